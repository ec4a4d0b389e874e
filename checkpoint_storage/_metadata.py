"""`_metadata`: the data model of a completed checkpoint and its on-storage encoding.

The encoding is specified in docs/metadata-format.md. Decoding is fail-closed: every length is
checked against the bytes that remain before anything is allocated, the body carries a CRC-32,
and every path is checked against the checkpoint's roots before a handle is built.

Every `_metadata` is read through ``read_metadata_bytes``: its header is read and recognised
first (this library's, Apache Flink's, or unknown), then at most ``MAX_METADATA_BYTES``; a file
that cannot be opened raises ``UnreadableCheckpointError`` naming it, never a bare errno.
"""

import dataclasses
import enum
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from checkpoint_storage._filesystems import PathRoots, check_relative_path, join
from checkpoint_storage._handles import (
    ByteStreamStateHandle,
    FileStateHandle,
    RelativeFileStateHandle,
    SegmentFileStateHandle,
    StreamStateHandle,
)
from checkpoint_storage._ids import JobID
from checkpoint_storage._references import CheckpointedStateScope
from checkpoint_storage.exceptions import (
    CheckpointIdMismatchError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    ForeignCheckpointError,
    InvalidCheckpointError,
    UnreadableCheckpointError,
    UnsafePathError,
)

__all__ = [
    "CheckpointMetadata",
    "CheckpointProperties",
    "MAX_METADATA_BYTES",
    "OperatorState",
    "OperatorSubtaskState",
    "SavepointFormatType",
    "SnapshotType",
    "load_checkpoint_metadata",
    "store_checkpoint_metadata",
]


class SnapshotType(enum.Enum):
    """The kind of a snapshot (Flink's ``SnapshotType``): a regular checkpoint, a full
    checkpoint (one that references no state of earlier checkpoints), or a savepoint."""

    CHECKPOINT = 0
    FULL_CHECKPOINT = 1
    SAVEPOINT = 2


class SavepointFormatType(enum.Enum):
    """The format a savepoint's state is written in (Flink's ``SavepointFormatType``):
    canonical (independent of how the job keeps its state) or native (as it keeps it)."""

    CANONICAL = 0
    NATIVE = 1


@dataclass(frozen=True)
class CheckpointProperties:
    """What kind of snapshot this is (Flink's CheckpointProperties/SnapshotType)."""

    snapshot_type: SnapshotType = SnapshotType.CHECKPOINT
    format_type: SavepointFormatType = SavepointFormatType.CANONICAL

    @classmethod
    def for_checkpoint(cls) -> "CheckpointProperties":
        return cls(SnapshotType.CHECKPOINT)

    @classmethod
    def for_full_checkpoint(cls) -> "CheckpointProperties":
        return cls(SnapshotType.FULL_CHECKPOINT)

    @classmethod
    def for_savepoint(
        cls, format_type: SavepointFormatType = SavepointFormatType.CANONICAL
    ) -> "CheckpointProperties":
        return cls(SnapshotType.SAVEPOINT, format_type)

    def is_savepoint(self) -> bool:
        return self.snapshot_type is SnapshotType.SAVEPOINT


@dataclass(frozen=True)
class OperatorSubtaskState:
    """The state handles one subtask (e.g. one Spark partition) wrote, plus string properties."""

    handles: tuple[StreamStateHandle, ...] = ()
    properties: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "handles", tuple(self.handles))
        object.__setattr__(self, "properties", dict(self.properties))
        for handle in self.handles:
            if not isinstance(handle, StreamStateHandle):
                raise TypeError(f"handles must be StreamStateHandles, got {handle!r}")
        for key, value in self.properties.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError("subtask properties map str to str")


