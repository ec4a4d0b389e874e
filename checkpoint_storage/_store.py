"""Completed checkpoints, their store, subsumption and discarding (Flink's CompletedCheckpoint,
DefaultCompletedCheckpointStore and CheckpointSubsumeHelper)."""

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from checkpoint_storage._access import _DirectoryBasedAccess
from checkpoint_storage._appending import is_appended_segment
from checkpoint_storage._filesystems import DEFAULT_DELETE_PARALLELISM, PathRoots
from checkpoint_storage._handles import FileStateHandle, StreamStateHandle
from checkpoint_storage._locations import (
    CheckpointStorageLocation,
    CompletedCheckpointStorageLocation,
)
from checkpoint_storage._metadata import CheckpointMetadata, CheckpointProperties
from checkpoint_storage._retention import CheckpointRetentionPolicy, JobStatus, RestoreMode
from checkpoint_storage._shared_state import SharedStateRegistry, discard_handles
from checkpoint_storage.exceptions import (
    CheckpointNotFoundError,
    InvalidCheckpointError,
    UnsafePathError,
)

__all__ = [
    "CompletedCheckpoint",
    "CompletedCheckpointStore",
    "FileSystemCompletedCheckpointStore",
    "StandaloneCompletedCheckpointStore",
    "AlsoRetained",
    "abort_checkpoint",
    "discard_checkpoint",
]

AlsoRetained = Callable[[Sequence["CompletedCheckpoint"]], Iterable[int]]
"""A retention rule on top of ``max_retained``: given the retained regular checkpoints
(oldest first), the ids of those to keep as well (e.g. a pipeline's furthest position and
its partition ends)."""

logger = logging.getLogger("checkpoint_storage")


def _is_owned_file(handle: StreamStateHandle) -> bool:
    """A file this job may delete once unreferenced: a file handle, or a segment of an
    appended physical file (deleted whole; other segments belong to a merging manager)."""
    return isinstance(handle, FileStateHandle) or is_appended_segment(handle)


@dataclass(frozen=True, eq=False)
class CompletedCheckpoint:
    """A completed checkpoint or savepoint: where it is, what it holds, and whether this job
    owns it (may discard it). Savepoints and NO_CLAIM restores are not owned."""

    location: CompletedCheckpointStorageLocation
    metadata: CheckpointMetadata
    owned: bool = True

    @classmethod
    def load(
        cls, location: CompletedCheckpointStorageLocation, owned: bool | None = None
    ) -> "CompletedCheckpoint":
        metadata = location.load_metadata()
        return cls(
            location, metadata, not metadata.properties.is_savepoint() if owned is None else owned
        )

    @property
    def checkpoint_id(self) -> int:
        return self.metadata.checkpoint_id

    @property
    def external_pointer(self) -> str:
        return self.location.external_pointer

    @property
    def properties(self) -> CheckpointProperties:
        return self.metadata.properties

    def is_savepoint(self) -> bool:
        return self.metadata.properties.is_savepoint()

    def _file_handles(self, root: int) -> list[StreamStateHandle]:
        roots = self.location.roots
        return [
            h
            for h in self.metadata.all_handles()
            if _is_owned_file(h) and roots.index_of(h.path) == root
        ]

    def private_handles(self) -> list[StreamStateHandle]:
        """File state inside the checkpoint's own directory: discarded with it."""
        return self._file_handles(PathRoots.OWN)

    def shared_handles(self) -> list[StreamStateHandle]:
        """File state in the job's ``shared/`` directory (files, and segments of appended
        physical files): owned by the shared state registry."""
        return self._file_handles(PathRoots.SHARED)

    def __repr__(self) -> str:
        kind = "savepoint" if self.is_savepoint() else "checkpoint"
        return f"CompletedCheckpoint({kind} {self.checkpoint_id} at {self.external_pointer!r})"


