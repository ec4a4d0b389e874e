"""State handles: what a state stream returns and `_metadata` records."""

import contextlib
import io
import zlib
from abc import ABC, abstractmethod
from typing import BinaryIO

from fsspec import AbstractFileSystem

from checkpoint_storage._filesystems import url_to_fs
from checkpoint_storage._references import CheckpointedStateScope
from checkpoint_storage.exceptions import StateIntegrityError

__all__ = [
    "ByteStreamStateHandle",
    "FileStateHandle",
    "RelativeFileStateHandle",
    "SegmentFileStateHandle",
    "StreamStateHandle",
]

_VERIFY_CHUNK = 1 << 20


class StreamStateHandle(ABC):
    """A piece of state that can be read back as a byte stream.

    Implementations provide ``state_size``, ``open()`` and ``discard_state()``.
    """

    __slots__ = ()

    @property
    @abstractmethod
    def state_size(self) -> int: ...

    @abstractmethod
    def open(self) -> BinaryIO:
        """A binary reader of the state; file handles verify size and checksum as it reads."""

    @abstractmethod
    def discard_state(self) -> None:
        """Delete the state's storage; idempotent."""


class ByteStreamStateHandle(StreamStateHandle):
    """State small enough to be kept inline, in `_metadata` itself."""

    __slots__ = ("handle_name", "data")

    def __init__(self, handle_name: str, data: bytes) -> None:
        if handle_name is None or data is None:
            raise TypeError("handle_name and data must not be None")
        self.handle_name = handle_name
        self.data = bytes(data)

    @property
    def state_size(self) -> int:
        return len(self.data)

    def open(self) -> BinaryIO:
        return io.BytesIO(self.data)

    def discard_state(self) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        # As in Flink: identity is the name, the bytes are the payload.
        if not isinstance(other, ByteStreamStateHandle):
            return NotImplemented
        return self.handle_name == other.handle_name

    def __hash__(self) -> int:
        return hash(self.handle_name)

    def __repr__(self) -> str:
        return f"ByteStreamStateHandle({self.handle_name!r}, {len(self.data)} bytes)"

    def __reduce__(self):
        return (ByteStreamStateHandle, (self.handle_name, self.data))


class _StoredStateHandle(StreamStateHandle):
    """State stored in (part of) a file at ``path``: the size, checksum and filesystem
    bookkeeping that file and segment handles share."""

    __slots__ = ("path", "_state_size", "checksum", "_filesystem")

    def __init__(
        self,
        path: str,
        state_size: int,
        checksum: int | None,
        filesystem: AbstractFileSystem | None,
    ) -> None:
        if path is None:
            raise TypeError("path must not be None")
        if isinstance(state_size, bool) or not isinstance(state_size, int) or state_size < 0:
            raise ValueError(f"state_size must be a non-negative int, got {state_size!r}")
        if checksum is not None and not (0 <= checksum <= 0xFFFFFFFF):
            raise ValueError(f"checksum must be an unsigned 32-bit int, got {checksum!r}")
        self.path = path
        self._state_size = state_size
        self.checksum = checksum
        self._filesystem = filesystem

    @property
    def state_size(self) -> int:
        return self._state_size

    @property
    def filesystem(self) -> AbstractFileSystem:
        if self._filesystem is None:
            self._filesystem = url_to_fs(self.path)[0]
        return self._filesystem

    def _fs_path(self) -> str:
        return self.filesystem._strip_protocol(self.path)


