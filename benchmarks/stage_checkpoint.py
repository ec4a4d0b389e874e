"""A stage checkpoint and restore against Spark's own ways to write and read the same DataFrame,
with one local Spark session in one process.

Usage::

    .venv/bin/python benchmarks/stage_checkpoint.py [--rows 5000000] [--repeats 3]
        [--batch-sizes 10000,50000,100000,200000] [--no-sweep] [--no-breakdown]
        [--experiments] [--local-dir DIR] [--quick]

The session is ``resources.build_spark_session("local[2]", ...)`` (the project's
``DEFAULT_SPARK_CONF``, plus the UI off and a 2 GiB driver so that blocks are not evicted). The
data is one cached, materialized DataFrame of ``--rows`` rows: ``id`` (long), ``x`` (double,
``rand(1)``), ``s`` (string, ``user-<id % 100000>``), in ``spark.defaultParallelism``
partitions. Every path runs once as a warm-up (Python workers, imports, JIT, page cache), and
the restored state is checked against the DataFrame; then each path is timed ``--repeats``
times, the paths rotating which goes first per round. The best run counts; all runs are
printed, with the CPU seconds of the whole process tree (driver, JVM, Python workers), which a
busy machine disturbs less than wall time (JVM GC and JIT still vary it).

Writes:

- ours: ``StatefulRunner.checkpoint({"bench": df}, position)`` with a
  ``FileSystemCheckpointStorage`` on local disk: each partition task streams its Arrow batches
  as Parquet into a state stream (``pipelines.state_io.write_state_partition``), the driver
  collects the handles, writes ``_metadata`` and finalizes; older checkpoints are subsumed as
  in a run (``max_retained`` 3), so one discard is part of the time, as the overwrite's delete
  is for the Parquet path.
- ``df.write.mode("overwrite").parquet(dir)`` (the JVM writer, snappy like ours).
- ``df.checkpoint(eager=True)`` (reliable RDD checkpoint into ``sc.setCheckpointDir``).
- the floor: ``df.mapInArrow(f, "rows long").collect()`` where ``f`` consumes every batch and
  yields one row per partition: the JVM -> Python Arrow transfer that our path cannot avoid.

Targets: checkpoint <= 1.15x the floor, checkpoint <= 1.5x ``df.write.parquet``.

Restore, the same work on both sides: ``StatefulRunner.restore_states(metadata)`` reads and
verifies every state file on the executors and materializes the result with
``localCheckpoint(eager=True)``; the Parquet side is therefore
``spark.read.parquet(dir).localCheckpoint(eager=True)``. Both are then scanned once with
``.write.format("noop")`` (every column, from the local-checkpoint blocks), and the time covers
both steps. The blocks are released after each run, outside the timed part. Target: restore
<= 1.3x Parquet. ``spark.read.parquet(dir)`` straight into the noop sink, without the
localCheckpoint, is printed for reference (no target).

Then ``spark.sql.execution.arrow.maxRecordsPerBatch`` is swept (``spark.conf.set`` before each
measurement): checkpoint, floor and restore (of a checkpoint written with that batch size) for
each value, against the value in ``resources.spark.DEFAULT_SPARK_CONF``.

The breakdown (skip with ``--no-breakdown``) first times the checkpoint and the floor on a
2-row DataFrame (the fixed, per-checkpoint cost), then the executor functions themselves in
this process, without Spark, on one partition's share of the data in the configured batch
size: ``write_state_partition`` and ``read_state_partition`` as they are, the Parquet encoding
alone (into a null sink), and, as experiments in this process only (patched, never the
project's files), other Parquet compressions, ``use_dictionary=False``,
``dictionary_pagesize_limit`` and a larger state stream write buffer. ``--experiments`` also
runs the checkpoint and restore in Spark with Parquet writer options patched in the Python
workers, alternating with the path as it is.

``--quick`` is a smoke run: 500,000 rows, one repetition. The last line is "N/3 targets met".
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from unittest import mock

from _common import targets_line, tree_cpu_seconds

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# The Python workers import pipelines/ and checkpoint_storage/ too: they inherit PYTHONPATH.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
)

BATCH_KEY = "spark.sql.execution.arrow.maxRecordsPerBatch"
FLOOR_TARGET = 1.15  # checkpoint / no-op mapInArrow
PARQUET_TARGET = 1.5  # checkpoint / df.write.parquet
RESTORE_TARGET = 1.3  # restore_states / spark.read.parquet (+ localCheckpoint)
DEFAULT_ROWS = 5_000_000
QUICK_ROWS = 500_000
DEFAULT_BATCH_SIZES = (10_000, 50_000, 100_000, 200_000)
MIB = 1024 * 1024

# Parquet writer options tried by --experiments (patched into the Python workers).
EXPERIMENTS = {
    "use_dictionary=True (pyarrow's default)": {"use_dictionary": True},
    "zstd": {"compression": "zstd"},
}


# --- what runs in the Python workers (pickled by value: this file is __main__) -------------


def _consume(batches):
    """The floor's mapInArrow body: take every batch, write nothing."""
    import pyarrow as pa

    rows = 0
    for batch in batches:
        rows += batch.num_rows
    yield pa.RecordBatch.from_pydict({"rows": [rows]}, schema=pa.schema([("rows", pa.int64())]))


