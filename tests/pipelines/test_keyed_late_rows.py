"""``Watermark(late_rows=...)``: the rows a keyed stage's watermark drops as late go to a named
output that a sink writes, still counted, exactly once across a failure and restore."""

import datetime as dt
import sys
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from pyspark import cloudpickle

from pipelines import ParquetSink, Source, StatefulPipeline, StatefulRunner
from pipelines.keyed import KeyedResult, KeyedStage, Watermark
from tests.pipelines.support import InjectedFault, storage_of

T0 = dt.datetime(2026, 3, 10, tzinfo=dt.UTC)
US = dt.timedelta(microseconds=1)
STATE = pa.schema([pa.field("k", pa.int64(), nullable=False), ("n", pa.int64())])
ROWS = pa.schema([("k", pa.int64()), ("ts", pa.timestamp("us", "UTC")), ("v", pa.string())])


def t(minutes: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


def count_and_echo(input: pa.Table, state: pa.Table) -> KeyedResult:
    """Counts each key's rows; outputs the (on-time) rows it got."""
    counts = input.group_by("k").aggregate([([], "count_all")])
    joined = counts.join(state, "k", join_type="left outer")
    n = pc.add(joined.column("count_all"), pc.fill_null(joined.column("n"), 0))
    return KeyedResult(pa.table({"k": joined.column("k"), "n": n}),
                       pa.table({"k": pa.array([], pa.int64())}), input.select(ROWS.names))


cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Watermark = the newest event time seen (this batch's included) - 10 minutes.
EVENTS = {  # per partition, per batch: (key, event time, value)
    "p1": [[(1, t(60), "a"), (2, t(60), "b")],
           # watermark t(60): a row exactly at it is on time, one 1 us older is late
           [(1, t(60), "at"), (2, t(60) - US, "behind"), (3, t(70), "c")]],
    "p2": [[(4, t(80), "d"), (5, t(70) - US, "behind2")],
           [(1, t(10), "old"), (6, t(90), "e")]],
}
LATE = {("p1", 2, t(60) - US, "behind"), ("p2", 5, t(70) - US, "behind2"),
        ("p2", 1, t(10), "old")}


@dataclass(frozen=True)
class Events(Source):
    def batches(self, spark, partition):
        return [f"{partition}-{i}" for i in range(len(EVENTS[partition]))]

    def read(self, spark, partition, batch):
        part, index = batch.rsplit("-", 1)
        table = pa.Table.from_pylist(
            [dict(zip(ROWS.names, row, strict=True)) for row in EVENTS[part][int(index)]],
            schema=ROWS)
        return spark.createDataFrame(table.to_pandas(), "k long, ts timestamp, v string")


def stage(late_rows: str | None = "late_events") -> KeyedStage:
    return KeyedStage("counts", "k", STATE, count_and_echo, output_schema=ROWS,
                      event_time="ts",
                      watermark=Watermark(dt.timedelta(minutes=10), late_rows=late_rows))


def pipeline(tmp_path: Path, **changes) -> StatefulPipeline:
    options = {
        "name": "late", "stages": [stage()], "source": Events(),
        "partitions": dg.StaticPartitionsDefinition(["p1", "p2"]), "checkpoint_interval": 1,
        "max_parallelism": 8, "keyed_parallelism": 2,
        "sinks": [ParquetSink(name="on_time", stage="counts", url=str(tmp_path / "on_time")),
                  ParquetSink(name="late_sink", stage="late_events",
                              url=str(tmp_path / "late"))]}
    return StatefulPipeline(**(options | changes))


def sink_rows(directory: Path) -> list[tuple]:
    """(partition, k, ts, v) of every row the sink's files hold."""
    rows = []
    for path in sorted(directory.rglob("*.parquet")):
        partition = path.parent.name.split("=", 1)[1]
        rows += [(partition, r["k"], r["ts"], r["v"]) for r in pq.read_table(path).to_pylist()]
    return sorted(rows)


@pytest.mark.timeout(300)
def test_late_rows_go_to_their_sink_once_across_a_failure_and_restore(spark, tmp_path):
    """A row exactly at the watermark stays on time, one 1 us older goes to the late-rows
    sink (with the input's columns) and is counted; a run killed after a batch's sinks were
    written and resumed from the checkpoint before it leaves no duplicate in either sink."""
    def kill(point, **info):
        if point == "batch_applied" and info["partition"] == "p2" and info["batch"] == 1:
            raise InjectedFault("killed after the batch's sinks were written")

    progress: list[str] = []
    with pytest.raises(InjectedFault):
        StatefulRunner(spark, storage_of(tmp_path), pipeline(tmp_path),
                       keyed_local_dir=str(tmp_path / "local"), fault_hook=kill).run(
            ["p1", "p2"], on_progress=progress.append)
    StatefulRunner(spark, storage_of(tmp_path), pipeline(tmp_path),
                   keyed_local_dir=str(tmp_path / "local")).run(
        ["p2"], on_progress=progress.append)
    on_time = {(p, k, ts, v) for p, events in EVENTS.items() for batch in events
               for k, ts, v in batch} - LATE
    assert (sorted(LATE), sorted(on_time)) == (
        sink_rows(tmp_path / "late"), sink_rows(tmp_path / "on_time"))
    assert pq.read_schema(next((tmp_path / "late").rglob("*.parquet"))).names == ROWS.names
    assert any("1 late row(s) sent to late_events" in line for line in progress), progress


def test_a_late_rows_output_is_named_checked_and_sinks_may_write_it(tmp_path):
    """The name is an identifier of its own (not a stage's, not another stage's late rows);
    a sink writes it as an output, never as state."""
    with pytest.raises(ValueError, match="late_rows names the late rows' output"):
        Watermark(late_rows="late events")
    with pytest.raises(ValueError, match="already names a stage"):
        pipeline(tmp_path, stages=[stage("counts")], sinks=[])
    with pytest.raises(ValueError, match="which have no state: use of='output'"):
        pipeline(tmp_path, sinks=[ParquetSink(name="s", stage="late_events", of="state",
                                              url=str(tmp_path / "s"))])
    with pytest.raises(ValueError, match=r"nor late-rows outputs \['late_events'\]"):
        pipeline(tmp_path, sinks=[ParquetSink(name="s", stage="nothing",
                                              url=str(tmp_path / "s"))])
    assert pipeline(tmp_path).late_outputs == {"late_events": "counts"}
