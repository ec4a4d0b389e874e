"""The generic parts of the pipeline API on real Spark and real local directories: sources
(``FileSource``, ``arrow_schema``), sinks (``ParquetSink``, ``SparkWriterSink``), the
``StatefulPipeline`` spec's validation, ``PartitionOrder``, and what the runner does when a
partly applied partition's batch list changed."""

import datetime as dt
import json
import os
from decimal import Decimal
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark.sql import functions as F
from pyspark.sql import types as T

from checkpoint_storage import FileSystemCheckpointStorage
from checkpoint_storage.spi import SOURCE_POSITION_STATE
from pipelines import (
    SOURCE,
    BatchListChangedError,
    FileSource,
    ParquetSink,
    PartitionOrder,
    SourcePosition,
    SparkReadSource,
    SparkWriterSink,
    Stage,
    StatefulPipeline,
    StatefulRunner,
    arrow_schema,
    batches_digest,
    empty_state,
)
from tests.pipelines.support import InjectedFault, NoSpark, rows

DAY = "2026-10-01"
KV_DDL = "k string, v bigint"
KV_ARROW = pa.schema([("k", pa.string()), ("v", pa.int64())])


def write_parquet(directory: Path, name: str, data: list[tuple], schema=KV_ARROW) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([dict(zip(schema.names, r, strict=True)) for r in data], schema)
    pq.write_table(table, directory / name)
    return directory / name


def kv_source(landing: Path, **options) -> FileSource:
    return FileSource(url=f"{landing}/date={{partition}}", schema=KV_DDL, **options)


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --- FileSource ------------------------------------------------------------------------------


def test_file_source_lists_files_in_name_order_skipping_hidden_names(tmp_path):
    """A partition's batches are its files in name order, without names starting with '_'
    or '.', without directories, and only those ending with the suffix."""
    day = tmp_path / f"date={DAY}"
    for name in ("b-2.parquet", "a-10.parquet", "a-9.parquet", "notes.txt"):
        write_parquet(day, name, [("x", 1)])
    (day / "_SUCCESS").touch()
    (day / ".a-0.parquet.tmp").touch()
    (day / "_temporary").mkdir()
    (day / "nested.parquet").mkdir()
    assert (
        ["a-10.parquet", "a-9.parquet", "b-2.parquet"],
        ["a-10.parquet", "a-9.parquet", "b-2.parquet", "notes.txt"],
    ) == (
        kv_source(tmp_path, suffix=".parquet").batches(NoSpark(), DAY),
        kv_source(tmp_path).batches(NoSpark(), DAY),
    )


def test_file_source_empty_partition_lists_no_batches(tmp_path):
    """A partition directory that holds only markers is an empty partition, not a missing
    one."""
    day = tmp_path / f"date={DAY}"
    day.mkdir()
    (day / "_SUCCESS").touch()
    assert [] == kv_source(tmp_path).batches(NoSpark(), DAY)


def test_file_source_missing_partition_names_it(tmp_path):
    """A partition whose directory does not exist raises FileNotFoundError naming the
    partition and the directory."""
    with pytest.raises(FileNotFoundError) as failure:
        kv_source(tmp_path).batches(NoSpark(), "2026-10-02")
    message = str(failure.value)
    assert (True, True) == (
        "partition 2026-10-02" in message,
        f"{tmp_path}/date=2026-10-02" in message,
    )


def test_file_source_reads_parquet_selecting_and_casting_to_its_schema(spark, tmp_path):
    """A Parquet batch is read with exactly the source's columns, in its order and types:
    extra columns are dropped, narrower types cast."""
    schema = pa.schema([("extra", pa.string()), ("v", pa.int32()), ("k", pa.string())])
    write_parquet(tmp_path / f"date={DAY}", "b.parquet", [("e", 1, "a"), ("e", 2, "b")], schema)
    frame = kv_source(tmp_path).read(spark, DAY, "b.parquet")
    assert (
        [("k", "string"), ("v", "bigint")],
        [("a", 1), ("b", 2)],
    ) == (frame.dtypes, rows(frame))


