"""Page views per hour: user sessions that expire after ``SESSION_GAP`` without a view (per-key
expiry: a session leaves the state once the newest view seen is more than the gap past its last
view, and is emitted as output), and a running view count per page.

Everything is on fsspec URLs: the hourly landing directories ``<base>/landing/hour=<key>/``,
the checkpoints (the code location's storage) and the sinks ``<base>/sessions`` (closed
sessions, per hour) and ``<base>/page_counts`` (the counts at the end of each hour). Its test
runs all of them on S3 (moto's server).
"""

import contextlib
import datetime as dt
import random

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from checkpoint_storage import url_to_fs
from pipelines import SOURCE, FileSource, ParquetSink, Stage, StatefulPipeline
from sensors import pipeline_definitions

__all__ = [
    "HOURLY_PARTITIONS",
    "NAME",
    "PAGE_VIEW_SCHEMA",
    "SESSION_GAP",
    "STAGES",
    "land_hour",
    "page_counts",
    "page_views_definitions",
    "page_views_pipeline",
    "sessions",
]

NAME = "page_views"
HOURLY_PARTITIONS = dg.HourlyPartitionsDefinition(start_date="2026-10-01-00:00", timezone="UTC")
SESSION_GAP = dt.timedelta(minutes=30)
PAGE_VIEW_SCHEMA = pa.schema(
    [
        pa.field("page_id", pa.string()),
        pa.field("user_id", pa.string()),
        pa.field("viewed_at", pa.timestamp("us", tz="UTC")),
    ]
)
SESSION_STATE_SCHEMA = T.StructType(
    [
        T.StructField("user_id", T.StringType()),
        T.StructField("session_start", T.TimestampType()),
        T.StructField("last_view", T.TimestampType()),
        T.StructField("views", T.LongType()),
    ]
)
PAGE_COUNT_SCHEMA = T.StructType(
    [T.StructField("page_id", T.StringType()), T.StructField("views", T.LongType())]
)


def sessions(
    views: DataFrame, state: DataFrame, gap: dt.timedelta = SESSION_GAP
) -> tuple[DataFrame, DataFrame]:
    """Open sessions per user in, open sessions and the sessions that closed out: a view more
    than ``gap`` after the previous one starts a new session; a session whose last view is
    more than ``gap`` before the newest view seen (the watermark) is closed."""
    seconds = int(gap.total_seconds())
    fragments = state.unionByName(
        views.select(
            "user_id",
            F.col("viewed_at").alias("session_start"),
            F.col("viewed_at").alias("last_view"),
            F.lit(1).cast("long").alias("views"),
        )
    )
    by_user = Window.partitionBy("user_id").orderBy("session_start", "last_view")
    earlier = by_user.rowsBetween(Window.unboundedPreceding, -1)
    starts = F.col("session_start").cast("long") > F.max(F.col("last_view").cast("long")).over(
        earlier
    ) + F.lit(seconds)
    merged = (
        fragments.withColumn("new", F.coalesce(starts, F.lit(True)).cast("int"))
        .withColumn("session", F.sum("new").over(by_user.rowsBetween(Window.unboundedPreceding, 0)))
        .groupBy("user_id", "session")
        .agg(
            F.min("session_start").alias("session_start"),
            F.max("last_view").alias("last_view"),
            F.sum("views").cast("long").alias("views"),
        )
        .drop("session")
    )
    watermark = merged.agg(F.max("last_view")).first()[0]
    if watermark is None:
        return state, state.limit(0).withColumnRenamed("last_view", "session_end")
    horizon = F.lit(watermark.astimezone(dt.UTC) - gap).cast(T.TimestampType())
    merged = merged.localCheckpoint(eager=True)
    still_open = merged.filter(F.col("last_view") >= horizon).coalesce(
        int(state.sparkSession.conf.get("spark.sql.shuffle.partitions"))
    )
    closed = merged.filter(F.col("last_view") < horizon).withColumnRenamed(
        "last_view", "session_end"
    )
    return still_open, closed


