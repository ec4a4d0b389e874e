"""File merging (Flink FLIP-306): many small states of a worker packed into few physical files.

One ``FileMergingSnapshotManager`` per job per worker process hands out merging state streams.
A stream writes its bytes as a segment (a *logical file*) of a *physical file* taken from a
pool; its handle is a ``SegmentFileStateHandle``. Physical files live in managed directories:
``shared/<operator>_<subtask>_<parallelism>_/`` per subtask (SHARED scope) and
``taskowned/<worker id>/`` per worker (EXCLUSIVE scope, shared by the worker's subtasks).
The physical and logical files and the pools that hand them out are in ``_physical_files``.

- A physical file is handed to one writer at a time; it returns to its pool until it reaches
  the maximum file size. WITHIN_CHECKPOINT mode keeps one pool per checkpoint (a file never
  spans two checkpoints); ACROSS_CHECKPOINTS mode keeps appending to a file until it is full.
- Physical files are reference counted by their logical files; a file is deleted once it is
  closed and no logical file references it, and only when this manager created it (files
  restored from elsewhere are never deleted).
- A logical file records the last checkpoint that used it: a segment reused by a later
  checkpoint survives the subsumption of older ones. Abort and subsumption notifications
  discard the subtask's logical files; a checkpoint is released once every registered subtask
  has reported.
- Space amplification (bytes of physical files / live segment bytes) is kept below a bound by
  retiring the most wasteful closed files: ``could_reuse_previous_state_handle`` then answers
  False for their segments, so the next checkpoint rewrites them elsewhere.

Visibility: on local disk a segment is readable as soon as its stream commits (the physical
file is flushed after each segment). On object stores (and fsspec's memory filesystem) bytes
become visible only when the physical file is closed: call ``sync_checkpoint(checkpoint_id)``
after the worker's streams of that checkpoint committed and before the coordinator publishes
its `_metadata`. This closes the files holding its segments, so on object stores
ACROSS_CHECKPOINTS behaves like WITHIN_CHECKPOINT (objects cannot be appended to).
"""

import contextlib
import enum
import logging
import re
import threading
import uuid
from dataclasses import dataclass

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from checkpoint_storage._filesystems import join
from checkpoint_storage._handles import (
    SegmentFileStateHandle,
    StreamStateHandle,
)
from checkpoint_storage._physical_files import (
    BlockingPhysicalFilePool,
    LogicalFile,
    NonBlockingPhysicalFilePool,
    PhysicalFile,
    _PhysicalFilePool,
)
from checkpoint_storage._references import CheckpointedStateScope
from checkpoint_storage._streams import (
    CheckpointStateOutputStream,
    CheckpointStreamFactory,
    SegmentStateOutputStream,
    check_name_prefix,
)
from checkpoint_storage.exceptions import StorageConfigurationError

__all__ = [
    "FileMergingSnapshotManager",
    "FileMergingType",
    "PhysicalFilePoolType",
    "SpaceStat",
    "SubtaskKey",
    "create_file_merging_snapshot_manager",
]

logger = logging.getLogger("checkpoint_storage")

DEFAULT_MAX_FILE_SIZE = 32 * 1024 * 1024
"""A physical file takes no more segments once it is this large (Flink's
``execution.checkpointing.file-merging.max-file-size``)."""
DEFAULT_MAX_SPACE_AMPLIFICATION = 2.0
_UNSAFE_NAME = re.compile(r"[^a-zA-Z0-9\-]")


class FileMergingType(enum.Enum):
    """Whether a physical file may hold segments of more than one checkpoint."""

    WITHIN_CHECKPOINT = "MERGE_WITHIN_CHECKPOINT"
    ACROSS_CHECKPOINTS = "MERGE_ACROSS_CHECKPOINT"


class PhysicalFilePoolType(enum.Enum):
    """NON_BLOCKING creates a new file when none is free; BLOCKING waits for one."""

    NON_BLOCKING = "NON_BLOCKING"
    BLOCKING = "BLOCKING"


def _sanitize(name: str) -> str:
    return _UNSAFE_NAME.sub("_", name)


