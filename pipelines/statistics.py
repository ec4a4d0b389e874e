"""Checkpoint statistics as operators look at them: flat numeric entries for an asset event
(Dagster plots each numeric entry across materializations), and the history of a job's
retained checkpoints (``checkpoints history``), with what older asset events recorded.
"""

from collections.abc import Iterable, Mapping

from checkpoint_storage import CheckpointInfo, list_checkpoints
from checkpoint_storage.spi import SOURCE_POSITION_STATE

__all__ = ["STATISTICS_METADATA", "checkpoint_history", "history_from_events",
           "statistics_metadata"]

STATISTICS_METADATA = {
    "bytes_written": "written_size",
    "bytes_full": "full_size",
    "files_new": "files_new",
    "files_reused": "files_reused",
    "full_snapshots": "full_snapshots",
    "change_files": "change_files",
    "live_rows": "live_rows",
    "expired_rows": "expired_rows",
}
"""Asset event metadata key -> checkpoint statistics key (totals)."""

_DURATIONS = {"batch_ms": "batch", "state_write_ms": "state_write",
              "metadata_publication_ms": "metadata_publication"}


def statistics_metadata(statistics: Mapping | None) -> dict[str, int | float]:
    """A checkpoint's statistics as numeric asset event metadata: the totals
    (``STATISTICS_METADATA``), the durations (``batch_ms``, ``state_write_ms``,
    ``metadata_publication_ms``) and per stage ``bytes_written_<stage>``; entries that are
    not known are left out, so that each stays numeric (and plotted)."""
    if not statistics:
        return {}
    entries = {key: statistics[name] for key, name in STATISTICS_METADATA.items()
               if statistics.get(name) is not None}
    durations = statistics.get("durations_ms") or {}
    entries |= {key: durations[name] for key, name in _DURATIONS.items()
                if durations.get(name) is not None}
    entries |= {f"bytes_written_{s['stage']}": s["written_size"]
                for s in statistics.get("stages", []) if s.get("written_size") is not None}
    return entries


def _position(info: CheckpointInfo) -> str | None:
    from pipelines.runner import SourcePosition

    data = info.master_states.get(SOURCE_POSITION_STATE)
    if data is None:
        return None
    try:
        return str(SourcePosition.from_bytes(data))
    except ValueError:
        return None


def _row(info: CheckpointInfo, publication: float | None) -> dict:
    statistics = info.statistics or {}
    durations = dict(statistics.get("durations_ms") or {})
    if durations.get("metadata_publication") is None:
        durations["metadata_publication"] = publication
    timestamp = info.metadata.timestamp_ms if info.metadata is not None else None
    return {
        "source": "checkpoint",
        "checkpoint_id": info.checkpoint_id,
        "timestamp_ms": timestamp,
        "kind": info.kind,
        "position": _position(info),
        "recorded": statistics.get("recorded"),
        **{name: statistics.get(name) for name in STATISTICS_METADATA.values()},
        "durations_ms": durations,
        "pointer": info.pointer,
    }


def checkpoint_history(job_directory: str, *, storage_options: Mapping | None = None
                       ) -> list[dict]:
    """The statistics of the job's retained checkpoints, oldest first: per checkpoint
    ``source`` ("checkpoint"), ``checkpoint_id``, ``timestamp_ms``, ``kind``, ``position``,
    ``recorded``, the totals (``written_size``, ``full_size``, ``files_new``,
    ``files_reused``, ``full_snapshots``, ``change_files``, ``live_rows``,
    ``expired_rows``), ``durations_ms`` (``batch``, ``state_write``,
    ``metadata_publication``: the next checkpoint records this one's) and ``pointer``."""
    infos = [i for i in list_checkpoints(job_directory, storage_options=dict(storage_options
                                                                              or {}))
             if i.completed and i.kind != "savepoint"]
    published = {}
    for info in infos:
        previous = (info.statistics or {}).get("previous_publication")
        if previous:
            published[previous.get("checkpoint_id")] = previous.get("ms")
    return [_row(info, published.get(info.checkpoint_id)) for info in infos]


def history_from_events(events: Iterable[tuple[int | None, Mapping]], retained: set[int]
                        ) -> list[dict]:
    """Rows of ``checkpoint_history``'s shape from asset events (``(timestamp_ms,
    metadata)`` with plain values) of checkpoints no longer retained, oldest first; events
    without a ``checkpoint_id`` are skipped."""
    rows = {}
    for timestamp, metadata in events:
        checkpoint_id = metadata.get("checkpoint_id")
        if not isinstance(checkpoint_id, int) or checkpoint_id in retained:
            continue
        rows[checkpoint_id] = {
            "source": "dagster event log",
            "checkpoint_id": checkpoint_id,
            "timestamp_ms": timestamp,
            "kind": "checkpoint",
            "position": metadata.get("source_position"),
            "recorded": None,
            **{name: metadata.get(key) for key, name in STATISTICS_METADATA.items()},
            "durations_ms": {name: metadata.get(key) for key, name in _DURATIONS.items()},
            "pointer": metadata.get("checkpoint_pointer"),
        }
    return [rows[i] for i in sorted(rows)]
