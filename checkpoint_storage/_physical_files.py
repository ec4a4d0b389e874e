"""The files of file merging (Flink FLIP-306, see ``_file_merging``): physical files, the
logical files (segments) that reference them, and the pools that hand physical files to one
writer at a time.

A physical file is reference counted by its logical files and deleted once closed and
unreferenced, and only when the manager created it. A pool keeps the files free for writing:
one queue per subtask (SHARED scope) and one for the worker (EXCLUSIVE scope).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from typing import TYPE_CHECKING

from checkpoint_storage._references import CheckpointedStateScope

if TYPE_CHECKING:
    from checkpoint_storage._file_merging import SubtaskKey

__all__ = [
    "BlockingPhysicalFilePool",
    "LogicalFile",
    "NonBlockingPhysicalFilePool",
    "PhysicalFile",
]


# --- physical and logical files ----------------------------------------------------------


class PhysicalFile:
    """A file that holds segments: reference counted by its logical files, deleted once closed
    and unreferenced, and only when ``owned`` (created by this manager)."""

    def __init__(self, out, url: str, deleter, scope: CheckpointedStateScope, owned=True):
        self.url = url
        self.scope = scope
        self.owned = owned
        self._out = out
        self._deleter = deleter
        self._lock = threading.RLock()
        self.closed = out is None
        self.deleted = False
        self.size = 0
        self.ref_count = 0
        self.live_bytes = 0
        self.could_reuse = True
        self.checkpoints: set[int] = set()  # checkpoints that wrote segments into it

    @property
    def output_stream(self):
        return self._out

    def is_open(self) -> bool:
        return not self.closed and self._out is not None

    def write(self, view: memoryview) -> None:
        self._out.write(view)
        self.size += len(view)

    def flush(self) -> None:
        with self._lock:
            if self._out is not None:
                self._out.flush()

    def inc_ref_count(self, length: int) -> None:
        with self._lock:
            self.ref_count += 1
            self.live_bytes += length

    def dec_ref_count(self, length: int) -> None:
        with self._lock:
            if self.ref_count <= 0:
                raise ValueError(f"reference count of {self.url} is already 0")
            self.ref_count -= 1
            self.live_bytes -= length
        self.delete_if_necessary()

    def close(self) -> None:
        """No more segments go in; deleted now if nothing references it."""
        with self._lock:
            if not self.closed:
                self.closed = True
                out, self._out = self._out, None
                if out is not None:
                    out.close()
        self.delete_if_necessary()

    def abandon(self) -> None:
        """Close after a failed write: the file may hold a torn segment and is never reused."""
        with self._lock:
            self.closed = True
            out, self._out = self._out, None
        if out is not None:
            with contextlib.suppress(Exception):
                out.close()
        self.delete_if_necessary()

    def delete_if_necessary(self) -> None:
        with self._lock:
            if self.is_open() or self.deleted or self.ref_count > 0:
                return
            self.deleted = True
        if self._deleter is not None and self.owned:
            self._deleter(self)

    def __repr__(self) -> str:
        return (
            f"PhysicalFile({self.url!r}, owned={self.owned}, closed={self.closed}, "
            f"refs={self.ref_count}, size={self.size})"
        )


class LogicalFile:
    """One segment of a physical file, owned by a subtask, used up to a checkpoint."""

    __slots__ = (
        "file_id",
        "physical_file",
        "start_offset",
        "length",
        "subtask_key",
        "last_used_checkpoint_id",
        "discarded",
    )

    def __init__(self, file_id, physical_file, start_offset, length, subtask_key) -> None:
        self.file_id = file_id
        self.physical_file = physical_file
        self.start_offset = start_offset
        self.length = length
        self.subtask_key = subtask_key
        self.last_used_checkpoint_id = -1
        self.discarded = False
        physical_file.inc_ref_count(length)

    def advance_last_checkpoint_id(self, checkpoint_id: int) -> None:
        if checkpoint_id > self.last_used_checkpoint_id:
            self.last_used_checkpoint_id = checkpoint_id

    def discard_with_checkpoint_id(self, checkpoint_id: int) -> None:
        """Release the physical file, unless a later checkpoint still uses the segment."""
        if not self.discarded and checkpoint_id >= self.last_used_checkpoint_id:
            self.discarded = True
            self.physical_file.dec_ref_count(self.length)



# --- pools -------------------------------------------------------------------------------


class _PhysicalFilePool:
    """Physical files free for writing: one queue per subtask (SHARED) and one for the worker
    (EXCLUSIVE). A file in a queue is held by no writer."""

    def __init__(self, max_file_size: int, creator) -> None:
        self.max_file_size = max_file_size
        self._creator = creator
        self._lock = threading.Lock()
        self._shared: dict[SubtaskKey, object] = {}
        self._exclusive = self._new_queue()
        self._closed = False

    def _new_queue(self):
        return deque()

    def _queue(self, subtask_key: SubtaskKey, scope: CheckpointedStateScope):
        if scope is CheckpointedStateScope.EXCLUSIVE:
            return self._exclusive
        with self._lock:
            q = self._shared.get(subtask_key)
            if q is None:
                q = self._shared[subtask_key] = self._new_queue()
            return q

    def poll_file(self, subtask_key: SubtaskKey, scope: CheckpointedStateScope) -> PhysicalFile:
        raise NotImplementedError

    def try_put_file(self, subtask_key: SubtaskKey, physical_file: PhysicalFile) -> bool:
        raise NotImplementedError

    def _all_queues(self) -> list:
        return [q for _, q in self._keyed_queues()]

    def _keyed_queues(self) -> list:
        with self._lock:
            return [(CheckpointedStateScope.EXCLUSIVE, self._exclusive), *self._shared.items()]

    def _emptied(self, key) -> None:
        """A queue lost files to ``close_files``."""

    def files(self) -> list[PhysicalFile]:
        return [f for q in self._all_queues() for f in _items(q)]

    def close(self, subtask_key: SubtaskKey | None = None) -> None:
        """Close the pooled files: the subtask's SHARED files, or all of them; a closed pool
        accepts no file back."""
        if subtask_key is None:
            self._closed = True
            queues = self._all_queues()
        else:
            with self._lock:
                queues = [self._shared.pop(subtask_key)] if subtask_key in self._shared else []
        for q in queues:
            for physical_file in _drain(q):
                physical_file.close()

    def close_files(self, predicate) -> None:
        """Close the pooled files for which ``predicate(file)`` holds."""
        for key, q in self._keyed_queues():
            keep = []
            closed = False
            for physical_file in _drain(q):
                if predicate(physical_file):
                    physical_file.close()
                    closed = True
                else:
                    keep.append(physical_file)
            for physical_file in keep:
                _put(q, physical_file)
            if closed:
                self._emptied(key)

    def is_empty(self) -> bool:
        return all(not _items(q) for q in self._all_queues())


def _items(q) -> list:
    if isinstance(q, queue.Queue):
        with q.mutex:
            return list(q.queue)
    return list(q)


def _drain(q) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait() if isinstance(q, queue.Queue) else q.popleft())
        except (IndexError, queue.Empty):
            return out


def _put(q, item) -> None:
    if isinstance(q, queue.Queue):
        q.put(item)
    else:
        q.append(item)


class NonBlockingPhysicalFilePool(_PhysicalFilePool):
    """Takes a free file or creates a new one; a full file is not taken back."""

    def poll_file(self, subtask_key, scope):
        q = self._queue(subtask_key, scope)
        try:
            return q.popleft()
        except IndexError:
            pass
        return self._creator(subtask_key, scope)

    def try_put_file(self, subtask_key, physical_file):
        if self._closed or physical_file.size >= self.max_file_size or not physical_file.is_open():
            return False
        self._queue(subtask_key, physical_file.scope).append(physical_file)
        return True


class BlockingPhysicalFilePool(_PhysicalFilePool):
    """One file per queue circulates: a writer waits until the file is returned; a full file is
    replaced by a new one."""

    def __init__(self, max_file_size: int, creator) -> None:
        super().__init__(max_file_size, creator)
        self._initialized: set = set()

    def _new_queue(self):
        return queue.Queue()

    def poll_file(self, subtask_key, scope):
        key = scope if scope is CheckpointedStateScope.EXCLUSIVE else subtask_key
        q = self._queue(subtask_key, scope)
        with self._lock:
            first = key not in self._initialized
            self._initialized.add(key)
        if first:
            q.put(self._creator(subtask_key, scope))
        return q.get()

    def try_put_file(self, subtask_key, physical_file):
        q = self._queue(subtask_key, physical_file.scope)
        if not self._closed and physical_file.size < self.max_file_size and physical_file.is_open():
            q.put(physical_file)
            return True
        if not self._closed:
            q.put(self._creator(subtask_key, physical_file.scope))
        return False

    def _emptied(self, key) -> None:
        # The next writer creates the replacement, instead of waiting for one forever.
        with self._lock:
            self._initialized.discard(key)

    def close(self, subtask_key=None):
        super().close(subtask_key)
        with self._lock:
            if subtask_key is None:
                self._initialized.clear()
            else:
                self._initialized.discard(subtask_key)

