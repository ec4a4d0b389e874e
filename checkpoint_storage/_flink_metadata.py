"""Apache Flink's `_metadata`, read in pure Python (no JVM, no pickle).

Flink writes ``int magic 0x4960672d, int version`` and then the body of its
``MetadataV<version>Serializer``. Versions 3 (Flink 1.11 to 1.15), 4 (adds the trailing
``CheckpointProperties``), 5 (adds operator name and uid) and 6 (Flink 1.20 and 2.x: a new
channel-state encoding) are read; any other version is refused by number, never guessed at.

Every handle type Flink 2.x writes for the filesystem storage and the heap and RocksDB
backends is decoded: byte stream (1), file (2), key groups (3, 12), operator stream (4),
incremental (5, 11), relative file (6), savepoint key groups (7), file-merging segment (15),
empty segment (16) and file-merging operator stream (17). The changelog handles (8-10, 13,
14) and unaligned checkpoints' channel state are refused with a message that says so.

The reader trusts nothing: every count and length is bounded by the bytes remaining, handle
nesting by a small depth, so a truncated or hostile file ends in ``FlinkMetadataError``
(naming the file, the offset and what was being read), never in a crash, a huge allocation
or a loop. The trailing ``CheckpointProperties`` are Java serialization; a small reader of
that grammar (``_flink_java_serialization``: objects, class descriptors, strings, enums, back
references; nothing that runs code) takes out the fields, so nothing is ever unpickled or
deserialized into objects.
"""

from __future__ import annotations

import posixpath
import struct
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from checkpoint_storage._filesystems import check_relative_path
from checkpoint_storage._flink_java_serialization import JavaEnum, JavaObject, read_java_object
from checkpoint_storage.exceptions import FlinkMetadataError, UnsafePathError

FLINK_METADATA_MAGIC = 0x4960672D
SUPPORTED_FLINK_VERSIONS = (3, 4, 5, 6)
"""The `_metadata` format versions this reader knows the layout of (Flink 1.11 to 2.x)."""

_MASTER_STATE_MAGIC = 0xC96B1696
_MAX_DEPTH = 6  # a key-groups stream handle may wrap another; nothing real nests deeper

# Handle tags (MetadataV2V3SerializerBase).
NULL = 0
BYTE_STREAM = 1
FILE = 2
KEY_GROUPS = 3
OPERATOR_STREAM = 4
INCREMENTAL = 5
RELATIVE_FILE = 6
SAVEPOINT_KEY_GROUPS = 7
INCREMENTAL_V2 = 11
KEY_GROUPS_V2 = 12
SEGMENT = 15
EMPTY_SEGMENT = 16
FILE_MERGING_OPERATOR_STREAM = 17
_CHANGELOG_TAGS = {8, 9, 10, 13, 14}

HANDLE_NAMES = {
    BYTE_STREAM: "ByteStreamStateHandle",
    FILE: "FileStateHandle",
    KEY_GROUPS: "KeyGroupsStateHandle",
    OPERATOR_STREAM: "OperatorStreamStateHandle",
    INCREMENTAL: "IncrementalRemoteKeyedStateHandle",
    RELATIVE_FILE: "RelativeFileStateHandle",
    SAVEPOINT_KEY_GROUPS: "KeyGroupsSavepointStateHandle",
    INCREMENTAL_V2: "IncrementalRemoteKeyedStateHandle",
    KEY_GROUPS_V2: "KeyGroupsStateHandle_V2",
    SEGMENT: "SegmentFileStateHandle",
    EMPTY_SEGMENT: "EmptySegmentFileStateHandle",
    FILE_MERGING_OPERATOR_STREAM: "FileMergingOperatorStreamStateHandle",
}
_SCOPES = ("EXCLUSIVE", "SHARED")
_DISTRIBUTION_MODES = ("SPLIT_DISTRIBUTE", "UNION", "BROADCAST")


# --- the decoded metadata ----------------------------------------------------------------


