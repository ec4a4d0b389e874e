"""Issue 12's retention check over a keyed pipeline: after N batches (default 1,000) with a
checkpoint after every batch and retention 3, the job directory holds only what the retained
checkpoints reference.

Usage::

    .venv/bin/python benchmarks/keyed_retention.py [--batches 1000] [--retained 3]
        [--partitions 1] [--work-dir DIR] [--progress 50] [--file-merging]
    .venv/bin/python benchmarks/keyed_retention.py --compare-merging [--batches 200]
        [--repeats 2]

The pipeline is per-customer order totals (a keyed stage, 16 key groups on 2 ranges,
local[2]; the keyed totals of tests/pipelines), snapshotting a range after every 3 change
files, over ``--batches`` batches split across ``--partitions`` partitions (one run), so
shared files are superseded and discarded the whole time. At the end (after the registry's
pending deletions):

- ``shared/`` files == the files the retained checkpoints reference;
- ``chk-*`` directories == the retained checkpoints (nothing else below the job directory
  but ``shared/``, ``taskowned/`` and the lease);
- the state equals a dict recomputation.

Prints one line per check and ``retention: ok`` or ``retention: FAILED``; exits 1 on failure.
``tests/pipelines/test_keyed_faults.py`` runs ``check`` with a few batches.

``--file-merging``: the storage merges files across checkpoints (a range's change files are
segments appended to one physical file per chain). ``--compare-merging``: the same batches
with merging off (what a user has without it) and on, interleaved, ``--repeats`` times each,
with the default full snapshot policy (a chain lasts until its changes outgrow 1 MiB):
prints the state files each created (every file seen in ``shared/`` after a batch), the wall
time per batch, the ratios and ``targets: N/M met`` (at least 10x fewer files; batch wall at
most 1.1x), and each run's retention check. A short run of each mode warms up first.
"""

import argparse
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from pyspark import cloudpickle  # noqa: E402
from pyspark.sql import types as T  # noqa: E402

from pipelines import KeyedResult, Source  # noqa: E402

# Per-customer order totals: orders made up from the batch id (the same batch always has the
# same rows), their count and total per customer as keyed state.
TOTALS = pa.schema([pa.field("customer", pa.string(), nullable=False),
                    ("orders", pa.int64()), ("total", pa.int64())])
ORDER_SCHEMA = T.StructType([T.StructField("customer", T.StringType()),
                             T.StructField("amount", T.LongType())])


@dataclass(frozen=True)
class Orders(Source):
    """``per_partition`` batches of ``rows_per_batch`` orders by ``customers`` customers."""

    per_partition: int = 4
    customers: int = 40
    rows_per_batch: int = 60

    def batches(self, spark, partition):
        return [f"{partition}-{i:03d}" for i in range(self.per_partition)]

    def read(self, spark, partition, batch):
        return spark.createDataFrame(self.rows(batch), ORDER_SCHEMA)

    def rows(self, batch: str) -> list[tuple[str, int]]:
        rng = random.Random(batch)
        return [(f"c{rng.randrange(self.customers)}", rng.randrange(1, 100))
                for _ in range(self.rows_per_batch)]


def customer_totals(input: pa.Table, state: pa.Table) -> KeyedResult:
    batch = input.group_by("customer").aggregate([([], "count_all"), ("amount", "sum")])
    joined = batch.join(state, "customer", join_type="left outer")
    upserts = pa.table({
        "customer": joined.column("customer"),
        "orders": pc.add(joined.column("count_all"), pc.fill_null(joined.column("orders"), 0)),
        "total": pc.add(joined.column("amount_sum"), pc.fill_null(joined.column("total"), 0)),
    })
    return KeyedResult(upserts, pa.table({"customer": pa.array([], pa.string())}), upserts)


