"""Page views per hour: user sessions that close after ``SESSION_GAP`` without a view, and a
running view count per page.

``sessions`` is a keyed stage with an event-time timer per open session, at its last view +
the gap: when the watermark (the newest view seen minus ``VIEW_LATENESS``) reaches it, the
session is emitted as output and leaves the state. A batch costs the users in it and the
timers that fire, not the whole state.

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

from checkpoint_storage import url_to_fs
from pipelines import FileSource, ParquetSink, StatefulPipeline
from pipelines.examples.page_views.stages import (
    NAME,
    PAGE_VIEW_SCHEMA,
    STAGES,
)
from sensors import pipeline_definitions

__all__ = [
    "HOURLY_PARTITIONS",
    "land_hour",
    "page_views_definitions",
    "page_views_pipeline",
]

HOURLY_PARTITIONS = dg.HourlyPartitionsDefinition(start_date="2026-10-01-00:00", timezone="UTC")


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
