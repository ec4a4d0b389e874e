"""Issue 12's guarantees under faults, over a keyed pipeline (test_keyed_runner.py's per-customer
totals with a state and an output sink): the driver SIGKILLed while writing change files,
during full snapshot and between the state writes and `_metadata`; Spark task attempts failing
after their writes; rescaling 2 -> 3 -> 2 killed mid-rescale. Each compares the final state,
the state sink and the output sink with a dict recomputation: updates lost or applied twice: 0.

The killed runs happen in a subprocess (keyed_fault_driver.py); this process resumes them.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
import scenarios_crash  # noqa: E402 - the two-host cluster harness
import scenarios_stall  # noqa: E402 - the SIGSTOPped writer

from checkpoint_storage import collect_garbage, is_appended_segment
from pipelines import StatefulRunner
from tests.pipelines import keyed_fault_driver as driver
from tests.pipelines.support import SOURCE, referenced_files, shared_files

pytestmark = pytest.mark.timeout(300)

DRIVER = Path(driver.__file__)
DRIVER_TIMEOUT = 240


def run_driver(work: Path, partitions: list[str], *args: str, env: dict | None = None,
               timeout: float = DRIVER_TIMEOUT) -> subprocess.CompletedProcess:
    """Run keyed_fault_driver.py to its end or its kill; its whole process group is killed
    afterwards (the JVM and Python workers of a killed driver)."""
    env = {k: v for k, v in (os.environ if env is None else env).items()
           if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    proc = subprocess.Popen(
        [sys.executable, str(DRIVER), "--work-dir", str(work), "--partitions",
         ",".join(partitions), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def resumer(spark, work: Path, parallelism: int | None = None, batches: int = 4,
            merging: bool = False) -> StatefulRunner:
    """A runner in this process on the killed driver's directories (its local stores too)."""
    return StatefulRunner(spark, driver.storage_of(work, merging),
                          driver.faults_pipeline(work, batches, parallelism, merging),
                          keyed_local_dir=str(work / "local"), lease_wait=30)


def state_of(runner: StatefulRunner) -> dict[str, tuple[int, int]]:
    rows = runner.restore_states(runner.store.latest().metadata)["totals"].collect()
    assert len(rows) == len({r["customer"] for r in rows}), "a key is in the state twice"
    return {r["customer"]: (r["orders"], r["total"]) for r in rows}


def state_sink(work: Path, partition: str) -> dict[str, tuple[int, int]]:
    frame = pd.read_parquet(work / "sink" / "state" / f"partition={partition}")
    assert len(frame) == frame["customer"].nunique(), "a key is in the state sink twice"
    return {r.customer: (r.orders, r.total) for r in frame.itertuples()}


def output_sink(work: Path, partition: str) -> Counter:
    frame = pd.read_parquet(work / "sink" / "output" / f"partition={partition}")
    return Counter((r.customer, r.orders, r.total) for r in frame.itertuples())


def batch_ids(partition: str, batches: int) -> list[str]:
    return driver.Orders(per_partition=batches).batches(None, partition)


def expected(partitions: list[str], batches: int = 4) -> dict[str, tuple[int, int]]:
    """Per customer (orders, total) after every batch of ``partitions``."""
    state: dict[str, tuple[int, int]] = {}
    for partition in partitions:
        for batch in batch_ids(partition, batches):
            for customer, amount in SOURCE.rows(batch):
                orders, total = state.get(customer, (0, 0))
                state[customer] = (orders + 1, total + amount)
    return state


def expected_output(before: list[str], partition: str, batches: int = 4) -> Counter:
    """The output rows of ``partition``'s batches: per batch, each customer in it with its
    (orders, total) after the batch, on top of the partitions ``before``."""
    state = expected(before, batches)
    rows = Counter()
    for batch in batch_ids(partition, batches):
        seen = set()
        for customer, amount in SOURCE.rows(batch):
            orders, total = state.get(customer, (0, 0))
            state[customer] = (orders + 1, total + amount)
            seen.add(customer)
        rows.update((c, *state[c]) for c in seen)
    return rows


