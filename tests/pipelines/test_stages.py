"""The stages as plain PySpark functions: no Dagster, no checkpoints."""

import datetime as dt
import time
from decimal import Decimal

import pytest

from pipelines import empty_state
from pipelines.examples.click_events.stages import (
    DEDUPE_RETENTION,
    DEDUPE_STATE_SCHEMA,
    EVENT_SCHEMA,
    STAGES,
    USER_ACTIVITY_STATE_SCHEMA,
    dedupe,
    user_activity,
)

T0 = dt.datetime(2026, 3, 10, 12, 0, tzinfo=dt.UTC)


def at(hours: float) -> dt.datetime:
    return T0 + dt.timedelta(hours=hours)


def utc(value: dt.datetime) -> dt.datetime:
    """A collected timestamp (naive, in the Python process's zone) as an aware UTC one."""
    return value.astimezone(dt.UTC)


def events(spark, *rows):
    """Events from (event_id, user_id, hours after T0, amount) tuples."""
    return spark.createDataFrame([(e, u, at(h), Decimal(a)) for e, u, h, a in rows], EVENT_SCHEMA)


def dedupe_state(spark, *rows):
    """Dedupe state from (event_id, hours after T0) tuples."""
    return spark.createDataFrame([(e, at(h)) for e, h in rows], DEDUPE_STATE_SCHEMA)


def ids(df) -> list[str]:
    return sorted(r["event_id"] for r in df.collect())


def state_rows(df) -> list[tuple]:
    return sorted((r["event_id"], utc(r["event_ts"])) for r in df.collect())


def activity(df) -> dict[str, tuple]:
    return {
        r["user_id"]: (r["event_count"], r["amount_sum"], utc(r["first_seen"]), utc(r["last_seen"]))
        for r in df.collect()
    }


def activity_state(spark, *rows):
    """User activity state from (user, count, sum, first hours, last hours) tuples."""
    return spark.createDataFrame(
        [(u, c, Decimal(s), at(f), at(last)) for u, c, s, f, last in rows],
        USER_ACTIVITY_STATE_SCHEMA,
    )


# --- dedupe ------------------------------------------------------------------------------


def test_dedupe_drops_duplicates_within_a_batch(spark):
    """A batch that delivers an event twice outputs it once."""
    batch = events(spark, ("e1", "u1", 0, "1.00"), ("e2", "u1", 1, "2.00"), ("e1", "u1", 0, "1.00"))
    _, output = dedupe(batch, empty_state(spark, STAGES[0]))
    assert ["e1", "e2"] == sorted(r["event_id"] for r in output.collect())


def test_dedupe_drops_duplicates_already_in_state(spark):
    """An event whose id is in the state (seen in an earlier batch) is not output again."""
    state = dedupe_state(spark, ("e1", 0), ("e2", 1))
    batch = events(spark, ("e1", "u1", 0, "1.00"), ("e3", "u2", 2, "3.00"))
    _, output = dedupe(batch, state)
    assert ["e3"] == ids(output)


def test_dedupe_drops_duplicates_across_consecutive_batches(spark):
    """Feeding one batch's new state into the next recognises redeliveries of its events."""
    state, first = dedupe(
        events(spark, ("e1", "u1", 0, "1"), ("e2", "u1", 1, "2")), empty_state(spark, STAGES[0])
    )
    _, second = dedupe(events(spark, ("e2", "u1", 1, "2"), ("e3", "u2", 2, "3")), state)
    assert (["e1", "e2"], ["e3"]) == (ids(first), ids(second))


def test_dedupe_output_keeps_event_columns_and_values(spark):
    """Output rows are the input events unchanged, in the event schema's column order."""
    batch = events(spark, ("e1", "u7", 0.5, "12.34"))
    _, output = dedupe(batch, empty_state(spark, STAGES[0]))
    rows = [
        (r["event_id"], r["user_id"], utc(r["event_ts"]), r["amount"]) for r in output.collect()
    ]
    assert (EVENT_SCHEMA.fieldNames(), [("e1", "u7", at(0.5), Decimal("12.34"))]) == (
        output.columns,
        rows,
    )


