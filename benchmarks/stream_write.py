"""Checkpoint state streams against plain fsspec files, on the same filesystem, in one process.

Usage::

    .venv/bin/python benchmarks/stream_write.py [--backend local|s3|memory|all] [--size-mib N]

Two workloads, each written both ways with the same bytes:

- large state: one stream of ``--size-mib`` MiB written in 64 KiB chunks and committed with
  ``close_and_get_handle()``, against ``fs.open(path, "wb")`` with the same chunks.
  Target: the stream reaches at least 0.9 of the plain file's throughput.
- small states: ``--states`` streams of 1 KiB each (inline: below the 20 KiB threshold, so they
  end as ``ByteStreamStateHandle``s), against ``--file-states`` plain 1 KiB files.
  Target: inline states at least 10x the plain files' rate.

Each measurement is the best of ``--repeats`` runs after a warm-up; the two sides alternate
which goes first, and written data is deleted between runs (outside the timed part). For S3 the
script starts moto's server on 127.0.0.1 (a free port) in this process, with test credentials.
When a target is missed (or with ``--profile``) our side is run again under cProfile and the
functions where the time goes are printed with file:line.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import platform
import pstats
import sys
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

from _common import Backend, open_backend, targets_line

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

KIB = 1024
MIB = 1024 * KIB
CHECKPOINT_ID = 1

LARGE_TARGET = 0.9  # stream throughput / plain file throughput
SMALL_TARGET = 10.0  # inline states per second / plain files per second

DEFAULT_SIZE_MIB = {"local": 1024, "memory": 1024, "s3": 128}
DEFAULT_FILE_STATES = {"local": 100_000, "memory": 100_000, "s3": 2_000}


# --- backends ------------------------------------------------------------------------------


# --- the two sides of each workload ----------------------------------------------------------


class Workloads:
    """Everything needed to time both sides on one backend."""

    def __init__(self, backend: Backend, chunk: int, state_size: int) -> None:
        import fsspec

        from checkpoint_storage import FileSystemCheckpointStorage, JobID

        self.backend = backend
        self.storage = FileSystemCheckpointStorage(
            backend.base_url, storage_options=backend.storage_options
        )
        access = self.storage.create_checkpoint_storage(JobID.generate())
        access.initialize_base_locations()
        self.location = access.initialize_location_for_checkpoint(CHECKPOINT_ID)
        self.fs, base_path = fsspec.core.url_to_fs(backend.base_url, **backend.storage_options)
        self.plain_dir = f"{base_path.rstrip('/')}/plain"
        self.fs.makedirs(self.plain_dir, exist_ok=True)
        # 16 distinct random chunks, cycled: the same bytes go through both sides.
        self.chunks = [os.urandom(chunk) for _ in range(16)]
        self.chunk = chunk
        self.state = os.urandom(state_size)

    # large state

    def large_stream(self, size: int, profiler: cProfile.Profile | None = None) -> float:
        from checkpoint_storage import CheckpointedStateScope, FileStateHandle

        chunks, n = self.chunks, size // self.chunk
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        stream = self.location.create_checkpoint_state_output_stream(
            CheckpointedStateScope.EXCLUSIVE
        )
        for i in range(n):
            stream.write(chunks[i & 15])
        handle = stream.close_and_get_handle()
        elapsed = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
        if not isinstance(handle, FileStateHandle) or handle.state_size != n * self.chunk:
            raise AssertionError(f"unexpected handle {handle!r}")
        handle.discard_state()
        return elapsed

    def large_plain(self, size: int) -> float:
        chunks, n = self.chunks, size // self.chunk
        path = f"{self.plain_dir}/{uuid.uuid4().hex}"
        start = time.perf_counter()
        with self.fs.open(path, "wb") as f:
            for i in range(n):
                f.write(chunks[i & 15])
        elapsed = time.perf_counter() - start
        self.fs.rm_file(path)
        return elapsed

    def checksum_only(self, size: int) -> float:
        """zlib.crc32 over the same bytes: what the stream's per-file checksum costs alone."""
        chunks, n = self.chunks, size // self.chunk
        start = time.perf_counter()
        crc = 0
        for i in range(n):
            crc = zlib.crc32(chunks[i & 15], crc)
        return time.perf_counter() - start

    # small states

    def small_streams(self, count: int, profiler: cProfile.Profile | None = None) -> float:
        from checkpoint_storage import ByteStreamStateHandle, CheckpointedStateScope

        exclusive, state, location = CheckpointedStateScope.EXCLUSIVE, self.state, self.location
        handles = []
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        for _ in range(count):
            stream = location.create_checkpoint_state_output_stream(exclusive)
            stream.write(state)
            handles.append(stream.close_and_get_handle())
        elapsed = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
        if not all(type(h) is ByteStreamStateHandle for h in handles):
            raise AssertionError("small states were not inlined")
        return elapsed

    def small_files(self, count: int) -> float:
        directory = f"{self.plain_dir}/small-{uuid.uuid4().hex[:8]}"
        self.fs.makedirs(directory, exist_ok=True)
        paths = [f"{directory}/{i:07d}" for i in range(count)]
        state, fs = self.state, self.fs
        start = time.perf_counter()
        for path in paths:
            with fs.open(path, "wb") as f:
                f.write(state)
        elapsed = time.perf_counter() - start
        if self.backend.name == "memory":
            # memory's recursive rm scans the whole store per path: quadratic in the file count
            for path in paths:
                fs.rm_file(path)
        else:
            fs.rm(directory, recursive=True)
        fs.invalidate_cache()
        return elapsed


