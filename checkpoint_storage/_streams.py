"""State output streams and the factories that create them (Flink's FsCheckpointStreamFactory,
FsCheckpointStateOutputStream and MemCheckpointStreamFactory)."""

import contextlib
import io
import itertools
import os
import queue
import re
import secrets
import threading
import uuid
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable

from fsspec import AbstractFileSystem

from checkpoint_storage._filesystems import abort_file, join
from checkpoint_storage._handles import (
    ByteStreamStateHandle,
    FileStateHandle,
    RelativeFileStateHandle,
    StreamStateHandle,
)
from checkpoint_storage._references import CheckpointedStateScope
from checkpoint_storage.exceptions import StateSizeExceededError, StreamClosedError

__all__ = ["CheckpointStateOutputStream", "CheckpointStreamFactory"]


class CheckpointStateOutputStream(ABC):
    """A binary stream that ends in a state handle.

    Subclasses implement ``write``, ``tell``, ``flush``, ``close_and_get_handle`` (commit) and
    ``close`` (abort: discard whatever was written; never raises). Leaving a ``with`` block
    without ``close_and_get_handle()`` aborts.
    """

    @abstractmethod
    def write(self, data) -> int: ...

    @abstractmethod
    def tell(self) -> int: ...

    @abstractmethod
    def flush(self) -> None: ...

    @abstractmethod
    def close_and_get_handle(self) -> StreamStateHandle | None:
        """Commit: the handle of everything written, or None if nothing was written."""

    @abstractmethod
    def close(self) -> None:
        """Abort unless already committed; never raises."""

    @property
    @abstractmethod
    def closed(self) -> bool: ...

    def writable(self) -> bool:
        return not self.closed

    def __enter__(self) -> "CheckpointStateOutputStream":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class CheckpointStreamFactory(ABC):
    """Creates the streams that one checkpoint's state is written into.

    ``name_prefix`` (letters, digits, ``_`` and ``-``) starts the name of the stream's file,
    e.g. a Spark task's partition and attempt, so that the files of retried or speculative
    attempts can be told apart; a random part always follows.
    """

    @abstractmethod
    def create_checkpoint_state_output_stream(
        self, scope: CheckpointedStateScope, name_prefix: str = ""
    ) -> CheckpointStateOutputStream: ...


_NAME_PREFIX = re.compile(r"[A-Za-z0-9_-]{0,64}")


def check_name_prefix(name_prefix: str) -> str:
    if not isinstance(name_prefix, str) or not _NAME_PREFIX.fullmatch(name_prefix):
        raise ValueError(
            f"name_prefix must be at most 64 letters, digits, '_' or '-', got {name_prefix!r}"
        )
    return name_prefix


class _InlineNames:
    """Unique names for inline handles: a per-process random prefix and a counter, about 20x
    cheaper than uuid4() on the hot path of many small states. Reseeded after fork, since
    PySpark forks its Python workers."""

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self._prefix = secrets.token_hex(12)
        self._counter = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):08x}"


_inline_names = _InlineNames()


class _Checksum:
    """The CRC-32 of a stream's bytes.

    Past ``_OFFLOAD_AFTER`` bytes it is computed on a helper thread, overlapping with the
    write: zlib and file writes both release the GIL, so on two cores a large local write is
    no longer paced by write + checksum in series. The bounded queue applies backpressure.
    """

    _OFFLOAD_AFTER = 8 * 1024 * 1024
    _BATCH = 1024 * 1024  # bytes per hand-off: one queue operation per write would cost more

    def __init__(self) -> None:
        self._value = 0
        self._seen = 0
        self._batch: list = []
        self._batch_bytes = 0
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None

    def update(self, view: memoryview) -> None:
        self._seen += len(view)
        if self._queue is None:
            if self._seen < self._OFFLOAD_AFTER:
                self._value = zlib.crc32(view, self._value)
                return
            self._queue = queue.Queue(maxsize=16)
            self._thread = threading.Thread(target=self._run, name="state-checksum", daemon=True)
            self._thread.start()
        # The helper reads the bytes later: hand it an immutable copy of mutable buffers.
        self._batch.append(view if view.readonly else bytes(view))
        self._batch_bytes += len(view)
        if self._batch_bytes >= self._BATCH:
            self._hand_off()

    def _hand_off(self) -> None:
        self._queue.put(self._batch)
        self._batch, self._batch_bytes = [], 0

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            for chunk in batch:
                self._value = zlib.crc32(chunk, self._value)

    def finish(self) -> int:
        if self._thread is not None:
            self._hand_off()
            self._queue.put(None)
            self._thread.join()
            self._thread = self._queue = None
        return self._value


