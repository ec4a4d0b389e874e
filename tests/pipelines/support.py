"""Helpers shared by the pipeline, sensor and acceptance tests."""

import datetime as dt
import sys
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import cloudpickle
from typer.testing import CliRunner

from checkpoint_storage.cli import build_app
from pipelines import KeyedResult, StatefulPipeline, empty_state
from pipelines.cli import register
from pipelines.examples.click_events import STAGES, click_events_pipeline
from pipelines.examples.click_events.events import batch_urls
from pipelines.examples.click_events.stages import EVENT_SCHEMA
from resources import CheckpointStorageResource, SparkResource
from sensors import build_stateful_assets, pipeline_definitions

RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"

SMALL_LANDING = {"batches_per_day": 3, "events_per_batch": 300, "users": 30, "seed": 1}


class InjectedFault(Exception):
    """Raised by a test's fault hook."""


class NoSpark:
    """Stands in for the SparkSession where no Spark work may happen."""

    def __getattr__(self, name):
        raise AssertionError(f"Spark was used: spark.{name}")


def run_read_cli(*args: str):
    """``checkpoints read ARGS`` in-process: the CLI without installed plugins, with the
    pipelines plugin registered."""
    app = build_app(plugins=False)
    register(app)
    return CliRunner().invoke(app, ["read", *args])


def rows(df) -> list[tuple]:
    return sorted(tuple(r) for r in df.collect())


def state_rows(states: dict) -> dict[str, list[tuple]]:
    return {name: rows(df) for name, df in states.items()}


def apply_batch_by_batch(spark, landing: str, days) -> tuple[dict, list[tuple]]:
    """Reference: the click-events stages applied to every batch once, in order, without the
    runner or checkpoints; returns the final state rows and the expected report rows of
    ``days`` (the report's columns, then ``report_date`` as read back with partition
    discovery)."""
    states = {stage.name: empty_state(spark, stage) for stage in STAGES}
    report = []
    for day in days:
        for url in batch_urls(landing, day):
            data = spark.read.schema(EVENT_SCHEMA).parquet(url)
            for stage in STAGES:
                new_state, data = stage.apply(data, states[stage.name])
                states[stage.name] = new_state.localCheckpoint(eager=True)
                data = data.localCheckpoint(eager=True)
        date = dt.date.fromisoformat(day)
        for r in states["user_activity"].collect():
            active = r["last_seen"].astimezone(dt.UTC).date() == date
            report.append((*tuple(r), active, date))
    return state_rows(states), sorted(report)


def click_pipeline(tmp_path: Path, **options) -> StatefulPipeline:
    """The click-events pipeline landing in ``tmp_path/landing`` and reporting to
    ``tmp_path/reports``; ``options`` go to ``click_events_pipeline``
    (``checkpoint_interval``, ``max_retained_checkpoints``)."""
    return click_events_pipeline(str(tmp_path / "landing"), str(tmp_path / "reports"), **options)


def resources_for(
    tmp_path: Path,
    *,
    spark_resource=None,
    storage: CheckpointStorageResource | None = None,
    **storage_options,
) -> dict:
    """The code location's resources (``spark``, ``checkpoint_storage``) on tmp-dir storage
    and local[2] Spark; ``storage_options`` are CheckpointStorageResource fields."""
    return {
        "spark": spark_resource or SparkResource(master="local[2]"),
        "checkpoint_storage": storage
        or CheckpointStorageResource(
            checkpoint_dir=str(tmp_path / "checkpoints"),
            savepoint_dir=str(tmp_path / "savepoints"),
            **storage_options,
        ),
    }


def click_defs(tmp_path: Path, *, resources: dict | None = None, **options) -> dg.Definitions:
    """The click-events pipeline's definitions (``click_pipeline(tmp_path, **options)``)
    merged with ``resources`` (default: ``resources_for(tmp_path)``)."""
    return dg.Definitions.merge(
        pipeline_definitions(click_pipeline(tmp_path, **options)),
        dg.Definitions(resources=resources or resources_for(tmp_path)),
    )


def materialize_range(
    instance,
    resources,
    first: str,
    last: str,
    *,
    pipeline: StatefulPipeline,
    landing: dict | None = SMALL_LANDING,
    **config,
):
    """Land and process ``first``..``last`` in one run (a single-run backfill) of
    ``[*pipeline.deps, stateful asset]``; ``landing`` is the run config of each of the
    pipeline's deps (the click events' LandingConfig; None: no config), ``config`` the
    stateful asset's (restore_from, restore_mode)."""
    ops = {pipeline.name: {"config": config}}
    if landing is not None:
        ops |= {dep.op.name: {"config": landing} for dep in pipeline.deps}
    return dg.materialize(
        [*pipeline.deps, build_stateful_assets(pipeline)],
        instance=instance,
        resources=resources,
        tags={RANGE_START_TAG: first, RANGE_END_TAG: last},
        run_config={"ops": ops},
        raise_on_error=False,
    )


# A keyed stage shared by the keyed runner tests and the reliability scenarios: orders per
# customer, their count and total.
TOTALS = pa.schema([pa.field("customer", pa.string(), nullable=False),
                    ("orders", pa.int64()), ("total", pa.int64())])


def customer_totals(input: pa.Table, state: pa.Table) -> KeyedResult:
    batch = input.group_by("customer").aggregate([([], "count_all"), ("amount", "sum")])
    joined = batch.join(state, "customer", join_type="left outer")
    upserts = pa.table({
        "customer": joined.column("customer"),
        "orders": pc.add(joined.column("count_all"), pc.fill_null(joined.column("orders"), 0)),
        "total": pc.add(joined.column("amount_sum"), pc.fill_null(joined.column("total"), 0)),
    })
    return KeyedResult(upserts, pa.table({"customer": pa.array([], pa.string())}), upserts)


# by value: Spark's Python workers need not import the tests package
cloudpickle.register_pickle_by_value(sys.modules[__name__])
