"""Helpers shared by the pipeline, sensor and acceptance tests."""

import datetime as dt
from pathlib import Path

import dagster as dg
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
)

from pipelines.assets import click_events, user_activity
from pipelines.events import batch_urls
from pipelines.stages import EVENT_SCHEMA, STAGES, empty_state
from resources import CheckpointStorageResource, DataLakeResource, SparkResource

SMALL_LANDING = {"batches_per_day": 3, "events_per_batch": 300, "users": 30, "seed": 1}


class InjectedFault(Exception):
    """Raised by a test's fault hook."""


class NoSpark:
    """Stands in for the SparkSession where no Spark work may happen."""

    def __getattr__(self, name):
        raise AssertionError(f"Spark was used: spark.{name}")


def rows(df) -> list[tuple]:
    return sorted(tuple(r) for r in df.collect())


def state_rows(states: dict) -> dict[str, list[tuple]]:
    return {name: rows(df) for name, df in states.items()}


def apply_batch_by_batch(spark, landing: str, days) -> tuple[dict, list[tuple]]:
    """Reference: the stages applied to every batch once, in order, without the runner or
    checkpoints; returns the final state rows and the expected report rows of ``days``."""
    states = {stage.name: empty_state(spark, stage) for stage in STAGES}
    report = []
    for day in days:
        for url in batch_urls(landing, day):
            data = spark.read.schema(EVENT_SCHEMA).parquet(url)
            for stage in STAGES:
                new_state, data = stage.apply(states[stage.name], data)
                states[stage.name] = new_state.localCheckpoint(eager=True)
                data = data.localCheckpoint(eager=True)
        date = dt.date.fromisoformat(day)
        for r in states["user_activity"].collect():
            active = r["last_seen"].astimezone(dt.UTC).date() == date
            report.append((*tuple(r), active, date))
    return state_rows(states), sorted(report)


def resources_for(
    tmp_path: Path,
    *,
    spark_resource=None,
    storage: CheckpointStorageResource | None = None,
    **storage_options,
) -> dict:
    """The code location's resources on tmp-dir storage and local[2] Spark."""
    return {
        "spark": spark_resource or SparkResource(master="local[2]"),
        "checkpoint_storage": storage
        or CheckpointStorageResource(
            checkpoint_dir=str(tmp_path / "checkpoints"),
            savepoint_dir=str(tmp_path / "savepoints"),
            **storage_options,
        ),
        "lake": DataLakeResource(
            landing_dir=str(tmp_path / "landing"), report_dir=str(tmp_path / "reports")
        ),
    }


def materialize_range(
    instance, resources, first: str, last: str, *, landing: dict = SMALL_LANDING, **config
):
    """Land and process ``first``..``last`` in one run (a single-run backfill); ``config`` is
    the stateful asset's run config (restore_from, restore_mode)."""
    return dg.materialize(
        [click_events, user_activity],
        instance=instance,
        resources=resources,
        tags={ASSET_PARTITION_RANGE_START_TAG: first, ASSET_PARTITION_RANGE_END_TAG: last},
        run_config={
            "ops": {
                "click_events": {"config": landing},
                "user_activity": {"config": config},
            }
        },
        raise_on_error=False,
    )
