"""Scale-out: a Dagster instance on PostgreSQL (``dagster-postgres``; Debian's server, started
here on 127.0.0.1 in a temporary data directory, see tests/acceptance/postgres.py) runs the
page_views pipeline end to end, in process:

1. ``page_views_job`` materializes the first hour.
2. A run of the second hour fails after its third batch (the test seam, ``PIPELINE_FAULT_INJECTION``
   and the tag ``test/fail_after_batch``), after the checkpoint taken after batch 2.
3. A tick of the real ``page_views_recovery_sensor`` of the definitions finds the failed run
   and requests the recovery run; it restores that checkpoint and applies
   only batches 3 and 4.
4. ``page_views_savepoint_job`` takes a savepoint (an observation with its pointer).
5. A backfill of the next two hours in one run, ``restore_from`` the savepoint.

Runs, event log and materializations are in the PostgreSQL database (read back with psycopg2),
and the final state and sinks equal an uninterrupted ``StatefulRunner`` recomputation.
"""

import dagster as dg
import pandas as pd
import pytest
from pandas.testing import assert_frame_equal

from pipelines import StatefulRunner, check_restore_from, job_id_for
from pipelines.examples.page_views import NAME, land_hour, page_views_pipeline
from pipelines.instance import CONCURRENCY_YAML, RUN_MONITORING_YAML
from resources import CheckpointStorageResource, SparkResource, build_spark_session
from sensors import FAULT_INJECTION_ENV, FAULT_TAG, RECOVERY_OF_TAG, pipeline_definitions
from tests.acceptance.postgres import PostgresServer, dagster_yaml, running_postgres

HOURS = ["2026-10-01-00:00", "2026-10-01-01:00", "2026-10-01-02:00", "2026-10-01-03:00"]
# Four batches per hour, a checkpoint every two: the fault after batch 3 of the second hour
# leaves the checkpoint after batch 2 as the latest one.
LANDING = {"batches": 4, "views_per_batch": 100, "users": 10, "pages": 5, "seed": 11}
# Small data: few tasks per stage (SparkResource would set its default of 8 otherwise).
SHUFFLE_PARTITIONS = "2"
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"


@pytest.fixture(scope="session")
def postgres_server():
    with running_postgres() as server:
        yield server


@pytest.fixture(scope="module")
def spark():
    """One session for every run here (SparkResource leaves a session it did not start)."""
    conf = {"spark.sql.shuffle.partitions": SHUFFLE_PARTITIONS, "spark.ui.enabled": "false"}
    session = build_spark_session("local[2]", "postgres-instance", conf)
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def postgres_instance(postgres_server: PostgresServer, tmp_path, monkeypatch):
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(
        dagster_yaml(postgres_server, CONCURRENCY_YAML + RUN_MONITORING_YAML)
    )
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    with dg.DagsterInstance.get() as instance:
        instance.wipe()
        yield instance


def materializations(result, asset: str = NAME) -> list[dg.AssetMaterialization]:
    return [
        m for m in result.asset_materializations_for_node(NAME) if m.asset_key == dg.AssetKey(asset)
    ]


def meta(event) -> dict[str, object]:
    return {k: v.value for k, v in event.metadata.items()}


