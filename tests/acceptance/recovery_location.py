"""The code location of the start-mode recovery test (test_recovery_start_modes.py): one copy
of the page-views pipeline per way a run starts (``pv_<mode>``, each in its own pool, so their
runs go side by side), on the project's resources, with the project's assets, jobs and sensors
of each (``sensors.pipeline_definitions``; its savepoint schedules are left out: one firing at
:30 during the test would only add Spark runs). Besides, the two starters the project does not
define itself:

- ``pv_schedule_fails``: a schedule (every minute) that starts one run of ``pv_schedule_job``
  over the first hour, tagged to fail after its second batch (``sensors.FAULT_TAG``);
- ``pv_sensor_fails``: a sensor that does the same for ``pv_sensor_job``.

Each starts one run only. ``RECOVERY_TEST_DATA`` is the directory under which each
pipeline lands, and writes its sinks, in ``<mode>/``.
"""

import dataclasses
import os

import dagster as dg

from pipelines import StatefulPipeline
from pipelines.definitions import default_resources
from pipelines.examples.page_views import page_views_pipeline
from sensors import FAULT_TAG, pipeline_definitions

__all__ = ["FAIL_AFTER", "HOURS", "MODES", "defs", "pipeline_of"]

MODES = ("schedule", "sensor", "ui", "job_backfill", "asset_backfill")
HOURS = ("2026-10-01-00:00", "2026-10-01-01:00")
# Each hour lands 3 batches, a checkpoint after each: a run fails after batch 2 of its first
# hour, so its recovery restores the checkpoint after batch 1.
FAIL_AFTER = "2"


def pipeline_of(mode: str, data_dir: str) -> StatefulPipeline:
    return dataclasses.replace(
        page_views_pipeline(f"{data_dir.rstrip('/')}/{mode}", checkpoint_interval=1),
        name=f"pv_{mode}",
    )


def _failing_request() -> dg.RunRequest:
    return dg.RunRequest(run_key="fail-once", partition_key=HOURS[0], tags={FAULT_TAG: FAIL_AFTER})


@dg.schedule(
    name="pv_schedule_fails",
    job_name="pv_schedule_job",
    cron_schedule="* * * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
)
def schedule_fails(context: dg.ScheduleEvaluationContext):
    # A schedule's run key is per tick: the next minute's tick would start another run.
    started = dg.RunsFilter(tags={"dagster/schedule_name": "pv_schedule_fails"})
    if context.instance.get_run_ids(started, limit=1):
        return dg.SkipReason("its one run was started already")
    return _failing_request()


@dg.sensor(
    name="pv_sensor_fails",
    job_name="pv_sensor_job",
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
)
def sensor_fails(context: dg.SensorEvaluationContext):
    return _failing_request()


def _definitions() -> dg.Definitions:
    data_dir = os.environ["RECOVERY_TEST_DATA"]
    parts = []
    for mode in MODES:
        full = pipeline_definitions(pipeline_of(mode, data_dir))
        parts.append(dg.Definitions(assets=full.assets, jobs=full.jobs, sensors=full.sensors))
    return dg.Definitions.merge(
        *parts,
        dg.Definitions(
            schedules=[schedule_fails],
            sensors=[sensor_fails],
            resources=default_resources(),
            executor=dg.in_process_executor,
        ),
    )


defs = _definitions()
