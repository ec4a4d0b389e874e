"""CheckpointStorageAccess: one job's view of its checkpoint storage, as the coordinator (driver)
and as the workers (executors) see it."""

import logging
import secrets
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable
from datetime import timedelta

from fsspec import AbstractFileSystem

from checkpoint_storage._appending import AppendingSegmentStreamFactory
from checkpoint_storage._discovery import CheckpointDirectory, discover_checkpoint_directories
from checkpoint_storage._file_merging import (
    FileMergingSnapshotManager,
    FsMergingCheckpointStreamFactory,
    SubtaskKey,
)
from checkpoint_storage._filesystems import (
    METADATA_FILE_NAME,
    EntropyInjector,
    PathRoots,
    canonical_url,
    check_pointer,
    join,
    normalize_pointer,
    parent_and_name,
    roots_for_directory,
    to_url,
    url_to_fs,
    verify_exclusive_create,
)
from checkpoint_storage._handles import FileStateHandle, StreamStateHandle
from checkpoint_storage._ids import JobID, checkpoint_directory_id, is_job_id
from checkpoint_storage._lease import DEFAULT_LEASE_TTL, JobLease
from checkpoint_storage._lease import acquire_job_lease as _acquire_job_lease
from checkpoint_storage._locations import (
    CheckpointStorageLocation,
    CompletedCheckpointStorageLocation,
    FileMetadataTarget,
    MemoryMetadataTarget,
    MetadataTarget,
)
from checkpoint_storage._metadata import unreadable
from checkpoint_storage._references import (
    CheckpointedStateScope,
    CheckpointStorageLocationReference,
    decode_path_from_reference,
    encode_path_as_reference,
)
from checkpoint_storage._streams import (
    CheckpointStateOutputStream,
    CheckpointStreamFactory,
    FsCheckpointStreamFactory,
    MemCheckpointStreamFactory,
)
from checkpoint_storage.exceptions import (
    CheckpointNotFoundError,
    InvalidCheckpointError,
    UnsafePathError,
)

__all__ = [
    "CheckpointStateToolset",
    "CheckpointStorageAccess",
    "CheckpointStorageCoordinatorView",
    "CheckpointStorageWorkerView",
]

logger = logging.getLogger("checkpoint_storage")

_SAVEPOINT_ATTEMPTS = 10


class CheckpointStorageCoordinatorView(ABC):
    """What the coordinator (e.g. the Spark driver) does with checkpoint storage."""

    @abstractmethod
    def supports_highly_available_storage(self) -> bool: ...

    @abstractmethod
    def has_default_savepoint_location(self) -> bool: ...

    @abstractmethod
    def initialize_base_locations(self) -> None:
        """Create the job's shared and task-owned directories, and verify (once per endpoint
        and process) that the filesystem's put-if-absent is exclusive
        (``UnsupportedFileSystemError`` when it is not)."""

    @abstractmethod
    def initialize_location_for_checkpoint(self, checkpoint_id: int) -> CheckpointStorageLocation:
        """Create ``chk-<id>`` and return its location (default reference)."""

    @abstractmethod
    def initialize_location_for_savepoint(
        self, checkpoint_id: int, external_location_pointer: str | None = None
    ) -> CheckpointStorageLocation:
        """Create a fresh ``savepoint-<job[:6]>-<12 hex>`` directory below the target (or the
        default savepoint directory) and return its location."""

    @abstractmethod
    def resolve_checkpoint(self, pointer: str) -> CompletedCheckpointStorageLocation: ...

    @abstractmethod
    def latest_completed_checkpoint(self) -> CompletedCheckpointStorageLocation | None:
        """The newest ``chk-<id>`` (by number) whose `_metadata` exists and validates."""


class CheckpointStorageWorkerView(ABC):
    """What workers (e.g. Spark executors) do with checkpoint storage. Nothing here creates or
    checks directories: the coordinator made them."""

    @abstractmethod
    def resolve_checkpoint_storage_location(
        self, checkpoint_id: int, reference: CheckpointStorageLocationReference
    ) -> CheckpointStreamFactory: ...

    @abstractmethod
    def create_task_owned_state_stream(self) -> CheckpointStateOutputStream: ...

    @abstractmethod
    def create_task_owned_checkpoint_state_toolset(self) -> "CheckpointStateToolset": ...

    def to_file_merging_storage(self, manager, *args, **kwargs) -> "CheckpointStorageWorkerView":
        """The view that merges small files; this one, while file merging is off."""
        return self

    def to_appending_storage(self, subtask_key, previous) -> "CheckpointStorageWorkerView":
        """The view whose SHARED-scope streams append to ``previous``'s physical file; this
        one, while file merging across checkpoints is off or cannot be done."""
        return self