def test_file_source_parquet_batch_without_a_column_of_the_schema_names_file_and_column(
        spark, tmp_path):
    """A Parquet batch lacking a column of the source's schema fails the read with an error
    naming the file and the column, rather than a null column."""
    schema = pa.schema([("k", pa.string())])
    path = write_parquet(tmp_path / f"date={DAY}", "b.parquet", [("a",)], schema)
    with pytest.raises(Exception) as raised:
        kv_source(tmp_path).read(spark, DAY, "b.parquet").collect()
    message = str(raised.value)
    assert (True, True) == (str(path) in message, "lacks the column(s) ['v']" in message)


def test_file_source_reads_csv_with_a_header(spark, tmp_path):
    """A CSV batch (with a header) is read with the source's schema: strings, integers,
    decimals and dates."""
    day = tmp_path / f"date={DAY}"
    day.mkdir()
    (day / "batch.csv").write_text("k,v,amount,day\na,1,1.25,2026-10-01\nb,-2,0.10,2026-10-02\n")
    source = FileSource(
        url=f"{tmp_path}/date={{partition}}",
        schema="k string, v bigint, amount decimal(12,2), day date",
        format="csv",
    )
    assert [
        ("a", 1, Decimal("1.25"), dt.date(2026, 10, 1)),
        ("b", -2, Decimal("0.10"), dt.date(2026, 10, 2)),
    ] == rows(source.read(spark, DAY, "batch.csv"))


def test_file_source_reads_json_lines(spark, tmp_path):
    """A JSON-lines batch is read with the source's schema: strings, integers, decimals,
    timestamps (in UTC) and dates (text in JSON)."""
    day = tmp_path / f"date={DAY}"
    day.mkdir()
    (day / "batch.json").write_text(
        '{"k": "a", "v": 1, "amount": "1.25", "ts": "2026-10-01T10:00:00Z",'
        ' "d": "2026-10-01"}\n'
        '{"k": "b", "v": -2, "amount": 0.10, "ts": "2026-10-02 23:30:00", "d": "2026-10-03"}\n'
    )
    source = FileSource(
        url=f"{tmp_path}/date={{partition}}",
        schema="k string, v bigint, amount decimal(12,2), ts timestamp, d date",
        format="json",
    )
    found = [
        (k, v, a, ts.astimezone(dt.UTC), d)
        for k, v, a, ts, d in rows(source.read(spark, DAY, "batch.json"))
    ]
    assert [
        ("a", 1, Decimal("1.25"), dt.datetime(2026, 10, 1, 10, tzinfo=dt.UTC),
         dt.date(2026, 10, 1)),
        ("b", -2, Decimal("0.10"), dt.datetime(2026, 10, 2, 23, 30, tzinfo=dt.UTC),
         dt.date(2026, 10, 3)),
    ] == found


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"url": "/landing/date=2026-10-01"}, "placeholder"),
        ({"format": "avro"}, "parquet, csv or json"),
        ({"schema": "k strang"}, "unknown type"),
        ({"storage_options": {"secret": "s3cr3t"}}, "storage_options_from_env"),
    ],
)
def test_file_source_refuses_bad_configuration(kwargs, match):
    """A FileSource without a partition placeholder, with an unknown format or schema type,
    or with a credential in its storage options is refused when it is defined."""
    options = {"url": "/landing/date={partition}", "schema": KV_DDL} | kwargs
    with pytest.raises((ValueError, TypeError), match=match):
        FileSource(**options)


# --- arrow_schema ----------------------------------------------------------------------------


def test_arrow_schema_reads_ddl_with_decimals():
    """A DDL string gives the Arrow schema it spells, decimal(p, s) included (spaces and
    backticks allowed, types case-insensitive), timestamps in UTC."""
    ddl = "`id` STRING, n bigint,amount decimal(12 , 2), ts timestamp, d date, f float, b boolean"
    assert pa.schema(
        [
            ("id", pa.string()),
            ("n", pa.int64()),
            ("amount", pa.decimal128(12, 2)),
            ("ts", pa.timestamp("us", tz="UTC")),
            ("d", pa.date32()),
            ("f", pa.float32()),
            ("b", pa.bool_()),
        ]
    ) == arrow_schema(ddl)


