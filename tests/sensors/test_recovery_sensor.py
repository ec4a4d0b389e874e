"""The recovery sensor, evaluated on a real instance holding runs in every shape a start kind
leaves (no daemon): one recovery request per failed run that no later run covered, whatever
started it, over the partitions that did not complete, restoring from the latest checkpoint,
and no more than the attempt bound. No cursor: a failure is found whenever the sensor looks."""

import datetime as dt
import time
import uuid

import dagster as dg
import pytest

# No public constructor for a run's materialization event without a step context.
from dagster._core.events import StepMaterializationData

from checkpoint_storage import read_job_lease, url_to_fs
from pipelines import job_id_for
from resources import CheckpointStorageResource, SparkResource
from sensors import (
    INTERRUPTED_TAG,
    RECOVERY_ATTEMPT_TAG,
    RECOVERY_OF_TAG,
    RECOVERY_ROOT_TAG,
    build_recovery_sensor,
    dead_run_reason,
    pipeline_definitions,
)
from sensors.recovery import run_lease_owner
from tests.sensors.support import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
    PARTITION_NAME_TAG,
    SMALL_LANDING,
    storage_resource,
    unused_click_pipeline,
)

PIPELINE = unused_click_pipeline()
JOB = f"{PIPELINE.name}_job"
RANGE = {ASSET_PARTITION_RANGE_START_TAG: "2026-10-01", ASSET_PARTITION_RANGE_END_TAG: "2026-10-03"}
SAVEPOINT = "/data/savepoints/savepoint-2b2376-000000000001"
CONFIG = {
    "ops": {
        "click_events": {"config": SMALL_LANDING},
        "user_activity": {"config": {"restore_from": SAVEPOINT, "restore_mode": "NO_CLAIM"}},
    }
}


def add_run(instance, tags, status, job_name=JOB, run_config=CONFIG, **fields) -> dg.DagsterRun:
    return instance.add_run(
        dg.DagsterRun(
            job_name=job_name, run_id=str(uuid.uuid4()), tags=tags, run_config=run_config,
            status=status, **fields,
        )
    )  # fmt: skip


def failed_run(instance, tags, completed=(), run_config=CONFIG, **fields) -> dg.DagsterRun:
    """A run (by default of user_activity_job, made like ``execute_in_process`` makes one:
    no code location origin) that materialized ``completed`` partitions, then failed."""
    run = add_run(instance, tags, dg.DagsterRunStatus.STARTED, run_config=run_config, **fields)
    for partition in completed:
        instance.report_dagster_event(
            dg.DagsterEvent(
                dg.DagsterEventType.ASSET_MATERIALIZATION.value,
                job_name=run.job_name,
                event_specific_data=StepMaterializationData(
                    dg.AssetMaterialization("user_activity", partition=partition)
                ),
            ),
            run.run_id,
        )
    instance.report_run_failed(run, "boom")
    return instance.get_run_by_id(run.run_id)


# The sensor reads the job's ops, and the job lease from the checkpoint storage (no lease
# was ever taken in /nonexistent).
NO_STORAGE = CheckpointStorageResource(
    checkpoint_dir="/nonexistent/checkpoints", savepoint_dir="/nonexistent/savepoints"
)
DEFS = dg.Definitions.merge(
    pipeline_definitions(PIPELINE),
    dg.Definitions(
        resources={"spark": SparkResource(master="local[1]"), "checkpoint_storage": NO_STORAGE}
    ),
)


def recovery_sensor(max_attempts: int, **options) -> dg.SensorDefinition:
    (job,) = [j for j in DEFS.jobs if JOB == j.name]
    return build_recovery_sensor(PIPELINE, job, max_attempts, **options)


def evaluate(sensor, instance, storage: CheckpointStorageResource = NO_STORAGE):
    """One tick of ``sensor`` (no cursor): the one request, a list of several, or the skip."""
    # As a context manager, so the resources the context builds are torn down on exit.
    with dg.build_sensor_context(
        instance=instance,
        repository_def=DEFS.get_repository_def(),
        resources={"checkpoint_storage": storage},
    ) as context:
        result = sensor(context)
    if isinstance(result, list) and len(result) == 1:
        return result[0]
    return result


