"""Rewinds that lose nothing and partition ends kept for time travel (issue 25, items 2 and 3),
on real Spark (local[2]) with a small keyed stage over hourly partitions, one or two batches
each, checked against a dict recomputation."""

import datetime as dt
import json
import random
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark import cloudpickle
from pyspark.sql import types as T
from typer.testing import CliRunner

from checkpoint_storage import FileSystemCheckpointStorage, collect_garbage
from checkpoint_storage.cli import build_app
from pipelines import (
    KeyedResult,
    KeyedStage,
    MaterialisationPolicy,
    Source,
    SourcePosition,
    StatefulPipeline,
    StatefulRunner,
)
from sensors import retained_snapshots, retained_table
from tests.pipelines.support import run_read_cli

START = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
HOURLY = dg.HourlyPartitionsDefinition(start_date="2026-01-01-00:00")
EVENTS = T.StructType([T.StructField("key", T.StringType()), T.StructField("n", T.LongType())])
COUNTS = pa.schema([pa.field("key", pa.string(), nullable=False), ("events", pa.int64()),
                    ("total", pa.int64())])


def hour(n: int) -> str:
    """The key of the n-th hourly partition, from 1."""
    return (START + dt.timedelta(hours=n - 1)).strftime("%Y-%m-%d-%H:%M")


def hours(first: int, last: int) -> list[str]:
    return [hour(n) for n in range(first, last + 1)]


@dataclass(frozen=True)
class Events(Source):
    """A few rows per batch over a few keys, made up from the batch id (the same batch always
    has the same rows)."""

    batches_per_partition: int = 1

    def batches(self, spark, partition):
        return [f"{partition}/{i}" for i in range(self.batches_per_partition)]

    def read(self, spark, partition, batch):
        return spark.createDataFrame(self.rows(batch), EVENTS)

    @staticmethod
    def rows(batch: str) -> list[tuple[str, int]]:
        rng = random.Random(batch)
        return [(f"k{rng.randrange(6)}", rng.randrange(1, 50)) for _ in range(4)]


def count_events(input: pa.Table, state: pa.Table) -> KeyedResult:
    batch = input.group_by("key").aggregate([([], "count_all"), ("n", "sum")])
    joined = batch.join(state, "key", join_type="left outer")
    upserts = pa.table({
        "key": joined.column("key"),
        "events": pc.add(joined.column("count_all"), pc.fill_null(joined.column("events"), 0)),
        "total": pc.add(joined.column("n_sum"), pc.fill_null(joined.column("total"), 0)),
    })
    return KeyedResult(upserts, pa.table({"key": pa.array([], pa.string())}), upserts)


cloudpickle.register_pickle_by_value(sys.modules[__name__])


def pipeline(batches: int = 1, **options) -> StatefulPipeline:
    options = {"checkpoint_interval": 1, "max_parallelism": 8, "keyed_parallelism": 2,
               "materialisation": MaterialisationPolicy(every=3, min_bytes=0)} | options
    return StatefulPipeline(
        name="hourly_counts",
        stages=[KeyedStage("counts", "key", COUNTS, count_events)],
        source=Events(batches),
        partitions=HOURLY,
        **options,
    )


def expected(partitions: list[str], batches: int = 1) -> dict[str, tuple[int, int]]:
    """Per key (events, total) after ``partitions``: an independent recomputation."""
    events, total = Counter(), Counter()
    for partition in partitions:
        for i in range(batches):
            for key, n in Events.rows(f"{partition}/{i}"):
                events[key] += 1
                total[key] += n
    return {k: (events[k], total[k]) for k in events}


def runner_of(spark, tmp_path: Path, spec: StatefulPipeline) -> StatefulRunner:
    storage = FileSystemCheckpointStorage(
        str(tmp_path / "checkpoints"), savepoint_dir=str(tmp_path / "savepoints"),
        file_state_size_threshold=0)
    return StatefulRunner(spark, storage, spec, keyed_local_dir=str(tmp_path / "local"))


