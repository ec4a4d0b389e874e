"""Cold run: the fixed cost of a run of one small partition and of a small batch (issue 28).

1. A cold run of one day of click events (4 batches of 2,000 rows) through Dagster as
   ``scripts/run --days 1`` does it (``python -m pipelines.main --days 1``: a new process, a
   fresh Dagster instance and data directory, ``SPARK_MASTER=local[2]``), against the floor:
   a new process that imports Dagster, starts a ``local[2]`` SparkSession, reads one small
   Parquet file (the day's 8,000 rows) and writes one. The cold run processes the second day,
   restoring the first day's checkpoint (landed and run once, untimed, then copied for each
   run; ``--from-empty``: the first day). Wall clock from spawning the process
   to its exit; median of ``--pairs`` interleaved pairs. The cold run's process is the real
   ``pipelines.main`` with stamps wrapped around functions on its path (same behaviour),
   which split its time: process start and imports, SparkSession, landing the day, restore,
   batches, checkpoint write, ``_metadata``, the rest of the Dagster run (setup, events,
   the sink), and what follows the run (the state report, exit). It also counts the files
   of the day's last checkpoint (what its ``_metadata`` references; inline states apart)
   and the files on disk under the checkpoint directory, and the CPU time of each child's
   process tree (itself, the JVM, the Python workers) at its last line, which a loaded
   machine changes far less than the wall clock.
2. A small batch: in one process and one SparkSession, our runner with the example's two
   keyed stages (``KEYED_STAGES``, a checkpoint per batch) and a Spark Structured Streaming
   query with the same two steps (dedupe within the watermark, then the per-user
   aggregate, RocksDB state store with changelog checkpointing, one file per trigger), on
   the same days' batches of 2,000 rows, a day each in turn after a warm-up day. A batch of
   ours: the time from one checkpoint's progress line to the next (apply and checkpoint);
   SS: landing the file and ``processAllAvailable``. Median over the timed batches.

Targets: cold run <= 1.5x the floor; small batch <= 1.5x SS's. The floor is a plain
session, as a user's own would be; each pair also runs it with the project's class archive
(``pipelines.class_archive``, when built), printed without a target: how much of the
difference is the driver JVM's start.

    python benchmarks/cold_run.py [--pairs 4] [--days 3] [--quick] [--cold-only]

``--quick``: one pair, one timed day; ``--cold-only``: without the small batch. The last line
is ``targets: N/M met``.
"""

import argparse
import datetime as dt
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from _common import class_archive_options  # noqa: E402

COLD_TARGET = 1.5
BATCH_TARGET = 1.5


# --- children ------------------------------------------------------------------------------