def discard_checkpoint(
    checkpoint: CompletedCheckpoint, *, max_workers: int = DEFAULT_DELETE_PARALLELISM
) -> None:
    """Delete a checkpoint: `_metadata` first (it is no longer addressable even if the rest
    fails), then its private state files in parallel, then its directory. Shared state is
    the registry's; task-owned state is never touched. Idempotent: every step is tried, then
    the first error is raised."""
    errors: list[BaseException] = []
    steps = (
        checkpoint.location.metadata_handle.discard_state,
        lambda: discard_handles(checkpoint.private_handles(), max_workers),
        checkpoint.location.dispose_storage_location,
    )
    for step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - collected, the first is raised below
            errors.append(exc)
    if errors:
        raise errors[0]


def abort_checkpoint(
    location: CheckpointStorageLocation,
    written_handles: Iterable[StreamStateHandle] = (),
    *,
    max_workers: int = DEFAULT_DELETE_PARALLELISM,
) -> None:
    """Clean up a failed or aborted checkpoint: discard the state it wrote (pass only handles
    this checkpoint created, never shared state reused from an earlier one; a segment's
    physical file stays, its other segments may be referenced) and remove its ``chk-<id>``
    directory."""
    errors: list[BaseException] = []
    for step in (
        lambda: discard_handles(list(written_handles), max_workers),
        location.dispose_on_failure,
    ):
        try:
            step()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    if errors:
        raise errors[0]