def test_failed_range_run_is_recovered_from_its_first_unfinished_partition():
    """A run over 10-01..10-03 that completed 10-01 gets one recovery request over
    10-02..10-03, keyed by its run id, tagged as attempt 1 of it, with its landing config
    and without its restore_from (its own checkpoints continue it)."""
    with dg.instance_for_test() as instance:
        run = failed_run(instance, RANGE, completed=["2026-10-01"])
        request = evaluate(recovery_sensor(3), instance)
    assert isinstance(request, dg.RunRequest)
    assert run.run_id == request.run_key
    assert {
        ASSET_PARTITION_RANGE_START_TAG: "2026-10-02",
        ASSET_PARTITION_RANGE_END_TAG: "2026-10-03",
        RECOVERY_ROOT_TAG: run.run_id,
        RECOVERY_ATTEMPT_TAG: "1",
        RECOVERY_OF_TAG: run.run_id,
    } == dict(request.tags)
    assert {
        "ops": {"click_events": {"config": SMALL_LANDING}, "user_activity": {"config": {}}}
    } == request.run_config


def test_failed_run_that_completed_nothing_keeps_its_restore_from():
    """A single-partition run that failed before completing its partition is recovered
    over that partition with the same run config (its restore_from still applies)."""
    with dg.instance_for_test() as instance:
        failed_run(instance, {PARTITION_NAME_TAG: "2026-10-02"})
        request = evaluate(recovery_sensor(3), instance)
    assert ("2026-10-02", CONFIG) == (request.partition_key, request.run_config)


def test_a_failed_run_is_recovered_once():
    """Evaluating the same failure twice gives the same run key (the daemon launches it
    once); once the recovery run exists, the failure is skipped."""
    sensor = recovery_sensor(3)
    with dg.instance_for_test() as instance:
        run = failed_run(instance, RANGE)
        first, second = evaluate(sensor, instance), evaluate(sensor, instance)
        assert first.run_key == second.run_key == run.run_id
        add_run(instance, dict(first.tags), dg.DagsterRunStatus.NOT_STARTED)
        third = evaluate(sensor, instance)
    assert isinstance(third, dg.SkipReason)
    assert f"run {run.run_id} already has a recovery run" in third.skip_message


def test_a_run_its_user_stopped_is_not_recovered():
    """A run stopped with Ctrl-C in scripts/run (tagged so before it failed) is left alone:
    the user stopped it on purpose; the skip reason says so and how to continue."""
    with dg.instance_for_test() as instance:
        run = failed_run(instance, RANGE | {INTERRUPTED_TAG: "Ctrl-C"})
        decision = evaluate(recovery_sensor(3), instance)
    assert isinstance(decision, dg.SkipReason)
    assert (f"run {run.run_id} was stopped by its user (Ctrl-C): not recovered; launch it "
            "again to continue from its last checkpoint") in decision.skip_message


@pytest.mark.parametrize(("attempt", "recovers"), [(1, True), (2, True), (3, False)])
def test_recovery_stops_after_the_attempt_bound(attempt, recovers):
    """A failed recovery run (attempt n of root R) is recovered again as attempt n+1 of R
    while n < 3, and at n = 3 the sensor stops, naming the root run."""
    root = str(uuid.uuid4())
    with dg.instance_for_test() as instance:
        failed_run(
            instance,
            RANGE | {RECOVERY_ROOT_TAG: root, RECOVERY_ATTEMPT_TAG: str(attempt)},
        )
        decision = evaluate(recovery_sensor(3), instance)
    assert recovers == isinstance(decision, dg.RunRequest)
    if recovers:
        assert (root, str(attempt + 1)) == (
            decision.tags[RECOVERY_ROOT_TAG],
            decision.tags[RECOVERY_ATTEMPT_TAG],
        )
    else:
        assert f"(first failure: run {root})" in decision.skip_message
        assert "not retrying any more" in decision.skip_message