def test_arrow_schema_accepts_arrow_and_spark_schemas():
    """An Arrow schema passes through; a Spark StructType converts (timestamps in UTC)."""
    spark_schema = T.StructType(
        [T.StructField("k", T.StringType()), T.StructField("ts", T.TimestampType())]
    )
    assert (KV_ARROW, pa.schema([("k", pa.string()), ("ts", pa.timestamp("us", tz="UTC"))])) == (
        arrow_schema(KV_ARROW),
        arrow_schema(spark_schema),
    )


@pytest.mark.parametrize("ddl", ["", "k", "k string,", "k map<string,int>", "k decimal(x,2)"])
def test_arrow_schema_refuses_what_it_cannot_read(ddl):
    """A DDL string with an empty, untyped or unknown field is refused, naming it."""
    with pytest.raises((ValueError, TypeError)):
        arrow_schema(ddl)


@pytest.mark.parametrize("ddl", ["amount decimal( 12, 2 )", "amount decimal(12)"])
def test_arrow_schema_reads_decimals_as_spark_spells_them(ddl):
    """decimal( p, s ) and decimal(p) (scale 0) read as Spark reads them."""
    scale = 2 if "," in ddl else 0
    assert pa.schema([("amount", pa.decimal128(12, scale))]) == arrow_schema(ddl)


# Spark's DDL spelling -> the Arrow type it stands for.
DDL_TYPES = {
    "string": pa.string(),
    "bigint": pa.int64(),
    "long": pa.int64(),
    "int": pa.int32(),
    "integer": pa.int32(),
    "smallint": pa.int16(),
    "short": pa.int16(),
    "tinyint": pa.int8(),
    "byte": pa.int8(),
    "double": pa.float64(),
    "float": pa.float32(),
    "real": pa.float32(),
    "boolean": pa.bool_(),
    "binary": pa.binary(),
    "date": pa.date32(),
    "timestamp": pa.timestamp("us", tz="UTC"),
}


@st.composite
def ddl_fields(draw):
    """One generated field: (our DDL spelling, Spark's DDL spelling, the Arrow field), of any
    known type or a decimal(p, s), in any case, with or without backticks and extra
    spaces."""
    name = draw(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True))
    space = st.sampled_from(["", " ", "  "])
    if draw(st.booleans()):
        precision = draw(st.integers(1, 38))
        scale = draw(st.integers(0, precision))
        spelling = f"decimal({precision}{draw(space)},{draw(space)}{scale})"
        canonical, kind = f"decimal({precision},{scale})", pa.decimal128(precision, scale)
    else:
        spelling = canonical = draw(st.sampled_from(sorted(DDL_TYPES)))
        kind = DDL_TYPES[spelling]
    spelling = draw(st.sampled_from([spelling, spelling.upper(), spelling.capitalize()]))
    quoted = f"`{name}`" if draw(st.booleans()) else name
    ours = f"{draw(space)}{quoted} {draw(space)}{spelling}{draw(space)}"
    return ours, f"`{name}` {canonical}", pa.field(name, kind)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ddl_fields(), min_size=1, max_size=6, unique_by=lambda f: f[2].name.lower()))
def test_arrow_schema_round_trips_generated_ddl(spark, fields):
    """A generated DDL string reads as the Arrow schema it was generated from, which is the
    Arrow form of the StructType Spark parses from the same fields."""
    parsed = arrow_schema(",".join(ours for ours, _, _ in fields))
    by_spark = T.StructType.fromDDL(", ".join(theirs for _, theirs, _ in fields))
    assert (pa.schema([f for _, _, f in fields]), parsed) == (parsed, arrow_schema(by_spark))


# --- ParquetSink ------------------------------------------------------------------------------


def kv_frame(spark, data: list[tuple], partitions: int = 1):
    return spark.createDataFrame(data, KV_DDL).repartition(partitions)


