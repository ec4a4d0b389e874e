"""Checkpoint statistics, like Flink's: per checkpoint and per operator (stage), the bytes it
wrote ("checkpointed size") against the bytes it references ("full size"), its files new and
reused, its rows, and how long its parts took.

A writer records them in the master state ``STATISTICS_STATE`` (JSON, see
``compute_checkpoint_statistics``); ``checkpoint_statistics`` reads them back, and derives
what the handles tell for a checkpoint written without them (sizes; new against reused by
comparing with the checkpoints retained before it), leaving the rest None.
"""

import json
from collections.abc import Iterable, Mapping, Sequence

from checkpoint_storage._handles import (
    ByteStreamStateHandle,
    FileStateHandle,
    SegmentFileStateHandle,
    StreamStateHandle,
)
from checkpoint_storage._master_states import STATISTICS_STATE, json_object_state
from checkpoint_storage._metadata import CheckpointMetadata, OperatorState

__all__ = [
    "STATISTICS_VERSION",
    "checkpoint_statistics",
    "compute_checkpoint_statistics",
    "encode_checkpoint_statistics",
    "handle_identity",
]

STATISTICS_VERSION = 1

_COUNTS = ("full_size", "written_size", "files", "files_new", "files_reused", "inline_handles",
           "full_snapshots", "change_files", "full_snapshots_new", "change_files_new",
           "live_rows", "expired_rows")


def handle_identity(handle: StreamStateHandle) -> tuple | None:
    """What makes two handles the same stored bytes: a file's path, a segment's path and
    range; None for inline state (it lives in `_metadata`, rewritten by every checkpoint)."""
    if isinstance(handle, SegmentFileStateHandle):
        return (handle.path, handle.start_position, handle.state_size)
    if isinstance(handle, FileStateHandle):
        return (handle.path,)
    return None


def _physical(handle: StreamStateHandle) -> str | None:
    return handle.path if isinstance(handle, FileStateHandle | SegmentFileStateHandle) else None


def _referenced(previous: Iterable[CheckpointMetadata]) -> tuple[set, set]:
    """The handle identities and physical files ``previous`` reference."""
    identities, files = set(), set()
    for metadata in previous:
        for handle in metadata.all_handles():
            if (identity := handle_identity(handle)) is not None:
                identities.add(identity)
                files.add(_physical(handle))
    return identities, files


def _recorded_count(op: OperatorState, name: str) -> int | None:
    try:
        counts = [int(s.properties[name]) for s in op.subtask_states.values()]
    except (KeyError, ValueError):
        return None
    return sum(counts) if counts else None


def _operator_statistics(op: OperatorState, identities: set | None, files: set | None,
                         parts: Mapping | None) -> dict:
    handles = [h for s in op.subtask_states.values() for h in s.handles]
    known = identities is not None
    stored = {}
    for handle in handles:
        path = _physical(handle)
        if path is not None:
            stored.setdefault(path, False)
            if known and handle_identity(handle) not in identities:
                stored[path] = True
    written = [h for h in handles if known and handle_identity(h) not in identities]
    new_files = [p for p, new in stored.items() if new and p not in files] if known else []
    rows, expired = _recorded_count(op, "rows"), _recorded_count(op, "expired_rows")
    stats = {
        "stage": op.operator_id,
        "kind": None,
        "full_size": op.state_size,
        "written_size": sum(h.state_size for h in written) if known else None,
        "files": len(stored),
        "files_new": len(new_files) if known else None,
        "files_reused": len(stored) - len(new_files) if known else None,
        "inline_handles": sum(1 for h in handles if isinstance(h, ByteStreamStateHandle)),
        "full_snapshots": None,
        "change_files": None,
        "full_snapshots_new": None,
        "change_files_new": None,
        "live_rows": None if rows is None or expired is None else rows - expired,
        "expired_rows": expired,
    }
    if parts is not None:
        stats["kind"] = parts.get("kind")
        for name in ("full_snapshots", "change_files"):
            if parts.get(name) is None:
                continue
            stats[name] = len(parts[name])
            stats[f"{name}_new"] = (sum(1 for h in parts[name] if handle_identity(h) is None
                                        or handle_identity(h) not in identities)
                                    if known else None)
    return stats


