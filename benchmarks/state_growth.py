"""State growth: what a batch and a checkpoint cost as the state grows, against Spark Structured
Streaming, the engine a user would pick instead for large keyed state.

Systems (each run in its own process, interleaved, on the same Parquet batches):

- ``ss-rocksdb``: Structured Streaming with the RocksDB state store and changelog checkpointing
  (``spark.sql.streaming.stateStore.providerClass`` = RocksDB provider,
  ``...rocksdb.changelogCheckpointing.enabled=true``), checkpoint on local disk;
- ``ss-hdfs``: Structured Streaming with its default (HDFS-backed, in-memory) state store;
- ``before``: our runner with a DataFrame stage, which snapshots the whole state each checkpoint;
- ``ours``: our runner with a keyed stage (incremental checkpoints) — measured once keyed stages
  are wired into the runner; until then it is reported as "not built" and its targets as missed.

Workloads: ``aggregate`` (per-key count, sum and last time, update mode) and ``dedupe`` (drop
events already seen within a two-day event-time window). Data: batch 0 holds S keys (the state
to start from, not timed); every later batch changes 1% of S (``--changed`` fixes the number
instead, for the growth measurement).

Per system and S it prints: bytes written per batch (all files that appear under the checkpoint
directory, snapshots and maintenance included, amortised over the batches), batch wall and CPU
seconds (best of the batches' medians over repetitions), and recovery: a new process restarting
from the checkpoint and processing one more batch.

    python benchmarks/state_growth.py [--keys 1000000,4000000,8000000] [--batches 8]
        [--repeats 2] [--systems ss-rocksdb,ss-hdfs,before] [--quick]

``--quick``: 100,000 keys, 3 batches, one repetition, a smoke run. The last line is
``targets: N/M met``.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import tree_cpu_seconds  # noqa: E402

SYSTEMS = ("ss-rocksdb", "ss-hdfs", "before", "ours")
WORKLOADS = ("aggregate", "dedupe")
SHUFFLE_PARTITIONS = 4
EVENT_SCHEMA = pa.schema(
    [
        ("user_id", pa.string()),
        ("event_id", pa.string()),
        ("amount", pa.int64()),
        ("ts", pa.timestamp("us", tz="UTC")),
    ]
)
START = np.datetime64("2026-10-01T00:00:00", "us")


# --- data ----------------------------------------------------------------------------------


def write_batches(directory: Path, keys: int, batches: int, changed: int, seed: int = 7) -> None:
    """Batch 0: one event per key (the initial state). Batches 1..n: ``changed`` keys drawn
    at random, one new event each, a minute later per batch."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for b in range(batches + 2):  # +1 initial, +1 for the recovery batch
        ids = np.arange(keys) if b == 0 else rng.choice(keys, size=changed, replace=False)
        count = len(ids)
        table = pa.table(
            {
                "user_id": pa.array([f"u{i:09d}" for i in ids]),
                "event_id": pa.array([f"e{b:05d}-{i:09d}" for i in ids]),
                "amount": pa.array(rng.integers(1, 1000, size=count)),
                "ts": pa.array(
                    np.full(count, START + np.timedelta64(b * 60, "s")), EVENT_SCHEMA[3].type
                ),
            },
            schema=EVENT_SCHEMA,
        )
        pq.write_table(table, directory / f"batch-{b:05d}.parquet")


# --- measuring the checkpoint directory -----------------------------------------------------