def _write_with_options(options, task, batches):
    """``write_state_partition`` with extra ``pq.ParquetWriter`` options (experiments only)."""
    import pyarrow.parquet as pq

    from pipelines import state_io

    original = pq.ParquetWriter

    class Writer(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **(kwargs | options))

    pq.ParquetWriter = Writer
    try:
        yield from state_io.write_state_partition(task, batches)
    finally:
        pq.ParquetWriter = original


# --- measuring ----------------------------------------------------------------------------


@dataclass
class Runs:
    wall: list[float]
    cpu: list[float | None]

    @property
    def best(self) -> float:
        return min(self.wall)

    @property
    def cpu_best(self) -> float | None:
        values = [c for c in self.cpu if c is not None]
        return min(values) if values else None


def timed(repeats: int, paths: dict) -> dict[str, Runs]:
    """Run every path ``repeats`` times, rotating which goes first; a path returns its own
    wall time (cleanup excluded) and may return ``(wall, cleanup)``."""
    names = list(paths)
    runs = {name: Runs([], []) for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            gc.collect()
            before = tree_cpu_seconds()
            result = paths[name]()
            after = tree_cpu_seconds()
            wall, cleanup = result if isinstance(result, tuple) else (result, None)
            runs[name].wall.append(wall)
            runs[name].cpu.append(None if before is None else after - before)
            if cleanup is not None:
                cleanup()
    return runs


def _dir_size(path: str) -> int:
    total = 0
    for parent, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(parent, f)) for f in files)
    return total