# Counts only some stages have (a keyed stage's files): the total of those that do.
_PARTIAL = {"full_snapshots", "change_files", "full_snapshots_new", "change_files_new"}


def _total(stages: Sequence[dict], name: str) -> int | None:
    values = [s[name] for s in stages]
    if name in _PARTIAL:
        known = [v for v in values if v is not None]
        return sum(known) if known else None
    if not values:
        return 0
    return None if None in values else sum(values)


def compute_checkpoint_statistics(
    metadata: CheckpointMetadata,
    previous: Iterable[CheckpointMetadata] | None = (),
    *,
    stages: Mapping[str, Mapping] | None = None,
    durations_ms: Mapping[str, float | None] | None = None,
    previous_publication: Mapping | None = None,
    recorded: bool = True,
) -> dict:
    """The statistics of ``metadata`` as a JSON-ready dict, comparing its handles with those
    of ``previous`` (the checkpoints retained before it; None: not known, so written bytes
    and new files are None). A file or segment none of them references is new: this
    checkpoint wrote it; inline state counts as written (it is in the new `_metadata`).

    ``stages`` adds what only the writer knows, per stage: ``kind`` ("plain", "keyed") and
    the handles of its ``full_snapshots`` and ``change_files``; ``durations_ms``: ``batch``
    (applying batches since the previous checkpoint), ``state_write`` (the stages'
    snapshots) and ``metadata_publication`` (None: a `_metadata` cannot hold the time of its
    own publication; ``previous_publication`` records the last one this writer measured,
    ``{"checkpoint_id", "ms"}``). Keys: ``version``, ``checkpoint_id``, ``recorded``, the
    counts (``full_size``, ``written_size``, ``files``, ``files_new``, ``files_reused``,
    ``inline_handles``, ``full_snapshots``, ``change_files``, ``full_snapshots_new``,
    ``change_files_new``, ``live_rows``, ``expired_rows``: totals, None when a stage does
    not know; a keyed stage's files: of the stages that have them, None when none does),
    ``durations_ms``, ``previous_publication`` and ``stages`` (the counts per stage, with
    ``stage`` and ``kind``)."""
    identities, files = (None, None) if previous is None else _referenced(previous)
    per_stage = [
        _operator_statistics(op, identities, files, (stages or {}).get(op.operator_id))
        for op in metadata.operator_states
    ]
    durations = {"batch": None, "state_write": None, "metadata_publication": None}
    durations |= {k: None if v is None else round(float(v), 1)
                  for k, v in (durations_ms or {}).items()}
    return {
        "version": STATISTICS_VERSION,
        "checkpoint_id": metadata.checkpoint_id,
        "recorded": recorded,
        **{name: _total(per_stage, name) for name in _COUNTS},
        "durations_ms": durations,
        "previous_publication": None if previous_publication is None else dict(
            previous_publication),
        "stages": per_stage,
    }


def encode_checkpoint_statistics(statistics: Mapping) -> bytes:
    """The bytes of the ``STATISTICS_STATE`` master state (compact JSON)."""
    return json.dumps(statistics, separators=(",", ":"), sort_keys=True).encode()


def _recorded(metadata: CheckpointMetadata) -> dict | None:
    value = json_object_state(metadata.master_states.get(STATISTICS_STATE), {"stages"})
    if value is None or not isinstance(value.get("stages"), list):
        return None
    return value


def checkpoint_statistics(
    metadata: CheckpointMetadata, previous: Iterable[CheckpointMetadata] | None = None
) -> dict:
    """The statistics ``metadata`` recorded (``recorded`` True), or, for a checkpoint written
    without them (or with a record this version cannot read), those its handles give
    (``recorded`` False: ``kind``, full snapshots and change files, durations None; written
    bytes and new files None unless ``previous``, the checkpoints retained before it, is
    given). Same keys either way (``compute_checkpoint_statistics``)."""
    recorded = _recorded(metadata)
    if recorded is not None:
        return recorded
    return compute_checkpoint_statistics(metadata, previous, recorded=False)