def test_dedupe_drops_events_older_than_retention_of_the_batch_watermark(spark):
    """Events older than the retention window behind the newest event time are dropped; one
    exactly at the window's edge is kept."""
    window_h = DEDUPE_RETENTION.total_seconds() / 3600
    batch = events(
        spark,
        ("new", "u1", 0, "1"),
        ("edge", "u1", -window_h, "1"),
        ("late", "u1", -window_h - 1, "1"),
        ("inside", "u1", -window_h + 1, "1"),
    )
    _, output = dedupe(batch, empty_state(spark, STAGES[0]))
    assert ["edge", "inside", "new"] == ids(output)


def test_dedupe_watermark_includes_the_state(spark):
    """The watermark is the newest time in state or input: an input event older than the
    retention window behind the state's newest event is dropped."""
    window_h = DEDUPE_RETENTION.total_seconds() / 3600
    state = dedupe_state(spark, ("seen", 0))
    batch = events(spark, ("late", "u1", -window_h - 1, "1"), ("ok", "u1", -window_h + 1, "1"))
    _, output = dedupe(batch, state)
    assert ["ok"] == ids(output)


def test_dedupe_state_keeps_only_ids_within_the_window(spark):
    """The new state holds the old and new ids whose time is within the retention window of
    the new watermark, with their event times; older ids are evicted."""
    window_h = DEDUPE_RETENTION.total_seconds() / 3600
    state = dedupe_state(spark, ("old", 0), ("kept", 2))
    batch = events(spark, ("e1", "u1", window_h - 2, "1"), ("e2", "u1", window_h + 1, "1"))
    new_state, _ = dedupe(batch, state)
    assert [
        ("e1", at(window_h - 2)),
        ("e2", at(window_h + 1)),
        ("kept", at(2)),
    ] == state_rows(new_state)


def test_dedupe_state_records_each_output_event_once(spark):
    """A duplicate within a batch adds its id to the state once."""
    batch = events(spark, ("e1", "u1", 0, "1"), ("e1", "u1", 0, "1"), ("e2", "u1", 1, "1"))
    new_state, _ = dedupe(batch, empty_state(spark, STAGES[0]))
    assert [("e1", at(0)), ("e2", at(1))] == state_rows(new_state)


def test_dedupe_empty_input_and_state(spark):
    """Empty state and empty input give empty state and empty output with the stage's
    columns."""
    new_state, output = dedupe(events(spark), empty_state(spark, STAGES[0]))
    assert (
        ([], DEDUPE_STATE_SCHEMA.fieldNames()),
        ([], EVENT_SCHEMA.fieldNames()),
    ) == ((new_state.collect(), new_state.columns), (output.collect(), output.columns))


def test_dedupe_empty_input_keeps_the_state(spark):
    """An empty batch outputs nothing and leaves the state as it was."""
    state = dedupe_state(spark, ("e1", 0), ("e2", 1))
    new_state, output = dedupe(events(spark), state)
    assert ([], [("e1", at(0)), ("e2", at(1))]) == (output.collect(), state_rows(new_state))


def test_dedupe_new_state_has_the_stage_schema(spark):
    """The new state has the dedupe stage's state schema."""
    new_state, _ = dedupe(events(spark, ("e1", "u1", 0, "1")), empty_state(spark, STAGES[0]))
    assert DEDUPE_STATE_SCHEMA.fieldNames() == new_state.columns
    assert [f.dataType for f in DEDUPE_STATE_SCHEMA] == [f.dataType for f in new_state.schema]


@pytest.fixture
def driver_in_berlin(monkeypatch):
    """The driver's Python process in a time zone with daylight saving time."""
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_dedupe_retention_is_absolute_time_across_a_dst_change(spark, driver_in_berlin):
    """The retention window is measured in absolute time, whatever the driver's time zone: a
    watermark just after a daylight saving change drops exactly the events older than it."""
    watermark = dt.datetime(2026, 10, 26, 12, 0, tzinfo=dt.UTC)  # Berlin left DST on the 25th
    horizon = watermark - DEDUPE_RETENTION
    batch = spark.createDataFrame(
        [
            ("new", "u1", watermark, Decimal("1")),
            ("late", "u1", horizon - dt.timedelta(minutes=30), Decimal("1")),
            ("ok", "u1", horizon + dt.timedelta(minutes=30), Decimal("1")),
        ],
        EVENT_SCHEMA,
    )
    _, output = dedupe(batch, empty_state(spark, STAGES[0]))
    assert ["new", "ok"] == ids(output)


