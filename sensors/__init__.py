"""The Dagster side of stateful pipelines: ``pipeline_definitions(pipeline)`` builds every
asset, check, job, schedule and sensor of a ``pipelines.StatefulPipeline``;
``StatefulPipelineComponent`` builds the same from a ``defs.yaml`` (``dg scaffold defs
sensors.StatefulPipelineComponent <name>`` starts one in ``pipelines/defs/<name>/``).

Per pipeline ``<name>``:

- ``<name>`` (+ ``<name>_<sink>``): the stateful multi-asset; run config ``restore_from`` /
  ``restore_mode`` (backfill from a savepoint, validated before any Spark work).
- ``checkpoint_integrity`` check on ``<name>``: in every run that materializes ``<name>``
  (for the last checkpoint it wrote), and alone in ``<name>_integrity_job``.
- the ``retained`` table (checkpoints and savepoints with their positions, sizes and
  pointers) on the newest materialization or observation of ``<name>``.
- ``<name>_savepoint_schedule`` + ``<name>_savepoint_job``: RUNNING. Writes new savepoints
  into ``<savepoint_dir>/scheduled``; skips while there is no completed checkpoint.
- ``<name>_retention_sensor``: RUNNING. Deletes only what the store's retention and the
  grace-period collector would, and scheduled savepoints beyond the newest K; never a
  snapshot in use, never a hand-made savepoint unless configured.
- ``<name>_recovery_sensor``: RUNNING. One recovery run per failed run of ``<name>`` (whatever
  started it) that no later run covered, a bounded number of attempts; a STARTED run whose
  job lease expired (its worker is gone) is reported failed first.

Stop any of them in the UI (Automation) or with ``dagster schedule stop`` / ``dagster sensor
stop``.
"""

from sensors._assets import (
    FAULT_INJECTION_ENV,
    FAULT_TAG,
    INTEGRITY_CHECK,
    StatefulRunConfig,
    build_stateful_assets,
    integrity_check_result,
    pool_for,
    runner_for,
    sink_asset_key,
)
from sensors._definitions import pipeline_definitions
from sensors._retained import (
    RETAINED_METADATA_KEY,
    RetainedSnapshot,
    retained_metadata,
    retained_snapshots,
    retained_table,
)
from sensors.component import ImportReference, PartitionsSpec, StatefulPipelineComponent
from sensors.recovery import (
    INTERRUPTED_TAG,
    RECOVERY_ATTEMPT_TAG,
    RECOVERY_OF_TAG,
    RECOVERY_ROOT_TAG,
    build_recovery_sensor,
    dead_run_reason,
    fail_dead_runs,
    plan_recovery,
    recovery_decisions,
)
from sensors.retention import (
    RetentionPolicy,
    RetentionReport,
    apply_retention,
    build_retention_sensor,
    savepoints_in_use,
    work_in_progress,
)
from sensors.savepoints import (
    SAVEPOINT_KIND_TAG,
    SavepointConfig,
    build_savepoint_job,
    build_savepoint_schedule,
    savepoint_cron_for,
    savepoint_run_request,
    savepoint_target,
)

__all__ = [
    "FAULT_INJECTION_ENV",
    "FAULT_TAG",
    "INTEGRITY_CHECK",
    "INTERRUPTED_TAG",
    "RECOVERY_ATTEMPT_TAG",
    "RECOVERY_OF_TAG",
    "RECOVERY_ROOT_TAG",
    "RETAINED_METADATA_KEY",
    "SAVEPOINT_KIND_TAG",
    "RetentionPolicy",
    "RetainedSnapshot",
    "RetentionReport",
    "ImportReference",
    "PartitionsSpec",
    "SavepointConfig",
    "StatefulPipelineComponent",
    "StatefulRunConfig",
    "apply_retention",
    "build_recovery_sensor",
    "build_retention_sensor",
    "build_savepoint_job",
    "build_savepoint_schedule",
    "build_stateful_assets",
    "dead_run_reason",
    "fail_dead_runs",
    "integrity_check_result",
    "pipeline_definitions",
    "plan_recovery",
    "recovery_decisions",
    "retained_metadata",
    "retained_snapshots",
    "retained_table",
    "pool_for",
    "runner_for",
    "savepoint_cron_for",
    "savepoint_run_request",
    "savepoint_target",
    "savepoints_in_use",
    "sink_asset_key",
    "work_in_progress",
]
