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

``__all__`` is what a Dagster definitions author needs: the factory and component, the
builders of each definition, the run config and policies, and the tags and names a run or
an automation condition refers to. The sensors' decision functions and the test seams stay
importable from here, outside ``__all__``.
"""


from checkpoint_storage.spi import lazy_names
from sensors._assets import INTEGRITY_CHECK, StatefulRunConfig, build_stateful_assets, pool_for
from sensors._definitions import pipeline_definitions
from sensors._retained import RetainedSnapshot, retained_snapshots
from sensors.component import ImportReference, PartitionsSpec, StatefulPipelineComponent
from sensors.recovery import (
    INTERRUPTED_TAG,
    RECOVERY_ATTEMPT_TAG,
    RECOVERY_OF_TAG,
    RECOVERY_ROOT_TAG,
    build_recovery_sensor,
)
from sensors.retention import (
    RetentionPolicy,
    RetentionReport,
    apply_retention,
    build_retention_sensor,
)
from sensors.savepoints import (
    SAVEPOINT_KIND_TAG,
    SavepointConfig,
    build_savepoint_job,
    build_savepoint_schedule,
)

__all__ = [
    # a pipeline's definitions, from Python or from defs.yaml
    "ImportReference",
    "PartitionsSpec",
    "StatefulPipelineComponent",
    "pipeline_definitions",
    # each definition on its own
    "build_recovery_sensor",
    "build_retention_sensor",
    "build_savepoint_job",
    "build_savepoint_schedule",
    "build_stateful_assets",
    # configuration
    "RetentionPolicy",
    "SavepointConfig",
    "StatefulRunConfig",
    # names runs and checks carry
    "INTEGRITY_CHECK",
    "INTERRUPTED_TAG",
    "RECOVERY_ATTEMPT_TAG",
    "RECOVERY_OF_TAG",
    "RECOVERY_ROOT_TAG",
    "SAVEPOINT_KIND_TAG",
    "pool_for",
    # what a pipeline retains, and retention by hand
    "RetainedSnapshot",
    "RetentionReport",
    "apply_retention",
    "retained_snapshots",
]

# Names outside __all__ that this package exported before: where each one lives. The fault
# injection seams (FAULT_INJECTION_ENV, FAULT_TAG) are for tests only.
_ELSEWHERE = {
    "FAULT_INJECTION_ENV": "sensors._assets",
    "FAULT_TAG": "sensors._assets",
    "integrity_check_result": "sensors._assets",
    "runner_for": "sensors._assets",
    "sink_asset_key": "sensors._assets",
    "RETAINED_METADATA_KEY": "sensors._retained",
    "retained_metadata": "sensors._retained",
    "retained_table": "sensors._retained",
    "dead_run_reason": "sensors.recovery",
    "fail_dead_runs": "sensors.recovery",
    "plan_recovery": "sensors.recovery",
    "recovery_decisions": "sensors.recovery",
    "savepoints_in_use": "sensors.retention",
    "work_in_progress": "sensors.retention",
    "savepoint_cron_for": "sensors.savepoints",
    "savepoint_run_request": "sensors.savepoints",
    "savepoint_target": "sensors.savepoints",
}


__getattr__, __dir__ = lazy_names(__name__, globals(), _ELSEWHERE)
