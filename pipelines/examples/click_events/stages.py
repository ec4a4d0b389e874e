"""The click-events example's stages: plain PySpark functions ``(input, state) -> (new state,
output)``, testable without Dagster or checkpoints.

- ``dedupe``: state = the ids of events seen within ``DEDUPE_RETENTION`` of the watermark
  (the newest event time seen). Output = each event once; events older than the retention
  window are dropped as too late, since their duplicates could no longer be recognised.
- ``user_activity``: state = per-user event count, amount sum, first and last seen. Output =
  this input's per-user aggregates.

Amounts are decimals, so sums are exact whatever the partitioning: a recovered run and an
uninterrupted one agree to the cent.

``SILENT_USERS_KEYED`` (``silent_users``, keyed, with event-time timers): an alert row when a
user has been silent for ``SILENCE`` (2 hours of event time): each event re-arms the user's
timer at its last event + ``SILENCE``; the timer fires once the watermark (the newest event
seen minus ``SILENCE_LATENESS``) reaches it, emits the alert and forgets the user until the
next event. ``click_events_pipeline(..., alerts_url=...)`` adds it and its sink.

``KEYED_STAGES`` are the same two stages as keyed stages (``pipelines.keyed``, docs/design.md
section 7): pure Arrow functions of one batch and the state of its keys. They compute what
``STAGES`` compute (tests/pipelines/test_click_events_keyed.py), with these differences, none
reachable from this pipeline's source, whose schema (``EVENT_ARROW_SCHEMA``) is not-null in
every column, so a null anywhere fails the read before either stage:

- Null keys: the keyed layer refuses a null ``event_id`` or ``user_id``; ``dedupe`` would
  pass a null-id event on at every delivery, ``user_activity`` would count a null user.
- Null ``event_ts``: ``dedupe_events`` drops the row; ``dedupe`` drops it too, except in a
  batch with no timestamp at all and no state (no watermark), which it passes on whole.
- An ``event_id`` delivered with different contents (not a re-delivery): ``dedupe`` keeps an
  arbitrary row of a batch's copies (``dropDuplicates``), ``dedupe_events`` the first not
  too late; and a copy whose id is still in ``dedupe``'s state, though behind the horizon,
  is dropped by ``dedupe`` and passed on by the keyed stage (that state has expired).
"""

import datetime as dt

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from pipelines import (
    SOURCE,
    KeyedResult,
    KeyedStage,
    Stage,
    StateTtl,
    TtlTimeCharacteristic,
    agg,
)
from pipelines.keyed import TimeMode, Watermark

__all__ = [
    "DEDUPE_KEYED",
    "DEDUPE_KEYED_STATE_SCHEMA",
    "DEDUPE_OUTPUT_SCHEMA",
    "DEDUPE_RETENTION",
    "DEDUPE_STATE_SCHEMA",
    "EVENT_SCHEMA",
    "KEYED_STAGES",
    "SILENCE",
    "SILENCE_ALERT_SCHEMA",
    "SILENCE_LATENESS",
    "SILENT_USERS_KEYED",
    "SILENT_USERS_STATE_SCHEMA",
    "STAGES",
    "USER_ACTIVITY_KEYED",
    "USER_ACTIVITY_KEYED_STATE_SCHEMA",
    "USER_ACTIVITY_OUTPUT_SCHEMA",
    "USER_ACTIVITY_STATE_SCHEMA",
    "alert_silence",
    "dedupe",
    "dedupe_events",
    "track_silence",
    "user_activity",
    "user_activity_totals",
]

