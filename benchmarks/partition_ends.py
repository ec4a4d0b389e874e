"""What keeping the ends of the last K hourly partitions costs (issue 25, item 3): a keyed
pipeline of ``--keys`` keys (default 1,000,000) runs ``--hours`` hourly partitions (default
50), the first loading every key, each later one changing ``--changed`` of them (default 1%),
with ``retain_partition_ends=K`` (default 48) and 1 retained checkpoint. Then, after garbage
collection, it prints the bytes on disk of the job directory against the bytes the head
alone references (what the job directory holds with K = 0: the head is the one retained
checkpoint), their ratio, and ``targets: N/M met``.

Usage::

    .venv/bin/python benchmarks/partition_ends.py [--keys 1000000] [--hours 50]
        [--changed 0.01] [--ends 48] [--with-k0] [--work-dir DIR]

``--with-k0`` runs the same partitions with K = 0 as well and prints its job directory's bytes
(a check that "the head alone" is what K = 0 keeps).

Targets: every one of the K ends is retained and reads back as its partition's state, and the
job directory with K ends is at most 2x the head alone. Why 2x: keyed checkpoints are
incremental, so the ends share the head's chain (a snapshot and its change files) and each
adds only its `_metadata`, while the head's own chain holds the last K partitions' changes; a
full snapshot within the window keeps the previous chain too (at most ``1 + ratio`` times a
snapshot more, docs/design.md), which 1% changes an hour do not reach within 48 hours.
"""

import argparse
import datetime as dt
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGET_RATIO = 2.0


def hour(n: int) -> str:
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    return (start + dt.timedelta(hours=n - 1)).strftime("%Y-%m-%d-%H:%M")


def make_pipeline(keys: int, changed: float, ends: int):
    import dagster as dg
    import pyarrow as pa
    import pyarrow.compute as pc
    from pyspark.sql import functions as F

    from pipelines import KeyedResult, KeyedStage, Source, StatefulPipeline

    schema = pa.schema([pa.field("key", pa.string(), nullable=False), ("hour", pa.int64()),
                        ("updates", pa.int64())])
    per_hour = max(1, int(keys * changed))

    @dataclass(frozen=True)
    class Updates(Source):
        """Hour 1: every key; hour h > 1: ``per_hour`` keys, a different slice each hour."""

        def batches(self, spark, partition):
            return [partition]

        def read(self, spark, partition, batch):
            n = int((dt.datetime.strptime(partition, "%Y-%m-%d-%H:%M")
                     - dt.datetime(2026, 1, 1)).total_seconds() // 3600) + 1
            rows = (spark.range(keys) if n == 1 else
                    spark.range(per_hour).withColumn("id", (F.col("id") + n * per_hour) % keys))
            return rows.select(F.concat(F.lit("k"), F.col("id").cast("string")).alias("key"),
                               F.lit(n).cast("long").alias("hour"))

    def upsert(input: pa.Table, state: pa.Table) -> KeyedResult:
        joined = input.join(state.select(["key", "updates"]), "key", join_type="left outer")
        upserts = pa.table({
            "key": joined.column("key"), "hour": joined.column("hour"),
            "updates": pc.add(pc.fill_null(joined.column("updates"), 0), 1),
        })
        return KeyedResult(upserts, pa.table({"key": pa.array([], pa.string())}),
                           schema.empty_table())

    return StatefulPipeline(
        name="partition_ends_bench",
        stages=[KeyedStage("latest", "key", schema, upsert)],
        source=Updates(),
        partitions=dg.HourlyPartitionsDefinition(start_date="2026-01-01-00:00"),
        max_retained_checkpoints=1,
        retain_partition_ends=ends,
        keyed_parallelism=2,
    )


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def head_bytes(runner) -> int:
    """The bytes the head references: its `_metadata` and its state files (each once)."""
    head = max(runner.store.all(), key=lambda c: c.checkpoint_id)
    files = {Path(head.external_pointer) / "_metadata"}
    files |= {Path(h.path) for h in head.metadata.all_handles() if hasattr(h, "path")}
    return sum(f.stat().st_size for f in files)


def run(spark, work: Path, args, ends: int):
    from checkpoint_storage import FileSystemCheckpointStorage, collect_garbage, format_size
    from pipelines import StatefulRunner
    from pipelines.cli import partition_end_pointer
    from pipelines.state_reader import read_state

    pipeline = make_pipeline(args.keys, args.changed, ends)
    storage = FileSystemCheckpointStorage(str(work / "checkpoints"))
    runner = StatefulRunner(spark, storage, pipeline, keyed_local_dir=str(work / "local"))
    started = time.perf_counter()
    for n in range(1, args.hours + 1):
        runner.run([hour(n)])
        if n % 10 == 0:
            print(f"  K={ends}: {n} of {args.hours} hours, {time.perf_counter() - started:.0f} s",
                  flush=True)
    runner.store.shared_state_registry.wait_for_pending_deletions()
    collect_garbage(runner.access, grace_period=0)
    job = Path(runner.access.checkpoints_directory)
    retained = len(runner.store.all())
    # Each end reads back as its partition's state: the key its hour changed holds that hour.
    readable = 0
    for n in range(args.hours - ends + 1, args.hours + 1):
        pointer = partition_end_pointer(str(job), hour(n), {})
        table = read_state(pointer, "latest", where={"hour": n}, limit=1)
        readable += table.num_rows == 1
    seconds = time.perf_counter() - started
    print(f"K={ends}: {args.hours} hours in {seconds:.0f} s; {retained} checkpoints retained; "
          f"job directory {format_size(directory_bytes(job))} ({directory_bytes(job)} B); "
          f"head alone {format_size(head_bytes(runner))} ({head_bytes(runner)} B); "
          f"{readable} of {ends} ends read back")
    return directory_bytes(job), head_bytes(runner), retained, readable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--hours", type=int, default=50)
    parser.add_argument("--changed", type=float, default=0.01)
    parser.add_argument("--ends", type=int, default=48)
    parser.add_argument("--with-k0", action="store_true")
    parser.add_argument("--work-dir")
    args = parser.parse_args()
    if args.hours < args.ends:
        parser.error("--hours must be at least --ends")

    from resources import build_spark_session

    spark = build_spark_session("local[2]", "partition-ends", {
        "spark.sql.shuffle.partitions": "4", "spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        total, head, retained, readable = run(spark, Path(work) / "k", args, args.ends)
        if args.with_k0:
            k0, _, _, _ = run(spark, Path(work) / "k0", args, 0)
            print(f"K=0: job directory {k0} B, {k0 / head:.2f}x the head alone")
    spark.stop()
    ratio = total / head
    print(f"\n{args.ends} partition ends of {args.keys} keys ({args.changed:.0%} changed an hour): "
          f"{total} B against {head} B for the head alone: {ratio:.2f}x")
    checks = [
        (f"{args.ends} ends retained (+ head)", retained >= args.ends),
        (f"{args.ends} ends read back", readable == args.ends),
        (f"job directory <= {TARGET_RATIO:g}x the head alone", ratio <= TARGET_RATIO),
    ]
    for name, ok in checks:
        print(f"  {name}: {'met' if ok else 'MISSED'}")
    print(f"targets: {sum(ok for _, ok in checks)}/{len(checks)} met")
    sys.exit(0 if all(ok for _, ok in checks) else 1)


if __name__ == "__main__":
    main()