def read_kv(directory: Path) -> list[tuple]:
    table = pq.read_table(directory)
    return sorted(zip(table.column("k").to_pylist(), table.column("v").to_pylist(), strict=True))


def test_parquet_sink_rewriting_a_batch_replaces_it(spark, tmp_path):
    """Writing a batch's output again replaces that batch's rows (no duplicates) and keeps
    the partition's other batches."""
    sink = ParquetSink(name="out", stage="s", url=str(tmp_path / "out"))
    first = [("a", 1), ("b", 2), ("c", 3)]
    sink.write(spark, kv_frame(spark, first, 2), DAY, 0)
    sink.write(spark, kv_frame(spark, [("d", 4)]), DAY, 1)
    sink.write(spark, kv_frame(spark, first, 2), DAY, 0)
    assert sorted([*first, ("d", 4)]) == read_kv(tmp_path / "out" / f"partition={DAY}")


def test_parquet_sink_rewriting_the_state_replaces_it(spark, tmp_path):
    """A state sink's write (no batch) replaces what the partition held for the state."""
    sink = ParquetSink(name="out", stage="s", of="state", url=str(tmp_path / "out"))
    sink.write(spark, kv_frame(spark, [("a", 1), ("b", 2)], 2), DAY, None)
    sink.write(spark, kv_frame(spark, [("a", 5)], 2), DAY, None)
    assert [("a", 5)] == read_kv(tmp_path / "out" / f"partition={DAY}")


def test_parquet_sink_rerun_with_fewer_tasks_deletes_stale_files(spark, tmp_path):
    """A re-run of a batch with fewer Spark tasks deletes the files of the earlier attempt's
    extra tasks."""
    sink = ParquetSink(name="out", stage="s", url=str(tmp_path / "out"))
    data = [(f"k{i}", i) for i in range(12)]
    sink.write(spark, kv_frame(spark, data, 4), DAY, 0)
    before = len(files_in(tmp_path / "out" / f"partition={DAY}"))
    sink.write(spark, kv_frame(spark, data, 1), DAY, 0)
    directory = tmp_path / "out" / f"partition={DAY}"
    assert (4, ["batch-00000-00000.parquet"], sorted(data)) == (
        before,
        files_in(directory),
        read_kv(directory),
    )


def test_parquet_sink_empty_output_writes_an_empty_file(spark, tmp_path):
    """An empty output still replaces the batch: one empty Parquet file with the columns,
    the earlier attempt's rows gone."""
    sink = ParquetSink(name="out", stage="s", url=str(tmp_path / "out"))
    sink.write(spark, kv_frame(spark, [("a", 1), ("b", 2)], 2), DAY, 0)
    sink.write(spark, kv_frame(spark, []), DAY, 0)
    directory = tmp_path / "out" / f"partition={DAY}"
    table = pq.read_table(directory)
    assert (["batch-00000-empty.parquet"], 0, ["k", "v"]) == (
        files_in(directory),
        table.num_rows,
        table.column_names,
    )


def test_parquet_sink_clear_removes_only_that_partition(spark, tmp_path):
    """clear removes the partition's directory and nothing else; clearing a partition that
    holds nothing is fine."""
    sink = ParquetSink(name="out", stage="s", url=str(tmp_path / "out"))
    sink.write(spark, kv_frame(spark, [("a", 1)]), DAY, 0)
    sink.write(spark, kv_frame(spark, [("b", 2)]), "2026-10-02", 0)
    sink.clear(spark, DAY)
    sink.clear(spark, "2026-10-03")
    assert ["partition=2026-10-02"] == files_in(tmp_path / "out")


