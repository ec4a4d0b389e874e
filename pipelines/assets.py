"""The Dagster assets: landed click events, the stateful ``user_activity`` state with its
``daily_report``, and the ``checkpoint_integrity`` check (DESIGN §5).

No ``from __future__ import annotations`` here: Dagster reads the ``config`` parameters'
annotations at definition time.
"""

import os
from pathlib import Path

import dagster as dg

from checkpoint_storage import (
    InvalidCheckpointError,
    RestoreMode,
    list_checkpoints,
    verify_checkpoint,
)
from checkpoint_storage._filesystems import format_size
from pipelines.events import generate_day
from pipelines.runner import PartitionResult, StatefulRunner, check_restore_from
from resources import CheckpointStorageResource, DataLakeResource, SparkResource

__all__ = [
    "DAILY_PARTITIONS",
    "FAULT_INJECTION_ENV",
    "FAULT_TAG",
    "FIRST_PARTITION",
    "LandingConfig",
    "StatefulRunConfig",
    "build_runner",
    "checkpoint_integrity",
    "checkpoint_integrity_job",
    "click_events",
    "daily_pipeline",
    "default_resources",
    "user_activity",
]

FIRST_PARTITION = "2026-10-01"
DAILY_PARTITIONS = dg.DailyPartitionsDefinition(start_date=FIRST_PARTITION, timezone="UTC")
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def default_resources() -> dict:
    """The embedded defaults (local Spark, directories under the project's ``.data``), each
    overridable from the environment: ``SPARK_MASTER``, ``CHECKPOINT_DIR``, ``SAVEPOINT_DIR``,
    ``CHECKPOINT_STORAGE_OPTIONS`` (JSON of non-secret fsspec options, e.g. an S3
    ``endpoint_url``), ``LANDING_DIR``, ``REPORT_DIR``, ``PIPELINE_DATA_DIR``."""
    import json

    data = Path(os.environ.get("PIPELINE_DATA_DIR", PROJECT_ROOT / ".data"))
    env = os.environ.get
    return {
        "spark": SparkResource(master=env("SPARK_MASTER", "local[*]")),
        "checkpoint_storage": CheckpointStorageResource(
            checkpoint_dir=env("CHECKPOINT_DIR", str(data / "checkpoints")),
            savepoint_dir=env("SAVEPOINT_DIR", str(data / "savepoints")),
            storage_options=json.loads(env("CHECKPOINT_STORAGE_OPTIONS", "{}")),
        ),
        "lake": DataLakeResource(
            landing_dir=env("LANDING_DIR", str(data / "landing")),
            report_dir=env("REPORT_DIR", str(data / "reports")),
        ),
    }


# --- test seam: a real failure in a real run (off by default) -------------------------
# The end-to-end tests (tests/acceptance) need a run of daily_pipeline that fails midway in
# the real processes, without mocks, so that the recovery sensor has something to recover.
# Only when the code location's environment has PIPELINE_FAULT_INJECTION=1 does a run tagged
# ``test/fail_after_batch=<k>`` raise right after applying its k-th batch (counted from 1
# within a partition, before that position's checkpoint). Without the env var the tag is
# ignored; recovery runs do not carry the failed run's tags, so they run through.
FAULT_INJECTION_ENV = "PIPELINE_FAULT_INJECTION"
FAULT_TAG = "test/fail_after_batch"


class InjectedFault(RuntimeError):
    """The failure the test seam injects (never raised unless enabled, see above)."""


def _fault_hook(tags: dict[str, str]):
    if os.environ.get(FAULT_INJECTION_ENV) != "1" or FAULT_TAG not in tags:
        return None
    after = int(tags[FAULT_TAG])

    def hook(point: str, **info) -> None:
        if point == "batch_applied" and info.get("batch", -1) + 1 == after:
            raise InjectedFault(
                f"injected fault ({FAULT_TAG}={after}) after batch {after} of "
                f"{info.get('partition')}"
            )

    return hook


def build_runner(
    spark: SparkResource,
    checkpoint_storage: CheckpointStorageResource,
    lake: DataLakeResource,
    **options,
) -> StatefulRunner:
    """The pipeline's runner, from resources (which stay here on the driver: only the plain
    storage object they hand out reaches the executors)."""
    return StatefulRunner(
        spark.session,
        checkpoint_storage.checkpoint_storage(),
        landing_dir=lake.landing_dir,
        report_dir=lake.report_dir,
        first_partition=FIRST_PARTITION,
        checkpoint_interval=checkpoint_storage.checkpoint_interval_batches,
        max_retained=checkpoint_storage.max_retained_checkpoints,
        **options,
    )