@dataclass(frozen=True)
class OperatorState:
    """One operator's (stage's) state: its parallelism and each subtask's state."""

    operator_id: str
    parallelism: int
    max_parallelism: int | None = None
    subtask_states: Mapping[int, OperatorSubtaskState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.operator_id, str) or not self.operator_id:
            raise ValueError("operator_id must be a non-empty string")
        if not isinstance(self.parallelism, int) or not 1 <= self.parallelism < 2**31:
            raise ValueError(f"parallelism must be in [1, 2^31), got {self.parallelism!r}")
        if self.max_parallelism is not None and not (
            isinstance(self.max_parallelism, int)
            and self.parallelism <= self.max_parallelism < 2**31
        ):
            raise ValueError(
                f"max_parallelism must be in [parallelism, 2^31), got {self.max_parallelism!r}"
            )
        states = dict(sorted(self.subtask_states.items()))
        for index, state in states.items():
            if not isinstance(index, int) or not 0 <= index < self.parallelism:
                raise ValueError(f"subtask index {index!r} outside [0, {self.parallelism})")
            if not isinstance(state, OperatorSubtaskState):
                raise TypeError(f"subtask states must be OperatorSubtaskState, got {state!r}")
        object.__setattr__(self, "subtask_states", states)

    @property
    def state_size(self) -> int:
        return sum(h.state_size for s in self.subtask_states.values() for h in s.handles)


@dataclass(frozen=True)
class CheckpointMetadata:
    """Everything `_metadata` holds: the checkpoint's identity, kind, master states (small
    named blobs such as source positions) and operator states.

    ``lease_epoch`` is the fencing epoch of the job lease the coordinator held when it
    published the checkpoint (None: published without a lease, or format version 1). A
    location created while the access holds a lease stamps it in; see ``JobLease``."""

    checkpoint_id: int
    operator_states: tuple[OperatorState, ...] = ()
    master_states: Mapping[str, bytes] = field(default_factory=dict)
    properties: CheckpointProperties = field(default_factory=CheckpointProperties)
    job_id: JobID | None = None
    timestamp_ms: int | None = None
    lease_epoch: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoint_id, int) or not 0 <= self.checkpoint_id < 2**63:
            raise ValueError(f"checkpoint_id must be in [0, 2^63), got {self.checkpoint_id!r}")
        if self.job_id is not None:
            object.__setattr__(self, "job_id", JobID.of(self.job_id))
        if self.timestamp_ms is not None and not (
            isinstance(self.timestamp_ms, int) and -(2**63) <= self.timestamp_ms < 2**63
        ):
            raise ValueError(f"timestamp_ms must be a 64-bit int, got {self.timestamp_ms!r}")
        if self.lease_epoch is not None and not (
            isinstance(self.lease_epoch, int)
            and not isinstance(self.lease_epoch, bool)
            and 1 <= self.lease_epoch < 2**63
        ):
            raise ValueError(f"lease_epoch must be in [1, 2^63), got {self.lease_epoch!r}")
        object.__setattr__(self, "operator_states", tuple(self.operator_states))
        ids = [op.operator_id for op in self.operator_states]
        if len(set(ids)) != len(ids):
            raise ValueError(f"operator ids must be unique, got {ids}")
        masters = dict(self.master_states)
        for name, value in masters.items():
            if not isinstance(name, str) or not isinstance(value, bytes | bytearray):
                raise TypeError("master states map str to bytes")
        object.__setattr__(self, "master_states", {k: bytes(v) for k, v in masters.items()})

    @property
    def state_size(self) -> int:
        return sum(op.state_size for op in self.operator_states)

    def all_handles(self) -> list[StreamStateHandle]:
        return [
            h for op in self.operator_states for s in op.subtask_states.values() for h in s.handles
        ]


# --- encoding ----------------------------------------------------------------------------

MAGIC = b"\x89CKPT\r\n\x1a"
FORMAT_VERSION = 2  # 2: the lease epoch is appended to the body
READABLE_VERSIONS = (1, 2)
_HEADER = struct.Struct(">8sHHQI")  # magic, version, flags, body length, body CRC-32
HEADER_SIZE = _HEADER.size
MAX_METADATA_BYTES = 64 * 1024 * 1024
"""The largest `_metadata` this library writes or reads (inline state included)."""
FLINK_MAGIC = 0x4960672D
"""Apache Flink's `_metadata` starts with this big-endian int, then its format version (int)."""
_FLINK_HEADER = struct.Struct(">iI")
FLINK = "Apache Flink"