def assert_exactly_once(runner: StatefulRunner, work: Path, done: list[str],
                        batches: int = 4) -> None:
    """State, state sink and output sink of the last partition equal the recomputation; after
    garbage collection (grace 0) the shared directory holds exactly the referenced files."""
    last = done[-1]
    assert expected(done, batches) == state_of(runner)
    assert expected(done, batches) == state_sink(work, last)
    assert expected_output(done[:-1], last, batches) == output_sink(work, last)
    collect_garbage(runner.access, grace_period=0)
    assert referenced_files(runner) == shared_files(work, runner)


@pytest.mark.timeout(60)
def test_the_kill_marker_is_whole_or_absent_and_the_first_writer_wins(tmp_path):
    """Two tasks reaching the kill point at once: one killed while publishing the marker
    leaves none (never an empty one), the next publishes it whole, and a later writer does
    not rewrite it (``write_text`` truncated it first: the marker was read back empty)."""
    marker = tmp_path / "killed"
    child = os.fork()
    if child == 0:  # a writer killed right before its marker would be in place
        os.link = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
        driver.write_marker(marker, "first")
        os._exit(0)
    _, status = os.waitpid(child, 0)
    killed = (os.WIFSIGNALED(status), marker.exists())
    driver.write_marker(marker, "second")
    driver.write_marker(marker, "third")
    assert ((True, False), "second") == (killed, marker.read_text())


# The driver's run of p1 (4 batches) at parallelism 2: change files of batches 0 and 1 go to
# chk-1, taken after batch 1; the second interval starts by snapshotting both ranges (2
# change files each) into chk-2, then batches 2 and 3 write their change files into it, then
# the state sink is written and chk-2's `_metadata`. Every kill lands in chk-2's interval.
# (A kill right after a file is written, or after a batch, leaves a subset of what these
# leave; they ran once with these and are kept out of the suite for its time.)
KILLS = {
    "change-file-torn": "write:2:-b3-:mid",
    "full snapshot-torn": "write:2:-m0-:mid",
    "before-final-metadata": "hook:before_metadata:checkpoint_id=2",
}


@pytest.mark.parametrize("point", list(KILLS.values()), ids=list(KILLS))
def test_driver_sigkill_then_resume_is_exactly_once(spark, tmp_path, point):
    """A driver SIGKILLed at the point and a new process resuming the partition: state and
    sinks equal a recomputation."""
    killed = run_driver(tmp_path, ["p1"], "--kill", point)
    assert (-signal.SIGKILL, point) == (killed.returncode, (tmp_path / "killed").read_text()), \
        killed.stderr[-3000:]
    runner = resumer(spark, tmp_path)
    job = tmp_path / "checkpoints" / str(runner.job_id)
    assert ([1], False) == ([c.checkpoint_id for c in runner.store.all()],
                            (job / "chk-2" / "_metadata").exists())

    runner.run(["p1"])

    assert_exactly_once(runner, tmp_path, ["p1"])


def test_driver_sigkill_mid_append_then_resume_is_exactly_once(spark, tmp_path):
    """With file merging across checkpoints, a driver SIGKILLed while a range appends batch 3's
    change file to the physical file checkpoint 1 references (a torn tail after batch 2's
    segment), then resumed: the retried batches append after the torn bytes, state and sinks
    equal a recomputation, and each range's change files are segments of one file."""
    point = "write:2:-b3-:mid"
    killed = run_driver(tmp_path, ["p1"], "--kill", point, "--merging")
    assert (-signal.SIGKILL, point) == (killed.returncode, (tmp_path / "killed").read_text()), \
        killed.stderr[-3000:]
    runner = resumer(spark, tmp_path, merging=True)
    referenced = runner.store.latest().metadata.all_handles()
    ends = {h.path: max(g.end_position for g in referenced if g.path == h.path)
            for h in referenced}
    sizes = {path: os.path.getsize(path) for path in ends}

    runner.run(["p1"])

    handles = runner.store.latest().metadata.all_handles()
    appended = [h for h in handles if h not in referenced]
    assert (8, set(ends), True, True) == (
        len(handles), {h.path for h in handles}, all(map(is_appended_segment, handles)),
        all(h.start_position >= sizes[h.path] for h in appended))
    assert any(sizes[path] > end for path, end in ends.items())  # a torn tail was there
    assert_exactly_once(runner, tmp_path, ["p1"])