def _closed_error() -> StreamClosedError:
    return StreamClosedError("the state stream is closed; create a new stream to write state")


class BufferedStateOutputStream(CheckpointStateOutputStream):
    """Buffers writes up to ``max(buffer_size, threshold)`` bytes; beyond that, hands them
    to ``_write_to_file`` in large pieces. A write or flush that fails aborts the stream (a
    stream that lost bytes must never commit).

    Subclasses implement ``_write_to_file``, ``close_and_get_handle`` and ``close``, and may
    override ``_flush_file`` to push their file's own buffers.
    """

    def __init__(self, buffer_size: int, threshold: int) -> None:
        # Grows on demand up to the capacity: most inline states are far below it.
        self._buffer = bytearray()
        self._capacity = max(buffer_size, threshold, 1)
        self._threshold = threshold
        self._flushed = 0
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def write(self, data) -> int:
        if self._closed:
            raise _closed_error()
        view = memoryview(data).cast("B")
        n = len(view)
        if len(self._buffer) + n <= self._capacity:
            self._buffer += view
            return n
        try:
            self._flush_buffer()
            if n >= self._capacity:
                self._write_to_file(view)
            else:
                self._buffer += view
        except BaseException:
            self.close()
            raise
        return n

    def tell(self) -> int:
        return self._flushed + len(self._buffer)

    def flush(self) -> None:
        if self._closed:
            raise _closed_error()
        if self._has_file() or len(self._buffer) > self._threshold:
            try:
                self._flush_buffer()
                self._flush_file()
            except BaseException:
                self.close()
                raise

    def _flush_buffer(self) -> None:
        if self._buffer:
            self._write_to_file(memoryview(self._buffer))
            self._buffer = bytearray()

    def _flush_file(self) -> None:
        """Push the file's own buffers after a ``flush()``; nothing by default."""

    @abstractmethod
    def _has_file(self) -> bool:
        """Whether bytes already went to a file (so the state can no longer be inline)."""

    @abstractmethod
    def _write_to_file(self, view: memoryview) -> None:
        """Append ``view`` to the stream's file (creating it on first use); count it in
        ``self._flushed``."""


class SegmentStateOutputStream(BufferedStateOutputStream):
    """Buffers up to the inline threshold (an inline handle); beyond it, writes one segment
    into a physical file that holds other streams' segments too (file merging).

    Subclasses implement ``_has_file``, ``_open_segment`` (take a physical file; return the
    offset the segment starts at), ``_append`` (write all of a view to it),
    ``_commit_segment`` (the segment's handle, from ``_start``, ``_flushed`` and ``_crc``),
    ``_abort_segment`` (give the file back after a failure; never raises) and
    ``_inline_directory`` (where an inline handle is named).
    """

    def __init__(self, buffer_size: int, threshold: int) -> None:
        super().__init__(buffer_size, threshold)
        self._start = 0
        self._crc = 0

    def _write_to_file(self, view: memoryview) -> None:
        if not self._has_file():
            self._start = self._open_segment()
        self._append(view)
        self._crc = zlib.crc32(view, self._crc)
        self._flushed += len(view)

    def close_and_get_handle(self) -> StreamStateHandle | None:
        if self._closed:
            raise StreamClosedError("the state stream was already closed or committed")
        if not self._has_file() and len(self._buffer) <= self._threshold:
            self._closed = True
            if not self._buffer:
                return None
            data, self._buffer = bytes(self._buffer), bytearray()
            return ByteStreamStateHandle(join(self._inline_directory(), _inline_names.next()), data)
        try:
            self._flush_buffer()
            handle = self._commit_segment()
        except BaseException:
            self.close()
            raise
        self._closed = True
        return handle

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._buffer = bytearray()
        if self._has_file():
            self._abort_segment()

    @abstractmethod
    def _open_segment(self) -> int: ...

    @abstractmethod
    def _append(self, view: memoryview) -> None: ...

    @abstractmethod
    def _commit_segment(self) -> StreamStateHandle: ...

    @abstractmethod
    def _abort_segment(self) -> None: ...

    @abstractmethod
    def _inline_directory(self) -> str: ...