# by value: Spark's Python workers cannot import this module (benchmarks/ is not a package)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclass
class RetentionReport:
    batches: int
    seconds: float
    retained: list[int]
    chk_dirs: list[int]
    shared: int
    referenced: int
    unreferenced: list[str]
    missing: list[str]
    other_entries: list[str]
    state_ok: bool
    max_retained: int
    files_created: int = 0

    @property
    def ok(self) -> bool:
        return (not self.unreferenced and not self.missing and not self.other_entries
                and self.retained == self.chk_dirs and len(self.retained) == self.max_retained
                and self.state_ok)

    def lines(self) -> list[str]:
        return [
            f"batches: {self.batches} in {self.seconds:.0f} s "
            f"({self.seconds / max(self.batches, 1):.2f} s/batch)",
            f"retained checkpoints: {self.retained} (max {self.max_retained})",
            f"chk-* directories: {self.chk_dirs}",
            f"shared/ files: {self.shared}, referenced by retained checkpoints: "
            f"{self.referenced}, unreferenced: {len(self.unreferenced)}, "
            f"missing: {len(self.missing)}",
            f"other entries in the job directory: {self.other_entries}",
            f"state files created: {self.files_created}",
            f"state equals a recomputation: {self.state_ok}",
            f"retention: {'ok' if self.ok else 'FAILED'}",
        ]