def test_parquet_sink_escapes_hourly_keys_for_hive_readers(spark, tmp_path):
    """An hourly key's ':' is escaped in the directory name (as Spark escapes it), and
    pyarrow and Spark read the key back with hive partitioning."""
    sink = ParquetSink(name="out", stage="s", url=str(tmp_path / "out"), partition_column="hour")
    hours = ["2026-10-01-05:00", "2026-10-01-06:00"]
    for number, hour in enumerate(hours):
        sink.write(spark, kv_frame(spark, [("a", number)]), hour, 0)
    table = pq.read_table(tmp_path / "out", partitioning="hive")
    by_arrow = sorted(
        zip(table.column("hour").to_pylist(), table.column("v").to_pylist(), strict=True)
    )
    by_spark = rows(spark.read.parquet(str(tmp_path / "out")).select("hour", "v"))
    assert (
        ["hour=2026-10-01-05%3A00", "hour=2026-10-01-06%3A00"],
        [(hours[0], 0), (hours[1], 1)],
        [(hours[0], 0), (hours[1], 1)],
        sink.location(hours[0]),
    ) == (
        files_in(tmp_path / "out"),
        by_arrow,
        [(str(h), v) for h, v in by_spark],
        f"{tmp_path / 'out'}/hour=2026-10-01-05%3A00",
    )


# --- SparkWriterSink --------------------------------------------------------------------------


def test_spark_writer_sink_dynamic_overwrite_replaces_one_partition(spark, tmp_path):
    """Writing a partition again replaces exactly that partition's rows; the others stay."""
    path = str(tmp_path / "report")
    sink = SparkWriterSink(name="report", stage="s", of="state", path=path, partition_column="day")
    sink.write(spark, kv_frame(spark, [("a", 1), ("b", 2)], 2), DAY, None)
    sink.write(spark, kv_frame(spark, [("c", 3)]), "2026-10-02", None)
    sink.write(spark, kv_frame(spark, [("a", 10)], 2), DAY, None)
    found = [(k, v, str(d)) for k, v, d in rows(spark.read.parquet(path).select("k", "v", "day"))]
    assert [("a", 10, DAY), ("c", 3, "2026-10-02")] == found


def test_spark_writer_sink_output_batches_replace_and_clear(spark, tmp_path):
    """An output sink writes each batch under its own directory: re-writing a batch replaces
    it, and clear removes the partition."""
    path = str(tmp_path / "out")
    sink = SparkWriterSink(name="out", stage="s", path=path)
    sink.write(spark, kv_frame(spark, [("a", 1)]), DAY, 0)
    sink.write(spark, kv_frame(spark, [("b", 2)]), DAY, 1)
    sink.write(spark, kv_frame(spark, [("a", 7)]), DAY, 0)
    written = rows(spark.read.parquet(path).select("k", "v", "batch"))
    sink.clear(spark, DAY)
    assert ([("a", 7, 0), ("b", 2, 1)], [p for p in os.listdir(path) if "=" in p]) == (
        written,
        [],
    )


# --- StatefulPipeline validation --------------------------------------------------------------

STATE = T.StructType([T.StructField("k", T.StringType())])


def identity(data, state):
    return state, data


def stage(name: str, input: str | None = None) -> Stage:  # noqa: A002 - the field's name
    return Stage(name, STATE, identity, input)


def pipeline(**overrides) -> StatefulPipeline:
    spec = {
        "name": "counts",
        "stages": [stage("first"), stage("second")],
        "source": FileSource(url="/landing/date={partition}", schema=KV_DDL),
        "partitions": dg.DailyPartitionsDefinition(start_date=DAY),
    } | overrides
    return StatefulPipeline(**spec)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"name": "Counts"}, "pipeline name 'Counts'"),
        ({"name": "2counts"}, "pipeline name '2counts'"),
        ({"name": "my-counts"}, "pipeline name 'my-counts'"),
        ({"name": ""}, "pipeline name ''"),
        ({"stages": []}, "at least one stage"),
        ({"stages": [stage("a"), stage("b", input="c")]}, "stage 'b' reads 'c'"),
        ({"stages": [stage("a", input="b"), stage("b")]}, "stage 'a' reads 'b'"),
        ({"stages": [stage("a"), stage("a")]}, "two stages are called 'a'"),
        (
            {"sinks": [ParquetSink(name="out", stage="third", url="/out")]},
            "sink 'out' writes stage 'third'",
        ),
        (
            {
                "sinks": [
                    ParquetSink(name="out", stage="first", url="/a"),
                    ParquetSink(name="out", stage="second", url="/b"),
                ]
            },
            "two sinks are called 'out'",
        ),
        ({"checkpoint_interval": 0}, "checkpoint_interval must be >= 1"),
        ({"max_retained_checkpoints": 0}, "max_retained_checkpoints must be >= 1"),
    ],
)
def test_pipeline_refuses_an_inconsistent_spec(overrides, match):
    """A pipeline with a bad name, no stages, a stage reading an unknown or later stage,
    duplicate stage or sink names, a sink of an unknown stage, or a non-positive interval or
    retention is refused when it is defined, naming what is wrong."""
    with pytest.raises(ValueError, match=match):
        pipeline(**overrides)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: stage("my-stage"), "stage name 'my-stage'"),
        (lambda: stage("1st"), "stage name '1st'"),
        (lambda: stage(SOURCE), "cannot be called 'source'"),
        (lambda: ParquetSink(name="out", stage="s", of="input", url="/out"), "of must be"),
    ],
)
def test_stage_and_sink_refuse_bad_names(build, match):
    """A stage named other than letters, digits and '_' (or named 'source'), and a sink of
    neither output nor state, are refused."""
    with pytest.raises(ValueError, match=match):
        build()


