"""Trust scenarios (issue 13), shared by pytest and ``benchmarks/reliability.py``:

- ``ignoring_endpoint``: S3 behind a proxy that drops ``If-None-Match``: two coordinators of
  one checkpoint; every attempt must be refused at setup, never a silent overwrite.
- ``lease_race``: N processes (no shared objects) race for one job's lease and each commits a
  checkpoint under it: owners at once at most 1, epochs and ids unique, every `_metadata`
  records its writer's epoch; then an owner is SIGKILLed and replaced after its ttl.
- ``discovery_aborted``: ``latest`` on S3 with many aborted ``chk-<id>`` directories:
  requests and seconds.
"""

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

from checkpoint_storage import (
    CheckpointMetadata,
    FileSystemCheckpointStorage,
    JobID,
    UnsupportedFileSystemError,
    store_checkpoint_metadata,
)
from checkpoint_storage._filesystems import forget_exclusive_create_verdicts, url_to_fs
from checkpoint_storage._lease import read_job_lease
from tests.reliability.proxy import IGNORES_CONDITIONAL_WRITES, FaultProxy
from tests.reliability.scenarios_net import Result, _upstream, new_bucket, read_object

HERE = Path(__file__).resolve().parent
WORKER = HERE / "lease_worker.py"
ROOT = HERE.parents[1]


# --- an endpoint that ignores If-None-Match -------------------------------------------------


def _finalize(access, checkpoint_id: int, master: bytes):
    location = access.initialize_location_for_checkpoint(checkpoint_id)
    out = location.create_metadata_output_stream()
    store_checkpoint_metadata(CheckpointMetadata(checkpoint_id, master_states={"w": master}), out)
    return out.close_and_finalize_checkpoint()


def scenario_ignoring_endpoint(trials: int, upstream_url: str | None = None) -> Result:
    """Per trial a fresh bucket behind an endpoint that ignores If-None-Match and two
    independent coordinators of checkpoint 42 (the first through an honest path when
    ``trial`` is odd, so there is a completed `_metadata` to overwrite). A failure is any
    coordinator that gets past setup on the ignoring endpoint, or a changed `_metadata`."""
    upstream_url = _upstream(upstream_url)
    outcomes: Counter = Counter()
    with FaultProxy(upstream_url, drop_headers=IGNORES_CONDITIONAL_WRITES) as proxy:
        for trial in range(trials):
            forget_exclusive_create_verdicts()  # every trial asks the endpoint again
            bucket = new_bucket(upstream_url)
            job_id = JobID.generate()
            first_bytes = None
            if trial % 2:
                honest = FileSystemCheckpointStorage(
                    f"s3://{bucket}/cp", storage_options={"endpoint_url": upstream_url}
                ).create_checkpoint_storage(job_id)
                honest.initialize_base_locations()
                _finalize(honest, 42, b"first")
                key = f"cp/{job_id.hex}/chk-42/_metadata"
                first_bytes = read_object(upstream_url, bucket, key)
            for writer in (b"A", b"B"):
                access = FileSystemCheckpointStorage(
                    f"s3://{bucket}/cp", storage_options=proxy.options(attempts=1)
                ).create_checkpoint_storage(job_id)
                try:
                    access.initialize_base_locations()
                    _finalize(access, 42, writer)
                    outcomes["committed through the ignoring endpoint"] += 1
                except UnsupportedFileSystemError:
                    outcomes["refused"] += 1
                except Exception as exc:  # noqa: BLE001 - any other outcome is counted
                    outcomes[f"raised {type(exc).__name__}"] += 1
            if first_bytes is not None:
                stored = read_object(upstream_url, bucket, f"cp/{job_id.hex}/chk-42/_metadata")
                outcomes["silent overwrites"] += stored != first_bytes
    forget_exclusive_create_verdicts()
    overwrites = outcomes["silent overwrites"]
    failures = trials * 2 - outcomes["refused"] + overwrites
    figure = (
        f"silent overwrites: {overwrites}; refused at setup: {outcomes['refused']} of "
        f"{trials * 2} coordinators; "
        + ", ".join(
            f"{k}={v}"
            for k, v in sorted(outcomes.items())
            if k not in ("refused", "silent overwrites")
        )
    )
    return Result(trials, failures, figure)


