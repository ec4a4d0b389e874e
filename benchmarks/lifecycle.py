"""Checkpoint lifecycle at scale: discovery of the latest completed checkpoint, and discarding.

Usage::

    .venv/bin/python benchmarks/lifecycle.py [--backend local|s3|all] [--checkpoints 10000]
        [--files 5000] [--repeats 3] [--workers 16] [--aborted 1000 10000]
        [--workloads discovery discard aborted]

Three workloads per backend:

- discovery: ``--checkpoints`` ``chk-<id>`` directories in one job directory, each with a small
  valid `_metadata` (the first finalized through the library, the rest written with the same
  encoding, ``encode_metadata(CheckpointMetadata(id))``, in bulk with ``fs.pipe``), then
  ``access.latest_completed_checkpoint()`` timed, best of ``--repeats``. On S3 every request
  the server receives is counted. Target: at most ceil(N/1000) + 1 LIST requests.
- discard: a completed checkpoint of ``--files`` private 1 KiB files, discarded with
  ``discard_checkpoint(checkpoint, max_workers=--workers)`` (S3: bulk DeleteObjects), against a
  serial baseline on a fresh identical checkpoint that deletes the same files one by one
  (``for h in handles: h.discard_state()``), with `_metadata` first and the directory last as
  ``discard_checkpoint`` does. Best of ``--repeats``; printed as the ratio serial / parallel
  (expected above 1: the reason deletions are parallel).
- aborted (issue 13): one completed ``chk-1`` below each of ``--aborted`` counts of aborted
  ``chk-<id>`` directories (one orphaned state file each, no `_metadata`), then ``latest``
  timed once with the library's discovery by listing and once with the probing discovery it
  replaced (``latest_by_probing``, kept here as the baseline: a listing of the job directory,
  then per directory, newest first, a HEAD of `_metadata` and, when absent, a HEAD and a LIST
  of the directory). On S3 every request is counted. Target: at most ceil(N/1000) + 1 LIST
  requests with the listing.

For S3 the script starts moto's server on 127.0.0.1 (a free port) in this process, with a WSGI
layer that logs each request, and test credentials in the environment.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import platform
import sys
import threading
import time
import uuid
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from _common import Backend, open_backend, targets_line

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

KIB = 1024
PIPE_BATCH = 1000  # objects per fs.pipe call (s3fs uploads each batch concurrently)
FILE_SIZE = KIB


# --- backends -------------------------------------------------------------------------------


class RequestLog:
    """Every HTTP request moto served: (method, kind) counts, resettable."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter = Counter()

    def record(self, environ: dict) -> None:
        method = environ["REQUEST_METHOD"]
        key = environ.get("PATH_INFO", "").lstrip("/").partition("/")[2]
        query = environ.get("QUERY_STRING", "")
        if method == "GET" and (not key or "list-type" in query):
            kind = "LIST"
        elif method == "POST" and "delete" in query:
            kind = "DeleteObjects"
        else:
            kind = method
        with self._lock:
            self._counts[kind] += 1

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()

    def snapshot(self) -> Counter:
        with self._lock:
            return Counter(self._counts)


def new_job(backend: Backend, directory: str):
    """A fresh job's storage access below ``directory``, with its base locations."""
    from checkpoint_storage import FileSystemCheckpointStorage, JobID

    storage = FileSystemCheckpointStorage(
        f"{backend.base_url}/{directory}", storage_options=backend.storage_options
    )
    access = storage.create_checkpoint_storage(JobID.generate())
    access.initialize_base_locations()
    return access


def pipe_all(fs, files: dict[str, bytes], local: bool) -> None:
    """Write many small files: in concurrent batches on S3, one by one on local disk."""
    items = list(files.items())
    for start in range(0, len(items), PIPE_BATCH):
        batch = dict(items[start : start + PIPE_BATCH])
        if local:
            for directory in {p.rsplit("/", 1)[0] for p in batch}:
                os.makedirs(directory, exist_ok=True)
        fs.pipe(batch)


# --- discovery --------------------------------------------------------------------------------


@dataclass
class Row:
    backend: str
    workload: str
    result: str
    target: str = ""
    ok: bool | None = None


