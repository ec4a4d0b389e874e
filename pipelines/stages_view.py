"""A pipeline snapshot's stages at a glance (Spark's ``state-metadata`` source, for these
checkpoints): per stage its kind, key, schema, TTL, timers, rows, key groups and the files
of each part, read from `_metadata` alone (no state file is opened).

``checkpoints stages POINTER`` prints it; ``spark.read.format("checkpoint")
.option("view", "stages").load(POINTER)`` gives it as rows (``stage_part_rows``).
"""

import datetime as dt
from collections.abc import Mapping

import pyarrow as pa

from checkpoint_storage import InvalidCheckpointError
from checkpoint_storage.spi import (
    FileStateHandle,
    RelativeFileStateHandle,
    SegmentFileStateHandle,
    StreamStateHandle,
    checkpoint_statistics,
)
from pipelines.keyed import (
    CHAIN_FORMAT,
    KEYED_STATE_PREFIX,
    KeyedStateFormatError,
    chains_from_operator_state,
    decode_keyed_master_state,
)
from pipelines.state_reader import PipelineSnapshot, open_snapshot

__all__ = ["STAGE_PART_SCHEMA", "TIMERS_COLUMN", "snapshot_stages", "stage_part_rows",
           "stages_of"]

TIMERS_COLUMN = "_timers"
"""A keyed state schema with this column keeps timers (their count is not in `_metadata`)."""


def _schema_fields(schema: pa.Schema) -> list[dict]:
    return [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in schema]


def _where(handle: StreamStateHandle, pointer: str) -> dict:
    """A handle's file, relative to the snapshot's job directory when below it (a
    checkpoint's own files: ``chk-<id>/...``; shared ones: ``shared/...``)."""
    base = pointer.rstrip("/").rpartition("/")[0] + "/"
    if isinstance(handle, SegmentFileStateHandle):
        path = handle.path
        where = {"type": "segment", "start": handle.start_position}
    elif isinstance(handle, FileStateHandle):
        path = handle.path
        where = {"type": "relative-file" if isinstance(handle, RelativeFileStateHandle)
                 else "file"}
    else:
        return {"type": "inline", "path": None, "size": handle.state_size}
    shown = path[len(base):] if path.startswith(base) else path
    return where | {"path": shown, "size": handle.state_size}


def _keyed(snapshot: PipelineSnapshot, stage: str, schema: pa.Schema, operator) -> dict:
    where = f"{snapshot.pointer}, stage {stage!r}"
    described = snapshot.metadata.master_states.get(KEYED_STATE_PREFIX + stage)
    if described is None:
        raise InvalidCheckpointError(f"{where}: keyed state without its "
                                     f"{KEYED_STATE_PREFIX + stage!r} master state")
    try:
        layout, clock = decode_keyed_master_state(described, schema, where)
        chains = chains_from_operator_state(operator)
    except KeyedStateFormatError as exc:
        raise InvalidCheckpointError(str(exc)) from exc
    ttl = None if layout.ttl is None else {
        "seconds": layout.ttl.ttl.total_seconds(),
        "time_characteristic": layout.ttl.time_characteristic.value,
        "timestamp_column": layout.ttl.timestamp_column,
    }
    parts = []
    for index, chain in enumerate(chains):
        files = [] if chain.full_snapshot is None else [
            {"role": "full snapshot"} | _where(chain.full_snapshot, snapshot.pointer)]
        files += [{"role": "change file"} | _where(h, snapshot.pointer) for h in chain.changes]
        live = (None if chain.rows is None or chain.expired_rows is None
                else chain.rows - chain.expired_rows)
        parts.append({"subtask": index, "key_groups": [chain.key_groups.start,
                                                       chain.key_groups.end],
                      "live_rows": live, "expired_rows": chain.expired_rows, "files": files})
    return {"kind": "keyed", "key": list(layout.key), "ttl": ttl,
            "max_parallelism": layout.max_parallelism,
            "clock": None if clock is None else clock.astimezone(dt.UTC).isoformat(),
            "parts": parts}


def _plain(snapshot: PipelineSnapshot, operator) -> dict:
    parts = []
    for index, subtask in operator.subtask_states.items():
        rows, expired = (subtask.properties.get(name) for name in ("rows", "expired_rows"))
        parts.append({
            "subtask": index, "key_groups": None,
            "live_rows": None if rows is None else int(rows) - int(expired or 0),
            "expired_rows": None if expired is None else int(expired),
            "files": [{"role": "state"} | _where(h, snapshot.pointer) for h in subtask.handles],
        })
    return {"kind": "plain", "key": None, "ttl": None, "max_parallelism": None, "clock": None,
            "parts": parts}


