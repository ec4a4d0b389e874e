"""CheckpointStorage: the configuration a job's checkpoint storage is created from.

Both storages are small picklable value objects: they are shipped to Spark executors, which
call ``create_checkpoint_storage(job_id)`` there. They hold configuration, never open
filesystems.
"""

import copy
import os
import socket
from abc import ABC, abstractmethod

from fsspec.core import split_protocol

from checkpoint_storage._access import (
    CheckpointStorageAccess,
    FsCheckpointStorageAccess,
    MemoryCheckpointStorageAccess,
    resolve_checkpoint_pointer,
)
from checkpoint_storage._appending import appends_in_place
from checkpoint_storage._file_merging import (
    DEFAULT_MAX_FILE_SIZE,
    DEFAULT_MAX_SPACE_AMPLIFICATION,
    FileMergingSnapshotManager,
    FileMergingType,
    PhysicalFilePoolType,
    manager_for_job,
)
from checkpoint_storage._filesystems import (
    EntropyInjector,
    canonical_url,
    options_with_environment,
    url_to_fs,
)
from checkpoint_storage._ids import JobID
from checkpoint_storage._locations import CompletedCheckpointStorageLocation

__all__ = ["CheckpointStorage", "FileSystemCheckpointStorage", "MemoryCheckpointStorage"]

MAX_FILE_STATE_THRESHOLD = 1024 * 1024
DEFAULT_FILE_STATE_THRESHOLD = 20 * 1024
"""Streams of at most this many bytes become inline ``ByteStreamStateHandle``s (no file);
Flink's ``state.storage.fs.memory-threshold``. At most ``MAX_FILE_STATE_THRESHOLD`` (1 MiB)."""
DEFAULT_WRITE_BUFFER_SIZE = 4096
"""Bytes a state stream buffers before it writes to its file (Flink's
``state.storage.fs.write-buffer-size``)."""
DEFAULT_MAX_MEMORY_STATE_SIZE = 5 * 1024 * 1024


class CheckpointStorage(ABC):
    """Creates each job's storage access and resolves checkpoint pointers.

    What a storage can do is declared here, with the defaults of a storage that cannot, so
    that callers read it instead of probing with ``getattr``/``hasattr``:

    - ``storage_options``: the fsspec options its files are read with (default: none);
    - ``savepoint_directory``: where savepoints go by default (None: no default location);
    - ``file_merging_enabled``: whether writers may pack several states into one physical
      file (Flink's file merging; default False);
    - ``resumes_physical_files``: whether a writer that lives for one checkpoint (a Spark
      task) appends its SHARED state to the physical file its subtask wrote last (default
      False)."""

    savepoint_directory: str | None = None
    file_merging_enabled: bool = False

    @property
    def storage_options(self) -> dict:
        """The fsspec options this storage's files are read with."""
        return {}

    @property
    def resumes_physical_files(self) -> bool:
        """Whether one-checkpoint writers append SHARED state to their subtask's last file."""
        return False

    @abstractmethod
    def create_checkpoint_storage(self, job_id: JobID | str) -> CheckpointStorageAccess: ...

    @abstractmethod
    def resolve_checkpoint(self, pointer: str) -> CompletedCheckpointStorageLocation: ...


def _optional_directory(url: str | None, storage_options: dict | None) -> str | None:
    return None if url is None else canonical_url(url, storage_options)