class Bench:
    """The session, the cached DataFrame, and every timed path."""

    def __init__(self, rows: int, base: str) -> None:
        import dagster as dg

        from checkpoint_storage import FileSystemCheckpointStorage
        from pipelines import (
            FileSource,
            SourcePosition,
            Stage,
            StatefulPipeline,
            StatefulRunner,
        )
        from resources import build_spark_session

        self.base = base
        self.spark = build_spark_session(
            "local[2]",
            "stage-checkpoint-bench",
            {"spark.ui.enabled": "false", "spark.driver.memory": "2g"},
        )
        self.spark.sparkContext.setLogLevel("ERROR")
        self.sc = self.spark.sparkContext
        self.rdd_dir = os.path.join(base, "rdd-checkpoints")
        self.sc.setCheckpointDir(self.rdd_dir)
        self.parquet_dir = os.path.join(base, "parquet")
        self.df = (
            self.spark.range(rows)
            .selectExpr("id", "rand(1) as x", "concat('user-', cast(id % 100000 as string)) as s")
            .cache()
        )
        self.rows = self.df.count()
        self.partitions = self.df.rdd.getNumPartitions()
        # What is persisted now (the cache) stays; what a run adds is released after it.
        self._kept = set(self._persisted_ids())
        self.storage = FileSystemCheckpointStorage(
            os.path.join(base, "chk"), os.path.join(base, "sp")
        )
        # Only checkpoint and restore_states are timed: the source is never read.
        pipeline = StatefulPipeline(
            name="stage_checkpoint_bench",
            stages=[Stage("bench", self.df.schema, lambda i, s: (s, i))],
            source=FileSource(
                url=os.path.join(base, "landing", "date={partition}"), schema=self.df.schema
            ),
            partitions=dg.DailyPartitionsDefinition(start_date="2026-01-01"),
        )
        self.runner = StatefulRunner(self.spark, self.storage, pipeline)
        self.position = SourcePosition("2026-01-01", 1, True)
        self.last_summary = None
        self.rdd_checkpoint_bytes = 0

    # --- housekeeping (never timed) ------------------------------------------------------

    def _persisted_ids(self) -> list[int]:
        return list(self.sc._jsc.getPersistentRDDs().keySet())

    def release(self) -> None:
        """Unpersist what the last run left in the block manager (localCheckpoint blocks),
        so that no run pays for another's memory."""
        gc.collect()
        rdds = self.sc._jsc.getPersistentRDDs()
        for rdd_id in list(rdds.keySet()):
            if rdd_id not in self._kept:
                rdds.get(rdd_id).unpersist(True)

    # --- writes --------------------------------------------------------------------------

    def checkpoint(self) -> float:
        start = time.perf_counter()
        summary = self.runner.checkpoint({"bench": self.df}, self.position)
        elapsed = time.perf_counter() - start
        self.last_summary = summary
        return elapsed

    def write_parquet(self) -> float:
        start = time.perf_counter()
        self.df.write.mode("overwrite").parquet(self.parquet_dir)
        return time.perf_counter() - start

    def rdd_checkpoint(self):
        start = time.perf_counter()
        checkpointed = self.df.checkpoint(eager=True)
        elapsed = time.perf_counter() - start
        del checkpointed

        def cleanup():
            self.release()
            self.rdd_checkpoint_bytes = _dir_size(self.rdd_dir)
            for entry in os.listdir(self.rdd_dir):
                shutil.rmtree(os.path.join(self.rdd_dir, entry), ignore_errors=True)

        return elapsed, cleanup

    def floor(self) -> float:
        start = time.perf_counter()
        rows = self.df.mapInArrow(_consume, "rows long").collect()
        elapsed = time.perf_counter() - start
        if sum(r["rows"] for r in rows) != self.rows:
            raise AssertionError(f"the floor saw {rows}, expected {self.rows} rows")
        return elapsed

    # --- reads ---------------------------------------------------------------------------

    def restore(self):
        metadata = self.runner.store.latest().metadata
        start = time.perf_counter()
        states = self.runner.restore_states(metadata)
        states["bench"].write.format("noop").mode("overwrite").save()
        elapsed = time.perf_counter() - start
        del states
        return elapsed, self.release

    def read_parquet(self):
        start = time.perf_counter()
        data = self.spark.read.parquet(self.parquet_dir).localCheckpoint(eager=True)
        data.write.format("noop").mode("overwrite").save()
        elapsed = time.perf_counter() - start
        del data
        return elapsed, self.release

    def read_parquet_plain(self) -> float:
        start = time.perf_counter()
        self.spark.read.parquet(self.parquet_dir).write.format("noop").mode("overwrite").save()
        return time.perf_counter() - start

    def verify_restore(self) -> None:
        """The restored state equals the DataFrame (row count and a sum over every column)."""
        from pyspark.sql import functions as F

        def digest(frame):
            return frame.agg(F.count("*"), F.sum("id"), F.sum("x"), F.sum(F.crc32("s"))).first()

        states = self.runner.restore_states(self.runner.store.latest().metadata)
        ours, expected = digest(states["bench"]), digest(self.df)
        del states
        self.release()
        if (ours[0], ours[1], ours[3]) != (expected[0], expected[1], expected[3]) or abs(
            ours[2] - expected[2]
        ) > 1e-6 * max(1.0, abs(expected[2])):
            raise AssertionError(f"restored state differs: {ours} vs {expected}")

    def row_groups(self) -> str:
        """Row groups per state file of the latest checkpoint."""
        import pyarrow.parquet as pq

        groups = []
        for handle in self.runner.store.latest().metadata.all_handles():
            path = getattr(handle, "path", None)
            if path is not None:
                groups.append(pq.ParquetFile(path.removeprefix("file://")).num_row_groups)
        return ",".join(map(str, groups)) or "inline"


# --- printing -----------------------------------------------------------------------------


@dataclass
class Row:
    backend: str
    workload: str
    ok: bool | None


