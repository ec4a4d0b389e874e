"""``pipeline_definitions``: everything Dagster needs for one pipeline, every name derived
from the pipeline's, so several pipelines share a code location (merge their definitions
with ``dagster.Definitions.merge``)."""

import dagster as dg

from pipelines import StatefulPipeline
from sensors._assets import INTEGRITY_CHECK, build_stateful_assets
from sensors.recovery import build_recovery_sensor
from sensors.retention import RetentionPolicy, build_retention_sensor
from sensors.savepoints import build_savepoint_job, build_savepoint_schedule

__all__ = ["pipeline_definitions"]


def pipeline_definitions(
    pipeline: StatefulPipeline,
    *,
    savepoint_cron: str | None = None,
    retention_policy: RetentionPolicy | None = None,
    recovery_max_attempts: int | None = None,
    automation_status: str = "RUNNING",
) -> dg.Definitions:
    """The definitions of ``pipeline`` (``<name>`` below stands for ``pipeline.name``):

    - assets: ``<name>`` (the state, a multi-asset step with one asset per sink,
      ``<name>_<sink>``), partitioned like the pipeline, single-run backfills, in the
      concurrency pool ``checkpoints_<name>``; the pipeline's ``deps`` come along;
    - asset check ``checkpoint_integrity`` on ``<name>``, part of the stateful step: every
      run that materializes the state verifies the last checkpoint it wrote;
    - jobs ``<name>_job`` (deps, then the state, sinks and check), ``<name>_integrity_job``
      (the check alone, on the newest checkpoint), ``<name>_savepoint_job``, all three in
      the pool;
    - schedule ``<name>_savepoint_schedule``; sensors ``<name>_retention_sensor`` and
      ``<name>_recovery_sensor`` (started unless ``automation_status="STOPPED"``).

    Resources are the code location's: ``spark`` (``resources.SparkResource``) and
    ``checkpoint_storage`` (``resources.CheckpointStorageResource``).
    """
    name = pipeline.name
    stateful = build_stateful_assets(pipeline)
    job = dg.define_asset_job(
        f"{name}_job",
        selection=dg.AssetSelection.assets(*pipeline.deps, stateful),
        description=f"Advance {name} through the selected partitions (after its upstream "
        "assets), checkpointing, write its sinks, and verify the last checkpoint written.",
    )
    integrity_job = dg.define_asset_job(
        f"{name}_integrity_job",
        selection=dg.AssetSelection.checks(dg.AssetCheckKey(dg.AssetKey(name), INTEGRITY_CHECK)),
        description=f"Verify that {name}'s latest completed checkpoint validates and restores.",
    )
    savepoint_job = build_savepoint_job(pipeline)
    schedule_status = dg.DefaultScheduleStatus(automation_status.upper())
    sensor_status = dg.DefaultSensorStatus(automation_status.upper())
    return dg.Definitions(
        assets=[*pipeline.deps, stateful],
        jobs=[job, integrity_job, savepoint_job],
        schedules=[
            build_savepoint_schedule(pipeline, savepoint_job, savepoint_cron, schedule_status)
        ],
        sensors=[
            build_retention_sensor(pipeline, retention_policy, default_status=sensor_status),
            build_recovery_sensor(pipeline, job, recovery_max_attempts, sensor_status),
        ],
    )
