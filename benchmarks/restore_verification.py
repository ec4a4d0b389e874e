"""What the runner's verification of a restored checkpoint costs (issue 24): the time to read
and check (size and CRC-32) every state file of a keyed stage's newest checkpoint on local
disk, on the driver, as ``StatefulRunner`` does before it restores.

The state: ``--keys`` keys (default 1,000,000) of a per-user aggregate (user id string, count,
sum, last time), max parallelism 128 on 2 ranges, written with the real chain format
(``write_full_snapshot``, ``write_change_file``) through a real ``FileSystemCheckpointStorage``.
Two checkpoints are measured: a chain just snapshotted (the snapshots alone), and the longest
chain the default ``FullSnapshotPolicy`` (ratio 1.0) lets grow: the snapshots plus change
files of 1% of the keys each, as many bytes as the snapshots. Files are read from the page
cache (just written); a cold read from disk or an object store adds its transfer time.

    python benchmarks/restore_verification.py [--keys 1000000] [--repeats 3] [--work-dir DIR]
"""

import argparse
import datetime as dt
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoint_storage import (  # noqa: E402
    FileSystemCheckpointStorage,
    JobID,
    format_size,
    verify_state_handles,
)
from pipelines.keyed import (  # noqa: E402
    KEY_GROUP,
    KeyedResult,
    KeyedStage,
    KeyedStateLayout,
    assign_key_groups,
    compute_key_group_range_for_operator_index,
    write_change_file,
    write_full_snapshot,
)

SCHEMA = pa.schema([pa.field("user", pa.string(), nullable=False), ("count", pa.int64()),
                    ("total", pa.int64()), ("last", pa.timestamp("us", "UTC"))])
MAX_PARALLELISM, PARALLELISM = 128, 2


def rows(ids: np.ndarray, rng: np.random.Generator) -> pa.Table:
    return pa.table({
        "user": pa.array([f"user-{i:09d}" for i in ids], pa.string()),
        "count": pa.array(rng.integers(1, 1000, len(ids))),
        "total": pa.array(rng.integers(1, 10**6, len(ids))),
        "last": pa.array(np.datetime64("2026-01-01") + rng.integers(0, 10**9, len(ids)).astype(
            "timedelta64[s]"), pa.timestamp("us", "UTC")),
    }, schema=SCHEMA)


def timed(handles, repeats: int, workers: int) -> tuple[float, int]:
    seconds, read = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        read, problems = verify_state_handles(handles, max_workers=workers)
        seconds.append(time.perf_counter() - started)
        assert not problems, problems
    return statistics.median(seconds), read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="restore-verification-"))
    try:
        measure(work, args)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


def measure(work: Path, args) -> None:
    storage = FileSystemCheckpointStorage(str(work / "checkpoints"))
    access = storage.create_checkpoint_storage(JobID.generate())
    access.initialize_base_locations()
    location = access.initialize_location_for_checkpoint(1)
    factory = access.resolve_checkpoint_storage_location(1, location.location_reference)
    stage = KeyedStage("agg", "user", SCHEMA,
                       lambda i, s: KeyedResult(i, i.select(["user"]).slice(0, 0), i))
    layout = KeyedStateLayout.of(stage, MAX_PARALLELISM)
    rng = np.random.default_rng(24)
    state = rows(np.arange(args.keys), rng)
    groups = assign_key_groups(state, ("user",), MAX_PARALLELISM)
    state = state.append_column(KEY_GROUP, groups.cast(pa.int16()))
    snapshots, changes = [], []
    for index in range(PARALLELISM):
        key_groups = compute_key_group_range_for_operator_index(MAX_PARALLELISM, PARALLELISM,
                                                                index)
        mine = state.filter(pa.compute.and_(
            pa.compute.greater_equal(state.column(KEY_GROUP), key_groups.start),
            pa.compute.less_equal(state.column(KEY_GROUP), key_groups.end)))
        mine = mine.sort_by(KEY_GROUP)
        snapshot = write_full_snapshot(factory, layout, key_groups, mine.to_batches())
        snapshots.append(snapshot)
        written = 0
        while written < snapshot.state_size:  # the policy's ratio 1.0: changes up to the base
            changed = rng.choice(args.keys, args.keys // 100, replace=False)
            upserts = rows(changed, rng)
            upserts = upserts.filter(pa.compute.is_in(
                upserts.column("user"), mine.column("user")))
            change = write_change_file(factory, layout, key_groups, upserts,
                                       upserts.select(["user"]).slice(0, 0))
            changes.append(change)
            written += change.state_size
    print(f"state: {args.keys:,} keys, {PARALLELISM} ranges of {MAX_PARALLELISM} key groups; "
          f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC")
    for name, handles in (("just snapshotted", snapshots),
                          ("longest chain (ratio 1.0)", snapshots + changes)):
        for workers in (8, 1):
            seconds, read = timed(handles, args.repeats, workers)
            print(f"{name}: {len(handles)} files, {format_size(read)}, {workers} thread(s): "
                  f"{seconds:.3f} s ({read / seconds / 2**20:.0f} MiB/s)")


if __name__ == "__main__":
    main()