EVENT_SCHEMA = T.StructType(
    [
        T.StructField("event_id", T.StringType(), True),
        T.StructField("user_id", T.StringType(), True),
        T.StructField("event_ts", T.TimestampType(), True),
        T.StructField("amount", T.DecimalType(12, 2), True),
    ]
)
DEDUPE_STATE_SCHEMA = T.StructType(
    [
        T.StructField("event_id", T.StringType(), True),
        T.StructField("event_ts", T.TimestampType(), True),
    ]
)
USER_ACTIVITY_STATE_SCHEMA = T.StructType(
    [
        T.StructField("user_id", T.StringType(), True),
        T.StructField("event_count", T.LongType(), True),
        T.StructField("amount_sum", T.DecimalType(22, 2), True),
        T.StructField("first_seen", T.TimestampType(), True),
        T.StructField("last_seen", T.TimestampType(), True),
    ]
)
DEDUPE_RETENTION = dt.timedelta(days=2)


def dedupe(
    events: DataFrame, state: DataFrame, retention: dt.timedelta = DEDUPE_RETENTION
) -> tuple[DataFrame, DataFrame]:
    events = events.dropDuplicates(["event_id"])
    newest = state.select(F.max("event_ts").alias("ts")).unionByName(
        events.select(F.max("event_ts").alias("ts"))
    )
    watermark = newest.agg(F.max("ts")).first()[0]
    if watermark is None:  # no state, no events
        return state, events
    # Collected timestamps are naive wall-clock times of the driver's zone: subtract the
    # retention in absolute (UTC) time, else a DST change shifts the window by an hour.
    horizon = F.lit(watermark.astimezone(dt.UTC) - retention).cast(T.TimestampType())
    fresh = events.filter(F.col("event_ts") >= horizon)
    output = fresh.join(state.select("event_id"), "event_id", "left_anti").select(
        *EVENT_SCHEMA.fieldNames()
    )
    # A union appends the output's partitions to the state's: without the coalesce, the
    # state (and each checkpoint's file count) gains partitions with every batch, forever.
    partitions = int(state.sparkSession.conf.get("spark.sql.shuffle.partitions"))
    new_state = (
        state.unionByName(output.select("event_id", "event_ts"))
        .filter(F.col("event_ts") >= horizon)
        .coalesce(partitions)
    )
    return new_state, output


def user_activity(events: DataFrame, state: DataFrame) -> tuple[DataFrame, DataFrame]:
    batch = events.groupBy("user_id").agg(
        F.count(F.lit(1)).alias("event_count"),
        F.sum("amount").cast(T.DecimalType(22, 2)).alias("amount_sum"),
        F.min("event_ts").alias("first_seen"),
        F.max("event_ts").alias("last_seen"),
    )
    new_state = (
        state.unionByName(batch)
        .groupBy("user_id")
        .agg(
            F.sum("event_count").cast(T.LongType()).alias("event_count"),
            F.sum("amount_sum").cast(T.DecimalType(22, 2)).alias("amount_sum"),
            F.min("first_seen").alias("first_seen"),
            F.max("last_seen").alias("last_seen"),
        )
    )
    return new_state, batch


STAGES: tuple[Stage, ...] = (
    Stage("dedupe", DEDUPE_STATE_SCHEMA, dedupe),
    Stage("user_activity", USER_ACTIVITY_STATE_SCHEMA, user_activity),
)


# --- keyed stages ------------------------------------------------------------------------
# The Spark schemas above as Spark hands them to Arrow (timestamps in UTC); the state keys are
# not null, as the keyed layer requires.

_TS = pa.timestamp("us", tz="UTC")
DEDUPE_OUTPUT_SCHEMA = pa.schema(
    [
        ("event_id", pa.string()),
        ("user_id", pa.string()),
        ("event_ts", _TS),
        ("amount", pa.decimal128(12, 2)),
    ]
)
"""The output of both dedupe stages (``EVENT_SCHEMA``)."""
DEDUPE_KEYED_STATE_SCHEMA = pa.schema(
    [pa.field("event_id", pa.string(), nullable=False), ("event_ts", _TS)]
)