def discovery(backend: Backend, n: int, repeats: int) -> list[Row]:
    from checkpoint_storage import CheckpointMetadata, store_checkpoint_metadata

    def encode_metadata(metadata: CheckpointMetadata) -> bytes:
        """The `_metadata` bytes the library writes (a stream without a job lease)."""
        buffer = io.BytesIO()
        store_checkpoint_metadata(metadata, buffer)
        return buffer.getvalue()

    access = new_job(backend, "discovery")
    fs = access._fs
    job = access._path(access.checkpoints_directory)
    local = backend.name == "local"

    start = time.perf_counter()
    # One real checkpoint through the library; the others get the same encoding.
    location = access.initialize_location_for_checkpoint(1)
    out = location.create_metadata_output_stream()
    store_checkpoint_metadata(CheckpointMetadata(1), out)
    completed = out.close_and_finalize_checkpoint()
    real = fs.cat_file(access._path(completed.metadata_handle.path))
    if real != encode_metadata(CheckpointMetadata(1)):
        raise AssertionError("the library's _metadata differs from encode_metadata()")
    pipe_all(
        fs,
        {
            f"{job}/chk-{i}/_metadata": encode_metadata(CheckpointMetadata(i))
            for i in range(2, n + 1)
        },
        local,
    )
    fs.invalidate_cache()
    written = time.perf_counter() - start
    print(
        f"  discovery: {n:,} chk-<id> directories with a valid _metadata written in "
        f"{written:.1f} s ({len(real)} bytes each)"
    )

    times, requests = [], []
    for _ in range(repeats):
        if backend.log is not None:
            backend.log.reset()
        start = time.perf_counter()
        latest = access.latest_completed_checkpoint()
        times.append(time.perf_counter() - start)
        if backend.log is not None:
            requests.append(backend.log.snapshot())
        if latest is None or not latest.external_pointer.endswith(f"/chk-{n}"):
            raise AssertionError(f"latest should be chk-{n}, got {latest!r}")
        if latest.load_metadata().checkpoint_id != n:
            raise AssertionError("the latest checkpoint's metadata has the wrong id")
    print(f"    latest_completed_checkpoint() runs (s): {' '.join(f'{t:.3f}' for t in times)}")
    best = min(times)
    if not requests:
        return [Row(backend.name, f"discovery: latest of {n:,} chk-<id>", f"{best:.3f} s")]
    lists = max(r["LIST"] for r in requests)
    others = ", ".join(f"{v} {k}" for k, v in sorted(requests[-1].items()) if k != "LIST")
    print(f"    requests per call: {lists} LIST, {others}")
    target = math.ceil(n / 1000) + 1
    return [
        Row(
            backend.name,
            f"discovery: latest of {n:,} chk-<id>",
            f"{best:.3f} s, {lists} LIST ({others})",
            f"<= {target} LIST",
            lists <= target,
        )
    ]


# --- discovery behind aborted directories (issue 13) ------------------------------------------


def latest_by_probing(access):
    """The discovery before issue 13, kept as the baseline: list the job directory, then
    resolve each ``chk-<id>`` newest first (a HEAD of its `_metadata`; when absent, a HEAD
    and a LIST of the directory to say why) until one loads."""
    import re

    from checkpoint_storage.exceptions import (
        CheckpointNotFoundError,
        InvalidCheckpointError,
        UnsafePathError,
    )

    fs = access._fs
    job = access._path(access.checkpoints_directory)
    fs.invalidate_cache(job)
    names = [entry.rstrip("/").rpartition("/")[2] for entry in fs.ls(job, detail=False)]
    ids = sorted(
        (int(m.group(1)) for n in names if (m := re.fullmatch(r"chk-(0|[1-9][0-9]*)", n))),
        reverse=True,
    )
    for checkpoint_id in ids:
        try:
            completed = access.resolve_checkpoint(
                f"{access.checkpoints_directory}/chk-{checkpoint_id}"
            )
            completed.load_metadata()
        except CheckpointNotFoundError:
            continue
        except (InvalidCheckpointError, UnsafePathError):
            continue
        return completed
    return None