class CheckpointStorageAccess(CheckpointStorageCoordinatorView, CheckpointStorageWorkerView):
    """Both views of one job's checkpoint storage."""

    job_id: JobID


class CheckpointStateToolset(ABC):
    """Copies state handles into task-owned storage (Flink's CheckpointStateToolset)."""

    @abstractmethod
    def can_fast_duplicate(self, handle: StreamStateHandle) -> bool: ...

    @abstractmethod
    def duplicate(self, handles: Iterable[StreamStateHandle]) -> list[StreamStateHandle]: ...


def _checkpoint_id(checkpoint_id: object) -> int:
    if checkpoint_id is None:
        raise TypeError("checkpoint id must not be None")
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int):
        raise TypeError(f"checkpoint id must be an int, got {type(checkpoint_id).__name__}")
    if not 0 <= checkpoint_id < 2**63:
        raise ValueError(f"checkpoint id must be non-negative, got {checkpoint_id}")
    return checkpoint_id


def resolve_checkpoint_pointer(
    pointer: str, storage_options: dict | None, entropy: EntropyInjector | None = None
) -> CompletedCheckpointStorageLocation:
    """A pointer (checkpoint dir, dir + '/', or its `_metadata`) to its completed location.

    Pointers follow ``normalize_pointer`` (``file:`` URLs, relative paths, no '.'/'..' inside),
    the same rule for the CLI and a run's ``restore_from``. Raises ``CheckpointNotFoundError``
    only when nothing is there (its message fits what is: a job directory, a file, ...), and
    ``UnreadableCheckpointError`` naming `_metadata` when it exists but is no readable file (a
    directory, FIFO or device, a symbolic link loop, no permission): nothing is ever opened
    but a regular file."""
    pointer = normalize_pointer(pointer)
    fs, path = url_to_fs(pointer, storage_options)
    directory, name = parent_and_name(path)
    if name == METADATA_FILE_NAME:
        metadata_path = path
    else:
        directory, metadata_path = path, join(path, METADATA_FILE_NAME)
    fs.invalidate_cache(directory)
    metadata_url = to_url(fs, metadata_path)
    try:
        info = fs.info(metadata_path)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise _missing_checkpoint(fs, pointer, directory) from exc
    except OSError as exc:  # a symbolic link loop, no permission to look: no verdict
        raise unreadable(metadata_url, exc) from exc
    return _completed_location(fs, directory, metadata_path, info, entropy)


def _completed_location(
    fs: AbstractFileSystem, directory: str, metadata_path: str, info: dict, entropy
) -> CompletedCheckpointStorageLocation:
    """The completed location whose `_metadata` has fsspec ``info``; ``UnreadableCheckpoint
    Error`` naming it when that is no regular file (never opened: a FIFO would block)."""
    kind = info.get("type")
    if kind != "file":
        what = (
            "a directory"
            if kind == "directory"
            else "not a regular file (a FIFO, socket or device?)"
        )
        raise unreadable(to_url(fs, metadata_path), OSError(f"it is {what}"))
    directory_url = to_url(fs, directory)
    handle = FileStateHandle(to_url(fs, metadata_path), int(info["size"]), filesystem=fs)
    return CompletedCheckpointStorageLocation(
        directory_url, handle, filesystem=fs, roots=roots_for_directory(directory_url, entropy)
    )


