"""The recovery sensor: a failed run of a pipeline recovers by itself, whatever started it.

``<pipeline>_recovery_sensor`` is a plain sensor that follows the pipeline's *state*, not a
stream of failure events: on each tick it looks at the newest ``RECENT_RUNS`` runs that
advance the pipeline (runs of ``<pipeline>_job`` however they started: the UI, a schedule, a
sensor, ``dagster job launch``, ``scripts/run``, ``execute_in_process``, a single-run
backfill; and asset backfill runs, ``__ASSET_JOB``, whose selection holds the state asset),
the partitions each covered and completed (its materializations of the state asset), and the
runs in progress. A failed run is recovered when it is the *latest* run over its first
partition that did not complete and no later run covers that partition or any after it (the
pipeline did not move on without it). Nothing depends on having seen an event: a failure
from while the daemon was down, or of a run Dagster never launched, is found on the next tick.

The recovery run is of ``<pipeline>_job`` over the failed run's partitions that did not
complete: the partitions whose materialization the failed run recorded are done (each was
recorded as soon as its checkpoint completed), so the recovery starts at the first one that
is not. It restores from the latest completed checkpoint: the runner picks the newest retained
checkpoint that fits the first partition, which is the checkpoint the failed run took last,
and replays only the batches after it. When the failed run named a ``restore_from`` (a
backfill from a savepoint) and completed no partition, the recovery keeps that
``restore_from``; once it completed one, its own checkpoints continue it.

- **One request per failed run**: the run key is the failed run's id (the daemon never launches
  a run key twice), and a failed run that already has a recovery run (tag
  ``recovery/of_run_id``) is skipped.
- **Bounded attempts**: recovery runs carry ``recovery/root_run_id`` (the first failed run)
  and ``recovery/attempt``; when a recovery run fails after ``RECOVERY_MAX_ATTEMPTS``
  (default 3) attempts the sensor stops and says so in a skip reason and its log, naming the
  root run: a failure that repeats is not transient, someone has to look at it.
- **Never two writers**: the recovery run is in the pipeline's pool (``checkpoints_<name>``),
  so it waits in the queue behind a run in progress, and the runner's lease guards the job
  directory on top of that.
- A run whose worker died (SIGKILL, OOM) is marked failed by Dagster (the code server that
  launched it, or run monitoring, see ``pipelines/instance.py``) and recovered like any other.
- **A dead worker Dagster cannot see** (machine lost: worker and code server gone) leaves its
  run STARTED forever. But a run that writes the state holds the pipeline's job lease (owner
  ``dagster run <run id>``, renewed every ttl/3 by its process). Before its decisions, each
  tick reads the lease once when a run of the pipeline is STARTED; when that run owns the
  lease and the lease has been *expired* (not released) for at least ``lease_grace`` (default:
  the lease's own ttl, so clock skew and one slow renewal never count), its process stopped
  renewing it: the sensor reports the run failed (``report_run_failed``, naming the lease) and
  recovers it in the same tick. A run holding no lease yet, a released lease (the run ended
  ``run()`` and is finishing its sinks) or a lease of another run is never evidence. Were the
  process only frozen, the lease fences it: it can publish no checkpoint any more.

**Relation to Dagster's run retries** (``run_retries`` in ``dagster.yaml`` and the
``dagster/max_retries`` tag): a run retry re-executes the failed run as it was, over the same
partition range from its first partition, which only works while a checkpoint fitting that
first partition is still retained; this sensor narrows the range to what did not complete and
bounds the attempts per root run. Use one or the other for a pipeline's job: run retries are
off by default, and when they are on for a failed run (enabled on the instance and the run's
``dagster/retry_number`` below its ``dagster/max_retries``) the sensor leaves the run to the
retry daemon and skips, so a failure is never recovered twice at once. Once the retries are
exhausted, the sensor takes over.
"""

import copy
import datetime as dt
import os
import time
from collections.abc import Collection, Sequence

import dagster as dg

