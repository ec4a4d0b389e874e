"""State growth: what a batch and a checkpoint cost as the state grows, against Spark Structured
Streaming, the engine a user would pick instead for large keyed state.

Systems (each run in its own process, interleaved, on the same Parquet batches):

- ``ss-rocksdb``: Structured Streaming with the RocksDB state store and changelog checkpointing
  (``spark.sql.streaming.stateStore.providerClass`` = RocksDB provider,
  ``...rocksdb.changelogCheckpointing.enabled=true``), checkpoint on local disk;
- ``ss-hdfs``: Structured Streaming with its default (HDFS-backed, in-memory) state store;
- ``before``: our runner with a DataFrame stage, which snapshots the whole state each checkpoint;
- ``ours``: our runner with a keyed stage (``KeyedStage``: local Arrow stores per key group
  range, a change file per range and batch, periodic materialisation by the pipeline's default
  ``MaterialisationPolicy(ratio=1.0, min_bytes=1 MiB)``), ``keyed_parallelism`` 2,
  ``max_parallelism`` 128, checkpoint on local disk. Its recovery process starts without the
  local stores (a new ``keyed_local_dir``) and rebuilds them from the checkpoint's chains, as
  SS's recovery starts without its local RocksDB instances (they live in the stopped
  SparkContext's temporary directory) and reloads them from its checkpoint.

Workloads: ``aggregate`` (per-key count, sum and last time, update mode) and ``dedupe`` (drop
events already seen within a two-day event-time window). Data: batch 0 holds S keys (the state
to start from, not timed); every later batch changes 1% of S (``--changed`` fixes the number
instead, for the growth measurement).

Per system and S it prints: bytes written per batch (all files that appear under the checkpoint
directory after the initial state's checkpoint, snapshots and maintenance included, amortised
over the timed batches; ours also by kind), bytes per batch in steady state (the target's
measure: ours with its materialisations amortised by the policy's ratio; SS from the batch
after its first snapshot, which uploads the whole store, to the end, which holds its next,
incremental snapshot: RocksDB with changelog checkpointing snapshots every 10 versions, so
the default 22 batches), batch wall and CPU
seconds (best of the batches' medians over repetitions), and recovery: a new process restarting
from the checkpoint and processing one more batch. For ours it also prints the median time
per phase of a batch on the driver (functions of the runner's keyed path, timed in the worker)
and, when a local copy of ``pipelines/keyed/_executor.py`` is instrumented to append one JSON
line per range and batch to ``$PIPELINES_KEYED_TIMINGS`` (step seconds under keys ending in
``_s``; not in the tree, as timing code does not belong in the task), the executor steps.
With more than one S and ``--changed``, it checks ours' growth from the smallest to the
largest S (<= 1.3x).

    python benchmarks/state_growth.py [--keys 1000000,4000000,8000000] [--batches 22]
        [--repeats 2] [--systems ss-rocksdb,ss-hdfs,before] [--quick]

``--quick``: 100,000 keys, 3 batches, one repetition, a smoke run. The last line is
``targets: N/M met``.
"""

import argparse
import json
import os
import re
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
# spark.sql.streaming.stateStore.minDeltasForSnapshot, Spark's default: the RocksDB store's
# snapshot interval in versions (batches), so steady state needs runs longer than twice it.
SS_MIN_DELTAS_FOR_SNAPSHOT = 10
KEYED_PARALLELISM = 2  # key group ranges of our keyed stage: one per core of local[2]
# The pipeline's default MaterialisationPolicy: a snapshot of a range when its change files
# outgrow its base (the last snapshot, or the chain's first change file; at least 1 MiB).
OURS_MATERIALISATION = {"every": None, "ratio": 1.0, "min_bytes": 1 << 20}
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
        self.increments: dict[str, int] | None = None  # per path, once set to {}

    def start(self) -> None:
        """Take the directory as it is now as the starting point: only what appears after
        it counts (the initial state's checkpoint is not a batch's)."""
        self.look()
        self.total = 0
        self.increments = {}

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
                    if self.increments is not None:
                        self.increments[path] = (self.increments.get(path, 0) + size
                                                 - self.seen.get(path, 0))
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
        written.start()
        walls, cpus, after = [], [], []
        for batch in files[1 : batches + 1]:
            cpu0, t0 = tree_cpu_seconds(), time.perf_counter()
            _feed(batch, feed)
            query.processAllAvailable()
            walls.append(time.perf_counter() - t0)
            cpus.append(tree_cpu_seconds() - cpu0)
            written.look()
            after.append(_ss_written(written))
        time.sleep(12)  # two maintenance intervals: snapshot uploads count too
        written.look()
        after[-1] = _ss_written(written)
        query.stop()
        return {"walls": walls, "cpus": cpus, "bytes_per_batch": written.total / batches,
                "steady_bytes_per_batch": _ss_steady_bytes(after)}
    # recovery: restart from the checkpoint and process one more batch
    t0 = time.perf_counter()
    query = _ss_query(spark, workload, feed, checkpoint)
    _feed(files[batches + 1], feed)
    query.processAllAvailable()
    recovery = time.perf_counter() - t0
    query.stop()
    return {"recovery": recovery}