def test_pipeline_inputs_default_to_the_previous_stage():
    """Without ``input``, the first stage reads the source and each later stage the one
    before; an explicit input is kept."""
    spec = pipeline(stages=[stage("a"), stage("b"), stage("c", input=SOURCE), stage("d", "a")])
    assert [SOURCE, "a", SOURCE, "a"] == [spec.input_of(i) for i in range(4)]


# --- PartitionOrder ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("partitions", "key", "previous", "following"),
    [
        (dg.DailyPartitionsDefinition(start_date=DAY), "2026-10-05", "2026-10-04", "2026-10-06"),
        (dg.DailyPartitionsDefinition(start_date=DAY), DAY, None, "2026-10-02"),
        (
            dg.HourlyPartitionsDefinition(start_date="2026-10-01-00:00"),
            "2026-10-02-00:00",
            "2026-10-01-23:00",
            "2026-10-02-01:00",
        ),
        (
            dg.HourlyPartitionsDefinition(start_date="2026-10-01-00:00"),
            "2026-10-01-00:00",
            None,
            "2026-10-01-01:00",
        ),
        (
            dg.WeeklyPartitionsDefinition(start_date="2026-10-04"),
            "2026-10-11",
            "2026-10-04",
            "2026-10-18",
        ),
        (dg.WeeklyPartitionsDefinition(start_date="2026-10-04"), "2026-10-04", None, "2026-10-11"),
        (dg.StaticPartitionsDefinition(["eu", "us", "apac"]), "us", "eu", "apac"),
        (dg.StaticPartitionsDefinition(["eu", "us", "apac"]), "eu", None, "us"),
        (dg.StaticPartitionsDefinition(["eu", "us", "apac"]), "apac", "us", None),
    ],
    ids=[
        "daily",
        "daily-first",
        "hourly-across-midnight",
        "hourly-first",
        "weekly",
        "weekly-first",
        "static",
        "static-first",
        "static-last",
    ],
)
def test_partition_order_previous_and_following(partitions, key, previous, following):
    """Time partitions are ordered in time, static ones as declared; the first partition
    has no previous one, the last static one no following one."""
    order = PartitionOrder(partitions)
    assert (previous, following) == (order.previous(key), order.following(key))


def test_partition_order_checks_keys_and_consecutive_ranges():
    """Unknown keys and ranges with a gap or out of order are refused; a consecutive range
    passes."""
    daily = PartitionOrder(dg.DailyPartitionsDefinition(start_date=DAY))
    static = PartitionOrder(dg.StaticPartitionsDefinition(["eu", "us", "apac"]))
    for call in (
        lambda: daily.check("2026-13-01"),
        lambda: static.check("mars"),
        lambda: daily.check_consecutive([DAY, "2026-10-03"]),
        lambda: static.check_consecutive(["us", "eu"]),
    ):
        with pytest.raises(ValueError):
            call()
    assert (["us", "apac"], DAY, "eu") == (
        static.check_consecutive(["us", "apac"]),
        daily.first,
        static.first,
    )