from checkpoint_storage import (
    CheckpointStorageError,
    FileSystemCheckpointStorage,
    LeaseRecord,
    read_job_lease,
    url_to_fs,
)
from pipelines import StatefulPipeline, job_id_for
from resources import CheckpointStorageResource
from sensors._tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
    MAX_RETRIES_TAG,
    PARTITION_NAME_TAG,
    RETRY_NUMBER_TAG,
)

__all__ = [
    "INTERRUPTED_TAG",
    "RECOVERY_ATTEMPT_TAG",
    "RECOVERY_OF_TAG",
    "RECOVERY_ROOT_TAG",
    "RECENT_RUNS",
    "build_recovery_sensor",
    "dead_run_reason",
    "fail_dead_runs",
    "plan_recovery",
    "run_lease_owner",
    "recovery_decisions",
]

RECOVERY_ROOT_TAG = "recovery/root_run_id"
"""Set on a recovery run: the id of the first failed run of its chain of recoveries."""
RECOVERY_ATTEMPT_TAG = "recovery/attempt"
"""Set on a recovery run: its attempt number within its chain (1 for the first)."""
RECOVERY_OF_TAG = "recovery/of_run_id"
"""Set on a recovery run: the id of the failed run it recovers."""
INTERRUPTED_TAG = "recovery/interrupted"
"""Set on a run its user stopped (Ctrl-C in ``scripts/run``): its failure is not recovered."""
# How far back a tick looks: the newest runs of the instance (all jobs) it reads each tick.
RECENT_RUNS = 500
_IN_PROGRESS = {
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
}


def run_lease_owner(run_id: str) -> str:
    """The owner name a Dagster run's runner takes the pipeline's job lease with."""
    return f"dagster run {run_id}"


def dead_run_reason(
    record: LeaseRecord | None,
    run_id: str,
    *,
    grace: dt.timedelta | None = None,
    now: float | None = None,
) -> str | None:
    """Why the STARTED run ``run_id`` is dead, judged by the job lease ``record``; None when
    the lease is no evidence (never taken, held by another owner, held, released, unreadable,
    or expired less than ``grace`` ago; ``grace`` None: the lease's own ttl)."""
    if record is None or record.owner != run_lease_owner(run_id):
        return None
    now = time.time() if now is None else now
    if record.state(now) != "expired":
        return None
    grace_s = record.ttl_seconds if grace is None else grace.total_seconds()
    if now - record.expires_at < grace_s:
        return None
    expired = dt.datetime.fromtimestamp(record.expires_at, dt.UTC).isoformat(timespec="seconds")
    return (
        f"run {run_id} stopped renewing the job lease it holds (epoch {record.epoch}, owner "
        f"{record.owner!r}, ttl {record.ttl_seconds:g} s): it expired at {expired} "
        f"({now - record.expires_at:.0f} s ago, more than the grace of {grace_s:g} s), so its "
        "worker process is gone (machine lost, or its process tree killed) although Dagster "
        "still shows the run STARTED"
    )