def _missing_checkpoint(fs: AbstractFileSystem, pointer: str, directory: str) -> Exception:
    """Why there is no `_metadata` at ``pointer``, in words that fit what is there."""
    try:
        kind = fs.info(directory).get("type")
    except (FileNotFoundError, NotADirectoryError):
        return CheckpointNotFoundError(
            f"no checkpoint at {pointer}: the path does not exist. Pass a completed checkpoint "
            "directory (…/<job_id>/chk-<id>), a savepoint directory, or its _metadata file"
        )
    if kind == "file":
        return CheckpointNotFoundError(
            f"{pointer} is a file, not a checkpoint: pass the checkpoint directory or its "
            "_metadata file"
        )
    try:
        names = {parent_and_name(entry)[1] for entry in fs.ls(directory, detail=False)}
    except OSError:
        names = set()
    if (
        any(checkpoint_directory_id(n) is not None for n in names)
        or {"shared", "taskowned"} & names
    ):
        return CheckpointNotFoundError(
            f"{pointer} is a job directory, not a checkpoint: pass one of its chk-<id> "
            f"directories, e.g. its latest completed one (`checkpoints latest {pointer}`, or "
            "latest_completed_checkpoint()); `checkpoints list` shows them all"
        )
    if any(is_job_id(n) for n in names):
        return CheckpointNotFoundError(
            f"{pointer} is a checkpoint base directory holding job directories, not a "
            f"checkpoint: `checkpoints list {pointer}` shows its checkpoints and savepoints"
        )
    return CheckpointNotFoundError(
        f"{pointer} has no _metadata: the checkpoint was never completed or was disposed. "
        "Pass a completed checkpoint (e.g. what latest_completed_checkpoint() returns)"
    )


