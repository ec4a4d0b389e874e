"""What verifying the local keyed-state store costs a batch (issue 24).

Usage::

    .venv/bin/python benchmarks/store_verification.py [--sizes 1000000,4000000] [--rounds 9]

Per state size S: one store of S rows (a segment) per variant, then per round and variant,
interleaved (the order alternating), one batch as a keyed stage's task runs it: open the
store, ``get`` 10,000 of its keys, ``apply`` them changed. Variants:

- ``off``: no checksum checked at open and no fsync (the store as it was before);
- ``checksums``: checksums checked at open (once per process per file), no fsync: what
  verifying alone costs;
- ``verified``: this change: checksums checked, each written file and the manifest fsynced,
  the directory after the rename (three fsyncs per batch).

``warm``: the files were verified (or written) by this process already, as in a Python
worker's later batches; ``cold``: the first open in a process (the record of verified files
cleared first), which hashes the segment and every run. The files are in the page cache in
both cases (dropping it needs root and would disturb other processes).

Prints the best batch time (of ``--rounds``: the least disturbed by other processes, as in
keyed_store.py; the median after it) and the median CPU time per size, variant and kind, with
ratios to ``off``, the time spent waiting in fsync, and a ``targets`` line: warm batch (time,
and CPU, which a loaded machine disturbs less) <= 1.05x ``off`` for ``checksums`` and
``verified``. The cold open's extra cost is stated, not a target (once per file and Python
worker).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipelines.keyed import (  # noqa: E402
    ArrowKeyedStateStore,
    KeyedStateLayout,
    KeyGroupRange,
    forget_verified_files,
)

SCHEMA = pa.schema([("key", pa.string()), ("page", pa.string()), ("count", pa.int64()),
                    ("seen", pa.timestamp("us", "UTC"))])
MAX_PARALLELISM = 128
LAYOUT = KeyedStateLayout(("key",), SCHEMA, MAX_PARALLELISM)
RANGE = KeyGroupRange(0, MAX_PARALLELISM - 1)
CHANGED = 10_000
WARM_TARGET = 1.05
VARIANTS = ["off", "checksums", "verified"]


def make_rows(ids: np.ndarray, rng: np.random.Generator) -> pa.Table:
    keys = pc.binary_join_element_wise(
        "user_", pc.utf8_lpad(pa.array(ids).cast(pa.string()), 10, "0"), "")
    pages = pc.binary_join_element_wise(
        "/p/", pa.array(rng.integers(0, 50_000, len(ids))).cast(pa.string()), "")
    seen = pa.array(rng.integers(1_700_000_000_000_000, 1_800_000_000_000_000, len(ids)))
    return pa.table([keys, pages, pa.array(rng.integers(1, 1000, len(ids)), pa.int64()),
                     seen.cast(pa.timestamp("us", "UTC"))], schema=SCHEMA)


class Fsync:
    """os.fsync timed while inside (``sync=False``: a no-op, the ``off`` variant)."""

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.seconds = 0.0

    def __enter__(self):
        self._real = os.fsync

        def fsync(descriptor) -> None:
            started = time.perf_counter()
            if self.sync:
                self._real(descriptor)
            self.seconds += time.perf_counter() - started

        os.fsync = fsync
        return self

    def __exit__(self, *exc) -> None:
        os.fsync = self._real


def one_batch(directory: Path, verify: bool, sync: bool, keys: pa.Table,
              batch: int) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, seconds waiting in fsync) of one batch."""
    started, cpu = time.perf_counter(), time.process_time()
    with Fsync(sync) as fsync:
        store = ArrowKeyedStateStore(directory, LAYOUT, RANGE, verify=verify)
        state = store.get(keys)
        changed = state.set_column(2, "count", pc.add(state.column("count"), 1))
        store.apply(changed, LAYOUT.key_schema.empty_table(), version=f"b{batch}")
        store.close()
    return time.perf_counter() - started, time.process_time() - cpu, fsync.seconds