def dedupe_events(input: pa.Table, state: pa.Table) -> KeyedResult:
    """Keyed ``dedupe`` for one batch: the input's events whose id has no state, each once
    (the first delivery in the batch), are the output and the new state rows. Rows without
    an ``event_ts`` are dropped. Events too late and expired ids never get here: the runner
    drops input behind the clock (the newest ``event_ts`` seen) minus ``DEDUPE_RETENTION``
    and expires state rows as old (``DEDUPE_KEYED``'s ``ttl`` and ``event_time``)."""
    events = input.select(DEDUPE_OUTPUT_SCHEMA.names).cast(DEDUPE_OUTPUT_SCHEMA)
    events = events.filter(pc.is_valid(events.column("event_ts")))
    events = events.filter(
        pc.invert(pc.is_in(events.column("event_id"), value_set=state.column("event_id")))
    )
    if events.num_rows:
        order = events.append_column("_row", pa.array(np.arange(events.num_rows)))
        first = order.group_by("event_id", use_threads=False).aggregate([("_row", "min")])
        events = events.take(np.sort(first.column("_row_min").to_numpy()))
    upserts = events.select(DEDUPE_KEYED_STATE_SCHEMA.names)
    return KeyedResult(upserts, DEDUPE_KEYED_STATE_SCHEMA.empty_table().select(["event_id"]),
                       events)


DEDUPE_KEYED = KeyedStage(
    "dedupe",
    key="event_id",
    state_schema=DEDUPE_KEYED_STATE_SCHEMA,
    apply=dedupe_events,
    ttl=StateTtl(DEDUPE_RETENTION, TtlTimeCharacteristic.EVENT_TIME, "event_ts"),
    output_schema=DEDUPE_OUTPUT_SCHEMA,
    event_time="event_ts",
)
USER_ACTIVITY_KEYED = agg.stage(
    "user_activity",
    key="user_id",
    input_schema=DEDUPE_OUTPUT_SCHEMA,
    aggregates={
        "event_count": agg.count(),
        "amount_sum": agg.sum("amount"),  # decimal(12, 2) sums to decimal(22, 2), as in Spark
        "first_seen": agg.min("event_ts"),
        "last_seen": agg.max("event_ts"),
    },
    emit="batch",
)
"""Keyed ``user_activity``: the output is each user's count, amount sum, first and last
``event_ts`` in the batch; the state adds them up (sums and bounds skip nulls, as Spark's
aggregates do)."""
USER_ACTIVITY_OUTPUT_SCHEMA = USER_ACTIVITY_KEYED.output_schema
"""The output of both user_activity stages: this input's per-user aggregates (a count is
never null, in Spark's output too)."""
USER_ACTIVITY_KEYED_STATE_SCHEMA = USER_ACTIVITY_KEYED.state_schema
user_activity_totals = USER_ACTIVITY_KEYED.apply
KEYED_STAGES: tuple[KeyedStage, ...] = (DEDUPE_KEYED, USER_ACTIVITY_KEYED)


# --- silence alerts (event-time timers) ---------------------------------------------------

SILENCE = dt.timedelta(hours=2)
SILENCE_LATENESS = dt.timedelta(days=1)
"""The alerts' allowed lateness: a day lands as batches that span up to a day, whose own
events must be on time; events later than this are dropped (and counted) by the stage."""
SILENT_USERS_STATE_SCHEMA = pa.schema(
    [pa.field("user_id", pa.string(), nullable=False), ("last_seen", _TS)]
)
SILENCE_ALERT_SCHEMA = pa.schema(
    [pa.field("user_id", pa.string(), nullable=False), ("last_seen", _TS), ("silent_at", _TS)]
)