class _DirectoryBasedAccess(CheckpointStorageAccess):
    """What both storages share (Flink's AbstractFsCheckpointStorageAccess): savepoint
    directories, pointer resolution, and discovery of the latest completed checkpoint."""

    def __init__(
        self,
        job_id: JobID | str,
        checkpoint_directory: str | None,
        default_savepoint_directory: str | None,
        storage_options: dict | None,
        entropy: EntropyInjector | None = None,
    ) -> None:
        self.job_id = JobID.of(job_id)
        self._job_directory = checkpoint_directory
        self._default_savepoint_directory = default_savepoint_directory
        self._storage_options = dict(storage_options or {})
        self._entropy = entropy
        self._fs_cache: AbstractFileSystem | None = None
        self._lease: JobLease | None = None
        self._highest_initialized = 0

    @property
    def checkpoints_directory(self) -> str | None:
        """``<checkpoint_dir>/<job_id>``: where ``chk-<id>`` directories are found."""
        return self._job_directory

    @property
    def _fs(self) -> AbstractFileSystem:
        if self._fs_cache is None:
            self._fs_cache = url_to_fs(self._job_directory, self._storage_options)[0]
        return self._fs_cache

    def _path(self, url: str) -> str:
        return self._fs._strip_protocol(url)

    def has_default_savepoint_location(self) -> bool:
        return self._default_savepoint_directory is not None

    @abstractmethod
    def _savepoint_streams(
        self, fs: AbstractFileSystem, directory: str
    ) -> CheckpointStreamFactory: ...

    def initialize_location_for_savepoint(
        self, checkpoint_id: int, external_location_pointer: str | None = None
    ) -> CheckpointStorageLocation:
        _checkpoint_id(checkpoint_id)
        if external_location_pointer is not None:
            base = canonical_url(check_pointer(external_location_pointer), self._storage_options)
        elif self._default_savepoint_directory is not None:
            base = self._default_savepoint_directory
        else:
            raise ValueError(
                "no savepoint location given and no default savepoint directory configured: "
                "pass a target directory or configure savepoint_dir"
            )
        fs, base_path = url_to_fs(base, self._storage_options)
        fs.makedirs(base_path, exist_ok=True)
        verify_exclusive_create(fs, base_path)
        prefix = f"savepoint-{self.job_id.hex[:6]}-"
        last_error: Exception | None = None
        for _ in range(_SAVEPOINT_ATTEMPTS):
            path = join(base_path, prefix + secrets.token_hex(6))
            try:
                fs.mkdir(path, create_parents=False)
            except FileExistsError as exc:
                last_error = exc
                continue
            directory = to_url(fs, path)
            return CheckpointStorageLocation(
                self._savepoint_streams(fs, directory),
                encode_path_as_reference(directory),
                FileMetadataTarget(fs, directory, PathRoots((directory,))),
            )
        raise OSError(f"could not create a new savepoint directory below {base}") from last_error

    def resolve_checkpoint(self, pointer: str) -> CompletedCheckpointStorageLocation:
        return resolve_checkpoint_pointer(pointer, self._storage_options, self._entropy)

    # --- discovery ---------------------------------------------------------------------

    def _checkpoint_directories(self) -> list[CheckpointDirectory]:
        """The job's ``chk-<id>`` directories, newest first (see ``_discovery``)."""
        if self._job_directory is None:
            return []
        return discover_checkpoint_directories(self._fs, self._path(self._job_directory))

    def _checkpoint_ids(self) -> list[int]:
        """The ids of the ``chk-<id>`` directories, newest first; [] if the job has none."""
        return [directory.checkpoint_id for directory in self._checkpoint_directories()]

    def _completed_in(
        self, directory: CheckpointDirectory
    ) -> CompletedCheckpointStorageLocation | None:
        """The completed location of a discovered directory (no request when the listing
        had its `_metadata`), None when it has no `_metadata`; ``UnreadableCheckpointError``
        when its `_metadata` cannot be looked at or is no regular file."""
        try:
            info = directory.metadata_info(self._fs)
        except OSError as exc:  # a symbolic link loop, no permission to look: no verdict
            raise unreadable(to_url(self._fs, directory.metadata_path), exc) from exc
        if info is None:
            return None
        return _completed_location(
            self._fs, directory.path, directory.metadata_path, info, self._entropy
        )

    def latest_completed_checkpoint(self) -> CompletedCheckpointStorageLocation | None:
        """The newest ``chk-<id>`` whose `_metadata` validates and holds checkpoint ``<id>``.
        Invalid, foreign and id-mismatched checkpoints are skipped with a warning; a `_metadata`
        that cannot be read raises ``UnreadableCheckpointError`` (never taken for "none")."""
        for directory in self._checkpoint_directories():
            completed = self._completed_in(directory)
            if completed is None:
                continue
            try:
                completed.load_metadata(directory.checkpoint_id)
            except CheckpointNotFoundError:
                continue
            except (InvalidCheckpointError, UnsafePathError) as exc:
                logger.warning(
                    "skipping invalid checkpoint %s: %s", completed.external_pointer, exc
                )
                continue
            return completed
        return None

    def next_checkpoint_id(self) -> int:
        """One above every ``chk-<id>`` directory listed in the job directory (completed or
        aborted) and every id this access initialized: a coordinator that takes the job over
        never reuses an id. (On object stores an aborted directory that holds no object is
        not seen; the put-if-absent of `_metadata` refuses a duplicate completion anyway.)"""
        listed = self._checkpoint_ids()
        return max(listed[0] if listed else 0, self._highest_initialized) + 1

    # --- the job lease -------------------------------------------------------------------

    @property
    def job_lease(self) -> JobLease | None:
        """The lease this access took with ``acquire_job_lease``, if any (it may have been
        released or lost since: see ``JobLease.valid``)."""
        return self._lease

    def acquire_job_lease(
        self,
        owner: str | None = None,
        *,
        ttl: timedelta | float = DEFAULT_LEASE_TTL,
        wait: float | None = None,
        auto_renew: bool = True,
        renew_interval: float | None = None,
    ) -> JobLease:
        """Take the job directory's lease: one coordinator per job (see ``JobLease``).

        ``owner`` names this coordinator in errors and ``checkpoints lease show`` (default
        ``<host>:<pid>``); ``ttl`` is how long the lease lives without renewal (a daemon
        thread renews it every ``renew_interval``, default ``ttl / 3``, unless
        ``auto_renew=False``); ``wait`` None fails at once with ``JobLeaseHeldError`` naming
        the holder, a number of seconds waits for it to be released or to expire.

        From then on every checkpoint location this access creates publishes `_metadata`
        only while the lease is current (checked right before the conditional PUT; else
        ``JobLeaseLostError``) and records the lease's epoch in it (``lease_epoch``). Use the
        lease as a context manager or call ``release()``; a released lease is not replaced
        until this method is called again.
        """
        if self._job_directory is None:
            raise ValueError("a job lease needs a checkpoint directory")
        job = self._path(self._job_directory)
        verify_exclusive_create(self._fs, job)
        if self._lease is not None and self._lease.valid:
            raise ValueError(f"this access already holds the job lease (epoch {self._lease.epoch})")
        self._lease = _acquire_job_lease(
            self._fs,
            job,
            owner,
            ttl=ttl,
            wait=wait,
            auto_renew=auto_renew,
            renew_interval=renew_interval,
        )
        return self._lease

    def _lease_for_new_location(self) -> JobLease | None:
        """The lease a new checkpoint location publishes under; fails early when it is no
        longer valid (no I/O)."""
        lease = self._lease
        if lease is not None and not lease.valid:
            raise lease._not_valid_error()
        return lease

    def _note_initialized(self, checkpoint_id: int) -> None:
        self._highest_initialized = max(self._highest_initialized, checkpoint_id)