@pytest.mark.timeout(900)  # 3 attempts per task, each rebuilding its ranges' stores
def test_task_attempts_failing_after_their_writes_apply_each_batch_once(spark, tmp_path):
    """With attempt 0 of range 1 dying and attempt 1 of range 0 raising after every change
    file and snapshot they wrote and their local store's update, Spark's retries apply each
    batch once: state and sinks equal a recomputation, no failed attempt's file referenced."""
    done = run_driver(tmp_path, ["p1"], "--task-kills", "--master", "local[2,3]", timeout=600)
    assert 0 == done.returncode, done.stderr[-3000:]
    runner = resumer(spark, tmp_path)

    files = [h.path for h in runner.store.latest().metadata.all_handles() if hasattr(h, "path")]
    failed = [p for p in files if "-kg8-15-" in p and "-a0-" in p
              or "-kg0-7-" in p and "-a1-" in p]
    assert (6, []) == (len(files), failed)  # 2 ranges x (snapshot, 2 change files)
    assert_exactly_once(runner, tmp_path, ["p1"])


@pytest.mark.timeout(900)
def test_task_attempts_failing_after_their_appends_apply_each_batch_once(spark, tmp_path):
    """With file merging across checkpoints, attempts failing after they appended their
    change file (as above) leave dead bytes between the committed segments, never a
    referenced one: state and sinks equal a recomputation, and each range's four change
    files are segments of its one file, range 1's with gaps where attempt 0's segments are."""
    done = run_driver(tmp_path, ["p1"], "--task-kills", "--master", "local[2,3]", "--merging",
                      timeout=600)
    assert 0 == done.returncode, done.stderr[-3000:]
    runner = resumer(spark, tmp_path, merging=True)

    segments: dict[str, list] = {}
    for handle in runner.store.latest().metadata.all_handles():
        segments.setdefault(handle.path, []).append(handle)
    gaps = sorted(sum(b.start_position > a.end_position for a, b in zip(
        sorted(hs, key=lambda h: h.start_position),
        sorted(hs, key=lambda h: h.start_position)[1:], strict=False)) for hs in segments.values())
    assert ([4, 4], [0, 3]) == (sorted(len(hs) for hs in segments.values()), gaps)
    assert_exactly_once(runner, tmp_path, ["p1"])


def test_rescaling_2_3_2_with_a_kill_mid_rescale_equals_a_recomputation(spark, tmp_path):
    """p1 on 2 ranges; p2 on 3, its driver SIGKILLed while writing the rescaled snapshots and
    resumed on 3; p3 on 2: state and sinks equal a recomputation after each (2 batches per
    partition, a checkpoint at each end)."""
    resumer(spark, tmp_path, 2, batches=2).run(["p1"])
    point = "write:2:-m0-:mid"
    killed = run_driver(tmp_path, ["p2"], "--parallelism", "3", "--batches", "2",
                        "--kill", point)
    assert (-signal.SIGKILL, point) == (killed.returncode, (tmp_path / "killed").read_text()), \
        killed.stderr[-3000:]

    three = resumer(spark, tmp_path, 3, batches=2)
    three.run(["p2"])
    assert 3 == three.store.latest().metadata.operator_states[0].parallelism
    assert_exactly_once(three, tmp_path, ["p1", "p2"], batches=2)

    two = resumer(spark, tmp_path, 2, batches=2)
    two.run(["p3"])
    assert 2 == two.store.latest().metadata.operator_states[0].parallelism
    assert_exactly_once(two, tmp_path, ["p1", "p2", "p3"], batches=2)