def fail_dead_runs(
    instance: dg.DagsterInstance,
    pipeline: StatefulPipeline,
    job_name: str,
    storage: FileSystemCheckpointStorage,
    *,
    grace: dt.timedelta | None = None,
    limit: int = RECENT_RUNS,
) -> list[str]:
    """Report failed each STARTED run of ``pipeline`` (among the runs ``recovery_decisions``
    considers) whose worker stopped renewing the job lease it holds (``dead_run_reason``);
    returns what was done, or why the lease could not be read (then nothing is reported)."""
    started = [
        r
        for r in instance.get_runs(
            dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]), limit=limit
        )
        if _advances(r, pipeline, job_name)
    ]
    if not started:
        return []
    directory = storage.create_checkpoint_storage(job_id_for(pipeline.name)).checkpoints_directory
    try:
        fs, path = url_to_fs(directory, storage.storage_options)
        record = read_job_lease(fs, path)
    except (OSError, CheckpointStorageError) as exc:
        return [
            f"could not read the job lease of {pipeline.name} in {directory} "
            f"({type(exc).__name__}): a run whose worker died is not detected this tick"
        ]
    notes = []
    for run in started:
        reason = dead_run_reason(record, run.run_id, grace=grace)
        if reason is None:
            continue
        current = instance.get_run_by_id(run.run_id)
        if current is None or current.status != dg.DagsterRunStatus.STARTED:
            continue  # it ended meanwhile: its own end stands
        message = f"{reason}; job lease of {pipeline.name} in {directory}/_lease"
        instance.report_run_failed(current, message)
        notes.append(f"reported run {run.run_id} failed: {message}")
    return notes


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
    *,
    later_runs: Sequence[dg.DagsterRun] = (),
    op_names: Collection[str] | None = None,
) -> dg.RunRequest | dg.SkipReason:
    """The recovery run of ``pipeline``'s job for ``failed``, or why there is none.

    ``later_runs``: the pipeline's runs created after ``failed``; when one of them covers the
    first partition ``failed`` did not complete, or a partition after it, there is nothing to
    recover (it was re-run, or the pipeline moved on). ``op_names``: the ops of the job the
    recovery runs (the run config of an asset backfill run keeps only those)."""
    run_id = failed.run_id
    if _retries_pending(instance, failed):
        return dg.SkipReason(
            f"run {run_id} failed; Dagster's run retries will retry it "
            f"({MAX_RETRIES_TAG}={failed.tags.get(MAX_RETRIES_TAG, 'instance default')})"
        )
    if failed.tags.get(INTERRUPTED_TAG):
        return dg.SkipReason(
            f"run {run_id} was stopped by its user ({failed.tags[INTERRUPTED_TAG]}): not "
            "recovered; launch it again to continue from its last checkpoint"
        )
    if instance.get_run_ids(dg.RunsFilter(tags={RECOVERY_OF_TAG: run_id}), limit=1):
        return dg.SkipReason(f"run {run_id} already has a recovery run")
    partitions = _partitions_of(failed, pipeline.partitions_def)
    if not partitions:
        return dg.SkipReason(f"run {run_id} is not a partitioned run: nothing to recover")
    done = _completed_partitions(instance, run_id, pipeline.name)
    remaining = partitions[
        next((i for i, p in enumerate(partitions) if p not in done), len(partitions)) :
    ]
    if not remaining:
        return dg.SkipReason(
            f"run {run_id} completed every partition ({partitions[0]}..{partitions[-1]}) "
            "before it failed: nothing to recover"
        )
    moved_on = _first_covering(later_runs, remaining[0], pipeline.partitions_def)
    if moved_on is not None:
        later, partition = moved_on
        return dg.SkipReason(
            f"run {run_id} failed at {remaining[0]}, but the later run {later.run_id} "
            f"({later.status.value}) covers {partition}: nothing to recover"
        )
    root = failed.tags.get(RECOVERY_ROOT_TAG, run_id)
    attempt = int(failed.tags.get(RECOVERY_ATTEMPT_TAG, 0)) + 1
    if attempt > max_attempts:
        return dg.SkipReason(
            f"run {run_id} was recovery attempt {attempt - 1} of {max_attempts} for "
            f"{partitions[0]}..{partitions[-1]} (first failure: run {root}) and failed too: not "
            "retrying any more, look at the runs' errors and re-launch by hand"
        )
    run_config = copy.deepcopy(dict(failed.run_config or {}))
    if op_names is not None and isinstance(run_config.get("ops"), dict):
        # An asset backfill's run may configure assets outside the pipeline's job.
        run_config["ops"] = {k: v for k, v in run_config["ops"].items() if k in op_names}
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


def _first_covering(
    runs: Sequence[dg.DagsterRun], partition: str, partitions: dg.PartitionsDefinition
) -> tuple[dg.DagsterRun, str] | None:
    """The first of ``runs`` covering ``partition`` or a partition after it, with that
    partition."""
    for run in runs:
        for key in _partitions_of(run, partitions):
            if key == partition or _after(key, partition, partitions):
                return run, key
    return None


def _after(key: str, other: str, partitions: dg.PartitionsDefinition) -> bool:
    if isinstance(partitions, dg.TimeWindowPartitionsDefinition):
        first, second = (partitions.time_window_for_partition_key(k) for k in (key, other))
        return first.start > second.start
    keys = list(partitions.get_partition_keys())
    return key in keys and other in keys and keys.index(key) > keys.index(other)