# --- user_activity -----------------------------------------------------------------------


def test_user_activity_aggregates_a_batch(spark):
    """Per user: event count, exact decimal amount sum, first and last event time; the output
    equals the new state when starting empty."""
    batch = events(
        spark,
        ("e1", "u1", 3, "0.10"),
        ("e2", "u1", 1, "0.20"),
        ("e3", "u1", 2, "9999999999.99"),
        ("e4", "u2", 5, "0.01"),
    )
    new_state, output = user_activity(batch, empty_state(spark, STAGES[1]))
    expected = {
        "u1": (3, Decimal("10000000000.29"), at(1), at(3)),
        "u2": (1, Decimal("0.01"), at(5), at(5)),
    }
    assert (expected, expected) == (activity(new_state), activity(output))


def test_user_activity_sums_exactly_to_the_cent(spark):
    """Many small decimal amounts sum exactly (no float rounding)."""
    batch = events(spark, *[(f"e{i}", "u1", 0, "0.10") for i in range(30)])
    new_state, _ = user_activity(batch, empty_state(spark, STAGES[1]))
    assert Decimal("3.00") == new_state.collect()[0]["amount_sum"]


def test_user_activity_merges_with_existing_state(spark):
    """New state adds counts and sums to the existing ones and widens first/last seen; users
    not in the input keep their state; the output holds only this input's aggregates."""
    state = activity_state(spark, ("u1", 5, "100.50", 0, 2), ("u3", 1, "1.00", -1, -1))
    batch = events(
        spark,
        ("e1", "u1", -2, "0.25"),
        ("e2", "u1", 4, "0.25"),
        ("e3", "u2", 1, "7.00"),
    )
    new_state, output = user_activity(batch, state)
    assert (
        {
            "u1": (7, Decimal("101.00"), at(-2), at(4)),
            "u2": (1, Decimal("7.00"), at(1), at(1)),
            "u3": (1, Decimal("1.00"), at(-1), at(-1)),
        },
        {
            "u1": (2, Decimal("0.50"), at(-2), at(4)),
            "u2": (1, Decimal("7.00"), at(1), at(1)),
        },
    ) == (activity(new_state), activity(output))


def test_user_activity_empty_input_keeps_the_state(spark):
    """An empty batch outputs nothing and leaves the state as it was."""
    state = activity_state(spark, ("u1", 5, "100.50", 0, 2))
    new_state, output = user_activity(events(spark), state)
    assert ({}, {"u1": (5, Decimal("100.50"), at(0), at(2))}) == (
        activity(output),
        activity(new_state),
    )


def test_user_activity_empty_input_and_state(spark):
    """Empty state and empty input give empty state and output with the stage's columns."""
    new_state, output = user_activity(events(spark), empty_state(spark, STAGES[1]))
    assert (([], USER_ACTIVITY_STATE_SCHEMA.fieldNames()), []) == (
        (new_state.collect(), new_state.columns),
        output.collect(),
    )


def test_user_activity_new_state_has_the_stage_schema(spark):
    """The new state has the user_activity stage's state schema (column names and types)."""
    new_state, _ = user_activity(events(spark, ("e", "u", 0, "1")), empty_state(spark, STAGES[1]))
    assert [(f.name, f.dataType) for f in USER_ACTIVITY_STATE_SCHEMA] == [
        (f.name, f.dataType) for f in new_state.schema
    ]


def test_dedupe_state_partitions_do_not_grow_with_batches(spark):
    """However many batches were applied, the dedupe state has at most
    spark.sql.shuffle.partitions partitions (each is a state file per checkpoint)."""
    limit = int(spark.conf.get("spark.sql.shuffle.partitions"))
    state = empty_state(spark, STAGES[0])
    for batch in range(limit + 2):
        data = events(spark, *[(f"e{batch}-{i}", "u1", batch, "1") for i in range(4)])
        state, _ = dedupe(data.repartition(2), state)
        state = state.localCheckpoint(eager=True)  # as the runner does: cut the lineage
    assert (4 * (limit + 2), True) == (state.count(), state.rdd.getNumPartitions() <= limit)