class FsCheckpointStorageAccess(_DirectoryBasedAccess):
    """Checkpoint storage on a filesystem (Flink's FsCheckpointStorageAccess)."""

    def __init__(self, storage, job_id: JobID | str) -> None:
        job_id = JobID.of(job_id)
        entropy = storage.entropy_injector
        base = storage.checkpoint_directory if entropy is None else entropy.plain
        super().__init__(
            job_id,
            join(base, job_id.hex) if storage.create_checkpoint_subdir else base,
            storage.savepoint_directory,
            storage.storage_options,
            entropy,
        )
        self._storage = storage
        self._threshold = storage.file_state_size_threshold
        self._buffer_size = storage.write_buffer_size

    def __reduce__(self):
        return (FsCheckpointStorageAccess, (self._storage, self.job_id))

    @property
    def shared_state_directory(self) -> str:
        return join(self._job_directory, "shared")

    @property
    def task_owned_state_directory(self) -> str:
        return join(self._job_directory, "taskowned")

    def supports_highly_available_storage(self) -> bool:
        return True

    def initialize_base_locations(self) -> None:
        for directory in (self.shared_state_directory, self.task_owned_state_directory):
            self._fs.makedirs(self._path(directory), exist_ok=True)
        verify_exclusive_create(self._fs, self._path(self._job_directory))

    def _streams(self, exclusive_dir: str) -> FsCheckpointStreamFactory:
        return FsCheckpointStreamFactory(
            self._fs,
            exclusive_dir,
            self.shared_state_directory,
            self.task_owned_state_directory,
            threshold=self._threshold,
            buffer_size=self._buffer_size,
            entropy=self._entropy,
        )

    def initialize_location_for_checkpoint(self, checkpoint_id: int) -> CheckpointStorageLocation:
        directory = join(self._job_directory, f"chk-{_checkpoint_id(checkpoint_id)}")
        lease = self._lease_for_new_location()
        # Cached after initialize_base_locations(): no request here in the usual case.
        verify_exclusive_create(self._fs, self._path(self._job_directory))
        self._fs.makedirs(self._path(directory), exist_ok=True)
        self._note_initialized(checkpoint_id)
        target = FileMetadataTarget(
            self._fs, directory, roots_for_directory(directory, self._entropy), lease
        )
        return CheckpointStorageLocation(
            self._streams(directory), CheckpointStorageLocationReference.get_default(), target
        )

    def _savepoint_streams(self, fs: AbstractFileSystem, directory: str) -> CheckpointStreamFactory:
        # Every scope lands in the savepoint's own directory, recorded relative to it.
        return FsCheckpointStreamFactory(
            fs,
            directory,
            directory,
            directory,
            threshold=self._threshold,
            buffer_size=self._buffer_size,
            self_contained=True,
        )

    def resolve_checkpoint_storage_location(
        self, checkpoint_id: int, reference: CheckpointStorageLocationReference
    ) -> CheckpointStreamFactory:
        if reference is None:
            raise TypeError("reference must not be None")
        if reference.is_default_reference():
            return self._streams(join(self._job_directory, f"chk-{_checkpoint_id(checkpoint_id)}"))
        pointer = check_pointer(decode_path_from_reference(reference))
        fs, path = url_to_fs(pointer, self._storage_options)
        return self._savepoint_streams(fs, to_url(fs, path))

    def create_task_owned_state_stream(self) -> CheckpointStateOutputStream:
        return self._streams(self.task_owned_state_directory).create_task_owned_state_stream()

    def create_task_owned_checkpoint_state_toolset(self) -> CheckpointStateToolset:
        return FsCheckpointStateToolset(self._fs, self.task_owned_state_directory)

    def to_file_merging_storage(
        self, manager: FileMergingSnapshotManager, subtask_key: SubtaskKey
    ) -> CheckpointStorageWorkerView:
        """The access of ``subtask_key`` whose checkpoint streams merge into physical files
        of ``manager``, when the storage enables file merging; else this access."""
        if not self._storage.file_merging_enabled:
            return self
        if manager is None or subtask_key is None:
            raise TypeError("manager and subtask_key must not be None")
        if subtask_key.job_id != self.job_id.hex:
            raise ValueError(f"{subtask_key} is not a subtask of job {self.job_id.hex}")
        manager.init_file_system(
            self._fs,
            self._job_directory,
            self.shared_state_directory,
            self.task_owned_state_directory,
            self._buffer_size,
            self._threshold,
        )
        manager.register_subtask_for_shared_states(subtask_key)
        return FsMergingCheckpointStorageAccess(self._storage, self.job_id, manager, subtask_key)

    def to_appending_storage(
        self, subtask_key: SubtaskKey, previous: StreamStateHandle | None
    ) -> CheckpointStorageWorkerView:
        """The access of ``subtask_key`` for a writer that lives one checkpoint (e.g. a Spark
        task): its SHARED-scope streams append segments to the physical file of ``previous``
        (the subtask's last segment, in the checkpoint it starts from or written since) or to
        a new one in the subtask's managed directory (``AppendingSegmentStreamFactory``).
        This access unless the storage enables file merging across checkpoint boundaries and
        its filesystem appends in place (local disk): on object stores one file per stream."""
        storage = self._storage
        if not storage.resumes_physical_files:
            return self
        if subtask_key is None:
            raise TypeError("subtask_key must not be None")
        if subtask_key.job_id != self.job_id.hex:
            raise ValueError(f"{subtask_key} is not a subtask of job {self.job_id.hex}")
        return FsAppendingCheckpointStorageAccess(storage, self.job_id, subtask_key, previous)