_TAG_BYTES = 1
_TAG_FILE = 2
_TAG_RELATIVE_FILE = 3
_TAG_SEGMENT = 4
_SCOPES = (CheckpointedStateScope.EXCLUSIVE, CheckpointedStateScope.SHARED)  # encoded 0, 1

_U8 = struct.Struct(">B")
_U32 = struct.Struct(">I")
_I32 = struct.Struct(">i")
_U64 = struct.Struct(">Q")
_I64 = struct.Struct(">q")


class _Writer:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def u8(self, v: int) -> None:
        self.parts.append(_U8.pack(v))

    def u32(self, v: int) -> None:
        self.parts.append(_U32.pack(v))

    def u64(self, v: int) -> None:
        self.parts.append(_U64.pack(v))

    def blob(self, v: bytes) -> None:
        self.u32(len(v))
        self.parts.append(bytes(v))

    def text(self, v: str) -> None:
        self.blob(v.encode("utf-8"))

    def optional(self, v: int | None, packer: struct.Struct) -> None:
        self.u8(v is not None)
        if v is not None:
            self.parts.append(packer.pack(v))


def encode_metadata(metadata: CheckpointMetadata) -> bytes:
    """The complete `_metadata` bytes: header, then body."""
    w = _Writer()
    w.u64(metadata.checkpoint_id)
    w.u8(metadata.job_id is not None)
    if metadata.job_id is not None:
        w.parts.append(bytes.fromhex(metadata.job_id.hex))
    w.optional(metadata.timestamp_ms, _I64)
    w.u8(metadata.properties.snapshot_type.value)
    w.u8(metadata.properties.format_type.value)
    w.u32(len(metadata.master_states))
    for name, value in metadata.master_states.items():
        w.text(name)
        w.blob(value)
    w.u32(len(metadata.operator_states))
    for op in metadata.operator_states:
        w.text(op.operator_id)
        w.u32(op.parallelism)
        w.parts.append(_I32.pack(-1 if op.max_parallelism is None else op.max_parallelism))
        w.u32(len(op.subtask_states))
        for index, subtask in op.subtask_states.items():
            w.u32(index)
            w.u32(len(subtask.properties))
            for key, value in subtask.properties.items():
                w.text(key)
                w.text(value)
            w.u32(len(subtask.handles))
            for handle in subtask.handles:
                _encode_handle(w, handle)
    w.optional(metadata.lease_epoch, _U64)  # version 2
    body = b"".join(w.parts)
    if HEADER_SIZE + len(body) > MAX_METADATA_BYTES:
        raise ValueError(
            f"this _metadata would have {HEADER_SIZE + len(body)} bytes, more than the "
            f"{MAX_METADATA_BYTES} any reader accepts: keep less state inline (lower "
            "file_state_size_threshold) or fewer master states"
        )
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(body), zlib.crc32(body)) + body


def _encode_handle(w: _Writer, handle: StreamStateHandle) -> None:
    if isinstance(handle, ByteStreamStateHandle):
        w.u8(_TAG_BYTES)
        w.text(handle.handle_name)
        w.blob(handle.data)
    elif isinstance(handle, RelativeFileStateHandle):
        w.u8(_TAG_RELATIVE_FILE)
        w.text(handle.relative_path)
        w.u64(handle.state_size)
        w.optional(handle.checksum, _U32)
    elif isinstance(handle, SegmentFileStateHandle):
        w.u8(_TAG_SEGMENT)
        w.text(handle.path)
        w.u64(handle.start_position)
        w.u64(handle.state_size)
        w.u8(_SCOPES.index(handle.scope))
        w.text(handle.logical_file_id)
        w.optional(handle.checksum, _U32)
    elif isinstance(handle, FileStateHandle):
        w.u8(_TAG_FILE)
        w.text(handle.path)
        w.u64(handle.state_size)
        w.optional(handle.checksum, _U32)
    else:
        raise TypeError(f"cannot store {type(handle).__name__} in _metadata")


