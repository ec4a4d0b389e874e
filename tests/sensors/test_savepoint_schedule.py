"""The savepoint schedule and job on a real instance: the schedule's run request is keyed
by the scheduled time; the job writes a real savepoint through Spark (scheduled ones into
<savepoint_dir>/scheduled, hand-made ones into <savepoint_dir>) and records it as an
observation; a backfill from it leaves checkpoints that a later regular run continues."""

import dataclasses
import datetime as dt
import logging
from pathlib import Path

import dagster as dg
import pytest

from pipelines import SourcePosition
from sensors import (
    SAVEPOINT_KIND_TAG,
    build_savepoint_job,
    build_savepoint_schedule,
    pipeline_definitions,
)
from tests.pipelines.support import click_pipeline
from tests.sensors.support import (
    materialize_range,
    pipeline_access,
    resources_for,
    storage_resource,
    unused_click_pipeline,
)
from tests.sensors.support import write_snapshot as snapshot

TICK = dt.datetime(2026, 10, 2, 3, 0, tzinfo=dt.UTC)
TAKE_SAVEPOINT = "user_activity_take_savepoint"
PIPELINES = ("user_activity", "page_views")  # the code location's
(savepoint_schedule,) = pipeline_definitions(unused_click_pipeline()).schedules


def evaluate_schedule(instance, resource, when=TICK):
    # As a context manager: the context builds its own instance from the ref on first use
    # and only disposes it on exit; left open, it stays Dagster's current one for later tests.
    with dg.build_schedule_context(
        instance=instance, scheduled_execution_time=when,
        resources={"checkpoint_storage": resource},
    ) as context:  # fmt: skip
        return savepoint_schedule.evaluate_tick(context)


def test_schedule_requests_one_scheduled_savepoint_per_tick(tmp_path):
    """With a completed checkpoint, a tick requests a scheduled savepoint run whose run key
    is the scheduled time: the same tick gives the same key, the next tick another."""
    resource = storage_resource(tmp_path)
    snapshot(pipeline_access(resource), 1, SourcePosition("2026-10-01", 2, True))
    with dg.instance_for_test() as instance:
        (first,) = evaluate_schedule(instance, resource).run_requests
        (again,) = evaluate_schedule(instance, resource).run_requests
        (later,) = evaluate_schedule(instance, resource, TICK + dt.timedelta(days=1)).run_requests
    assert "scheduled-savepoint-2026-10-02T03:00:00+00:00" == first.run_key == again.run_key
    assert "scheduled-savepoint-2026-10-03T03:00:00+00:00" == later.run_key
    assert {"ops": {TAKE_SAVEPOINT: {"config": {"scheduled": True}}}} == first.run_config
    assert "scheduled" == first.tags[SAVEPOINT_KIND_TAG]


def test_schedule_skips_without_a_completed_checkpoint(tmp_path):
    """Before the pipeline completed a checkpoint, the tick skips and says why."""
    with dg.instance_for_test() as instance:
        data = evaluate_schedule(instance, storage_resource(tmp_path))
    assert [] == list(data.run_requests or [])
    assert "no completed checkpoint of user_activity" in data.skip_message


def test_schedule_is_daily_by_default_and_running():
    """Without SAVEPOINT_CRON the schedule runs daily (03:00 UTC) and starts RUNNING."""
    assert ("0 3 * * *", "UTC", dg.DefaultScheduleStatus.RUNNING) == (
        savepoint_schedule.cron_schedule,
        savepoint_schedule.execution_timezone,
        savepoint_schedule.default_status,
    )


def schedule_for(partitions, cron=None):
    pipeline = dataclasses.replace(unused_click_pipeline(), partitions=partitions)
    return build_savepoint_schedule(pipeline, build_savepoint_job(pipeline), cron)


