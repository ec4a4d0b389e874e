"""SIGSTOP writers (issue 24): a keyed pipeline's driver stopped inside a batch, past its lease
ttl, while its task holds a range's local store lock; a successor on the same local stores.

Each round, in subprocesses (tests/pipelines/keyed_fault_driver.py, lease ttl 3 s):

1. a writer runs p1 and is SIGSTOPped (driver, JVM and Python workers) right after a change
   file of checkpoint 2 is written, inside its range's store lock;
2. a successor runs p1: it takes the lease once the writer's expired, waits for the held lock
   at most its lease ttl and runs the range on a private copy of the store. A *hang* is a
   successor that took longer than the ttl and ``MARGIN`` from its lease to its end, or did
   not end within ``HANG_AFTER`` (the writer is then SIGCONTed, so that nothing waits for
   ever);
3. the writer is SIGCONTed: it must publish nothing (its lease is lost: it exits with
   ``JobLeaseLostError``, every ``_metadata`` as the successor left it);
4. a third run does p2 on the same stores: its state must equal a dict recomputation; a
   *wrong value* is a key whose (orders, total) differs, or is missing or extra.

``StalledWriter`` and ``metadata_files`` serve tests/pipelines/test_keyed_faults.py too.
"""

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.pipelines import keyed_fault_driver as driver  # noqa: E402
from tests.pipelines.support import SOURCE  # noqa: E402

__all__ = ["LOCK_SLACK", "MARGIN", "SCENARIOS", "StalledWriter", "metadata_files",
           "sigstop_writers"]

DRIVER = Path(driver.__file__)
PYTHON = os.path.abspath(sys.executable)
STOP_POINT = "write:2:-b2-:after"  # inside batch 2's store lock, checkpoint 1 completed
TTL = driver.LEASE_TTL.total_seconds()
# The successor's work once it holds the lease, besides the ttl it waits for the lock:
# restore, snapshot 2 ranges, 2 batches, the state sink and a checkpoint, on a 2-core
# machine other Spark jobs share (measured 33-46 s in a fresh driver at load 14-16).
MARGIN = 60.0
LOCK_SLACK = 5.0  # past the lock timeout, what a poll of the lock may overshoot under load
HANG_AFTER = 180.0  # a successor still running then waits for the stopped writer
RUN_TIMEOUT = 240.0


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    return env


def _group_states(group: int) -> list[str]:
    """The scheduler state (``R``, ``S``, ``T``...) of each process in process group
    ``group``."""
    states = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == group:
                states.append(fields[0])
    return states


class StalledWriter:
    """keyed_fault_driver.py running ``partitions`` with ``--stop point``: ``start`` returns
    once the driver and its Python workers are SIGSTOPped inside the write at ``point``
    (holding that range's store lock); ``finish`` SIGCONTs them and waits for the driver's
    end. Output goes to files: a stopped process must not hold a pipe full."""

    def __init__(self, work: Path, partitions: list[str], point: str = STOP_POINT) -> None:
        self.work, self.partitions, self.point = work, partitions, point
        self.proc: subprocess.Popen | None = None
        self.groups: list[int] = []

    def start(self, timeout: float = RUN_TIMEOUT) -> "StalledWriter":
        self.work.mkdir(parents=True, exist_ok=True)
        with open(self.work / "stalled.out", "w") as out, \
                open(self.work / "stalled.err", "w") as err:
            self.proc = subprocess.Popen(
                [PYTHON, str(DRIVER), "--work-dir", str(self.work), "--partitions",
                 ",".join(self.partitions), "--stop", self.point],
                stdout=out, stderr=err, env=_env(), start_new_session=True)
        self.groups = [self.proc.pid]
        deadline = time.monotonic() + timeout
        while not (self.work / driver.STOPPED).exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the writer did not stop at {self.point} (exit "
                                   f"{self.proc.returncode}): {self.stderr()[-3000:]}")
            time.sleep(0.1)
        self.groups = [int(g) for g in (self.work / driver.STOPPING).read_text().split()]
        return self

    def states(self) -> list[str]:
        """The scheduler state of each of the writer's processes (driver group and Python
        workers)."""
        return [s for g in self.groups for s in _group_states(g)]

    def stopped(self) -> bool:
        """Whether every live process of the writer is stopped (a zombie, e.g. a Python worker
        that ended before its stopped daemon reaped it, holds no lock)."""
        live = [s for s in self.states() if s not in "ZX"]
        return bool(live) and all(s in "Tt" for s in live)

    def resume(self) -> None:
        for group in self.groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGCONT)

    def finish(self, timeout: float = RUN_TIMEOUT) -> int:
        """SIGCONT the writer and wait for its driver's exit; its return code."""
        self.resume()
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL whatever is left of the writer's process groups."""
        for group in self.groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.wait(30)

    def stdout(self) -> str:
        return (self.work / "stalled.out").read_text()

    def stderr(self) -> str:
        return (self.work / "stalled.err").read_text()


