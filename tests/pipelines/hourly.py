"""An hourly pipeline with a small keyed stage (events per key), its dict recomputation and
what a rewind or time-travel check reads back: shared by tests/pipelines/test_rewind.py and the
reliability scenarios (tests/reliability/scenarios_operations.py)."""

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
from pyspark import cloudpickle
from pyspark.sql import types as T
from typer.testing import CliRunner

from checkpoint_storage import FileSystemCheckpointStorage, collect_garbage
from checkpoint_storage.cli import build_app
from pipelines import (
    FullSnapshotPolicy,
    KeyedResult,
    KeyedStage,
    Source,
    StatefulPipeline,
    StatefulRunner,
)
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
               "full_snapshot": FullSnapshotPolicy(every=3, min_bytes=0)} | options
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