def test_run_retries_take_precedence_while_they_last():
    """With Dagster's run retries on, a run with retries left is left to the retry daemon;
    the last retry's failure is recovered by the sensor."""
    overrides = {"run_retries": {"enabled": True, "max_retries": 1}}
    with dg.instance_for_test(overrides=overrides) as instance:
        failed_run(instance, RANGE)
        decisions = [evaluate(recovery_sensor(3), instance)]
        retried = failed_run(instance, RANGE | {"dagster/retry_number": "1"})
        decisions.append(evaluate(recovery_sensor(3), instance))
    assert [dg.SkipReason, dg.RunRequest] == [type(d) for d in decisions]
    assert "Dagster's run retries will retry it" in decisions[0].skip_message
    assert retried.run_id == decisions[1].run_key


# --- each start kind ----------------------------------------------------------------------

START_KINDS = {
    # execute_in_process and scripts/run: no code location origin, no launcher tags.
    "execute_in_process": {},
    "ui_or_dagster_job_launch": {"dagster/from_ui": "true"},
    "schedule": {"dagster/schedule_name": "nightly"},
    "sensor": {"dagster/sensor_name": "landing_sensor"},
    "single_run_backfill": RANGE | {"dagster/backfill": "abcdefgh"},
}


@pytest.mark.parametrize("kind", sorted(START_KINDS))
def test_a_failure_is_recovered_whatever_started_the_run(kind):
    """A failed run of the job is recovered however it was started: only its partitions,
    its materializations and the runs after it matter."""
    tags = START_KINDS[kind]
    tags = (
        tags
        if ASSET_PARTITION_RANGE_START_TAG in tags
        else tags | {PARTITION_NAME_TAG: "2026-10-02"}
    )
    with dg.instance_for_test() as instance:
        run = failed_run(instance, tags)
        request = evaluate(recovery_sensor(3), instance)
    assert isinstance(request, dg.RunRequest), request
    assert (run.run_id, run.run_id) == (request.run_key, request.tags[RECOVERY_OF_TAG])


def test_a_failed_asset_backfill_run_is_recovered_through_the_job():
    """An asset backfill's run (``__ASSET_JOB``) whose selection holds the state asset is
    recovered as a run of the pipeline's job; config of assets outside that job is dropped."""
    config = {"ops": CONFIG["ops"] | {"other_asset": {"config": {"x": 1}}}}
    selection = {
        dg.AssetKey("click_events"),
        dg.AssetKey("user_activity"),
        dg.AssetKey("other_asset"),
    }
    with dg.instance_for_test() as instance:
        run = failed_run(
            instance, RANGE | {"dagster/backfill": "abcdefgh"}, completed=["2026-10-01"],
            run_config=config, job_name="__ASSET_JOB", asset_selection=selection,
        )  # fmt: skip
        request = evaluate(recovery_sensor(3), instance)
    assert isinstance(request, dg.RunRequest), request
    assert (run.run_id, "2026-10-02") == (
        request.run_key,
        request.tags[ASSET_PARTITION_RANGE_START_TAG],
    )
    assert {"click_events", "user_activity"} == set(request.run_config["ops"])


def test_runs_of_other_pipelines_are_not_recovered():
    """A failed asset job run without the state asset, and a failed run of another job, are
    not this pipeline's: the sensor skips and says it found no failed run of it."""
    with dg.instance_for_test() as instance:
        failed_run(
            instance, {PARTITION_NAME_TAG: "2026-10-02"}, job_name="__ASSET_JOB",
            asset_selection={dg.AssetKey("page_views")},
        )  # fmt: skip
        failed_run(instance, {PARTITION_NAME_TAG: "2026-10-02"}, job_name="page_views_job")
        decision = evaluate(recovery_sensor(3), instance)
    assert isinstance(decision, dg.SkipReason)
    assert "no failed run of user_activity" in decision.skip_message