def sorted_frame(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values(list(frame.columns)).reset_index(drop=True)


def final_states(spark, checkpoint_dir: str, pipeline) -> dict[str, pd.DataFrame]:
    storage = CheckpointStorageResource(checkpoint_dir=checkpoint_dir).checkpoint_storage()
    runner = StatefulRunner(spark, storage, pipeline)
    latest = runner.store.latest()
    return {
        name: sorted_frame(state.toPandas())
        for name, state in runner.restore_states(latest.metadata).items()
    }


@pytest.mark.timeout(600)
def test_postgres_instance_runs_fault_recovery_and_savepoint_backfill(
    postgres_server, postgres_instance, spark, tmp_path, monkeypatch
):
    """On a PostgreSQL-backed instance a failed run, its sensor-planned recovery and a
    backfill from a savepoint leave runs and events in PostgreSQL and the recomputed state."""
    instance = postgres_instance
    assert "PostgresRunStorage" == type(instance.run_storage).__name__
    assert "PostgresEventLogStorage" == type(instance.event_log_storage).__name__
    assert "PostgresScheduleStorage" == type(instance.schedule_storage).__name__

    base, reference_base = str(tmp_path / "page_views"), str(tmp_path / "reference")
    for hour in HOURS:
        land_hour(base, hour, **LANDING)
        land_hour(reference_base, hour, **LANDING)
    pipeline = page_views_pipeline(base, checkpoint_interval=2)
    checkpoint_dir = str(tmp_path / "checkpoints")
    storage = CheckpointStorageResource(
        checkpoint_dir=checkpoint_dir, savepoint_dir=str(tmp_path / "savepoints")
    )
    defs = dg.Definitions.merge(
        pipeline_definitions(pipeline, automation_status="STOPPED"),
        dg.Definitions(
            resources={
                "spark": SparkResource(
                    master="local[2]", conf={"spark.sql.shuffle.partitions": SHUFFLE_PARTITIONS}
                ),
                "checkpoint_storage": storage,
            }
        ),
    )
    job = defs.resolve_job_def(f"{NAME}_job")
    monkeypatch.setenv(FAULT_INJECTION_ENV, "1")

    # 1. The first hour.
    first = job.execute_in_process(instance=instance, partition_key=HOURS[0])
    assert first.success

    # 2. The second hour fails after batch 3 (checkpoints after batch 2, none after 3).
    failed = job.execute_in_process(
        instance=instance, partition_key=HOURS[1], tags={FAULT_TAG: "3"}, raise_on_error=False
    )
    assert not failed.success
    (step_failure,) = failed.get_step_failure_events()
    assert "injected fault" in step_failure.step_failure_data.error.to_string()
    access = storage.checkpoint_storage().create_checkpoint_storage(job_id_for(NAME))
    inside = access.latest_completed_checkpoint().external_pointer
    position = check_restore_from(storage.checkpoint_storage(), inside, HOURS[1], pipeline)
    assert (HOURS[1], 2, False) == (position.partition, position.batches, position.complete)

    # 3. A tick of the recovery sensor of the definitions finds the failed run in PostgreSQL.
    sensor = next(s for s in defs.sensors if s.name == f"{NAME}_recovery_sensor")
    # the daemon binds the definitions' resources to a sensor; a built context takes them
    with dg.build_sensor_context(
        instance=instance, repository_def=defs.get_repository_def(),
        resources={"checkpoint_storage": storage},
    ) as context:
        (request,) = sensor(context)
    assert isinstance(request, dg.RunRequest), request
    assert HOURS[1] == request.partition_key
    assert failed.run_id == request.tags[RECOVERY_OF_TAG]
    recovered = job.execute_in_process(
        instance=instance,
        partition_key=request.partition_key,
        tags=request.tags,
        run_config=request.run_config,
    )
    assert recovered.success
    (recovery,) = map(meta, materializations(recovered))
    assert (inside, f"end of {HOURS[1]}", 2) == (
        recovery["restored_from"],
        recovery["source_position"],
        recovery["batches_applied"],
    )

    # 4. A savepoint (hand-made: into the savepoint dir), recorded as an observation.
    savepoint_run = defs.resolve_job_def(f"{NAME}_savepoint_job").execute_in_process(
        instance=instance
    )
    assert savepoint_run.success
    (observation,) = [
        e.event_specific_data.asset_observation
        for e in savepoint_run.get_asset_observation_events()
    ]
    savepoint = meta(observation)["savepoint_pointer"]
    assert f"end of {HOURS[1]}" == meta(observation)["source_position"]

    # 5. The backfill of the next two hours in one run, from the savepoint.
    backfill = job.execute_in_process(
        instance=instance,
        tags={RANGE_START_TAG: HOURS[2], RANGE_END_TAG: HOURS[3]},
        run_config={"ops": {NAME: {"config": {"restore_from": savepoint}}}},
    )
    assert backfill.success
    done = [meta(m) for m in materializations(backfill)]
    assert [f"end of {HOURS[2]}", f"end of {HOURS[3]}"] == [m["source_position"] for m in done]
    assert savepoint == done[0]["restored_from"]

    # Everything Dagster recorded is in PostgreSQL, read back without Dagster.
    runs = [first, failed, recovered, savepoint_run, backfill]
    state_key = dg.AssetKey(NAME).to_string()
    with postgres_server.connect() as connection, connection.cursor() as cursor:
        cursor.execute("SELECT run_id, status FROM runs")
        assert {r.run_id: r.dagster_run.status.value for r in runs} == dict(cursor.fetchall())
        cursor.execute("SELECT count(*) FROM event_logs WHERE run_id = %s", (failed.run_id,))
        assert cursor.fetchone()[0] > 0
        cursor.execute(
            "SELECT partition, run_id FROM event_logs"
            " WHERE dagster_event_type = 'ASSET_MATERIALIZATION' AND asset_key = %s",
            (state_key,),
        )
        assert sorted(
            [
                (HOURS[0], first.run_id),
                (HOURS[1], recovered.run_id),
                (HOURS[2], backfill.run_id),
                (HOURS[3], backfill.run_id),
            ]
        ) == sorted(cursor.fetchall())
    connection.close()
    assert {"SUCCESS": 4, "FAILURE": 1} == {
        status: len(instance.get_run_ids(dg.RunsFilter(statuses=[dg.DagsterRunStatus[status]])))
        for status in ("SUCCESS", "FAILURE")
    }

    # The recomputation: the same four hours, no failure, no savepoint, other directories
    # (checkpoints only at the end of each hour: where they are taken does not change state).
    reference = page_views_pipeline(reference_base, checkpoint_interval=LANDING["batches"])
    reference_dir = str(tmp_path / "reference-checkpoints")
    StatefulRunner(
        spark,
        CheckpointStorageResource(checkpoint_dir=reference_dir).checkpoint_storage(),
        reference,
    ).run(HOURS)
    expected, actual = (
        final_states(spark, reference_dir, reference),
        final_states(spark, checkpoint_dir, pipeline),
    )
    assert expected.keys() == actual.keys()
    for name in expected:
        assert_frame_equal(expected[name], actual[name])
    for expected_sink, sink in zip(reference.sinks, pipeline.sinks, strict=True):
        for hour in HOURS:
            assert_frame_equal(
                sorted_frame(pd.read_parquet(expected_sink.location(hour))),
                sorted_frame(pd.read_parquet(sink.location(hour))),
            )
