"""What a pipeline retains: its checkpoints and savepoints with their decoded source positions,
as rows (``retained_snapshots``) and as the table the Dagster UI shows on the state asset
(``retained_metadata``: metadata key ``retained``).

The stateful asset (after each partition's checkpoint), the savepoint job and the retention
sensor all record it, so the newest event on the asset's page shows what is retained now.
Storage only: no Spark, no Dagster instance.
"""

import datetime as dt
from dataclasses import dataclass

import dagster as dg

from checkpoint_storage import (
    CheckpointInfo,
    FileSystemCheckpointStorage,
    InvalidCheckpointError,
    list_checkpoints,
)
from checkpoint_storage.spi import SOURCE_POSITION_STATE, format_age, format_size
from pipelines import SourcePosition, job_id_for
from pipelines.runner import SCHEDULED_SAVEPOINTS

__all__ = [
    "RETAINED_METADATA_KEY",
    "RetainedSnapshot",
    "retained_metadata",
    "retained_snapshots",
    "retained_table",
]

RETAINED_METADATA_KEY = "retained"
SCHEDULED_SAVEPOINT = "scheduled savepoint"
HAND_MADE_SAVEPOINT = "savepoint"
# Listed directories without a `_metadata`: nothing retained (yet, or ever).
WITHOUT_METADATA = ("in-progress", "abandoned")


@dataclass(frozen=True)
class RetainedSnapshot:
    """One retained checkpoint or savepoint. ``kind``: the checkpoint's kind (``checkpoint``,
    ``full checkpoint``), ``savepoint`` (made by hand, kept until disposed) or ``scheduled
    savepoint`` (thinned out by retention); ``status`` as ``checkpoints list`` says it
    (``completed``, ``invalid``, ``foreign``, ``unreadable``); ``position`` None when the
    `_metadata` could not be read or holds none."""

    checkpoint_id: int | None
    kind: str
    status: str
    position: SourcePosition | None
    state_size: int | None
    file_count: int
    modified: dt.datetime | None
    pointer: str

    @property
    def partition_end(self) -> bool:
        """Whether this holds the state at the end of a partition: a boundary to backfill
        from (``restore_from``) or read ``--as-of``."""
        return self.position is not None and self.position.complete

    def age(self, now: dt.datetime) -> dt.timedelta | None:
        return None if self.modified is None else now - self.modified


def _listed(directory: str, options: dict) -> list[CheckpointInfo]:
    try:
        return list_checkpoints(directory, storage_options=options)
    except FileNotFoundError:  # nothing written there yet
        return []


def _position(info: CheckpointInfo) -> SourcePosition | None:
    """The source position of a completed pipeline checkpoint (from the master states its
    listing read); None for others."""
    data = info.master_states.get(SOURCE_POSITION_STATE)
    if data is None:  # not completed, or written by something other than a pipeline
        return None
    try:
        return SourcePosition.from_bytes(data)
    except InvalidCheckpointError:
        return None


def _snapshot(info: CheckpointInfo, kind: str) -> RetainedSnapshot:
    return RetainedSnapshot(
        info.checkpoint_id, kind, info.status, _position(info), info.state_size,
        info.file_count, info.modified, info.pointer,
    )  # fmt: skip


def retained_snapshots(
    storage: FileSystemCheckpointStorage, pipeline_name: str
) -> list[RetainedSnapshot]:
    """The pipeline's checkpoints (every ``chk-<id>`` with a `_metadata`, by id), then its
    savepoints in ``<savepoint_dir>`` and ``<savepoint_dir>/scheduled`` (oldest first).
    I/O errors are raised."""
    job = job_id_for(pipeline_name).hex
    options = dict(storage.storage_options)
    base = storage.checkpoint_directory.rstrip("/")
    rows = [
        _snapshot(info, info.kind)
        for info in _listed(f"{base}/{job}", options)
        if info.status not in WITHOUT_METADATA
    ]
    savepoints = []
    if storage.savepoint_directory is not None:
        directory = storage.savepoint_directory.rstrip("/")
        for folder, kind in (
            (directory, HAND_MADE_SAVEPOINT),
            (f"{directory}/{SCHEDULED_SAVEPOINTS}", SCHEDULED_SAVEPOINT),
        ):
            savepoints += [
                _snapshot(info, kind)
                for info in _listed(folder, options)
                if info.status not in WITHOUT_METADATA and _owned_savepoint(info, job)
            ]
    epoch = dt.datetime.fromtimestamp(0, dt.UTC)
    savepoints.sort(key=lambda s: (s.modified or epoch, s.pointer))
    return rows + savepoints


def _owned_savepoint(info: CheckpointInfo, job: str) -> bool:
    if info.job_id is not None:
        return info.job_id == job
    # `_metadata` unreadable: the directory name carries the job id's first six characters.
    return info.pointer.rstrip("/").rsplit("/", 1)[-1].startswith(f"savepoint-{job[:6]}-")


# The pointer early: it is what restore_from and `checkpoints read` take, and a wide table is
# cut at the right of the UI's metadata column.
_COLUMNS = [
    ("id", "int", "checkpoint id"),
    ("kind", "string", "checkpoint, full checkpoint, savepoint (by hand) or scheduled savepoint"),
    ("partition", "string", "source position: the partition"),
    ("batches", "int", "source position: batches of the partition applied"),
    ("complete", "bool", "source position: all of the partition's batches applied"),
    ("partition_end", "string", "'partition end': the state at the end of the partition, a "
     "boundary to backfill the next partitions from (restore_from) or to read --as-of"),
    ("pointer", "string", "restore_from this, or `checkpoints read` it"),
    ("size", "string", "state size"),
    ("files", "int", "state files"),
    ("age", "string", "age when this was recorded"),
    ("written", "string", "when its _metadata was written (UTC)"),
    ("status", "string", "completed, or why its _metadata cannot be used"),
]


def retained_table(
    snapshots: list[RetainedSnapshot], now: dt.datetime | None = None
) -> dg.TableMetadataValue:
    """The table of ``snapshots`` (one row each) as Dagster metadata."""
    now = now or dt.datetime.now(dt.UTC)
    records = [
        dg.TableRecord(
            {
                "id": s.checkpoint_id,
                "kind": s.kind,
                "status": s.status,
                "partition": s.position.partition if s.position else None,
                "batches": s.position.batches if s.position else None,
                "complete": s.position.complete if s.position else None,
                "partition_end": "partition end" if s.partition_end else "",
                "size": "-" if s.state_size is None else format_size(s.state_size),
                "files": s.file_count,
                "written": "-" if s.modified is None else s.modified.strftime("%Y-%m-%d %H:%M:%S"),
                "age": format_age(s.age(now)),
                "pointer": s.pointer,
            }
        )
        for s in snapshots
    ]
    schema = dg.TableSchema(
        columns=[dg.TableColumn(name, kind, description) for name, kind, description in _COLUMNS]
    )
    return dg.MetadataValue.table(records, schema)


def retained_metadata(storage: FileSystemCheckpointStorage, pipeline_name: str) -> dict:
    """``{"retained": <table>}``: what the pipeline retains now, for an asset event."""
    return {RETAINED_METADATA_KEY: retained_table(retained_snapshots(storage, pipeline_name))}