class _Reader:
    """Bounds-checked reads over the body; every failure is an InvalidCheckpointError."""

    def __init__(self, data: bytes, source: str) -> None:
        self.data = memoryview(data)
        self.pos = 0
        self.source = source

    def fail(self, what: str) -> InvalidCheckpointError:
        return invalid(self.source, f"{what} at byte {HEADER_SIZE + self.pos}")

    def take(self, n: int) -> memoryview:
        if n > len(self.data) - self.pos:
            raise self.fail(f"{n} bytes announced but only {len(self.data) - self.pos} remain")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, packer: struct.Struct) -> int:
        return packer.unpack(self.take(packer.size))[0]

    def u8(self) -> int:
        return self.unpack(_U8)

    def u32(self) -> int:
        return self.unpack(_U32)

    def u64(self) -> int:
        return self.unpack(_U64)

    def flag(self) -> bool:
        value = self.u8()
        if value > 1:
            raise self.fail(f"flag byte {value}")
        return bool(value)

    def count(self, min_item_size: int) -> int:
        n = self.u32()
        if n * min_item_size > len(self.data) - self.pos:
            raise self.fail(f"count {n} larger than the remaining bytes allow")
        return n

    def blob(self) -> bytes:
        return bytes(self.take(self.u32()))

    def text(self) -> str:
        raw = self.blob()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("invalid UTF-8 text") from None

    def optional(self, packer: struct.Struct) -> int | None:
        return self.unpack(packer) if self.flag() else None

    def enum(self, enum_type: type[enum.Enum]):
        value = self.u8()
        try:
            return enum_type(value)
        except ValueError:
            raise self.fail(f"unknown {enum_type.__name__} {value}") from None


def invalid(source: str, detail: str) -> InvalidCheckpointError:
    return InvalidCheckpointError(
        f"{source} is not a valid or complete checkpoint ({detail}); it was truncated, "
        "corrupted or not written by this library: restore from another checkpoint"
    )


def check_metadata_header(header: bytes, source: str) -> None:
    """Recognise the first bytes of a `_metadata` (up to ``HEADER_SIZE`` of them) before its
    body is read. Raises ``ForeignCheckpointError`` for Apache Flink's format, an unknown
    format or a newer version of this library's, and ``InvalidCheckpointError`` for a file of
    this library's too short to hold the header."""
    if len(header) >= 4 and header[:4] == FLINK_MAGIC.to_bytes(4, "big"):
        version = _FLINK_HEADER.unpack_from(header)[1] if len(header) >= 8 else None
        raise ForeignCheckpointError(
            f"{source} was written by Apache Flink (metadata format version "
            f"{'unknown' if version is None else version}); this library cannot read it (not a "
            "valid checkpoint of this library): restore it with Apache Flink; this library "
            "never deletes or rewrites it",
            format_name=FLINK,
            format_version=version,
        )
    if len(header) < len(MAGIC) and MAGIC.startswith(header):
        raise invalid(source, f"{len(header)} bytes, shorter than the {HEADER_SIZE}-byte header")
    if header[: len(MAGIC)] != MAGIC:
        raise ForeignCheckpointError(
            f"{source} is not a valid or complete checkpoint (it starts with "
            f"{header[:8].hex(' ') or 'nothing'}, neither this library's magic number nor "
            "Apache Flink's: an unknown format); this library cannot read it and never "
            "deletes it",
            format_name="unknown",
        )
    if len(header) >= len(MAGIC) + 2:
        version = int.from_bytes(header[len(MAGIC) : len(MAGIC) + 2], "big")
        if version > FORMAT_VERSION:
            raise ForeignCheckpointError(
                f"{source} is not a valid checkpoint for this library version: format version "
                f"{version}, this library reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}; upgrade the library "
                "to read newer checkpoints",
                format_name="newer version",
                format_version=version,
            )