def test_partition_order_refuses_other_partition_kinds():
    """Partitions without an order (dynamic, multi-dimensional) are refused."""
    with pytest.raises(TypeError, match="time-window partitions"):
        PartitionOrder(dg.DynamicPartitionsDefinition(name="things"))


# --- the runner when a partly applied partition's batches change ------------------------------

COUNT_STATE = T.StructType(
    [
        T.StructField("k", T.StringType()),
        T.StructField("total", T.LongType()),
        T.StructField("n", T.LongType()),
    ]
)


def count(batch, state):
    """Per key: the sum of ``v`` and the number of rows; output: this batch's figures."""
    figures = batch.groupBy("k").agg(
        F.sum("v").cast("bigint").alias("total"), F.count(F.lit(1)).alias("n")
    )
    new_state = (
        state.unionByName(figures)
        .groupBy("k")
        .agg(F.sum("total").cast("bigint").alias("total"), F.sum("n").cast("bigint").alias("n"))
    )
    return new_state, figures


BATCH_ROWS = {
    f"batch-{i}.parquet": [("a", i + 1), ("b", 10 * (i + 1)), (f"only-{i}", 100 + i)]
    for i in range(6)
}


def counts_pipeline(base: Path) -> StatefulPipeline:
    return StatefulPipeline(
        name="counts",
        stages=[Stage("count", COUNT_STATE, count)],
        source=kv_source(base / "landing", suffix=".parquet"),
        partitions=dg.DailyPartitionsDefinition(start_date=DAY),
        sinks=[ParquetSink(name="figures", stage="count", url=str(base / "figures"))],
        checkpoint_interval=2,
    )


def counts_runner(spark, base: Path, **options) -> StatefulRunner:
    storage = FileSystemCheckpointStorage(str(base / "chk"), str(base / "sp"))
    return StatefulRunner(spark, storage, counts_pipeline(base), **options)


def land(base: Path, *names: str) -> None:
    for name in names:
        write_parquet(base / "landing" / f"date={DAY}", name, BATCH_ROWS[name])


def recompute(spark, names: list[str]) -> tuple[list[tuple], list[tuple]]:
    """The state and the outputs of applying ``count`` to each batch once, in order."""
    state = empty_state(spark, Stage("count", COUNT_STATE, count))
    outputs = []
    for name in names:
        state, output = count(kv_frame(spark, BATCH_ROWS[name]), state)
        state = state.localCheckpoint(eager=True)
        outputs += rows(output)
    return rows(state), sorted(outputs)


@pytest.fixture
def partly_applied(spark, tmp_path) -> Path:
    """Three batches landed; a run failed after applying the third, past the checkpoint
    after the second: the newest checkpoint is inside the partition."""

    def fail_after_third(point, **info):
        if point == "batch_applied" and info["batch"] == 2:
            raise InjectedFault("after batch 3")

    land(tmp_path, "batch-0.parquet", "batch-1.parquet", "batch-2.parquet")
    crashed = counts_runner(spark, tmp_path, fault_hook=fail_after_third)
    with pytest.raises(InjectedFault):
        crashed.run([DAY])
    assert SourcePosition(DAY, 2, False) == crashed.latest_position()
    return tmp_path


def test_batches_appended_after_a_checkpoint_are_applied_exactly_once(spark, partly_applied):
    """Batches landed after a checkpoint inside the partition are applied by the restarted
    run: its state and its sink's outputs equal a recomputation over all the batches."""
    base = partly_applied
    land(base, "batch-3.parquet", "batch-4.parquet")
    runner = counts_runner(spark, base)
    (result,) = runner.run([DAY])
    states = runner.restore_states(runner.store.latest().metadata)
    names = sorted(BATCH_ROWS)[:5]
    figures = pq.read_table(base / "figures")
    written = sorted(
        zip(*(figures.column(c).to_pylist() for c in ("k", "total", "n")), strict=True)
    )
    assert (
        (3, SourcePosition(DAY, 5, True)),
        recompute(spark, names),
    ) == (
        (result.batches_applied, result.checkpoint.position),
        (rows(states["count"]), written),
    )


