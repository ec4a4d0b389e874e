"""Keyed state rows of an Apache Flink canonical savepoint, read without a JVM.

A canonical savepoint (``KeyGroupsSavepointStateHandle``, tag 7) is backend-independent:
the heap and RocksDB backends write it in the same "unified" layout, per subtask one stream
of the backend meta (``KeyedBackendSerializationProxy``: the key serializer and, per state,
its name, type and serializer snapshots) followed by the key groups at the handle's offsets:

    short kvStateId, then (int length, key bytes, int length, value bytes)*
    where a key whose first byte has bit 0x80 set is followed by a short: the next
    kvStateId, or 0xFFFF at the end of the key group.

A key is ``key group prefix (1 byte up to 128 key groups, else 2) + key + namespace``.

Supported, and refused otherwise naming what was found:
- keys and values of Flink's primitive serializers (int, long, short, byte, boolean, float,
  double, char, String), and Rows of them as keys (PyFlink's keys);
- VoidNamespace (keyed state outside windows);
- ValueState of those types, and PyFlink's states (``python-state-<name>``: a ListState of
  byte arrays whose bytes PyFlink's coders wrote): their values are the raw bytes, or decoded
  with ``python_value_type`` ("long", "int", "double", "boolean": PyFlink's big-endian
  coders);
- uncompressed key groups only.
Not supported: checkpoints and native savepoints (the heap backend's own layout, RocksDB's
SST files), list/map/reducing/aggregating state of Java types, TTL, POJO/Kryo/Avro types,
snappy-compressed key groups, windows' namespaces. Timers (priority-queue states) are
skipped.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from checkpoint_storage._filesystems import url_to_fs
from checkpoint_storage._flink_metadata import (
    SAVEPOINT_KEY_GROUPS,
    FlinkCheckpointMetadata,
    FlinkOperatorState,
    _Reader,
)
from checkpoint_storage.exceptions import FlinkMetadataError

PYTHON_STATE_PREFIX = "python-state-"
_END_OF_KEY_GROUP = 0xFFFF
_META_FOLLOWS = 0x80
_COMPOSITE_MAGIC = 911108
_NESTED_MAGIC = 1333245
_KEY_VALUE = 0
_PRIORITY_QUEUE = 3
_MAX_STATE_BYTES = 1 << 30

_SERIALIZERS = "org.apache.flink.api.common.typeutils.base."
# Snapshot class -> struct format of the value it serializes (None: a String).
_PRIMITIVES = {
    _SERIALIZERS + "IntSerializer$IntSerializerSnapshot": ">i",
    _SERIALIZERS + "LongSerializer$LongSerializerSnapshot": ">q",
    _SERIALIZERS + "ShortSerializer$ShortSerializerSnapshot": ">h",
    _SERIALIZERS + "ByteSerializer$ByteSerializerSnapshot": ">b",
    _SERIALIZERS + "BooleanSerializer$BooleanSerializerSnapshot": ">?",
    _SERIALIZERS + "FloatSerializer$FloatSerializerSnapshot": ">f",
    _SERIALIZERS + "DoubleSerializer$DoubleSerializerSnapshot": ">d",
    _SERIALIZERS + "CharSerializer$CharSerializerSnapshot": ">H",
    _SERIALIZERS + "StringSerializer$StringSerializerSnapshot": None,
}
_BYTES = _SERIALIZERS + "array.BytePrimitiveArraySerializer$BytePrimitiveArraySerializerSnapshot"
_VOID = "org.apache.flink.runtime.state.VoidNamespaceSerializer$VoidNamespaceSerializerSnapshot"
_ROW = "org.apache.flink.api.java.typeutils.runtime.RowSerializer$RowSerializerSnapshot"
_LIST = _SERIALIZERS + "ListSerializerSnapshot"
_TIMER = "org.apache.flink.streaming.api.operators.TimerSerializerSnapshot"
# Composite snapshots: class -> bytes of their outer snapshot by outer version.
_COMPOSITES = {_ROW: {3: 0, 4: 1}, _LIST: {1: 0}, _TIMER: {2: 0}}
_PYTHON_VALUE_TYPES = {"long": ">q", "int": ">i", "double": ">d", "boolean": ">?"}


@dataclass(frozen=True)
class _Snapshot:
    class_name: str
    nested: tuple[_Snapshot, ...] = ()
    legacy_row: bool = False


@dataclass(frozen=True)
class _StateInfo:
    name: str
    backend_type: int
    options: dict[str, str]
    serializers: dict[str, _Snapshot]


@dataclass(frozen=True)
class FlinkStateRow:
    """One keyed ValueState entry: its key group, state name, key and value."""

    key_group: int
    state: str
    key: object
    value: object


@dataclass(frozen=True)
class FlinkStateRows:
    """The rows ``read_heap_value_rows`` read of one operator, and the states it holds."""

    operator: str
    states: list[str]
    rows: list[FlinkStateRow] = field(default_factory=list)


def _snapshot(r: _Reader, depth: int = 0) -> _Snapshot:
    if depth > 8:
        raise r.fail("serializer snapshots nest too deeply")
    name = r.utf("serializer snapshot class")
    r.i32(f"{name} version")
    if name in _PRIMITIVES or name in (_BYTES, _VOID):
        return _Snapshot(name)
    if name not in _COMPOSITES:
        raise r.fail(f"serializer {name} is not supported (only Flink's primitive types)")
    if r.i32(f"{name} magic") != _COMPOSITE_MAGIC:
        raise r.fail(f"{name} has no composite snapshot magic number")
    outer_version = r.i32(f"{name} outer version")
    outer_bytes = _COMPOSITES[name].get(outer_version)
    if outer_bytes is None:
        raise r.fail(f"{name} outer snapshot version {outer_version} is not supported")
    legacy = r.boolean(f"{name} legacy mode") if outer_bytes else False
    if r.i32(f"{name} nested magic") != _NESTED_MAGIC:
        raise r.fail(f"{name} has no nested snapshots magic number")
    r.i32(f"{name} nested version")
    count = r.count(f"{name} nested serializers", 6)
    nested = tuple(_proxied_snapshot(r, depth + 1) for _ in range(count))
    return _Snapshot(name, nested, legacy)


def _proxied_snapshot(r: _Reader, depth: int = 0) -> _Snapshot:
    """``TypeSerializerSnapshotSerializationUtil.writeSerializerSnapshot``: a proxy version
    (int) and then the versioned snapshot; nested snapshots inside composites have no proxy."""
    if depth == 0:
        r.i32("serializer snapshot proxy version")
    return _snapshot(r, depth)


def _backend_meta(r: _Reader) -> tuple[_Snapshot, list[_StateInfo]]:
    version = r.i32("keyed backend meta version")
    if version != 6:
        raise r.fail(f"keyed backend meta version {version} is not supported (only 6)")
    if r.boolean("key group compression flag"):
        raise r.fail("the key groups are snappy-compressed, which is not supported")
    key = _proxied_snapshot(r)
    count = struct.unpack(">H", r.take(2, "number of states"))[0]
    states = []
    for _ in range(count):
        name = r.utf("state name")
        backend_type = r.i32(f"state {name!r} type")
        options = {}
        for _ in range(r.count(f"state {name!r} options", 4)):
            option = r.utf("option key")  # read before its value: Python evaluates the
            options[option] = r.utf("option value")  # right-hand side of `x[k()] = v()` first
        serializers = {}
        for _ in range(r.count(f"state {name!r} serializers", 6)):
            role = r.utf("serializer role")
            serializers[role] = _proxied_snapshot(r)
        states.append(_StateInfo(name, backend_type, options, serializers))
    return key, states


def _value(r: _Reader, snapshot: _Snapshot, what: str) -> object:
    name = snapshot.class_name
    if name in _PRIMITIVES:
        fmt = _PRIMITIVES[name]
        if fmt is None:
            return _string(r, what)
        value = struct.unpack(fmt, r.take(struct.calcsize(fmt), what))[0]
        return chr(value) if fmt == ">H" else value
    if name == _BYTES:
        return r.take(r.i32(f"{what} length"), what)
    if name == _ROW:
        arity = len(snapshot.nested)
        mask_bits = arity + (0 if snapshot.legacy_row else 2)
        mask = int.from_bytes(r.take((mask_bits + 7) // 8, f"{what} row mask"), "big")
        total = ((mask_bits + 7) // 8) * 8
        offset = 0 if snapshot.legacy_row else 2
        fields = []
        for i, nested in enumerate(snapshot.nested):
            if mask >> (total - 1 - offset - i) & 1:
                fields.append(None)
            else:
                fields.append(_value(r, nested, f"{what} field {i}"))
        return tuple(fields)
    raise r.fail(f"{what} uses serializer {name}, not supported")


def _string(r: _Reader, what: str) -> str:
    """Flink's StringValue encoding: length + 1 as a varint (0: null), then each char as a
    varint."""

    def varint() -> int:
        value = shift = 0
        for _ in range(5):
            byte = r.u8(what)
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7
        raise r.fail(f"{what} has a malformed length")

    n = varint()
    if n == 0:
        return None
    if n - 1 > r.remaining():
        raise r.fail(f"{what} length {n - 1} exceeds the bytes left")
    return "".join(chr(varint()) for _ in range(n - 1))


def _pick_operator(m: FlinkCheckpointMetadata, wanted: str | None) -> FlinkOperatorState:
    keyed = [
        op for op in m.operators if any(s.managed_keyed_state is not None for s in op.subtasks)
    ]
    if wanted is not None:
        matches = [op for op in m.operators if wanted in (op.uid, op.name, op.operator_id)]
        if not matches:
            raise ValueError(f"{m.directory}: no operator with uid, name or id {wanted!r}")
        return matches[0]
    if len(keyed) != 1:
        names = ", ".join(op.uid or op.name or op.operator_id for op in keyed) or "none"
        raise ValueError(f"{m.directory}: choose an operator with --operator (keyed: {names})")
    return keyed[0]


def _stream_bytes(handle, storage_options: dict | None) -> bytes:
    if handle.inline:
        return handle.data
    if handle.size > _MAX_STATE_BYTES:
        raise FlinkMetadataError(f"{handle.path}: {handle.size} bytes is too large to read")
    fs, path = url_to_fs(handle.path, storage_options)
    with fs.open(path, "rb") as f:
        f.seek(handle.start)
        return f.read(handle.size)


def read_heap_value_rows(
    m: FlinkCheckpointMetadata,
    storage_options: dict | None = None,
    *,
    operator: str | None = None,
    python_value_type: str | None = None,
) -> FlinkStateRows:
    """The ValueState rows of one operator of a canonical savepoint (see the module
    docstring for what is supported). Raises ``FlinkMetadataError`` naming the file and
    what is not supported, ``ValueError`` for an operator that is not there."""
    if python_value_type is not None and python_value_type not in _PYTHON_VALUE_TYPES:
        raise ValueError(f"python value type must be one of {sorted(_PYTHON_VALUE_TYPES)}")
    op = _pick_operator(m, operator)
    label = op.uid or op.name or op.operator_id
    result = FlinkStateRows(label, [])
    for subtask in op.subtasks:
        keyed = subtask.managed_keyed_state
        if keyed is None:
            continue
        if keyed.tag != SAVEPOINT_KEY_GROUPS or keyed.delegate is None:
            raise FlinkMetadataError(
                f"{m.directory}: operator {label} holds a {keyed.type_name}: only canonical "
                "savepoints (KeyGroupsSavepointStateHandle) can be read as rows"
            )
        where = keyed.delegate.path or f"{m.directory} (inline)"
        r = _Reader(_stream_bytes(keyed.delegate, storage_options), where)
        key_snapshot, states = _backend_meta(r)
        if not result.states:
            result.states.extend(
                s.name.removeprefix(PYTHON_STATE_PREFIX)
                for s in states
                if s.backend_type == _KEY_VALUE
            )
        prefix = 1 if op.max_parallelism <= 128 else 2
        first = keyed.key_groups[0]
        for index, offset in enumerate(keyed.offsets):
            if offset == 0:  # a key group without state
                continue
            r.pos = offset
            if offset >= len(r.data):
                raise r.fail(f"key group {first + index} starts beyond the end")
            _key_group(r, first + index, states, key_snapshot, prefix, python_value_type, result)
    return result


def _key_group(r, key_group, states, key_snapshot, prefix, python_type, result) -> None:
    state_id = struct.unpack(">H", r.take(2, "kvStateId"))[0]
    while True:
        if state_id >= len(states):
            raise r.fail(f"key group {key_group} names state {state_id} of {len(states)}")
        key = bytearray(r.take(r.i32("key length"), "key"))
        value = r.take(r.i32("value length"), "value")
        meta_follows = bool(key and key[0] & _META_FOLLOWS)
        if key:
            key[0] &= ~_META_FOLLOWS & 0xFF
        state = states[state_id]
        if state.backend_type == _KEY_VALUE:
            result.rows.append(
                _row(r, key_group, state, bytes(key), value, key_snapshot, prefix, python_type)
            )
        elif state.backend_type != _PRIORITY_QUEUE:
            raise r.fail(f"state {state.name!r} is of backend type {state.backend_type}")
        if meta_follows:
            state_id = struct.unpack(">H", r.take(2, "kvStateId"))[0]
            if state_id == _END_OF_KEY_GROUP:
                return


def _row(r, key_group, state, key, value, key_snapshot, prefix, python_type) -> FlinkStateRow:
    kr = _Reader(key, r.source)
    stored_group = int.from_bytes(kr.take(prefix, "key group prefix"), "big")
    if stored_group != key_group:
        raise r.fail(f"a key of key group {stored_group} is stored in key group {key_group}")
    decoded_key = _value(kr, key_snapshot, "key")
    namespace = state.serializers.get("NAMESPACE_SERIALIZER")
    if namespace is None or namespace.class_name != _VOID:
        raise r.fail(f"state {state.name!r} has a namespace (windows): not supported")
    kr.take(1, "void namespace")
    if kr.remaining():
        raise r.fail(f"a key of state {state.name!r} has {kr.remaining()} unexpected bytes")
    vr = _Reader(value, r.source)
    serializer = state.serializers.get("VALUE_SERIALIZER")
    kind = state.options.get("KEYED_STATE_TYPE")
    python = state.name.startswith(PYTHON_STATE_PREFIX)
    if python and kind == "LIST" and serializer and serializer.class_name == _LIST:
        decoded = _python_value(vr, state.name, python_type)
    elif kind == "VALUE" and serializer is not None:
        decoded = _value(vr, serializer, f"value of {state.name!r}")
    else:
        raise r.fail(f"state {state.name!r} is a {kind} state: only ValueState is supported")
    if vr.remaining():
        raise r.fail(f"a value of state {state.name!r} has {vr.remaining()} unexpected bytes")
    name = state.name.removeprefix(PYTHON_STATE_PREFIX)
    return FlinkStateRow(key_group, name, _plain(decoded_key), decoded)


def _python_value(vr: _Reader, name: str, python_type: str | None) -> object:
    """A PyFlink ValueState: one element of a ListState<byte[]> (RocksDB-style list: the
    elements one after another, a ',' between them), the bytes PyFlink's coder wrote."""
    data = vr.take(vr.i32(f"value of {name!r}"), f"value of {name!r}")
    if vr.remaining():
        raise vr.fail(f"state {name!r} holds more than one element: not a ValueState")
    if python_type is None:
        return data.hex()
    fmt = _PYTHON_VALUE_TYPES[python_type]
    if len(data) != struct.calcsize(fmt):
        raise vr.fail(f"a value of {name!r} has {len(data)} bytes, not a {python_type}")
    return struct.unpack(fmt, data)[0]


def _plain(key: object) -> object:
    """A Row key of one field as that field (PyFlink's ``key_by`` keys)."""
    return key[0] if isinstance(key, tuple) and len(key) == 1 else key