def _is_ss_snapshot(path: str) -> bool:
    """A file of a RocksDB state store snapshot: ``<version>.zip`` (with its ``.crc``) or an
    SST file under ``SSTs/`` (snapshots share SSTs; each uploads only the new ones)."""
    return ".zip" in Path(path).name or f"{os.sep}SSTs{os.sep}" in path


def _ss_written(written: WrittenBytes) -> dict:
    """So far: all bytes, the snapshots' bytes, and per state store partition how many
    snapshots were uploaded."""
    snapshots: dict[str, int] = {}
    for path in written.seen:
        if path.endswith(".zip"):
            partition = str(Path(path).parent)
            snapshots[partition] = snapshots.get(partition, 0) + 1
    return {"total": written.total, "snapshot": sum(
        n for p, n in written.increments.items() if _is_ss_snapshot(p)),
        "snapshots": min(snapshots.values(), default=0)}  # fmt: skip


def _ss_steady_bytes(after: list[dict]) -> dict | None:
    """SS's bytes per batch in steady state, its snapshots amortised: from the batch after
    its first snapshot of every partition (which uploads the whole store) to the end, the
    changelogs and metadata per batch (``changelog``), and the snapshot bytes over the snapshot
    interval (``snapshot``, per ``SS_MIN_DELTAS_FOR_SNAPSHOT`` batches). None: no second
    snapshot of every partition landed (pass more ``--batches``)."""
    first = next((i for i, a in enumerate(after) if a["snapshots"] >= 1), None)
    if first is None or first == len(after) - 1 or after[-1]["snapshots"] < 2:
        return None
    start, end = after[first], after[-1]
    snapshot = end["snapshot"] - start["snapshot"]
    rest = end["total"] - start["total"] - snapshot
    return {"changelog": rest / (len(after) - 1 - first),
            "snapshot": snapshot / SS_MIN_DELTAS_FOR_SNAPSHOT}


def worker_before(workload: str, data: Path, work: Path, batches: int, phase: str) -> dict:
    """Our runner with a DataFrame stage: one static partition per batch, a checkpoint after
    each (the same cadence as a micro-batch engine)."""
    import dagster as dg
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from checkpoint_storage import FileSystemCheckpointStorage
    from pipelines import FileSource, Stage, StatefulPipeline, StatefulRunner

    spark = _spark("before")
    landing, names = _land(data, work, batches)
    if workload == "aggregate":
        schema = T.StructType([
            T.StructField("user_id", T.StringType()), T.StructField("events", T.LongType()),
            T.StructField("total", T.LongType()), T.StructField("last_seen", T.TimestampType()),
        ])  # fmt: skip

        def apply(events, state):
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

        def apply(events, state):
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
        written.start()
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



# --- ours: keyed stages ---------------------------------------------------------------------

AGGREGATE_STATE = pa.schema([
    pa.field("user_id", pa.string(), nullable=False), ("events", pa.int64()),
    ("total", pa.int64()), ("last_seen", EVENT_SCHEMA.field("ts").type),
])  # fmt: skip
DEDUPE_STATE = pa.schema([
    pa.field("event_id", pa.string(), nullable=False), ("ts", EVENT_SCHEMA.field("ts").type),
])  # fmt: skip