def page_counts(views: DataFrame, state: DataFrame) -> tuple[DataFrame, DataFrame]:
    """The running view count per page; output: this batch's counts."""
    batch = views.groupBy("page_id").agg(F.count(F.lit(1)).cast("long").alias("views"))
    new_state = (
        state.unionByName(batch).groupBy("page_id").agg(F.sum("views").cast("long").alias("views"))
    )
    return new_state, batch


STAGES = (
    Stage("sessions", SESSION_STATE_SCHEMA, sessions, input=SOURCE),
    Stage("page_counts", PAGE_COUNT_SCHEMA, page_counts, input=SOURCE),
)


def land_hour(
    base_url: str,
    partition: str,
    *,
    batches: int = 3,
    views_per_batch: int = 500,
    users: int = 50,
    pages: int = 20,
    seed: int = 0,
    storage_options: dict | None = None,
) -> int:
    """Write ``partition``'s page views as ``batches`` Parquet files (replacing an earlier
    landing of the hour); returns the number of views. Same arguments, same bytes. Half of the
    users are active in even hours, the other half in odd ones, so sessions end."""
    start = HOURLY_PARTITIONS.time_window_for_partition_key(partition).start
    rng = random.Random(f"{seed}:{partition}")
    fs, path = url_to_fs(f"{base_url.rstrip('/')}/landing/hour={partition}", storage_options)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(path, recursive=True)
    fs.makedirs(path, exist_ok=True)
    span = 3600 / max(batches, 1)
    audience = (start.hour % 2) * (users // 2)
    for index in range(batches):
        rows = [
            {
                "page_id": f"page-{rng.randrange(pages):03d}",
                "user_id": f"user-{audience + rng.randrange(max(users // 2, 1)):04d}",
                "viewed_at": start + dt.timedelta(seconds=span * index + rng.random() * span),
            }
            for _ in range(views_per_batch)
        ]
        with fs.open(f"{path}/batch-{index:05d}.parquet", "wb") as f:
            pq.write_table(pa.Table.from_pylist(rows, schema=PAGE_VIEW_SCHEMA), f)
    if batches == 0:
        fs.touch(f"{path}/_SUCCESS")
    return batches * views_per_batch


def page_views_pipeline(
    base_url: str,
    *,
    storage_options: dict | None = None,
    storage_options_from_env: dict | None = None,
    checkpoint_interval: int = 2,
    max_retained_checkpoints: int = 3,
) -> StatefulPipeline:
    """The pipeline over ``<base_url>/landing/hour=<key>/``, writing ``<base_url>/sessions``
    and ``<base_url>/page_counts``."""
    base = base_url.rstrip("/")
    fsspec_options = {
        "storage_options": dict(storage_options or {}),
        "storage_options_from_env": dict(storage_options_from_env or {}),
    }
    return StatefulPipeline(
        name=NAME,
        stages=STAGES,
        source=FileSource(
            url=f"{base}/landing/hour={{partition}}", schema=PAGE_VIEW_SCHEMA, **fsspec_options
        ),
        partitions=HOURLY_PARTITIONS,
        sinks=[
            ParquetSink(
                name="sessions", stage="sessions", url=f"{base}/sessions", partition_column="hour",
                **fsspec_options,
            ),
            ParquetSink(
                name="page_counts", stage="page_counts", of="state",
                url=f"{base}/page_counts", partition_column="hour", **fsspec_options,
            ),
        ],  # fmt: skip
        checkpoint_interval=checkpoint_interval,
        max_retained_checkpoints=max_retained_checkpoints,
        description="Open page-view sessions per user (expiring after 30 minutes without a "
        "view) and the running view count per page.",
    )


def page_views_definitions(base_url: str, **options) -> dg.Definitions:
    """The pipeline's definitions (``options`` go to ``page_views_pipeline``)."""
    return pipeline_definitions(page_views_pipeline(base_url, **options))