def track_silence(input: pa.Table, state: pa.Table) -> KeyedResult:
    """Keyed ``silent_users`` for one batch. Per user, the batch's events newer than its
    ``last_seen`` in time order: each one ``SILENCE`` or more after the one before (or after
    ``last_seen``) ends a silence, whose alert is the output (the user came back before the
    timer fired). The newest event is the new ``last_seen``; the timer moves to it +
    ``SILENCE``. An event older than the user's newest changes nothing."""
    events = input.filter(pc.is_valid(input.column("event_ts")))
    seen = pa.table({"user_id": events.column("user_id").cast(pa.string()),
                     "event_ts": events.column("event_ts").cast(_TS)})
    seen = seen.join(state.select(SILENT_USERS_STATE_SCHEMA.names), "user_id",
                     join_type="left outer")
    seen = seen.filter(pc.or_kleene(pc.is_null(seen.column("last_seen")),
                                    pc.greater(seen.column("event_ts"),
                                               seen.column("last_seen"))))
    seen = pa.table({"user_id": seen.column("user_id"), "last_seen": seen.column("event_ts")})
    both = pa.concat_tables([state.select(SILENT_USERS_STATE_SCHEMA.names).cast(seen.schema),
                             seen]).sort_by([("user_id", "ascending"), ("last_seen", "ascending")])
    users = both.column("user_id").combine_chunks()
    ts = both.column("last_seen").cast(pa.int64()).to_numpy()
    same_user = np.r_[False, pc.equal(users[1:], users[:-1]).to_numpy(zero_copy_only=False)] \
        if len(both) > 1 else np.zeros(len(both), bool)
    step = np.r_[0, np.diff(ts)] if len(ts) else ts
    silence = int(SILENCE / dt.timedelta(microseconds=1))
    ends = np.flatnonzero(same_user & (step >= silence))  # rows that end a silence
    newest = np.r_[~same_user[1:], True] if len(both) else np.zeros(0, bool)

    def at(rows: np.ndarray) -> pa.Array:
        return pa.array(ts[rows], pa.int64()).cast(_TS)

    alerts = pa.table({"user_id": users.take(pa.array(ends - 1)), "last_seen": at(ends - 1),
                       "silent_at": pc.add(at(ends - 1), pa.scalar(SILENCE))},
                      schema=SILENCE_ALERT_SCHEMA)
    rows = np.flatnonzero(newest)
    upserts = pa.table({"user_id": users.take(pa.array(rows)), "last_seen": at(rows)},
                       schema=SILENT_USERS_STATE_SCHEMA)
    timers = pa.table({"user_id": upserts.column("user_id"),
                       "timer": pc.add(upserts.column("last_seen"), pa.scalar(SILENCE))})
    old = pa.table({"user_id": state.column("user_id"),
                    "timer": pc.add(state.column("last_seen"), pa.scalar(SILENCE))})
    moved = old.join(timers, ["user_id", "timer"], join_type="left anti")
    return KeyedResult(upserts, upserts.select(["user_id"]).slice(0, 0), alerts,
                       timers=timers, deleted_timers=moved.select(["user_id", "timer"]))


def alert_silence(fired: pa.Table, state: pa.Table) -> KeyedResult:
    """A user's timer fired: no event for ``SILENCE`` after its ``last_seen``. The alert is
    the output; the user's state (and timer) goes until its next event re-arms it."""
    newest = fired.group_by("user_id", use_threads=False).aggregate([("timer", "max")])
    due = state.join(newest, "user_id", join_type="inner")
    silent_at = pc.add(due.column("last_seen"), pa.scalar(SILENCE))
    due = due.append_column("silent_at", silent_at).filter(
        pc.less_equal(silent_at, due.column("timer_max")))
    alerts = due.select(SILENCE_ALERT_SCHEMA.names).cast(SILENCE_ALERT_SCHEMA)
    return KeyedResult(SILENT_USERS_STATE_SCHEMA.empty_table(), alerts.select(["user_id"]),
                       alerts)


SILENT_USERS_KEYED = KeyedStage(
    "silent_users",
    key="user_id",
    state_schema=SILENT_USERS_STATE_SCHEMA,
    apply=track_silence,
    on_timer=alert_silence,
    time_mode=TimeMode.EVENT_TIME,
    watermark=Watermark(allowed_lateness=SILENCE_LATENESS),
    event_time="event_ts",
    input=SOURCE,
    output_schema=SILENCE_ALERT_SCHEMA,
)
"""Users seen and not yet silent for ``SILENCE`` (keyed state, one timer each); output: one
alert per silence, when the watermark passes it."""