class FsCheckpointStateOutputStream(BufferedStateOutputStream):
    """Buffers up to the inline threshold; beyond it, streams into a lazily created file.

    ``directory`` returns the directory URL for the file (called once, when the file is
    created: entropy injection draws fresh characters per file). Files get UUID names and are
    never overwritten; the stream issues no exists/mkdir calls.
    """

    def __init__(
        self,
        fs: AbstractFileSystem,
        directory: Callable[[], str],
        buffer_size: int,
        threshold: int,
        relative: bool,
        name_prefix: str = "",
    ) -> None:
        super().__init__(buffer_size, threshold)
        self._fs = fs
        self._directory = directory
        self._name_prefix = check_name_prefix(name_prefix)
        self._relative = relative
        self._file = None
        self._file_url: str | None = None
        self._file_dir: str | None = None
        self._file_name: str | None = None
        self._checksum = _Checksum()

    def _has_file(self) -> bool:
        return self._file is not None

    def _flush_file(self) -> None:
        self._file.flush()

    def _write_to_file(self, view: memoryview) -> None:
        if self._file is None:
            self._open_file()
        self._file.write(view)
        self._checksum.update(view)
        self._flushed += len(view)

    def _open_file(self) -> None:
        directory = self._directory()
        name = self._name_prefix + uuid.uuid4().hex
        path = join(directory, name)
        fs_path = self._fs._strip_protocol(path)
        try:
            self._file = self._fs.open(fs_path, "wb")
        except BaseException:
            # The open may have created the file before failing (local disk creates it on
            # open): no handle means nobody else would ever delete it.
            with contextlib.suppress(Exception):
                self._fs.rm_file(fs_path)
            raise
        self._file_url, self._file_dir, self._file_name = path, directory, name

    def close_and_get_handle(self) -> StreamStateHandle | None:
        if self._closed:
            raise StreamClosedError("the state stream was already closed or committed")
        try:
            if self._file is None:
                if not self._buffer:
                    self._closed = True
                    return None
                if len(self._buffer) <= self._threshold:
                    self._closed = True
                    name = join(self._directory(), _inline_names.next())
                    return ByteStreamStateHandle(name, bytes(self._buffer))
            self._flush_buffer()
            self._file.close()
        except BaseException:
            self.close()
            raise
        self._closed = True
        self._buffer = bytearray()
        size, crc, fs = self._flushed, self._checksum.finish(), self._fs
        if self._relative:
            return RelativeFileStateHandle(
                self._file_url, self._file_name, size, crc, filesystem=fs
            )
        return FileStateHandle(self._file_url, size, crc, filesystem=fs)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._buffer = bytearray()
        self._checksum.finish()  # stops the helper thread, if any
        if self._file is not None:
            abort_file(self._fs, self._file, self._fs._strip_protocol(self._file_url))