class CompletedCheckpointStore(ABC):
    """The retained completed checkpoints of one job, oldest first.

    - ``add_checkpoint`` records a new checkpoint, then subsumes older ones: regular
      checkpoints beyond ``max_retained`` (never the newest entry, nor those ``also_retain``
      names) leave the store and are discarded when owned; savepoints do not count toward
      ``max_retained``, leave the store once older than every retained checkpoint, and are
      never discarded.
    - ``shutdown(job_status)`` applies the retention policy for how the job ended.
    - Shared state is registered per checkpoint in ``shared_state_registry`` and deleted once
      no retained checkpoint references it.

    Implementations override ``_recover()`` to rebuild the entries from durable storage.
    """

    def __init__(
        self,
        max_retained: int = 1,
        retention_policy: CheckpointRetentionPolicy = (
            CheckpointRetentionPolicy.NEVER_RETAIN_AFTER_TERMINATION
        ),
        shared_state_registry: SharedStateRegistry | None = None,
        *,
        discard_parallelism: int = DEFAULT_DELETE_PARALLELISM,
        also_retain: AlsoRetained | None = None,
    ) -> None:
        if isinstance(max_retained, bool) or not isinstance(max_retained, int):
            raise TypeError(f"max_retained must be an int, got {max_retained!r}")
        if max_retained < 1:
            raise ValueError(f"max_retained must be at least 1, got {max_retained}")
        self._max_retained = max_retained
        self._policy = CheckpointRetentionPolicy(retention_policy)
        self._registry = shared_state_registry or SharedStateRegistry()
        self._discard_parallelism = discard_parallelism
        self._also_retain = also_retain
        self._entries: list[CompletedCheckpoint] = []
        self._unclaimed_shared: set[str] = set()
        self._lock = threading.RLock()
        self._shut_down = False

    @property
    def max_retained(self) -> int:
        return self._max_retained

    @property
    def retention_policy(self) -> CheckpointRetentionPolicy:
        return self._policy

    @property
    def shared_state_registry(self) -> SharedStateRegistry:
        return self._registry

    def latest(self) -> CompletedCheckpoint | None:
        with self._lock:
            return self._entries[-1] if self._entries else None

    def all(self) -> list[CompletedCheckpoint]:
        with self._lock:
            return list(self._entries)

    def requires_full_checkpoint(self) -> bool:
        """True after a NO_CLAIM restore until a checkpoint that does not depend on the
        restored snapshot's shared state was added."""
        with self._lock:
            return bool(self._unclaimed_shared)

    def add_checkpoint(
        self,
        completed: CompletedCheckpointStorageLocation | CompletedCheckpoint,
        metadata: CheckpointMetadata | None = None,
    ) -> list[CompletedCheckpoint]:
        """Record a completed checkpoint, then subsume older ones; returns those that left
        the store. Discard failures are logged, not raised: the checkpoint was added, and
        what could not be deleted is garbage for ``collect_garbage``."""
        checkpoint = self._as_checkpoint(completed, metadata)
        with self._lock:
            self._check_open()
            if any(e.external_pointer == checkpoint.external_pointer for e in self._entries):
                raise ValueError(f"{checkpoint!r} is already in the store")
            referenced = {h.path for h in checkpoint.metadata.all_handles() if _is_owned_file(h)}
            if not checkpoint.is_savepoint() and referenced & self._unclaimed_shared:
                raise ValueError(
                    f"{checkpoint!r} references shared state of a snapshot restored in "
                    "NO_CLAIM mode, which this job does not own: the first checkpoint after "
                    "a NO_CLAIM restore must be a full checkpoint"
                )
            self._register(checkpoint)
            self._entries.append(checkpoint)
            if not checkpoint.is_savepoint():
                self._unclaimed_shared.clear()
            return self._subsume()

    def restore(
        self,
        snapshot: CompletedCheckpointStorageLocation | CompletedCheckpoint,
        mode: RestoreMode = RestoreMode.NO_CLAIM,
    ) -> CompletedCheckpoint:
        """Start from ``snapshot`` (a checkpoint or savepoint). CLAIM: the job owns it and
        deletes it once subsumed. NO_CLAIM: its files are never deleted by this job, and the
        next checkpoint may not reuse its shared state."""
        mode = RestoreMode(mode)
        if isinstance(snapshot, CompletedCheckpoint):
            snapshot = snapshot.location
        owned = mode is RestoreMode.CLAIM
        checkpoint = CompletedCheckpoint.load(snapshot, owned=owned)
        with self._lock:
            self._check_open()
            existing = next(
                (e for e in self._entries if e.external_pointer == checkpoint.external_pointer),
                None,
            )
            if existing is not None:
                return existing
            self._register(checkpoint)
            self._entries.append(checkpoint)
            self._entries.sort(key=lambda e: e.checkpoint_id)
            if not owned:
                self._unclaimed_shared = {
                    SharedStateRegistry.key_of(h) for h in checkpoint.shared_handles()
                }
        return checkpoint

    def subsume(self) -> list[CompletedCheckpoint]:
        """Subsume now what exceeds ``max_retained`` (what the next ``add_checkpoint`` would
        subsume), e.g. a recovered surplus, on behalf of an explicit retention step; returns
        those that left the store. Recovery and construction never call this."""
        with self._lock:
            self._check_open()
            return self._subsume() if self._entries else []

    def _as_checkpoint(self, completed, metadata) -> CompletedCheckpoint:
        if isinstance(completed, CompletedCheckpoint):
            return completed
        if metadata is None:
            return CompletedCheckpoint.load(completed)
        return CompletedCheckpoint(completed, metadata, not metadata.properties.is_savepoint())

    def _register(self, checkpoint: CompletedCheckpoint) -> None:
        for handle in checkpoint.shared_handles():
            self._registry.register_reference(
                handle, checkpoint.checkpoint_id, owned=checkpoint.owned
            )

    def _subsumable(self) -> list[CompletedCheckpoint]:
        """The regular checkpoints beyond ``max_retained`` that no rule keeps."""
        latest = self._entries[-1]
        regular = [e for e in self._entries if not e.is_savepoint()]
        surplus = regular[: max(0, len(regular) - self._max_retained)]
        if not surplus:
            return []
        kept = set(self._also_retain(regular)) if self._also_retain is not None else set()
        return [e for e in surplus if e is not latest and e.checkpoint_id not in kept]

    def _subsume(self) -> list[CompletedCheckpoint]:
        latest = self._entries[-1]
        regular = [e for e in self._entries if not e.is_savepoint()]
        subsumed = self._subsumable()
        retained_regular = [e for e in regular if e not in subsumed]
        oldest_retained = min((e.checkpoint_id for e in retained_regular), default=None)
        subsumed += [
            e
            for e in self._entries
            if e.is_savepoint()
            and e is not latest
            and oldest_retained is not None
            and e.checkpoint_id < oldest_retained
        ]
        if not subsumed:
            return []
        self._entries = [e for e in self._entries if e not in subsumed]
        for checkpoint in subsumed:
            if checkpoint.owned and self._policy.discard_on_subsumed():
                self._discard_logged(checkpoint)
        self._release_unused_shared_state()
        return subsumed

    def _release_unused_shared_state(self) -> None:
        # By reference, not by lowest retained id: kept heads and partition ends leave gaps
        # of subsumed ids between retained ones, whose own files must go.
        self._registry.unregister_unreferenced(
            SharedStateRegistry.key_of(h) for e in self._entries for h in e.shared_handles()
        )

    def _discard_logged(self, checkpoint: CompletedCheckpoint) -> None:
        try:
            discard_checkpoint(checkpoint, max_workers=self._discard_parallelism)
        except Exception:  # noqa: BLE001 - its _metadata goes first, so leftovers are garbage
            logger.warning("could not fully discard %r", checkpoint, exc_info=True)

    def shutdown(self, job_status: JobStatus) -> list[CompletedCheckpoint]:
        """The job ended with ``job_status``: discard the owned checkpoints the retention
        policy does not keep; a suspended job keeps everything. Returns the discarded ones."""
        job_status = JobStatus(job_status)
        with self._lock:
            if self._shut_down:
                return []
            self._shut_down = True
            discarded: list[CompletedCheckpoint] = []
            if job_status.is_globally_terminal():
                discarded = [
                    e for e in self._entries if e.owned and self._policy.discard_on(job_status)
                ]
                for checkpoint in discarded:
                    self._discard_logged(checkpoint)
                self._entries = [e for e in self._entries if e not in discarded]
                self._release_unused_shared_state()
        self._registry.close()
        return discarded

    def _check_open(self) -> None:
        if self._shut_down:
            raise RuntimeError("the checkpoint store was shut down")

    @abstractmethod
    def _recover(self) -> None:
        """Rebuild the entries from durable storage (called by the constructor). Reads
        only: nothing is subsumed or deleted until the next ``add_checkpoint``."""