def read_metadata_bytes(handle: StreamStateHandle, source: str) -> bytes:
    """The bytes of a `_metadata`, read safely: the header first (a foreign or newer format is
    refused before its body is read), then at most ``MAX_METADATA_BYTES``. Raises
    ``CheckpointNotFoundError`` when it vanished, ``UnreadableCheckpointError`` (naming the
    file) when it cannot be opened or read, ``InvalidCheckpointError`` when it is too large.

    The caller checked that ``handle`` names a regular file (``resolve_checkpoint_pointer``
    does), so opening it cannot block on a FIFO.
    """
    try:
        with handle.open() as f:
            header = _read_up_to(f, HEADER_SIZE)
            check_metadata_header(header, source)
            if handle.state_size > MAX_METADATA_BYTES:
                raise invalid(
                    source,
                    f"{handle.state_size} bytes, more than the {MAX_METADATA_BYTES} a "
                    "`_metadata` may have",
                )
            rest = _read_up_to(f, MAX_METADATA_BYTES + 1 - len(header))
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"{source} disappeared: the checkpoint was disposed after it was resolved"
        ) from exc
    except CheckpointStorageError:
        raise
    except OSError as exc:
        raise unreadable(source, exc) from exc
    data = header + rest
    if len(data) > MAX_METADATA_BYTES:
        raise invalid(source, f"more than the {MAX_METADATA_BYTES} bytes a `_metadata` may have")
    return data


def _read_up_to(f, n: int) -> bytes:
    parts, remaining = [], n
    while remaining > 0:
        chunk = f.read(min(remaining, 1 << 20))
        if not chunk:
            break
        parts.append(chunk)
        remaining -= len(chunk)
    return b"".join(parts)


def unreadable(source: str, exc: BaseException) -> UnreadableCheckpointError:
    """The error for a `_metadata` that exists but cannot be opened or read."""
    reason = getattr(exc, "strerror", None) or " ".join(str(exc).split()) or type(exc).__name__
    return UnreadableCheckpointError(
        f"cannot read {source} ({reason}): this says nothing about the checkpoint's validity, "
        "so it is neither used nor deleted. Make it a readable file (check its permissions, "
        "or whether it is a link to nowhere) or move the checkpoint directory aside; "
        "`checkpoints list` shows the other checkpoints"
    )


def decode_metadata(
    data: bytes,
    *,
    source: str,
    directory: str,
    roots: PathRoots,
    filesystem=None,
    checkpoint_id: int | None = None,
) -> CheckpointMetadata:
    """Parse `_metadata` bytes; relative handles resolve against ``directory``. With
    ``checkpoint_id`` (the id of its ``chk-<id>`` directory) the id inside must equal it, else
    ``CheckpointIdMismatchError`` (checked before any handle path)."""
    check_metadata_header(data[:HEADER_SIZE], source)
    if len(data) < HEADER_SIZE:
        raise invalid(source, f"{len(data)} bytes, shorter than the {HEADER_SIZE}-byte header")
    magic, version, flags, length, crc = _HEADER.unpack_from(data)
    if version not in READABLE_VERSIONS:
        raise invalid(
            source,
            f"format version {version}; this library reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))} "
            "(upgrade the library to read newer checkpoints)",
        )
    if flags != 0:
        raise invalid(source, f"unknown flags {flags:#x}")
    if length != len(data) - HEADER_SIZE:
        raise invalid(source, f"body of {len(data) - HEADER_SIZE} bytes, header says {length}")
    body = data[HEADER_SIZE:]
    if zlib.crc32(body) != crc:
        raise invalid(source, "body checksum mismatch")
    r = _Reader(body, source)
    if checkpoint_id is not None and len(body) >= _U64.size:
        found = _U64.unpack_from(body)[0]
        if found != checkpoint_id:
            raise CheckpointIdMismatchError(
                f"{source} holds checkpoint {found} but its directory is chk-{checkpoint_id}: "
                f"a copied or renamed checkpoint directory, skipped (id {found} != "
                f"{checkpoint_id}); its files are kept. Move it back to chk-{found} or dispose it"
            )
    try:
        metadata = _decode_body(r, directory, roots, filesystem, version)
    except (InvalidCheckpointError, UnsafePathError):
        raise  # a path outside the roots is a security verdict, reported as such
    except (ValueError, TypeError) as exc:
        raise r.fail(str(exc)) from None
    if r.pos != len(body):
        raise r.fail(f"{len(body) - r.pos} trailing bytes")
    return metadata


