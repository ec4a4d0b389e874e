"""The retention sensor: keeps checkpoint and savepoint storage bounded.

Each evaluation (at most every ``minimum_interval_seconds``, default hourly) does, in order:

1. **Checkpoint retention** (the store's own): a recovered ``FileSystemCompletedCheckpointStore``
   with ``max_retained_checkpoints``, told to ``subsume()``, deletes the completed checkpoints
   beyond it,
   which a crash between "new checkpoint published" and "old one subsumed" leaves behind. The
   newest completed checkpoint is never subsumed, nor the pipeline's head (furthest position)
   and the ends of its last ``retain_partition_ends`` partitions (``position_retention``).
2. **Garbage collection** (``collect_garbage``): unreferenced files below ``chk-<id>/`` and
   ``shared/`` older than the grace period (abandoned checkpoints, failed task attempts); never
   a ``chk-<id>`` whose writer still holds the job lease.
3. **Savepoint retention** (optional): of the savepoints in ``<savepoint_dir>/scheduled`` (the
   savepoint schedule's, see ``sensors.savepoints``) the newest ``keep_scheduled_savepoints``
   are kept; savepoints made by hand (directly in ``<savepoint_dir>``) are kept unless
   ``keep_hand_made_savepoints`` is set.

Never deleted: the latest completed checkpoint; anything a retained checkpoint references
(the store and the collector only delete what no retained checkpoint names); a savepoint
**in use**, which is one that

- a run that has not finished (queued, starting, started) or a backfill in progress names as
  ``restore_from`` in its run config, or
- is where the current checkpoint lineage began: following the ``restored_from`` metadata of
  the pipeline's state materializations back from each retained checkpoint reaches it (a backfill
  from that savepoint produced the checkpoints that are retained now), or
- holds a file a retained checkpoint references.

While a run or backfill is in progress, steps 1 and 3 are deferred to a later tick (it may be
restoring from a checkpoint or savepoint right now); step 2 always runs, because the collector
is safe next to a running job as long as the grace period exceeds the longest checkpoint.

Reporting: the sensor launches no run. When it deleted something, or what is retained changed
since its last tick (runs, savepoints, the CLI), it records an ``AssetObservation`` on the
pipeline's state asset (what was deleted, bytes, what was kept as in use, and the ``retained``
table of every checkpoint and savepoint left), so the deletions appear on the asset's page next
to the checkpoints they concern, and it logs the summary in the tick's logs; otherwise the tick
is skipped with a reason saying what was checked. The cursor keeps the time of the last
evaluation, running totals and the pointers retained, so ticks stay idempotent (a second
evaluation finds nothing to delete and nothing new to record). A run per cleanup would have
put a Spark-less run in the run list every hour for nothing.

The work happens inside the sensor evaluation, which Dagster bounds (60 s by default,
``DAGSTER_SENSOR_GRPC_TIMEOUT_SECONDS``): raise it for stores with very many files.

Infrastructure errors (``OSError`` and the library's errors) propagate: the tick fails and
shows the error; they are never turned into a skip. A subsumed checkpoint whose ``_metadata``
could not be deleted (the store only logs that) fails the tick as well.

Settings from the environment (read when the code location loads): ``RETENTION_GRACE_SECONDS``
(default 7200), ``KEEP_SCHEDULED_SAVEPOINTS`` (default 7; ``all`` keeps every one),
``KEEP_HAND_MADE_SAVEPOINTS`` (default ``all``), ``RETENTION_INTERVAL_SECONDS`` (3600).
"""

import datetime as dt
import json
import logging
import os
from dataclasses import dataclass, field

import dagster as dg

from checkpoint_storage import (
    CheckpointInfo,
    CheckpointRetentionPolicy,
    FileSystemCheckpointStorage,
    GarbageCollectionResult,
    collect_garbage,
    dispose_savepoint,
    list_checkpoints,
)
from checkpoint_storage.spi import (
    AlsoRetained,
    FileStateHandle,
    FileSystemCompletedCheckpointStore,
    format_size,
)
from pipelines import StatefulPipeline, job_id_for
from pipelines.runner import SCHEDULED_SAVEPOINTS, position_retention
from resources import CheckpointStorageResource
from sensors._retained import (
    EVENT_KEY,
    RETENTION_TICK_EVENT,
    retained_directories,
    retained_entries,
    retained_snapshots,
)

__all__ = [
    "RetentionPolicy",
    "RetentionReport",
    "apply_retention",
    "build_retention_sensor",
    "savepoints_in_use",
    "work_in_progress",
]

logger = logging.getLogger(__name__)
_ACTIVE_BACKFILLS = ("REQUESTED", "CANCELING")
_ACTIVE_RUNS = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]


