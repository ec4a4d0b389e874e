"""Schedules and sensors of the pipeline (DESIGN §5): scheduled savepoints, storage
retention, automatic recovery of failed runs.

- ``savepoint_schedule`` + ``savepoint_job``: RUNNING. It only writes new savepoints (into
  ``<savepoint_dir>/scheduled``) and skips while there is no completed checkpoint.
- ``checkpoint_retention_sensor``: RUNNING. It deletes only what the store's retention and
  the grace-period collector would, and scheduled savepoints beyond the newest K; never a
  snapshot in use, never a hand-made savepoint unless configured.
- ``daily_pipeline_recovery_sensor``: RUNNING. One recovery run per failed run, a bounded
  number of attempts.

Stop any of them in the UI (Automation) or with ``dagster schedule stop`` / ``dagster sensor
stop``; the backfill from a savepoint needs nothing here (run config ``restore_from`` of
``user_activity``, validated before any Spark work).
"""

from sensors.recovery import (
    RECOVERY_ATTEMPT_TAG,
    RECOVERY_OF_TAG,
    RECOVERY_ROOT_TAG,
    build_recovery_sensor,
    plan_recovery,
    recovery_sensor,
)
from sensors.retention import (
    RetentionPolicy,
    RetentionReport,
    apply_retention,
    build_retention_sensor,
    retention_sensor,
    savepoints_in_use,
    work_in_progress,
)
from sensors.savepoints import (
    SAVEPOINT_KIND_TAG,
    SavepointConfig,
    build_savepoint_schedule,
    savepoint_job,
    savepoint_run_request,
    savepoint_schedule,
    savepoint_target,
    take_savepoint,
)

__all__ = [
    "RECOVERY_ATTEMPT_TAG",
    "RECOVERY_OF_TAG",
    "RECOVERY_ROOT_TAG",
    "SAVEPOINT_KIND_TAG",
    "RetentionPolicy",
    "RetentionReport",
    "SavepointConfig",
    "apply_retention",
    "build_recovery_sensor",
    "build_retention_sensor",
    "build_savepoint_schedule",
    "plan_recovery",
    "recovery_sensor",
    "retention_sensor",
    "savepoint_job",
    "savepoint_run_request",
    "savepoint_schedule",
    "savepoint_target",
    "savepoints_in_use",
    "take_savepoint",
    "work_in_progress",
]