def _line(label: str, runs: Runs) -> None:
    walls = " ".join(f"{t:.2f}" for t in runs.wall)
    cpu = runs.cpu_best
    cpu_text = f"   cpu {cpu:6.2f} s" if cpu is not None else ""
    print(
        f"  {label:<44} best {runs.best:6.2f} s   median {statistics.median(runs.wall):6.2f} s"
        f"{cpu_text}   runs: {walls}"
    )


def _target(subject: str, versus: str, ours: float, theirs: float, target: float) -> Row:
    ratio = ours / theirs
    ok = ratio <= target
    label = f"{subject} vs {versus}"
    print(
        f"  {label:<44} {ours:6.2f} s / {theirs:6.2f} s = {ratio:5.2f}x   target <= "
        f"{target:.2f}x   {'ok' if ok else 'MISSED'}"
    )
    return Row(subject, f"vs {versus}", ok)


def _cpu_ratio(a: Runs, b: Runs) -> str:
    if a.cpu_best is None or b.cpu_best is None or not b.cpu_best:
        return "n/a"
    return f"{a.cpu_best:.2f} / {b.cpu_best:.2f} cpu s = {a.cpu_best / b.cpu_best:.2f}x"


# --- sections -----------------------------------------------------------------------------


def sweep(bench: Bench, sizes: list[int], repeats: int, configured: int) -> None:
    print(
        f"\n{BATCH_KEY} (spark.conf.set before each measurement; DEFAULT_SPARK_CONF has "
        f"{configured:,}); best of {repeats}, rotating; cpu = process-tree CPU seconds:"
    )
    print(
        f"  {'batch rows':>10}  {'checkpoint':>10}  {'(cpu)':>7}  {'floor':>7}  {'(cpu)':>7}  "
        f"{'ckpt/floor':>10}  {'restore':>7}  {'(cpu)':>7}  row groups per file"
    )
    results = {}
    try:
        for size in sizes:
            bench.spark.conf.set(BATCH_KEY, str(size))
            bench.checkpoint()  # so that every timed restore reads a file of this batch size
            runs = timed(
                repeats,
                {"checkpoint": bench.checkpoint, "floor": bench.floor, "restore": bench.restore},
            )
            results[size] = runs
            c, f, r = runs["checkpoint"], runs["floor"], runs["restore"]
            mark = "  <- DEFAULT_SPARK_CONF" if size == configured else ""
            print(
                f"  {size:>10,}  {c.best:9.2f}s  {_cpu(c)}  {f.best:6.2f}s  {_cpu(f)}  "
                f"{c.best / f.best:9.2f}x  {r.best:6.2f}s  {_cpu(r)}  {bench.row_groups()}{mark}"
            )
    finally:
        bench.spark.conf.set(BATCH_KEY, str(configured))
    fastest = min(results, key=lambda s: results[s]["checkpoint"].best)
    text = f"  fastest checkpoint: {fastest:,} rows per batch"
    if configured in results:
        c = results[configured]["checkpoint"].best
        text += f"; the configured {configured:,}: {c:.2f} s"
        text += f" ({c / results[fastest]['checkpoint'].best:.2f}x the fastest)"
        if 10_000 in results and configured != 10_000:
            d = results[10_000]["checkpoint"].best
            text += f"; Spark's default 10,000: {d:.2f} s ({d / c:.2f}x the configured)"
    print(text)


def _cpu(runs: Runs) -> str:
    return f"{runs.cpu_best:6.2f}s" if runs.cpu_best is not None else f"{'n/a':>7}"