@pytest.mark.parametrize(
    ("partitions", "expected"),
    [
        (dg.HourlyPartitionsDefinition(start_date="2026-10-01-00:00"), ("30 * * * *", "UTC")),
        (
            dg.HourlyPartitionsDefinition(start_date="2026-10-01-00:00", minute_offset=45),
            ("15 * * * *", "UTC"),
        ),
        (dg.DailyPartitionsDefinition(start_date="2026-10-01"), ("0 3 * * *", "UTC")),
        (
            dg.DailyPartitionsDefinition(
                start_date="2026-10-01", hour_offset=22, timezone="Europe/Berlin"
            ),
            ("0 1 * * *", "Europe/Berlin"),
        ),
        (dg.WeeklyPartitionsDefinition(start_date="2026-10-04"), ("0 3 * * 0", "UTC")),
        (
            dg.WeeklyPartitionsDefinition(start_date="2026-10-04", day_offset=6, hour_offset=23),
            ("0 2 * * 0", "UTC"),
        ),
        (dg.MonthlyPartitionsDefinition(start_date="2026-10-01"), ("0 3 1 * *", "UTC")),
        (dg.StaticPartitionsDefinition(["eu", "us"]), ("0 3 * * *", "UTC")),
    ],
)
def test_default_schedule_follows_the_partitions(partitions, expected, monkeypatch):
    """Without a cron: one savepoint per time-window partition, half a period (at most 3 h)
    after it closes, in the partitions' timezone (past midnight: the next day); static
    partitions keep daily at 03:00 UTC and say it is a fixed default."""
    monkeypatch.delenv("SAVEPOINT_CRON", raising=False)
    schedule = schedule_for(partitions)
    assert expected == (schedule.cron_schedule, schedule.execution_timezone)
    assert "coarser" not in schedule.description
    static = isinstance(partitions, dg.StaticPartitionsDefinition)
    origin = "static partitions: a fixed default" if static else "one per partition"
    assert origin in schedule.description