class FsAppendingCheckpointStorageAccess(FsCheckpointStorageAccess):
    """A subtask's access whose checkpoint streams append to a resumed physical file;
    savepoints never merge."""

    def __init__(self, storage, job_id, subtask_key: SubtaskKey, previous) -> None:
        super().__init__(storage, job_id)
        self.subtask_key = subtask_key
        self.previous = previous

    def __reduce__(self):
        raise TypeError(
            "an appending access belongs to its writer: ship the storage and call "
            "to_appending_storage() where the state is written"
        )

    def to_appending_storage(self, subtask_key, previous) -> CheckpointStorageWorkerView:
        return FsCheckpointStorageAccess(self._storage, self.job_id).to_appending_storage(
            subtask_key, previous
        )

    def resolve_checkpoint_storage_location(
        self, checkpoint_id: int, reference: CheckpointStorageLocationReference
    ) -> CheckpointStreamFactory:
        plain = super().resolve_checkpoint_storage_location(checkpoint_id, reference)
        if not reference.is_default_reference():
            return plain
        return AppendingSegmentStreamFactory(
            plain,
            self._fs,
            join(self.shared_state_directory, self.subtask_key.managed_dir_name),
            self.previous,
            self._storage.file_merging_max_file_size,
            self._buffer_size,
            self._threshold,
        )


class FsMergingCheckpointStorageAccess(FsCheckpointStorageAccess):
    """A subtask's access with file merging (Flink's FsMergingCheckpointStorageAccess):
    checkpoint streams write segments through the manager; savepoints never merge."""

    def __init__(self, storage, job_id, manager, subtask_key) -> None:
        super().__init__(storage, job_id)
        self.file_merging_snapshot_manager = manager
        self.subtask_key = subtask_key

    def __reduce__(self):
        raise TypeError(
            "a file merging access belongs to its worker process: ship the storage and call "
            "to_file_merging_storage() on the worker"
        )

    def to_file_merging_storage(self, manager, subtask_key) -> CheckpointStorageWorkerView:
        if manager is self.file_merging_snapshot_manager and subtask_key == self.subtask_key:
            return self
        return FsCheckpointStorageAccess(self._storage, self.job_id).to_file_merging_storage(
            manager, subtask_key
        )

    def resolve_checkpoint_storage_location(
        self, checkpoint_id: int, reference: CheckpointStorageLocationReference
    ) -> CheckpointStreamFactory:
        if reference is None:
            raise TypeError("reference must not be None")
        if not reference.is_default_reference():
            return super().resolve_checkpoint_storage_location(checkpoint_id, reference)
        return FsMergingCheckpointStreamFactory(
            self.file_merging_snapshot_manager, self.subtask_key, _checkpoint_id(checkpoint_id)
        )


