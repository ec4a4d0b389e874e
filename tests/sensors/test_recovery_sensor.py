"""The recovery sensor with Dagster's run-failure test context on a real instance: one
recovery request per failed run, over the partitions that did not complete, restoring from
the latest checkpoint, and no more than the attempt bound."""

import uuid

import dagster as dg
import pytest

# No public constructor for a run's materialization event without a step context.
from dagster._core.events import StepMaterializationData

from sensors import (
    RECOVERY_ATTEMPT_TAG,
    RECOVERY_OF_TAG,
    RECOVERY_ROOT_TAG,
    build_recovery_sensor,
    pipeline_definitions,
)
from tests.sensors.conftest import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
    PARTITION_NAME_TAG,
    SMALL_LANDING,
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


def failed_run(instance, tags, completed=(), run_config=CONFIG) -> dg.DagsterRun:
    """A user_activity_job run that materialized ``completed`` partitions, then failed."""
    run = instance.add_run(
        dg.DagsterRun(
            job_name=JOB, run_id=str(uuid.uuid4()), tags=tags, run_config=run_config,
            status=dg.DagsterRunStatus.STARTED,
        )
    )  # fmt: skip
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


def recovery_sensor(max_attempts: int) -> dg.SensorDefinition:
    (job,) = [j for j in pipeline_definitions(PIPELINE).jobs if JOB == j.name]
    return build_recovery_sensor(PIPELINE, job, max_attempts)


def evaluate(sensor, instance, run):
    (entry,) = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)
    context = dg.build_run_status_sensor_context(
        sensor_name=sensor.name,
        dagster_event=entry.dagster_event,
        dagster_instance=instance,
        dagster_run=run,
    ).for_run_failure()
    return sensor(context)


def test_failed_range_run_is_recovered_from_its_first_unfinished_partition():
    """A run over 10-01..10-03 that completed 10-01 gets one recovery request over
    10-02..10-03, keyed by its run id, tagged as attempt 1 of it, with its landing config
    and without its restore_from (its own checkpoints continue it)."""
    with dg.instance_for_test() as instance:
        run = failed_run(instance, RANGE, completed=["2026-10-01"])
        request = evaluate(recovery_sensor(3), instance, run)
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
        run = failed_run(instance, {PARTITION_NAME_TAG: "2026-10-02"})
        request = evaluate(recovery_sensor(3), instance, run)
    assert ("2026-10-02", CONFIG) == (request.partition_key, request.run_config)


def test_a_failed_run_is_recovered_once():
    """Evaluating the same failure twice gives the same run key (the daemon launches it
    once); once the recovery run exists, the failure is skipped."""
    sensor = recovery_sensor(3)
    with dg.instance_for_test() as instance:
        run = failed_run(instance, RANGE)
        first, second = evaluate(sensor, instance, run), evaluate(sensor, instance, run)
        assert first.run_key == second.run_key == run.run_id
        instance.add_run(
            dg.DagsterRun(job_name=JOB, run_id=str(uuid.uuid4()), tags=dict(first.tags))
        )
        third = evaluate(sensor, instance, run)
    assert isinstance(third, dg.SkipReason)
    assert f"run {run.run_id} already has a recovery run" == third.skip_message


@pytest.mark.parametrize(("attempt", "recovers"), [(1, True), (2, True), (3, False)])
def test_recovery_stops_after_the_attempt_bound(attempt, recovers):
    """A failed recovery run (attempt n of root R) is recovered again as attempt n+1 of R
    while n < 3, and at n = 3 the sensor stops, naming the root run."""
    root = str(uuid.uuid4())
    with dg.instance_for_test() as instance:
        run = failed_run(
            instance,
            RANGE | {RECOVERY_ROOT_TAG: root, RECOVERY_ATTEMPT_TAG: str(attempt)},
        )
        decision = evaluate(recovery_sensor(3), instance, run)
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
        first = failed_run(instance, RANGE)
        retried = failed_run(instance, RANGE | {"dagster/retry_number": "1"})
        decisions = [evaluate(recovery_sensor(3), instance, r) for r in (first, retried)]
    assert [dg.SkipReason, dg.RunRequest] == [type(d) for d in decisions]
    assert "Dagster's run retries will retry it" in decisions[0].skip_message