class FileSystemCheckpointStorage(CheckpointStorage):
    """Checkpoints in a directory of any fsspec filesystem (Flink's
    FileSystemCheckpointStorage): state files above ``file_state_size_threshold`` bytes,
    inline state below it.

    With ``file_merging_enabled`` (off by default, as in Flink), workers that call
    ``to_file_merging_storage(manager, subtask_key)`` pack their state files into few physical
    files (see ``FileMergingSnapshotManager``); savepoints never merge.

    ``storage_options`` are passed to fsspec (e.g. ``endpoint_url``). This object travels to
    executors, so credentials never go in there: name them in ``storage_options_from_env``
    (fsspec option -> environment variable), which each process reads from its own environment
    when it opens the filesystem.
    """

    def __init__(
        self,
        checkpoint_dir: str,
        savepoint_dir: str | None = None,
        *,
        file_state_size_threshold: int = DEFAULT_FILE_STATE_THRESHOLD,
        write_buffer_size: int = DEFAULT_WRITE_BUFFER_SIZE,
        create_checkpoint_subdir: bool = True,
        storage_options: dict | None = None,
        storage_options_from_env: dict[str, str] | None = None,
        entropy_injection_key: str | None = None,
        entropy_length: int = 4,
        file_merging_enabled: bool = False,
        file_merging_across_checkpoint_boundary: bool = False,
        file_merging_max_file_size: int = DEFAULT_MAX_FILE_SIZE,
        file_merging_pool_blocking: bool = False,
        file_merging_max_space_amplification: float = DEFAULT_MAX_SPACE_AMPLIFICATION,
    ) -> None:
        if checkpoint_dir is None:
            raise TypeError("checkpoint_dir must not be None")
        if not isinstance(file_state_size_threshold, int) or not (
            0 <= file_state_size_threshold <= MAX_FILE_STATE_THRESHOLD
        ):
            raise ValueError(
                "file_state_size_threshold must be between 0 and "
                f"{MAX_FILE_STATE_THRESHOLD} bytes, got {file_state_size_threshold!r}"
            )
        if not isinstance(write_buffer_size, int) or write_buffer_size < 0:
            raise ValueError(f"write_buffer_size must be >= 0, got {write_buffer_size!r}")
        self._static_options = dict(storage_options or {})
        self.storage_options_from_env = dict(storage_options_from_env or {})
        both = sorted(set(self._static_options) & set(self.storage_options_from_env))
        if both:
            raise ValueError(f"storage options {both} are given both directly and from env")
        self.checkpoint_directory = canonical_url(checkpoint_dir, self.storage_options)
        self.savepoint_directory = _optional_directory(savepoint_dir, self.storage_options)
        self.file_state_size_threshold = file_state_size_threshold
        self.write_buffer_size = max(write_buffer_size, file_state_size_threshold)
        self.create_checkpoint_subdir = bool(create_checkpoint_subdir)
        if entropy_injection_key is not None:
            if (
                not isinstance(entropy_injection_key, str)
                or not entropy_injection_key.strip("/")
                or "/" in entropy_injection_key
            ):
                raise ValueError(
                    f"entropy_injection_key must be a path segment, got {entropy_injection_key!r}"
                )
            if not isinstance(entropy_length, int) or entropy_length < 1:
                raise ValueError(f"entropy_length must be >= 1, got {entropy_length!r}")
            if entropy_injection_key in checkpoint_dir and split_protocol(checkpoint_dir)[0] in (
                None,
                "file",
                "local",
            ):
                raise ValueError(
                    "entropy injection spreads keys over object-store prefixes; local "
                    "directories do not need it: remove entropy_injection_key"
                )
        self.entropy_injection_key = entropy_injection_key
        self.entropy_length = entropy_length
        if isinstance(file_merging_max_file_size, bool) or not (
            isinstance(file_merging_max_file_size, int) and file_merging_max_file_size >= 1
        ):
            raise ValueError(
                f"file_merging_max_file_size must be >= 1, got {file_merging_max_file_size!r}"
            )
        amplification = file_merging_max_space_amplification
        if (
            isinstance(amplification, bool)
            or not isinstance(amplification, int | float)
            or amplification != amplification  # NaN
        ):
            raise ValueError(
                f"file_merging_max_space_amplification must be a number, got {amplification!r}"
            )
        self.file_merging_enabled = bool(file_merging_enabled)
        self.file_merging_across_checkpoint_boundary = bool(file_merging_across_checkpoint_boundary)
        self.file_merging_max_file_size = file_merging_max_file_size
        self.file_merging_pool_blocking = bool(file_merging_pool_blocking)
        self.file_merging_max_space_amplification = float(amplification)

    @property
    def storage_options(self) -> dict:
        """The fsspec options, with those named in ``storage_options_from_env`` read from this
        process's environment now."""
        return options_with_environment(
            self._static_options, self.storage_options_from_env, "checkpoints"
        )

    @property
    def entropy_injector(self) -> EntropyInjector | None:
        """Injects entropy into data file paths, when the key is in the checkpoint directory."""
        key = self.entropy_injection_key
        if key and key in self.checkpoint_directory:
            return EntropyInjector(key, self.entropy_length, self.checkpoint_directory)
        return None

    def create_checkpoint_storage(self, job_id: JobID | str) -> CheckpointStorageAccess:
        return FsCheckpointStorageAccess(self, job_id)

    @property
    def resumes_physical_files(self) -> bool:
        """Whether a writer that lives for one checkpoint (a Spark task) appends its SHARED
        state to the physical file its subtask wrote last (``to_appending_storage``): file
        merging across checkpoint boundaries, on a filesystem that appends in place."""
        return (
            self.file_merging_enabled
            and self.file_merging_across_checkpoint_boundary
            and appends_in_place(url_to_fs(self.checkpoint_directory, self.storage_options)[0])
        )

    def with_file_state_size_threshold(self, threshold: int) -> "FileSystemCheckpointStorage":
        """This storage with a lower inline threshold (0: every state to a file), for a
        writer whose inline states would add up: e.g. a chain of change files, each
        repeated in every later ``_metadata`` until a snapshot supersedes it."""
        if not isinstance(threshold, int) or not 0 <= threshold <= self.file_state_size_threshold:
            raise ValueError(f"threshold must be between 0 and this storage's "
                             f"{self.file_state_size_threshold}, got {threshold!r}")
        lower = copy.copy(self)
        lower.file_state_size_threshold = threshold
        return lower

    def file_merging_snapshot_manager(
        self, job_id: JobID | str, worker_id: str | None = None
    ) -> FileMergingSnapshotManager:
        """This process's file merging manager of the job, configured by the
        ``file_merging_*`` options (one per job per worker process; created on first use).
        ``worker_id`` names its ``taskowned/<worker id>/`` directory (default: host and pid)."""
        job = JobID.of(job_id).hex
        if worker_id is None:
            worker_id = f"{socket.gethostname()}-{os.getpid()}"
        return manager_for_job(
            job,
            f"job_{job}_worker_{worker_id}",
            merging_type=(
                FileMergingType.ACROSS_CHECKPOINTS
                if self.file_merging_across_checkpoint_boundary
                else FileMergingType.WITHIN_CHECKPOINT
            ),
            max_file_size=self.file_merging_max_file_size,
            pool_type=(
                PhysicalFilePoolType.BLOCKING
                if self.file_merging_pool_blocking
                else PhysicalFilePoolType.NON_BLOCKING
            ),
            max_space_amplification=self.file_merging_max_space_amplification,
        )

    def resolve_checkpoint(self, pointer: str) -> CompletedCheckpointStorageLocation:
        return resolve_checkpoint_pointer(pointer, self.storage_options, self.entropy_injector)

    def _key(self) -> tuple:
        return (
            self.checkpoint_directory,
            self.savepoint_directory,
            self.file_state_size_threshold,
            self.write_buffer_size,
            self.create_checkpoint_subdir,
            sorted(self._static_options.items()),
            sorted(self.storage_options_from_env.items()),
            self.entropy_injection_key,
            self.entropy_length,
            self.file_merging_enabled,
            self.file_merging_across_checkpoint_boundary,
            self.file_merging_max_file_size,
            self.file_merging_pool_blocking,
            self.file_merging_max_space_amplification,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FileSystemCheckpointStorage):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self.checkpoint_directory)

    def __repr__(self) -> str:
        # Option values may hold endpoints or tokens: names only.
        return (
            f"FileSystemCheckpointStorage(checkpoint_dir={self.checkpoint_directory!r}, "
            f"savepoint_dir={self.savepoint_directory!r}, "
            f"file_state_size_threshold={self.file_state_size_threshold}, "
            f"storage_options=<{', '.join(sorted(self._static_options))}>, "
            f"storage_options_from_env={self.storage_options_from_env!r})"
        )