def _timed_call(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def breakdown(bench: Bench, repeats: int) -> None:
    """The executor functions in this process, on one partition's share of the data."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql.pandas.types import to_arrow_schema

    from checkpoint_storage import FileSystemCheckpointStorage, JobID
    from pipelines import state_io

    n = max(repeats, 3)
    # Fixed costs: the same paths on a 2-row DataFrame (one partition).
    tiny = bench.df.limit(2).localCheckpoint(eager=True)
    tiny_paths = {
        "checkpoint": lambda: _timed_call(bench.runner.checkpoint, {"bench": tiny}, bench.position),
        "floor": lambda: _timed_call(lambda: tiny.mapInArrow(_consume, "rows long").collect()),
    }
    fixed = timed(n, tiny_paths)
    print(
        f"\nfixed costs, the same paths on a 2-row DataFrame: checkpoint "
        f"{fixed['checkpoint'].best:.2f} s (cpu {_cpu(fixed['checkpoint']).strip()}), floor "
        f"{fixed['floor'].best:.2f} s (cpu {_cpu(fixed['floor']).strip()}); best of {n}"
    )
    bench.release()

    batch_rows = int(bench.spark.conf.get(BATCH_KEY))
    schema = to_arrow_schema(bench.df.schema, timezone="UTC")
    table = bench.df.toArrow()
    part = table.slice(0, -(-table.num_rows // bench.partitions))
    if part.schema != schema:
        part = part.cast(schema)
    batches = part.to_batches(max_chunksize=batch_rows)
    del table
    print(
        f"\nexecutor path in this process, no Spark: one partition's share, {part.num_rows:,} "
        f"rows in {len(batches)} Arrow batches of up to {batch_rows:,}; best of {n}"
    )

    def best(fn) -> float:
        times = []
        for _ in range(n):
            gc.collect()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    def writer_for(storage):
        job_id = JobID.generate()
        access = storage.create_checkpoint_storage(job_id)
        access.initialize_base_locations()
        location = access.initialize_location_for_checkpoint(1)
        return state_io.StateWriteTask(
            storage, str(job_id), 1, location.location_reference, "bench", schema
        )

    def write_and_read(storage, options: dict) -> tuple[float, float, int]:
        task = writer_for(storage)
        handles = []

        def write():
            if options:
                rows = list(_write_with_options(options, task, iter(batches)))
            else:  # the project's function, untouched
                rows = list(state_io.write_state_partition(task, iter(batches)))
            handles.append(rows[0])

        w = best(write)
        row = handles[-1]
        read_task = state_io.StateReadTask(storage, schema)

        def read():
            total = sum(b.num_rows for b in state_io.read_state_partition(read_task, iter([row])))
            if total != part.num_rows:
                raise AssertionError(f"read {total} rows, expected {part.num_rows}")

        r = best(read)
        size = row.column("size")[0].as_py()
        for h in handles:
            path = h.column("path")[0].as_py()
            if path and h.column("kind")[0].as_py() != "bytes":
                os.remove(path.removeprefix("file://"))
        return w, r, size

    def encode_only(options: dict) -> float:
        def run():
            sink = pa.MockOutputStream()
            writer = pq.ParquetWriter(
                sink, schema, **(state_io.PARQUET_OPTIONS | options)
            )
            for batch in batches:
                writer.write_batch(batch)
            writer.close()

        return best(run)

    base = os.path.join(bench.base, "breakdown")
    storage = FileSystemCheckpointStorage(base)
    print(
        f"  {'write_state_partition, Parquet options':<44} {'write':>7} {'encode':>7} "
        f"{'read':>7} {'size':>9}"
    )
    current = state_io.PARQUET_COMPRESSION
    variants = [({}, f"as is ({current}, dictionary off)")]
    for codec in ("zstd", "lz4", "none"):
        if codec != current:
            variants.append(({"compression": codec}, f"{codec}"))
    small_dictionary = {"dictionary_pagesize_limit": 64 * 1024, "use_dictionary": True}
    variants += [
        ({"use_dictionary": True}, f"use_dictionary=True ({current})"),
        (small_dictionary, f"dictionary_pagesize_limit=64KiB ({current})"),
        (small_dictionary | {"compression": "zstd"}, "dictionary_pagesize_limit=64KiB, zstd"),
    ]
    first = None
    for options, label in variants:
        w, r, size = write_and_read(storage, options)
        e = encode_only(options)
        first = first or w
        print(
            f"  {label:<44} {w:6.3f}s {e:6.3f}s {r:6.3f}s {size / MIB:6.1f} MiB"
            f"   write {w / first:4.2f}x"
        )
    for buffer in (1 * MIB, 8 * MIB):
        big = FileSystemCheckpointStorage(base, write_buffer_size=buffer)
        w, r, size = write_and_read(big, {})
        print(
            f"  {'as is, write_buffer_size ' + str(buffer // MIB) + ' MiB':<44} {w:6.3f}s "
            f"{'':>7} {r:6.3f}s {size / MIB:6.1f} MiB   write {w / first:4.2f}x"
        )
    shutil.rmtree(base, ignore_errors=True)
    print(
        "  (write: write_state_partition into a local state stream; encode: pq.ParquetWriter "
        "into a null sink; read: read_state_partition, read + CRC-32 + decode)"
    )


def experiments(bench: Bench, repeats: int) -> None:
    """Checkpoint and restore in Spark with patched Parquet writer options in the workers,
    alternating with the path as it is."""
    from pipelines import state_io

    print(
        f"\nexperiments in Spark (Parquet writer options patched in the Python workers; "
        f"not the project's code): best of {repeats}, rotating"
    )

    @contextmanager
    def patched(options):
        if not options:
            yield
            return
        with mock.patch.object(
            state_io, "write_state_partition", partial(_write_with_options, options)
        ):
            yield

    variants = {"as is": {}} | EXPERIMENTS
    names = list(variants)
    checkpoints = {name: Runs([], []) for name in names}
    restores = {name: Runs([], []) for name in names}
    sizes = {}
    # The restore reads the latest checkpoint: each variant's restore follows its checkpoint.
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:

            def checkpoint(options=variants[name]):
                with patched(options):
                    return bench.checkpoint()

            got = timed(1, {"checkpoint": checkpoint, "restore": bench.restore})
            for runs, key in ((checkpoints, "checkpoint"), (restores, "restore")):
                runs[name].wall += got[key].wall
                runs[name].cpu += got[key].cpu
            sizes[name] = bench.last_summary.state_bytes
    print(
        f"  {'variant':<32} {'checkpoint':>10} {'(cpu)':>7} {'restore':>8} {'(cpu)':>7} "
        f"{'state':>10}"
    )
    for name in names:
        ck, rs = checkpoints[name], restores[name]
        print(
            f"  {name:<32} {ck.best:9.2f}s {_cpu(ck)} {rs.best:7.2f}s {_cpu(rs)} "
            f"{sizes[name] / MIB:6.1f} MiB   checkpoint "
            f"{ck.best / checkpoints['as is'].best:4.2f}x, restore "
            f"{rs.best / restores['as is'].best:4.2f}x"
        )


# --- main ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=None, help=f"rows (default {DEFAULT_ROWS:,})")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per path (3)")
    parser.add_argument(
        "--batch-sizes",
        default=",".join(map(str, DEFAULT_BATCH_SIZES)),
        help="maxRecordsPerBatch values to sweep, comma separated",
    )
    parser.add_argument("--no-sweep", action="store_true", help="skip the batch size sweep")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the breakdown")
    parser.add_argument(
        "--experiments", action="store_true", help="Parquet writer options tried in Spark"
    )
    parser.add_argument("--local-dir", default=None, help="parent directory for the files")
    parser.add_argument(
        "--quick", action="store_true", help=f"smoke run: {QUICK_ROWS:,} rows, 1 repetition"
    )
    args = parser.parse_args(argv)
    rows_n = args.rows if args.rows is not None else (QUICK_ROWS if args.quick else DEFAULT_ROWS)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]

    import pyarrow
    import pyspark

    from pipelines import state_io
    from resources.spark import DEFAULT_SPARK_CONF

    configured = int(DEFAULT_SPARK_CONF[BATCH_KEY])
    base = tempfile.mkdtemp(prefix="stage-checkpoint-", dir=args.local_dir)
    bench = None
    try:
        bench = Bench(rows_n, base)
        print(
            f"stage_checkpoint benchmark: python {platform.python_version()}, pyspark "
            f"{pyspark.__version__}, pyarrow {pyarrow.__version__}, {os.cpu_count()} CPUs, "
            f"local[2]; load average {os.getloadavg()[0]:.2f} at start"
        )
        print(
            f"data: {bench.rows:,} rows (id long, x double, s string), cached, "
            f"{bench.partitions} partitions; files under {base}"
        )
        print(
            f"{BATCH_KEY} = {bench.spark.conf.get(BATCH_KEY)}; state Parquet compression "
            f"{state_io.PARQUET_COMPRESSION}; spark.sql.parquet.compression.codec = "
            f"{bench.spark.conf.get('spark.sql.parquet.compression.codec')}; state stream "
            f"write buffer {bench.storage.write_buffer_size:,} bytes"
        )

        writes = {
            "checkpoint": bench.checkpoint,
            "parquet": bench.write_parquet,
            "df.checkpoint": bench.rdd_checkpoint,
            "floor": bench.floor,
        }
        reads = {
            "restore": bench.restore,
            "read.parquet": bench.read_parquet,
            "read.parquet plain": bench.read_parquet_plain,
        }
        started = time.perf_counter()
        for fn in (*writes.values(), *reads.values()):  # warm-up, one of each
            result = fn()
            if isinstance(result, tuple):
                result[1]()
        bench.verify_restore()
        print(
            f"warm-up: one run of every path, {time.perf_counter() - started:.1f} s; the "
            "restored state matches the DataFrame"
        )

        print(f"\nwrites: best of {repeats}, rotating; cpu = process-tree CPU seconds (best)")
        w = timed(repeats, writes)
        _line("stage checkpoint (runner.checkpoint)", w["checkpoint"])
        _line("df.write.parquet (overwrite)", w["parquet"])
        _line("df.checkpoint(eager=True)", w["df.checkpoint"])
        _line("floor: no-op mapInArrow, collected", w["floor"])
        summary = bench.last_summary
        print(
            f"  sizes: checkpoint {summary.state_bytes / MIB:,.1f} MiB in "
            f"{summary.files_written} files ({summary.inline_states} inline), row groups per "
            f"file {bench.row_groups()}; Parquet {_dir_size(bench.parquet_dir) / MIB:,.1f} MiB; "
            f"df.checkpoint {bench.rdd_checkpoint_bytes / MIB:,.1f} MiB"
        )

        print(
            f"\nrestore: best of {repeats}, rotating; both sides localCheckpoint(eager=True), "
            "then one noop scan"
        )
        r = timed(repeats, reads)
        _line("restore_states + noop scan", r["restore"])
        _line("read.parquet + localCheckpoint + noop scan", r["read.parquet"])
        _line("read.parquet + noop scan (reference)", r["read.parquet plain"])

        runs = w | r
        best = {k: v.best for k, v in runs.items()}
        print("\ntargets (best wall times):")
        rows = [
            _target(
                "checkpoint",
                "no-op mapInArrow floor",
                best["checkpoint"],
                best["floor"],
                FLOOR_TARGET,
            ),
            _target(
                "checkpoint",
                "df.write.parquet",
                best["checkpoint"],
                best["parquet"],
                PARQUET_TARGET,
            ),
            _target(
                "restore",
                "read.parquet (+localCheckpoint)",
                best["restore"],
                best["read.parquet"],
                RESTORE_TARGET,
            ),
        ]
        print("  the same ratios in CPU seconds (no target; less sensitive to other load):")
        print(f"    checkpoint / floor:        {_cpu_ratio(runs['checkpoint'], runs['floor'])}")
        print(f"    checkpoint / write.parquet: {_cpu_ratio(runs['checkpoint'], runs['parquet'])}")
        print(f"    restore / read.parquet:    {_cpu_ratio(runs['restore'], runs['read.parquet'])}")
        print(
            "  no target: checkpoint / df.checkpoint "
            f"{best['checkpoint'] / best['df.checkpoint']:.2f}x; floor / df.write.parquet "
            f"{best['floor'] / best['parquet']:.2f}x; restore / read.parquet without "
            f"localCheckpoint {best['restore'] / best['read.parquet plain']:.2f}x"
        )
        spread = {k: statistics.median(v.wall) / v.best for k, v in runs.items()}
        noisy = [f"{k} {v:.2f}x" for k, v in spread.items() if v > 1.2]
        if noisy:
            print(
                f"  noisy: median / best above 1.2 for {', '.join(noisy)}: the machine is busy; "
                "trust the ratios less, or rerun with more --repeats"
            )

        if not args.no_sweep and sizes:
            sweep(bench, sizes, repeats, configured)
        if not args.no_breakdown:
            breakdown(bench, repeats)
        if args.experiments:
            experiments(bench, repeats)

        print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
        print(targets_line(rows).lstrip("\n"))
    finally:
        if bench is not None:
            bench.spark.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
