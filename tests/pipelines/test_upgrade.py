"""Upgrading a pipeline across a savepoint (docs/pipelines.md, "Upgrading a pipeline"): v1 (a
keyed stage, a DataFrame stage and a stage v2 drops) runs p1 and is savepointed; v2 (a
widened, a renamed and an added column in both stage kinds, a stage added, one removed)
restores it and continues. Plus the refused changes with their messages, a pipeline's initial
state, and savepoints written from tables (``write_savepoint``)."""

import random
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark import cloudpickle
from pyspark.sql import functions as F
from pyspark.sql import types as T

from checkpoint_storage import FileSystemCheckpointStorage
from pipelines import (
    KeyedResult,
    KeyedStage,
    ParquetSink,
    Source,
    Stage,
    StatefulPipeline,
    StatefulRunner,
    read_state,
    write_savepoint,
)
from pipelines.runner import NonRestoredStateError, check_restore_from

cloudpickle.register_pickle_by_value(sys.modules[__name__])

PARTITIONS = dg.StaticPartitionsDefinition(["p1", "p2", "p3"])
BATCHES = 2
ORDERS = T.StructType([T.StructField("customer", T.StringType()),
                       T.StructField("amount", T.LongType())])


@dataclass(frozen=True)
class Orders(Source):
    """Two batches per partition, made up from the batch id."""

    def batches(self, spark, partition):
        return [f"{partition}-{i}" for i in range(BATCHES)]

    def read(self, spark, partition, batch):
        return spark.createDataFrame(rows_of(batch), ORDERS)


def rows_of(batch: str) -> list[tuple[str, int]]:
    rng = random.Random(batch)
    return [(f"c{rng.randrange(12)}", rng.randrange(1, 100)) for _ in range(20)]


def orders_of(partitions) -> list[tuple[str, int]]:
    return [row for p in partitions for b in Orders().batches(None, p) for row in rows_of(b)]


# --- v1 ---------------------------------------------------------------------------------------

TOTALS_V1 = pa.schema([pa.field("customer", pa.string(), nullable=False),
                       ("orders", pa.int32()), ("total", pa.int64())])
TALLY_V1 = T.StructType([T.StructField("batches", T.IntegerType()),
                         T.StructField("rows", T.LongType())])


def totals_v1(input: pa.Table, state: pa.Table) -> KeyedResult:
    batch = input.group_by("customer").aggregate([([], "count_all"), ("amount", "sum")])
    joined = batch.join(state, "customer", join_type="left outer")
    upserts = pa.table({
        "customer": joined.column("customer"),
        "orders": pc.add(joined.column("count_all"),
                         pc.fill_null(joined.column("orders"), 0)).cast(pa.int32()),
        "total": pc.add(joined.column("amount_sum"), pc.fill_null(joined.column("total"), 0)),
    })
    return KeyedResult(upserts, pa.table({"customer": pa.array([], pa.string())}), upserts)


def tally_v1(input, state):
    batch = input.agg(F.lit(1).cast("int").alias("batches"), F.count("*").alias("rows"))
    new = state.unionByName(batch).agg(F.sum("batches").cast("int").alias("batches"),
                                       F.sum("rows").cast("long").alias("rows"))
    return new, input


def legacy(input, state):
    return state, input


def v1(**options) -> StatefulPipeline:
    return StatefulPipeline(
        name="shop", source=Orders(), partitions=PARTITIONS, checkpoint_interval=10,
        max_parallelism=8, keyed_parallelism=2,
        stages=[KeyedStage("totals", "customer", TOTALS_V1, totals_v1, input="source"),
                Stage("tally", TALLY_V1, tally_v1, input="source"),
                Stage("legacy", T.StructType([T.StructField("x", T.LongType())]), legacy,
                      input="source")],
        **options)


# --- v2: orders int32 -> int64, total renamed amount_sum, biggest added; a stage added ---------

TOTALS_V2 = pa.schema([pa.field("customer", pa.string(), nullable=False),
                       ("orders", pa.int64()), ("amount_sum", pa.int64()),
                       ("biggest", pa.int64())])
TALLY_V2 = T.StructType([T.StructField("batches", T.LongType()),
                         T.StructField("row_count", T.LongType()),
                         T.StructField("max_amount", T.LongType())])
SEEN = T.StructType([T.StructField("customer", T.StringType())])