class LandingConfig(dg.Config):
    """The generator that stands in for a real source."""

    batches_per_day: int = 4
    events_per_batch: int = 2_000
    users: int = 500
    seed: int = 7


@dg.asset(
    partitions_def=DAILY_PARTITIONS,
    backfill_policy=dg.BackfillPolicy.single_run(),
    group_name="clicks",
    kinds={"parquet"},
    description="Click events landed as several Parquet batches per day, with duplicate "
    "deliveries and late events (generated here; a real source in production).",
)
def click_events(
    context: dg.AssetExecutionContext, config: LandingConfig, lake: DataLakeResource
) -> dg.MaterializeResult:
    days = [
        generate_day(
            lake.landing_dir,
            partition,
            batches=config.batches_per_day,
            events_per_batch=config.events_per_batch,
            users=config.users,
            seed=config.seed,
        )
        for partition in context.partition_keys
    ]
    return dg.MaterializeResult(
        metadata={
            "landing_dir": dg.MetadataValue.path(lake.landing_dir),
            "batches": sum(d.batches for d in days),
            "rows": sum(d.rows for d in days),
            "duplicate_deliveries": sum(d.duplicates for d in days),
            "late_events": sum(d.late_events for d in days),
        }
    )


class StatefulRunConfig(dg.Config):
    """Where the state comes from. By default the newest retained checkpoint that fits the
    first partition of the run; ``restore_from`` names a checkpoint or savepoint instead
    (backfill from a savepoint). ``restore_mode``: NO_CLAIM never deletes the restored
    snapshot; CLAIM hands it to retention."""

    restore_from: str | None = None
    restore_mode: RestoreMode = RestoreMode.NO_CLAIM


USER_ACTIVITY = dg.AssetSpec(
    "user_activity",
    group_name="clicks",
    kinds={"spark"},
    description="Per-user event count, amount, first and last seen: the stateful stage's "
    "state, checkpointed through the checkpoint storage's worker view.",
    deps=[
        "click_events",
        # The state after day D is the state after D-1 plus D's events.
        dg.AssetDep(
            "user_activity",
            partition_mapping=dg.TimeWindowPartitionMapping(start_offset=-1, end_offset=-1),
        ),
    ],
    skippable=True,
)
DAILY_REPORT = dg.AssetSpec(
    "daily_report",
    group_name="clicks",
    kinds={"parquet"},
    description="Each user's activity as of the end of the day, one Parquet partition per "
    "day; a re-run replaces its day.",
    deps=["user_activity"],
    skippable=True,
)


def _materializations(result: PartitionResult, report_dir: str):
    checkpoint = result.checkpoint
    rows = {f"rows_{name}": count for name, count in result.rows.items()}
    state_rows = {f"state_rows_{name}": n for name, n in checkpoint.state_rows.items()}
    yield dg.AssetMaterialization(
        "user_activity",
        partition=result.partition,
        metadata={
            "checkpoint_pointer": dg.MetadataValue.path(checkpoint.pointer),
            "checkpoint_id": checkpoint.checkpoint_id,
            "restored_from": result.restored_from or "none: started from empty state",
            "source_position": str(checkpoint.position),
            "state_bytes": checkpoint.state_bytes,
            "state_size": format_size(checkpoint.state_bytes),
            "files_written": checkpoint.files_written,
            "inline_states": checkpoint.inline_states,
            "checkpoints_taken": len(result.checkpoints_taken),
            "batches_applied": result.batches_applied,
            "duration_s": round(result.duration_s, 3),
            **rows,
            **state_rows,
        },
    )
    report_path = f"{report_dir.rstrip('/')}/report_date={result.partition}"
    yield dg.AssetMaterialization(
        "daily_report",
        partition=result.partition,
        metadata={
            "path": dg.MetadataValue.path(report_path),
            "users": checkpoint.state_rows.get("user_activity", 0),
        },
    )


