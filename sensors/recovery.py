"""The recovery sensor: a failed run of a pipeline's job recovers by itself.

``<pipeline>_recovery_sensor`` is a ``run_failure_sensor`` on the pipeline's job
(``<pipeline>_job``). For a failed run it requests one recovery run of that job over the
failed run's partitions that did not complete: the partitions whose materialization of the
pipeline's state asset the failed run recorded are done (each was recorded as soon as its
checkpoint completed), so the recovery starts at the first one that is not. It restores from
the latest completed checkpoint: the runner picks the newest retained checkpoint that fits
the first partition, which is the checkpoint the failed run took last (at the end of the
previous partition, or part-way into this one), and replays only the batches after it. When
the failed run named a ``restore_from`` (a backfill from a savepoint) and completed no
partition, the recovery keeps that ``restore_from``; once it completed one, its own
checkpoints continue it.

- **One request per failed run**: the run key is the failed run's id (the daemon never launches
  a run key twice), and a failed run that already has a recovery run (tag
  ``recovery/of_run_id``) is skipped.
- **Bounded attempts**: recovery runs carry ``recovery/root_run_id`` (the first failed run)
  and ``recovery/attempt``; when a recovery run fails after ``RECOVERY_MAX_ATTEMPTS``
  (default 3) attempts the sensor stops and says so in a skip reason and its log, naming the
  root run: a failure that repeats is not transient, someone has to look at it.

**Relation to Dagster's run retries** (``run_retries`` in ``dagster.yaml`` and the
``dagster/max_retries`` tag): a run retry re-executes the failed run as it was, over the same
partition range from its first partition, which only works while a checkpoint fitting that
first partition is still retained; this sensor narrows the range to what did not complete and
bounds the attempts per root run. Use one or the other for a pipeline's job: run retries are
off by default, and when they are on for a failed run (enabled on the instance and the run's
``dagster/retry_number`` below its ``dagster/max_retries``) the sensor leaves the run to the
retry daemon and skips, so a failure is never recovered twice at once. Once the retries are
exhausted, the sensor takes over.

Runs launched as asset backfills (``__ASSET_JOB``) are not monitored; backfill through the
pipeline's job (or re-launch the failed partitions) to have them recovered.
"""

import copy
import os

import dagster as dg

from pipelines import StatefulPipeline
from sensors._tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
    MAX_RETRIES_TAG,
    PARTITION_NAME_TAG,
    RETRY_NUMBER_TAG,
)

__all__ = [
    "RECOVERY_ATTEMPT_TAG",
    "RECOVERY_OF_TAG",
    "RECOVERY_ROOT_TAG",
    "build_recovery_sensor",
    "plan_recovery",
]

RECOVERY_ROOT_TAG = "recovery/root_run_id"
RECOVERY_ATTEMPT_TAG = "recovery/attempt"
RECOVERY_OF_TAG = "recovery/of_run_id"


def _partitions_of(run: dg.DagsterRun, partitions: dg.PartitionsDefinition) -> list[str]:
    tags = run.tags
    if PARTITION_NAME_TAG in tags:
        return [tags[PARTITION_NAME_TAG]]
    start, end = tags.get(ASSET_PARTITION_RANGE_START_TAG), tags.get(ASSET_PARTITION_RANGE_END_TAG)
    if start and end:
        return partitions.get_partition_keys_in_range(dg.PartitionKeyRange(start, end))
    return []


def _completed_partitions(instance: dg.DagsterInstance, run_id: str, asset: str) -> set[str]:
    """The partitions whose materialization of ``asset`` ``run_id`` recorded."""
    done = set()
    for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION):
        event = entry.dagster_event
        if event is not None and event.asset_key == dg.AssetKey(asset) and event.partition:
            done.add(event.partition)
    return done


def _retries_pending(instance: dg.DagsterInstance, run: dg.DagsterRun) -> bool:
    if not instance.run_retries_enabled:
        return False
    max_retries = int(run.tags.get(MAX_RETRIES_TAG, instance.run_retries_max_retries))
    return int(run.tags.get(RETRY_NUMBER_TAG, 0)) < max_retries