def totals_v2(input: pa.Table, state: pa.Table) -> KeyedResult:
    grouped = input.group_by("customer").aggregate([([], "count_all"), ("amount", "sum"),
                                                    ("amount", "max")])
    batch = pa.table({"customer": grouped.column("customer"), "n": grouped.column("count_all"),
                      "s": grouped.column("amount_sum"), "m": grouped.column("amount_max")})
    joined = batch.join(state, "customer", join_type="left outer")
    upserts = pa.table({
        "customer": joined.column("customer"),
        "orders": pc.add(joined.column("n"), pc.fill_null(joined.column("orders"), 0)),
        "amount_sum": pc.add(joined.column("s"), pc.fill_null(joined.column("amount_sum"), 0)),
        "biggest": pc.max_element_wise(joined.column("m"), joined.column("biggest"),
                                       skip_nulls=True),
    })
    return KeyedResult(upserts, pa.table({"customer": pa.array([], pa.string())}), upserts)


def tally_v2(input, state):
    batch = input.agg(F.lit(1).cast("long").alias("batches"),
                      F.count("*").alias("row_count"), F.max("amount").alias("max_amount"))
    new = state.unionByName(batch).agg(F.sum("batches").cast("long").alias("batches"),
                                       F.sum("row_count").cast("long").alias("row_count"),
                                       F.max("max_amount").cast("long").alias("max_amount"))
    return new, input


def seen(input, state):
    return state.unionByName(input.select("customer")).distinct(), input


def v2(tmp_path: Path, **options) -> StatefulPipeline:
    return StatefulPipeline(
        name="shop", source=Orders(), partitions=PARTITIONS, checkpoint_interval=10,
        max_parallelism=8, keyed_parallelism=2,
        stages=[KeyedStage("totals", "customer", TOTALS_V2, totals_v2, input="source",
                           renamed={"total": "amount_sum"}),
                Stage("tally", TALLY_V2, tally_v2, input="source", renamed={"rows": "row_count"},
                      defaults={"max_amount": 0}),
                Stage("seen", SEEN, seen, input="source")],
        sinks=[ParquetSink(name="totals_state", stage="totals", of="state",
                           url=str(tmp_path / "sink"))],
        **options)


def storage_of(path: Path) -> FileSystemCheckpointStorage:
    return FileSystemCheckpointStorage(str(path / "checkpoints"),
                                       savepoint_dir=str(path / "savepoints"),
                                       file_state_size_threshold=0)


def runner_of(spark, path: Path, pipeline) -> StatefulRunner:
    return StatefulRunner(spark, storage_of(path), pipeline, keyed_local_dir=str(path / "local"))


@pytest.fixture(scope="module")
def v1_savepoint(spark, tmp_path_factory) -> str:
    """v1 after p1, savepointed."""
    path = tmp_path_factory.mktemp("v1")
    runner = runner_of(spark, path, v1())
    runner.run(["p1"])
    return runner.take_savepoint().pointer


def states_of(runner: StatefulRunner) -> dict[str, list[dict]]:
    frames = runner.restore_states(runner.store.latest().metadata)
    return {name: sorted((r.asDict() for r in frame.collect()), key=str)
            for name, frame in frames.items()}


def totals_expected(before, after) -> dict[str, tuple]:
    """v2's totals after v1 ran ``before`` and v2 ran ``after``: biggest is null for
    customers v2 has not seen (v1 did not record it)."""
    orders, amounts, biggest = Counter(), Counter(), {}
    for customer, amount in orders_of([*before, *after]):
        orders[customer] += 1
        amounts[customer] += amount
    for customer, amount in orders_of(after):
        biggest[customer] = max(biggest.get(customer, 0), amount)
    return {c: (orders[c], amounts[c], biggest.get(c)) for c in orders}


