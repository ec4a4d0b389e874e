"""The click-events pipeline: daily partitions of generated click events, deduplicated over a
two-day window and aggregated per user, with a daily report per day. Its stages are keyed
stages (state per event id and per user, checkpointed incrementally).

No ``from __future__ import annotations`` here: Dagster reads the ``config`` parameter's
annotation at definition time.
"""

from collections.abc import Sequence

import dagster as dg
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from pipelines import (
    FileSource,
    KeyedStage,
    ParquetSink,
    SparkWriterSink,
    Stage,
    StatefulPipeline,
)
from pipelines.examples.click_events.events import EVENT_ARROW_SCHEMA, generate_day
from pipelines.examples.click_events.stages import KEYED_STAGES, SILENT_USERS_KEYED
from sensors import pipeline_definitions

__all__ = [
    "DAILY_PARTITIONS",
    "FIRST_PARTITION",
    "NAME",
    "LandingConfig",
    "click_events_asset",
    "click_events_definitions",
    "click_events_pipeline",
    "report_columns",
]

NAME = "user_activity"
FIRST_PARTITION = "2026-10-01"
DAILY_PARTITIONS = dg.DailyPartitionsDefinition(start_date=FIRST_PARTITION, timezone="UTC")


class LandingConfig(dg.Config):
    """The generator that stands in for a real source."""

    batches_per_day: int = 4
    events_per_batch: int = 2_000
    users: int = 500
    seed: int = 7


def click_events_asset(
    landing_dir: str, storage_options: dict | None = None
) -> dg.AssetsDefinition:
    """``click_events``: each day's events landed as several Parquet batches in
    ``<landing_dir>/date=<day>/`` (generated here; a real source in production)."""

    @dg.asset(
        name="click_events",
        partitions_def=DAILY_PARTITIONS,
        backfill_policy=dg.BackfillPolicy.single_run(),
        group_name=NAME,
        kinds={"parquet"},
        description="Click events landed as several Parquet batches per day, with duplicate "
        "deliveries and late events (generated here; a real source in production).",
    )
    def click_events(
        context: dg.AssetExecutionContext, config: LandingConfig
    ) -> dg.MaterializeResult:
        days = []
        for partition in context.partition_keys:
            day = generate_day(
                landing_dir,
                partition,
                batches=config.batches_per_day,
                events_per_batch=config.events_per_batch,
                users=config.users,
                seed=config.seed,
                storage_options=storage_options,
            )
            context.log.info(f"landed {partition}: {day.batches} batches, {day.rows} events")
            days.append(day)
        return dg.MaterializeResult(
            metadata={
                "landing_dir": dg.MetadataValue.path(landing_dir),
                "batches": sum(d.batches for d in days),
                "rows": sum(d.rows for d in days),
                "duplicate_deliveries": sum(d.duplicates for d in days),
                "late_events": sum(d.late_events for d in days),
            }
        )

    return click_events


def report_columns(state: DataFrame, partition: str) -> DataFrame:
    """The daily report: each user's activity as of the end of ``partition``."""
    day = F.lit(partition).cast("date")
    return state.withColumn("active_on_day", F.to_date("last_seen") == day)


def click_events_pipeline(
    landing_dir: str,
    report_dir: str,
    *,
    checkpoint_interval: int = 2,
    max_retained_checkpoints: int = 3,
    storage_options: dict | None = None,
    stages: Sequence[Stage | KeyedStage] = KEYED_STAGES,
    alerts_url: str | None = None,
) -> StatefulPipeline:
    """The pipeline over ``<landing_dir>/date=<day>/`` (any fsspec URL; ``storage_options``
    are its non-secret fsspec options), reporting into ``report_dir`` (a Spark path).
    ``stages``: the keyed stages (``KEYED_STAGES``), or the DataFrame stages that compute
    the same (``STAGES``). ``alerts_url``: add the ``silent_users`` stage (an alert per user
    silent for 2 hours, ``SILENT_USERS_KEYED``) and its alerts as Parquet under this URL."""
    alerts = []
    if alerts_url is not None:
        stages = (*stages, SILENT_USERS_KEYED)
        alerts = [ParquetSink(name="silence_alerts", stage=SILENT_USERS_KEYED.name,
                              url=alerts_url, partition_column="date",
                              storage_options=dict(storage_options or {}))]
    return StatefulPipeline(
        name=NAME,
        stages=stages,
        source=FileSource(
            url=f"{landing_dir.rstrip('/')}/date={{partition}}",
            schema=EVENT_ARROW_SCHEMA,
            suffix=".parquet",
            storage_options=dict(storage_options or {}),
        ),
        partitions=DAILY_PARTITIONS,
        sinks=[
            SparkWriterSink(
                name="daily_report",
                stage="user_activity",
                of="state",
                path=report_dir,
                partition_column="report_date",
                transform=report_columns,
            ),
            *alerts,
        ],
        checkpoint_interval=checkpoint_interval,
        max_retained_checkpoints=max_retained_checkpoints,
        description="Per-user event count, amount, first and last seen over deduplicated "
        "click events: the stateful stages' state, checkpointed through the checkpoint "
        "storage's worker view.",
        deps=[click_events_asset(landing_dir, storage_options)],
    )


def click_events_definitions(landing_dir: str, report_dir: str, **options) -> dg.Definitions:
    """The pipeline's definitions (``options`` go to ``click_events_pipeline``)."""
    return pipeline_definitions(click_events_pipeline(landing_dir, report_dir, **options))