@dataclass(frozen=True)
class FlinkStreamHandle:
    """A stream of bytes: inline in `_metadata` (byte stream), a whole file (file, relative
    file), a segment of a file-merging physical file, or an empty segment.

    ``path`` is the file it reads (absolute, remapped; relative files resolved against the
    checkpoint directory), None for inline and empty ones; ``size`` the state's size in
    bytes; ``data`` the inline bytes; ``name`` the inline handle's name (the path Flink would
    have written, which exists nowhere)."""

    tag: int
    size: int
    path: str | None = None
    written_path: str | None = None
    relative_path: str | None = None
    name: str | None = None
    data: bytes | None = field(default=None, repr=False)
    start: int = 0
    scope: str | None = None
    logical_file_id: str | None = None

    @property
    def type_name(self) -> str:
        return HANDLE_NAMES[self.tag]

    @property
    def inline(self) -> bool:
        return self.tag == BYTE_STREAM

    @property
    def extent(self) -> int:
        """The bytes of ``path`` the handle needs (a segment ends at start + size)."""
        return self.start + self.size


@dataclass(frozen=True)
class FlinkKeyedStateHandle:
    """A keyed state handle: key groups (heap backend, canonical savepoints) or incremental
    (RocksDB), with the stream handles it is made of."""

    tag: int
    key_groups: tuple[int, int]  # first and last key group, inclusive
    offsets: tuple[int, ...] = ()
    delegate: FlinkStreamHandle | None = None
    state_handle_id: str | None = None
    checkpoint_id: int | None = None
    backend_id: str | None = None
    checkpointed_size: int | None = None
    meta: FlinkStreamHandle | None = None
    shared: tuple[tuple[str, FlinkStreamHandle], ...] = ()
    private: tuple[tuple[str, FlinkStreamHandle], ...] = ()

    @property
    def type_name(self) -> str:
        return HANDLE_NAMES[self.tag]

    def stream_handles(self) -> Iterator[FlinkStreamHandle]:
        if self.delegate is not None:
            yield self.delegate
        if self.meta is not None:
            yield self.meta
        for _, handle in (*self.shared, *self.private):
            yield handle


@dataclass(frozen=True)
class FlinkOperatorStateHandle:
    """Operator (non-keyed) state: partition offsets per state name and the stream holding
    them; with file merging also the task-owned and shared directories it writes to."""

    tag: int
    states: tuple[tuple[str, str, tuple[int, ...]], ...]  # name, distribution mode, offsets
    delegate: FlinkStreamHandle | None
    task_owned_dir: str | None = None
    shared_dir: str | None = None
    empty: bool = False

    @property
    def type_name(self) -> str:
        return HANDLE_NAMES[self.tag]

    def stream_handles(self) -> Iterator[FlinkStreamHandle]:
        if self.delegate is not None:
            yield self.delegate


@dataclass(frozen=True)
class FlinkSubtaskState:
    """One subtask's state of an operator: its four handles (managed and raw, operator and
    keyed state; None when absent) and whether the subtask had finished."""

    index: int
    finished: bool = False
    managed_operator_state: FlinkOperatorStateHandle | None = None
    raw_operator_state: FlinkOperatorStateHandle | None = None
    managed_keyed_state: FlinkKeyedStateHandle | None = None
    raw_keyed_state: FlinkKeyedStateHandle | None = None

    def handles(self) -> Iterator[FlinkOperatorStateHandle | FlinkKeyedStateHandle]:
        for handle in (
            self.managed_operator_state,
            self.raw_operator_state,
            self.managed_keyed_state,
            self.raw_keyed_state,
        ):
            if handle is not None:
                yield handle


@dataclass(frozen=True)
class FlinkOperatorState:
    """One operator's state: its id, name and uid (format version 5 and later), parallelism,
    its coordinator's state and its subtasks' states."""

    operator_id: str  # 32 hex digits, as Flink prints an OperatorID
    parallelism: int
    max_parallelism: int
    name: str | None = None
    uid: str | None = None
    coordinator_state: FlinkStreamHandle | None = None
    subtasks: tuple[FlinkSubtaskState, ...] = ()
    fully_finished: bool = False


@dataclass(frozen=True)
class FlinkMasterState:
    """A master (coordinator) state: its name, serializer version and bytes."""

    name: str
    version: int
    data: bytes = field(repr=False)