def vanish(landing: Path) -> None:
    (landing / "batch-0.parquet").unlink()


def reorder(landing: Path) -> None:
    (landing / "batch-0.parquet").rename(landing / "batch-9.parquet")


def insert_before(landing: Path) -> None:
    write_parquet(landing, "batch-00.parquet", [("a", 1)])


@pytest.mark.parametrize("change", [vanish, reorder, insert_before])
def test_changed_batches_before_the_checkpoint_stop_the_run(spark, partly_applied, change):
    """When the batches a checkpoint inside the partition applied vanished, were renamed or
    are no longer first, the restarted run stops before applying anything, naming the
    partition and saying what to do."""
    base = partly_applied
    change(base / "landing" / f"date={DAY}")
    runner = counts_runner(spark, base)
    before = [c.checkpoint_id for c in runner.store.all()]
    with pytest.raises(BatchListChangedError) as failure:
        runner.run([DAY])
    message = str(failure.value)
    assert (
        True,
        True,
        True,
        True,
        before,
    ) == (
        f"partition {DAY}" in message,
        "New batches may only be appended" in message,
        "Restore the original batches" in message,
        f"process {DAY} again from empty state" in message,
        [c.checkpoint_id for c in runner.store.all()],
    )


def test_position_records_the_digest_of_the_applied_batches(partly_applied):
    """The checkpoint inside the partition records which batches it applied (a digest of
    their names), in `_metadata`'s source position."""
    storage = FileSystemCheckpointStorage(str(partly_applied / "chk"))
    runner = StatefulRunner(NoSpark(), storage, counts_pipeline(partly_applied))
    raw = json.loads(runner.store.latest().metadata.master_states[SOURCE_POSITION_STATE])
    assert batches_digest(["batch-0.parquet", "batch-1.parquet"]) == raw["digest"]


# --- SparkReadSource ---------------------------------------------------------------------


def test_spark_read_source_lists_files_through_hadoop_and_reads_each(spark, tmp_path):
    """A path source lists a partition's files through Hadoop's FileSystem in name order
    (skipping _SUCCESS and hidden files) and reads one file per batch with Spark."""
    day = tmp_path / f"date={DAY}"
    day.mkdir()
    for name, values in (("b-2.parquet", [3]), ("a-1.parquet", [1, 2])):
        pq.write_table(pa.table({"v": pa.array(values, pa.int64())}), day / name)
    (day / "_SUCCESS").write_text("")
    (day / ".in-progress").write_text("")
    source = SparkReadSource(path=f"{tmp_path}/date={{partition}}", schema="v bigint")

    batches = source.batches(spark, DAY)

    assert ["a-1.parquet", "b-2.parquet"] == batches
    assert [[(1,), (2,)], [(3,)]] == [rows(source.read(spark, DAY, b)) for b in batches]
    with pytest.raises(FileNotFoundError, match="2026-10-02"):
        source.batches(spark, "2026-10-02")


def test_spark_read_source_reads_a_table_filtered_per_partition(spark):
    """A table source is one batch per partition: the table's rows of that partition."""
    spark.createDataFrame(
        [(DAY, 1), (DAY, 2), ("2026-10-02", 3)], "event_date string, v long"
    ).createOrReplaceTempView("spark_read_source_events")
    source = SparkReadSource(
        table="spark_read_source_events", where="event_date = '{partition}'"
    )

    assert ["table"] == source.batches(spark, DAY)
    assert [(DAY, 1), (DAY, 2)] == rows(source.read(spark, DAY, "table"))


@pytest.mark.parametrize(
    "kwargs", [{}, {"path": "/x/{partition}", "table": "t"}, {"path": "/x/no-placeholder"}]
)
def test_spark_read_source_needs_one_place_to_read(kwargs):
    """Exactly one of path (with a {partition} placeholder) and table."""
    with pytest.raises(ValueError, match="SparkReadSource"):
        SparkReadSource(**kwargs)
