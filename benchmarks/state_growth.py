"""State growth: our keyed stage against Spark Structured Streaming with the RocksDB state store
(changelog checkpointing), measured as the targets of issue 28 name them.

Systems, each in its own process, interleaved, on the same Parquet batches, checkpoint on
local disk, ``local[2]``, the same session options: those our sessions set on a local master
(``_common.LOCAL_SESSION_CONF``: the driver JVM's G1 returns idle heap and compiles with C1
only; Spark's Python daemon as our sessions run it) and the project's class archive:

- ``ss-rocksdb``: Structured Streaming, ``RocksDBStateStoreProvider`` with changelog
  checkpointing; a snapshot every ``--ss-min-deltas`` versions
  (``spark.sql.streaming.stateStore.minDeltasForSnapshot``, Spark's default 10), uploaded by
  the maintenance task every ``SS_MAINTENANCE_INTERVAL``;
- ``ours``: ``StatefulRunner`` with the click events' keyed ``user_activity`` stage
  (``keyed_parallelism`` 2, ``max_parallelism`` 128, the default ``FullSnapshotPolicy``: a
  range's chain is replaced by a snapshot once its change files outgrow its base).

Workload: the full per-key aggregate (count, decimal(22,2) sum, min and max event time),
update mode. Batch 0 holds S keys (the initial state, not timed); every later batch changes
1% of S (``--changed`` fixes the number). After the run each system's final state is read
back (ours: ``pipelines.read_state``; SS: Spark's ``statestore`` data source) and compared
with an independent recomputation in pyarrow (made once per size, kept beside the batches).

Per system and S:

- bytes written per batch: MEASURED, the growth of the checkpoint directory's files listed
  before and after each batch (snapshots, full snapshots and SS's maintenance uploads
  included), summed over the timed batches and divided by their number. The window must hold
  a full snapshot of every range of ours and a snapshot of every SS state partition (the
  coverage line says whether it did; if not, the bytes target is MISSED: pass more
  ``--batches``);
- batch wall: median over the timed batches;
- recovery: a new process restarting from a copy of the checkpoint as it was after batch b
  and processing batch b+1, timed from process start (interpreter, imports, SparkSession,
  restore, one batch) and from the runner's (query's) start, at the best point (the shortest
  chain of change files after a snapshot) and the worst (the longest chain; SS's from its
  steady cycle, ``choose_points``) of the window.
  The worst point, the target's, is recovered ``--recoveries`` times per system (default
  3), the systems alternating in turns (ours, SS; SS, ours; ...), and its figure is the
  median: a single restart's wall moves by ±10% between runs on a quiet machine, and the
  machine's state drifts between two systems' single recoveries (docs/benchmarks.md). The
  repeats run only where they could change a verdict: when the first pair leaves every
  recovery ratio with a target (the worst point's; at 8M the recoveries' peak) further than
  ``REPEAT_BAND`` (0.15) from it, that pair decides (a line says so);
- peak memory: RSS and PSS summed over the process tree (JVM, Python daemon and workers),
  sampled every 0.2 s, over the run and the recoveries; printed by phase too (the run's
  initial state, its timed batches, each recovery), each with the split of its peak sample
  by process (the JVM, the driver's Python, the daemon, the workers). A recovery's peak is
  the highest of all its recoveries (not a median: a peak is what a machine must hold).

With more than one S, ours' growth at ``GROWTH_CHANGED`` changed keys per batch from the
smallest to the largest S (batch wall ratio) is measured in two extra workers, alive together,
their timed batches interleaved one at a time (so that a drift of the machine's speed reaches
both: run one after the other, the pair's ratio moved between 0.90x and 1.32x across rounds):
the median of the steady batches, ``GROWTH_BATCHES`` after the initial state less the first
``GROWTH_WARMUP``.
Those first batches pay, once, for the initial state's size, not for the batch's: the operating
system writes back the ~0.7 GB the initial state left dirty at 8M (local stores, checkpoint,
shuffle files) while they run, and until the workers of an executor shared verified files,
each Python worker hashed (CRC-32) the 236 MB segment the other had written. At 8M they took
2-4x the later batches, so a median of 10 batches measured them, not the steady batch.
Their walls are printed too (``warm-up``), so nothing is hidden.

    python benchmarks/state_growth.py [--sizes 1000000,4000000,8000000] [--batches 110]
        [--changed N] [--ss-min-deltas 10] [--recoveries 3] [--quick] [--growth-only]

``--quick``: a smoke run (20,000 keys, 50% changed, 20 batches, SS snapshot every 4 versions,
growth from 20,000 to 40,000 keys). ``--growth-only``: the growth runs alone (the smallest and
the largest of ``--sizes``), its one target. The last line is ``targets: N/M met``.
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import (  # noqa: E402
    LOCAL_SESSION_CONF,
    SERIALIZER_RESETS,
    PeakMemory,
    PhasePeak,
    class_archive_options,
    rocksdb_session,
    tree_cpu_seconds,
)

SYSTEMS = ("ss-rocksdb", "ours")
SHUFFLE_PARTITIONS = 4
SS_MAINTENANCE_INTERVAL = "2s"
RUN_INITIAL = "run's initial state"  # memory phases: process start, session and batch 0
RUN_BATCHES = "run's timed batches"
KEYED_PARALLELISM = 2  # key group ranges of our keyed stage: one per core of local[2]
GROWTH_CHANGED = 10_000
GROWTH_BATCHES = 30
GROWTH_WARMUP = 5  # batches after the initial state left out of the growth median (module doc)
STAGE = "user_activity"
EVENT_SCHEMA = pa.schema(
    [
        ("event_id", pa.string()),
        ("user_id", pa.string()),
        ("event_ts", pa.timestamp("us", tz="UTC")),
        ("amount", pa.decimal128(12, 2)),
    ]
)
STATE_NAMES = ["user_id", "event_count", "amount_sum", "first_seen", "last_seen"]
SUM_TYPE = pa.decimal128(22, 2)
START = np.datetime64("2026-10-01T00:00:00", "us")
TARGETS = {"bytes/batch": 0.3, "batch wall": 0.7, "recovery (worst point)": 0.8,
           "peak RSS": 1.0}  # fmt: skip
# The issue names the recovery's own peak at 8M ("in the run and in recovery"): a target
# there; at the other sizes it is printed without one.
RECOVERY_PEAK_TARGET, RECOVERY_PEAK_SIZES = 1.0, (8_000_000,)
# A first pair of recoveries at the worst point this far from every target decides alone: single
# pairs' ratios at 1M moved between 0.68x and 0.87x across runs (docs/benchmarks.md)
REPEAT_BAND = 0.15
GROWTH_TARGET = 1.3
# A change file or a full snapshot of one key group range, in our shared directory.
OURS_STATE_FILE = re.compile(r"-kg(\d+)-(\d+)-([bm])\d+-a\d+-")


# --- data ----------------------------------------------------------------------------------


def _ids(prefix: str, numbers: np.ndarray) -> pa.Array:
    padded = pc.utf8_lpad(pc.cast(pa.array(numbers), pa.string()), width=9, padding="0")
    return pc.binary_join_element_wise(pa.scalar(prefix), padded, "")


def _decimal_cents(cents: np.ndarray) -> pa.Array:
    """Integer cents as decimal(12, 2), exactly: a decimal128 is the unscaled value as a
    16-byte little-endian integer (the high word the sign's extension)."""
    words = np.empty((len(cents), 2), np.int64)
    words[:, 0], words[:, 1] = cents, np.where(cents < 0, -1, 0)
    return pa.Array.from_buffers(EVENT_SCHEMA.field("amount").type, len(cents),
                                 [None, pa.py_buffer(words.tobytes())])


def write_batches(directory: Path, keys: int, batches: int, changed: int, seed: int = 7) -> None:
    """Batch 0: one event per key (the initial state). Batches 1..n+1 (the last one only for
    recovery): ``changed`` keys drawn at random, one event each, in that batch's minute."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for b in range(batches + 2):
        ids = np.arange(keys) if b == 0 else rng.choice(keys, size=changed, replace=False)
        count = len(ids)
        ts = START + np.timedelta64(b * 60, "s") + rng.integers(0, 60_000_000, count).astype(
            "timedelta64[us]")
        cents = rng.integers(-50_000, 500_000, count)
        table = pa.table(
            {
                "event_id": _ids(f"e{b:05d}-", ids),
                "user_id": _ids("u", ids),
                "event_ts": pa.array(ts, EVENT_SCHEMA.field("event_ts").type),
                "amount": _decimal_cents(cents),
            },
            schema=EVENT_SCHEMA,
        )
        pq.write_table(table, directory / f"batch-{b:05d}.parquet")


def expected_state(data: Path, upto: int) -> pa.Table:
    """The per-key aggregate over batches 0..upto, recomputed with pyarrow alone, once per
    data directory: the first system's check keeps it there (``expected-state-<upto>``), the
    other's reads it (at 8M keys a recomputation took 16 s)."""
    kept = data / f"expected-state-{upto}.parquet"
    if kept.exists():
        return pq.read_table(kept)
    expected = _recomputed_state(data, upto)
    partial = kept.with_name(f".{kept.name}.tmp")
    pq.write_table(expected, partial)
    os.replace(partial, kept)
    return expected


def _recomputed_state(data: Path, upto: int) -> pa.Table:
    events = pa.concat_tables(pq.read_table(data / f"batch-{b:05d}.parquet")
                              for b in range(upto + 1))
    events = events.set_column(3, "amount", events.column("amount").cast(SUM_TYPE))
    state = events.group_by("user_id", use_threads=False).aggregate(
        [([], "count_all"), ("amount", "sum"), ("event_ts", "min"), ("event_ts", "max")])
    return _canonical(pa.table([state.column(n) for n in ("user_id", "count_all", "amount_sum",
                                                          "event_ts_min", "event_ts_max")],
                               names=STATE_NAMES))


def _canonical(table: pa.Table) -> pa.Table:
    table = table.select(STATE_NAMES)
    return table.cast(pa.schema([
        ("user_id", pa.string()), ("event_count", pa.int64()), ("amount_sum", SUM_TYPE),
        ("first_seen", EVENT_SCHEMA.field("event_ts").type),
        ("last_seen", EVENT_SCHEMA.field("event_ts").type),
    ])).sort_by("user_id")  # fmt: skip


def compare_state(actual: pa.Table, expected: pa.Table) -> str:
    actual = _canonical(actual)
    if actual.equals(expected):
        return f"equal to the recomputation ({expected.num_rows:,} keys)"
    if actual.num_rows != expected.num_rows:
        return f"DIFFERENT: {actual.num_rows:,} keys, recomputation {expected.num_rows:,}"
    for name in STATE_NAMES:
        same = pc.equal(actual.column(name), expected.column(name))
        wrong = len(same) - pc.sum(pc.fill_null(same, False).cast(pa.int64())).as_py()
        if wrong:
            return f"DIFFERENT: {wrong:,} keys differ in {name}"
    return "DIFFERENT"


# --- the checkpoint directory ---------------------------------------------------------------


def listing(root: Path) -> dict[str, int]:
    """Size of every file under ``root``, by path relative to it."""
    sizes = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                sizes[os.path.relpath(path, root)] = os.path.getsize(path)
            except OSError:
                continue  # deleted meanwhile (retention, SS's maintenance)
    return sizes


def written_between(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Bytes that appeared (new files, or files that grew) between two listings."""
    return {p: s - before.get(p, 0) for p, s in after.items() if s > before.get(p, 0)}


def link_copy(source: Path, target: Path) -> None:
    """The directory as it is now, by hard links (checkpoint files are immutable once
    written; retention and maintenance delete the original links, not the copy's)."""
    for dirpath, _, files in os.walk(source):
        rel = os.path.relpath(dirpath, source)
        os.makedirs(target / rel, exist_ok=True)
        for name in files:
            try:
                os.link(os.path.join(dirpath, name), target / rel / name)
            except FileNotFoundError:
                continue


class Chains:
    """Per range (ours) or state partition (SS), how many change files a restore would
    replay after the newest snapshot: the chain's length, tracked batch by batch."""

    def __init__(self) -> None:
        self.length: dict[str, int] = {}
        self.snapshots: dict[str, int] = {}  # snapshots written in the timed window

    def ours(self, new: dict[str, int]) -> None:
        changes: dict[str, int] = {}
        for path in new:
            if (m := OURS_STATE_FILE.search(os.path.basename(path))) and "shared" in path:
                key = f"kg{m[1]}-{m[2]}"
                if m[3] == "m":
                    self.length[key] = 0
                    self.snapshots[key] = self.snapshots.get(key, 0) + 1
                else:
                    changes[key] = changes.get(key, 0) + 1
        for key, n in changes.items():
            self.length[key] = self.length.get(key, 0) + n
            self.snapshots.setdefault(key, 0)

    def ss(self, files: dict[str, int], new: dict[str, int], version: int) -> None:
        """SS: ``state/<op>/<partition>/<version>.changelog`` and ``<version>.zip`` (a
        snapshot, uploaded by maintenance some time after its version's commit)."""
        latest: dict[str, int] = {}
        for path in files:
            parts = Path(path).parts
            if len(parts) == 4 and parts[0] == "state" and parts[3].endswith(".zip"):
                key = f"{parts[1]}/{parts[2]}"
                latest[key] = max(latest.get(key, 0), int(parts[3].split(".")[0]))
            elif len(parts) == 4 and parts[0] == "state" and parts[3].endswith(".changelog"):
                latest.setdefault(f"{parts[1]}/{parts[2]}", 0)
        for key, snap in latest.items():
            self.length[key] = version - snap
            self.snapshots.setdefault(key, 0)
        for path in new:
            parts = Path(path).parts
            if len(parts) == 4 and parts[0] == "state" and parts[3].endswith(".zip"):
                key = f"{parts[1]}/{parts[2]}"
                self.snapshots[key] = self.snapshots.get(key, 0) + 1

    def total(self) -> int:
        return sum(self.length.values())


def kind_of(system: str, path: str) -> str:
    name = os.path.basename(path)
    if system == "ours":
        if name == "_metadata":
            return "metadata"
        if m := OURS_STATE_FILE.search(name):
            return "full_snapshot" if m[3] == "m" else "change"
        return "other"
    if path.startswith("state") and (".zip" in name or f"{os.sep}SSTs{os.sep}" in path):
        return "snapshot"
    if path.startswith("state") and ".changelog" in name:
        return "changelog"
    return "other"


# --- workers (one process each) -------------------------------------------------------------


def _spark(app: str, ss_min_deltas: int, on_context=None):
    # Both JVMs get our local sessions' options (peak RSS measures what each system needs,
    # not how much heap G1 left committed; C1 only) and map the project's class archive when
    # it exists (pipelines.class_archive: our sessions' JVMs do): neither system's result is
    # the other's JVM setting. ``on_context``: ours' warm-up, once the context exists.
    return rocksdb_session(app, ss_min_deltas, shuffle_partitions=SHUFFLE_PARTITIONS,
                           maintenance_interval=SS_MAINTENANCE_INTERVAL,
                           driver_java_options=(
                               f"{LOCAL_SESSION_CONF['spark.driver.extraJavaOptions']} "
                               f"{class_archive_options()}").strip(),
                           conf=LOCAL_SESSION_CONF | SERIALIZER_RESETS, on_context=on_context)


def _ss_query(spark, feed: Path, checkpoint: Path):
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    events = (
        spark.readStream.schema(from_arrow_schema(EVENT_SCHEMA))
        .option("maxFilesPerTrigger", 1).parquet(str(feed))
    )  # fmt: skip
    result = events.groupBy("user_id").agg(
        F.count(F.lit(1)).alias("event_count"), F.sum("amount").alias("amount_sum"),
        F.min("event_ts").alias("first_seen"), F.max("event_ts").alias("last_seen"),
    )  # fmt: skip
    return (
        result.writeStream.format("noop").outputMode("update")
        .option("checkpointLocation", str(checkpoint)).start()
    )  # fmt: skip


def _feed(batch: Path, feed: Path) -> None:
    """Land one batch file where the stream source looks (atomically, by rename)."""
    tmp = feed / f".{batch.name}.tmp"
    shutil.copyfile(batch, tmp)
    os.replace(tmp, feed / batch.name)


def _ss_state(spark, checkpoint: Path) -> pa.Table:
    """SS's final state through Spark's ``statestore`` data source: the aggregation buffer
    per key (count; decimal sum and its isEmpty flag; min; max), in that order."""
    frame = spark.read.format("statestore").load(str(checkpoint))
    value = frame.schema["value"].dataType
    fields = [f.name for f in value.fields if f.dataType.typeName() != "boolean"]
    if len(fields) != 4:
        raise ValueError(f"unexpected SS aggregation buffer {value.simpleString()}")
    rows = frame.selectExpr("key.user_id AS user_id",
                            *[f"value.`{f}` AS `{n}`" for f, n in zip(fields, STATE_NAMES[1:],
                                                                      strict=True)])
    return rows.toArrow() if hasattr(rows, "toArrow") else pa.Table.from_pandas(rows.toPandas())


def _ours_pipeline(landing: Path, names: list[str]):
    from pipelines import FileSource, StatefulPipeline
    from pipelines.examples.click_events import KEYED_STAGES

    return StatefulPipeline(
        name="state_growth_keyed",
        stages=[s for s in KEYED_STAGES if s.name == STAGE],
        source=FileSource(url=str(landing) + "/{partition}", schema=EVENT_SCHEMA),
        partitions=names,  # static keys: a restart that imports no Dagster, as SS's
        checkpoint_interval=1,
        max_retained_checkpoints=3,
        max_parallelism=128,
        keyed_parallelism=KEYED_PARALLELISM,
    )


def _land(data: Path, work: Path) -> tuple[Path, list[str]]:
    """One static partition per batch file (hard links)."""
    files = sorted(data.glob("batch-*.parquet"))
    names = [f"b{b:05d}" for b in range(len(files))]
    landing = work / "landing"
    for name, batch in zip(names, files, strict=True):
        (landing / name).mkdir(parents=True, exist_ok=True)
        if not (landing / name / batch.name).exists():
            os.link(batch, landing / name / batch.name)
    return landing, names


class System:
    """What the worker drives: ``start`` (the runner or the query), ``batch(b)``, the final
    state, ``stop``."""

    def __init__(self, name: str, data: Path, work: Path, ss_min_deltas: int,
                 spark=None) -> None:
        self.name, self.data, self.work = name, data, work
        self.checkpoint = work / "checkpoint"
        # ``spark``: a session started already (ours' recovery). Asked for again, a session's
        # builder sets its options on it, which builds its SessionState there and then.
        self.spark = spark if spark is not None else _spark(f"state_growth-{name}",
                                                            ss_min_deltas)
        self.spark.sparkContext.setLogLevel("ERROR")
        self.files = sorted(data.glob("batch-*.parquet"))

    def start(self, local_dir: str) -> None:
        if self.name == "ours":
            from checkpoint_storage import FileSystemCheckpointStorage
            from pipelines import StatefulRunner

            landing, self.names = _land(self.data, self.work)
            self.pipeline = _ours_pipeline(landing, self.names)
            self.storage = FileSystemCheckpointStorage(str(self.checkpoint))
            self.runner = StatefulRunner(self.spark, self.storage, self.pipeline,
                                         lease_owner="state_growth", keyed_local_dir=local_dir)
        else:
            self.feed = self.work / "feed"
            self.feed.mkdir(parents=True, exist_ok=True)
            self.query = _ss_query(self.spark, self.feed, self.checkpoint)

    def batch(self, b: int) -> None:
        if self.name == "ours":
            self.runner.run([self.names[b]])
        else:
            _feed(self.files[b], self.feed)
            self.query.processAllAvailable()

    def state(self) -> pa.Table:
        if self.name == "ours":
            from pipelines import job_id_for, read_state

            latest = self.storage.create_checkpoint_storage(
                job_id_for(self.pipeline.name)).latest_completed_checkpoint()
            return read_state(latest.external_pointer, STAGE)
        self.query.stop()
        return _ss_state(self.spark, self.checkpoint)

    def stop(self) -> None:
        if self.name != "ours" and self.query.isActive:
            self.query.stop()


def _say(tag: str, value) -> None:
    print(f"{tag} {json.dumps(value)}", flush=True)


def worker_run(args, system: System) -> None:
    """The initial state, then the timed batches: wall, CPU, bytes written and the chains
    after each; a hard-linked copy of the checkpoint after each batch for the recoveries."""
    system.start(str(system.work / "local-run"))
    system.batch(0)
    print(f"PHASE {RUN_BATCHES}", flush=True)  # the parent's memory peaks, by phase
    # ``--stepped``: each timed batch waits for the parent's line on stdin and says when it
    # is done, so that the parent can interleave two workers' batches (the growth runs)
    step = sys.stdin.readline if args.stepped else None
    chains, before = Chains(), listing(system.checkpoint)
    walls, cpus, written, lengths = [], [], [], []
    kinds: dict[str, int] = {}
    points = system.work / "points"
    for b in range(1, args.batches + 1):
        if step is not None:
            step()
        cpu0, t0 = tree_cpu_seconds(), time.perf_counter()
        system.batch(b)
        walls.append(time.perf_counter() - t0)
        if step is not None:
            print(f"STEP {b}", flush=True)
        cpus.append(tree_cpu_seconds() - cpu0)
        after = listing(system.checkpoint)
        new = written_between(before, after)
        if system.name == "ours":
            chains.ours(new)
        else:
            chains.ss(after, new, b + 1)  # version b+1: batch 0 committed version 1
        before = after
        written.append(sum(new.values()))
        for path, size in new.items():
            kinds[kind_of(system.name, path)] = kinds.get(kind_of(system.name, path), 0) + size
        lengths.append(chains.total())
        if args.points:
            link_copy(system.checkpoint, points / str(b))
    if system.name != "ours":
        # SS uploads snapshots in its maintenance task: what it uploads for the window's
        # versions belongs to the window (two maintenance intervals, then a last look).
        time.sleep(2 * float(SS_MAINTENANCE_INTERVAL.rstrip("s")) + 1)
        after = listing(system.checkpoint)
        new = written_between(before, after)
        chains.ss(after, new, args.batches + 1)
        written[-1] += sum(new.values())
        for path, size in new.items():
            kinds[kind_of(system.name, path)] = kinds.get(kind_of(system.name, path), 0) + size
    print("TIMED-END", flush=True)  # the parent stops sampling memory here
    result = {"walls": walls, "cpus": cpus, "written": written, "kinds": kinds,
              "chain_lengths": lengths, "snapshots": chains.snapshots}  # fmt: skip
    if args.points:
        try:
            result["state_check"] = compare_state(system.state(),
                                                  expected_state(system.data, args.batches))
        except Exception as exc:  # reported, not hidden: the check is a target's premise
            result["state_check"] = f"NOT CHECKED: {type(exc).__name__}: {exc}"[:300]
    system.stop()
    _say("RESULT", result)


class _SessionStart(threading.Thread):
    """Ours' session started in the background, its workers' warm-up started as soon as its
    SparkContext exists, as ``SparkResource.start`` does: the warm-up's job (the Python
    daemon's start, its workers' fork) runs beside the session's build and the runner's
    restore. The session's settings are SS's: only the moment the context is made apart
    from the session differs, which is the builder's own first step."""

    def __init__(self, app: str, ss_min_deltas: int) -> None:
        super().__init__(name="spark-session-start", daemon=True)
        self.app, self.ss_min_deltas = app, ss_min_deltas
        self.session = None
        self.stamps: dict[str, float] = {}

    def run(self) -> None:
        def warm_up(context) -> None:
            self.stamps["context_started"] = time.time()
            # imported here, not before the JVM's launch (the main thread has it by now)
            from pipelines.warm_up import warm_up_workers

            warm_up_workers(context)

        self.session = _spark(self.app, self.ss_min_deltas, on_context=warm_up)
        self.stamps["session_built"] = time.time()


def worker_recover(args, system_name: str, data: Path, work: Path) -> None:
    """A new process (its start stamped by the parent): SparkSession, restore from the
    checkpoint in place (the copy at batch ``args.point``), batch ``args.point + 1``. Ours
    starts its session in the background, then ``prefetch_local_stores`` (unless
    ``--no-prefetch``): the pipeline's imports and the local stores' rebuild overlap the JVM's
    start, as a restart of ``scripts/run`` on a ``local[*]`` master does."""
    local_dir = str(work / f"local-recover-{args.point}")
    prefetch = None
    stamps = {}  # the timeline (wall clock): printed, for the recovery's profile
    session = None
    if system_name == "ours":
        # As a restart through the product does (``SparkResource.start`` in ``pipelines.main``):
        # the JVM starts in the background, and the workers' warm-up as soon as its
        # SparkContext exists, while the driver imports the pipeline's modules and starts the
        # prefetch; ``System`` below is handed that session. SS's worker has nothing to
        # overlap with its session's start, and no Python workers.
        import pyspark.sql  # noqa: F401  (here: the JVM's launch waits for no other import)

        session_start = _SessionStart(f"state_growth-{system_name}", args.ss_min_deltas)
        session_start.start()
        if args.prefetch:
            from checkpoint_storage import FileSystemCheckpointStorage
            from pipelines import prefetch_local_stores

            pipeline = _ours_pipeline(*_land(data, work))
            stamps["prefetch_start"] = time.time()
            prefetch = prefetch_local_stores(
                FileSystemCheckpointStorage(str(work / "checkpoint")), pipeline,
                local_dir=local_dir)
        session_start.join()
        session = session_start.session
        stamps |= session_start.stamps
    system = System(system_name, data, work, args.ss_min_deltas, spark=session)
    started = time.time()
    stamps["session_ready"] = started
    system.start(local_dir)
    system.batch(args.point + 1)
    done = time.time()
    system.stop()
    prefetched = None if prefetch is None else [
        {"outcome": p.outcome, "seconds": round(p.seconds, 2)} for p in prefetch.wait()]
    _say("RESULT", {"runner_start": started, "done": done, "prefetched": prefetched,
                    "stamps": stamps, "cpu": _thread_cpu()})


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process, its main thread, its live other threads
    (Arrow's pool, py4j's; a finished thread's, e.g. the prefetch's, counts in the process
    only) and its children (the JVM): where a recovery's CPU went."""
    tick, cpu = os.sysconf("SC_CLK_TCK"), {}
    paths = {f"/proc/self/task/{t}/stat": "main" if int(t) == os.getpid() else "other threads"
             for t in os.listdir("/proc/self/task")}
    with open(f"/proc/self/task/{os.getpid()}/children") as f:
        paths |= {f"/proc/{c}/stat": "children (JVM)" for c in f.read().split()}
    times = os.times()
    cpu["process"] = round(times.user + times.system, 2)
    for path, label in paths.items():
        try:
            with open(path) as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rindex(")") + 2:].split()
        cpu[label] = round(cpu.get(label, 0) + (int(fields[11]) + int(fields[12])) / tick, 2)
    return cpu


# --- driver ---------------------------------------------------------------------------------


@dataclass
class Measured:
    walls: list[float]
    written: list[int]
    kinds: dict[str, int]
    chain_lengths: list[int]
    snapshots: dict[str, int]
    state_check: str
    peak_rss: int
    peak_pss: int
    recovery: dict[str, "Recoveries"] = field(default_factory=dict)  # point -> its runs
    phases: dict[str, PhasePeak] = field(default_factory=dict)  # phase -> its peak

    @property
    def batch_wall(self) -> float:
        return statistics.median(self.walls)

    @property
    def bytes_per_batch(self) -> float:
        return sum(self.written) / len(self.written)


class Worker:
    """A worker process (this script with ``argv``): its stdout read a line at a time, its
    stderr kept in a file (not a pipe: Spark's log could fill it). It runs in a session of its
    own: a JVM that outlives its worker (it holds the stdout pipe, so reading to its end would
    wait for it: seen once after an 8M recovery) is killed with it by ``close``."""

    def __init__(self, argv: list[str], stdin=None) -> None:
        self.argv = argv
        self.errors = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by close)
        self.started = time.time()
        self.proc = subprocess.Popen([sys.executable, __file__, *argv], stdin=stdin,
                                     stdout=subprocess.PIPE, stderr=self.errors, text=True,
                                     start_new_session=True)  # fmt: skip

    def until(self, prefix: str) -> str:
        """The rest of its next line that starts with ``prefix`` (a failure if it ends first)."""
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :]
        raise self._stopped()

    def step(self) -> None:
        """One timed batch of a ``--stepped`` worker."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        self.until("STEP ")

    def close(self, result: dict | None, timeout: float = 600) -> dict:
        """Wait for its end (its RESULT read: ``result``), kill what is left of its session;
        raises with its stderr's last lines if it failed."""
        try:
            if result is not None:
                self.proc.wait(timeout=timeout)
        finally:
            error = self._stopped()
        if self.proc.returncode != 0 or result is None:
            raise error
        return result

    def _stopped(self) -> RuntimeError:
        """Kill what is left of its session; the error that names its stderr's last lines."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.errors.seek(0)
        tail = " | ".join(self.errors.read().strip().splitlines()[-3:])
        self.errors.close()
        return RuntimeError(f"worker {' '.join(self.argv[:3])} failed "
                            f"({self.proc.returncode}): {tail}")


def spawn(argv: list[str], sample: bool = True,
          phase: str = "all") -> tuple[dict, float, PeakMemory | None]:
    """Run a worker; its RESULT, the wall clock at its start, and its memory peaks (sampled
    until it prints TIMED-END, or to its end), by phase: ``phase`` from its start, then the
    phase each ``PHASE <name>`` line it prints names."""
    worker = Worker(argv)
    peak = PeakMemory(worker.proc.pid, phase=phase) if sample else None
    result = None
    try:
        for line in worker.proc.stdout:
            if line.startswith("TIMED-END") and peak is not None:
                peak.active = False
            elif line.startswith("PHASE ") and peak is not None:
                peak.phase = line[len("PHASE ") :].strip()
            elif line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
                break  # the worker's last line
    finally:
        if peak is not None:
            peak.stop()
        worker.close(result)
    return result, worker.started, peak


def common_argv(system: str, data: Path, work: Path, args) -> list[str]:
    return ["--system", system, "--data", str(data), "--work", str(work),
            "--batches", str(args.batches), "--ss-min-deltas", str(args.ss_min_deltas),
            *([] if args.prefetch else ["--no-prefetch"])]


def choose_points(m: Measured, *, steady: bool = False) -> dict[str, int]:
    """Worst: the batch after which the chains are longest (``steady``: of the batches after
    the first snapshot in the window, when there is one). Best: the shortest chains after
    the first snapshot in the window (None without one).

    SS's worst point is chosen ``steady``: until its maintenance uploads a first snapshot,
    a restart replays the changelog of batch 0, the whole initial state (at 8M keys 57-73 s
    where a restart in its later cycles took ~35 s), so a longest chain that fell there (by
    the upload's timing) measured SS's start-up instead of its cycle, and a ratio of ours
    against it flattered ours. Ours' chains start from the initial state's change file
    as later ones start from a full snapshot (the same rows, read alike): its first cycle is
    its steady one."""
    lengths = m.chain_lengths
    reset = [i for i in range(1, len(lengths)) if lengths[i] < lengths[i - 1]]
    candidates = range(reset[0] if steady and reset else 0, len(lengths))
    worst = max(candidates, key=lambda i: (lengths[i], i))
    points = {"worst": worst + 1}
    if reset:
        best = min(range(reset[0], len(lengths)), key=lambda i: (lengths[i], i))
        points["best"] = best + 1
    return points


def recover(system: str, m: Measured, data: Path, work: Path, point: str, b: int, args) -> None:
    """Put the copy at batch ``b`` in place (a real copy: the recovery writes into it) and
    the stream source's directory as it was, then time a recovery process."""
    shutil.rmtree(work / "checkpoint", ignore_errors=True)
    shutil.copytree(work / "points" / str(b), work / "checkpoint")
    if system != "ours":
        for path in (work / "feed").glob("batch-*.parquet"):
            if int(path.stem.split("-")[1]) > b:
                path.unlink()
    name = f"recovery at the {point} point"
    result, started, peak = spawn(["recover", *common_argv(system, data, work, args),
                                   "--point", str(b)], phase=name)
    m.peak_rss, m.peak_pss = max(m.peak_rss, peak.rss), max(m.peak_pss, peak.pss)
    for phase, phase_peak in peak.phases.items():  # the highest of the point's recoveries
        if phase not in m.phases or phase_peak.rss > m.phases[phase].rss:
            m.phases[phase] = phase_peak
    m.recovery.setdefault(point, Recoveries(b, m.chain_lengths[b - 1])).runs.append(
        {"from_process_start": result["done"] - started,
         "from_runner_start": result["done"] - result["runner_start"],
         "peak_rss": peak.rss, "prefetched": result.get("prefetched")})


def recovery_ratios(size: int, measured: dict) -> dict[str, tuple[float, float]]:
    """The recoveries' ratios (ours / SS) that have a target, each with its target: the worst
    point's median from process start; at ``RECOVERY_PEAK_SIZES`` the recoveries' peak RSS
    (the highest of each system's recoveries). Only those both systems measured."""
    ours, ss = measured.get("ours"), measured.get("ss-rocksdb")
    if ours is None or ss is None:
        return {}
    ratios = {}
    if "worst" in ours.recovery and "worst" in ss.recovery:
        ratios["recovery (worst point)"] = (
            ours.recovery["worst"].median("from_process_start")
            / ss.recovery["worst"].median("from_process_start"),
            TARGETS["recovery (worst point)"])
    if size in RECOVERY_PEAK_SIZES and ours.recovery and ss.recovery:
        ratios["peak RSS in recovery"] = (recovery_peak_ratio(ours, ss), RECOVERY_PEAK_TARGET)
    return ratios


def recovery_peak_ratio(ours: "Measured", ss: "Measured") -> float:
    """Ours' highest recovery peak RSS over SS's (their runs' peaks aside: the recoveries
    alone)."""
    return (max(p.peak_rss for p in ours.recovery.values())
            / max(p.peak_rss for p in ss.recovery.values()))


def undecided(size: int, measured: dict) -> bool:
    """Whether more recoveries at the worst point could change a verdict: a ratio with a
    target is within ``REPEAT_BAND`` of it (or none is measured yet)."""
    ratios = recovery_ratios(size, measured)
    return not ratios or any(abs(r - t) <= REPEAT_BAND for r, t in ratios.values())


def recovery_turns(order: list[str], recoveries: int) -> list[tuple[str, str]]:
    """The recoveries' (point, system) in the order they run: the best point once per system,
    then the worst ``recoveries`` times per system, the systems taking turns first (``order``,
    then reversed, ...), so that a drift of the machine's speed reaches both alike."""
    turns = [("best", system) for system in order]
    for i in range(recoveries):
        turns += [("worst", system) for system in (order if i % 2 == 0 else order[::-1])]
    return turns


@dataclass
class Recoveries:
    """A point's recoveries of one system: ``runs`` hold each one's ``from_process_start``,
    ``from_runner_start`` (s), ``peak_rss`` (bytes) and ``prefetched`` (ours)."""

    batch: int
    chain: int
    runs: list[dict] = field(default_factory=list)

    def median(self, figure: str) -> float:
        return statistics.median(r[figure] for r in self.runs)

    @property
    def peak_rss(self) -> int:
        return max(r["peak_rss"] for r in self.runs)


def measure_size(size: int, changed: int, base: Path, args, order: list[str]) -> dict:
    data = base / f"s{size}"
    write_batches(data, size, args.batches, changed)
    works = {s: Path(tempfile.mkdtemp(prefix=f"state_growth-{s}-", dir=base)) for s in order}
    measured: dict[str, Measured] = {}
    try:
        for system in order:
            result, _, peak = spawn(["run", *common_argv(system, data, works[system], args),
                                     "--points"], phase=RUN_INITIAL)
            measured[system] = Measured(
                result["walls"], result["written"], result["kinds"], result["chain_lengths"],
                result["snapshots"], result["state_check"], peak.rss, peak.pss,
                phases=dict(peak.phases))
            print(f"  S={size:,} {system}: run done, peak RSS {mib(peak.rss)}, load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
        points = {s: choose_points(measured[s], steady=s == "ss-rocksdb") for s in order}
        turns = recovery_turns(order, args.recoveries)
        first_pair_done = 2 * len(order)  # the best point once per system, one worst pair
        for i, (point, system) in enumerate(turns):
            if i == first_pair_done and not undecided(size, measured):
                ratios = ", ".join(f"{label} {r:.2f}x (target {t}x)" for label, (r, t)
                                   in recovery_ratios(size, measured).items())
                print(f"  S={size:,}: the worst point recovered once per system: {ratios}, "
                      f"each further than {REPEAT_BAND} from its target", flush=True)
                break
            if point in points[system]:
                recover(system, measured[system], data, works[system], point,
                        points[system][point], args)
    finally:
        for work in works.values():
            shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)
    return measured


def steady_wall(walls: list[float], warmup: int) -> float:
    """The median batch wall without the first ``warmup`` batches (the module doc says why)."""
    if len(walls) <= warmup:
        raise ValueError(f"{len(walls)} growth batches leave none after the {warmup} warm-up "
                         "batches: pass more --growth-batches or fewer --growth-warmup")
    return statistics.median(walls[warmup:])


def measure_growth(sizes: list[int], base: Path, args) -> dict[int, float]:
    """Ours' steady batch wall (``steady_wall``) at GROWTH_CHANGED changed keys, at the
    smallest and largest S: one worker each, both alive, their initial states built side by
    side, then their timed batches interleaved one at a time (the first in turn alternating),
    so that the machine's drift reaches both alike. Prints each size's warm-up walls and its
    median of all batches."""
    growth_args = argparse.Namespace(**{**vars(args), "batches": args.growth_batches})
    pair = (min(sizes), max(sizes))
    datas = {size: base / f"g{size}" for size in pair}
    works = {size: Path(tempfile.mkdtemp(prefix="state_growth-g-", dir=base)) for size in pair}
    workers: dict[int, Worker] = {}
    results: dict[int, dict | None] = dict.fromkeys(pair)
    try:
        for size in pair:
            write_batches(datas[size], size, growth_args.batches, args.growth_changed)
        for size in pair:
            workers[size] = Worker(["run", *common_argv("ours", datas[size], works[size],
                                                        growth_args), "--stepped"],
                                   stdin=subprocess.PIPE)
        for size in pair:
            workers[size].until(f"PHASE {RUN_BATCHES}")
        for b in range(growth_args.batches):
            for size in (pair if b % 2 == 0 else pair[::-1]):
                workers[size].step()
        for size in pair:
            results[size] = json.loads(workers[size].until("RESULT "))
    finally:
        for size, worker in workers.items():
            if results[size] is None:  # the error that stopped the pair is raised already
                with contextlib.suppress(Exception):
                    worker.close(None)
            else:
                worker.close(results[size])
        for path in (*works.values(), *datas.values()):
            shutil.rmtree(path, ignore_errors=True)
    walls = {}
    for size in pair:
        batch_walls = results[size]["walls"]
        walls[size] = steady_wall(batch_walls, args.growth_warmup)
        warmup = ", ".join(f"{w:.2f}" for w in batch_walls[:args.growth_warmup])
        print(f"  growth S={size:,}: warm-up batches {warmup} s; steady median "
              f"{walls[size]:.2f} s over {len(batch_walls) - args.growth_warmup} batches (all "
              f"{statistics.median(batch_walls):.2f} s); load {os.getloadavg()[0]:.1f}",
              flush=True)
    return walls


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def recovery_figures(from_process_start: float, from_runner_start: float,
                     peak_rss: float) -> str:
    return (f"{from_process_start:.2f} s from process start, {from_runner_start:.2f} s from "
            f"the runner's start, peak RSS {mib(peak_rss)}")


def report(size: int, measured: dict[str, Measured], args) -> list[bool]:
    checks = []
    for system, m in measured.items():
        kinds = ", ".join(f"{k} {mib(v / args.batches)}" for k, v in sorted(m.kinds.items()))
        print(f"S={size:,} {system}: bytes/batch {mib(m.bytes_per_batch)} measured ({kinds}); "
              f"batch {m.batch_wall:.2f} s median; peak RSS {mib(m.peak_rss)} "
              f"(PSS {mib(m.peak_pss)}); final state {m.state_check}")
        for phase, peak in m.phases.items():
            print(f"    peak RSS of the {phase}: {peak.describe()}")
        snaps = ", ".join(f"{k} {v}" for k, v in sorted(m.snapshots.items()))
        print(f"    snapshots in the window: {snaps or 'none'}; longest chain "
              f"{max(m.chain_lengths)} files")
        for point, r in m.recovery.items():
            many = len(r.runs) > 1
            print(f"    recovery at the {point} point (after batch {r.batch}, chains "
                  f"{r.chain} files){f', median of {len(r.runs)}' if many else ''}: "
                  + recovery_figures(r.median("from_process_start"),
                                     r.median("from_runner_start"), r.peak_rss)
                  + (" (the highest)" if many else ""))
            for i, run in enumerate(r.runs, 1):
                # the ranges are built one after another: their sum is the prefetch's wall
                prefetched = run.get("prefetched")
                print(f"        {i}: "
                      + recovery_figures(run["from_process_start"], run["from_runner_start"],
                                         run["peak_rss"])
                      + (f"; local stores prefetched: "
                         f"{', '.join(p['outcome'] for p in prefetched)} "
                         f"({sum(p['seconds'] for p in prefetched):.2f} s)"
                         if prefetched else ""))
    ours, ss = measured.get("ours"), measured.get("ss-rocksdb")
    covered = ours is not None and ss is not None and all(
        v >= 1 for m in (ours, ss) for v in m.snapshots.values()) and all(
        m.snapshots for m in (ours, ss))
    print(f"S={size:,} window covers a snapshot of every range and SS partition: "
          f"{'yes' if covered else 'NO (pass more --batches)'}")
    correct = all(m.state_check.startswith("equal") for m in measured.values())
    figures = {
        "bytes/batch": (lambda m: m.bytes_per_batch, covered),
        "batch wall": (lambda m: m.batch_wall, True),
        "recovery (worst point)": (
            lambda m: m.recovery["worst"].median("from_process_start")
            if "worst" in m.recovery else None, True),
        "peak RSS": (lambda m: m.peak_rss, True),
    }
    for label, (get, valid) in figures.items():
        limit = TARGETS[label]
        a = get(ours) if ours else None
        b = get(ss) if ss else None
        if a is None or not b or not valid or not correct:
            why = "final state wrong" if not correct else "not measured"
            print(f"S={size:,} {label} <= {limit}x SS RocksDB: MISSED ({why})")
            checks.append(False)
            continue
        ratio = a / b
        checks.append(ratio <= limit)
        print(f"S={size:,} {label}: {ratio:.2f}x SS RocksDB (target <= {limit}x): "
              f"{'ok' if ratio <= limit else 'MISSED'}")
    if ours and ss and "worst" in ours.recovery and "worst" in ss.recovery:
        r = (ours.recovery["worst"].median("from_runner_start")
             / ss.recovery["worst"].median("from_runner_start"))
        print(f"S={size:,} recovery (worst point) from the runner's start: {r:.2f}x SS "
              "RocksDB (no target)")
    if ours and ss and ours.recovery and ss.recovery:
        # "peak RSS" above is each system's peak over its run and its recoveries (ours' is
        # its run's); this compares the recoveries alone
        r = recovery_peak_ratio(ours, ss)
        if size in RECOVERY_PEAK_SIZES and correct:
            checks.append(r <= RECOVERY_PEAK_TARGET)
            print(f"S={size:,} peak RSS in recovery: {r:.2f}x SS RocksDB (target <= "
                  f"{RECOVERY_PEAK_TARGET}x): {'ok' if r <= RECOVERY_PEAK_TARGET else 'MISSED'}")
        else:
            print(f"S={size:,} peak RSS in recovery: {r:.2f}x SS RocksDB (no target)")
    elif size in RECOVERY_PEAK_SIZES:
        print(f"S={size:,} peak RSS in recovery <= {RECOVERY_PEAK_TARGET}x SS RocksDB: MISSED "
              "(not measured)")
        checks.append(False)
    return checks


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", choices=("run", "recover"))
    parser.add_argument("--system", choices=SYSTEMS)
    parser.add_argument("--data")
    parser.add_argument("--work")
    parser.add_argument("--point", type=int)
    parser.add_argument("--points", action="store_true")
    parser.add_argument("--stepped", action="store_true")
    parser.add_argument("--sizes", default="1000000,4000000,8000000")
    # ~100 batches of 1% reach our first full snapshot (changes outgrow the base)
    parser.add_argument("--batches", type=int, default=110)
    parser.add_argument("--changed", type=float, default=0.01,
                        help="changed keys per batch: a fraction of S (< 1) or a number")
    parser.add_argument("--ss-min-deltas", type=int, default=10)
    parser.add_argument("--recoveries", type=int, default=3,
                        help="recoveries at the worst point per system (the median counts)")
    parser.add_argument("--growth-changed", type=int, default=GROWTH_CHANGED)
    parser.add_argument("--growth-batches", type=int, default=GROWTH_BATCHES)
    parser.add_argument("--growth-warmup", type=int, default=GROWTH_WARMUP)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--growth-only", action="store_true",
                        help="only the growth runs: the smallest and the largest of --sizes")
    parser.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                        help="recoveries of ours without prefetch_local_stores")
    args = parser.parse_args(argv)
    if args.command == "run":
        worker_run(args, System(args.system, Path(args.data), Path(args.work),
                                args.ss_min_deltas))
        return
    if args.command == "recover":
        worker_recover(args, args.system, Path(args.data), Path(args.work))
        return
    if args.quick:
        # half the keys per batch, 20 batches: each range's changes (~0.07 MiB a batch)
        # outgrow the policy's 1 MiB minimum base within the window, so that a
        # full snapshot (and a best point) is exercised
        args.sizes, args.batches, args.changed, args.ss_min_deltas = "20000", 20, 0.5, 4
        args.growth_changed, args.growth_batches, args.growth_warmup = 2000, 5, 2
    if args.recoveries < 1:
        parser.error("--recoveries must be at least 1")
    sizes = [int(s) for s in args.sizes.split(",")]
    growth_sizes = [20_000, 40_000] if args.quick else sizes
    if args.growth_only and len(growth_sizes) < 2:
        parser.error("--growth-only needs two --sizes at least: growth is the largest's steady "
                     "batch against the smallest's")
    print(f"state_growth: sizes {sizes}, {args.batches} batches, changed {args.changed} per "
          f"batch, SS minDeltasForSnapshot {args.ss_min_deltas}, maintenance every "
          f"{SS_MAINTENANCE_INTERVAL}, local[2]; load {os.getloadavg()}", flush=True)
    checks: list[bool] = []
    began = time.time()
    base = Path(tempfile.mkdtemp(prefix="state_growth-"))
    try:
        for i, size in enumerate([] if args.growth_only else sizes):
            changed = int(args.changed * size) if args.changed < 1 else int(args.changed)
            order = list(SYSTEMS) if i % 2 == 0 else list(reversed(SYSTEMS))
            measured = measure_size(size, max(1, changed), base, args, order)
            checks += report(size, measured, args)
        if len(growth_sizes) > 1:
            walls = measure_growth(growth_sizes, base, args)
            small, large = min(growth_sizes), max(growth_sizes)
            ratio = walls[large] / walls[small]
            checks.append(ratio <= GROWTH_TARGET)
            print(f"growth S={small:,}->{large:,} at {args.growth_changed:,} changed keys: "
                  f"steady batch (after {args.growth_warmup} warm-up) {walls[small]:.2f} -> "
                  f"{walls[large]:.2f} s, {ratio:.2f}x (target "
                  f"<= {GROWTH_TARGET}x): {'ok' if ratio <= GROWTH_TARGET else 'MISSED'}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"load after: {os.getloadavg()}; {(time.time() - began) / 60:.1f} min")
    print(f"targets: {sum(checks)}/{len(checks)} met")


if __name__ == "__main__":
    main()