def metadata_files(work: Path) -> dict[str, str]:
    """Every ``_metadata`` under the work directory's checkpoints, by path: a digest of it."""
    return {str(p.relative_to(work)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((work / "checkpoints").glob("*/chk-*/_metadata"))}


def expected(partitions: list[str]) -> dict[str, tuple[int, int]]:
    """Per customer (orders, total) after every batch of ``partitions`` (4 batches each)."""
    state: dict[str, tuple[int, int]] = {}
    for partition in partitions:
        for batch in driver.Orders().batches(None, partition):
            for customer, amount in SOURCE.rows(batch):
                orders, total = state.get(customer, (0, 0))
                state[customer] = (orders + 1, total + amount)
    return state


def _run(work: Path, partitions: list[str], *args: str, stalled: StalledWriter | None = None
         ) -> tuple[dict, bool]:
    """keyed_fault_driver.py on ``partitions`` to its end: its RESULT, and whether it had to be
    unblocked (still running after ``HANG_AFTER``: ``stalled`` is then SIGCONTed)."""
    proc = subprocess.Popen(
        [PYTHON, str(DRIVER), "--work-dir", str(work), "--partitions", ",".join(partitions),
         *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
        start_new_session=True)
    unblocked = False
    try:
        try:
            out, err = proc.communicate(timeout=HANG_AFTER)
        except subprocess.TimeoutExpired:
            unblocked = True
            if stalled is not None:
                stalled.resume()
            out, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.communicate()
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"driver on {partitions} failed ({proc.returncode}): {err[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT ")), unblocked


def stalled_round(work: Path) -> dict:
    """One round (see the module): its counts and timings."""
    stalled = StalledWriter(work, ["p1"]).start()
    try:
        successor, unblocked = _run(work, ["p1"], stalled=stalled)
        still_stopped = stalled.stopped()
        states = "".join(stalled.states())
        published = metadata_files(work)
        code = stalled.finish()
        unchanged = metadata_files(work) == published
    finally:
        stalled.kill()
    fenced = (code != 0 and "JobLeaseLostError" in stalled.stderr()
              and "RESULT" not in stalled.stdout())
    third, _ = _run(work, ["p2"], "--state")
    state = {customer: (orders, total) for customer, orders, total in third["state"]}
    want = expected(["p1", "p2"])
    seconds = successor["done_at"] - successor["lease_at"]
    return {
        "hang": unblocked or seconds > TTL + MARGIN,
        "seconds": seconds,
        "private": any("private copy" in line for line in successor["progress"]),
        "held": still_stopped,
        "states": states,
        "published": int(not unchanged) + int(not fenced),
        "wrong": sum(state.get(k) != v for k, v in want.items()) + len(set(state) - set(want)),
    }


def sigstop_writers(rounds: int) -> tuple[int, int, str]:
    """``rounds`` rounds; a round fails on a hang, a wrong value, a publication by the stopped
    writer, or a successor that did not run on a private copy while the writer was stopped."""
    reports = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as directory:
            try:
                reports.append(stalled_round(Path(directory)))
            except Exception as exc:  # noqa: BLE001 - a failed round is a failed trial
                reports.append({"error": str(exc)[-300:]})
    done = [r for r in reports if "error" not in r]
    failures = len(reports) - len(done) + sum(
        bool(r["hang"] or r["wrong"] or r["published"] or not (r["private"] and r["held"]))
        for r in done)
    figure = (
        f"rounds={len(reports)} hangs_past_ttl={sum(r['hang'] for r in done)} "
        f"wrong_values={sum(r['wrong'] for r in done)} "
        f"published_by_stopped={sum(r['published'] for r in done)} "
        f"private_copies={sum(r['private'] for r in done)} "
        f"successor_s(lease->end, ttl {TTL:.0f} s)="
        + ",".join(f"{r['seconds']:.1f}" for r in done)
        + "".join(f"; error: {r['error']!r}" for r in reports if "error" in r)
        + "".join(f"; writer not stopped throughout (process states {r['states']})"
                  for r in done if not r["held"]))
    return len(reports), failures, figure


SCENARIOS = {
    # A round is three Spark driver runs, about 1.5-2 minutes: 1 round per 100 trials, at
    # most 3.
    "sigstop_writers": lambda trials: sigstop_writers(min(3, max(1, trials // 100))),
}