@dg.multi_asset(
    specs=[USER_ACTIVITY, DAILY_REPORT],
    partitions_def=DAILY_PARTITIONS,
    # One run processes a backfill's partitions in order, in one Spark session.
    backfill_policy=dg.BackfillPolicy.single_run(),
    can_subset=False,
)
def user_activity(
    context: dg.AssetExecutionContext,
    config: StatefulRunConfig,
    spark: SparkResource,
    checkpoint_storage: CheckpointStorageResource,
    lake: DataLakeResource,
):
    if config.restore_from is not None and context.partition_keys:
        # Storage only, before the Spark session exists: a savepoint that is missing or does
        # not fit the range fails here, with the reason, and no Spark work was done.
        position = check_restore_from(
            checkpoint_storage.checkpoint_storage(), config.restore_from, context.partition_keys[0]
        )
        mode = RestoreMode(config.restore_mode).value
        context.log.info(f"restoring from {config.restore_from} ({position}, {mode})")
    fault_hook = _fault_hook(context.run.tags)  # test seam, None unless enabled
    runner = build_runner(spark, checkpoint_storage, lake, fault_hook=fault_hook)

    def record(result: PartitionResult) -> None:
        # Each partition is recorded as soon as its checkpoint completed, so a run that fails
        # later keeps the partitions it finished.
        for event in _materializations(result, lake.report_dir):
            context.log_event(event)
        context.log.info(
            f"{result.partition}: checkpoint {result.checkpoint.pointer} "
            f"({format_size(result.checkpoint.state_bytes)}), restored from "
            f"{result.restored_from or 'empty state'}"
        )

    runner.run(
        context.partition_keys,
        restore_from=config.restore_from,
        restore_mode=config.restore_mode,
        on_partition_done=record,
    )
    yield from ()


@dg.asset_check(
    asset="user_activity",
    name="checkpoint_integrity",
    description="The latest completed checkpoint validates (every file's size and CRC-32) "
    "and restores (each stage's rows as recorded).",
)
def checkpoint_integrity(
    spark: SparkResource,
    checkpoint_storage: CheckpointStorageResource,
    lake: DataLakeResource,
) -> dg.AssetCheckResult:
    runner = build_runner(spark, checkpoint_storage, lake)
    storage = runner.storage
    directory = runner.access.checkpoints_directory
    try:
        found = list_checkpoints(directory, storage_options=storage.storage_options)
    except FileNotFoundError:
        found = []
    with_metadata = [c for c in found if c.status in ("completed", "invalid")]
    if not with_metadata:
        return dg.AssetCheckResult(
            passed=False, description=f"no completed checkpoint in {directory}"
        )
    newest = with_metadata[-1]
    if newest.status == "invalid":
        return dg.AssetCheckResult(
            passed=False,
            description=f"the newest checkpoint {newest.pointer} is invalid: {newest.reason}",
            metadata={"checkpoint_pointer": dg.MetadataValue.path(newest.pointer)},
        )
    location = runner.access.resolve_checkpoint(newest.pointer)
    try:
        report = verify_checkpoint(location)
    except InvalidCheckpointError as exc:
        return dg.AssetCheckResult(passed=False, description=str(exc))
    metadata = {
        "checkpoint_pointer": dg.MetadataValue.path(newest.pointer),
        "checkpoint_id": report.checkpoint_id,
        "handles_checked": report.handles_checked,
        "bytes_read": report.bytes_read,
    }
    if not report.ok:
        problems = "; ".join(f"{p.kind}: {p.path}: {p.reason}" for p in report.problems[:5])
        return dg.AssetCheckResult(
            passed=False, description=f"{len(report.problems)} problem(s): {problems}",
            metadata=metadata,
        )
    snapshot = location.load_metadata()
    states = runner.restore_states(snapshot)
    restored = {name: state.count() for name, state in states.items()}
    recorded = {
        op.operator_id: sum(int(s.properties.get("rows", -1)) for s in op.subtask_states.values())
        for op in snapshot.operator_states
    }
    for state in states.values():
        state.unpersist()
    metadata |= {f"restored_rows_{name}": n for name, n in restored.items()}
    if restored != recorded:
        return dg.AssetCheckResult(
            passed=False,
            description=f"restored rows {restored} differ from the recorded {recorded}",
            metadata=metadata,
        )
    return dg.AssetCheckResult(passed=True, metadata=metadata)


# --- jobs (here, not in definitions.py, so that sensors/ can name them) ---------------

daily_pipeline = dg.define_asset_job(
    "daily_pipeline",
    # The stateful asset reports each partition as it completes (not through outputs), so a
    # check in the same run would count as skipped: it runs in its own job instead.
    selection=dg.AssetSelection.assets(click_events, user_activity).without_checks(),
    description="Land a day's click events, then advance the stateful user_activity state "
    "through it (checkpointing) and write the day's report.",
)

checkpoint_integrity_job = dg.define_asset_job(
    "checkpoint_integrity_job",
    selection=dg.AssetSelection.checks(checkpoint_integrity),
    description="Verify that the latest completed checkpoint validates and restores.",
)
