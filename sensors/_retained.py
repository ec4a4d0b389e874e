"""What a pipeline retains: its checkpoints and savepoints with their decoded source positions,
as rows (``retained_snapshots``) and as the table the Dagster UI shows on the state asset
(``retained_metadata``: metadata key ``retained``).

The stateful asset (after each partition's checkpoint), the savepoint job and the retention
sensor all record it, so the newest event on the asset's page shows what is retained now.
Storage only: no Spark, no Dagster instance.
"""

import datetime as dt
from collections.abc import Sequence
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
    "EVENT_KEY",
    "MATERIALIZATION_EVENT",
    "RETAINED_METADATA_KEY",
    "RETENTION_TICK_EVENT",
    "SAVEPOINT_EVENT",
    "RetainedSnapshot",
    "position_label",
    "relative_pointer",
    "retained_directories",
    "retained_entries",
    "retained_metadata",
    "retained_snapshots",
    "retained_table",
]

RETAINED_METADATA_KEY = "retained"
# The first metadata entry of each event on the state asset: which kind of event it is (the
# UI's event list tells materializations from observations by their icon only).
EVENT_KEY = "event"
MATERIALIZATION_EVENT = "materialization"
SAVEPOINT_EVENT = "savepoint"
RETENTION_TICK_EVENT = "retention tick"
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
    written_size: int | None = None
    """The bytes it wrote itself (its statistics); the rest of its size it shares with the
    checkpoints before it. None: not known."""

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
        (info.statistics or {}).get("written_size"),
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


# Narrow enough for the event panel of the asset page at 1280 px (about 490 px beside the
# metadata keys): one position column instead of partition, batches and completeness, and the
# pointer last and relative, so that it never wraps size, files and age out of sight. Full
# pointers are too long to wrap (a 32-digit job id): the schema names the directories instead.
_COLUMNS = [
    ("id", "int", "checkpoint id"),
    ("kind", "string", "checkpoint, full checkpoint, savepoint (by hand) or scheduled savepoint"),
    ("position", "string", "the source position it holds: '<partition> end' when all of the "
     "partition's batches are applied (a boundary to backfill the next partitions from with "
     "restore_from, or to read --as-of), '<partition> batch <n>' after n batches; else its "
     "status (invalid, foreign, unreadable: why its _metadata cannot be used)"),
    ("size", "string", "state size: all the state it references"),
    ("written", "string", "the bytes it wrote itself (the rest of its size it shares with "
     "older checkpoints); '-' when not known"),
    ("files", "int", "state files"),
    ("age", "string", "age when this was recorded"),
    ("pointer", "string", "relative to the directory that holds it"),
]


def position_label(snapshot: RetainedSnapshot) -> str:
    """``2026-10-04 end``, ``2026-10-05 batch 2``, or why there is no position."""
    position = snapshot.position
    if position is None:
        return snapshot.status if snapshot.status != "completed" else "no source position"
    if position.complete:
        return f"{position.partition} end"
    return f"{position.partition} batch {position.batches}"


def relative_pointer(pointer: str, directories: Sequence[str]) -> str:
    """``pointer`` relative to the first of ``directories`` that holds it (``chk-18``,
    ``savepoint-2b2376-…``); the pointer itself when none does."""
    for directory in directories:
        prefix = directory.rstrip("/") + "/"
        if pointer.startswith(prefix) and len(pointer) > len(prefix):
            return pointer[len(prefix) :].rstrip("/")
    return pointer


def retained_table(
    snapshots: list[RetainedSnapshot],
    now: dt.datetime | None = None,
    directories: Sequence[str] = (),
) -> dg.TableMetadataValue:
    """The table of ``snapshots`` (one row each) as Dagster metadata, pointers relative to
    the first of ``directories`` that holds them (``retained_directories``)."""
    now = now or dt.datetime.now(dt.UTC)
    records = [
        dg.TableRecord(
            {
                "id": s.checkpoint_id,
                "kind": s.kind,
                "position": position_label(s),
                "size": "-" if s.state_size is None else format_size(s.state_size),
                "written": "-" if s.written_size is None else format_size(s.written_size),
                "files": s.file_count,
                "age": format_age(s.age(now), compact=True),
                "pointer": relative_pointer(s.pointer, directories),
            }
        )
        for s in snapshots
    ]
    described = dict(pointer=_COLUMNS[-1][2] + (
        f": {', '.join(directories)} (for restore_from or `checkpoints read`, join it to its "
        "directory: chk-<id> to the first, a savepoint to the one of its kind)"
        if directories else ""
    ))  # fmt: skip
    schema = dg.TableSchema(
        columns=[
            dg.TableColumn(name, kind, described.get(name, description))
            for name, kind, description in _COLUMNS
        ]
    )
    return dg.MetadataValue.table(records, schema)


def retained_directories(storage: FileSystemCheckpointStorage, pipeline_name: str) -> list[str]:
    """The directories the ``retained`` table's pointers are relative to: the pipeline's
    job directory, then the scheduled and the hand-made savepoints' (when there are
    savepoints); the kind column tells which."""
    job = job_id_for(pipeline_name).hex
    directories = [f"{storage.checkpoint_directory.rstrip('/')}/{job}"]
    if storage.savepoint_directory is not None:
        savepoints = storage.savepoint_directory.rstrip("/")
        directories += [f"{savepoints}/{SCHEDULED_SAVEPOINTS}", savepoints]
    return directories


def retained_entries(
    snapshots: list[RetainedSnapshot], directories: Sequence[str]
) -> dict[str, dg.MetadataValue]:
    """``retained``: the table, for an asset event."""
    return {RETAINED_METADATA_KEY: retained_table(snapshots, directories=directories)}


def retained_metadata(storage: FileSystemCheckpointStorage, pipeline_name: str) -> dict:
    """``retained``: what the pipeline retains now, for an asset event."""
    snapshots = retained_snapshots(storage, pipeline_name)
    return retained_entries(snapshots, retained_directories(storage, pipeline_name))