def tree_cpu() -> float:
    """CPU seconds (user + system) of this process and every process below it (the JVM, the
    Python workers), those that ended and were waited for included (/proc): what a loaded
    machine does not change, unlike the wall clock."""
    ticks = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[tuple[int, list[str]]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            children.setdefault(int(fields[1]), []).append((int(entry), fields))
    stat = Path(f"/proc/{os.getpid()}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    total = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    pending = [os.getpid()]
    while pending:
        for pid, fields in children.get(pending.pop(), []):
            total += sum(int(f) for f in fields[11:15])
            pending.append(pid)
    return total / ticks


class Stamps:
    """Seconds per label, exclusive of nested wrapped calls, on the main thread only (the
    wall clock's path: the SparkSession's start in the background is not on it, the wait
    for it is)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.stack: list[float] = []

    def wrap(self, owner, name: str, label: str) -> None:
        original = owner.__dict__.get(name)
        if isinstance(original, property):  # its getter, e.g. SparkResource.session
            setattr(owner, name, property(self.timed(original.fget, label)))
        else:
            setattr(owner, name, self.timed(getattr(owner, name), label))

    def timed(self, original, label: str):
        stamps = self

        def timed(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                return original(*args, **kwargs)
            started = time.perf_counter()
            stamps.stack.append(0.0)
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                nested = stamps.stack.pop()
                stamps.seconds[label] = stamps.seconds.get(label, 0.0) + elapsed - nested
                if stamps.stack:
                    stamps.stack[-1] += elapsed

        return timed


def child_cold(args) -> None:
    """``pipelines.main --days 1`` in this process, with stamps around its path."""
    import dagster as dg
    from pyspark.sql import SparkSession

    import pipelines
    import pipelines.definitions  # noqa: F401 (what main imports: the code location)
    import pipelines.examples.click_events.pipeline as click_pipeline
    import pipelines.main
    import pipelines.runner as runner
    import sensors
    from resources import SparkResource

    imported = time.time()
    stamps = Stamps()
    stamps.wrap(SparkSession.Builder, "getOrCreate", "SparkSession")
    stamps.wrap(SparkResource, "session", "SparkSession")  # or the wait for its start
    stamps.wrap(click_pipeline, "generate_day", "landing the day")
    # restore: finding, verifying and opening the checkpoint; a keyed stage's local stores
    # are rebuilt by the first batch's tasks (in "batches")
    stamps.wrap(runner.StatefulRunner, "_recover_store", "restore")
    stamps.wrap(runner.StatefulRunner, "_starting_point", "restore")
    stamps.wrap(runner.StatefulRunner, "_apply_batch", "batches")
    stamps.wrap(runner.StatefulRunner, "checkpoint", "checkpoint write")
    # where the runner's `_snapshot` writes `_metadata` (a module of its own)
    stamps.wrap(inspect.getmodule(runner.StatefulRunner._snapshot), "store_checkpoint_metadata",
                "_metadata")
    stamps.wrap(dg.JobDefinition, "execute_in_process", "Dagster run (setup, events)")
    # inside the Dagster run (its own split): the report sink's write, the check, the
    # session's stop
    for sink_class in (pipelines.SparkWriterSink, pipelines.ParquetSink):
        stamps.wrap(sink_class, "write", "the report sink")
    # the check as the stateful asset calls it (a name of the asset's module)
    stamps.wrap(inspect.getmodule(sensors.build_stateful_assets), "integrity_check_result",
                "the check")
    stamps.wrap(SparkResource, "teardown_after_execution", "the session's stop")
    status = pipelines.main.main(["--days", "1"], own_process=True)
    ended = time.time()
    print("RESULT " + json.dumps({"status": status, "imported": imported, "ended": ended,
                                  "stamps": stamps.seconds, "cpu": tree_cpu()}),
          flush=True)  # fmt: skip
    pipelines.main.settle_heap()  # and exit as main's process does (its exit is measured)
    sys.exit(status)


def child_floor(args) -> None:
    """Import Dagster, start a local[2] SparkSession, read one small Parquet file, write one."""
    import dagster  # noqa: F401
    from pyspark.sql import SparkSession

    imported = time.time()
    builder = SparkSession.builder
    if args.class_archive:  # the same floor, its JVM given the project's class archive
        builder = builder.config("spark.driver.extraJavaOptions", class_archive_options())
    spark = (
        builder.master("local[2]").appName("cold_run-floor")
        .config("spark.ui.enabled", "false").getOrCreate()
    )  # fmt: skip
    session = time.time()
    spark.read.parquet(args.input).write.mode("overwrite").parquet(args.output)
    ended = time.time()
    print("RESULT " + json.dumps({"imported": imported, "session": session, "ended": ended,
                                  "cpu": tree_cpu()}), flush=True)  # fmt: skip


def child_small_batch(args) -> None:
    """Ours and SS over the same days' batches in one SparkSession, a day each in turn."""
    import dagster as dg
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    from checkpoint_storage import FileSystemCheckpointStorage
    from pipelines import FileSource, StatefulPipeline, StatefulRunner
    from pipelines.examples.click_events import (
        EVENT_ARROW_SCHEMA,
        FIRST_PARTITION,
        KEYED_STAGES,
        generate_day,
    )
    from pipelines.examples.click_events.stages import DEDUPE_RETENTION

    work = Path(args.work)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master("local[2]").appName("cold_run-small-batch")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.streaming.stateStore.providerClass",
                "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
        .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
        .getOrCreate()
    )  # fmt: skip
    spark.sparkContext.setLogLevel("ERROR")
    first = dt.date.fromisoformat(FIRST_PARTITION)
    days = [(first + dt.timedelta(days=i)).isoformat() for i in range(args.days + 1)]
    landing = work / "landing"
    for seed, day in enumerate(days):
        generate_day(str(landing), day, batches=4, events_per_batch=2_000, seed=seed)
    pipeline = StatefulPipeline(
        name="cold_run_small_batch",
        stages=list(KEYED_STAGES),
        source=FileSource(url=f"{landing}/date={{partition}}", schema=EVENT_ARROW_SCHEMA,
                          suffix=".parquet"),
        partitions=dg.StaticPartitionsDefinition(days),
        checkpoint_interval=1,
        max_retained_checkpoints=3,
    )  # fmt: skip
    runner = StatefulRunner(spark, FileSystemCheckpointStorage(str(work / "checkpoints")),
                            pipeline, lease_owner="cold_run", keyed_local_dir=str(work / "local"))

    feed = work / "feed"
    feed.mkdir()
    events = (
        spark.readStream.schema(from_arrow_schema(EVENT_ARROW_SCHEMA))
        .option("maxFilesPerTrigger", 1).parquet(str(feed))
    )  # fmt: skip
    retention = f"{int(DEDUPE_RETENTION.total_seconds())} seconds"
    totals = (
        events.withWatermark("event_ts", retention).dropDuplicatesWithinWatermark(["event_id"])
        .groupBy("user_id").agg(
            F.count(F.lit(1)).alias("event_count"), F.sum("amount").alias("amount_sum"),
            F.min("event_ts").alias("first_seen"), F.max("event_ts").alias("last_seen"))
    )  # fmt: skip
    query = (
        totals.writeStream.format("noop").outputMode(args.ss_mode)
        .option("checkpointLocation", str(work / "ss-checkpoint")).start()
    )  # fmt: skip

    def ours_day(day: str) -> list[float]:
        stamps: list[float] = []

        def note(line: str) -> None:
            if ": checkpoint " in line:  # "<day>: checkpoint <id> at ...": a batch's end
                stamps.append(time.perf_counter())

        started = time.perf_counter()
        runner.run([day], on_progress=note)
        # the first checkpoint line ends batch 1 (its partition's setup included); the
        # final checkpoint closes the day, after the last batch's
        marks = [started, *stamps]
        return [b - a for a, b in zip(marks, marks[1:], strict=False)][1:]

    def ss_day(day: str) -> list[float]:
        walls = []
        for path in sorted((landing / f"date={day}").glob("*.parquet")):
            started = time.perf_counter()
            tmp = feed / f".{day}-{path.name}.tmp"
            shutil.copyfile(path, tmp)
            os.replace(tmp, feed / f"{day}-{path.name}")
            query.processAllAvailable()
            walls.append(time.perf_counter() - started)
        return walls

    ours_day(days[0])  # warm-up: the JVM's and the workers' first jobs
    ss_day(days[0])
    ours, ss = [], []
    for i, day in enumerate(days[1:]):
        for name in (("ours", "ss") if i % 2 == 0 else ("ss", "ours")):
            (ours if name == "ours" else ss).extend(ours_day(day) if name == "ours"
                                                    else ss_day(day))
    query.stop()
    print("RESULT " + json.dumps({"ours": ours, "ss": ss}), flush=True)


# --- driver --------------------------------------------------------------------------------


def spawn(argv: list[str], env: dict | None = None, cwd: Path | None = None) -> tuple[dict, float,
                                                                                     float]:
    """Run a child; its RESULT, and the wall clock at its spawn and exit."""
    with tempfile.TemporaryFile("w+") as errors:
        started = time.time()
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=errors, text=True,
                              env=env, cwd=cwd, timeout=1800)  # fmt: skip
        ended = time.time()
        errors.seek(0)
        stderr = errors.read()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = " | ".join((stderr or proc.stdout).strip().splitlines()[-4:])
        raise RuntimeError(f"{' '.join(argv[1:3])} failed ({proc.returncode}): {tail}")
    return json.loads(lines[-1][len("RESULT ") :]), started, ended