def check(spark, work: Path, batches: int, max_retained: int = 3, partitions: int = 1,
          progress=None, file_merging: bool = False, full_snapshot=None) -> RetentionReport:
    """Run the keyed totals pipeline over ``batches`` batches (checkpoint every batch,
    ``max_retained`` retained; ``full_snapshot``: default every 3 change files) in
    ``work``, then compare the job directory with the retained checkpoints."""
    import dagster as dg

    from checkpoint_storage import FileSystemCheckpointStorage
    from pipelines import (
        FullSnapshotPolicy,
        KeyedStage,
        StatefulPipeline,
        StatefulRunner,
    )

    per_partition = -(-batches // partitions)
    names = [f"r{i:03d}" for i in range(partitions)]
    source = Orders(per_partition=per_partition)
    pipeline = StatefulPipeline(
        name="keyed_retention",
        stages=[KeyedStage("totals", "customer", TOTALS, customer_totals)],
        source=source,
        partitions=dg.StaticPartitionsDefinition(names),
        checkpoint_interval=1,
        max_retained_checkpoints=max_retained,
        max_parallelism=16,
        full_snapshot=full_snapshot or FullSnapshotPolicy(every=3, min_bytes=0),
        keyed_parallelism=2,
    )
    storage = FileSystemCheckpointStorage(
        str(work / "checkpoints"), file_state_size_threshold=0,
        file_merging_enabled=file_merging, file_merging_across_checkpoint_boundary=file_merging)
    runner = StatefulRunner(spark, storage, pipeline, keyed_local_dir=str(work / "local"))
    job = work / "checkpoints" / str(runner.job_id)
    seen: set[str] = set()

    def on_progress(line: str) -> None:
        if (job / "shared").exists():
            seen.update(str(p) for p in (job / "shared").rglob("*") if p.is_file())
        if progress is not None:
            progress(line)

    started = time.monotonic()
    runner.run(names, on_progress=on_progress)
    seconds = time.monotonic() - started
    runner.store.shared_state_registry.wait_for_pending_deletions()

    retained = [c.checkpoint_id for c in runner.store.all()]
    chk_dirs = sorted(int(p.name[4:]) for p in job.iterdir() if p.name.startswith("chk-"))
    referenced = {h.path for c in runner.store.all() for h in c.metadata.all_handles()
                  if hasattr(h, "path")}
    shared = {str(p) for p in (job / "shared").rglob("*") if p.is_file()}
    other = sorted(p.name for p in job.iterdir() if not p.name.startswith("chk-")
                   and p.name not in ("shared", "taskowned", "_lease"))
    other += sorted(str(p) for p in (job / "taskowned").rglob("*") if p.is_file())

    model: dict[str, tuple[int, int]] = {}
    for name in names:
        for batch in source.batches(None, name):
            for customer, amount in source.rows(batch):
                orders, total = model.get(customer, (0, 0))
                model[customer] = (orders + 1, total + amount)
    rows = runner.restore_states(runner.store.latest().metadata)["totals"].collect()
    state = {r["customer"]: (r["orders"], r["total"]) for r in rows}
    return RetentionReport(
        per_partition * partitions, seconds, retained, chk_dirs, len(shared), len(referenced),
        sorted(shared - referenced), sorted(referenced - shared), other,
        len(rows) == len(state) and state == model, max_retained, len(seen | shared))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--retained", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--work-dir")
    parser.add_argument("--progress", type=int, default=50, help="a line every N batches")
    parser.add_argument("--file-merging", action="store_true")
    parser.add_argument("--compare-merging", action="store_true")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from resources import build_spark_session

    spark = build_spark_session("local[2]", "keyed-retention", {
        "spark.sql.shuffle.partitions": "4", "spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    started = time.monotonic()

    def progress(line: str) -> None:
        if "batch " in line and " of " in line and "rows in" in line:
            done = int(line.split("batch ")[1].split(" of")[0])
            if done % args.progress == 0:
                print(f"  {line} ({time.monotonic() - started:.0f} s)", flush=True)

    if args.compare_merging:
        ok = compare_merging(spark, args)
        spark.stop()
        sys.exit(0 if ok else 1)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        report = check(spark, Path(work), args.batches, args.retained, args.partitions,
                       progress, args.file_merging)
    spark.stop()
    for line in report.lines():
        print(line)
    for path in report.unreferenced[:5] + report.missing[:5]:
        print(f"  {path}")
    sys.exit(0 if report.ok else 1)


def compare_merging(spark, args) -> bool:
    """Merging off and on, interleaved; prints files, batch wall, ratios and targets."""
    from pipelines import FullSnapshotPolicy

    print(f"load average at start: {os.getloadavg()}", flush=True)
    reports: dict[bool, list[RetentionReport]] = {False: [], True: []}
    for merging in (False, True):  # warm-up, not measured: the JVM, the Python workers
        with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
            check(spark, Path(work), 5, args.retained, 1, None, merging)
    for repeat in range(args.repeats):
        for merging in (False, True):
            with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
                report = check(spark, Path(work), args.batches, args.retained,
                               args.partitions, None, merging, FullSnapshotPolicy())
            reports[merging].append(report)
            print(f"run {repeat + 1} merging {'on' if merging else 'off'}: "
                  f"{report.seconds / report.batches:.3f} s/batch, "
                  f"{report.files_created} state files, retention "
                  f"{'ok' if report.ok else 'FAILED'}", flush=True)
    off, on = reports[False], reports[True]
    files_off = min(r.files_created for r in off)
    files_on = max(r.files_created for r in on)
    wall_off = min(r.seconds / r.batches for r in off)
    wall_on = min(r.seconds / r.batches for r in on)
    rows = [
        ("state files created", files_on / files_off, 0.1),
        ("batch wall (best)", wall_on / wall_off, 1.1),
    ]
    print(f"state files created over {args.batches} batches: off {files_off}, on {files_on}")
    print(f"batch wall (best of {args.repeats}): off {wall_off:.3f} s, on {wall_on:.3f} s")
    met = 0
    for name, ratio, target in rows:
        ok = ratio <= target
        met += ok
        print(f"{name}: merging on {ratio:.2f}x off (target <= {target}x): "
              f"{'ok' if ok else 'MISSED'}")
    retention_ok = all(r.ok for r in off + on)
    print(f"retention and state, every run: {'ok' if retention_ok else 'FAILED'}")
    print(f"load average at end: {os.getloadavg()}")
    print(f"targets: {met}/{len(rows)} met")
    return retention_ok


if __name__ == "__main__":
    main()