class FileStateHandle(_StoredStateHandle):
    """State in a file, addressed by its absolute URL.

    ``checksum`` is the CRC-32 of the file's bytes; reading through ``open()`` fails with
    ``StateIntegrityError`` when the file's size or checksum differ. ``filesystem`` is the
    fsspec filesystem to read it with (resolved from the URL when not given).
    """

    __slots__ = ()

    def __init__(
        self,
        path: str,
        state_size: int,
        checksum: int | None = None,
        *,
        filesystem: AbstractFileSystem | None = None,
    ) -> None:
        super().__init__(path, state_size, checksum, filesystem)

    def open(self) -> BinaryIO:
        raw = _open_checked(
            self,
            self._state_size,
            True,
            f"state file {self.path} has {{actual}} bytes, its handle records {self._state_size}",
        )
        return _VerifyingReader(raw, f"state file {self.path}", self._state_size, self.checksum)

    def discard_state(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filesystem.rm_file(self._fs_path())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FileStateHandle):
            return NotImplemented
        return self.path == other.path

    def __hash__(self) -> int:
        return hash(self.path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, {self._state_size} bytes)"

    def __reduce__(self):
        return (_rebuild_file_handle, (type(self), self._init_args(), self._filesystem))

    def _init_args(self) -> tuple:
        return (self.path, self._state_size, self.checksum)


class RelativeFileStateHandle(FileStateHandle):
    """A file handle recorded relative to its checkpoint directory, so that the directory
    (a savepoint) can be moved and still restores."""

    __slots__ = ("relative_path",)

    def __init__(
        self,
        path: str,
        relative_path: str,
        state_size: int,
        checksum: int | None = None,
        *,
        filesystem: AbstractFileSystem | None = None,
    ) -> None:
        super().__init__(path, state_size, checksum, filesystem=filesystem)
        if relative_path is None:
            raise TypeError("relative_path must not be None")
        self.relative_path = relative_path

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RelativeFileStateHandle):
            return NotImplemented
        return (self.path, self.relative_path) == (other.path, other.relative_path)

    def __hash__(self) -> int:
        return hash((self.path, self.relative_path))

    def _init_args(self) -> tuple:
        return (self.path, self.relative_path, self._state_size, self.checksum)


class SegmentFileStateHandle(_StoredStateHandle):
    """A segment of a physical file that file merging packed many states into (Flink's
    SegmentFileStateHandle): ``state_size`` bytes from ``start_position`` of ``path``.

    Reading it returns exactly its segment, verified against ``checksum`` (the CRC-32 of the
    segment's bytes) when it records one. ``discard_state()`` does nothing: the physical file
    holds other segments too. The worker's ``FileMergingSnapshotManager`` deletes its files
    once no segment in them is referenced; the shared-state registry deletes an appended
    file (``is_appended_segment``) once no retained checkpoint references a segment in it.
    """

    __slots__ = ("start_position", "scope", "logical_file_id")

    def __init__(
        self,
        path: str,
        start_position: int,
        state_size: int,
        scope: CheckpointedStateScope,
        logical_file_id: str,
        checksum: int | None = None,
        *,
        filesystem: AbstractFileSystem | None = None,
    ) -> None:
        if path is None or scope is None or logical_file_id is None:
            raise TypeError("path, scope and logical_file_id must not be None")
        for name, value in (("start_position", start_position), ("state_size", state_size)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
                raise ValueError(f"{name} must be an int in [0, 2^63), got {value!r}")
        if not isinstance(scope, CheckpointedStateScope):
            raise TypeError(f"scope must be a CheckpointedStateScope, got {scope!r}")
        if not isinstance(logical_file_id, str) or not logical_file_id:
            raise ValueError(f"logical_file_id must be a non-empty str, got {logical_file_id!r}")
        super().__init__(path, state_size, checksum, filesystem)
        self.start_position = start_position
        self.scope = scope
        self.logical_file_id = logical_file_id

    @property
    def end_position(self) -> int:
        return self.start_position + self._state_size

    def open(self) -> BinaryIO:
        segment = f"segment [{self.start_position}, {self.end_position}) of {self.path}"
        raw = _open_checked(
            self,
            self.end_position,
            False,
            f"physical file {self.path} has {{actual}} bytes, too few for the {segment}",
        )
        return _VerifyingReader(raw, segment, self._state_size, self.checksum, self.start_position)

    def discard_state(self) -> None:
        """Nothing: the worker-side file merging manager owns the physical file."""

    def _key(self) -> tuple:
        return (self.path, self.start_position, self._state_size, self.scope, self.logical_file_id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SegmentFileStateHandle):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"SegmentFileStateHandle({self.path!r}, [{self.start_position}, "
            f"{self.end_position}), {self.scope.value}, {self.logical_file_id!r})"
        )

    def __reduce__(self):
        return (
            _rebuild_segment_handle,
            (
                self.path,
                self.start_position,
                self._state_size,
                self.scope.value,
                self.logical_file_id,
                self.checksum,
                self._filesystem,
            ),
        )