def _decode_body(
    r: _Reader, directory: str, roots: PathRoots, fs, version: int
) -> CheckpointMetadata:
    checkpoint_id = r.u64()
    job_id = JobID(bytes(r.take(16)).hex()) if r.flag() else None
    timestamp_ms = r.optional(_I64)
    properties = CheckpointProperties(r.enum(SnapshotType), r.enum(SavepointFormatType))
    master_states = {}
    for _ in range(r.count(8)):
        name = r.text()
        if name in master_states:
            raise r.fail(f"duplicate master state {name!r}")
        master_states[name] = r.blob()
    operator_states = []
    for _ in range(r.count(16)):
        operator_id = r.text()
        parallelism = r.u32()
        max_parallelism = r.unpack(_I32)
        subtasks = {}
        for _ in range(r.count(12)):
            index = r.u32()
            if index in subtasks:
                raise r.fail(f"duplicate subtask {index}")
            properties_ = {}
            for _ in range(r.count(8)):
                key = r.text()
                properties_[key] = r.text()
            handles = tuple(_decode_handle(r, directory, roots, fs) for _ in range(r.count(1)))
            subtasks[index] = OperatorSubtaskState(handles, properties_)
        operator_states.append(
            OperatorState(
                operator_id,
                parallelism,
                None if max_parallelism == -1 else max_parallelism,
                subtasks,
            )
        )
    lease_epoch = r.optional(_U64) if version >= 2 else None
    return CheckpointMetadata(
        checkpoint_id,
        tuple(operator_states),
        master_states,
        properties,
        job_id,
        timestamp_ms,
        lease_epoch,
    )


def _decode_handle(r: _Reader, directory: str, roots: PathRoots, fs) -> StreamStateHandle:
    tag = r.u8()
    if tag == _TAG_BYTES:
        return ByteStreamStateHandle(r.text(), r.blob())
    if tag == _TAG_RELATIVE_FILE:
        relative = check_relative_path(r.text())
        size, checksum = r.u64(), r.optional(_U32)
        path = roots.check(join(directory, relative))
        return RelativeFileStateHandle(path, relative, size, checksum, filesystem=fs)
    if tag == _TAG_FILE:
        path = roots.check(r.text())
        size, checksum = r.u64(), r.optional(_U32)
        return FileStateHandle(path, size, checksum, filesystem=fs)
    if tag == _TAG_SEGMENT:
        path = roots.check(r.text())
        start, size = r.u64(), r.u64()
        if start + size >= 2**63:
            raise r.fail(f"segment [{start}, {start + size}) beyond 2^63")
        scope = r.u8()
        if scope >= len(_SCOPES):
            raise r.fail(f"unknown segment scope {scope}")
        logical_file_id, checksum = r.text(), r.optional(_U32)
        return SegmentFileStateHandle(
            path, start, size, _SCOPES[scope], logical_file_id, checksum, filesystem=fs
        )
    raise r.fail(f"unknown state handle type {tag}")


def store_checkpoint_metadata(metadata: CheckpointMetadata, out) -> None:
    """Write ``metadata`` into a metadata output stream (then call its
    ``close_and_finalize_checkpoint()``). A stream of a location created under a job lease
    stamps the lease's epoch into the metadata (``lease_epoch``)."""
    if not isinstance(metadata, CheckpointMetadata):
        raise TypeError(f"expected CheckpointMetadata, got {type(metadata).__name__}")
    out.write(encode_metadata(with_lease_epoch(metadata, getattr(out, "lease_epoch", None))))


def with_lease_epoch(metadata: CheckpointMetadata, epoch: int | None) -> CheckpointMetadata:
    """``metadata`` stamped with ``epoch`` (unchanged when ``epoch`` is None or already
    there); a different epoch already in it is refused (``ValueError``)."""
    if epoch is None or metadata.lease_epoch == epoch:
        return metadata
    if metadata.lease_epoch is not None:
        raise ValueError(
            f"the metadata records lease epoch {metadata.lease_epoch}, but this location was "
            f"created under lease epoch {epoch}"
        )
    return dataclasses.replace(metadata, lease_epoch=epoch)


def load_checkpoint_metadata(completed_location) -> CheckpointMetadata:
    """Read and validate the `_metadata` of a completed checkpoint or savepoint."""
    return completed_location.load_metadata()