def state_at(runner: StatefulRunner, pointer: str) -> dict[str, tuple[int, int]]:
    metadata = runner.access.resolve_checkpoint(pointer).load_metadata()
    rows = runner.restore_states(metadata)["counts"].collect()
    return {r["key"]: (r["events"], r["total"]) for r in rows}


def read_as_of(job_dir: Path, partition: str) -> dict[str, tuple[int, int]]:
    ran = run_read_cli(str(job_dir), "--stage", "counts", "--as-of", partition, "--json")
    assert ran.exit_code == 0, ran.output
    rows = [json.loads(line) for line in ran.stdout.splitlines() if line.startswith("{")]
    return {r["key"]: (r["events"], r["total"]) for r in rows}


def on_disk(job_dir: Path) -> set[str]:
    """Every file below the job's ``chk-<id>/`` and ``shared/`` directories."""
    return {str(p) for top in job_dir.iterdir() if top.name.startswith("chk-")
            or top.name == "shared" for p in top.rglob("*") if p.is_file()}


def referenced(runner: StatefulRunner) -> set[str]:
    """The `_metadata` and state files of the retained checkpoints."""
    files = set()
    for checkpoint in runner.store.all():
        files.add(str(Path(checkpoint.external_pointer) / "_metadata"))
        files |= {h.path for h in checkpoint.metadata.all_handles() if hasattr(h, "path")}
    return files


def run_list_cli(directory: str) -> str:
    ran = CliRunner().invoke(build_app(plugins=False), ["list", directory], env={"COLUMNS": "300"})
    assert ran.exit_code == 0, ran.output
    return ran.output


def collect(runner: StatefulRunner) -> None:
    runner.store.shared_state_registry.wait_for_pending_deletions()
    result = collect_garbage(runner.access, grace_period=0)
    assert not result.skipped


@pytest.mark.timeout(300)
def test_a_rewind_keeps_the_head_and_says_so(spark, tmp_path):
    """Run 8 hourly partitions, backfill 3-5 from a savepoint at the end of 2 (retention 2,
    no partition ends kept: the newest ids are then the backfill's, at earlier positions),
    then continue with 9: the head at the end of 8 survives retention and garbage collection,
    restores and equals the recomputation, the run says it rewound and where the head is
    kept, and 9 continues from it without recomputing 6-8."""
    spec = pipeline(max_retained_checkpoints=2)
    runner = runner_of(spark, tmp_path, spec)
    runner.run(hours(1, 2))
    savepoint = runner.take_savepoint().pointer
    first = runner.run(hours(3, 8))
    head = first[-1].checkpoint.pointer

    lines: list[str] = []
    backfill = runner_of(spark, tmp_path, spec)
    rewind = backfill.run(hours(3, 5), restore_from=savepoint, on_progress=lines.append)
    retained = [c.external_pointer for c in backfill.store.all()]
    assert head in retained and retained[-1] == rewind[-1].checkpoint.pointer
    note = (f"rewound from end of {hour(8)} to end of {hour(2)}; the head is kept at {head} "
            f"(a run of {hour(9)} continues from it)")
    assert note in lines
    assert rewind[0].rewound == note and rewind[1].rewound is None
    collect(backfill)
    assert on_disk(Path(backfill.access.checkpoints_directory)) == referenced(backfill)
    assert state_at(backfill, head) == expected(hours(1, 8))
    assert state_at(backfill, rewind[-1].checkpoint.pointer) == expected(hours(1, 5))

    lines.clear()
    later = runner_of(spark, tmp_path, spec).run([hour(9)], on_progress=lines.append)
    assert later[0].restored_from == head and later[0].rewound is None
    assert not any("rewound" in line for line in lines)
    assert state_at(backfill, later[-1].checkpoint.pointer) == expected(hours(1, 9))