def test_v1_savepoint_restored_into_v2_equals_a_recomputation(spark, tmp_path, v1_savepoint):
    """v2 restores v1's savepoint (allow_non_restored_state: v2 dropped stage legacy) and
    runs p2 and p3: the keyed state, its state sink and the DataFrame stages equal a
    recomputation under v2's rules (renamed columns carry v1's values, an added one is null
    or its default until written, the added stage starts empty), and the checkpoints record
    v2's schemas and no file written under v1's."""
    runner = runner_of(spark, tmp_path, v2(tmp_path))

    runner.run(["p2", "p3"], restore_from=v1_savepoint, allow_non_restored_state=True)

    states = states_of(runner)
    assert totals_expected(["p1"], ["p2", "p3"]) == {
        r["customer"]: (r["orders"], r["amount_sum"], r["biggest"]) for r in states["totals"]}
    sink = pd.read_parquet(tmp_path / "sink" / "partition=p3")
    assert totals_expected(["p1"], ["p2", "p3"]) == {
        r.customer: (r.orders, r.amount_sum, None if pd.isna(r.biggest) else r.biggest)
        for r in sink.itertuples()}
    later = orders_of(["p2", "p3"])
    assert [{"batches": 3 * BATCHES, "row_count": 3 * BATCHES * 20,
             "max_amount": max(a for _, a in later)}] == states["tally"]
    assert sorted({c for c, _ in later}) == [r["customer"] for r in states["seen"]]
    metadata = runner.store.latest().metadata
    assert ["totals", "tally", "seen"] == [op.operator_id for op in metadata.operator_states]
    assert TOTALS_V2.names == read_state(runner.store.latest().external_pointer,
                                         "totals").column_names
    savepoint = {h.path for h in runner.access.resolve_checkpoint(v1_savepoint)
                 .load_metadata().all_handles() if hasattr(h, "path")}
    assert not savepoint & {h.path for h in metadata.all_handles() if hasattr(h, "path")}


def test_v2_continues_v1s_own_checkpoint_of_change_files_and_warm_stores(spark, tmp_path):
    """v2 deployed over v1's job directory continues from v1's last checkpoint (CLAIM: its
    own), whose keyed chains hold change files written under v1 and whose local stores are
    warm with v1's schema: the state equals the recomputation, and the first checkpoint
    references no file of v1's."""
    v1_runner = runner_of(spark, tmp_path, v1())
    v1_runner.run(["p1"])
    v1_files = {h.path for h in v1_runner.store.latest().metadata.all_handles()
                if hasattr(h, "path")}
    assert any("-b1-" in Path(f).name for f in v1_files)  # batch 1's change files
    runner = runner_of(spark, tmp_path, v2(tmp_path))

    runner.run(["p2"], allow_non_restored_state=True)

    assert totals_expected(["p1"], ["p2"]) == {
        r["customer"]: (r["orders"], r["amount_sum"], r["biggest"])
        for r in states_of(runner)["totals"]}
    assert not v1_files & {h.path for h in runner.store.latest().metadata.all_handles()
                           if hasattr(h, "path")}


def test_a_removed_stage_is_refused_without_allow_non_restored_state(spark, tmp_path,
                                                                     v1_savepoint):
    """The savepoint holds stage legacy, which v2 lacks: refused before any batch, naming
    it and the option."""
    runner = runner_of(spark, tmp_path, v2(tmp_path))

    with pytest.raises(NonRestoredStateError,
                       match=r"stage\(s\) \['legacy'\].*allow_non_restored_state=True"):
        runner.run(["p2"], restore_from=v1_savepoint)
    assert not list((tmp_path / "checkpoints").rglob("_metadata"))


def test_the_dagster_check_before_spark_refuses_a_removed_stage(tmp_path, v1_savepoint):
    """The run config's restore_from is checked before any Spark work (storage only): the
    removed stage is refused there too, unless allow_non_restored_state."""
    with pytest.raises(NonRestoredStateError, match=r"\['legacy'\]"):
        check_restore_from(storage_of(tmp_path), v1_savepoint, "p2", v2(tmp_path))

    position = check_restore_from(storage_of(tmp_path), v1_savepoint, "p2", v2(tmp_path),
                                  allow_non_restored_state=True)

    assert "end of p1" == str(position)


def _keyed_v1(schema=TOTALS_V1, key="customer", **stage):
    def pipeline(**options):
        return StatefulPipeline(
            name="shop", source=Orders(), partitions=PARTITIONS,
            stages=[KeyedStage("totals", key, schema, totals_v1, input="source", **stage),
                    Stage("tally", TALLY_V1, tally_v1, input="source")],
            **{"max_parallelism": 8} | options)
    return pipeline


