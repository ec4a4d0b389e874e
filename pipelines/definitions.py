"""The code location: ``workspace.yaml`` and ``[tool.dagster]`` both load this module.

It is the composition root, the one module of ``pipelines`` that imports ``sensors``.
Schedules and sensors (all start RUNNING, see ``sensors/__init__.py``): ``savepoint_schedule``
(``SAVEPOINT_CRON``, default daily), ``checkpoint_retention_sensor`` and
``daily_pipeline_recovery_sensor``.
"""

import dagster as dg

from pipelines.assets import (
    checkpoint_integrity,
    checkpoint_integrity_job,
    click_events,
    daily_pipeline,
    default_resources,
    user_activity,
)
from sensors import recovery_sensor, retention_sensor, savepoint_job, savepoint_schedule

__all__ = ["checkpoint_integrity_job", "daily_pipeline", "defs", "savepoint_job"]

defs = dg.Definitions(
    assets=[click_events, user_activity],
    asset_checks=[checkpoint_integrity],
    jobs=[daily_pipeline, checkpoint_integrity_job, savepoint_job],
    schedules=[savepoint_schedule],
    sensors=[retention_sensor, recovery_sensor],
    resources=default_resources(),
    # One process (and one Spark session) per run, not one per step.
    executor=dg.in_process_executor,
)