def plan_recovery(
    instance: dg.DagsterInstance,
    failed: dg.DagsterRun,
    max_attempts: int,
    pipeline: StatefulPipeline,
) -> dg.RunRequest | dg.SkipReason:
    """The recovery run of ``pipeline``'s job for ``failed``, or why there is none."""
    run_id = failed.run_id
    if _retries_pending(instance, failed):
        return dg.SkipReason(
            f"run {run_id} failed; Dagster's run retries will retry it "
            f"({MAX_RETRIES_TAG}={failed.tags.get(MAX_RETRIES_TAG, 'instance default')})"
        )
    if instance.get_run_ids(dg.RunsFilter(tags={RECOVERY_OF_TAG: run_id}), limit=1):
        return dg.SkipReason(f"run {run_id} already has a recovery run")
    partitions = _partitions_of(failed, pipeline.partitions)
    if not partitions:
        return dg.SkipReason(f"run {run_id} is not a partitioned run: nothing to recover")
    root = failed.tags.get(RECOVERY_ROOT_TAG, run_id)
    attempt = int(failed.tags.get(RECOVERY_ATTEMPT_TAG, 0)) + 1
    if attempt > max_attempts:
        return dg.SkipReason(
            f"run {run_id} was recovery attempt {attempt - 1} of {max_attempts} for "
            f"{partitions[0]}..{partitions[-1]} (first failure: run {root}) and failed too: not "
            "retrying any more, look at the runs' errors and re-launch by hand"
        )
    done = _completed_partitions(instance, run_id, pipeline.name)
    remaining = partitions[
        next((i for i, p in enumerate(partitions) if p not in done), len(partitions)) :
    ]
    if not remaining:
        return dg.SkipReason(
            f"run {run_id} completed every partition ({partitions[0]}..{partitions[-1]}) "
            "before it failed: nothing to recover"
        )
    run_config = copy.deepcopy(dict(failed.run_config or {}))
    if len(remaining) < len(partitions):
        # The failed run's own checkpoints continue it, not its restore_from.
        op_config = run_config.get("ops", {}).get(pipeline.name, {}).get("config")
        if isinstance(op_config, dict):
            op_config.pop("restore_from", None)
            op_config.pop("restore_mode", None)
    tags = {
        RECOVERY_ROOT_TAG: root,
        RECOVERY_ATTEMPT_TAG: str(attempt),
        RECOVERY_OF_TAG: run_id,
    }
    if len(remaining) == 1:
        return dg.RunRequest(
            run_key=run_id, run_config=run_config, tags=tags, partition_key=remaining[0]
        )
    tags |= {
        ASSET_PARTITION_RANGE_START_TAG: remaining[0],
        ASSET_PARTITION_RANGE_END_TAG: remaining[-1],
    }
    return dg.RunRequest(run_key=run_id, run_config=run_config, tags=tags)


def build_recovery_sensor(
    pipeline: StatefulPipeline,
    job,
    max_attempts: int | None = None,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
) -> dg.SensorDefinition:
    """The recovery sensor of ``pipeline``'s ``job`` (its asset job), stopping after
    ``max_attempts`` (``RECOVERY_MAX_ATTEMPTS``, 3) per first failure."""
    bound = max_attempts or int(os.environ.get("RECOVERY_MAX_ATTEMPTS", "3"))
    if bound < 1:
        raise ValueError(f"max_attempts must be >= 1, got {bound}")

    @dg.run_failure_sensor(
        name=f"{pipeline.name}_recovery_sensor",
        monitored_jobs=[job],
        request_job=job,
        default_status=default_status,
        description=f"Launch a recovery run of {job.name} for a failed run's partitions that "
        "did not complete, restoring from the latest completed checkpoint; one per failed "
        f"run, at most {bound} attempts per first failure.",
    )
    def recovery_sensor(context: dg.RunFailureSensorContext):
        decision = plan_recovery(context.instance, context.dagster_run, bound, pipeline)
        if isinstance(decision, dg.SkipReason):
            context.log.info(decision.skip_message or "")
        else:
            context.log.info(
                f"recovering run {context.dagster_run.run_id}: attempt "
                f"{decision.tags[RECOVERY_ATTEMPT_TAG]} of {bound}"
            )
        return decision

    return recovery_sensor
