"""A checkpoint's `_metadata` as JSON-ready values: what ``checkpoints inspect --json``
prints, for tools and dashboards that want the same (``metadata_as_json``), and the decoding
of master states it uses (``decode_master_state``).
"""

import base64
import json
from datetime import UTC, datetime

from checkpoint_storage._handles import (
    ByteStreamStateHandle,
    RelativeFileStateHandle,
    SegmentFileStateHandle,
)
from checkpoint_storage._metadata import CheckpointMetadata, OperatorState
from checkpoint_storage._tools import snapshot_kind

__all__ = ["decode_master_state", "metadata_as_json"]

_ARROW_CONTINUATION = b"\xff\xff\xff\xff"  # how an Arrow IPC message (a schema) begins


def _arrow_schema_fields(data: bytes) -> list[dict] | None:
    if not data.startswith(_ARROW_CONTINUATION):
        return None
    import pyarrow as pa  # only for master states that look like Arrow schemas

    try:
        schema = pa.ipc.read_schema(pa.py_buffer(data))
    except (pa.ArrowException, ValueError):
        return None
    return [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in schema]


def _is_text(text: str) -> bool:
    return all(c.isprintable() or c in "\n\t" for c in text)


def decode_master_state(data: bytes) -> tuple[str, object]:
    """``(encoding, value)`` of a master state: ``json`` (a JSON object or array, parsed),
    ``arrow-schema`` (an Arrow IPC schema, e.g. ``STATE_SCHEMA_PREFIX`` states: its fields
    as ``{name, type, nullable}``), ``text`` (printable UTF-8) or ``base64``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if isinstance(value, dict | list):
            return "json", value
        if _is_text(text):
            return "text", text
    fields = _arrow_schema_fields(data)
    if fields is not None:
        return "arrow-schema", fields
    return "base64", base64.b64encode(data).decode("ascii")




def _iso(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _crc(checksum: int | None) -> str | None:
    return None if checksum is None else f"{checksum:08x}"


def _handle_json(handle) -> dict:
    if isinstance(handle, ByteStreamStateHandle):
        return {
            "type": "inline",
            "name": handle.handle_name,
            "path": None,
            "relative_path": None,
            "size": handle.state_size,
            "crc32": None,
        }
    if isinstance(handle, SegmentFileStateHandle):
        return {
            "type": "segment",
            "name": handle.logical_file_id,
            "path": handle.path,
            "relative_path": None,
            "size": handle.state_size,
            "crc32": _crc(handle.checksum),
            "start": handle.start_position,
            "scope": handle.scope.value.lower(),
        }
    relative = handle.relative_path if isinstance(handle, RelativeFileStateHandle) else None
    return {
        "type": "relative-file" if relative is not None else "file",
        "name": None,
        "path": handle.path,
        "relative_path": relative,
        "size": handle.state_size,
        "crc32": _crc(handle.checksum),
    }


def _master_state_json(name: str, data: bytes) -> dict:
    encoding, value = decode_master_state(data)
    return {
        "name": name,
        "size": len(data),
        "encoding": encoding,
        "value": value,
        "base64": base64.b64encode(data).decode("ascii"),
    }


def _recorded_rows(op: OperatorState) -> dict:
    """The rows an operator's subtasks recorded (the well-known subtask properties ``rows``
    and ``expired_rows``, a pipeline's): stored rows, of those expired by a TTL but not
    dropped yet, and live (stored less expired). None where a subtask did not record it
    (a checkpoint written before it was recorded: unknown, not 0)."""

    def total(name: str) -> int | None:
        try:
            counts = [int(s.properties[name]) for s in op.subtask_states.values()]
        except (KeyError, ValueError):
            return None
        return sum(counts) if counts else None

    rows, expired = total("rows"), total("expired_rows")
    live = None if rows is None or expired is None else rows - expired
    return {"rows": rows, "live_rows": live, "expired_rows": expired}


def metadata_as_json(metadata: CheckpointMetadata, pointer: str | None = None) -> dict:
    """``metadata`` (of the checkpoint or savepoint at ``pointer``) as a JSON-ready dict
    with stable keys: ``pointer``, ``checkpoint_id``, ``job_id`` (hex), ``timestamp_ms``,
    ``timestamp`` (ISO 8601, UTC), ``kind`` ("checkpoint", "full checkpoint" or
    "savepoint"), ``properties`` (``snapshot_type``, ``format_type``), ``state_size``,
    ``master_states`` (each ``name``, ``size``, ``encoding`` and ``value`` as
    ``decode_master_state`` gives them, and the raw bytes as ``base64``) and ``operators``
    (``operator_id``, ``parallelism``, ``max_parallelism``, ``state_size``, the ``rows``,
    ``live_rows`` and ``expired_rows`` the subtasks recorded (None: not recorded), and
    ``subtasks``: ``index``, ``properties`` and ``handles``, each with ``type`` ("inline",
    "file", "relative-file" or "segment"), ``name``, ``path``, ``relative_path``, ``size``
    and ``crc32`` (8 hex digits); segments also ``start`` and ``scope``)."""
    timestamp = (
        None
        if metadata.timestamp_ms is None
        else datetime.fromtimestamp(metadata.timestamp_ms / 1000, UTC)
    )
    return {
        "pointer": pointer,
        "checkpoint_id": metadata.checkpoint_id,
        "job_id": None if metadata.job_id is None else metadata.job_id.hex,
        "timestamp_ms": metadata.timestamp_ms,
        "timestamp": _iso(timestamp),
        "kind": snapshot_kind(metadata),
        "properties": {
            "snapshot_type": metadata.properties.snapshot_type.name.lower(),
            "format_type": metadata.properties.format_type.name.lower(),
        },
        "state_size": metadata.state_size,
        "master_states": [
            _master_state_json(name, value) for name, value in metadata.master_states.items()
        ],
        "operators": [
            {
                "operator_id": op.operator_id,
                "parallelism": op.parallelism,
                "max_parallelism": op.max_parallelism,
                "state_size": op.state_size,
                **_recorded_rows(op),
                "subtasks": [
                    {
                        "index": index,
                        "properties": dict(subtask.properties),
                        "handles": [_handle_json(h) for h in subtask.handles],
                    }
                    for index, subtask in op.subtask_states.items()
                ],
            }
            for op in metadata.operator_states
        ],
    }