class FsCheckpointStateToolset(CheckpointStateToolset):
    """Duplicates file handles into the task-owned directory, server-side where the
    filesystem can copy; inline handles need no copy."""

    def __init__(self, fs: AbstractFileSystem, directory: str) -> None:
        self._fs = fs
        self._directory = directory

    def can_fast_duplicate(self, handle: StreamStateHandle) -> bool:
        return isinstance(handle, FileStateHandle) and handle.filesystem is self._fs

    def duplicate(self, handles: Iterable[StreamStateHandle]) -> list[StreamStateHandle]:
        return [self._duplicate(handle) for handle in handles]

    def _duplicate(self, handle: StreamStateHandle) -> StreamStateHandle:
        if not isinstance(handle, FileStateHandle):
            return handle
        target = join(self._directory, uuid.uuid4().hex)
        target_path = self._fs._strip_protocol(target)
        if self.can_fast_duplicate(handle):
            self._fs.copy(self._fs._strip_protocol(handle.path), target_path)
        else:
            with handle.open() as source, self._fs.open(target_path, "wb") as out:
                while chunk := source.read(1 << 20):
                    out.write(chunk)
        return FileStateHandle(target, handle.state_size, handle.checksum, filesystem=self._fs)


class MemoryCheckpointStorageAccess(_DirectoryBasedAccess):
    """State kept inline (Flink's MemoryBackendCheckpointStorageAccess): `_metadata` goes to
    ``chk-<id>/`` when a checkpoint directory is configured, else stays in this process."""

    def __init__(self, storage, job_id: JobID | str) -> None:
        job_id = JobID.of(job_id)
        directory = storage.checkpoint_directory
        super().__init__(
            job_id,
            None if directory is None else join(directory, job_id.hex),
            storage.savepoint_directory,
            storage.storage_options,
        )
        self._max_state_size = storage.max_state_size
        self._in_memory: dict[int, CompletedCheckpointStorageLocation] = {}
        self._lock = threading.Lock()

    shared_state_directory = None
    task_owned_state_directory = None

    def supports_highly_available_storage(self) -> bool:
        return self._job_directory is not None

    def initialize_base_locations(self) -> None:
        if self._job_directory is not None:
            self._fs.makedirs(self._path(self._job_directory), exist_ok=True)
            verify_exclusive_create(self._fs, self._path(self._job_directory))

    def _memory_streams(self) -> MemCheckpointStreamFactory:
        return MemCheckpointStreamFactory(self._max_state_size)

    def initialize_location_for_checkpoint(self, checkpoint_id: int) -> CheckpointStorageLocation:
        checkpoint_id = _checkpoint_id(checkpoint_id)
        target: MetadataTarget
        if self._job_directory is None:
            target = MemoryMetadataTarget(self._in_memory, checkpoint_id)
        else:
            directory = join(self._job_directory, f"chk-{checkpoint_id}")
            lease = self._lease_for_new_location()
            verify_exclusive_create(self._fs, self._path(self._job_directory))
            self._fs.makedirs(self._path(directory), exist_ok=True)
            self._note_initialized(checkpoint_id)
            target = FileMetadataTarget(self._fs, directory, roots_for_directory(directory), lease)
        return CheckpointStorageLocation(
            self._memory_streams(), CheckpointStorageLocationReference.get_default(), target
        )

    def _savepoint_streams(self, fs: AbstractFileSystem, directory: str) -> CheckpointStreamFactory:
        return self._memory_streams()

    def resolve_checkpoint_storage_location(
        self, checkpoint_id: int, reference: CheckpointStorageLocationReference
    ) -> CheckpointStreamFactory:
        if reference is None:
            raise TypeError("reference must not be None")
        return self._memory_streams()

    def create_task_owned_state_stream(self) -> CheckpointStateOutputStream:
        return self._memory_streams().create_checkpoint_state_output_stream(
            CheckpointedStateScope.EXCLUSIVE
        )

    def create_task_owned_checkpoint_state_toolset(self) -> CheckpointStateToolset:
        return _InlineStateToolset()

    def latest_completed_checkpoint(self) -> CompletedCheckpointStorageLocation | None:
        if self._job_directory is not None:
            return super().latest_completed_checkpoint()
        with self._lock:
            return self._in_memory[max(self._in_memory)] if self._in_memory else None


class _InlineStateToolset(CheckpointStateToolset):
    """Inline state needs no copy: duplicates are the handles themselves."""

    def can_fast_duplicate(self, handle: StreamStateHandle) -> bool:
        return False

    def duplicate(self, handles: Iterable[StreamStateHandle]) -> list[StreamStateHandle]:
        return list(handles)