def keyed_aggregate(input: pa.Table, state: pa.Table):
    """Per user: count, sum of amount and newest ts, added to the user's state; the output is
    the updated rows (what SS emits in update mode)."""
    import pyarrow.compute as pc

    from pipelines import KeyedResult

    batch = input.group_by("user_id", use_threads=False).aggregate(
        [([], "count_all"), ("amount", "sum"), ("ts", "max")])
    both = batch.join(state, "user_id", join_type="left outer")
    new, old = both.column("ts_max"), both.column("last_seen")
    upserts = pa.table({
        "user_id": both.column("user_id"),
        "events": pc.add(both.column("count_all"), pc.fill_null(both.column("events"), 0)),
        "total": pc.add(both.column("amount_sum"), pc.fill_null(both.column("total"), 0)),
        "last_seen": pc.coalesce(pc.if_else(pc.greater(new, old), new, old), new, old),
    })  # fmt: skip
    return KeyedResult(upserts, AGGREGATE_STATE.empty_table().select(["user_id"]), upserts)


def keyed_dedupe(input: pa.Table, state: pa.Table):
    """The input's events whose event_id has no state, each once (the first in the batch):
    the output (whole events, as SS's dropDuplicatesWithinWatermark emits) and the new state
    rows. Rows behind the two-day window are dropped by the runner (the stage's event_time
    and ttl), as SS drops rows behind its watermark."""
    import pyarrow.compute as pc

    from pipelines import KeyedResult

    events = input.filter(pc.invert(pc.is_in(input.column("event_id"),
                                             value_set=state.column("event_id"))))
    if events.num_rows:
        order = events.append_column("_row", pa.array(np.arange(events.num_rows)))
        first = order.group_by("event_id", use_threads=False).aggregate([("_row", "min")])
        if first.num_rows != events.num_rows:
            events = events.take(np.sort(first.column("_row_min").to_numpy()))
    upserts = events.select(DEDUPE_STATE.names)
    return KeyedResult(upserts, DEDUPE_STATE.empty_table().select(["event_id"]), events)


def _ours_pipeline(workload: str, landing: Path, names: list[str]):
    import datetime as dt

    import dagster as dg

    from pipelines import (
        FileSource,
        KeyedStage,
        MaterialisationPolicy,
        StatefulPipeline,
        StateTtl,  # fmt: skip
        TtlTimeCharacteristic,
    )

    if workload == "aggregate":
        stage = KeyedStage("aggregate", "user_id", AGGREGATE_STATE, keyed_aggregate)
    else:
        stage = KeyedStage(
            "dedupe", "event_id", DEDUPE_STATE, keyed_dedupe,
            ttl=StateTtl(dt.timedelta(days=2), TtlTimeCharacteristic.EVENT_TIME, "ts"),
            output_schema=EVENT_SCHEMA, event_time="ts",
        )  # fmt: skip
    return StatefulPipeline(
        name=f"state_growth_{workload}_keyed",
        stages=[stage],
        source=FileSource(url=str(landing) + "/{partition}", schema=EVENT_SCHEMA),
        partitions=dg.StaticPartitionsDefinition(names),
        checkpoint_interval=1,
        max_retained_checkpoints=3,
        max_parallelism=128,
        keyed_parallelism=KEYED_PARALLELISM,
        materialisation=MaterialisationPolicy(**OURS_MATERIALISATION),
    )


def _land(data: Path, work: Path, batches: int) -> tuple[Path, list[str]]:
    """One static partition per batch file (hard links), for ``before`` and ours."""
    names = [f"b{b:05d}" for b in range(batches + 2)]
    landing = work / "landing"
    for name, batch in zip(names, sorted(data.glob("batch-*.parquet")), strict=True):
        (landing / name).mkdir(parents=True, exist_ok=True)
        target = landing / name / batch.name
        if not target.exists():
            os.link(batch, target)
    return landing, names


def _ours_bytes_by_kind(paths: dict[str, int]) -> dict[str, int]:
    """Bytes written by kind: change files, materialisations, ``_metadata``, other."""
    kinds = {"change": 0, "materialisation": 0, "metadata": 0, "other": 0}
    for path, size in paths.items():
        name = Path(path).name
        if name == "_metadata":
            kinds["metadata"] += size
        elif "/shared/" in path and re.search(r"-kg\d+-\d+-b\d+-a\d+-", name):
            kinds["change"] += size
        elif "/shared/" in path and re.search(r"-kg\d+-\d+-m\d+-a\d+-", name):
            kinds["materialisation"] += size
        else:
            kinds["other"] += size
    return kinds