class MemoryCheckpointStateOutputStream(CheckpointStateOutputStream):
    """Keeps all state in memory; fails at commit when larger than ``max_size``."""

    def __init__(self, name: Callable[[], str], max_size: int) -> None:
        self._name = name
        self._max_size = max_size
        self._out: io.BytesIO | None = io.BytesIO()

    @property
    def closed(self) -> bool:
        return self._out is None

    def write(self, data) -> int:
        if self._out is None:
            raise _closed_error()
        return self._out.write(data)

    def tell(self) -> int:
        if self._out is None:
            raise _closed_error()
        return self._out.tell()

    def flush(self) -> None:
        if self._out is None:
            raise _closed_error()

    def close_and_get_handle(self) -> ByteStreamStateHandle | None:
        if self._out is None:
            raise StreamClosedError("the state stream was already closed or committed")
        data, self._out = self._out.getvalue(), None
        if not data:
            return None
        if len(data) > self._max_size:
            raise StateSizeExceededError(
                f"state of {len(data)} bytes exceeds the maximum state size of "
                f"{self._max_size} bytes of MemoryCheckpointStorage; use "
                "FileSystemCheckpointStorage for state of this size"
            )
        return ByteStreamStateHandle(self._name(), data)

    def close(self) -> None:
        self._out = None


class FsCheckpointStreamFactory(CheckpointStreamFactory):
    """Streams for EXCLUSIVE state into ``exclusive_dir``, SHARED state into ``shared_dir`` and
    task-owned state into ``task_owned_dir``.

    Exclusive files are recorded relative to their directory (so savepoints relocate) unless
    entropy is injected into their paths. A savepoint passes its own directory for all three
    and ``self_contained=True``: every file is then recorded relative to it.
    """

    def __init__(
        self,
        fs: AbstractFileSystem,
        exclusive_dir: str,
        shared_dir: str,
        task_owned_dir: str,
        *,
        threshold: int,
        buffer_size: int,
        entropy=None,
        self_contained: bool = False,
    ) -> None:
        self._fs = fs
        self._exclusive_dir = exclusive_dir
        self._shared_dir = shared_dir
        self._task_owned_dir = task_owned_dir
        self._threshold = threshold
        self._buffer_size = max(buffer_size, threshold)
        self._entropy = entropy
        self._self_contained = self_contained

    def _target(self, directory: str) -> Callable[[], str]:
        if self._entropy is None:
            return lambda: directory
        return lambda: self._entropy.inject(directory)

    def create_checkpoint_state_output_stream(
        self, scope: CheckpointedStateScope, name_prefix: str = ""
    ) -> CheckpointStateOutputStream:
        if scope is CheckpointedStateScope.EXCLUSIVE:
            directory, relative = self._exclusive_dir, True
        elif scope is CheckpointedStateScope.SHARED:
            directory, relative = self._shared_dir, self._self_contained
        else:
            raise TypeError(f"scope must be a CheckpointedStateScope, got {scope!r}")
        return FsCheckpointStateOutputStream(
            self._fs,
            self._target(directory),
            self._buffer_size,
            self._threshold,
            relative and self._entropy is None,
            name_prefix,
        )

    def create_task_owned_state_stream(self) -> CheckpointStateOutputStream:
        """A stream into the task-owned directory, which the coordinator never deletes."""
        return FsCheckpointStateOutputStream(
            self._fs,
            self._target(self._task_owned_dir),
            self._buffer_size,
            self._threshold,
            self._self_contained and self._entropy is None,
        )


class MemCheckpointStreamFactory(CheckpointStreamFactory):
    """Streams that keep state in memory (Flink's MemCheckpointStreamFactory)."""

    def __init__(self, max_state_size: int, name_prefix: str = "memory") -> None:
        self._max_state_size = max_state_size
        self._name_prefix = name_prefix

    def create_checkpoint_state_output_stream(
        self, scope: CheckpointedStateScope, name_prefix: str = ""
    ) -> CheckpointStateOutputStream:
        if not isinstance(scope, CheckpointedStateScope):
            raise TypeError(f"scope must be a CheckpointedStateScope, got {scope!r}")
        check_name_prefix(name_prefix)
        return MemoryCheckpointStateOutputStream(
            lambda: f"{self._name_prefix}/{_inline_names.next()}", self._max_state_size
        )