# --- lease race ------------------------------------------------------------------------------


def _worker(config: dict) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def _last_json(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": f"no output: {text[-200:]!r}"}


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The largest number of intervals that hold one instant."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    current = best = 0
    for _, step in events:
        current += step
        best = max(best, current)
    return best


def lease_race(
    base: str,
    storage_options: dict,
    processes: int = 16,
    *,
    ttl: float = 5.0,
    hold: float = 0.05,
    kill_ttl: float = 2.0,
) -> tuple[int, list[str], str]:
    """One race of ``processes`` coordinators for one job, then a SIGKILLed owner replaced
    after expiry. Returns (owners at once, problems, figure)."""
    job_id = uuid.uuid4().hex
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as scratch:
        start = os.path.join(scratch, "start")
        config = {
            "base": base,
            "job_id": job_id,
            "storage_options": storage_options,
            "ttl": ttl,
            "wait": 120.0,
            "hold": hold,
            "mode": "race",
            "start": start,
        }
        workers = [_worker(config) for _ in range(processes)]
        time.sleep(0.2)
        Path(start).touch()
        reports = []
        for proc in workers:
            out, _ = proc.communicate(timeout=240)
            reports.append(_last_json(out))
    errors = [r["error"] for r in reports if "error" in r]
    problems += [f"worker failed: {e}" for e in errors]
    done = [r for r in reports if "error" not in r]
    at_once = max_overlap([(r["acquired"], r["released"]) for r in done]) if done else 0
    if at_once > 1:
        problems.append(f"{at_once} owners at once")
    epochs = [r["epoch"] for r in done]
    ids = [r["checkpoint_id"] for r in done]
    if len(set(epochs)) != len(epochs) or len(set(ids)) != len(ids):
        problems.append(f"epochs {sorted(epochs)} or ids {sorted(ids)} repeat")
    if any(r["recorded_epoch"] != r["epoch"] for r in done):
        problems.append("a _metadata does not record its writer's epoch")
    by_time = sorted(done, key=lambda r: r["acquired"])
    if [r["epoch"] for r in by_time] != sorted(epochs) or [
        r["checkpoint_id"] for r in by_time
    ] != sorted(ids):
        problems.append("epochs or ids do not grow with ownership")

    # An owner SIGKILLed while holding the lease: replaced once its ttl ran out, not before.
    holder = _worker({**config, "mode": "hold", "ttl": kill_ttl, "wait": 60.0})
    line = holder.stdout.readline()
    killed_epoch = json.loads(line)["epoch"] if line.startswith("{") else None
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    killed_at = time.monotonic()
    access = FileSystemCheckpointStorage(
        base, storage_options=storage_options
    ).create_checkpoint_storage(job_id)
    fs, _ = url_to_fs(base, storage_options)
    expires_at = read_job_lease(fs, access._path(access.checkpoints_directory)).expires_at
    with access.acquire_job_lease("replacement", ttl=ttl, wait=kill_ttl * 5) as lease:
        replaced_after = time.monotonic() - killed_at
        after_expiry = time.time() - expires_at
        replacement_epoch = lease.epoch
    if after_expiry < 0:
        problems.append(f"replaced {-after_expiry:.2f} s before the killed lease expired")
    if killed_epoch is None or replacement_epoch != killed_epoch + 1:
        problems.append(f"killed epoch {killed_epoch}, replacement epoch {replacement_epoch}")
    if replaced_after > kill_ttl * 2 + 1:
        problems.append(f"replaced only after {replaced_after:.1f} s (ttl {kill_ttl} s)")
    figure = (
        f"{processes} processes: owners at once: {at_once}, {len(done)} commits with "
        f"epochs {min(epochs, default=0)}..{max(epochs, default=0)}; SIGKILLed owner (ttl "
        f"{kill_ttl:g} s) replaced {replaced_after:.1f} s after the kill, "
        f"{after_expiry:.2f} s after its lease expired"
    )
    return at_once, problems, figure


def scenario_lease_race(trials: int, upstream_url: str | None = None) -> Result:
    """``lease_race`` on local disk and on S3 (moto), alternating; one race per trial."""
    failures, figures, worst = 0, [], 0
    for trial in range(trials):
        if trial % 2 == 0:
            base_dir = tempfile.mkdtemp(prefix="lease-race-")
            base, options, where = base_dir, {}, "local"
        else:
            upstream = _upstream(upstream_url)
            base = f"s3://{new_bucket(upstream)}/cp"
            options, where = {"endpoint_url": upstream}, "s3"
        at_once, problems, figure = lease_race(base, options)
        worst = max(worst, at_once)
        failures += bool(problems)
        figures.append(f"{where}: {figure}" + (f" PROBLEMS: {problems[:2]}" if problems else ""))
    return Result(trials, failures, f"owners at once: at most {worst}; " + " | ".join(figures[:2]))


# --- discovery with many aborted directories -------------------------------------------------


def discovery_aborted(upstream_url: str, aborted: int) -> tuple[dict, float, bool]:
    """``latest`` with one completed chk-1 below ``aborted`` aborted directories on S3:
    (requests by kind, seconds, whether the answer was chk-1). Requests are counted by a
    pass-through proxy."""
    import fsspec

    bucket = new_bucket(upstream_url)
    storage = FileSystemCheckpointStorage(
        f"s3://{bucket}/cp", storage_options={"endpoint_url": upstream_url}
    )
    access = storage.create_checkpoint_storage(JobID.generate())
    access.initialize_base_locations()
    _finalize(access, 1, b"only")
    fs = fsspec.filesystem("s3", endpoint_url=upstream_url)
    job = access.checkpoints_directory.removeprefix("s3://")
    items = [(f"{job}/chk-{i}/orphan", b"x") for i in range(2, aborted + 2)]
    for start in range(0, len(items), 1000):
        fs.pipe(dict(items[start : start + 1000]))
    with FaultProxy(upstream_url) as proxy:
        reader = FileSystemCheckpointStorage(
            f"s3://{bucket}/cp", storage_options=proxy.options(attempts=3, timeout=30)
        ).create_checkpoint_storage(access.job_id)
        started = time.monotonic()
        latest = reader.latest_completed_checkpoint()
        seconds = time.monotonic() - started
        counts = Counter(request.kind for request, _ in proxy.log)
    right = latest is not None and latest.external_pointer.endswith("/chk-1")
    return dict(counts), seconds, right


def scenario_discovery_aborted(trials: int, upstream_url: str | None = None) -> Result:
    """10,000 aborted directories (one run whatever ``trials``): at most ceil(n/1000) + 1
    LIST requests and a right answer."""
    aborted = 10_000
    counts, seconds, right = discovery_aborted(_upstream(upstream_url), aborted)
    lists = counts.get("LIST", 0)
    ok = right and lists <= math.ceil((aborted + 1) / 1000) + 1
    shown = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    figure = (
        f"latest with {aborted:,} aborted chk-<id> on S3: {sum(counts.values())} requests "
        f"({shown}), {seconds:.2f} s, answer {'right' if right else 'WRONG'} (1 run)"
    )
    return Result(1, 0 if ok else 1, figure)


def _lease_races(trials: int) -> Result:
    runs = max(2, trials // 50)  # each race starts 17 processes
    result = scenario_lease_race(runs)
    return result._replace(figure=f"{result.figure} ({runs} races for --trials {trials})")


def _ignoring(trials: int) -> Result:
    runs = max(1, trials // 10)
    result = scenario_ignoring_endpoint(runs)
    return result._replace(figure=f"{result.figure} ({runs} trials for --trials {trials})")


SCENARIOS = {
    "trust_ignoring_endpoint": _ignoring,
    "trust_lease_race": _lease_races,
    "trust_discovery_10k_aborted": scenario_discovery_aborted,
}