def best_of(repeats: int, ours, plain) -> tuple[float, float, list, list]:
    """Alternate the two sides (ours first on even rounds); the fastest run of each."""
    ours_times, plain_times = [], []
    for r in range(repeats):
        order = ((ours, ours_times), (plain, plain_times))
        for fn, times in order if r % 2 == 0 else reversed(order):
            gc.collect()
            times.append(fn())
    return min(ours_times), min(plain_times), ours_times, plain_times


# --- profiling --------------------------------------------------------------------------------


def _short(filename: str) -> str:
    for marker in ("site-packages/", str(ROOT) + "/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def profile(title: str, fn, top: int = 18) -> None:
    """Run ``fn(profiler)``, which profiles its timed part only, and print the hot spots."""
    profiler = cProfile.Profile()
    fn(profiler)
    stats = pstats.Stats(profiler).stats
    total = sum(tt for (_, _, tt, _, _) in stats.values()) or 1e-9
    print(f"\n  cProfile of our side, {title} (total {total:.3f} s of own time):")
    print(f"    {'own s':>8} {'own %':>6} {'cum s':>8} {'calls':>9}  function (file:line)")
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    for (filename, line, func), (_, calls, tt, ct, _) in rows:
        where = f"{_short(filename)}:{line}" if line else "built-in"
        print(f"    {tt:8.3f} {100 * tt / total:6.1f} {ct:8.3f} {calls:9d}  {func} ({where})")
    ours = [
        (ct, tt, f"{func} ({_short(fn_)}:{line})")
        for (fn_, line, func), (_, _, tt, ct, _) in stats.items()
        if "checkpoint_storage" in fn_
    ]
    print("    library functions by cumulative time:")
    for ct, tt, name in sorted(ours, reverse=True)[:10]:
        print(f"    {tt:8.3f} {'':6} {ct:8.3f} {'':9}  {name}")


# --- main ---------------------------------------------------------------------------------------


@dataclass
class Row:
    backend: str
    workload: str
    ours: str
    plain: str
    ratio: float
    target: str
    ok: bool


def run_backend(name: str, args) -> list[Row]:
    size_mib = args.size_mib if args.size_mib is not None else DEFAULT_SIZE_MIB[name]
    size = size_mib * MIB
    states = args.states
    file_states = args.file_states if args.file_states is not None else DEFAULT_FILE_STATES[name]
    backend = open_backend(name, args.local_dir, "stream-write")
    rows = []
    try:
        print(f"\n== {name}: {backend.description}")
        if name == "memory":
            print(
                "  note: a memory:// 'file' is a dict entry, so the 10x inline target is meant "
                "for real filesystems (local, s3)"
            )
        if name == "s3":
            print("  note: moto serves from this process, so client and server share the GIL")
        w = Workloads(backend, args.chunk_kib * KIB, args.state_kib * KIB)

        # warm-up: imports, connection pools, page cache, the filesystem instance
        warm = min(size, 16 * MIB)
        w.large_stream(warm), w.large_plain(warm)
        w.small_streams(min(states, 1000)), w.small_files(min(file_states, 200))

        print(
            f"  large state: {size_mib} MiB in {args.chunk_kib} KiB writes, "
            f"best of {args.repeats} (alternating)"
        )
        ours_s, plain_s, ours_all, plain_all = best_of(
            args.repeats, lambda: w.large_stream(size), lambda: w.large_plain(size)
        )
        print(f"    runs (s): stream {_fmt_runs(ours_all)} | plain {_fmt_runs(plain_all)}")
        ours_mibs, plain_mibs = size_mib / ours_s, size_mib / plain_s
        crc_s = min(w.checksum_only(size) for _ in range(args.repeats))
        print(
            f"    zlib.crc32 alone over the same bytes: {size_mib / crc_s:,.0f} MiB/s; plain "
            f"write + crc32 one after the other would give {size_mib / (plain_s + crc_s):,.0f} "
            f"MiB/s (measured stream: {ours_mibs:,.0f} MiB/s)"
        )
        ratio = ours_mibs / plain_mibs
        large = Row(
            name,
            f"large state {size_mib} MiB / {args.chunk_kib} KiB writes",
            f"{ours_mibs:,.1f} MiB/s",
            f"{plain_mibs:,.1f} MiB/s",
            ratio,
            f">= {LARGE_TARGET:.2f}x",
            ratio >= LARGE_TARGET,
        )
        rows.append(large)

        print(
            f"  small states: {states:,} x {args.state_kib} KiB through streams (inline) vs "
            f"{file_states:,} x {args.state_kib} KiB plain files, best of {args.repeats}"
        )
        if file_states != states:
            print(
                f"    note: the plain-file baseline writes {file_states:,} files, not "
                f"{states:,}"
                + (" (one PUT each to moto is slow)" if name == "s3" else "")
                + "; rates (states/s) are compared"
            )
        ours_s, plain_s, ours_all, plain_all = best_of(
            args.repeats, lambda: w.small_streams(states), lambda: w.small_files(file_states)
        )
        print(f"    runs (s): streams {_fmt_runs(ours_all)} | files {_fmt_runs(plain_all)}")
        ours_rate, plain_rate = states / ours_s, file_states / plain_s
        ratio = ours_rate / plain_rate
        small = Row(
            name,
            f"{args.state_kib} KiB states: inline vs files",
            f"{ours_rate:,.0f} states/s",
            f"{plain_rate:,.0f} states/s",
            ratio,
            f">= {SMALL_TARGET:.0f}x",
            ratio >= SMALL_TARGET,
        )
        rows.append(small)

        if args.profile or not large.ok:
            profile(f"large state ({name}, {size_mib} MiB)", lambda p: w.large_stream(size, p))
        if args.profile or not small.ok:
            profile(f"{states:,} inline states ({name})", lambda p: w.small_streams(states, p))
    finally:
        backend.close()
    return rows


def _fmt_runs(times: list[float]) -> str:
    return " ".join(f"{t:.3f}" for t in times)


def print_table(rows: list[Row]) -> None:
    headers = (
        "backend",
        "workload",
        "ours (stream)",
        "plain fsspec",
        "ours/plain",
        "target",
        "result",
    )
    table = [
        (
            r.backend,
            r.workload,
            r.ours,
            r.plain,
            f"{r.ratio:.2f}x",
            r.target,
            "ok" if r.ok else "MISSED",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(headers)]
    line = "  ".join("-" * w for w in widths)
    print("\n" + "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print(line)
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("local", "s3", "memory", "all"), default="local")
    parser.add_argument(
        "--size-mib",
        type=int,
        default=None,
        help="large state size (default: 1024 local/memory, 128 s3)",
    )
    parser.add_argument("--chunk-kib", type=int, default=64, help="write size (default 64)")
    parser.add_argument("--states", type=int, default=100_000, help="inline states (100k)")
    parser.add_argument(
        "--file-states",
        type=int,
        default=None,
        help="plain small files (default: 100k local/memory, 2k s3)",
    )
    parser.add_argument("--state-kib", type=int, default=1, help="small state size (1 KiB)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, best counts")
    parser.add_argument("--local-dir", default=None, help="parent directory for local runs")
    parser.add_argument("--profile", action="store_true", help="always profile our side")
    args = parser.parse_args(argv)

    import fsspec

    versions = [f"python {platform.python_version()}", f"fsspec {fsspec.__version__}"]
    if args.backend in ("s3", "all"):
        import moto
        import s3fs

        versions += [f"s3fs {s3fs.__version__}", f"moto {moto.__version__}"]
    print(f"stream_write benchmark: {', '.join(versions)}, {os.cpu_count()} CPUs")

    backends = ("local", "memory", "s3") if args.backend == "all" else (args.backend,)
    rows: list[Row] = []
    for name in backends:
        rows += run_backend(name, args)
    print_table(rows)
    print(targets_line(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