@dataclass(frozen=True)
class SubtaskKey:
    """One subtask of one operator of one job (Flink's FileMergingSnapshotManager.SubtaskKey)."""

    job_id: str
    operator_id: str
    subtask_index: int
    parallelism: int

    def __post_init__(self) -> None:
        for name in ("job_id", "operator_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty str, got {value!r}")
        if not isinstance(self.parallelism, int) or self.parallelism < 1:
            raise ValueError(f"parallelism must be an int >= 1, got {self.parallelism!r}")
        if (
            not isinstance(self.subtask_index, int)
            or not 0 <= self.subtask_index < self.parallelism
        ):
            raise ValueError(
                f"subtask_index must be in [0, {self.parallelism}), got {self.subtask_index!r}"
            )

    @property
    def managed_dir_name(self) -> str:
        """``<operator>_<subtask>_<parallelism>_`` with anything but letters, digits and '-'
        replaced by '_' (as Flink names it)."""
        return _sanitize(f"{self.operator_id}_{self.subtask_index}_{self.parallelism}_")


@dataclass
class SpaceStat:
    """Bytes and counts of the physical and logical files this manager owns."""

    physical_file_count: int = 0
    physical_file_size: int = 0
    logical_file_count: int = 0
    logical_file_size: int = 0

    @property
    def space_amplification(self) -> float:
        if self.logical_file_size == 0:
            return 1.0 if self.physical_file_size == 0 else float("inf")
        return self.physical_file_size / self.logical_file_size


# --- the manager -------------------------------------------------------------------------

_GHOST_CHECKPOINT_IDS = 16