@pytest.mark.parametrize(("pipeline", "message"), [
    (_keyed_v1(pa.schema([pa.field("customer", pa.string(), nullable=False),
                          ("orders", pa.int16()), ("total", pa.int64())])),
     r"column 'orders' was int32, is now int16: not a widening.*write_savepoint"),
    (_keyed_v1(pa.schema([pa.field("customer", pa.string(), nullable=False),
                          ("orders", pa.int32()), ("total", pa.string())])),
     r"column 'total' was int64, is now string: not a widening"),
    (_keyed_v1(pa.schema([pa.field("customer", pa.string(), nullable=False),
                          ("orders", pa.int32()), ("total", pa.int64()),
                          pa.field("region", pa.string(), nullable=False)])),
     r"column 'region' is new and NOT NULL, without a default"),
    (_keyed_v1(pa.schema([pa.field("customer", pa.string(), nullable=False),
                          ("orders", pa.int32()), ("total", pa.int64())]), key="orders"),
     r"keyed by \['customer'\], the stage by \['orders'\].*write_savepoint"),
    (_keyed_v1(pa.schema([pa.field("customer", pa.large_string(), nullable=False),
                          ("orders", pa.int32()), ("total", pa.int64())])),
     r"key column 'customer' was string, is now large_string.*write_savepoint"),
    (lambda **options: _keyed_v1()(**options | {"max_parallelism": 16}),
     r"max_parallelism 8, the pipeline has 16.*write_savepoint"),
])
def test_incompatible_changes_are_refused_saying_what_changed(spark, tmp_path, v1_savepoint,
                                                              pipeline, message):
    """Narrowing and other type changes, a NOT NULL column without a default, a changed key,
    key type or max_parallelism: refused before any batch, with old and new and what to do."""
    runner = runner_of(spark, tmp_path, pipeline())

    with pytest.raises(Exception, match=message):
        runner.run(["p2"], restore_from=v1_savepoint, allow_non_restored_state=True)
    assert not list((tmp_path / "checkpoints").rglob("_metadata"))


def test_a_dataframe_stage_narrowed_is_refused(spark, tmp_path, v1_savepoint):
    """A DataFrame stage's column narrowed (rows long -> int): refused naming both types."""
    narrowed = T.StructType([T.StructField("batches", T.IntegerType()),
                             T.StructField("rows", T.IntegerType())])
    pipeline = StatefulPipeline(
        name="shop", source=Orders(), partitions=PARTITIONS, max_parallelism=8,
        stages=[KeyedStage("totals", "customer", TOTALS_V1, totals_v1, input="source"),
                Stage("tally", narrowed, tally_v1, input="source")])

    with pytest.raises(Exception, match=r"stage 'tally'.*column 'rows' was int64, is now "
                                        r"int32"):
        runner_of(spark, tmp_path, pipeline).run(["p2"], restore_from=v1_savepoint,
                                                 allow_non_restored_state=True)


def test_a_stage_of_another_kind_is_refused(spark, tmp_path, v1_savepoint):
    """totals, keyed in v1, as a DataFrame stage: refused naming the format it holds."""
    pipeline = StatefulPipeline(
        name="shop", source=Orders(), partitions=PARTITIONS, max_parallelism=8,
        stages=[Stage("totals", T.StructType([T.StructField("customer", T.StringType())]),
                      legacy, input="source"),
                Stage("tally", TALLY_V1, tally_v1, input="source")])

    with pytest.raises(Exception, match=r"stage 'totals': the snapshot holds the stage's "
                                        r"state as keyed-v1, the stage is a DataFrame stage"):
        runner_of(spark, tmp_path, pipeline).run(["p2"], restore_from=v1_savepoint,
                                                 allow_non_restored_state=True)


def _totals_frame(spark, totals: dict[str, tuple[int, int]]):
    return spark.createDataFrame([(c, o, t) for c, (o, t) in sorted(totals.items())],
                                 "customer string, orders int, total long")


def v1_totals(partitions) -> dict[str, tuple[int, int]]:
    orders, total = Counter(), Counter()
    for customer, amount in orders_of(partitions):
        orders[customer] += 1
        total[customer] += amount
    return {c: (orders[c], total[c]) for c in orders}