@dataclass(frozen=True)
class FlinkCheckpointProperties:
    """The trailing ``CheckpointProperties`` (format version 4 and later).

    ``kind`` is "checkpoint" or "savepoint"; ``type_name`` Flink's name of the snapshot type
    ("Checkpoint", "Full Checkpoint", "Savepoint", "Suspend Savepoint", "Terminate
    Savepoint"); ``format_type`` "CANONICAL" or "NATIVE" for savepoints;
    ``post_checkpoint_action`` "NONE", "SUSPEND" or "TERMINATE" for savepoints;
    ``sharing_files_strategy`` for checkpoints; ``flags`` the boolean fields (forced,
    discard*, unclaimed)."""

    kind: str
    type_name: str | None
    format_type: str | None = None
    post_checkpoint_action: str | None = None
    sharing_files_strategy: str | None = None
    flags: dict[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class FlinkFileReference:
    """A file the checkpoint reads: its path, the bytes of it the handles need (the largest
    extent), the size the handles record when they cover the whole file, and how many
    handles point into it."""

    path: str
    needed_bytes: int
    whole_file_size: int | None
    handles: int


@dataclass(frozen=True)
class FlinkCheckpointMetadata:
    """A parsed Flink `_metadata`. ``directory`` is the checkpoint directory relative handles
    were resolved against."""

    version: int
    checkpoint_id: int
    master_states: tuple[FlinkMasterState, ...]
    operators: tuple[FlinkOperatorState, ...]
    properties: FlinkCheckpointProperties | None
    directory: str
    metadata_size: int

    @property
    def kind(self) -> str:
        """The kind: "checkpoint", "savepoint", or "unknown" (version 3 records none)."""
        return self.properties.kind if self.properties else "unknown"

    def stream_handles(self) -> Iterator[FlinkStreamHandle]:
        """Every stream handle, depth first (coordinator states included)."""
        for op in self.operators:
            if op.coordinator_state is not None:
                yield op.coordinator_state
            for subtask in op.subtasks:
                for handle in subtask.handles():
                    yield from handle.stream_handles()

    def inline_bytes(self) -> int:
        return sum(h.size for h in self.stream_handles() if h.inline)

    def referenced_files(self) -> dict[str, FlinkFileReference]:
        """The files the checkpoint reads, by path (a file-merging physical file once)."""
        extents: dict[str, list] = {}
        for handle in self.stream_handles():
            if handle.path is None:
                continue
            entry = extents.setdefault(handle.path, [0, None, 0])
            entry[0] = max(entry[0], handle.extent)
            if handle.tag in (FILE, RELATIVE_FILE):
                entry[1] = handle.size
            entry[2] += 1
        return {p: FlinkFileReference(p, n, whole, c) for p, (n, whole, c) in extents.items()}


# --- paths -------------------------------------------------------------------------------


def parse_remap(pairs: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``OLD=NEW`` texts as (old, new) prefixes; ``ValueError`` naming a malformed one."""
    result = []
    for text in pairs:
        old, sep, new = text.partition("=")
        if not sep or not old.strip() or not new.strip():
            raise ValueError(f"invalid remap {text!r}: use OLD=NEW, e.g. /srv/flink=/mnt/copy")
        result.append((_local_form(old.strip()).rstrip("/"), new.strip().rstrip("/")))
    return tuple(result)


def _local_form(uri: str) -> str:
    """``file:/a``, ``file:///a`` and ``file://localhost/a`` as ``/a``; others unchanged."""
    if uri.startswith("file:"):
        parsed = urllib.parse.urlsplit(uri)
        if parsed.netloc in ("", "localhost"):
            return parsed.path
    return uri


def remap_path(written: str, remap: Sequence[tuple[str, str]] = ()) -> str:
    """A path Flink wrote, as this machine reads it: local form, then the first matching
    ``remap`` prefix (whole path segments only) replaced."""
    path = _local_form(written)
    for old, new in remap:
        if path == old or path.startswith(old + "/"):
            return new + path[len(old) :]
    return path


def _check_absolute(path: str, source: str) -> str:
    segments = path.split("/")
    if any(s in (".", "..") for s in segments) or any(ord(c) < 0x20 for c in path):
        raise UnsafePathError(
            f"{source}: a state path {path!r} has '.'/'..' segments or control characters; "
            "the _metadata was tampered with or corrupted: nothing it references is touched"
        )
    return path


# --- the byte reader ---------------------------------------------------------------------


class _Reader:
    def __init__(self, data: bytes, source: str) -> None:
        self.data = data
        self.pos = 0
        self.source = source

    def fail(self, what: str) -> FlinkMetadataError:
        return FlinkMetadataError(
            f"{self.source}: not a valid Apache Flink _metadata at byte {self.pos}: {what}; "
            "the file is truncated, corrupt or not Flink's: it is reported, never deleted",
            offset=self.pos,
        )

    def remaining(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.remaining():
            raise self.fail(f"{what} needs {n} bytes, {self.remaining()} remain")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def boolean(self, what: str) -> bool:
        value = self.u8(what)
        if value > 1:
            raise self.fail(f"{what} is {value}, not a boolean")
        return bool(value)

    def i32(self, what: str) -> int:
        return struct.unpack(">i", self.take(4, what))[0]

    def i64(self, what: str) -> int:
        return struct.unpack(">q", self.take(8, what))[0]

    def count(self, what: str, min_item_bytes: int) -> int:
        n = self.i32(what)
        if n < 0 or n * min_item_bytes > self.remaining():
            raise self.fail(f"{what} is {n}, impossible with {self.remaining()} bytes left")
        return n

    def non_negative(self, value: int, what: str) -> int:
        if value < 0:
            raise self.fail(f"{what} is negative ({value})")
        return value

    def utf(self, what: str) -> str:
        n = struct.unpack(">H", self.take(2, what))[0]
        raw = self.take(n, what)
        return decode_modified_utf8(raw, lambda: self.fail(f"{what} is not modified UTF-8"))


def decode_modified_utf8(raw: bytes, error) -> str:
    """Java's modified UTF-8 (``writeUTF``): NUL as C0 80, supplementary characters as two
    3-byte surrogates."""
    try:
        text = raw.replace(b"\xc0\x80", b"\x00").decode("utf-8", "surrogatepass")
        return text.encode("utf-16", "surrogatepass").decode("utf-16")
    except UnicodeError:
        raise error() from None


# --- the parser --------------------------------------------------------------------------


class _Parser:
    def __init__(self, reader: _Reader, version: int, directory: str, remap) -> None:
        self.r = reader
        self.version = version
        self.directory = directory.rstrip("/")
        self.remap = tuple(remap)

    def absolute(self, written: str) -> str:
        return _check_absolute(remap_path(written, self.remap), self.r.source)

    def relative(self, relative_path: str) -> str:
        try:
            check_relative_path(relative_path)
        except UnsafePathError:
            raise UnsafePathError(
                f"{self.r.source}: relative state path {relative_path!r} leaves its "
                "checkpoint directory: the _metadata was tampered with; nothing it "
                "references is touched"
            ) from None
        return posixpath.join(self.directory, relative_path)

    # stream handles

    def stream_handle(self, what: str, depth: int = 0) -> FlinkStreamHandle | None:
        r = self.r
        if depth > _MAX_DEPTH:
            raise r.fail(f"{what} nests handles deeper than {_MAX_DEPTH}")
        tag = r.u8(f"{what} type")
        if tag == NULL:
            return None
        if tag == FILE:
            size = r.non_negative(r.i64(f"{what} size"), f"{what} size")
            written = r.utf(f"{what} path")
            return FlinkStreamHandle(FILE, size, path=self.absolute(written), written_path=written)
        if tag == BYTE_STREAM:
            name = r.utf(f"{what} name")
            n = r.i32(f"{what} length")
            data = r.take(n, f"{what} inline bytes")
            return FlinkStreamHandle(BYTE_STREAM, len(data), name=name, data=data)
        if tag == RELATIVE_FILE:
            relative_path = r.utf(f"{what} relative path")
            size = r.non_negative(r.i64(f"{what} size"), f"{what} size")
            return FlinkStreamHandle(
                RELATIVE_FILE,
                size,
                path=self.relative(relative_path),
                relative_path=relative_path,
            )
        if tag == KEY_GROUPS:  # an old key-groups handle written as a stream handle
            keyed = self.key_groups(KEY_GROUPS, what, depth)
            return keyed.delegate
        if tag == SEGMENT:
            start = r.non_negative(r.i64(f"{what} start"), f"{what} start")
            size = r.non_negative(r.i64(f"{what} size"), f"{what} size")
            scope_index = r.i32(f"{what} scope")
            if not 0 <= scope_index < len(_SCOPES):
                raise r.fail(f"{what} scope is {scope_index}, not 0 (EXCLUSIVE) or 1 (SHARED)")
            written = r.utf(f"{what} file path")
            logical = r.utf(f"{what} logical file id")
            return FlinkStreamHandle(
                SEGMENT,
                size,
                path=self.absolute(written),
                written_path=written,
                start=start,
                scope=_SCOPES[scope_index],
                logical_file_id=logical,
            )
        if tag == EMPTY_SEGMENT:
            return FlinkStreamHandle(EMPTY_SEGMENT, 0)
        raise self.unknown(tag, what)

    def unknown(self, tag: int, what: str) -> FlinkMetadataError:
        if tag in _CHANGELOG_TAGS:
            return self.r.fail(
                f"{what} is a changelog state backend handle (type {tag}), which this reader "
                "does not support"
            )
        return self.r.fail(f"{what} has unknown handle type {tag}")

    # keyed handles

    def key_groups(self, tag: int, what: str, depth: int) -> FlinkKeyedStateHandle:
        r = self.r
        first = r.i32(f"{what} first key group")
        n = r.count(f"{what} number of key groups", 8)
        if first < 0 or first + n - 1 > 2**15:
            raise r.fail(f"{what} key groups {first}+{n} are out of Flink's range")
        offsets = struct.unpack(f">{n}q", r.take(8 * n, f"{what} offsets"))
        delegate = self.stream_handle(f"{what} delegate", depth + 1)
        handle_id = r.utf(f"{what} state handle id") if tag == KEY_GROUPS_V2 else None
        return FlinkKeyedStateHandle(
            tag, (first, first + n - 1), offsets, delegate=delegate, state_handle_id=handle_id
        )

    def keyed_handle(self, what: str) -> FlinkKeyedStateHandle | None:
        r = self.r
        tag = r.u8(f"{what} type")
        if tag == NULL:
            return None
        if tag in (KEY_GROUPS, KEY_GROUPS_V2, SAVEPOINT_KEY_GROUPS):
            return self.key_groups(tag, what, 0)
        if tag in (INCREMENTAL, INCREMENTAL_V2):
            checkpoint_id = r.i64(f"{what} checkpoint id")
            backend = r.utf(f"{what} backend id")
            first = r.i32(f"{what} first key group")
            n = r.i32(f"{what} number of key groups")
            if first < 0 or n < 0 or first + n - 1 > 2**15:
                raise r.fail(f"{what} key groups {first}+{n} are out of Flink's range")
            checkpointed = r.i64(f"{what} checkpointed size") if tag == INCREMENTAL_V2 else None
            meta = self.stream_handle(f"{what} meta data handle", 1)
            shared = self.local_paths(f"{what} shared state")
            private = self.local_paths(f"{what} private state")
            handle_id = r.utf(f"{what} state handle id") if tag == INCREMENTAL_V2 else None
            return FlinkKeyedStateHandle(
                tag,
                (first, first + n - 1),
                state_handle_id=handle_id,
                checkpoint_id=checkpoint_id,
                backend_id=backend,
                checkpointed_size=checkpointed,
                meta=meta,
                shared=shared,
                private=private,
            )
        raise self.unknown(tag, what)

    def local_paths(self, what: str) -> tuple[tuple[str, FlinkStreamHandle], ...]:
        n = self.r.count(f"{what} count", 3)
        result = []
        for i in range(n):
            local_path = self.r.utf(f"{what} {i} local path")
            handle = self.stream_handle(f"{what} {i} ({local_path})", 1)
            if handle is None:
                raise self.r.fail(f"{what} {i} ({local_path}) has no handle")
            result.append((local_path, handle))
        return tuple(result)

    # operator state handles

    def operator_handle(self, what: str) -> FlinkOperatorStateHandle | None:
        r = self.r
        tag = r.u8(f"{what} type")
        if tag == NULL:
            return None
        if tag not in (OPERATOR_STREAM, FILE_MERGING_OPERATOR_STREAM):
            raise self.unknown(tag, what)
        states = []
        for _ in range(r.count(f"{what} number of states", 7)):
            name = r.utf(f"{what} state name")
            mode = r.u8(f"{what} distribution mode of {name!r}")
            if mode >= len(_DISTRIBUTION_MODES):
                raise r.fail(f"{what} distribution mode of {name!r} is {mode}")
            n = r.count(f"{what} number of offsets of {name!r}", 8)
            offsets = struct.unpack(f">{n}q", r.take(8 * n, f"{what} offsets of {name!r}"))
            states.append((name, _DISTRIBUTION_MODES[mode], offsets))
        task_owned = shared = None
        empty = False
        if tag == FILE_MERGING_OPERATOR_STREAM:
            task_owned = self.absolute(r.utf(f"{what} task-owned directory"))
            shared = self.absolute(r.utf(f"{what} shared directory"))
            empty = r.boolean(f"{what} empty flag")
        delegate = self.stream_handle(f"{what} delegate", 1)
        return FlinkOperatorStateHandle(tag, tuple(states), delegate, task_owned, shared, empty)

    # operators and subtasks

    def subtask(self, index: int, what: str) -> FlinkSubtaskState:
        r = self.r
        managed_op = raw_op = None
        if r.i32(f"{what} has managed operator state") != 0:
            managed_op = self.operator_handle(f"{what} managed operator state")
        if r.i32(f"{what} has raw operator state") != 0:
            raw_op = self.operator_handle(f"{what} raw operator state")
        managed_keyed = self.keyed_handle(f"{what} managed keyed state")
        raw_keyed = self.keyed_handle(f"{what} raw keyed state")
        for kind in ("input channel", "result subpartition"):
            n = r.i32(f"{what} number of {kind} states")
            if n != 0:
                raise r.fail(
                    f"{what} has {n} {kind} states (unaligned checkpoint channel state), "
                    "which this reader does not support"
                )
        return FlinkSubtaskState(index, False, managed_op, raw_op, managed_keyed, raw_keyed)

    def operator(self, number: int) -> FlinkOperatorState:
        r = self.r
        what = f"operator {number}"
        name = uid = None
        if self.version >= 5:
            name = r.utf(f"{what} name") or None
            uid = r.utf(f"{what} uid") or None
            what = f"operator {name or number!r}"
        operator_id = r.take(16, f"{what} id").hex()
        parallelism = r.i32(f"{what} parallelism")
        max_parallelism = r.i32(f"{what} max parallelism")
        if parallelism < 0 or max_parallelism < 0:
            raise r.fail(f"{what} parallelism {parallelism}/{max_parallelism} is negative")
        coordinator = self.stream_handle(f"{what} coordinator state", 1)
        if coordinator is not None and not coordinator.inline:
            raise r.fail(f"{what} coordinator state is not a byte stream handle")
        n = r.i32(f"{what} number of subtask states")
        if n < 0:  # a fully finished operator
            return FlinkOperatorState(
                operator_id, parallelism, max_parallelism, name, uid, None, (), True
            )
        if n * 4 > r.remaining():
            raise r.fail(f"{what} number of subtask states {n} exceeds the bytes left")
        subtasks = []
        for _ in range(n):
            stored = r.i32(f"{what} subtask index")
            if stored < 0:
                subtasks.append(FlinkSubtaskState(-stored - 1, finished=True))
            else:
                subtasks.append(self.subtask(stored, f"{what} subtask {stored}"))
        return FlinkOperatorState(
            operator_id,
            parallelism,
            max_parallelism,
            name,
            uid,
            coordinator,
            tuple(subtasks),
        )

    def master_state(self, index: int) -> FlinkMasterState:
        r = self.r
        what = f"master state {index}"
        if r.i32(f"{what} magic") & 0xFFFFFFFF != _MASTER_STATE_MAGIC:
            raise r.fail(f"{what} does not start with Flink's master state magic number")
        n = r.i32(f"{what} length")
        if n <= 0:
            raise r.fail(f"{what} length {n} is not positive")
        body = _Reader(r.take(n, f"{what} bytes"), r.source)
        version = body.i32(f"{what} version")
        name = body.utf(f"{what} name")
        data = body.take(body.i32(f"{what} payload length"), f"{what} payload")
        if body.remaining():
            raise r.fail(f"{what} ({name!r}) has {body.remaining()} trailing bytes")
        return FlinkMasterState(name, version, data)


def is_flink_metadata(header: bytes) -> bool:
    """Whether bytes start with Apache Flink's `_metadata` magic number."""
    return len(header) >= 4 and struct.unpack(">I", header[:4])[0] == FLINK_METADATA_MAGIC


def parse_flink_metadata(
    data: bytes,
    *,
    directory: str,
    source: str | None = None,
    remap: Sequence[tuple[str, str]] = (),
) -> FlinkCheckpointMetadata:
    """Parse the bytes of a Flink `_metadata` found in ``directory`` (which relative handles
    are resolved against). ``remap``: (old, new) path prefixes for the absolute paths Flink
    wrote on another machine (``parse_remap``). Raises ``FlinkMetadataError`` for anything
    that is not a complete, supported `_metadata`, ``UnsafePathError`` for a path that
    leaves its directory."""
    source = source or posixpath.join(directory, "_metadata")
    r = _Reader(bytes(data), source)
    if not is_flink_metadata(r.data):
        raise r.fail("it does not start with Flink's magic number 0x4960672d")
    r.pos = 4
    version = r.i32("format version")
    if version not in SUPPORTED_FLINK_VERSIONS:
        raise FlinkMetadataError(
            f"{source}: Apache Flink _metadata format version {version} is not supported "
            f"(supported: {', '.join(map(str, SUPPORTED_FLINK_VERSIONS))}); it is kept as is",
            offset=4,
            format_version=version,
        )
    p = _Parser(r, version, directory, remap)
    checkpoint_id = r.i64("checkpoint id")
    if checkpoint_id < 0:
        raise r.fail(f"checkpoint id {checkpoint_id} is negative")
    masters = tuple(p.master_state(i) for i in range(r.count("number of master states", 12)))
    operators = tuple(p.operator(i) for i in range(r.count("number of operator states", 21)))
    properties = None
    if version >= 4:
        properties = _properties(read_java_object(r))
    if r.remaining():
        raise r.fail(f"{r.remaining()} bytes follow the end of the metadata")
    return FlinkCheckpointMetadata(
        version, checkpoint_id, masters, operators, properties, directory, len(r.data)
    )


# --- CheckpointProperties, from the Java objects of the trailing stream ------------------


def _enum_name(value: object) -> str | None:
    return value.constant if isinstance(value, JavaEnum) else None


def _properties(obj: object) -> FlinkCheckpointProperties:
    if not isinstance(obj, JavaObject) or not obj.class_name.endswith(".CheckpointProperties"):
        name = obj.class_name if isinstance(obj, JavaObject) else type(obj).__name__
        raise FlinkMetadataError(f"the trailing checkpoint properties are a {name}")
    flags = {k: v for k, v in obj.fields.items() if isinstance(v, bool)}
    snapshot = obj.fields.get("checkpointType")
    if not isinstance(snapshot, JavaObject):
        return FlinkCheckpointProperties("unknown", None, flags=flags)
    name = snapshot.fields.get("name")
    name = name if isinstance(name, str) else None
    if snapshot.class_name.endswith(".SavepointType"):
        return FlinkCheckpointProperties(
            "savepoint",
            name,
            format_type=_enum_name(snapshot.fields.get("formatType")),
            post_checkpoint_action=_enum_name(snapshot.fields.get("postCheckpointAction")),
            flags=flags,
        )
    return FlinkCheckpointProperties(
        "checkpoint",
        name,
        sharing_files_strategy=_enum_name(snapshot.fields.get("sharingFilesStrategy")),
        flags=flags,
    )
