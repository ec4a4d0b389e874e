"""The click-events example's stages: plain PySpark functions ``(state, input) -> (new state,
output)``, testable without Dagster or checkpoints.

- ``dedupe``: state = the ids of events seen within ``DEDUPE_RETENTION`` of the watermark
  (the newest event time seen). Output = each event once; events older than the retention
  window are dropped as too late, since their duplicates could no longer be recognised.
- ``user_activity``: state = per-user event count, amount sum, first and last seen. Output =
  this input's per-user aggregates.

Amounts are decimals, so sums are exact whatever the partitioning: a recovered run and an
uninterrupted one agree to the cent.
"""

import datetime as dt

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from pipelines import Stage

__all__ = [
    "DEDUPE_RETENTION",
    "DEDUPE_STATE_SCHEMA",
    "EVENT_SCHEMA",
    "STAGES",
    "USER_ACTIVITY_STATE_SCHEMA",
    "dedupe",
    "user_activity",
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
    state: DataFrame, events: DataFrame, retention: dt.timedelta = DEDUPE_RETENTION
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


def user_activity(state: DataFrame, events: DataFrame) -> tuple[DataFrame, DataFrame]:
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