class WrittenBytes:
    """Bytes of the files that appeared (or grew) under a directory since the last look: what
    a system wrote to its checkpoint, including what its background maintenance uploaded."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.seen: dict[str, int] = {}
        self.total = 0

    def look(self) -> int:
        new = 0
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                path = os.path.join(dirpath, name)
                try:
                    size = os.path.getsize(path)
                except OSError:
                    continue
                if size > self.seen.get(path, 0):
                    new += size - self.seen.get(path, 0)
                    self.seen[path] = size
        self.total += new
        return new


# --- workers (one process each) ---------------------------------------------------------------


def _spark(system: str):
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors: this interpreter
    builder = (
        SparkSession.builder.master("local[2]")
        .appName(f"state_growth-{system}")
        .config("spark.sql.shuffle.partitions", str(SHUFFLE_PARTITIONS))
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "6g")
        .config("spark.sql.session.timeZone", "UTC")
        # Maintenance (snapshot uploads, cleanup) every 5 s, so its bytes land inside the run.
        .config("spark.sql.streaming.stateStore.maintenanceInterval", "5s")
    )
    if system == "ss-rocksdb":
        builder = builder.config(
            "spark.sql.streaming.stateStore.providerClass",
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
        ).config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _ss_query(spark, workload: str, feed: Path, checkpoint: Path):
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    events = (
        spark.readStream.schema(from_arrow_schema(EVENT_SCHEMA))
        .option("maxFilesPerTrigger", 1)
        .parquet(str(feed))
    )
    if workload == "aggregate":
        result = events.groupBy("user_id").agg(
            F.count(F.lit(1)).alias("events"), F.sum("amount").alias("total"),
            F.max("ts").alias("last_seen"),
        )  # fmt: skip
        mode = "update"
    else:
        result = events.withWatermark("ts", "2 days").dropDuplicatesWithinWatermark(["event_id"])
        mode = "append"
    return (
        result.writeStream.format("noop").outputMode(mode)
        .option("checkpointLocation", str(checkpoint)).start()
    )  # fmt: skip


def _feed(batch: Path, feed: Path) -> None:
    """Land one batch file where the stream source looks (atomically, by rename)."""
    tmp = feed / f".{batch.name}.tmp"
    shutil.copyfile(batch, tmp)
    os.replace(tmp, feed / batch.name)


def worker_ss(system: str, workload: str, data: Path, work: Path, batches: int, phase: str) -> dict:
    feed, checkpoint = work / "feed", work / "checkpoint"
    feed.mkdir(parents=True, exist_ok=True)
    spark = _spark(system)
    files = sorted(data.glob("batch-*.parquet"))
    if phase == "run":
        query = _ss_query(spark, workload, feed, checkpoint)
        _feed(files[0], feed)
        query.processAllAvailable()  # the initial state, not timed
        written = WrittenBytes(checkpoint)
        written.look()
        walls, cpus = [], []
        for batch in files[1 : batches + 1]:
            cpu0, t0 = tree_cpu_seconds(), time.perf_counter()
            _feed(batch, feed)
            query.processAllAvailable()
            walls.append(time.perf_counter() - t0)
            cpus.append(tree_cpu_seconds() - cpu0)
            written.look()
        time.sleep(12)  # two maintenance intervals: snapshot uploads count too
        written.look()
        query.stop()
        kinds = sorted({Path(p).suffix or Path(p).name for p in written.seen})
        return {"walls": walls, "cpus": cpus, "bytes_per_batch": written.total / batches,
                "file_kinds": kinds}  # fmt: skip
    # recovery: restart from the checkpoint and process one more batch
    t0 = time.perf_counter()
    query = _ss_query(spark, workload, feed, checkpoint)
    _feed(files[batches + 1], feed)
    query.processAllAvailable()
    recovery = time.perf_counter() - t0
    query.stop()
    return {"recovery": recovery}


def worker_before(workload: str, data: Path, work: Path, batches: int, phase: str) -> dict:
    """Our runner with a DataFrame stage: one static partition per batch, a checkpoint after
    each (the same cadence as a micro-batch engine)."""
    import dagster as dg
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from checkpoint_storage import FileSystemCheckpointStorage
    from pipelines import FileSource, Stage, StatefulPipeline, StatefulRunner

    spark = _spark("before")
    names = [f"b{b:05d}" for b in range(batches + 2)]
    landing = work / "landing"
    for name, batch in zip(names, sorted(data.glob("batch-*.parquet")), strict=True):
        (landing / name).mkdir(parents=True, exist_ok=True)
        target = landing / name / batch.name
        if not target.exists():
            os.link(batch, target)
    if workload == "aggregate":
        schema = T.StructType([
            T.StructField("user_id", T.StringType()), T.StructField("events", T.LongType()),
            T.StructField("total", T.LongType()), T.StructField("last_seen", T.TimestampType()),
        ])  # fmt: skip

        def apply(state, events):
            batch = events.groupBy("user_id").agg(
                F.count(F.lit(1)).alias("events"), F.sum("amount").alias("total"),
                F.max("ts").alias("last_seen"),
            )  # fmt: skip
            merged = state.unionByName(batch).groupBy("user_id").agg(
                F.sum("events").alias("events"), F.sum("total").alias("total"),
                F.max("last_seen").alias("last_seen"),
            )  # fmt: skip
            return merged, batch
    else:
        schema = T.StructType([
            T.StructField("event_id", T.StringType()), T.StructField("ts", T.TimestampType()),
        ])  # fmt: skip

        def apply(state, events):
            horizon = events.agg(F.max("ts")).first()[0]
            fresh = events.select("event_id", "ts").join(state, "event_id", "left_anti")
            kept = state.unionByName(fresh).where(
                F.col("ts") >= F.lit(horizon) - F.expr("INTERVAL 2 DAYS")
            )
            return kept, fresh

    pipeline = StatefulPipeline(
        name=f"state_growth_{workload}",
        stages=[Stage(workload, schema, apply)],
        source=FileSource(url=str(landing) + "/{partition}", schema=EVENT_SCHEMA),
        partitions=dg.StaticPartitionsDefinition(names),
        checkpoint_interval=1,
        max_retained_checkpoints=3,
    )
    storage = FileSystemCheckpointStorage(str(work / "checkpoint"))
    runner = StatefulRunner(spark, storage, pipeline, lease_owner="state_growth")
    if phase == "run":
        runner.run(names[:1])
        written = WrittenBytes(work / "checkpoint")
        written.look()
        walls, cpus = [], []
        for name in names[1 : batches + 1]:
            cpu0, t0 = tree_cpu_seconds(), time.perf_counter()
            runner.run([name])
            walls.append(time.perf_counter() - t0)
            cpus.append(tree_cpu_seconds() - cpu0)
            written.look()
        return {"walls": walls, "cpus": cpus, "bytes_per_batch": written.total / batches}
    t0 = time.perf_counter()
    runner.run([names[batches + 1]])
    return {"recovery": time.perf_counter() - t0}


def worker(args) -> None:
    data, work = Path(args.data), Path(args.work)
    if args.system.startswith("ss-"):
        result = worker_ss(args.system, args.workload, data, work, args.batches, args.phase)
    elif args.system == "before":
        result = worker_before(args.workload, data, work, args.batches, args.phase)
    else:
        raise SystemExit(f"state_growth: system {args.system!r} is not built yet")
    print("RESULT " + json.dumps(result), flush=True)


# --- driver ---------------------------------------------------------------------------------


@dataclass
class Measured:
    batch_wall: float
    batch_cpu: float
    bytes_per_batch: float
    recovery: float


def run_system(system: str, workload: str, data: Path, batches: int) -> Measured | None:
    work = Path(tempfile.mkdtemp(prefix=f"state_growth-{system}-"))
    try:
        results = {}
        for phase in ("run", "recovery"):
            proc = subprocess.run(
                [sys.executable, __file__, "worker", "--system", system, "--workload", workload,
                 "--data", str(data), "--work", str(work), "--batches", str(batches),
                 "--phase", phase],
                capture_output=True, text=True, timeout=3600,
            )  # fmt: skip
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                print(f"  {system} {workload} {phase}: failed: {' | '.join(tail)}", flush=True)
                return None
            results |= json.loads(lines[-1][len("RESULT ") :])
        return Measured(
            statistics.median(results["walls"]), statistics.median(results["cpus"]),
            results["bytes_per_batch"], results["recovery"],
        )  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


def best(runs: list[Measured]) -> Measured:
    return Measured(
        min(r.batch_wall for r in runs), min(r.batch_cpu for r in runs),
        min(r.bytes_per_batch for r in runs), min(r.recovery for r in runs),
    )  # fmt: skip


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    w = sub.add_parser("worker")
    for flag in ("--system", "--workload", "--data", "--work", "--phase"):
        w.add_argument(flag, required=True)
    w.add_argument("--batches", type=int, required=True)
    parser.add_argument("--keys", default="1000000,4000000,8000000")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--changed", type=int, default=None, help="changed keys per batch")
    parser.add_argument("--systems", default="ss-rocksdb,ss-hdfs,before,ours")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "worker":
        worker(args)
        return
    if args.quick:
        args.keys, args.batches, args.repeats = "100000", 3, 1
    sizes = [int(k) for k in args.keys.split(",")]
    systems = args.systems.split(",")
    workloads = args.workloads.split(",")
    print(f"state_growth: keys {sizes}, {args.batches} batches, {args.repeats} repeats, "
          f"local[2], {SHUFFLE_PARTITIONS} shuffle partitions; load {os.getloadavg()}")  # fmt: skip
    table: dict[tuple[str, str, int], Measured | None] = {}
    base = Path(tempfile.mkdtemp(prefix="state_growth-data-"))
    try:
        for size in sizes:
            changed = args.changed or max(1, size // 100)
            data = base / f"s{size}"
            write_batches(data, size, args.batches, changed)
            for workload in workloads:
                runs: dict[str, list[Measured]] = {s: [] for s in systems}
                for r in range(args.repeats):
                    order = systems[r % len(systems) :] + systems[: r % len(systems)]
                    for system in order:
                        if system == "ours":
                            continue  # keyed stages are not wired into the runner yet
                        m = run_system(system, workload, data, args.batches)
                        if m is not None:
                            runs[system].append(m)
                for system in systems:
                    table[(system, workload, size)] = best(runs[system]) if runs[system] else None
                    m = table[(system, workload, size)]
                    shown = (
                        "not built" if system == "ours" else "failed" if m is None else
                        f"{mib(m.bytes_per_batch)}/batch, batch {m.batch_wall:.2f} s wall "
                        f"{m.batch_cpu:.2f} s cpu, recovery {m.recovery:.2f} s"
                    )  # fmt: skip
                    print(f"S={size:>9,} {workload:<9} {system:<10} {shown}", flush=True)
            shutil.rmtree(data, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"load after: {os.getloadavg()}")
    checks = []
    for workload in workloads:
        for size in sizes:
            ours = table.get(("ours", workload, size))
            ss = table.get(("ss-rocksdb", workload, size))
            for label, limit, get in (
                ("bytes/batch", 1.0, lambda m: m.bytes_per_batch),
                ("batch wall", 1.5, lambda m: m.batch_wall),
                ("recovery", 1.0, lambda m: m.recovery),
            ):
                if ours is None or ss is None:
                    checks.append(False)
                    print(f"{workload} S={size:,} {label} <= {limit}x SS RocksDB: MISSED "
                          "(not measured)")  # fmt: skip
                    continue
                ratio = get(ours) / get(ss)
                ok = ratio <= limit
                checks.append(ok)
                print(f"{workload} S={size:,} {label}: {ratio:.2f}x SS RocksDB "
                      f"(target <= {limit}x): {'ok' if ok else 'MISSED'}")  # fmt: skip
    print(f"targets: {sum(checks)}/{len(checks)} met")


if __name__ == "__main__":
    main()
