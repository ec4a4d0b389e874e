"""The shared state registry: keeps SHARED-scope files alive exactly as long as a retained
checkpoint references them (Flink's SharedStateRegistryImpl)."""

import logging
import threading
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from checkpoint_storage._appending import is_appended_segment
from checkpoint_storage._filesystems import DEFAULT_DELETE_PARALLELISM, delete_files
from checkpoint_storage._handles import FileStateHandle, StreamStateHandle

__all__ = ["SharedStateRegistry"]

logger = logging.getLogger("checkpoint_storage")


@dataclass
class _Entry:
    handle: StreamStateHandle
    created_by: int
    last_used: int
    owned: bool  # False for state of a snapshot restored in NO_CLAIM mode


def _same_state(a: StreamStateHandle, b: StreamStateHandle) -> bool:
    if is_appended_segment(a) or is_appended_segment(b):
        # one entry per appended physical file: its segments differ and share the file
        return is_appended_segment(a) and is_appended_segment(b)
    return (
        type(a) is type(b)
        and a == b
        and a.state_size == b.state_size
        and getattr(a, "checksum", None) == getattr(b, "checksum", None)
    )


def discard_handles(
    handles: Iterable[StreamStateHandle], max_workers: int, *, appended_files: bool = False
) -> None:
    """Discard many handles: file handles grouped by filesystem and deleted in parallel
    (bounded), others one by one (a segment: nothing). ``appended_files``: a segment of an
    appended file deletes the whole file (the registry's own discard, once no retained
    checkpoint references any segment in it). Every deletion is tried before the first
    error is raised."""
    by_filesystem: dict[int, tuple] = {}
    paths: dict[int, dict[str, None]] = defaultdict(dict)
    errors: list[BaseException] = []
    for handle in handles:
        if isinstance(handle, FileStateHandle) or (appended_files and is_appended_segment(handle)):
            fs = handle.filesystem
            by_filesystem[id(fs)] = fs
            paths[id(fs)][fs._strip_protocol(handle.path)] = None
        else:
            try:
                handle.discard_state()
            except Exception as exc:  # noqa: BLE001 - collected, the first is raised below
                errors.append(exc)
    for key, fs in by_filesystem.items():
        try:
            delete_files(fs, list(paths[key]), max_workers)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    if errors:
        raise errors[0]


class SharedStateRegistry:
    """Reference counting of shared state by last use.

    Each SHARED-scope file is registered under a stable key (its path) with the id of every
    checkpoint that references it; an appended physical file (``is_appended_segment``) is
    one entry for all its segments, and is deleted whole.
    ``unregister_unused_state(lowest_retained_id)`` forgets the entries no retained
    checkpoint uses any more and deletes their files in the background, one batch at a time,
    with bounded parallelism. State restored in NO_CLAIM mode is forgotten but never deleted.
    """

    def __init__(self, *, max_workers: int = DEFAULT_DELETE_PARALLELISM) -> None:
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._max_workers = max_workers
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="shared-state-discard")
        self._pending: list[Future] = []
        self._closed = False

    @staticmethod
    def key_of(handle: StreamStateHandle) -> str:
        """The stable key of a shared state handle."""
        if isinstance(handle, FileStateHandle) or is_appended_segment(handle):
            return handle.path
        raise TypeError(
            "only file handles and segments of appended files are shared state, got "
            f"{type(handle).__name__}"
        )

    def register_reference(
        self, handle: StreamStateHandle, checkpoint_id: int, *, owned: bool = True
    ) -> StreamStateHandle:
        """Record that checkpoint ``checkpoint_id`` uses ``handle``; returns the registered
        handle. Registering a different handle under an existing key raises ValueError."""
        key = self.key_of(handle)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._entries[key] = _Entry(handle, checkpoint_id, checkpoint_id, owned)
                return handle
            if not _same_state(entry.handle, handle):
                raise ValueError(
                    f"shared state {key} is already registered with a different handle "
                    f"({entry.handle!r} vs {handle!r}); shared files must never be rewritten"
                )
            entry.last_used = max(entry.last_used, checkpoint_id)
            entry.owned = entry.owned and owned
            return entry.handle

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def last_used(self, key: str) -> int:
        with self._lock:
            return self._entries[key].last_used

    def is_owned(self, key: str) -> bool:
        with self._lock:
            return self._entries[key].owned

    def unregister_unused_state(self, lowest_retained_checkpoint_id: int) -> list:
        """Forget every entry last used before ``lowest_retained_checkpoint_id`` and schedule
        the deletion of the owned ones; returns the handles scheduled for deletion."""
        with self._lock:
            unused = [
                key
                for key, entry in self._entries.items()
                if entry.last_used < lowest_retained_checkpoint_id
            ]
            doomed = [self._entries[key].handle for key in unused if self._entries[key].owned]
            for key in unused:
                del self._entries[key]
            if doomed and not self._closed:
                self._pending = [f for f in self._pending if not f.done()]
                self._pending.append(self._executor.submit(self._discard, doomed))
        return doomed

    def unregister_unreferenced(self, referenced: Iterable[str]) -> list:
        """Forget every entry whose key is not in ``referenced`` (the keys the retained
        checkpoints hold) and schedule the deletion of the owned ones; returns the handles
        scheduled for deletion. Exact where retention is not a contiguous run of ids (a
        kept head or partition end among subsumed checkpoints), which the last-use rule of
        ``unregister_unused_state`` would over-keep."""
        referenced = set(referenced)
        with self._lock:
            unused = [key for key in self._entries if key not in referenced]
            doomed = [self._entries[key].handle for key in unused if self._entries[key].owned]
            for key in unused:
                del self._entries[key]
            if doomed and not self._closed:
                self._pending = [f for f in self._pending if not f.done()]
                self._pending.append(self._executor.submit(self._discard, doomed))
        return doomed

    def _discard(self, handles: list) -> None:
        try:
            discard_handles(handles, self._max_workers, appended_files=True)
        except Exception:  # noqa: BLE001 - leftovers are garbage: collect_garbage removes them
            logger.warning("could not delete some unused shared state", exc_info=True)

    def wait_for_pending_deletions(self) -> None:
        """Block until every scheduled deletion has run."""
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.result()

    def close(self) -> None:
        """Finish the scheduled deletions and stop the deletion thread."""
        self.wait_for_pending_deletions()
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=True)
