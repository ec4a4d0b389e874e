"""File merging (Flink FLIP-306): small states packed into few physical files, off vs on.

Usage::

    .venv/bin/python benchmarks/file_merging.py [--backend local|s3|all] [--states 2000]
        [--checkpoints 10] [--state-size 32768] [--subtasks 20]

Workload, per backend and mode: ``--states`` EXCLUSIVE states of ``--state-size`` bytes (above
the 20 KiB inline threshold) spread over ``--checkpoints`` checkpoints and ``--subtasks``
subtasks. Each checkpoint is written, (with merging) synced, finalized and acknowledged; then
the previous checkpoint is subsumed: discarded by the coordinator (`_metadata` and private
files) and, with merging, the manager is notified so unreferenced physical files go.

Printed per backend, merging off vs on: state files created, S3 requests (every request moto
served, including `_metadata` and deletions), write time (state streams plus sync), bytes of
state files on storage at the end and the space amplification (those bytes / the live bytes of
the retained checkpoint). Targets: at least 20x fewer files and S3 requests with merging, and
space amplification at most the configured bound (2.0).

For S3 the script starts moto's server on 127.0.0.1 (a free port) in this process with test
credentials (benchmarks/_common.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from _common import start_moto, targets_line

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from checkpoint_storage import (  # noqa: E402
    CheckpointedStateScope,
    CheckpointMetadata,
    CheckpointStorageLocationReference,
    CompletedCheckpoint,
    FileSystemCheckpointStorage,
    JobID,
    OperatorState,
    OperatorSubtaskState,
    SubtaskKey,
    create_file_merging_snapshot_manager,
    discard_checkpoint,
    store_checkpoint_metadata,
)

KIB = 1024


@dataclass
class Result:
    files: int
    requests: int | None
    write_seconds: float
    bytes_on_storage: int
    live_bytes: int

    @property
    def amplification(self) -> float:
        return self.bytes_on_storage / self.live_bytes if self.live_bytes else float("inf")


@dataclass
class Row:
    backend: str
    workload: str
    ok: bool | None


class RequestCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def record(self, environ: dict) -> None:
        with self._lock:
            self.count += 1


def run(base_url, options, merging: bool, args, counter: RequestCounter | None) -> Result:
    storage = FileSystemCheckpointStorage(
        base_url, storage_options=options, file_merging_enabled=merging
    )
    job = JobID(uuid.uuid4().hex)
    access = storage.create_checkpoint_storage(job)
    access.initialize_base_locations()
    keys = [SubtaskKey(job.hex, "op", i, args.subtasks) for i in range(args.subtasks)]
    manager = create_file_merging_snapshot_manager("bench") if merging else None
    views = [access.to_file_merging_storage(manager, k) for k in keys]
    per_checkpoint = args.states // args.checkpoints
    data = os.urandom(args.state_size)
    if counter is not None:
        counter.count = 0
    files = 0
    write_seconds = 0.0
    previous: CompletedCheckpoint | None = None
    for checkpoint_id in range(1, args.checkpoints + 1):
        location = access.initialize_location_for_checkpoint(checkpoint_id)
        handles: dict[int, list] = {i: [] for i in range(args.subtasks)}
        start = time.perf_counter()
        for n in range(per_checkpoint):
            i = n % args.subtasks
            factory = views[i].resolve_checkpoint_storage_location(
                checkpoint_id, CheckpointStorageLocationReference.get_default()
            )
            with factory.create_checkpoint_state_output_stream(
                CheckpointedStateScope.EXCLUSIVE
            ) as out:
                out.write(data)
                handles[i].append(out.close_and_get_handle())
        if manager is not None:
            manager.sync_checkpoint(checkpoint_id)
        write_seconds += time.perf_counter() - start
        if manager is None:
            files += per_checkpoint
        md = CheckpointMetadata(
            checkpoint_id,
            (
                OperatorState(
                    "op",
                    args.subtasks,
                    subtask_states={i: OperatorSubtaskState(tuple(h)) for i, h in handles.items()},
                ),
            ),
        )
        out = location.create_metadata_output_stream()
        store_checkpoint_metadata(md, out)
        completed = CompletedCheckpoint(out.close_and_finalize_checkpoint(), md)
        if manager is not None:
            for k in keys:
                manager.notify_checkpoint_complete(k, checkpoint_id)
        if previous is not None:
            discard_checkpoint(previous)
            if manager is not None:
                for k in keys:
                    manager.notify_checkpoint_subsumed(k, checkpoint_id - 1)
        previous = completed
    if manager is not None:
        files = manager.files_created
    requests = counter.count if counter is not None else None
    fs = access._fs
    fs.invalidate_cache()
    listing = fs.find(access._path(access.checkpoints_directory), detail=True)
    on_storage = sum(
        int(info["size"]) for name, info in listing.items() if not name.endswith("_metadata")
    )
    live = previous.metadata.state_size
    return Result(files, requests, write_seconds, on_storage, live)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["local", "s3", "all"], default="all")
    parser.add_argument("--states", type=int, default=2000)
    parser.add_argument("--checkpoints", type=int, default=10)
    parser.add_argument("--state-size", type=int, default=32 * KIB)
    parser.add_argument("--subtasks", type=int, default=20)
    args = parser.parse_args()
    bound = 2.0
    print(
        f"file merging: {args.states} states of {args.state_size // KIB} KiB over "
        f"{args.checkpoints} checkpoints, {args.subtasks} subtasks, EXCLUSIVE scope, "
        f"within-checkpoint merging, max space amplification {bound}"
    )
    rows: list[Row] = []
    backends = ["local", "s3"] if args.backend == "all" else [args.backend]
    for name in backends:
        counter = None
        server = None
        tmp = None
        if name == "local":
            tmp = tempfile.mkdtemp(prefix="fm-bench-")
            base, options = tmp, {}
        else:
            counter = RequestCounter()
            endpoint, server = start_moto(counter.record)
            import boto3

            bucket = f"bench-{uuid.uuid4().hex[:12]}"
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
            base, options = f"s3://{bucket}/cp", {"endpoint_url": endpoint}
        try:
            off = run(base, options, False, args, counter)
            on = run(base, options, True, args, counter)
        finally:
            if server is not None:
                server.stop()
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        print(f"\n{name}:")
        print(f"  {'':28} {'merging off':>14} {'merging on':>14} {'off / on':>10}")

        def line(label, a, b, fmt="{:,}"):
            ratio = f"{a / b:.1f}x" if isinstance(a, int | float) and b else "-"
            print(f"  {label:28} {fmt.format(a):>14} {fmt.format(b):>14} {ratio:>10}")

        line("state files created", off.files, on.files)
        if off.requests is not None:
            line("S3 requests", off.requests, on.requests)
        line("write time (s)", off.write_seconds, on.write_seconds, "{:.2f}")
        line("bytes on storage", off.bytes_on_storage, on.bytes_on_storage)
        line("space amplification", off.amplification, on.amplification, "{:.2f}")
        files_ok = off.files >= 20 * on.files
        rows.append(Row(name, "files >= 20x fewer", files_ok))
        if off.requests is not None:
            rows.append(Row(name, "S3 requests >= 20x fewer", off.requests >= 20 * on.requests))
        rows.append(Row(name, f"space amplification <= {bound}", on.amplification <= bound))
    print(targets_line(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