class FileMergingSnapshotManager:
    """Hands out merging state streams and owns the physical files behind their segments
    (Flink's FileMergingSnapshotManagerBase; see the module docstring).

    Create it with ``create_file_merging_snapshot_manager`` or through
    ``FileSystemCheckpointStorage.file_merging_snapshot_manager``; it is initialised by the
    first ``to_file_merging_storage(manager, subtask_key)``.
    """

    def __init__(
        self,
        worker_id: str,
        *,
        merging_type: FileMergingType = FileMergingType.WITHIN_CHECKPOINT,
        max_file_size: int = DEFAULT_MAX_FILE_SIZE,
        pool_type: PhysicalFilePoolType = PhysicalFilePoolType.NON_BLOCKING,
        max_space_amplification: float = DEFAULT_MAX_SPACE_AMPLIFICATION,
    ) -> None:
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id must be a non-empty str, got {worker_id!r}")
        if not isinstance(merging_type, FileMergingType):
            raise TypeError(f"merging_type must be a FileMergingType, got {merging_type!r}")
        if not isinstance(pool_type, PhysicalFilePoolType):
            raise TypeError(f"pool_type must be a PhysicalFilePoolType, got {pool_type!r}")
        if (
            isinstance(max_file_size, bool)
            or not isinstance(max_file_size, int)
            or max_file_size < 1
        ):
            raise ValueError(f"max_file_size must be an int >= 1, got {max_file_size!r}")
        if not isinstance(max_space_amplification, int | float) or max_space_amplification != (
            max_space_amplification
        ):
            raise ValueError(
                f"max_space_amplification must be a number, got {max_space_amplification!r}"
            )
        self.id = _sanitize(worker_id)
        self.merging_type = merging_type
        self.max_file_size = max_file_size
        self.pool_type = pool_type
        self.max_space_amplification = float(max_space_amplification)
        self._lock = threading.RLock()
        self._uploaded_states: dict[int, set[LogicalFile]] = {}
        self._known_logical_files: dict[str, LogicalFile] = {}
        self._owned_files: set[PhysicalFile] = set()
        self._fs: AbstractFileSystem | None = None
        self._directories: tuple[str, str, str] | None = None
        self._managed_shared: dict[SubtaskKey, str] = {}
        self._managed_exclusive: str | None = None
        self._write_buffer_size = 4096
        self._threshold = 0
        self._visible_on_flush = False
        self._notified_subtasks: dict[int, set[SubtaskKey]] = {}
        self._released: list[int] = []
        self._in_flight: dict[int, int] = {}
        self._idle = threading.Condition(self._lock)
        self._pools: dict[int, _PhysicalFilePool] = {}  # WITHIN: per checkpoint; ACROSS: key 0
        self.files_created = 0

    # -- set-up ----------------------------------------------------------------------------

    def init_file_system(
        self,
        fs: AbstractFileSystem,
        checkpoint_base_dir: str,
        shared_state_dir: str,
        task_owned_state_dir: str,
        write_buffer_size: int,
        file_state_size_threshold: int = 0,
    ) -> None:
        """Set the job's directories once; later calls must name the same directories."""
        directories = (checkpoint_base_dir, shared_state_dir, task_owned_state_dir)
        with self._lock:
            if self._directories is not None:
                if directories != self._directories:
                    raise StorageConfigurationError(
                        f"file merging manager {self.id!r} was initialised with the directories "
                        f"{list(self._directories)}, not {list(directories)}: one manager "
                        "serves one job's checkpoint directory"
                    )
                return
            self._fs = fs
            self._directories = directories
            self._visible_on_flush = isinstance(fs, LocalFileSystem)
            self._managed_exclusive = join(task_owned_state_dir, self.id)
            self._create_managed_directory(self._managed_exclusive)
            self._write_buffer_size = max(write_buffer_size, file_state_size_threshold, 1)
            self._threshold = file_state_size_threshold

    def _create_managed_directory(self, url: str) -> None:
        # Object stores have no directories: nothing to create, no request issued.
        if isinstance(self._fs, LocalFileSystem):
            self._fs.makedirs(self._fs._strip_protocol(url), exist_ok=True)

    def register_subtask_for_shared_states(self, subtask_key: SubtaskKey) -> None:
        with self._lock:
            if self._directories is None:
                raise ValueError("init_file_system() must be called before registering subtasks")
            if subtask_key not in self._managed_shared:
                url = join(self._directories[1], subtask_key.managed_dir_name)
                self._create_managed_directory(url)
                self._managed_shared[subtask_key] = url

    def unregister_subtask(self, subtask_key: SubtaskKey) -> None:
        with self._lock:
            self._managed_shared.pop(subtask_key, None)

    def get_managed_dir(self, subtask_key: SubtaskKey, scope: CheckpointedStateScope) -> str | None:
        if scope is CheckpointedStateScope.SHARED:
            return self._managed_shared.get(subtask_key)
        return self._managed_exclusive

    @property
    def segments_visible_on_flush(self) -> bool:
        """Whether a committed segment is readable at once (local disk), or only once its
        physical file is closed by ``sync_checkpoint`` (object stores, memory)."""
        return self._visible_on_flush

    # -- physical and logical files --------------------------------------------------------

    def _create_physical_file(
        self, subtask_key: SubtaskKey, scope: CheckpointedStateScope
    ) -> PhysicalFile:
        directory = self.get_managed_dir(subtask_key, scope)
        if directory is None:
            raise ValueError(
                f"no {scope.value} directory for {subtask_key}: register the subtask first"
            )
        url = join(directory, uuid.uuid4().hex)
        out = self._fs.open(self._fs._strip_protocol(url), "wb")
        physical_file = PhysicalFile(out, url, self._delete_physical_file, scope)
        with self._lock:
            self._owned_files.add(physical_file)
            self.files_created += 1
        logger.debug("created physical file %s for file merging", url)
        return physical_file

    def _delete_physical_file(self, physical_file: PhysicalFile) -> None:
        with self._lock:
            self._owned_files.discard(physical_file)
        try:
            self._fs.rm_file(self._fs._strip_protocol(physical_file.url))
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("could not delete physical file %s: %s", physical_file.url, exc)

    def _create_logical_file(self, physical_file, start, length, subtask_key) -> LogicalFile:
        logical_file = LogicalFile(uuid.uuid4().hex, physical_file, start, length, subtask_key)
        with self._lock:
            self._known_logical_files[logical_file.file_id] = logical_file
        return logical_file

    def _pool(self, checkpoint_id: int) -> _PhysicalFilePool:
        key = checkpoint_id if self.merging_type is FileMergingType.WITHIN_CHECKPOINT else 0
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                cls = (
                    BlockingPhysicalFilePool
                    if self.pool_type is PhysicalFilePoolType.BLOCKING
                    else NonBlockingPhysicalFilePool
                )
                pool = self._pools[key] = cls(self.max_file_size, self._create_physical_file)
            return pool

    def _get_or_create_physical_file(self, subtask_key, checkpoint_id, scope) -> PhysicalFile:
        with self._lock:
            self._in_flight[checkpoint_id] = self._in_flight.get(checkpoint_id, 0) + 1
        try:
            return self._pool(checkpoint_id).poll_file(subtask_key, scope)
        except BaseException:
            self._writer_done(checkpoint_id)
            raise

    def _writer_done(self, checkpoint_id: int) -> None:
        with self._lock:
            left = self._in_flight.get(checkpoint_id, 1) - 1
            if left > 0:
                self._in_flight[checkpoint_id] = left
            else:
                self._in_flight.pop(checkpoint_id, None)
            self._idle.notify_all()

    def _return_physical_file(self, subtask_key, checkpoint_id, physical_file) -> None:
        try:
            if self._visible_on_flush:
                physical_file.flush()
            if not physical_file.could_reuse or not self._pool(checkpoint_id).try_put_file(
                subtask_key, physical_file
            ):
                physical_file.close()
        finally:
            self._writer_done(checkpoint_id)

    def _segment_committed(
        self, subtask_key, checkpoint_id, scope, physical_file, start, size, crc
    ):
        logical_file = self._create_logical_file(physical_file, start, size, subtask_key)
        logical_file.advance_last_checkpoint_id(checkpoint_id)
        with self._lock:
            self._uploaded_states.setdefault(checkpoint_id, set()).add(logical_file)
            physical_file.checkpoints.add(checkpoint_id)
        fs = self._fs
        self._return_physical_file(subtask_key, checkpoint_id, physical_file)
        return SegmentFileStateHandle(
            physical_file.url, start, size, scope, logical_file.file_id, crc, filesystem=fs
        )

    def _segment_failed(self, checkpoint_id, physical_file) -> None:
        try:
            physical_file.abandon()
        finally:
            self._writer_done(checkpoint_id)

    def create_checkpoint_state_output_stream(
        self,
        subtask_key: SubtaskKey,
        checkpoint_id: int,
        scope: CheckpointedStateScope,
        name_prefix: str = "",
    ) -> CheckpointStateOutputStream:
        if not isinstance(scope, CheckpointedStateScope):
            raise TypeError(f"scope must be a CheckpointedStateScope, got {scope!r}")
        if self._directories is None:
            raise ValueError("init_file_system() must be called before writing state")
        check_name_prefix(name_prefix)
        return FileMergingCheckpointStateOutputStream(
            self, subtask_key, checkpoint_id, scope, self._write_buffer_size, self._threshold
        )

    def sync_checkpoint(self, checkpoint_id: int, timeout: float | None = None) -> None:
        """Make every committed segment of ``checkpoint_id`` readable: waits until no stream
        of the checkpoint holds a physical file, then closes the pooled files holding its
        segments (on local disk they are already flushed: nothing to do)."""
        with self._lock:
            if not self._idle.wait_for(
                lambda: self._in_flight.get(checkpoint_id, 0) == 0, timeout=timeout
            ):
                raise TimeoutError(f"streams of checkpoint {checkpoint_id} are still writing")
            pools = list(self._pools.values())
        if self._visible_on_flush:
            return
        for pool in pools:
            pool.close_files(lambda f: checkpoint_id in f.checkpoints)

    # -- notifications ---------------------------------------------------------------------

    def notify_checkpoint_complete(self, subtask_key: SubtaskKey, checkpoint_id: int) -> None:
        if self.merging_type is FileMergingType.WITHIN_CHECKPOINT:
            self._remove_and_close_files(subtask_key, checkpoint_id)
        self._control_space_amplification()

    def notify_checkpoint_aborted(self, subtask_key: SubtaskKey, checkpoint_id: int) -> None:
        with self._lock:
            logical_files = self._uploaded_states.get(checkpoint_id)
            if logical_files is not None and self._discard_logical_files(
                subtask_key, checkpoint_id, logical_files
            ):
                del self._uploaded_states[checkpoint_id]
        self._notify_release_checkpoint(subtask_key, checkpoint_id)
        if self.merging_type is FileMergingType.WITHIN_CHECKPOINT:
            self._remove_and_close_files(subtask_key, checkpoint_id)
        self._control_space_amplification()

    def notify_checkpoint_subsumed(self, subtask_key: SubtaskKey, checkpoint_id: int) -> None:
        with self._lock:
            for cp in sorted(k for k in self._uploaded_states if k <= checkpoint_id):
                if self._discard_logical_files(
                    subtask_key, checkpoint_id, self._uploaded_states[cp]
                ):
                    del self._uploaded_states[cp]
        self._notify_release_checkpoint(subtask_key, checkpoint_id)
        self._control_space_amplification()

    def _discard_logical_files(self, subtask_key, checkpoint_id, logical_files) -> bool:
        for logical_file in list(logical_files):
            if (
                logical_file.subtask_key == subtask_key
                and logical_file.last_used_checkpoint_id <= checkpoint_id
            ):
                logical_file.discard_with_checkpoint_id(checkpoint_id)
                logical_files.discard(logical_file)
                self._known_logical_files.pop(logical_file.file_id, None)
        if not logical_files:
            self._try_discard_checkpoint(checkpoint_id)
            return True
        return False

    def _notify_release_checkpoint(self, subtask_key, checkpoint_id) -> None:
        with self._lock:
            if checkpoint_id in self._released:
                return
            known = self._notified_subtasks.setdefault(checkpoint_id, set())
            known.add(subtask_key)
            if known >= set(self._managed_shared):
                self._try_discard_checkpoint(checkpoint_id)
            while len(self._notified_subtasks) > _GHOST_CHECKPOINT_IDS:
                del self._notified_subtasks[min(self._notified_subtasks)]

    def _try_discard_checkpoint(self, checkpoint_id: int) -> None:
        with self._lock:
            if checkpoint_id in self._released:
                return
            self._released.append(checkpoint_id)
            self._notified_subtasks.pop(checkpoint_id, None)
            del self._released[:-_GHOST_CHECKPOINT_IDS]
            pool = (
                self._pools.pop(checkpoint_id, None)
                if self.merging_type is FileMergingType.WITHIN_CHECKPOINT
                else None
            )
        if pool is not None:
            pool.close()

    def is_checkpoint_released(self, checkpoint_id: int) -> bool:
        """Whether every registered subtask reported the checkpoint aborted or subsumed."""
        with self._lock:
            return checkpoint_id in self._released

    def _remove_and_close_files(self, subtask_key, checkpoint_id) -> None:
        with self._lock:
            pool = self._pools.get(checkpoint_id)
        if pool is not None:
            pool.close(subtask_key)
            if pool.is_empty():
                with self._lock:
                    if self._pools.get(checkpoint_id) is pool:
                        del self._pools[checkpoint_id]
                pool.close()

    # -- reuse and space amplification -----------------------------------------------------

    def could_reuse_previous_state_handle(self, handle: StreamStateHandle) -> bool:
        """False for a segment in a retired file: write that state anew instead."""
        if isinstance(handle, SegmentFileStateHandle):
            logical_file = self._known_logical_files.get(handle.logical_file_id)
            if logical_file is not None:
                return logical_file.physical_file.could_reuse
        return True

    def reuse_previous_state_handle(self, checkpoint_id: int, handles) -> None:
        """Record that ``checkpoint_id`` references these earlier segments too."""
        for handle in handles:
            if isinstance(handle, SegmentFileStateHandle):
                logical_file = self._known_logical_files.get(handle.logical_file_id)
                if logical_file is not None:
                    logical_file.advance_last_checkpoint_id(checkpoint_id)

    def space_stat(self) -> SpaceStat:
        with self._lock:
            files = [f for f in self._owned_files if not f.deleted]
            logical = [lf for lf in self._known_logical_files.values() if lf.physical_file.owned]
        return SpaceStat(
            len(files),
            sum(f.size for f in files),
            len(logical),
            sum(lf.length for lf in logical),
        )

    def _control_space_amplification(self) -> None:
        """Retire the most wasteful closed files until the projected amplification (their
        live segments rewritten elsewhere, the files deleted) is within the bound."""
        bound = self.max_space_amplification
        if bound < 1:
            return
        with self._lock:
            files = [f for f in self._owned_files if not f.deleted]
            total = sum(f.size for f in files)
            live = sum(f.live_bytes for f in files)
            if total <= bound * live:
                return
            candidates = sorted(
                (f for f in files if f.closed and f.could_reuse and f.size > 0),
                key=lambda f: f.live_bytes / f.size,
            )
            for physical_file in candidates:
                if total <= bound * live:
                    break
                physical_file.could_reuse = False
                total -= physical_file.size - physical_file.live_bytes

    # -- restore ---------------------------------------------------------------------------

    def restore_state_handles(self, checkpoint_id: int, subtask_key: SubtaskKey, handles) -> None:
        """Rebuild the bookkeeping of a restored checkpoint's segments; physical files outside
        this manager's directories are never deleted by it."""
        with self._lock:
            restored = self._uploaded_states.setdefault(checkpoint_id, set())
            known = {
                lf.physical_file.url: lf.physical_file for lf in self._known_logical_files.values()
            }
            for handle in handles:
                if not isinstance(handle, SegmentFileStateHandle):
                    continue
                physical_file = known.get(handle.path)
                if physical_file is None:
                    owned = self._is_managed(handle.path, subtask_key, handle.scope)
                    physical_file = PhysicalFile(
                        None, handle.path, self._delete_physical_file, handle.scope, owned
                    )
                    if owned:
                        self._owned_files.add(physical_file)
                    known[handle.path] = physical_file
                physical_file.size = max(physical_file.size, handle.end_position)
                logical_file = LogicalFile(
                    handle.logical_file_id,
                    physical_file,
                    handle.start_position,
                    handle.state_size,
                    subtask_key,
                )
                logical_file.advance_last_checkpoint_id(checkpoint_id)
                self._known_logical_files[logical_file.file_id] = logical_file
                restored.add(logical_file)

    def _is_managed(self, url: str, subtask_key, scope) -> bool:
        directory = self.get_managed_dir(subtask_key, scope)
        return directory is not None and url.startswith(directory.rstrip("/") + "/")

    def get_logical_file(self, file_id: str) -> LogicalFile | None:
        return self._known_logical_files.get(file_id)

    def uploaded_states(self) -> dict[int, set[LogicalFile]]:
        with self._lock:
            return {k: set(v) for k, v in sorted(self._uploaded_states.items())}

    def close(self) -> None:
        """Close every pooled physical file (segments stay; nothing referenced is deleted)."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()


def create_file_merging_snapshot_manager(
    worker_id: str,
    *,
    merging_type: FileMergingType = FileMergingType.WITHIN_CHECKPOINT,
    max_file_size: int = DEFAULT_MAX_FILE_SIZE,
    pool_type: PhysicalFilePoolType = PhysicalFilePoolType.NON_BLOCKING,
    max_space_amplification: float = DEFAULT_MAX_SPACE_AMPLIFICATION,
) -> FileMergingSnapshotManager:
    """A new manager (Flink's FileMergingSnapshotManagerBuilder): use one per job per worker
    process."""
    return FileMergingSnapshotManager(
        worker_id,
        merging_type=merging_type,
        max_file_size=max_file_size,
        pool_type=pool_type,
        max_space_amplification=max_space_amplification,
    )


_managers: dict[str, FileMergingSnapshotManager] = {}
_managers_lock = threading.Lock()


def manager_for_job(job_id: str, worker_id: str, **config) -> FileMergingSnapshotManager:
    """This process's manager of ``job_id`` (created on first use)."""
    with _managers_lock:
        manager = _managers.get(job_id)
        if manager is None:
            manager = _managers[job_id] = create_file_merging_snapshot_manager(worker_id, **config)
        return manager


def release_manager_for_job(job_id: str) -> None:
    with _managers_lock:
        manager = _managers.pop(job_id, None)
    if manager is not None:
        manager.close()


# --- the merging stream ------------------------------------------------------------------


class FileMergingCheckpointStateOutputStream(SegmentStateOutputStream):
    """Buffers up to the inline threshold (inline handle); beyond it, appends a segment to a
    physical file taken from the manager's pool, held until commit or abort."""

    def __init__(self, manager, subtask_key, checkpoint_id, scope, buffer_size, threshold):
        super().__init__(buffer_size, threshold)
        self._manager = manager
        self._subtask_key = subtask_key
        self._checkpoint_id = checkpoint_id
        self._scope = scope
        self._file: PhysicalFile | None = None

    def _has_file(self) -> bool:
        return self._file is not None

    def _open_segment(self) -> int:
        self._file = self._manager._get_or_create_physical_file(
            self._subtask_key, self._checkpoint_id, self._scope
        )
        return self._file.size

    def _append(self, view: memoryview) -> None:
        self._file.write(view)

    def _inline_directory(self) -> str:
        return self._manager.get_managed_dir(self._subtask_key, self._scope)

    def _commit_segment(self) -> StreamStateHandle:
        physical_file, self._file = self._file, None
        return self._manager._segment_committed(
            self._subtask_key,
            self._checkpoint_id,
            self._scope,
            physical_file,
            self._start,
            self._flushed,
            self._crc,
        )

    def _abort_segment(self) -> None:
        physical_file, self._file = self._file, None
        with contextlib.suppress(Exception):
            self._manager._segment_failed(self._checkpoint_id, physical_file)


class FsMergingCheckpointStreamFactory(CheckpointStreamFactory):
    """The stream factory of one checkpoint of one subtask, when file merging is on."""

    def __init__(self, manager: FileMergingSnapshotManager, subtask_key, checkpoint_id: int):
        self._manager = manager
        self._subtask_key = subtask_key
        self._checkpoint_id = checkpoint_id

    def create_checkpoint_state_output_stream(
        self, scope: CheckpointedStateScope, name_prefix: str = ""
    ) -> CheckpointStateOutputStream:
        return self._manager.create_checkpoint_state_output_stream(
            self._subtask_key, self._checkpoint_id, scope, name_prefix
        )