class StandaloneCompletedCheckpointStore(CompletedCheckpointStore):
    """Keeps the retained checkpoints in memory only (Flink's standalone store)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._recover()

    def _recover(self) -> None:
        pass


class FileSystemCompletedCheckpointStore(CompletedCheckpointStore):
    """A durable store: the job's ``chk-<id>`` directories with a valid `_metadata` are its
    record, so it rebuilds itself after a restart.

    Constructing (recovering) a store reads and never deletes: it may hold more than
    ``max_retained`` checkpoints afterwards (``needs_subsumption``), e.g. after a crash
    between publishing a checkpoint and subsuming older ones, or when the store is opened
    with a smaller ``max_retained``. As in Flink, the surplus is subsumed when the next
    checkpoint is added. Savepoints and snapshots restored from elsewhere live outside the
    job directory and are kept in memory only: after a restart they are forgotten, never
    deleted.
    """

    def __init__(self, access: _DirectoryBasedAccess, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._access = access
        self._recover()

    @property
    def needs_subsumption(self) -> bool:
        """Whether the store holds more regular checkpoints than ``max_retained`` (recovered
        surplus), which the next ``add_checkpoint`` subsumes."""
        with self._lock:
            return bool(self._entries) and bool(self._subsumable())

    def _recover(self) -> None:
        # The same rule as discovery: a chk-<id> counts when its `_metadata` validates and
        # holds checkpoint <id>; invalid, foreign and mismatched ones are skipped with a
        # warning (never discarded: they are not entries), unreadable ones raise.
        recovered = []
        for directory in reversed(self._access._checkpoint_directories()):
            location = self._access._completed_in(directory)
            if location is None:
                continue  # never completed: garbage for collect_garbage
            try:
                metadata = location.load_metadata(directory.checkpoint_id)
                recovered.append(
                    CompletedCheckpoint(location, metadata, not metadata.properties.is_savepoint())
                )
            except CheckpointNotFoundError:
                continue  # disposed since it was listed
            except (InvalidCheckpointError, UnsafePathError) as exc:
                logger.warning("skipping invalid checkpoint %s: %s", location.external_pointer, exc)
        with self._lock:
            for checkpoint in recovered:
                self._register(checkpoint)
            self._entries = recovered