def aborted_discovery(backend: Backend, counts: list[int]) -> list[Row]:
    from checkpoint_storage import CheckpointMetadata, store_checkpoint_metadata

    rows = []
    for n in counts:
        access = new_job(backend, f"aborted-{n}")
        fs = access._fs
        job = access._path(access.checkpoints_directory)
        location = access.initialize_location_for_checkpoint(1)
        out = location.create_metadata_output_stream()
        store_checkpoint_metadata(CheckpointMetadata(1), out)
        out.close_and_finalize_checkpoint()
        start = time.perf_counter()
        pipe_all(
            fs,
            {f"{job}/chk-{i}/orphan": b"x" for i in range(2, n + 2)},
            backend.name == "local",
        )
        fs.invalidate_cache()
        print(
            f"  aborted: {n:,} aborted chk-<id> above chk-1 written in "
            f"{time.perf_counter() - start:.1f} s"
        )
        for label, function in (("listing", None), ("probing (before)", latest_by_probing)):
            if backend.log is not None:
                backend.log.reset()
            start = time.perf_counter()
            latest = access.latest_completed_checkpoint() if function is None else function(access)
            elapsed = time.perf_counter() - start
            if latest is None or not latest.external_pointer.endswith("/chk-1"):
                raise AssertionError(f"latest should be chk-1, got {latest!r}")
            counts_ = backend.log.snapshot() if backend.log is not None else Counter()
            total = sum(counts_.values())
            shown = ", ".join(f"{v} {k}" for k, v in sorted(counts_.items()))
            print(f"    latest by {label}: {elapsed:.3f} s, {total} requests ({shown})")
            target, ok = "", None
            if function is None and backend.log is not None:
                target = f"<= {math.ceil((n + 1) / 1000) + 1} LIST"
                ok = counts_["LIST"] <= math.ceil((n + 1) / 1000) + 1
            result = f"{elapsed:.3f} s"
            if backend.log is not None:
                result += f", {total} requests ({shown})"
            rows.append(Row(backend.name, f"latest, {n:,} aborted: {label}", result, target, ok))
    return rows


# --- discarding --------------------------------------------------------------------------------


def make_checkpoint(access, checkpoint_id: int, data: list[bytes], local: bool):
    """A completed checkpoint of private files with the given contents: files written in
    bulk, handles as the library's streams record them, `_metadata` published through the
    checkpoint's location."""
    from checkpoint_storage import (
        CheckpointMetadata,
        CompletedCheckpoint,
        OperatorState,
        OperatorSubtaskState,
        RelativeFileStateHandle,
        store_checkpoint_metadata,
    )

    fs = access._fs
    location = access.initialize_location_for_checkpoint(checkpoint_id)
    directory = f"{access.checkpoints_directory}/chk-{checkpoint_id}"
    names = [uuid.uuid4().hex for _ in data]
    pipe_all(
        fs, {access._path(f"{directory}/{n}"): d for n, d in zip(names, data, strict=True)}, local
    )
    handles = tuple(
        RelativeFileStateHandle(f"{directory}/{n}", n, len(d), zlib.crc32(d), filesystem=fs)
        for n, d in zip(names, data, strict=True)
    )
    metadata = CheckpointMetadata(
        checkpoint_id,
        (OperatorState("op", 1, subtask_states={0: OperatorSubtaskState(handles)}),),
    )
    out = location.create_metadata_output_stream()
    store_checkpoint_metadata(metadata, out)
    checkpoint = CompletedCheckpoint(out.close_and_finalize_checkpoint(), metadata)
    if len(checkpoint.private_handles()) != len(data):
        raise AssertionError("the benchmark's handles are not the checkpoint's private state")
    fs.invalidate_cache()
    return checkpoint


def remaining(access, checkpoint) -> int:
    fs = access._fs
    fs.invalidate_cache()
    try:
        return len(fs.find(access._path(checkpoint.external_pointer)))
    except FileNotFoundError:
        return 0