def test_explicit_coarser_cron_is_kept_and_described_as_coarser(monkeypatch, caplog):
    """An hourly pipeline with a daily cron (argument or SAVEPOINT_CRON) keeps that cron; its
    description and one warning at definition time say that it is coarser; a cron at least
    as fine as the partitions says nothing of the kind."""
    hourly = dg.HourlyPartitionsDefinition(start_date="2026-10-01-00:00")
    monkeypatch.delenv("SAVEPOINT_CRON", raising=False)
    with caplog.at_level(logging.WARNING, logger="sensors.savepoints"):
        schedule = schedule_for(hourly, "0 3 * * *")
        schedule_for(hourly, "0 3 * * *")  # built again (another process would log again)
    assert ("0 3 * * *", "UTC") == (schedule.cron_schedule, schedule.execution_timezone)
    assert "'0 3 * * *' (explicit) is coarser than user_activity's partitions" in (
        schedule.description
    )
    assert 1 == sum("is coarser than" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("SAVEPOINT_CRON", "0 3 * * 1-5")
    from_env = schedule_for(dg.DailyPartitionsDefinition(start_date="2026-10-01"))
    assert "0 3 * * 1-5" == from_env.cron_schedule
    assert "(SAVEPOINT_CRON) is coarser than" in from_env.description
    assert "coarser" not in schedule_for(hourly, "*/20 * * * *").description
    assert "coarser" not in schedule_for(
        dg.DailyPartitionsDefinition(start_date="2026-10-01"), "0 5 * * *"
    ).description


def test_code_location_registers_the_schedule_and_sensors_running():
    """The code location holds each pipeline's savepoint job and schedule, retention and
    recovery sensors, each starting RUNNING, and still validates."""
    from pipelines.definitions import defs

    with dg.instance_for_test():  # Dagster resolves definitions against a live instance
        dg.Definitions.validate_loadable(defs)
        repository = defs.get_repository_def()
        statuses = {
            s.name: s.default_status.value
            for s in [*repository.schedule_defs, *repository.sensor_defs]
        }
        jobs = {name: repository.has_job(f"{name}_savepoint_job") for name in PIPELINES}
    assert {name: True for name in PIPELINES} == jobs
    assert {
        f"{name}_{automation}": "RUNNING"
        for name in PIPELINES
        for automation in ("savepoint_schedule", "retention_sensor", "recovery_sensor")
    } == statuses


# --- with Spark --------------------------------------------------------------------------


def observations(instance) -> list[dict]:
    records = instance.fetch_observations(dg.AssetKey("user_activity"), limit=10).records
    return [
        {k: v.value for k, v in r.asset_observation.metadata.items()} for r in reversed(records)
    ]


def user_activity_metadata(instance) -> dict[str, dict]:
    records = instance.fetch_materializations(dg.AssetKey("user_activity"), limit=20).records
    return {
        r.asset_materialization.partition: {
            k: v.value for k, v in r.asset_materialization.metadata.items()
        }
        for r in reversed(records)  # oldest first: the newest materialization of a day wins
    }


@pytest.fixture(scope="module")
def savepointed(spark, tmp_path_factory):
    """One day materialized, then a scheduled and a hand-made savepoint of it."""
    tmp_path = tmp_path_factory.mktemp("savepoints")
    resources = resources_for(tmp_path)
    pipeline = click_pipeline(tmp_path)
    savepoint_job = build_savepoint_job(pipeline)
    with dg.instance_for_test() as instance:
        assert materialize_range(
            instance, resources, "2026-10-01", "2026-10-01", pipeline=pipeline
        ).success
        scheduled = savepoint_job.execute_in_process(
            instance=instance,
            resources=resources,
            run_config={"ops": {TAKE_SAVEPOINT: {"config": {"scheduled": True}}}},
            tags={SAVEPOINT_KIND_TAG: "scheduled"},
        )
        by_hand = savepoint_job.execute_in_process(instance=instance, resources=resources)
        yield instance, resources, tmp_path, pipeline, (scheduled, by_hand)


def test_savepoint_job_writes_the_savepoint_and_records_it(savepointed):
    """The scheduled run writes a self-contained savepoint into savepoints/scheduled holding
    the latest checkpoint's state, and records pointer, size, position and checkpoint id."""
    instance, resources, tmp_path, _, (run, _) = savepointed
    assert run.success
    checkpoint = user_activity_metadata(instance)["2026-10-01"]
    (directory,) = (tmp_path / "savepoints" / "scheduled").iterdir()
    stored = pipeline_access(resources["checkpoint_storage"]).resolve_checkpoint(str(directory))
    stored = stored.load_metadata()
    observed = observations(instance)[0]
    assert {
        "savepoint_pointer": str(directory),
        "savepoint_kind": "scheduled",
        "taken_from": checkpoint["checkpoint_pointer"],
        "checkpoint_id": checkpoint["checkpoint_id"],
        "source_position": "end of 2026-10-01",
        "state_bytes": stored.state_size,
    } == {k: observed[k] for k in (
        "savepoint_pointer", "savepoint_kind", "taken_from", "checkpoint_id", "source_position",
        "state_bytes",
    )}  # fmt: skip
    assert stored.properties.is_savepoint()
    assert checkpoint["state_rows_user_activity"] == observed["state_rows_user_activity"]
    assert all(
        h.path.startswith(str(directory)) for h in stored.all_handles() if hasattr(h, "path")
    )


def test_savepoint_made_by_hand_goes_to_the_savepoint_directory(savepointed):
    """The job launched without config writes into savepoints/ itself, not scheduled/."""
    instance, _, tmp_path, _, (_, run) = savepointed
    assert run.success
    observed = observations(instance)[1]
    assert ("hand-made", tmp_path / "savepoints") == (
        observed["savepoint_kind"],
        Path(observed["savepoint_pointer"]).parent,
    )


def test_backfill_from_the_savepoint_leaves_checkpoints_later_runs_continue(savepointed):
    """A backfill of 10-02..10-03 restoring from the scheduled savepoint succeeds in one run,
    starts from the savepoint, and the next regular run (10-04) continues from the
    checkpoint the backfill left."""
    instance, resources, _, pipeline, _ = savepointed
    pointer = observations(instance)[0]["savepoint_pointer"]
    backfill = materialize_range(
        instance, resources, "2026-10-02", "2026-10-03", pipeline=pipeline, restore_from=pointer
    )
    regular = materialize_range(instance, resources, "2026-10-04", "2026-10-04", pipeline=pipeline)
    meta = user_activity_metadata(instance)
    assert (True, True) == (backfill.success, regular.success)
    assert pointer == meta["2026-10-02"]["restored_from"]
    assert meta["2026-10-02"]["checkpoint_pointer"] == meta["2026-10-03"]["restored_from"]
    assert meta["2026-10-03"]["checkpoint_pointer"] == meta["2026-10-04"]["restored_from"]
    assert Path(pointer, "_metadata").is_file()  # NO_CLAIM: the savepoint stays
