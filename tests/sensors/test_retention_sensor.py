"""The retention sensor on a prepared storage directory and a real Dagster instance:
checkpoint retention, garbage collection and savepoint retention delete exactly what they
should, keep what is in use, defer while work is in progress and fail on I/O errors."""

import datetime as dt
import json
import uuid
from pathlib import Path

import dagster as dg
import pytest

import sensors.retention
from pipelines import SourcePosition
from sensors import RetentionPolicy, build_retention_sensor
from tests.sensors.support import (
    age,
    files_below,
    pipeline_access,
    storage_resource,
    unused_click_pipeline,
)
from tests.sensors.support import write_snapshot as snapshot
from tests.support import payload, write_state

HOUR = 3600.0
DAY = 24 * HOUR
POLICY = RetentionPolicy(dt.timedelta(hours=1), keep_scheduled_savepoints=2)
PIPELINE = unused_click_pipeline(max_retained_checkpoints=2)


def retention_sensor(policy: RetentionPolicy) -> dg.SensorDefinition:
    return build_retention_sensor(PIPELINE, policy)


def end_of(day: int) -> SourcePosition:
    return SourcePosition(f"2026-10-{day:02d}", 2, True)


class Prepared:
    """chk-1..5 completed (max_retained 2), orphans old and young, an aborted checkpoint
    old and one young, four scheduled savepoints and two hand-made ones."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path
        self.resource = storage_resource(tmp_path)
        access = pipeline_access(self.resource)
        self.job = Path(access.checkpoints_directory)
        self.chk = {i: snapshot(access, i, end_of(i), age_s=(6 - i) * HOUR) for i in range(1, 6)}
        self.orphan_old = self.job / "chk-5" / "orphan-old"
        self.orphan_young = self.job / "chk-5" / "orphan-young"
        self.shared_old = self.job / "shared" / "crashed-writer"
        for path in (self.orphan_old, self.orphan_young, self.shared_old):
            path.write_bytes(payload(100, 1))
        age(self.orphan_old, 3 * HOUR)
        age(self.shared_old, 3 * HOUR)
        aborted_old = write_state(access.initialize_location_for_checkpoint(6), payload(2048, 6))
        self.aborted_old = Path(aborted_old.path)
        age(self.aborted_old.parent, 3 * HOUR)  # the directory too: it was created then
        self.aborted_young = Path(
            write_state(access.initialize_location_for_checkpoint(7), payload(2048, 7)).path
        )
        scheduled = str(tmp_path / "savepoints" / "scheduled")
        self.scheduled = [
            snapshot(access, i, end_of(i), savepoint_dir=scheduled, age_s=(5 - i) * DAY)
            for i in range(1, 5)
        ]
        hand = str(tmp_path / "savepoints")
        self.hand_made = [
            snapshot(access, 2, end_of(2), savepoint_dir=hand, age_s=10 * DAY),
            snapshot(access, 5, end_of(5), savepoint_dir=hand, age_s=HOUR),
        ]

    def files(self) -> set[str]:
        return files_below(self.root)

    def rel(self, *paths) -> set[str]:
        out = set()
        for path in paths:
            path = Path(path)
            below = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            out |= {str(p.relative_to(self.root)) for p in below}
        return out


def record_lineage(instance, prepared: Prepared) -> None:
    """Materializations saying chk-4 was restored from the oldest scheduled savepoint and
    chk-5 from chk-4: that savepoint is where the retained lineage began."""
    for pointer, source in (
        (prepared.chk[4], prepared.scheduled[0]),
        (prepared.chk[5], prepared.chk[4]),
    ):
        instance.report_runless_asset_event(
            dg.AssetMaterialization(
                "user_activity",
                metadata={
                    "checkpoint_pointer": dg.MetadataValue.path(pointer),
                    "restored_from": source,
                },
            )
        )


def evaluate(sensor, instance, resource, cursor=None):
    # As a context manager, so the instance the context may build is disposed on exit.
    with dg.build_sensor_context(
        instance=instance, cursor=cursor, resources={"checkpoint_storage": resource}
    ) as context:
        return sensor(context)


def test_retention_deletes_exactly_the_expired_and_keeps_the_rest(tmp_path):
    """One tick subsumes chk-1..3, collects the old orphans and the old aborted checkpoint,
    disposes the scheduled savepoints beyond the newest two except the one in use, and
    deletes nothing else (hand-made savepoints, young files, retained checkpoints)."""
    prepared = Prepared(tmp_path)
    before = prepared.files()
    expected_deleted = prepared.rel(
        prepared.chk[1], prepared.chk[2], prepared.chk[3], prepared.orphan_old,
        prepared.shared_old, prepared.aborted_old, prepared.scheduled[1],
    )  # fmt: skip
    sensor = retention_sensor(POLICY)
    with dg.instance_for_test() as instance:
        record_lineage(instance, prepared)
        result = evaluate(sensor, instance, prepared.resource)
    assert 3 * 2 + 3 + 2 == len(expected_deleted)
    assert before - expected_deleted == prepared.files()
    assert not (prepared.job / "chk-6").exists()  # emptied, then removed
    (observation,) = result.asset_events
    meta = {k: v.value for k, v in observation.metadata.items()}
    assert [prepared.chk[i] for i in (1, 2, 3)] == meta["subsumed_checkpoints"]
    assert [prepared.scheduled[1]] == meta["deleted_savepoints"]
    assert [prepared.scheduled[0]] == list(meta["kept_in_use"])
    assert 3 == meta["garbage_files_deleted"]
    assert 3 + 3 + 1 == json.loads(result.cursor)["deleted_total"]


def test_second_tick_deletes_nothing_and_skips(tmp_path):
    """Retention is idempotent: a second tick with the first tick's cursor deletes nothing,
    skips with a reason, and keeps the running total."""
    prepared = Prepared(tmp_path)
    sensor = retention_sensor(POLICY)
    with dg.instance_for_test() as instance:
        record_lineage(instance, prepared)
        first = evaluate(sensor, instance, prepared.resource)
        after_first = prepared.files()
        second = evaluate(sensor, instance, prepared.resource, first.cursor)
    assert after_first == prepared.files()
    assert [] == list(second.asset_events)
    assert second.skip_reason.skip_message.startswith("nothing to delete")
    assert json.loads(first.cursor)["deleted_total"] == json.loads(second.cursor)["deleted_total"]


def test_without_lineage_the_old_scheduled_savepoints_go_and_hand_made_stay(tmp_path):
    """With no materialization naming a savepoint, both scheduled savepoints beyond the
    newest two are disposed; hand-made ones stay unless a keep count is configured, then
    only the newest of them stays."""
    prepared = Prepared(tmp_path)
    with dg.instance_for_test() as instance:
        evaluate(retention_sensor(POLICY), instance, prepared.resource)
        remaining = prepared.files()
        assert prepared.rel(*prepared.scheduled[2:], *prepared.hand_made) == {
            f for f in remaining if f.startswith("savepoints/")
        }
        keep_one = RetentionPolicy(dt.timedelta(hours=1), 2, keep_hand_made_savepoints=1)
        evaluate(retention_sensor(keep_one), instance, prepared.resource)
    assert prepared.rel(*prepared.scheduled[2:], prepared.hand_made[1]) == {
        f for f in prepared.files() if f.startswith("savepoints/")
    }


def test_work_in_progress_defers_checkpoint_and_savepoint_retention(tmp_path):
    """While a run is in progress only the garbage collector runs: no checkpoint is
    subsumed and no savepoint disposed, and the report says why."""
    prepared = Prepared(tmp_path)
    with dg.instance_for_test() as instance:
        run = instance.add_run(
            dg.DagsterRun(
                job_name="user_activity_job", run_id=str(uuid.uuid4()),
                status=dg.DagsterRunStatus.STARTED,
            )
        )  # fmt: skip
        result = evaluate(retention_sensor(POLICY), instance, prepared.resource)
    (observation,) = result.asset_events
    meta = {k: v.value for k, v in observation.metadata.items()}
    assert ([], [], 3) == (
        meta["subsumed_checkpoints"],
        meta["deleted_savepoints"],
        meta["garbage_files_deleted"],
    )
    assert run.run_id in meta["deferred"]
    assert all(Path(prepared.chk[i], "_metadata").is_file() for i in range(1, 6))


def test_an_io_error_fails_the_tick(tmp_path, monkeypatch):
    """An OSError while disposing a savepoint propagates out of the sensor (a failed tick),
    it is not turned into a skip."""
    prepared = Prepared(tmp_path)

    def denied(pointer, **kwargs):
        raise PermissionError(13, "permission denied", pointer)

    monkeypatch.setattr(sensors.retention, "dispose_savepoint", denied)
    with dg.instance_for_test() as instance, pytest.raises(Exception) as raised:
        evaluate(retention_sensor(POLICY), instance, prepared.resource)
    chain, error = [], raised.value
    while error is not None:
        chain.append(type(error))
        error = error.__cause__
    assert PermissionError in chain


def test_a_flink_job_directory_is_kept_whole_and_reported(tmp_path):
    """Apache Flink's checkpoints in the pipeline's job directory: the tick deletes none of
    their files (however old) and reports each one it could not read on the observation."""
    import fsspec

    from tests.support import make_flink_job_directory

    resource = storage_resource(tmp_path)
    job = pipeline_access(resource).checkpoints_directory
    written = make_flink_job_directory(fsspec.filesystem("file"), job)
    for url in written:
        age(Path(url), 3 * DAY)
    before = files_below(tmp_path)

    with dg.instance_for_test() as instance:
        result = evaluate(retention_sensor(POLICY), instance, resource)

    assert before == files_below(tmp_path)
    (observation,) = result.asset_events
    unreadable = observation.metadata["unreadable_checkpoints"].value
    assert [f"{job}/chk-{i}" for i in (3, 5, 6)] == sorted(c["pointer"] for c in unreadable)
    assert {"foreign"} == {c["reason"] for c in unreadable}


def retained_rows(event, prepared) -> list[tuple]:
    """The (kind, id, position, pointer) rows of an event's ``retained`` table, each pointer
    joined to the directory it is relative to (the job's, the scheduled or the hand-made
    savepoints')."""
    table = event.metadata["retained"]
    directories = {
        "checkpoint": prepared.chk[4].rsplit("/", 1)[0],
        "savepoint": str(prepared.root / "savepoints"),
        "scheduled savepoint": str(prepared.root / "savepoints" / "scheduled"),
    }
    return [
        tuple(r.data[c] for c in ("kind", "id", "position"))
        + (f"{directories[r.data['kind']]}/{r.data['pointer']}",)
        for r in table.records
    ]


def test_observation_shows_what_is_retained_after_the_tick(tmp_path):
    """The tick's observation carries the retained table: the two retained checkpoints by id,
    then the savepoints left, oldest first, each with its decoded position and pointer."""
    prepared = Prepared(tmp_path)
    sensor = retention_sensor(POLICY)
    with dg.instance_for_test() as instance:
        record_lineage(instance, prepared)
        result = evaluate(sensor, instance, prepared.resource)
    (observation,) = result.asset_events
    expected = [
        ("checkpoint", 4, "2026-10-04 end", prepared.chk[4]),
        ("checkpoint", 5, "2026-10-05 end", prepared.chk[5]),
        ("savepoint", 2, "2026-10-02 end", prepared.hand_made[0]),
        ("scheduled savepoint", 1, "2026-10-01 end", prepared.scheduled[0]),
        ("scheduled savepoint", 3, "2026-10-03 end", prepared.scheduled[2]),
        ("scheduled savepoint", 4, "2026-10-04 end", prepared.scheduled[3]),
        ("savepoint", 5, "2026-10-05 end", prepared.hand_made[1]),
    ]
    assert expected == retained_rows(observation, prepared)


def test_retained_table_is_narrow_with_the_pointer_last_and_relative(tmp_path):
    """Issue 29: the table fits the asset page at 1280 px: one position column, the pointer
    last and relative to the job directory (``chk-<id>``) or the savepoint directory
    (``savepoint-…``); the observation says first that it is a retention tick."""
    prepared = Prepared(tmp_path)
    sensor = retention_sensor(POLICY)
    with dg.instance_for_test() as instance:
        record_lineage(instance, prepared)
        result = evaluate(sensor, instance, prepared.resource)
    (observation,) = result.asset_events
    table = observation.metadata["retained"]
    columns = [c.name for c in table.schema.columns]
    assert ["id", "kind", "position", "size", "written", "files", "age", "pointer"] == columns
    shown = [r.data["pointer"] for r in table.records]
    assert ["chk-4", "chk-5"] == shown[:2]
    names = [p.rsplit("/", 1)[-1] for p in (*prepared.hand_made[:1], *prepared.scheduled[0:1])]
    assert names == shown[2:4]
    assert all(p.startswith("savepoint-") for p in shown[2:]), shown
    # The schema names the directories, for the full pointers.
    (described,) = [c.description for c in table.schema.columns if c.name == "pointer"]
    job_directory = prepared.chk[4].rsplit("/", 1)[0]
    assert f"{job_directory}, {tmp_path / 'savepoints' / 'scheduled'}, " in described
    assert "retention tick" == observation.metadata["event"].value
    assert "event" == next(iter(observation.metadata))
    assert observation.description.startswith("Retention tick: ")


def test_tick_after_a_new_savepoint_records_it_without_deleting(tmp_path):
    """A savepoint written between two ticks changes what is retained: the second tick
    deletes nothing but records an observation whose table ends with the new savepoint."""
    prepared = Prepared(tmp_path)
    sensor = retention_sensor(POLICY)
    with dg.instance_for_test() as instance:
        record_lineage(instance, prepared)
        first = evaluate(sensor, instance, prepared.resource)
        access = pipeline_access(prepared.resource)
        new = snapshot(access, 5, end_of(5), savepoint_dir=str(tmp_path / "savepoints"))
        second = evaluate(sensor, instance, prepared.resource, first.cursor)
    (observation,) = second.asset_events
    assert "Retention tick: retained checkpoints and savepoints changed" == observation.description
    assert [] == observation.metadata["deleted_savepoints"].value
    assert ("savepoint", 5, "2026-10-05 end", new) == retained_rows(observation, prepared)[-1]