def discard(backend: Backend, m: int, repeats: int, workers: int) -> list[Row]:
    from checkpoint_storage import discard_checkpoint

    access = new_job(backend, "discard")
    local = backend.name == "local"
    data = [os.urandom(FILE_SIZE) for _ in range(m)]
    next_id = iter(range(1, 2 * repeats + 1))

    def parallel() -> tuple[float, Counter]:
        checkpoint = make_checkpoint(access, next(next_id), data, local)
        if backend.log is not None:
            backend.log.reset()
        start = time.perf_counter()
        discard_checkpoint(checkpoint, max_workers=workers)
        elapsed = time.perf_counter() - start
        counts = backend.log.snapshot() if backend.log is not None else Counter()
        if remaining(access, checkpoint):
            raise AssertionError("discard_checkpoint left files behind")
        return elapsed, counts

    def serial() -> tuple[float, Counter]:
        checkpoint = make_checkpoint(access, next(next_id), data, local)
        handles = checkpoint.private_handles()
        if backend.log is not None:
            backend.log.reset()
        start = time.perf_counter()
        checkpoint.location.metadata_handle.discard_state()
        for h in handles:
            h.discard_state()
        checkpoint.location.dispose_storage_location()
        elapsed = time.perf_counter() - start
        counts = backend.log.snapshot() if backend.log is not None else Counter()
        if remaining(access, checkpoint):
            raise AssertionError("the serial baseline left files behind")
        return elapsed, counts

    par_runs, ser_runs = [], []
    for r in range(repeats):  # alternate which side goes first
        for fn, runs in ((parallel, par_runs), (serial, ser_runs))[:: 1 if r % 2 == 0 else -1]:
            runs.append(fn())
    par, ser = min(t for t, _ in par_runs), min(t for t, _ in ser_runs)
    print(
        f"  discard: {m:,} private files of {FILE_SIZE} bytes, best of {repeats}, "
        f"a fresh identical checkpoint each run"
    )
    print(f"    parallel runs (s): {' '.join(f'{t:.3f}' for t, _ in par_runs)}")
    print(f"    serial runs (s):   {' '.join(f'{t:.3f}' for t, _ in ser_runs)}")

    def requests(counts: Counter) -> str:
        if backend.log is None:
            return ""
        shown = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        return f" ({shown})"

    ratio = ser / par
    return [
        Row(
            backend.name,
            f"discard {m:,} files: parallel ({workers} workers)",
            f"{par:.3f} s{requests(par_runs[-1][1])}",
        ),
        Row(
            backend.name,
            f"discard {m:,} files: serial, one by one",
            f"{ser:.3f} s{requests(ser_runs[-1][1])}",
        ),
        Row(backend.name, "discard: serial / parallel", f"{ratio:.1f}x", "> 1x", ratio > 1),
    ]


# --- main -----------------------------------------------------------------------------------------


def run_backend(name: str, args) -> list[Row]:
    backend = open_backend(name, args.local_dir, "lifecycle", RequestLog())
    try:
        print(f"\n== {name}: {backend.description}")
        if name == "s3":
            print("  note: moto serves from this process, so client and server share the GIL")
        rows = []
        if "discovery" in args.workloads:
            rows += discovery(backend, args.checkpoints, args.repeats)
        if "discard" in args.workloads:
            rows += discard(backend, args.files, args.repeats, args.workers)
        if "aborted" in args.workloads:
            rows += aborted_discovery(backend, args.aborted)
    finally:
        backend.close()
    print_table(rows)
    return rows


def print_table(rows: list[Row]) -> None:
    headers = ("backend", "workload", "result", "target", "ok")
    table = [
        (r.backend, r.workload, r.result, r.target, {None: "", True: "ok", False: "MISSED"}[r.ok])
        for r in rows
    ]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(headers)]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    print("  ".join("-" * w for w in widths))
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)).rstrip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("local", "s3", "all"), default="all")
    parser.add_argument("--checkpoints", type=int, default=10_000, help="chk-<id> dirs (10k)")
    parser.add_argument("--files", type=int, default=5_000, help="files to discard (5k)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (3)")
    parser.add_argument("--workers", type=int, default=16, help="discard parallelism (16)")
    parser.add_argument("--local-dir", default=None, help="parent directory for local runs")
    parser.add_argument(
        "--aborted",
        type=int,
        nargs="+",
        default=[1_000, 10_000],
        help="aborted chk-<id> counts for the aborted workload (1000 10000)",
    )
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=("discovery", "discard", "aborted"),
        default=["discovery", "discard", "aborted"],
    )
    args = parser.parse_args(argv)
    if args.checkpoints < 1 or args.files < 1 or args.repeats < 1 or args.workers < 1:
        parser.error("--checkpoints, --files, --repeats and --workers must be >= 1")

    import fsspec

    versions = [f"python {platform.python_version()}", f"fsspec {fsspec.__version__}"]
    if args.backend in ("s3", "all"):
        import moto
        import s3fs

        versions += [f"s3fs {s3fs.__version__}", f"moto {moto.__version__}"]
    print(f"lifecycle benchmark: {', '.join(versions)}, {os.cpu_count()} CPUs")

    backends = ("local", "s3") if args.backend == "all" else (args.backend,)
    rows: list[Row] = []
    for name in backends:
        rows += run_backend(name, args)
    print(targets_line(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