def _total(parts: list[dict], name: str) -> int | None:
    values = [p[name] for p in parts]
    return None if None in values else sum(values)


def snapshot_stages(snapshot: PipelineSnapshot) -> list[dict]:
    """The stages of ``snapshot``, JSON-ready, in pipeline order: ``stage``, ``kind``
    ("plain" or "keyed"), ``format``, ``key`` (None for a plain stage), ``schema``
    (``name``, ``type``, ``nullable``), ``ttl`` (``seconds``, ``time_characteristic``,
    ``timestamp_column``; None without expiry), ``timers`` (the ``_timers`` column's type
    when the keyed state keeps timers; None otherwise), ``max_parallelism`` and
    ``parallelism``, ``clock`` (a keyed stage's event-time clock), ``live_rows`` and
    ``expired_rows`` (None: not recorded), ``state_size``, ``written_size`` (by this
    snapshot, as its statistics say) and ``parts``: per subtask its ``key_groups``
    ([first, last]; None for a plain stage), rows and ``files`` (``role``: "full snapshot",
    "change file" or "state"; ``type``, ``path`` relative to the job directory when below
    it, ``size``)."""
    statistics = {s["stage"]: s for s in checkpoint_statistics(snapshot.metadata)["stages"]}
    operators = {op.operator_id: op for op in snapshot.metadata.operator_states}
    stages = []
    for stage in snapshot.stages:
        operator = operators[stage]
        schema = snapshot.schema(stage)
        state_format = snapshot.state_format(stage)
        view = (_keyed(snapshot, stage, schema, operator) if state_format == CHAIN_FORMAT
                else _plain(snapshot, operator))
        timers = schema.field(TIMERS_COLUMN) if TIMERS_COLUMN in schema.names else None
        stages.append({
            "stage": stage, "kind": view["kind"], "format": state_format, "key": view["key"],
            "schema": _schema_fields(schema), "ttl": view["ttl"],
            "timers": None if timers is None else str(timers.type),
            "max_parallelism": view["max_parallelism"], "parallelism": operator.parallelism,
            "clock": view["clock"],
            "live_rows": _total(view["parts"], "live_rows"),
            "expired_rows": _total(view["parts"], "expired_rows"),
            "state_size": operator.state_size,
            "written_size": statistics.get(stage, {}).get("written_size"),
            "parts": view["parts"],
        })
    return stages


def stages_of(pointer: str, *, storage_options: Mapping | None = None) -> list[dict]:
    """``snapshot_stages`` of the pipeline checkpoint or savepoint at ``pointer``."""
    return snapshot_stages(open_snapshot(pointer, storage_options=storage_options))


STAGE_PART_SCHEMA = pa.schema([
    ("stage", pa.string()), ("kind", pa.string()), ("key", pa.list_(pa.string())),
    ("ttl_seconds", pa.float64()), ("ttl_time_characteristic", pa.string()),
    ("timers", pa.string()), ("max_parallelism", pa.int32()), ("parallelism", pa.int32()),
    ("subtask", pa.int32()), ("key_group_first", pa.int32()), ("key_group_last", pa.int32()),
    ("live_rows", pa.int64()), ("expired_rows", pa.int64()), ("files", pa.list_(pa.string())),
    ("bytes", pa.int64()),
])
"""The rows of ``format("checkpoint").option("view", "stages")``: one per stage part."""


def stage_part_rows(stages: list[dict]) -> pa.Table:
    """``snapshot_stages`` as one row per stage part (``STAGE_PART_SCHEMA``)."""
    rows = []
    for stage in stages:
        ttl = stage["ttl"] or {}
        for part in stage["parts"]:
            groups = part["key_groups"] or [None, None]
            rows.append({
                "stage": stage["stage"], "kind": stage["kind"], "key": stage["key"],
                "ttl_seconds": ttl.get("seconds"),
                "ttl_time_characteristic": ttl.get("time_characteristic"),
                "timers": stage["timers"], "max_parallelism": stage["max_parallelism"],
                "parallelism": stage["parallelism"], "subtask": part["subtask"],
                "key_group_first": groups[0], "key_group_last": groups[1],
                "live_rows": part["live_rows"], "expired_rows": part["expired_rows"],
                "files": [f["path"] or "(inline)" for f in part["files"]],
                "bytes": sum(f["size"] for f in part["files"]),
            })
    return pa.Table.from_pylist(rows, STAGE_PART_SCHEMA)