def _rebuild_segment_handle(path, start, size, scope, logical_file_id, checksum, filesystem):
    return SegmentFileStateHandle(
        path,
        start,
        size,
        CheckpointedStateScope(scope),
        logical_file_id,
        checksum,
        filesystem=filesystem,
    )


def _rebuild_file_handle(cls, args, filesystem):
    return cls(*args, filesystem=filesystem)


class _VerifyingReader(io.RawIOBase):
    """Reads bytes ``[start, start + size)`` of ``raw`` (a whole state file, or one segment of
    a physical file) and fails with ``StateIntegrityError`` unless their CRC-32 matches.

    The checksum is checked once the reader reaches the end sequentially. A seek away from the
    sequential position verifies the rest first, so random access (e.g. Parquet footers) is
    verified too. The caller checks the file's size before handing it over.
    """

    def __init__(self, raw, what: str, size: int, checksum: int | None, start: int = 0) -> None:
        super().__init__()
        self._raw, self._what, self._size, self._expected = raw, what, size, checksum
        self._start = start
        self._pos = 0
        self._crc = 0
        self._verified_upto = size if checksum is None else 0
        raw.seek(start)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:
        remaining = self._size - self._pos
        n = remaining if size is None or size < 0 else min(size, remaining)
        data = self._raw.read(n) if n > 0 else b""
        if self._pos == self._verified_upto and self._verified_upto < self._size:
            self._crc = zlib.crc32(data, self._crc)
            self._verified_upto += len(data)
            self._check_if_complete()
        self._pos += len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self.read(-1)

    def _check_if_complete(self) -> None:
        if self._verified_upto >= self._size and self._crc != self._expected:
            raise StateIntegrityError(
                f"{self._what} does not match the checksum its handle records: the file is "
                "corrupt; restore from another checkpoint"
            )

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = {
            io.SEEK_SET: offset,
            io.SEEK_CUR: self._pos + offset,
            io.SEEK_END: self._size + offset,
        }[whence]
        target = max(0, min(target, self._size))
        if target != self._verified_upto and self._verified_upto < self._size:
            self._raw.seek(self._start + self._verified_upto)
            while self._verified_upto < self._size:
                chunk = self._raw.read(min(_VERIFY_CHUNK, self._size - self._verified_upto))
                if not chunk:
                    break
                self._crc = zlib.crc32(chunk, self._crc)
                self._verified_upto += len(chunk)
            self._verified_upto = self._size
            self._check_if_complete()
        self._raw.seek(self._start + target)
        self._pos = target
        return target

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


def _open_checked(handle, minimum_size: int, exact: bool, problem: str):
    """Opens ``handle``'s file, failing with ``StateIntegrityError`` when it is shorter than
    ``minimum_size`` (or, ``exact``, any other size)."""
    raw = handle.filesystem.open(handle._fs_path(), "rb")
    try:
        actual = _file_size(raw)
        if actual < minimum_size or (exact and actual != minimum_size):
            raise StateIntegrityError(
                f"{problem.format(actual=actual)}: the file was truncated or replaced; restore "
                "from another checkpoint"
            )
    except BaseException:
        raw.close()
        raise
    return raw


def _file_size(raw) -> int:
    size = getattr(raw, "size", None)
    if isinstance(size, int):
        return size
    position = raw.tell()
    end = raw.seek(0, io.SEEK_END)
    raw.seek(position)
    return end
