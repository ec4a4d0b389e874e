"""The click-events example's stages: plain PySpark functions ``(input, state) -> (new state,
output)``, testable without Dagster or checkpoints.

- ``dedupe``: state = the ids of events seen within ``DEDUPE_RETENTION`` of the watermark
  (the newest event time seen). Output = each event once; events older than the retention
  window are dropped as too late, since their duplicates could no longer be recognised.
- ``user_activity``: state = per-user event count, amount sum, first and last seen. Output =
  this input's per-user aggregates.

Amounts are decimals, so sums are exact whatever the partitioning: a recovered run and an
uninterrupted one agree to the cent.

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

from pipelines import KeyedResult, KeyedStage, Stage, StateTtl, TtlTimeCharacteristic, agg

__all__ = [
    "DEDUPE_KEYED",
    "DEDUPE_KEYED_STATE_SCHEMA",
    "DEDUPE_OUTPUT_SCHEMA",
    "DEDUPE_RETENTION",
    "DEDUPE_STATE_SCHEMA",
    "EVENT_SCHEMA",
    "KEYED_STAGES",
    "STAGES",
    "USER_ACTIVITY_KEYED",
    "USER_ACTIVITY_KEYED_STATE_SCHEMA",
    "USER_ACTIVITY_OUTPUT_SCHEMA",
    "USER_ACTIVITY_STATE_SCHEMA",
    "dedupe",
    "dedupe_events",
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