class Phases:
    """Driver-side time per batch by phase (exclusive of nested phases): the functions of
    the runner's keyed path wrapped in this worker process, behaviour unchanged."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.stack: list[float] = []

    def wrap(self, owner, name: str, label: str, numbered: bool = False) -> None:
        original = getattr(owner, name)
        phases = self

        def timed(*args, **kwargs):
            phases.calls[label] = phases.calls.get(label, 0) + 1
            key = f"{label} #{phases.calls[label]}" if numbered else label
            started = time.perf_counter()
            phases.stack.append(0.0)
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                nested = phases.stack.pop()
                phases.current[key] = phases.current.get(key, 0.0) + elapsed - nested
                if phases.stack:
                    phases.stack[-1] += elapsed

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        taken, self.current, self.calls = self.current, {}, {}
        return taken


def _profile_ours() -> Phases:
    try:  # the class the session's DataFrames are (Spark 4: classic)
        from pyspark.sql.classic.dataframe import DataFrame
    except ImportError:
        from pyspark.sql import DataFrame

    import pipelines.runner as runner
    from pipelines import FileSource
    from pipelines.keyed import KeyedStageDriver

    phases = Phases()
    phases.wrap(FileSource, "batches", "source: list files")
    phases.wrap(FileSource, "read", "source: read plan")
    phases.wrap(DataFrame, "localCheckpoint", "localCheckpoint", numbered=True)
    phases.wrap(DataFrame, "count", "count", numbered=True)
    phases.wrap(DataFrame, "first", "first", numbered=True)
    # KeyedStageDriver.apply is apply_keyed_batch and the chains' bookkeeping.
    phases.wrap(KeyedStageDriver, "apply", "apply_keyed_batch (route + applyInArrow + "
                "collect handles)")
    phases.wrap(KeyedStageDriver, "prepare", "prepare (materialise if due)")
    phases.wrap(runner.StatefulRunner, "checkpoint", "checkpoint (_metadata, GC)")
    phases.wrap(runner.StatefulRunner, "_recover_store", "recover checkpoint store")
    return phases


def _executor_timings(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    path.unlink()
    return rows


def worker_ours(workload: str, data: Path, work: Path, batches: int, phase: str) -> dict:
    """Our runner with a keyed stage (local stores, change files, periodic materialisation):
    one static partition per batch, a checkpoint after each, as for ``before``. Local stores
    live under ``work/local-<phase>``: the recovery process starts without them and rebuilds
    them from the checkpoint's chains, as SS's recovery starts without its local RocksDB
    instances (they live in the stopped SparkContext's temporary directory) and reloads them
    from its checkpoint."""
    from checkpoint_storage import FileSystemCheckpointStorage
    from pipelines import StatefulRunner

    timings = work / f"executor-timings-{phase}.jsonl"
    os.environ["PIPELINES_KEYED_TIMINGS"] = str(timings)  # read by an instrumented _executor.py
    spark = _spark("ours")
    phases = _profile_ours()
    landing, names = _land(data, work, batches)
    pipeline = _ours_pipeline(workload, landing, names)
    storage = FileSystemCheckpointStorage(str(work / "checkpoint"))
    local = work / f"local-{phase}"
    t0 = time.perf_counter()
    runner = StatefulRunner(spark, storage, pipeline, lease_owner="state_growth",
                            keyed_local_dir=str(local))
    if phase == "run":
        runner.run(names[:1])
        phases.take()
        _executor_timings(timings)
        written = WrittenBytes(work / "checkpoint")
        written.start()
        walls, cpus, profile, executor = [], [], [], []
        for name in names[1 : batches + 1]:
            cpu0, t0 = tree_cpu_seconds(), time.perf_counter()
            runner.run([name])
            walls.append(time.perf_counter() - t0)
            cpus.append(tree_cpu_seconds() - cpu0)
            profile.append(phases.take())
            executor.append(_executor_timings(timings))
            written.look()
        grown = written.increments
        return {"walls": walls, "cpus": cpus, "bytes_per_batch": written.total / batches,
                "bytes_by_kind": _ours_bytes_by_kind(grown), "profile": profile,
                "executor": executor}  # fmt: skip
    progress: list[str] = []
    runner.run([names[batches + 1]], on_progress=progress.append)
    recovery = time.perf_counter() - t0
    rebuilt = [n for line in progress for n in line.split("; ") if "rebuilt" in n]
    return {"recovery": recovery, "recovery_profile": phases.take(),
            "recovery_executor": _executor_timings(timings), "recovery_rebuilt": rebuilt}


def worker(args) -> None:
    data, work = Path(args.data), Path(args.work)
    if args.system.startswith("ss-"):
        result = worker_ss(args.system, args.workload, data, work, args.batches, args.phase)
    elif args.system == "before":
        result = worker_before(args.workload, data, work, args.batches, args.phase)
    elif args.system == "ours":
        result = worker_ours(args.workload, data, work, args.batches, args.phase)
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
    detail: dict | None = None


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
            {k: results[k] for k in ("bytes_by_kind", "steady_bytes_per_batch", "walls",
                                     "profile", "executor", "recovery_profile",
                                     "recovery_executor", "recovery_rebuilt") if k in results},
        )  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


def steady_bytes_per_batch(m: Measured, batches: int) -> float | None:
    """Bytes per batch in steady state, snapshots amortised (None: not measurable).

    SS: what it wrote from the batch after its first snapshot of every partition to the end
    (changelogs and its next, incremental snapshot; ``_ss_steady_bytes``).

    Ours: the change files, plus the materialisations the policy writes for them (a
    snapshot once the changes outgrow ``ratio`` times the base, so ``1/ratio`` of the change
    bytes per batch, whatever the state's size), plus the rest (``_metadata``); a window of
    a few batches may hold no materialisation or one, so this is at least the window's
    measured bytes."""
    detail = m.detail or {}
    if "steady_bytes_per_batch" in detail:
        steady = detail["steady_bytes_per_batch"]
        return None if steady is None else steady["changelog"] + steady["snapshot"]
    kinds = detail.get("bytes_by_kind")
    if not kinds:
        return m.bytes_per_batch
    change = kinds.get("change", 0) / batches
    rest = sum(v for k, v in kinds.items() if k not in ("change", "materialisation")) / batches
    return max(m.bytes_per_batch, change * (1 + 1 / OURS_MATERIALISATION["ratio"]) + rest)


def best(runs: list[Measured]) -> Measured:
    return Measured(
        min(r.batch_wall for r in runs), min(r.batch_cpu for r in runs),
        min(r.bytes_per_batch for r in runs), min(r.recovery for r in runs),
        min(runs, key=lambda r: r.bytes_per_batch).detail,
    )  # fmt: skip


def _detail(detail: dict, batches: int) -> str:
    parts = []
    if "bytes_by_kind" in detail:
        parts.append("bytes/batch by kind: " + ", ".join(
            f"{k} {mib(v / batches)}" for k, v in detail["bytes_by_kind"].items() if v))
    if "walls" in detail:
        parts.append("batch walls s: " + " ".join(f"{w:.2f}" for w in detail["walls"]))
    lines = ["; ".join(parts)]
    if detail.get("profile"):
        lines.append(_profile_lines(detail["profile"], detail.get("executor"), detail["walls"]))
    if "recovery_profile" in detail:
        lines.append("recovery: " + _phase_text(detail["recovery_profile"])
                     + _executor_text(detail.get("recovery_executor") or [])
                     + "".join(f"; {note}" for note in detail.get("recovery_rebuilt", [])))
    return "\n      ".join(lines)


def _phase_text(phases: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1])
                     if v >= 0.005)


def _executor_text(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = [k for k in rows[0] if k.endswith("_s")]
    return " | executor (per range, max): " + ", ".join(
        f"{k[:-2]} {max(r.get(k, 0.0) for r in rows):.2f}" for k in keys)


def _profile_lines(profile: list[dict], executor: list | None, walls: list[float]) -> str:
    """Per phase, the median seconds over the timed batches (driver side, exclusive), and
    the executor-side steps of the keyed stage per range."""
    labels = sorted({k for p in profile for k in p})
    medians = {k: statistics.median(p.get(k, 0.0) for p in profile) for k in labels}
    accounted = [sum(p.values()) for p in profile]
    medians["(rest of runner.run)"] = statistics.median(
        w - a for w, a in zip(walls, accounted, strict=True))
    text = "batch profile, median s: " + _phase_text(medians)
    if executor and any(executor):
        keys = [k for k in executor[0][0] if k.endswith("_s")] if executor[0] else []
        per = {k: statistics.median(max((r.get(k, 0.0) for r in rows), default=0.0)
                                    for rows in executor) for k in keys}
        text += " | executor per range (median of the slower range): " + ", ".join(
            f"{k[:-2]} {v:.2f}" for k, v in per.items())
    return text


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
    # 22: SS snapshots at versions 10 and 20, so its steady-state window holds one
    parser.add_argument("--batches", type=int, default=22)
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
                        m = run_system(system, workload, data, args.batches)
                        if m is not None:
                            runs[system].append(m)
                for system in systems:
                    table[(system, workload, size)] = best(runs[system]) if runs[system] else None
                    m = table[(system, workload, size)]
                    shown = (
                        "failed" if m is None else
                        f"{mib(m.bytes_per_batch)}/batch, batch {m.batch_wall:.2f} s wall "
                        f"{m.batch_cpu:.2f} s cpu, recovery {m.recovery:.2f} s"
                    )  # fmt: skip
                    print(f"S={size:>9,} {workload:<9} {system:<10} {shown}", flush=True)
                    if m is not None and m.detail:
                        print(f"    {system} detail: {_detail(m.detail, args.batches)}",
                              flush=True)
            shutil.rmtree(data, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"load after: {os.getloadavg()}")
    checks = []
    for workload in workloads:
        for size in sizes:
            ours = table.get(("ours", workload, size))
            ss = table.get(("ss-rocksdb", workload, size))
            for name, m, how in ((("ours", ours, "materialisation amortised"),
                                  ("ss-rocksdb", ss, "after its first snapshot, the next "
                                   "snapshot included"))):
                if m is not None:
                    steady = steady_bytes_per_batch(m, args.batches)
                    shown = "not measured (pass more --batches)" if steady is None else mib(steady)
                    parts = (m.detail or {}).get("steady_bytes_per_batch")
                    if parts:
                        shown += (f" (changelogs {mib(parts['changelog'])} + snapshots "
                                  f"{mib(parts['snapshot'])})")
                    print(f"{workload} S={size:,} {name} steady-state bytes/batch ({how}): "
                          f"{shown}")
            for label, limit, get in (
                ("bytes/batch", 1.0, lambda m: steady_bytes_per_batch(m, args.batches)),
                ("batch wall", 1.5, lambda m: m.batch_wall),
                ("recovery", 1.0, lambda m: m.recovery),
            ):
                if ours is None or ss is None or get(ss) is None:
                    checks.append(False)
                    print(f"{workload} S={size:,} {label} <= {limit}x SS RocksDB: MISSED "
                          "(not measured)")  # fmt: skip
                    continue
                ratio = get(ours) / get(ss)
                ok = ratio <= limit
                checks.append(ok)
                print(f"{workload} S={size:,} {label}: {ratio:.2f}x SS RocksDB "
                      f"(target <= {limit}x): {'ok' if ok else 'MISSED'}")  # fmt: skip
    if len(sizes) > 1:
        small, large = min(sizes), max(sizes)
        fixed = args.changed is not None
        for workload in workloads:
            for system in ("ss-rocksdb", "ours"):
                a, b = table.get((system, workload, small)), table.get((system, workload, large))
                for label, get in (("batch wall", lambda m: m.batch_wall),
                                   ("bytes/batch", lambda m: m.bytes_per_batch)):
                    if system != "ours":
                        if a is not None and b is not None:
                            print(f"{workload} growth S={small:,}->{large:,} {label} "
                                  f"(ss-rocksdb, for reference): {get(b) / get(a):.2f}x")
                        continue
                    name = (f"{workload} growth S={small:,}->{large:,} {label} at "
                            f"{args.changed:,} changed keys") if fixed else None
                    if name is None:
                        print(f"{workload} growth {label}: not checked (pass --changed to fix "
                              "the number of changed keys)")
                        continue
                    if a is None or b is None:
                        checks.append(False)
                        print(f"{name} <= 1.3x: MISSED (not measured)")
                        continue
                    ratio = get(b) / get(a)
                    checks.append(ratio <= 1.3)
                    print(f"{name}: {ratio:.2f}x (target <= 1.3x): "
                          f"{'ok' if ratio <= 1.3 else 'MISSED'}")
    print(f"targets: {sum(checks)}/{len(checks)} met")


if __name__ == "__main__":
    main()
