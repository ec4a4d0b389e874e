"""Helpers shared by the pipeline, sensor and acceptance tests."""

import datetime as dt
import random
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import cloudpickle
from pyspark.sql import types as T
from typer.testing import CliRunner

from checkpoint_storage import FileSystemCheckpointStorage, JobID
from checkpoint_storage.cli import build_app
from pipelines import (
    FullSnapshotPolicy,
    KeyedResult,
    KeyedStage,
    ParquetSink,
    Source,
    StatefulPipeline,
    StatefulRunner,
    empty_state,
)
from pipelines.cli import register
from pipelines.examples.click_events import STAGES, click_events_pipeline
from pipelines.examples.click_events.events import batch_urls
from pipelines.examples.click_events.stages import EVENT_SCHEMA
from pipelines.keyed import KeyedStateChain, KeyedStateLayout, KeyGroupRange
from pipelines.keyed._key_groups import compute_key_group_range_for_operator_index
from pipelines.keyed._task import KeyedStageTask
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


def run_cli(*args: str):
    """``checkpoints ARGS`` in-process: the built-in commands, without plugins; an exception
    other than the exit is raised."""
    result = CliRunner().invoke(build_app(plugins=False), list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


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


# The keyed per-customer totals pipeline of the keyed runner tests, also run by the keyed
# fault driver, the stall scenarios and benchmarks/keyed_retention.py.
PARTITIONS = dg.StaticPartitionsDefinition(["p1", "p2", "p3"])
BATCHES = 4
ORDER_SCHEMA = T.StructType([
    T.StructField("customer", T.StringType()),
    T.StructField("amount", T.LongType()),
])


@dataclass(frozen=True)
class GeneratedOrders(Source):
    """Orders made up from the batch id: the same batch always has the same rows."""

    customers: int = 40
    rows_per_batch: int = 60

    def batches(self, spark, partition):
        return [f"{partition}-{i:03d}" for i in range(BATCHES)]

    def read(self, spark, partition, batch):
        return spark.createDataFrame(self.rows(batch), ORDER_SCHEMA)

    def rows(self, batch: str) -> list[tuple[str, int]]:
        rng = random.Random(batch)
        return [(f"c{rng.randrange(self.customers)}", rng.randrange(1, 100))
                for _ in range(self.rows_per_batch)]


SOURCE = GeneratedOrders()


def totals_pipeline(tmp_path: Path, **options) -> StatefulPipeline:
    options = {"checkpoint_interval": 2, "max_parallelism": 16,
               "full_snapshot": FullSnapshotPolicy(every=3, min_bytes=0)} | options
    return StatefulPipeline(
        name="keyed_totals",
        stages=[KeyedStage("totals", "customer", TOTALS, customer_totals)],
        source=SOURCE,
        partitions=PARTITIONS,
        sinks=[ParquetSink(name="totals_state", stage="totals", of="state",
                             url=str(tmp_path / "sink"))],
        **options,
    )


def expected(partitions: list[str], batches: int = BATCHES) -> dict[str, tuple[int, int]]:
    """Per customer (orders, total) after ``batches`` batches of each partition."""
    orders, total = Counter(), Counter()
    for partition in partitions:
        for batch in SOURCE.batches(None, partition)[:batches]:
            for customer, amount in SOURCE.rows(batch):
                orders[customer] += 1
                total[customer] += amount
    return {c: (orders[c], total[c]) for c in orders}


def storage_of(tmp_path: Path, **options) -> FileSystemCheckpointStorage:
    return FileSystemCheckpointStorage(
        str(tmp_path / "checkpoints"), savepoint_dir=str(tmp_path / "savepoints"),
        **({"file_state_size_threshold": 0} | options))


def state_of(runner: StatefulRunner, metadata=None) -> dict[str, tuple[int, int]]:
    metadata = metadata or runner.store.latest().metadata
    frame = runner.restore_states(metadata)["totals"]
    rows = frame.collect()
    assert len(rows) == len({r["customer"] for r in rows}), "a key is in the state twice"
    return {r["customer"]: (r["orders"], r["total"]) for r in rows}


def shared_files(tmp_path: Path, runner: StatefulRunner) -> set[str]:
    shared = tmp_path / "checkpoints" / str(runner.job_id) / "shared"
    return {str(p) for p in shared.rglob("*") if p.is_file()}


def referenced_files(runner: StatefulRunner) -> set[str]:
    return {h.path for c in runner.store.all() for h in c.metadata.all_handles()
            if hasattr(h, "path")}


# Keyed state of users' clicks, for the keyed state store tests.
SCHEMA = pa.schema([("user", pa.string()), ("clicks", pa.int64()),
                    ("seen", pa.timestamp("us", "UTC"))])
MAX_PARALLELISM = 8
LAYOUT = KeyedStateLayout(("user",), SCHEMA, MAX_PARALLELISM)
ALL = KeyGroupRange(0, MAX_PARALLELISM - 1)
T0 = dt.datetime(2026, 3, 10, tzinfo=dt.UTC)
NO_KEYS = pa.table({"user": pa.array([], pa.string())})


def clicks_table(model: dict[str, int]) -> pa.Table:
    keys = sorted(model)
    return pa.table({"user": keys, "clicks": [model[k] for k in keys],
                     "seen": [T0 + dt.timedelta(seconds=model[k]) for k in keys]}, schema=SCHEMA)


def as_model(table: pa.Table) -> dict[str, int]:
    users, clicks = table.column("user").to_pylist(), table.column("clicks").to_pylist()
    assert len(set(users)) == len(users), "a key is in the state twice"
    return dict(zip(users, clicks, strict=True))


def store_state(store) -> dict[str, int]:
    table = pa.Table.from_batches(list(store.sorted_batches()), store.layout.stored_schema
                                  .append(pa.field("_key_group", pa.int16())))
    groups = table.column("_key_group").to_numpy()
    assert (store.layout.key_groups_of(table) == groups).all(), "rows under other key groups"
    assert (np.diff(groups) >= 0).all(), "rows out of key group order"
    return as_model(table)


class Job:
    """A checkpoint storage job on local disk and a stream factory of its checkpoint 1."""

    def __init__(self, root: Path) -> None:
        # threshold 0: every state stream becomes a file in shared/, as large state would
        storage = FileSystemCheckpointStorage(str(root / "checkpoints"),
                                              file_state_size_threshold=0)
        self.access = storage.create_checkpoint_storage(JobID.generate())
        self.access.initialize_base_locations()
        self.location = self.access.initialize_location_for_checkpoint(1)
        self.factory = self.access.resolve_checkpoint_storage_location(
            1, self.location.location_reference)


def keyed_batch_task(tmp_path: Path, stage: KeyedStage, output: pa.Schema,
                     max_parallelism: int, parallelism: int, *,
                     storage: FileSystemCheckpointStorage | None = None,
                     **task_options) -> KeyedStageTask:
    """Range 0's batch task of ``stage`` over ``parallelism`` empty chains, writing checkpoint
    1 of a new job in ``storage`` (default: a new one under ``tmp_path``), its local stores
    under ``tmp_path``."""
    storage = storage or FileSystemCheckpointStorage(str(tmp_path / "checkpoints"))
    job_id = JobID.generate()
    access = storage.create_checkpoint_storage(job_id)
    access.initialize_base_locations()
    location = access.initialize_location_for_checkpoint(1)
    chains = tuple(KeyedStateChain(compute_key_group_range_for_operator_index(
        max_parallelism, parallelism, i), None) for i in range(parallelism))
    return KeyedStageTask(storage, str(job_id), 1, location.location_reference, stage, output,
                          max_parallelism, parallelism, chains, 0,
                          local_dir=str(tmp_path / "local"), **task_options)


def deletes(keys) -> pa.Table:
    """A keyed state store's deletes of these users."""
    return pa.table({"user": pa.array(sorted(keys), pa.string())})


# by value: Spark's Python workers need not import the tests package

CLICK_COUNT_STATE = pa.schema([pa.field("user", pa.string(), nullable=False),
                               ("clicks", pa.int64())])


def count_clicks(input: pa.Table, state: pa.Table) -> KeyedResult:
    """A keyed stage's function: clicks per user, the running count its output."""
    counts = input.group_by("user").aggregate([([], "count_all")])
    joined = counts.join(state, "user", join_type="left outer")
    clicks = pc.add(joined.column("count_all"), pc.fill_null(joined.column("clicks"), 0))
    upserts = pa.table({"user": joined.column("user"), "clicks": clicks})
    return KeyedResult(upserts, pa.table({"user": pa.array([], pa.string())}), upserts)


cloudpickle.register_pickle_by_value(sys.modules[__name__])


def py4j_calls(monkeypatch) -> list[str]:
    """The py4j round trips of this thread from now on (not py4j's garbage collection's)."""
    import threading

    from py4j import clientserver

    calls = []
    send = clientserver.ClientServerConnection.send_command
    caller = threading.get_ident()

    def counted(connection, command):
        if threading.get_ident() == caller:
            calls.append(command.split("\n", 1)[0])
        return send(connection, command)

    monkeypatch.setattr(clientserver.ClientServerConnection, "send_command", counted)
    return calls


def small_click_events_checkpoint(spark, work: Path, day: str) -> str:
    """The pointer of a checkpoint of one small day of click events (one batch of 50 events
    over 5 users), run under ``work``."""
    from pipelines.examples.click_events import generate_day

    generate_day(str(work / "landing"), day, batches=1, events_per_batch=50, users=5)
    pipeline = click_events_pipeline(str(work / "landing"), str(work / "reports"))
    storage = FileSystemCheckpointStorage(str(work / "checkpoints"))
    (result,) = StatefulRunner(spark, storage, pipeline).run([day])
    return result.checkpoint.pointer


# Every proxy lives as long as the process: a buffer it allocated is freed through it, maybe
# long after its block (a store kept open, a reader's cycle collected later), and a free
# through a pool that is gone crashes the process (SIGSEGV, as one did CI's test run).
_POOLS: list[pa.MemoryPool] = []


@contextmanager
def counting_pool() -> Iterator[pa.MemoryPool]:
    """A proxy of the default memory pool, the default while the block runs, for a measure of
    what Arrow allocates there (``bytes_allocated``, ``max_memory``). Tests measure Arrow's
    memory with this only: never with a proxy of their own."""
    previous = pa.default_memory_pool()
    proxy = pa.proxy_memory_pool(previous)
    _POOLS.append(proxy)
    pa.set_memory_pool(proxy)
    try:
        yield proxy
    finally:
        pa.set_memory_pool(previous)