def measure(size: int, rounds: int, work: Path) -> tuple[dict[tuple[str, str], list], int]:
    """(wall, CPU, fsync) seconds of each batch per (variant, kind), and the segment's
    bytes."""
    rng = np.random.default_rng(size)
    directories = {v: work / f"{v}-{size}" for v in VARIANTS}
    rows = make_rows(np.arange(size), rng)
    for directory in directories.values():
        store = ArrowKeyedStateStore(directory, LAYOUT, RANGE)
        store.load(rows, version="b0")
        store.close()
    del rows
    segment_bytes = sum(p.stat().st_size for p in directories["off"].glob("segment-*"))
    times: dict[tuple[str, str], list[float]] = {}
    for round_ in range(rounds):
        order = VARIANTS[round_ % 3:] + VARIANTS[:round_ % 3]  # rotating
        for variant in order:
            # cold then warm: clearing the record for another variant's cold batch would
            # make this variant's next batch cold again
            for kind in ("cold", "warm"):
                keys = make_rows(rng.choice(size, CHANGED, replace=False), rng).select(["key"])
                if kind == "cold":
                    forget_verified_files()  # as the first open in a new Python worker
                batch = 2 * round_ + (kind == "warm") + 1
                measured = one_batch(directories[variant], variant != "off",
                                     variant == "verified", keys, batch)
                times.setdefault((variant, kind), []).append(measured)
    for directory in directories.values():
        shutil.rmtree(directory)
    return times, segment_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000000,4000000")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()[0]:.2f}")
    met = checked = 0
    with tempfile.TemporaryDirectory(prefix="store-verification-") as work:
        for size in (int(s) for s in args.sizes.split(",")):
            times, segment_bytes = measure(size, args.rounds, Path(work))
            best = {k: min(t[0] for t in v) for k, v in times.items()}
            median = {k: statistics.median(t[0] for t in v) for k, v in times.items()}
            cpu = {k: statistics.median(t[1] for t in v) for k, v in times.items()}
            fsync = statistics.median(t[2] for t in times[("verified", "warm")])
            segment_mb = segment_bytes / 1e6
            print(f"\n{size:,} rows (segment ~{segment_mb:.0f} MB), batch of {CHANGED:,} "
                  f"changed keys, best of {args.rounds} (median) in ms:")
            for kind in ("warm", "cold"):
                off = best[("off", kind)]
                print(f"  {kind}: " + "  ".join(
                    f"{v} {best[(v, kind)] * 1e3:.1f} ({median[(v, kind)] * 1e3:.1f}) "
                    f"{best[(v, kind)] / off:.2f}x" for v in VARIANTS))
                print(f"  {kind} CPU (median): " + "  ".join(
                    f"{v} {cpu[(v, kind)] * 1e3:.1f} {cpu[(v, kind)] / cpu[('off', kind)]:.2f}x"
                    for v in VARIANTS))
            for variant in VARIANTS[1:]:
                for what, table in (("time", best), ("CPU", cpu)):
                    ratio = table[(variant, "warm")] / table[("off", "warm")]
                    checked += 1
                    met += ratio <= WARM_TARGET
                    print(f"  warm {variant} {what} <= {WARM_TARGET}x off: "
                          f"{'met' if ratio <= WARM_TARGET else 'MISSED'} ({ratio:.2f}x)")
            print(f"  cold open with checksums: "
                  f"{(cpu[('checksums', 'cold')] - cpu[('checksums', 'warm')]) * 1e3:.0f} ms "
                  f"CPU more than warm (once per file and Python worker); the three fsyncs of "
                  f"a batch waited {fsync * 1e3:.1f} ms (median)")
    print(f"\nload after: {os.getloadavg()[0]:.2f}")
    print(f"targets: {met}/{checked} met")
    return 0 if met == checked else 1


if __name__ == "__main__":
    sys.exit(main())