def _env_keep(name: str, default: str) -> int | None:
    value = os.environ.get(name, default).strip().lower()
    return None if value in ("all", "none", "") else int(value)


@dataclass(frozen=True)
class RetentionPolicy:
    """``keep_*_savepoints``: how many of the newest to keep; None keeps all of them."""

    grace_period: dt.timedelta = dt.timedelta(hours=2)
    keep_scheduled_savepoints: int | None = 7
    keep_hand_made_savepoints: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_scheduled_savepoints", "keep_hand_made_savepoints"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None (keep all), got {value}")

    @classmethod
    def from_env(cls) -> "RetentionPolicy":
        return cls(
            dt.timedelta(seconds=float(os.environ.get("RETENTION_GRACE_SECONDS", "7200"))),
            _env_keep("KEEP_SCHEDULED_SAVEPOINTS", "7"),
            _env_keep("KEEP_HAND_MADE_SAVEPOINTS", "all"),
        )


@dataclass
class RetentionReport:
    """What ``apply_retention`` deleted: the checkpoints beyond the retained ones, the garbage
    collector's result, the savepoints beyond the newest K (and their bytes), the savepoints
    kept because they are in use (pointer -> why), and why retention was deferred (None: it
    was not)."""

    subsumed_checkpoints: list[str] = field(default_factory=list)
    garbage: GarbageCollectionResult = field(default_factory=GarbageCollectionResult)
    deleted_savepoints: list[str] = field(default_factory=list)
    savepoint_bytes_deleted: int = 0
    kept_in_use: dict[str, str] = field(default_factory=dict)
    deferred: str | None = None

    @property
    def deleted_anything(self) -> bool:
        return bool(
            self.subsumed_checkpoints
            or self.garbage.deleted
            or self.deleted_savepoints
            or self.garbage.removed_directories
        )

    def summary(self) -> str:
        parts = [
            f"subsumed {len(self.subsumed_checkpoints)} checkpoint(s)",
            f"garbage: {self.garbage.summary()}",
            f"disposed {len(self.deleted_savepoints)} savepoint(s) "
            f"({format_size(self.savepoint_bytes_deleted)})",
        ]
        if self.kept_in_use:
            parts.append(f"kept {len(self.kept_in_use)} savepoint(s) in use")
        if self.deferred:
            parts.append(f"checkpoint and savepoint retention deferred: {self.deferred}")
        return "; ".join(parts)

    def metadata(self) -> dict:
        return {
            "subsumed_checkpoints": dg.MetadataValue.json(self.subsumed_checkpoints),
            "garbage_files_deleted": len(self.garbage.deleted),
            "garbage_bytes_deleted": self.garbage.bytes_deleted,
            "garbage_deleted": dg.MetadataValue.json(list(self.garbage.deleted)),
            "deleted_savepoints": dg.MetadataValue.json(self.deleted_savepoints),
            "savepoint_bytes_deleted": self.savepoint_bytes_deleted,
            "kept_in_use": dg.MetadataValue.json(self.kept_in_use),
            # Checkpoints whose `_metadata` could not be read (foreign, corrupt, unreadable):
            # all their files and shared/ were kept; someone has to look at them.
            "unreadable_checkpoints": dg.MetadataValue.json(
                [{"pointer": c.pointer, "reason": c.reason, "detail": c.detail}
                 for c in self.garbage.skipped]
            ),
            "deferred": self.deferred or "no",
            "summary": self.summary(),
        }


def _list(directory: str, options: dict) -> list[CheckpointInfo]:
    try:
        return list_checkpoints(directory, storage_options=options)
    except FileNotFoundError:
        return []


def _completed_checkpoints(access, options: dict) -> list[str]:
    return [
        info.pointer
        for info in _list(access.checkpoints_directory, options)
        if info.completed and info.kind != "savepoint"
    ]


def _savepoints(directory: str, job_hex: str, options: dict) -> list[CheckpointInfo]:
    """The pipeline's completed savepoints directly in ``directory``, oldest first."""
    found = [
        info
        for info in _list(directory, options)
        if info.completed and info.kind == "savepoint" and info.job_id in (job_hex, None)
    ]
    epoch = dt.datetime.fromtimestamp(0, dt.UTC)
    return sorted(found, key=lambda i: (i.modified or epoch, i.checkpoint_id or 0, i.pointer))


def _referenced_directories(store: FileSystemCompletedCheckpointStore) -> set[str]:
    """Directories holding files that retained checkpoints reference."""
    return {
        handle.path.rstrip("/").rsplit("/", 1)[0]
        for checkpoint in store.all()
        for handle in checkpoint.metadata.all_handles()
        if isinstance(handle, FileStateHandle)
    }