def cold_run(base: Path, i: int | str, seed: Path | None) -> dict:
    """One cold run: a fresh Dagster home; the data directory a copy of ``seed``'s (the first
    day landed and checkpointed, so that the run restores it and processes the next day),
    or empty. Always at the same path, the seed's: a checkpoint records its files' absolute
    paths, and one copied elsewhere is refused (skipped as invalid: nothing to restore)."""
    data, home = base / "cold-data", base / f"cold-{i}" / "home"
    home.mkdir(parents=True)
    shutil.rmtree(data, ignore_errors=True)
    if seed is not None:
        shutil.copytree(seed, data)
    env = os.environ | {"DAGSTER_HOME": str(home), "PIPELINE_DATA_DIR": str(data),
                        "SPARK_MASTER": "local[2]", "PYTHONPATH": str(ROOT)}  # fmt: skip
    result, started, ended = spawn([sys.executable, __file__, "child-cold"], env=env, cwd=ROOT)
    result["wall"] = ended - started
    result["process start and imports"] = result["imported"] - started
    result["after the run (state report, exit)"] = ended - result["ended"]
    result["files"] = checkpoint_files(data / "checkpoints")
    return result


def checkpoint_files(root: Path) -> dict:
    """The newest completed checkpoint's files: what its ``_metadata`` references (stored
    files, inline states), and all files on disk under ``root``."""
    from checkpoint_storage import FileSystemCheckpointStorage
    from pipelines import SourcePosition, job_id_for
    from pipelines.examples.click_events import NAME

    latest = FileSystemCheckpointStorage(str(root)).create_checkpoint_storage(
        job_id_for(NAME)).latest_completed_checkpoint()
    on_disk = [p for p in root.rglob("*") if p.is_file()]
    result = {"on_disk": len(on_disk), "on_disk_bytes": sum(p.stat().st_size for p in on_disk)}
    if latest is not None:
        handles = latest.load_metadata().all_handles()
        stored = {h.path for h in handles if getattr(h, "path", None)}
        result |= {"referenced": len(stored) + 1, "inline": len(handles) - sum(
            1 for h in handles if getattr(h, "path", None))}  # +1: the _metadata file
        result["partition"] = SourcePosition.of(latest.load_metadata()).partition
    return result