def test_initial_state_bootstraps_the_first_run_as_running_from_the_table(spark, tmp_path):
    """v1 with an initial state (totals and a tally built elsewhere, e.g. by a batch job over
    p2 and p3's orders; a DataFrame and a function) runs p1: its state equals p1 applied on
    top of the tables; a later run restores its checkpoint and ignores the initial state."""
    table = v1_totals(["p2", "p3"])  # state built elsewhere, e.g. by a batch job
    tally = spark.createDataFrame([(4, 80)], "batches int, rows long")
    pipeline = v1(initial_state={"totals": _totals_frame(spark, table),
                                 "tally": lambda s: tally})
    runner = runner_of(spark, tmp_path, pipeline)

    runner.run(["p1"])

    states = states_of(runner)
    assert v1_totals(["p1", "p2", "p3"]) == {
        r["customer"]: (r["orders"], r["total"]) for r in states["totals"]}
    assert [{"batches": 4 + BATCHES, "rows": 80 + BATCHES * 20}] == states["tally"]
    runner_of(spark, tmp_path, pipeline).run(["p2"])
    assert v1_totals(["p1", "p2", "p2", "p3"]) == {
        r["customer"]: (r["orders"], r["total"])
        for r in states_of(runner_of(spark, tmp_path, pipeline))["totals"]}


def test_a_stage_added_since_the_snapshot_starts_from_its_initial_state(spark, tmp_path,
                                                                        v1_savepoint):
    """v1's savepoint (after p1) restored into v1 plus a keyed stage ``recount``, added since,
    with an initial state (p2 and p3's totals): recount starts from it, totals from the
    savepoint (its initial state given too is ignored: the snapshot holds totals)."""
    pipeline = StatefulPipeline(
        name="shop", source=Orders(), partitions=PARTITIONS, max_parallelism=8,
        keyed_parallelism=2,
        stages=[*v1().stages,
                KeyedStage("recount", "customer", TOTALS_V1, totals_v1, input="source")],
        initial_state={"recount": _totals_frame(spark, v1_totals(["p2", "p3"])),
                       "totals": _totals_frame(spark, {"nobody": (1, 1)})})
    runner = runner_of(spark, tmp_path, pipeline)

    runner.run(["p2"], restore_from=v1_savepoint)

    states = states_of(runner)
    assert (v1_totals(["p1", "p2"]), v1_totals(["p2", "p3", "p2"])) == tuple(
        {r["customer"]: (r["orders"], r["total"]) for r in states[name]}
        for name in ("totals", "recount"))


def test_an_initial_state_with_a_key_twice_is_refused_naming_it(spark, tmp_path):
    """Two rows of key c1: refused naming the stage and the key; nothing committed."""
    rows = spark.createDataFrame([("c1", 1, 5), ("c2", 1, 6), ("c1", 2, 7)],
                                 "customer string, orders int, total long")
    runner = runner_of(spark, tmp_path, v1(initial_state={"totals": rows}))

    with pytest.raises(Exception, match=r"initial state of keyed stage totals: key "
                                        r"\{'customer': 'c1'\} has 2 rows"):
        runner.run(["p1"])
    assert not list((tmp_path / "checkpoints").rglob("_metadata"))


def test_write_savepoint_then_restore_equals_a_run_that_built_the_state(spark, tmp_path):
    """A savepoint written from tables (p1's totals and tally; legacy not given: no rows)
    at the end of p1, restored and continued with p2, equals running p1 and p2; `read_state`
    reads it like any savepoint, and its directory holds only what it references."""
    built = runner_of(spark, tmp_path / "built", v1())
    built.run(["p1", "p2"])
    storage = storage_of(tmp_path / "written")
    tally = spark.createDataFrame([(BATCHES, BATCHES * 20)], "batches int, rows long")

    pointer = write_savepoint(v1(), {"totals": _totals_frame(spark, v1_totals(["p1"])),
                                     "tally": tally},
                              storage=storage, spark=spark, after="p1")

    assert v1_totals(["p1"]) == {
        r["customer"]: (r["orders"], r["total"])
        for r in read_state(pointer, "totals").to_pylist()}
    referenced = {h.path for h in StatefulRunner(spark, storage, v1()).access
                  .resolve_checkpoint(pointer).load_metadata().all_handles()
                  if hasattr(h, "path")}
    assert referenced == {str(p) for p in Path(pointer).rglob("*")
                          if p.is_file() and p.name != "_metadata"}
    runner = runner_of(spark, tmp_path / "written", v1())
    runner.run(["p2"], restore_from=pointer)
    assert states_of(built) == states_of(runner)