class MemoryCheckpointStorage(CheckpointStorage):
    """Flink's JobManagerCheckpointStorage: all state inline, at most ``max_state_size`` bytes
    per state. With ``checkpoint_dir``, `_metadata` is persisted to ``chk-<id>/``; without it,
    completed checkpoints live in the access object of this process only."""

    def __init__(
        self,
        checkpoint_dir: str | None = None,
        savepoint_dir: str | None = None,
        *,
        max_state_size: int = DEFAULT_MAX_MEMORY_STATE_SIZE,
        storage_options: dict | None = None,
    ) -> None:
        if not isinstance(max_state_size, int) or max_state_size <= 0:
            raise ValueError(f"max_state_size must be > 0, got {max_state_size!r}")
        self._storage_options = dict(storage_options or {})
        self.checkpoint_directory = _optional_directory(checkpoint_dir, self.storage_options)
        self.savepoint_directory = _optional_directory(savepoint_dir, self.storage_options)
        self.max_state_size = max_state_size

    @property
    def storage_options(self) -> dict:
        return self._storage_options

    def create_checkpoint_storage(self, job_id: JobID | str) -> CheckpointStorageAccess:
        return MemoryCheckpointStorageAccess(self, job_id)

    def resolve_checkpoint(self, pointer: str) -> CompletedCheckpointStorageLocation:
        return resolve_checkpoint_pointer(pointer, self.storage_options)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MemoryCheckpointStorage):
            return NotImplemented
        return (self.checkpoint_directory, self.savepoint_directory, self.max_state_size) == (
            other.checkpoint_directory,
            other.savepoint_directory,
            other.max_state_size,
        )

    def __hash__(self) -> int:
        return hash((self.checkpoint_directory, self.max_state_size))

    def __repr__(self) -> str:
        return (
            f"MemoryCheckpointStorage(checkpoint_dir={self.checkpoint_directory!r}, "
            f"savepoint_dir={self.savepoint_directory!r}, max_state_size={self.max_state_size})"
        )