@pytest.mark.parametrize(
    ("status", "partition"),
    [
        (dg.DagsterRunStatus.SUCCESS, "2026-10-02"),  # re-run by hand
        (dg.DagsterRunStatus.NOT_STARTED, "2026-10-02"),  # re-run not started yet
        (dg.DagsterRunStatus.STARTED, "2026-10-03"),  # the pipeline moved on
    ],
)
def test_a_failure_that_a_later_run_covers_is_not_recovered(status, partition):
    """The decision follows the state: when a later run covers the failed partition (or one
    after it), the failure is not the partition's latest word, and the skip says which run."""
    with dg.instance_for_test() as instance:
        run = failed_run(instance, {PARTITION_NAME_TAG: "2026-10-02"})
        later = add_run(instance, {PARTITION_NAME_TAG: partition}, status)
        decision = evaluate(recovery_sensor(3), instance)
    assert isinstance(decision, dg.SkipReason), decision
    assert (
        f"run {run.run_id} failed at 2026-10-02, but the later run {later.run_id} "
        f"({status.value}) covers {partition}: nothing to recover"
    ) in decision.skip_message


def test_failures_from_before_the_sensor_looked_are_all_recovered():
    """No cursor: failures that happened while nothing watched (the daemon down) are found
    on the first tick, each once; of two failures of the same partition only the latest is
    recovered (the earlier one is covered by it)."""
    with dg.instance_for_test() as instance:
        earlier = failed_run(instance, {PARTITION_NAME_TAG: "2026-10-02"})
        latest = failed_run(instance, {PARTITION_NAME_TAG: "2026-10-02"})
        requests = evaluate(recovery_sensor(3), instance)
    assert isinstance(requests, dg.RunRequest), requests
    assert latest.run_id == requests.run_key != earlier.run_id


# --- a dead run worker, noticed from the job lease ----------------------------------------


def take_lease(storage: CheckpointStorageResource, run_id: str, ttl: float):
    """The pipeline's job lease, taken as the run ``run_id``'s runner takes it, never renewed
    (as if its process had died right after)."""
    access = storage.checkpoint_storage().create_checkpoint_storage(job_id_for(PIPELINE.name))
    return access.acquire_job_lease(run_lease_owner(run_id), ttl=ttl, auto_renew=False)


def expire(lease, past_grace: float = 1.0) -> None:
    """Wait until ``lease`` has been expired for ``past_grace`` of its ttl and a bit (time
    only moves on: once true, it stays true)."""
    record = lease.record
    while time.time() <= record.expires_at + past_grace * record.ttl_seconds + 0.02:
        time.sleep(0.02)


def current_lease(storage: CheckpointStorageResource):
    access = storage.checkpoint_storage().create_checkpoint_storage(job_id_for(PIPELINE.name))
    fs, path = url_to_fs(access.checkpoints_directory)
    return read_job_lease(fs, path)


def started_run(instance, partition: str = "2026-10-02") -> dg.DagsterRun:
    return add_run(instance, {PARTITION_NAME_TAG: partition}, dg.DagsterRunStatus.STARTED)


def status(instance, run) -> dg.DagsterRunStatus:
    return instance.get_run_by_id(run.run_id).status


def failure_message(instance, run) -> str:
    (entry,) = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)
    return entry.dagster_event.message or ""


@pytest.mark.timeout(60)
def test_a_started_run_whose_lease_expired_is_failed_and_recovered_in_the_same_tick(tmp_path):
    """Worker and code server gone: the run stays STARTED, but the job lease it holds expired
    more than a ttl ago. The tick reports it failed, naming the lease, and requests its
    recovery at once."""
    storage = storage_resource(tmp_path)
    with dg.instance_for_test() as instance:
        run = started_run(instance)
        expire(take_lease(storage, run.run_id, ttl=0.1))
        request = evaluate(recovery_sensor(3), instance, storage)
        assert dg.DagsterRunStatus.FAILURE == status(instance, run)
        message = failure_message(instance, run)
    assert isinstance(request, dg.RunRequest), request
    assert (run.run_id, "2026-10-02") == (request.run_key, request.partition_key)
    assert run.run_id == request.tags[RECOVERY_OF_TAG]
    assert f"run {run.run_id} stopped renewing the job lease it holds (epoch 1" in message
    assert "it expired at 20" in message and "worker process is gone" in message
    assert f"{job_id_for(PIPELINE.name)}/_lease" in message