@pytest.mark.timeout(300)
def test_retention_keeps_the_last_partition_ends_and_gc_exactly_their_files(spark, tmp_path):
    """Two batches per partition, a checkpoint after each: with 2 retained and the ends of
    the last 4 partitions, exactly the newest two and those ends stay (listed by id), and
    the job directory holds exactly the files they reference (keyed chains materialise every
    3 change files, so files go while others are shared)."""
    spec = pipeline(batches=2, max_retained_checkpoints=2, retain_partition_ends=4)
    runner = runner_of(spark, tmp_path, spec)
    results = runner.run(hours(1, 8))
    ids = {p.partition: [c.checkpoint_id for c in p.checkpoints_taken] for p in results}
    assert ids[hour(1)] == [1, 2] and ids[hour(8)] == [15, 16]
    # newest two: 15, 16; ends of hours 5-8: 10, 12, 14, 16
    assert [c.checkpoint_id for c in runner.store.all()] == [10, 12, 14, 15, 16]
    reopened = runner_of(spark, tmp_path, spec)
    assert [c.checkpoint_id for c in reopened.store.all()] == [10, 12, 14, 15, 16]
    job_dir = Path(runner.access.checkpoints_directory)
    assert sorted(p.name for p in job_dir.glob("chk-*")) == [
        "chk-10", "chk-12", "chk-14", "chk-15", "chk-16"]
    collect(runner)
    assert on_disk(job_dir) == referenced(runner)
    for n in range(5, 9):
        assert read_as_of(job_dir, hour(n)) == expected(hours(1, n), batches=2)
    # The retained table (Dagster) and `checkpoints list` mark the boundaries.
    snapshots = retained_snapshots(runner.storage, spec.name)
    assert [(s.checkpoint_id, s.partition_end) for s in snapshots] == [
        (10, True), (12, True), (14, True), (15, False), (16, True)]
    marks = [r.data["position"].endswith(" end") for r in retained_table(snapshots).records]
    assert marks == [True] * 3 + [False, True]
    listed = run_list_cli(str(job_dir))
    assert listed.count("partition end (2 batches)") == 4, listed


@pytest.mark.timeout(300)
def test_time_travel_over_48_hourly_partition_ends(spark, tmp_path):
    """50 hourly partitions with the ends of the last 48 kept: every retained end reads
    (``--as-of``) and restores equal to the recomputation, a backfill from the oldest one
    works without a savepoint (and keeps the head), the job directory holds exactly the files
    the retained checkpoints reference, and ``--as-of`` an hour no longer kept names the
    retained ends."""
    spec = pipeline(max_retained_checkpoints=1, retain_partition_ends=48)
    runner = runner_of(spark, tmp_path, spec)
    results = runner.run(hours(1, 50))
    ends = {SourcePosition.of(c.metadata).partition: c.external_pointer
            for c in runner.store.all()}
    assert sorted(ends) == hours(3, 50)
    assert [c.checkpoint_id for c in runner.store.all()] == list(range(3, 51))
    job_dir = Path(runner.access.checkpoints_directory)
    collect(runner)
    assert on_disk(job_dir) == referenced(runner)
    for n in range(3, 51):
        want = expected(hours(1, n))
        assert read_as_of(job_dir, hour(n)) == want, hour(n)
        assert state_at(runner, ends[hour(n)]) == want, hour(n)

    missing = run_read_cli(str(job_dir), "--stage", "counts", "--as-of", hour(2))
    assert missing.exit_code == 3
    message = " ".join(missing.output.split())
    assert f"end of {hour(2)}" in message and f"{hour(3)}, {hour(4)}" in message

    lines: list[str] = []
    backfill = runner_of(spark, tmp_path, spec).run(hours(4, 5), on_progress=lines.append)
    assert backfill[0].restored_from == ends[hour(3)]
    assert backfill[0].rewound == (
        f"rewound from end of {hour(50)} to end of {hour(3)}; the head is kept at "
        f"{results[-1].checkpoint.pointer} (a run of {hour(51)} continues from it)")
    after = runner_of(spark, tmp_path, spec)
    assert results[-1].checkpoint.pointer in [c.external_pointer for c in after.store.all()]
    assert state_at(after, backfill[-1].checkpoint.pointer) == expected(hours(1, 5))
