"""The click-events example's 'silent for 2 hours' alert (``silent_users``, a keyed stage
with an event-time timer per user): its functions, the timers contract without Spark, and
the pipeline through the runner, each against a recomputation from the events alone."""

import datetime as dt
import random

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from checkpoint_storage import FileSystemCheckpointStorage
from pipelines import StatefulRunner
from pipelines.examples.click_events import SILENCE, click_events_pipeline, generate_day
from pipelines.examples.click_events.events import EVENT_ARROW_SCHEMA, batch_urls
from pipelines.examples.click_events.stages import (
    SILENCE_LATENESS,
    SILENT_USERS_STATE_SCHEMA,
    alert_silence,
    track_silence,
)
from tests.pipelines.timer_model import TIMER_TYPE, TimerModel, sorted_rows

T0 = dt.datetime(2026, 10, 1, 8, 0, tzinfo=dt.UTC)
HOUR = dt.timedelta(hours=1)
DAYS = ("2026-10-01", "2026-10-02")


def events_table(events: list[tuple]) -> pa.Table:
    return pa.Table.from_pylist(
        [{"event_id": f"e{i}", "user_id": u, "event_ts": t, "amount": 1}
         for i, (u, t) in enumerate(events)], schema=EVENT_ARROW_SCHEMA)


def state_table(rows: list[tuple]) -> pa.Table:
    return pa.Table.from_pylist([{"user_id": u, "last_seen": t} for u, t in rows],
                                schema=SILENT_USERS_STATE_SCHEMA)


def recomputed_alerts(batches: list[list[tuple]], lateness: dt.timedelta = SILENCE_LATENESS
                      ) -> list[list[tuple]]:
    """Each batch's alerts, recomputed from (user, event time) rows in arrival order: rows
    behind the watermark (newest event time seen minus ``lateness``) are dropped; a user's
    events newer than its last one, in time order, each ``SILENCE`` or more after the one
    before, alert for that one; then every user whose last event + ``SILENCE`` is at or
    before the watermark alerts and is forgotten."""
    clock, last, alerts = None, {}, []
    for batch in batches:
        clock = max([t for _, t in batch] + ([clock] if clock else []))
        watermark = clock - lateness
        out = []
        for user in sorted({u for u, t in batch if t >= watermark}):
            prev = last.get(user)
            for t in sorted(t for u, t in batch if u == user and t >= watermark):
                if prev is not None and t <= prev:
                    continue
                if prev is not None and t - prev >= SILENCE:
                    out.append((user, prev, prev + SILENCE))
                prev = t
            last[user] = prev
        for user, seen in sorted(last.items()):
            if seen + SILENCE <= watermark:
                out.append((user, seen, seen + SILENCE))
                del last[user]
        alerts.append(sorted(out))
    return alerts


def test_a_user_back_after_the_silence_alerts_and_its_timer_moves():
    """u1 comes back 3 hours after its last event: an alert for the silence, its timer
    moves. u2 comes back within the hour: no alert, timer moves. u3's event is older than
    its last one: nothing changes. u4 is new: state and a timer."""
    state = state_table([("u1", T0), ("u2", T0), ("u3", T0)])
    events = events_table([("u1", T0 + 3 * HOUR), ("u2", T0 + HOUR / 2),
                           ("u3", T0 - HOUR), ("u4", T0 + HOUR)])

    result = track_silence(events, state)

    assert [("u1", T0, T0 + SILENCE)] == sorted_rows(result.output)
    assert [("u1", T0 + 3 * HOUR), ("u2", T0 + HOUR / 2), ("u3", T0),
            ("u4", T0 + HOUR)] == sorted_rows(result.upserts)
    assert [("u1", T0 + 3 * HOUR + SILENCE), ("u2", T0 + HOUR / 2 + SILENCE),
            ("u3", T0 + SILENCE), ("u4", T0 + HOUR + SILENCE)] == sorted_rows(result.timers)
    assert [("u1", T0 + SILENCE), ("u2", T0 + SILENCE)] == sorted_rows(result.deleted_timers)


def test_a_fired_timer_alerts_and_forgets_the_user():
    fired = pa.table({"user_id": ["u1"], "timer": pa.array([T0 + SILENCE], TIMER_TYPE)})

    result = alert_silence(fired, state_table([("u1", T0)]))

    assert [("u1", T0, T0 + SILENCE)] == sorted_rows(result.output)
    assert [("u1",)] == sorted_rows(result.deletes)


def test_alerts_through_the_timer_contract_equal_the_recomputation():
    """Random events in batches of 30 minutes, some late (a few beyond the lateness): each
    batch's alerts equal the recomputation."""
    rng = random.Random(5)
    batches = []
    for b in range(30):
        start = T0 + b * HOUR / 2
        batches.append([(f"u{rng.randrange(6)}", start + dt.timedelta(
            seconds=rng.randrange(1800) - (rng.randrange(5 * 3600) if rng.random() < 0.1
                                           else 0))) for _ in range(4)])
    model = TimerModel(track_silence, alert_silence, SILENT_USERS_STATE_SCHEMA, "user_id",
                       "event_ts", lateness=3 * HOUR)

    alerts = [model.batch(events_table(batch)) for batch in batches]

    assert recomputed_alerts(batches, lateness=3 * HOUR) == alerts
    assert sum(len(a) for a in alerts) > 5


@pytest.mark.timeout(900)
def test_the_pipeline_with_alerts_equals_the_recomputation(spark, tmp_path):
    """Two generated days (duplicates and late events included) through the runner: the
    alerts in the sink, day by day, equal the recomputation from the landed batches."""
    landing, alerts_url = str(tmp_path / "landing"), str(tmp_path / "alerts")
    for day in DAYS:
        generate_day(landing, day, batches=3, events_per_batch=60, users=8, seed=3)
    pipeline = click_events_pipeline(landing, str(tmp_path / "reports"),
                                     alerts_url=alerts_url)
    runner = StatefulRunner(spark, FileSystemCheckpointStorage(str(tmp_path / "cp")), pipeline)

    runner.run(list(DAYS))

    batches = {day: [[(r["user_id"], r["event_ts"]) for r in pq.read_table(url).to_pylist()]
                     for url in batch_urls(landing, day)] for day in DAYS}
    expected = recomputed_alerts([b for day in DAYS for b in batches[day]])
    sink = ds.dataset(alerts_url, format="parquet", partitioning="hive").to_table()
    for i, day in enumerate(DAYS):
        mine = sink.filter(ds.field("date") == day).drop_columns(["date"])
        days_alerts = [alert for batch in expected[3 * i:3 * i + 3] for alert in batch]
        assert sorted(days_alerts) == sorted_rows(mine)
    assert sum(len(a) for a in expected) > 3