def floor_run(base: Path, i: int, source: Path, class_archive: bool = False) -> dict:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    result, started, ended = spawn([sys.executable, __file__, "child-floor", "--input",
                                    str(source), "--output", str(base / f"floor-{i}")]
                                   + (["--class-archive"] if class_archive else []), env=env)
    return {"wall": ended - started, "process start and imports": result["imported"] - started,
            "SparkSession": result["session"] - result["imported"],
            "read and write": result["ended"] - result["session"],
            "exit": ended - result["ended"], "cpu": result["cpu"]}  # fmt: skip


def floor_input(base: Path) -> Path:
    """The day's 8,000 rows as one Parquet file."""
    import pyarrow.parquet as pq

    from pipelines.examples.click_events import FIRST_PARTITION, generate_day

    generate_day(str(base / "floor-landing"), FIRST_PARTITION)
    table = pq.read_table(next((base / "floor-landing").rglob("*.parquet")).parent)
    pq.write_table(table, base / "floor-input.parquet")
    return base / "floor-input.parquet"


def split_line(cold: list[dict], floor: list[dict]) -> str:
    """Where the cold run's time goes (medians), next to the floor's."""
    labels = ["process start and imports", "SparkSession", "landing the day", "restore",
              "batches", "checkpoint write", "_metadata", "Dagster run (setup, events)",
              "the report sink", "the check", "the session's stop",
              "after the run (state report, exit)"]
    parts = []
    for label in labels:
        values = [c.get(label, c["stamps"].get(label, 0.0)) for c in cold]
        parts.append(f"{label} {statistics.median(values):.2f}")
    floor_parts = [f"{k} {statistics.median(f[k] for f in floor):.2f}"
                   for k in ("process start and imports", "SparkSession", "read and write",
                             "exit")]
    cpu = (f"  CPU (user + system) of the process tree at its last line, median s: cold run "
           f"{statistics.median(c['cpu'] for c in cold):.2f}, floor "
           f"{statistics.median(f['cpu'] for f in floor):.2f}")
    return ("  cold run split, median s: " + ", ".join(parts)
            + "\n  floor split, median s: " + ", ".join(floor_parts) + "\n" + cpu)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?",
                        choices=("child-cold", "child-floor", "child-small-batch"))
    parser.add_argument("--input")
    parser.add_argument("--output")
    parser.add_argument("--work")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--days", type=int, default=3, help="timed days of the small batch")
    parser.add_argument("--ss-mode", default="update")
    parser.add_argument("--from-empty", action="store_true",
                        help="cold runs of the first day, without a checkpoint to restore")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cold-only", action="store_true",
                        help="the cold runs and the floor only, without the small batch")
    parser.add_argument("--class-archive", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.command is not None:
        {"child-cold": child_cold, "child-floor": child_floor,
         "child-small-batch": child_small_batch}[args.command](args)  # fmt: skip
        return
    if args.quick:
        args.pairs, args.days = 1, 1
    from pipelines.examples.click_events import FIRST_PARTITION
    print(f"cold_run: {args.pairs} pairs, small batch over {args.days} days; load "
          f"{os.getloadavg()}", flush=True)
    checks = []
    base = Path(tempfile.mkdtemp(prefix="cold_run-"))
    try:
        source = floor_input(base)
        seed = None
        if not args.from_empty:  # untimed: the day before, so that the timed runs restore
            seed = base / "seed-data"
            cold_run(base, "seed", None)
            shutil.copytree(base / "cold-data", seed)
        cold, floor, archived = [], [], []
        archive = bool(class_archive_options())
        for i in range(args.pairs):
            pair = ("cold", "floor", "archived") if i % 2 == 0 else ("archived", "floor", "cold")
            for name in pair:
                if name == "cold":
                    cold.append(cold_run(base, i, seed))
                elif name == "floor":
                    floor.append(floor_run(base, i, source))
                elif archive:
                    archived.append(floor_run(base, i, source, class_archive=True))
            print(f"  pair {i + 1}: cold run {cold[-1]['wall']:.2f} s, floor "
                  f"{floor[-1]['wall']:.2f} s"
                  + (f", floor with the class archive {archived[-1]['wall']:.2f} s"
                     if archived else "") + f"; load {os.getloadavg()[0]:.1f}", flush=True)
        if any(c["status"] != 0 for c in cold):
            raise SystemExit("cold_run: a cold run failed (pipelines.main returned non-zero)")
        # the second day, after the seed's first: not the first again from an empty state
        day = FIRST_PARTITION if seed is None else (
            dt.date.fromisoformat(FIRST_PARTITION) + dt.timedelta(days=1)).isoformat()
        if any(c["files"].get("partition") != day for c in cold):
            raise SystemExit(f"cold_run: a cold run did not end at {day} (restore refused?)")
        cold_wall = statistics.median(c["wall"] for c in cold)
        floor_wall = statistics.median(f["wall"] for f in floor)
        ratio = cold_wall / floor_wall
        which = "the first day" if seed is None else "the second day, restoring the first"
        print(f"cold run (scripts/run --days 1, 8,000 rows, {which}): {cold_wall:.2f} s median, "
              f"floor "
              f"{floor_wall:.2f} s: {ratio:.2f}x (target <= {COLD_TARGET}x): "
              f"{'ok' if ratio <= COLD_TARGET else 'MISSED'}")
        checks.append(ratio <= COLD_TARGET)
        if archived:  # how much of the difference is the JVM's class archive
            archived_wall = statistics.median(f["wall"] for f in archived)
            print(f"  the floor with the project's class archive (pipelines.class_archive; no "
                  f"target): {archived_wall:.2f} s median: the cold run "
                  f"{cold_wall / archived_wall:.2f}x it")
        else:
            print("  (no class archive: scripts/setup-env builds it; the cold run ran without)")
        print(split_line(cold, floor))
        files = cold[-1]["files"]
        print(f"  the day's last checkpoint: {files.get('referenced', '?')} files referenced "
              f"by its _metadata (itself included), {files.get('inline', '?')} states inline; "
              f"{files['on_disk']} files, {files['on_disk_bytes'] / 2**20:.2f} MiB on disk "
              "under the checkpoint directory (retained checkpoints)")

        if not args.cold_only:  # the small batch
            work = base / "small-batch"
            work.mkdir()
            env = os.environ | {"PYTHONPATH": str(ROOT)}
            result, _, _ = spawn([sys.executable, __file__, "child-small-batch", "--work",
                                  str(work), "--days", str(args.days), "--ss-mode", args.ss_mode],
                                 env=env)  # fmt: skip
            ours, ss = statistics.median(result["ours"]), statistics.median(result["ss"])
            ratio = ours / ss
            print(f"small batch (2,000 rows, the two keyed stages, a checkpoint each): ours "
                  f"{ours:.2f} s, SS micro-batch {ss:.2f} s (medians of {len(result['ours'])} and "
                  f"{len(result['ss'])}): {ratio:.2f}x (target <= {BATCH_TARGET}x): "
                  f"{'ok' if ratio <= BATCH_TARGET else 'MISSED'}")
            print("  ours s: " + " ".join(f"{w:.2f}" for w in result["ours"])
                  + " | SS s: " + " ".join(f"{w:.2f}" for w in result["ss"]))
            checks.append(ratio <= BATCH_TARGET)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"load after: {os.getloadavg()}")
    print(f"targets: {sum(checks)}/{len(checks)} met")


if __name__ == "__main__":
    main()