def apply_retention(
    storage: FileSystemCheckpointStorage,
    *,
    max_retained: int,
    policy: RetentionPolicy,
    in_use: dict[str, str] | None = None,
    deferred: str | None = None,
    now: dt.datetime | float | None = None,
    pipeline: str,
    also_retain: AlsoRetained | None = None,
) -> RetentionReport:
    """Apply checkpoint retention, garbage collection and savepoint retention to the
    ``pipeline``'s storage (see the module docstring); ``in_use`` maps savepoint pointers to
    why they must stay; ``deferred`` (a reason) skips checkpoint and savepoint retention;
    ``also_retain`` is the pipeline's rule for checkpoints kept besides the newest
    ``max_retained`` (``position_retention``: its head and partition ends)."""
    in_use = {p.rstrip("/"): why for p, why in (in_use or {}).items()}
    options = dict(storage.storage_options)
    job_id = job_id_for(pipeline)
    access = storage.create_checkpoint_storage(job_id)
    report = RetentionReport(kept_in_use={}, deferred=deferred)

    if deferred is None:
        before = _completed_checkpoints(access, options)
        store = FileSystemCompletedCheckpointStore(
            access, max_retained, CheckpointRetentionPolicy.RETAIN_ON_CANCELLATION,
            also_retain=also_retain,
        )
        store.subsume()  # recovery reads only; retention subsumes explicitly
        retained = {c.external_pointer.rstrip("/") for c in store.all()}
        report.subsumed_checkpoints = [p for p in before if p.rstrip("/") not in retained]
        still_there = set(report.subsumed_checkpoints) & set(
            _completed_checkpoints(access, options)
        )
        if still_there:  # the store logs discard failures; retention must not hide them
            raise OSError(f"could not delete subsumed checkpoint(s) {sorted(still_there)}")
        referenced = _referenced_directories(store)
    else:
        referenced = set()

    report.garbage = collect_garbage(
        access, grace_period=policy.grace_period, now=now,
        extra_references=[p for p in in_use if p.startswith(access.checkpoints_directory)],
    )  # fmt: skip

    if deferred is None and storage.savepoint_directory is not None:
        base = storage.savepoint_directory.rstrip("/")
        for directory, keep in (
            (f"{base}/{SCHEDULED_SAVEPOINTS}", policy.keep_scheduled_savepoints),
            (base, policy.keep_hand_made_savepoints),
        ):
            if keep is None:
                continue
            savepoints = _savepoints(directory, job_id.hex, options)
            for info in savepoints[: max(0, len(savepoints) - keep)]:
                pointer = info.pointer.rstrip("/")
                why = in_use.get(pointer) or (
                    "a retained checkpoint references its files"
                    if any(d == pointer or d.startswith(pointer + "/") for d in referenced)
                    else None
                )
                if why:
                    report.kept_in_use[pointer] = why
                    continue
                dispose_savepoint(pointer, storage_options=options)
                report.deleted_savepoints.append(pointer)
                report.savepoint_bytes_deleted += info.state_size or 0
    logger.info("retention of %s: %s", pipeline, report.summary())
    return report


# --- what the Dagster instance knows --------------------------------------------------


def _restore_from(run_config: dict | None, op_name: str) -> str | None:
    ops = (run_config or {}).get("ops", {})
    value = ops.get(op_name, {}).get("config", {}).get("restore_from")
    return value if isinstance(value, str) and value else None


def work_in_progress(
    instance: dg.DagsterInstance, op_name: str
) -> tuple[str | None, dict[str, str]]:
    """A reason to defer retention (runs or backfills in progress) or None, and the
    snapshots those name as ``restore_from`` of op ``op_name`` (the pipeline's stateful
    step). Any run in progress defers: from the instance alone one cannot always tell which
    pipelines an asset backfill's run will touch, and deferring is always safe."""
    runs = instance.get_runs(dg.RunsFilter(statuses=_ACTIVE_RUNS), limit=100)
    backfills = [
        b for b in instance.get_backfills(limit=100) if b.status.value in _ACTIVE_BACKFILLS
    ]
    named = {}
    for run in runs:
        pointer = _restore_from(run.run_config, op_name)
        if pointer:
            named[pointer] = f"run {run.run_id} ({run.status.value}) restores from it"
    for backfill in backfills:
        pointer = _restore_from(backfill.run_config, op_name)
        if pointer:
            named[pointer] = f"backfill {backfill.backfill_id} restores from it"
    if not runs and not backfills:
        return None, named
    what = [f"run {r.run_id} ({r.status.value})" for r in runs[:3]]
    what += [f"backfill {b.backfill_id}" for b in backfills[:3]]
    return f"in progress: {', '.join(what)}", named