@pytest.mark.timeout(900, method="signal")  # signal: the cluster's teardown still runs
def test_speculative_copies_of_a_range_apply_each_batch_once(spark, tmp_path):
    """On a two-host cluster with speculation, attempt 0 of range 1 straggles after each
    write (its local store updated) and a copy on the other host wins: state and sinks equal
    a recomputation, and range 1's referenced files are the copies'."""
    work = tmp_path / "driver"
    work.mkdir()
    with scenarios_crash.two_host_cluster(tmp_path / "cluster") as cluster:
        done = run_driver(work, ["p1"], "--master", cluster.url, "--straggle",
                          env=cluster.env(), timeout=600)
    assert 0 == done.returncode, done.stderr[-3000:]
    runner = resumer(spark, work)

    files = [h.path for h in runner.store.latest().metadata.all_handles() if hasattr(h, "path")]
    assert [] == [p for p in files if "-kg8-15-" in p and "-a0-" in p]
    assert_exactly_once(runner, work, ["p1"])


@pytest.mark.parametrize("file_merging", [False, True], ids=["plain", "merging"])
def test_retention_after_many_batches_keeps_only_what_retained_checkpoints_reference(
        spark, tmp_path, file_merging):
    """benchmarks/keyed_retention.py with 12 batches over 2 partitions, retention 3, with
    and without file merging across checkpoints: shared files == referenced files, chk-* ==
    retained, state == recomputation."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import keyed_retention

    report = keyed_retention.check(spark, tmp_path, 12, max_retained=3, partitions=2,
                                   file_merging=file_merging)

    assert ([], [], []) == (report.unreferenced, report.missing, report.other_entries)
    assert (report.retained, 3, True) == (report.chk_dirs, len(report.retained), report.state_ok)


@pytest.mark.timeout(600)
def test_a_writer_stopped_holding_store_locks_never_blocks_its_successor(spark, tmp_path):
    """Issue 24's case: a driver SIGSTOPped inside batch 2's change file write (its task holds
    the range's local store lock) stays stopped past its lease ttl (3 s). A successor on the
    same local stores takes the lease, waits for the held lock no longer than its own lease
    ttl, runs the range on a private copy, and finishes p1 while the writer is still
    stopped, within the ttl and a margin of taking the lease. SIGCONTed, the writer
    publishes nothing (JobLeaseLostError; every `_metadata` unchanged); p2, on the local
    stores it left, then equals a recomputation, sinks included."""
    ttl = driver.LEASE_TTL.total_seconds()
    stalled = scenarios_stall.StalledWriter(tmp_path, ["p1"]).start()
    lines, lease_at = [], []

    def progress(line: str) -> None:
        if not lease_at:  # the first line comes once the lease is taken, state restored
            lease_at.append(time.monotonic())
        lines.append(line)

    successor = StatefulRunner(spark, driver.storage_of(tmp_path), driver.faults_pipeline(tmp_path),
                               keyed_local_dir=str(tmp_path / "local"),
                               lease_ttl=driver.LEASE_TTL, lease_wait=60)
    # Code that waits for the lock without bound would hang: SIGCONT the writer after a
    # while, so that such code fails on the assertions below instead.
    watchdog = threading.Timer(scenarios_stall.HANG_AFTER, stalled.resume)
    watchdog.start()
    try:
        successor.run(["p1"], on_progress=progress)
        seconds = time.monotonic() - lease_at[0]
        still_stopped = stalled.stopped()
        watchdog.cancel()
        published = scenarios_stall.metadata_files(tmp_path)
        code = stalled.finish()
    finally:
        watchdog.cancel()
        stalled.kill()
    waits = [float(w) for w in re.findall(r"waited (\d+\.\d+) s", "\n".join(lines))]

    assert (True, True) == (still_stopped, seconds < ttl + scenarios_stall.MARGIN), (
        seconds, lines)
    assert waits and ttl <= max(waits) <= ttl + scenarios_stall.LOCK_SLACK, lines
    assert (True, True, False, published) == (
        code != 0, "JobLeaseLostError" in stalled.stderr(), "RESULT" in stalled.stdout(),
        scenarios_stall.metadata_files(tmp_path)), stalled.stderr()[-3000:]
    after = resumer(spark, tmp_path)
    after.run(["p2"])
    assert_exactly_once(after, tmp_path, ["p1", "p2"])