def _advances(run: dg.DagsterRun, pipeline: StatefulPipeline, job_name: str) -> bool:
    """Whether ``run`` advances ``pipeline``: a run of its job, or of an asset job (an asset
    backfill, ``materialize``) whose selection holds its state asset."""
    if run.job_name == job_name:
        return True
    return bool(run.asset_selection) and dg.AssetKey(pipeline.name) in run.asset_selection


def recovery_decisions(
    instance: dg.DagsterInstance,
    pipeline: StatefulPipeline,
    job_name: str,
    max_attempts: int,
    *,
    op_names: Collection[str] | None = None,
    limit: int = RECENT_RUNS,
) -> tuple[list[dg.RunRequest], list[str]]:
    """The recovery runs ``pipeline`` needs now and the reasons it needs no other: one
    decision per failed run among the newest ``limit`` runs of the instance that advance it
    (``plan_recovery``, with the runs created after it)."""
    runs = [r for r in instance.get_runs(limit=limit) if _advances(r, pipeline, job_name)]
    requests, reasons = [], []
    for index, run in enumerate(runs):  # newest first
        if run.status != dg.DagsterRunStatus.FAILURE:
            continue
        decision = plan_recovery(
            instance, run, max_attempts, pipeline, later_runs=runs[:index], op_names=op_names
        )
        if isinstance(decision, dg.RunRequest):
            requests.append(decision)
        else:
            reasons.append(decision.skip_message or "")
    if not requests and not reasons:
        busy = [r.run_id for r in runs if r.status in _IN_PROGRESS]
        reasons.append(
            f"no failed run of {pipeline.name} among the newest {limit} runs"
            + (f" (in progress: {', '.join(busy[:3])})" if busy else "")
        )
    return requests, reasons


def build_recovery_sensor(
    pipeline: StatefulPipeline,
    job,
    max_attempts: int | None = None,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
    *,
    lease_grace: dt.timedelta | None = None,
) -> dg.SensorDefinition:
    """The recovery sensor of ``pipeline``'s ``job`` (its asset job), stopping after
    ``max_attempts`` (``RECOVERY_MAX_ATTEMPTS``, 3) per first failure. ``lease_grace``: how
    long a STARTED run's job lease must have been expired before the run counts as dead
    (default: the lease's ttl)."""
    bound = max_attempts or int(os.environ.get("RECOVERY_MAX_ATTEMPTS", "3"))
    if bound < 1:
        raise ValueError(f"max_attempts must be >= 1, got {bound}")

    interval = int(os.environ.get("RECOVERY_INTERVAL_SECONDS", "30"))

    @dg.sensor(
        name=f"{pipeline.name}_recovery_sensor",
        job=job,
        minimum_interval_seconds=interval,
        default_status=default_status,
        description=f"Launch a recovery run of {job.name} for each failed run of {pipeline.name} "
        "(whatever started it) that no later run covered, over its partitions that did not "
        "complete, restoring from the latest completed checkpoint; one per failed run, at "
        f"most {bound} attempts per first failure.",
    )
    def recovery_sensor(
        context: dg.SensorEvaluationContext, checkpoint_storage: CheckpointStorageResource
    ):
        # First, so that a run found dead is recovered by the decisions of this same tick.
        dead = fail_dead_runs(
            context.instance,
            pipeline,
            job.name,
            checkpoint_storage.checkpoint_storage(),
            grace=lease_grace,
        )
        for note in dead:
            context.log.warning(note)
        op_names = None
        if context.repository_def is not None:
            op_names = set(context.repository_def.get_job(job.name).graph.node_names())
        requests, reasons = recovery_decisions(
            context.instance, pipeline, job.name, bound, op_names=op_names
        )
        for reason in reasons:
            context.log.info(reason)
        for request in requests:
            context.log.info(
                f"recovering run {request.tags[RECOVERY_OF_TAG]}: attempt "
                f"{request.tags[RECOVERY_ATTEMPT_TAG]} of {bound}"
            )
        if requests:
            return requests
        return dg.SkipReason("; ".join([*dead, *reasons][:5]))

    return recovery_sensor