def savepoints_in_use(
    instance: dg.DagsterInstance,
    retained_checkpoints: list[str],
    asset: str,
    *,
    limit: int = 1000,
) -> dict[str, str]:
    """Savepoints the current lineage began at: following the ``restored_from`` metadata of
    ``asset``'s materializations back from each retained checkpoint."""
    records = instance.fetch_materializations(dg.AssetKey(asset), limit=limit).records
    origin: dict[str, str] = {}
    for record in records:
        metadata = record.asset_materialization.metadata
        pointer, source = metadata.get("checkpoint_pointer"), metadata.get("restored_from")
        if pointer is not None and source is not None:
            origin[str(pointer.value).rstrip("/")] = str(source.value).rstrip("/")
    in_use = {}
    for start in retained_checkpoints:
        seen, pointer = set(), start.rstrip("/")
        while pointer in origin and pointer not in seen:
            seen.add(pointer)
            pointer = origin[pointer]
            if pointer.rsplit("/", 1)[-1].startswith("savepoint-"):
                in_use[pointer] = f"the retained checkpoint {start} descends from it"
                break
    return in_use


def build_retention_sensor(
    pipeline: StatefulPipeline,
    policy: RetentionPolicy | None = None,
    *,
    minimum_interval_seconds: int | None = None,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
) -> dg.SensorDefinition:
    """``<pipeline>_retention_sensor`` with ``policy`` (default: ``RetentionPolicy.from_env()``)."""
    policy = policy or RetentionPolicy.from_env()
    interval = minimum_interval_seconds or int(os.environ.get("RETENTION_INTERVAL_SECONDS", 3600))
    name = pipeline.name

    @dg.sensor(
        name=f"{name}_retention_sensor",
        minimum_interval_seconds=interval,
        default_status=default_status,
        description=f"Subsume checkpoints of {name} beyond its "
        f"{pipeline.max_retained_checkpoints} retained ones, collect unreferenced files older "
        f"than {policy.grace_period}, keep the newest {policy.keep_scheduled_savepoints or 'all'} "
        f"scheduled savepoints and {policy.keep_hand_made_savepoints or 'all'} hand-made ones. "
        f"Records what it deleted, and the retained table when it changed, as an observation "
        f"of {name}.",
    )
    def retention(
        context: dg.SensorEvaluationContext, checkpoint_storage: CheckpointStorageResource
    ):
        storage = checkpoint_storage.checkpoint_storage()
        access = storage.create_checkpoint_storage(job_id_for(name))
        deferred, named = work_in_progress(context.instance, name)
        retained = _completed_checkpoints(access, dict(storage.storage_options))
        in_use = savepoints_in_use(context.instance, retained, name) | named
        report = apply_retention(
            storage,
            max_retained=pipeline.max_retained_checkpoints,
            also_retain=position_retention(pipeline),
            policy=policy,
            in_use=in_use,
            deferred=deferred,
            pipeline=name,
        )
        previous = json.loads(context.cursor) if context.cursor else {}
        snapshots = retained_snapshots(storage, name)
        pointers = [s.pointer for s in snapshots]
        deleted = (
            len(report.subsumed_checkpoints) + len(report.garbage.deleted)
            + len(report.deleted_savepoints)
        )  # fmt: skip
        cursor = json.dumps(
            {
                "evaluated_at": dt.datetime.now(dt.UTC).isoformat(),
                "deleted_total": int(previous.get("deleted_total", 0)) + deleted,
                "last": report.summary(),
                "retained": pointers,
            }
        )
        context.log.info(report.summary())
        for skipped in report.garbage.skipped:
            context.log.warning(f"kept {skipped.pointer} whole: {skipped.detail}")
        changed = pointers != previous.get("retained", [])
        if not report.deleted_anything and not report.garbage.skipped and not changed:
            return dg.SensorResult(
                skip_reason=dg.SkipReason(
                    f"nothing to delete, retained unchanged: {report.summary()}"
                ),
                cursor=cursor,
            )
        # The UI's event list shows no label, only the event's icon: the description says what
        # the event is first.
        if report.deleted_anything:
            description = "Retention tick: deleted storage"
        elif report.garbage.skipped:
            description = "Retention tick: kept checkpoints it cannot read"
        else:
            description = "Retention tick: retained checkpoints and savepoints changed"
        return dg.SensorResult(
            cursor=cursor,
            asset_events=[
                dg.AssetObservation(
                    name,
                    description=description,
                    metadata={EVENT_KEY: RETENTION_TICK_EVENT}
                    | report.metadata()
                    | retained_entries(snapshots, retained_directories(storage, name)),
                )
            ],
        )

    return retention