@pytest.mark.timeout(60)
def test_a_lease_of_another_run_is_no_evidence(tmp_path):
    """Two STARTED runs, the expired lease is the first one's: only that one is failed."""
    storage = storage_resource(tmp_path)
    with dg.instance_for_test() as instance:
        owner, other = started_run(instance, "2026-10-01"), started_run(instance, "2026-10-02")
        expire(take_lease(storage, owner.run_id, ttl=0.1))
        evaluate(recovery_sensor(3), instance, storage)
        statuses = status(instance, owner), status(instance, other)
    assert (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.STARTED) == statuses


@pytest.mark.timeout(60)
def test_a_run_without_a_lease_yet_then_with_an_expired_one(tmp_path):
    """A STARTED run that holds no lease yet (still starting) is left alone; once a lease it
    took has expired past the grace, it is failed."""
    storage = storage_resource(tmp_path)
    sensor = recovery_sensor(3)
    with dg.instance_for_test() as instance:
        run = started_run(instance)
        first = evaluate(sensor, instance, storage)
        assert dg.DagsterRunStatus.STARTED == status(instance, run)
        assert isinstance(first, dg.SkipReason), first
        expire(take_lease(storage, run.run_id, ttl=0.1))
        evaluate(sensor, instance, storage)
        assert dg.DagsterRunStatus.FAILURE == status(instance, run)


@pytest.mark.timeout(60)
def test_a_released_lease_is_no_evidence(tmp_path):
    """A run that released its lease (its ``run()`` ended; sinks and checks may still run)
    stays STARTED however long ago; a later run's expired lease is evidence against it only."""
    storage = storage_resource(tmp_path)
    with dg.instance_for_test() as instance:
        finishing, dead = started_run(instance, "2026-10-01"), started_run(instance, "2026-10-02")
        released = take_lease(storage, finishing.run_id, ttl=0.1)
        released.release()
        expire(released)
        evaluate(recovery_sensor(3), instance, storage)
        assert dg.DagsterRunStatus.STARTED == status(instance, finishing)
        expire(take_lease(storage, dead.run_id, ttl=0.1))
        evaluate(recovery_sensor(3), instance, storage)
        statuses = status(instance, finishing), status(instance, dead)
    assert (dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.FAILURE) == statuses


@pytest.mark.timeout(60)
def test_a_live_lease_is_no_evidence(tmp_path):
    """A run whose lease is held (renewed within its ttl) is left alone; the same record,
    once expired for a ttl, would be evidence."""
    storage = storage_resource(tmp_path)
    with dg.instance_for_test() as instance:
        run = started_run(instance)
        lease = take_lease(storage, run.run_id, ttl=600)
        decision = evaluate(recovery_sensor(3), instance, storage)
        assert dg.DagsterRunStatus.STARTED == status(instance, run)
    assert isinstance(decision, dg.SkipReason), decision
    record = current_lease(storage)
    assert record.owner == run_lease_owner(run.run_id) == lease.owner
    later = record.expires_at + 1.01 * record.ttl_seconds
    assert dead_run_reason(record, run.run_id, now=later) is not None


@pytest.mark.timeout(60)
def test_an_expiry_within_the_grace_is_no_evidence(tmp_path):
    """Expired, but less than the grace ago (clock skew, one slow renewal): left alone. The
    default grace is the lease's ttl."""
    storage = storage_resource(tmp_path)
    with dg.instance_for_test() as instance:
        run = started_run(instance)
        expire(take_lease(storage, run.run_id, ttl=0.1))
        evaluate(recovery_sensor(3, lease_grace=dt.timedelta(hours=1)), instance, storage)
        assert dg.DagsterRunStatus.STARTED == status(instance, run)
        evaluate(recovery_sensor(3), instance, storage)  # the default grace: one ttl
        assert dg.DagsterRunStatus.FAILURE == status(instance, run)
    record = current_lease(storage)
    assert record.state(record.expires_at + 0.5 * record.ttl_seconds) == "expired"
    half_a_ttl = record.expires_at + 0.5 * record.ttl_seconds
    assert dead_run_reason(record, run.run_id, now=half_a_ttl) is None
