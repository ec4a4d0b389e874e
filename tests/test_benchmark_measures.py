"""The measuring parts of benchmarks/state_growth.py that its targets rest on, without Spark:
the recomputed state and its comparison, the bytes written between two listings, the chain
lengths that choose the recovery points, and the memory of a process tree; and
benchmarks/sessions.py's batches and recomputation."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import sessions as sb  # noqa: E402
import state_growth as sg  # noqa: E402
from _common import LOCAL_SESSION_CONF, PeakMemory, tree_memory, tree_memory_parts  # noqa: E402,I001


def test_amounts_are_exact_decimals():
    assert ["123.45", "-0.05", "0.00", "-1234.56"] == [
        str(v) for v in sg._decimal_cents(np.array([12345, -5, 0, -123456])).to_pylist()]


def test_recomputed_state_is_the_full_aggregate_and_a_difference_is_named(tmp_path):
    sg.write_batches(tmp_path, keys=50, batches=2, changed=10)
    expected = sg.expected_state(tmp_path, 3)
    events = pa.concat_tables(pq.read_table(p) for p in sorted(tmp_path.glob("batch-*")))
    key = events.column("user_id")[0].as_py()
    mine = events.filter(pc.equal(events.column("user_id"), key))
    row = expected.filter(pc.equal(expected.column("user_id"), key)).to_pylist()[0]

    assert 50 == expected.num_rows
    assert mine.num_rows == row["event_count"]
    assert sum(mine.column("amount").to_pylist()) == row["amount_sum"]
    assert min(mine.column("event_ts").to_pylist()) == row["first_seen"]
    assert max(mine.column("event_ts").to_pylist()) == row["last_seen"]
    assert sg.compare_state(expected, expected).startswith("equal")
    wrong = expected.set_column(2, "amount_sum", pa.array([0] * 50, sg.SUM_TYPE))
    assert "DIFFERENT: 50 keys differ in amount_sum" == sg.compare_state(wrong, expected)


def test_written_bytes_are_new_files_and_growth():
    before = {"a": 10, "b": 5}
    after = {"a": 10, "b": 8, "c": 4}  # "gone" files (deleted by retention) do not count

    assert {"b": 3, "c": 4} == sg.written_between(before, after)


def test_growth_is_the_median_of_the_steady_batches_after_the_warm_up():
    """The first batches after the initial state (2-4x the later ones at 8M keys) are left
    out of the growth median, and too few batches to leave any is an error, not a figure."""
    walls = [3.06, 2.25, 2.33, 1.93, 0.89, 0.92, 0.77, 0.62, 0.8, 0.8, 0.64]

    assert 0.8 == sg.steady_wall(walls, warmup=4)
    assert sg.GROWTH_BATCHES - sg.GROWTH_WARMUP >= 20
    with pytest.raises(ValueError, match="none after the 4 warm-up"):
        sg.steady_wall(walls[:4], warmup=4)


def test_chains_reset_at_a_snapshot_and_choose_the_worst_and_best_points():
    ours = sg.Chains()
    lengths = []
    for b, files in enumerate([["kg0-63-b1", "kg64-127-b1"], ["kg0-63-b2", "kg64-127-b2"],
                               ["kg0-63-m3", "kg0-63-b3", "kg64-127-m3", "kg64-127-b3"],
                               ["kg0-63-b4", "kg64-127-b4"]]):
        ours.ours({f"shared/s-{f}-a0-x{b}": 1 for f in files})
        lengths.append(ours.total())
    ss = sg.Chains()
    ss.ss({"state/0/0/3.changelog": 1, "state/0/0/2.zip": 1, "state/0/1/3.changelog": 1},
          {"state/0/0/2.zip": 1}, 3)
    measured = sg.Measured([1.0], [1], {}, lengths, ours.snapshots, "equal", 0, 0)

    assert [2, 4, 2, 4] == lengths
    assert {"kg0-63": 1, "kg64-127": 1} == ours.snapshots
    assert {"worst": 4, "best": 3} == sg.choose_points(measured)
    # SS's chains longest before its first snapshot (batch 0's changelog replayed): its
    # worst point is taken from its steady cycle; ours' first cycle is its steady one
    start_up = sg.Measured([1.0], [1], {}, [5, 6, 2, 4, 3], {}, "equal", 0, 0)
    assert {"worst": 2, "best": 3} == sg.choose_points(start_up)
    assert {"worst": 4, "best": 3} == sg.choose_points(start_up, steady=True)
    no_snapshot = sg.Measured([1.0], [1], {}, [1, 2, 3], {}, "equal", 0, 0)
    assert {"worst": 3} == sg.choose_points(no_snapshot, steady=True)
    assert ({"0/0": 1, "0/1": 3}, {"0/0": 1, "0/1": 0}) == (ss.length, ss.snapshots)


def test_the_worst_point_is_recovered_in_turns_and_its_median_is_the_target(capsys):
    """The worst point is recovered ``--recoveries`` times per system, the systems taking
    turns in alternating order; the target is the ratio of the medians, each run is printed,
    and a point's peak is its highest run's."""
    assert sg.recovery_turns(["ours", "ss-rocksdb"], 3) == [
        ("best", "ours"), ("best", "ss-rocksdb"), ("worst", "ours"), ("worst", "ss-rocksdb"),
        ("worst", "ss-rocksdb"), ("worst", "ours"), ("worst", "ours"), ("worst", "ss-rocksdb")]
    assert sg.recovery_turns(["ss-rocksdb", "ours"], 1)[2:] == [("worst", "ss-rocksdb"),
                                                               ("worst", "ours")]
    mib = 2**20

    def measured(walls, peaks):
        m = sg.Measured([1.0], [1], {}, [1, 2], {"kg0-127": 1}, "equal", 100 * mib, 0)
        m.recovery["worst"] = sg.Recoveries(2, 2, [
            {"from_process_start": w, "from_runner_start": w / 2, "peak_rss": p * mib}
            for w, p in zip(walls, peaks, strict=True)])
        return m

    # ours' one slow run (16 s) does not decide: medians 9 and 12 s
    ours, ss = measured([9.0, 16.0, 8.0], [500, 700, 600]), measured([12.0, 11.0, 13.0],
                                                                      [650, 640, 660])
    assert ours.recovery["worst"].median("from_process_start") == 9.0
    assert ours.recovery["worst"].peak_rss == 700 * mib
    checks = sg.report(1000, {"ours": ours, "ss-rocksdb": ss},
                       sg.argparse.Namespace(batches=1))
    out = capsys.readouterr().out
    assert "S=1,000 recovery (worst point): 0.75x SS RocksDB (target <= 0.8x): ok" in out
    assert "recovery at the worst point (after batch 2, chains 2 files), median of 3: 9.00 s " \
        "from process start, 4.50 s from the runner's start, peak RSS 700.00 MiB (the " \
        "highest)" in out
    assert "        2: 16.00 s from process start, 8.00 s from the runner's start, peak RSS " \
        "700.00 MiB" in out
    assert "S=1,000 peak RSS in recovery: 1.06x SS RocksDB (no target)" in out
    assert checks[2] is True
    # the same runs with ours' median over the target: MISSED
    ours.recovery["worst"].runs[0]["from_process_start"] = 10.0
    sg.report(1000, {"ours": ours, "ss-rocksdb": ss}, sg.argparse.Namespace(batches=1))
    assert "recovery (worst point): 0.83x SS RocksDB (target <= 0.8x): MISSED" in \
        capsys.readouterr().out


def test_the_worst_point_is_recovered_again_only_where_a_verdict_could_change():
    """After one pair at the worst point, more pairs run only while a recovery ratio with a
    target is within ``REPEAT_BAND`` of it: the time's at every size, the peak's at 8M."""
    mib = 2**20

    def measured(wall, peak):
        m = sg.Measured([1.0], [1], {}, [1, 2], {"kg0-127": 1}, "equal", 0, 0)
        m.recovery["worst"] = sg.Recoveries(2, 2, [
            {"from_process_start": wall, "from_runner_start": wall, "peak_rss": peak * mib}])
        return m

    clear = {"ours": measured(6.0, 900), "ss-rocksdb": measured(10.0, 1000)}  # 0.6x, 0.9x
    near = {"ours": measured(7.5, 900), "ss-rocksdb": measured(10.0, 1000)}  # 0.75x
    assert sg.recovery_ratios(1_000_000, clear) == {"recovery (worst point)": (0.6, 0.8)}
    assert not sg.undecided(1_000_000, clear)
    assert sg.undecided(1_000_000, near)
    # at 8M the peak counts too: 0.9x of SS's is within 0.15 of its 1.0x target
    assert sg.recovery_ratios(8_000_000, clear)["peak RSS in recovery"] == (0.9, 1.0)
    assert sg.undecided(8_000_000, clear)
    assert sg.undecided(1_000_000, {"ours": clear["ours"]})  # nothing to compare yet


def test_the_recomputed_state_is_made_once_per_data_directory(tmp_path, monkeypatch):
    """The second system's check reads the first one's recomputation: equal to a fresh one."""
    sg.write_batches(tmp_path, 200, 2, 20)
    first = sg.expected_state(tmp_path, 2)
    calls = []
    monkeypatch.setattr(sg, "_recomputed_state", lambda *a: calls.append(a))
    assert sg.expected_state(tmp_path, 2).equals(first)
    assert calls == []
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("batch-")) == [
        "expected-state-2.parquet"]


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="Linux /proc only")
def test_tree_memory_counts_the_children():
    child = subprocess.Popen([sys.executable, "-c",
                              "b = bytearray(200 * 2**20); import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while tree_memory(child.pid)[0] < 200 * 2**20:  # the child alone, once allocated
            assert time.monotonic() < deadline, "the child never reached 200 MiB"
            time.sleep(0.1)
        rss, pss = tree_memory(os.getpid())  # this process's tree includes the child
        assert rss >= 200 * 2**20 and pss >= 200 * 2**20
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="Linux /proc only")
@pytest.mark.timeout(60)
def test_tree_memory_counts_a_jvm_once_while_it_spawns(tmp_path):
    """A JVM's child that has not exec'd yet (same executable, same command line) shares the
    JVM's memory: the tree's RSS counts it once. The "JVM" is a copy of the interpreter named
    java whose child (a fork standing in for posix_spawn's) sleeps before any exec."""
    java = tmp_path / "java"
    java.write_bytes(Path(os.path.realpath(sys.executable)).read_bytes())
    java.chmod(0o755)
    code = ("import os, sys, time; sys.path[:0] = " + repr(sys.path) + "; "
            "b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
            "pid = os.fork(); time.sleep(30)")
    jvm = subprocess.Popen([str(java), "-c", code])
    try:
        deadline = time.monotonic() + 30
        while len([p for p in os.listdir("/proc") if p.isdigit() and _parent(p) == jvm.pid]) < 1:
            assert time.monotonic() < deadline, "the child was never started"
            time.sleep(0.1)
        own = _rss_of(jvm.pid)
        rss, _ = tree_memory(jvm.pid)
        assert own >= 200 * 2**20 and rss < own * 1.5, (rss, own)
    finally:
        jvm.kill()
        jvm.wait()


@pytest.mark.timeout(60)
def test_a_worker_is_done_at_its_result_and_whatever_it_leaves_is_killed(tmp_path, monkeypatch):
    """A worker that prints its RESULT and exits while a child of its own (as a JVM once did)
    still holds its stdout: the parent returns the result without waiting for that child, and
    the child is killed."""
    pid_file = tmp_path / "child.pid"
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import json, os, subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('RESULT ' + json.dumps({'done': 1}), flush=True)\n"
        "os._exit(0)\n")
    monkeypatch.setattr(sg, "__file__", str(worker))
    started = time.monotonic()
    result, _, _ = sg.spawn(["recover"], sample=False)
    assert result == {"done": 1}
    assert time.monotonic() - started < 30
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, f"the worker's child {child} was left running"
        time.sleep(0.1)


_STEPPED_WORKER = """
import json, os, sys
with open({log!r} + ".pids", "a") as pids:
    pids.write(f"{{os.getpid()}}\\n")
args = sys.argv[1:]
data, batches = args[args.index("--data") + 1], int(args[args.index("--batches") + 1])
assert "--stepped" in args
size = int(data.rsplit("g", 1)[1])
if size == {fail}:
    sys.exit("the initial state failed")
print("PHASE run's timed batches", flush=True)
walls = []
for b in range(1, batches + 1):
    sys.stdin.readline()
    with open({log!r}, "a") as log:
        log.write(f"{{size}} {{b}}\\n")
    walls.append(size / 1000 + b / 100)
    print(f"STEP {{b}}", flush=True)
print("RESULT " + json.dumps({{"walls": walls}}), flush=True)
"""


def _growth_args(batches: int) -> "sg.argparse.Namespace":
    return sg.argparse.Namespace(growth_batches=batches, growth_changed=5, growth_warmup=1,
                                 ss_min_deltas=10, prefetch=True)


@pytest.mark.timeout(120)
def test_growth_interleaves_the_two_sizes_batches_one_at_a_time(tmp_path, monkeypatch, capsys):
    """Both growth workers are alive together; each timed batch starts only when the parent
    says so, the two sizes take turns (the first in turn alternating), and each size's steady
    wall is the median of its own batches after the warm-up."""
    log = tmp_path / "steps.log"
    worker = tmp_path / "worker.py"
    worker.write_text(_STEPPED_WORKER.format(log=str(log), fail=-1))
    monkeypatch.setattr(sg, "__file__", str(worker))

    walls = sg.measure_growth([300, 100, 200], tmp_path, _growth_args(batches=4))

    steps = log.read_text().split()
    assert [(int(s), int(b)) for s, b in zip(steps[::2], steps[1::2], strict=True)] == [
        (100, 1), (300, 1), (300, 2), (100, 2), (100, 3), (300, 3), (300, 4), (100, 4)]
    assert walls == {100: pytest.approx(0.13), 300: pytest.approx(0.33)}
    assert "growth S=300: warm-up batches 0.31 s" in capsys.readouterr().out
    assert not list(tmp_path.glob("state_growth-g-*")) and not list(tmp_path.glob("g*"))


@pytest.mark.timeout(120)
def test_growth_stops_with_the_failed_workers_error_and_kills_the_other(tmp_path, monkeypatch):
    worker = tmp_path / "worker.py"
    worker.write_text(_STEPPED_WORKER.format(log=str(tmp_path / "steps.log"), fail=300))
    monkeypatch.setattr(sg, "__file__", str(worker))
    started = time.monotonic()

    with pytest.raises(RuntimeError, match="failed .1.: the initial state failed"):
        sg.measure_growth([100, 300], tmp_path, _growth_args(batches=3))
    assert time.monotonic() - started < 60
    assert not (tmp_path / "steps.log").exists()
    pids = [int(p) for p in (tmp_path / "steps.log.pids").read_text().split()]
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_memory_peaks_are_kept_by_phase_with_the_split_of_their_sample(capsys):
    """Each phase keeps its own peak RSS (with the split by part of that sample), its PSS and
    each part's own peak; the overall peaks are the phases' largest; the report prints a
    line per phase."""
    peak = PeakMemory(os.getpid(), interval=3600)  # samples only what is recorded here
    peak.stop()
    mib = 2**20
    peak.record("run's initial state", {"JVM": (600 * mib, 590 * mib, 1),
                                        "workers": (800 * mib, 500 * mib, 2)})
    peak.record("run's initial state", {"JVM": (900 * mib, 880 * mib, 1),
                                        "workers": (300 * mib, 200 * mib, 2)})
    peak.record("run's timed batches", {"JVM": (700 * mib, 690 * mib, 1),
                                        "driver": (190 * mib, 185 * mib, 1)})
    initial = peak.phases["run's initial state"]

    assert (peak.rss, peak.pss) == (1400 * mib, 1090 * mib)
    assert (initial.rss, initial.pss) == (1400 * mib, 1090 * mib)
    assert initial.describe() == "1400 MiB (PSS 1090; JVM 600, 2 workers 800; own peaks JVM " \
        "900, workers 800)"
    assert peak.phases["run's timed batches"].describe() == \
        "890 MiB (PSS 875; JVM 700, driver 190; own peaks JVM 700, driver 190)"
    measured = sg.Measured([1.0], [1], {}, [1], {}, "equal", peak.rss, peak.pss,
                           phases=peak.phases)
    sg.report(1000, {"ours": measured}, sg.argparse.Namespace(batches=1))
    out = capsys.readouterr().out
    assert "    peak RSS of the run's initial state: 1400 MiB (PSS 1090; JVM 600, 2 workers " \
        "800; own peaks JVM 900, workers 800)" in out
    assert "    peak RSS of the run's timed batches: 890 MiB" in out


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="Linux /proc only")
@pytest.mark.timeout(60)
def test_tree_memory_parts_name_the_jvm_the_daemon_and_its_workers(tmp_path):
    """Below the driver (this process): a JVM (an executable named java), the Python process
    it started (Spark's daemon) and what that one forked (the workers), each its own part."""
    java = tmp_path / "java"
    java.write_bytes(Path(os.path.realpath(sys.executable)).read_bytes())
    java.chmod(0o755)
    # each process ends with its parent: the JVM's kill ends them all
    daemon = ("import os, time; b = bytearray(60 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
              "os.fork(); os.fork(); p = os.getppid()\n"
              "while os.getppid() == p: time.sleep(0.1)")
    code = (f"import subprocess, sys, time; subprocess.Popen([{sys.executable!r}, '-c', "
            f"{daemon!r}]); time.sleep(60)")
    # The driver is a child of its own, so that this process's other children (a test
    # runner's) are not in the tree; its session's kill ends every process of the tree.
    driver = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, time; "
         f"subprocess.Popen([{str(java)!r}, '-c', {code!r}]); time.sleep(60)"],
        start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while (parts := tree_memory_parts(driver.pid)).get("workers", (0, 0, 0))[2] < 3:
            assert time.monotonic() < deadline, parts
            time.sleep(0.1)
        assert sorted(parts) == ["JVM", "daemon", "driver", "workers"]
        assert (parts["JVM"][2], parts["daemon"][2], parts["workers"][2]) == (1, 1, 3)
        assert parts["daemon"][0] >= 60 * 2**20 and parts["workers"][0] >= 3 * 60 * 2**20
        assert sum(p[0] for p in parts.values()) == pytest.approx(
            tree_memory(driver.pid)[0], rel=0.2)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()


def _parent(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Rss:"))


# --- benchmarks/sessions.py ------------------------------------------------------------------


def _brute_force_sessions(data: Path, upto: int, watermark_ms: int) -> tuple[set, set]:
    views = pa.concat_tables(pq.read_table(data / f"batch-{b:05d}.parquet")
                             for b in range(upto + 1))
    by_user: dict[str, list[int]] = {}
    for user, ts in zip(views.column("user_id").to_pylist(),
                        views.column("viewed_at").cast(pa.int64()).to_pylist(), strict=True):
        by_user.setdefault(user, []).append(ts // 1000)
    closed, open_ = set(), set()
    for user, times in by_user.items():
        times.sort()
        sessions, start, last, n = [], times[0], times[0], 0
        for t in times:
            if t - last >= sb.GAP_MS:
                sessions.append((user, start, last, n))
                start, n = t, 0
            last, n = t, n + 1
        sessions.append((user, start, last, n))
        closed |= set(sessions[:-1])
        (closed if last + sb.GAP_MS <= watermark_ms else open_).add(sessions[-1])
    return closed, open_


def _as_ms(table: pa.Table) -> set:
    return {(r[0], int(r[1].timestamp() * 1000), int(r[2].timestamp() * 1000), r[3])
            for r in (tuple(d.values()) for d in table.to_pylist())}


def test_session_batches_keep_the_open_sessions_and_the_recomputation_is_exact(tmp_path):
    """The generator keeps about S sessions open while some close every batch, no two views
    exactly the gap apart; the vectorised recomputation equals a brute force one; a wrong
    view count is named."""
    sb.write_batches(tmp_path, sessions=400, batches=8)
    watermark = sb.final_watermark_ms("ours", tmp_path, 8)
    closed, open_ = sb.expected_sessions(tmp_path, 8, watermark)
    warmup = pa.concat_tables(pq.read_table(p) for p in sorted((tmp_path / "warmup").glob("*")))
    ms = pa.concat_tables(pq.read_table(p) for p in sorted(tmp_path.glob("batch-*"))).column(
        "viewed_at").cast(pa.int64()).to_numpy() // 1000

    assert (_as_ms(closed), _as_ms(open_)) == _brute_force_sessions(tmp_path, 8, watermark)
    assert 0 < closed.num_rows and 360 <= open_.num_rows <= 440
    assert pq.read_table(tmp_path / "batch-00000.parquet").equals(warmup)
    assert np.all(ms % sb.QUANTUM_MS == 0) and sb.GAP_MS % sb.QUANTUM_MS != 0
    assert sb.compare("open", open_, open_, sb.SESSION_NAMES).startswith("open equal")
    wrong = open_.set_column(3, "views", pc.add(open_.column("views"), 1))
    assert sb.compare("open", wrong, open_, sb.SESSION_NAMES).endswith("differ in views")


def test_the_benchmark_sessions_run_the_python_daemon_our_local_sessions_run():
    """The state_growth sessions (both systems) get what ``build_spark_session`` adds on a
    local master: a copy, so that the benchmarks' processes need not import Dagster."""
    from resources.spark import LOCAL_SPARK_CONF

    assert LOCAL_SESSION_CONF == LOCAL_SPARK_CONF


def test_the_benchmark_sessions_reset_serialization_streams_as_ours_do():
    """Both systems' state_growth sessions get the product sessions' serializer resets."""
    from _common import SERIALIZER_RESETS

    from resources.spark import DEFAULT_SPARK_CONF

    assert SERIALIZER_RESETS.items() <= DEFAULT_SPARK_CONF.items()


class _StartedSession:
    """What the recover worker's ``System`` touches of a session started before it."""

    class sparkContext:  # noqa: N801
        levels: list = []

        @classmethod
        def setLogLevel(cls, level):  # noqa: N802
            cls.levels.append(level)


def test_ours_recovery_hands_its_started_session_to_the_runner(tmp_path, monkeypatch):
    """The session ours' recover worker started in the background is the one its runner gets:
    asking the builder again set its options on it, which built the session's SessionState
    before the runner's start was stamped (SS's is built after it, by its query)."""

    def no_second_session(*args):
        raise AssertionError("a session asked for again")

    monkeypatch.setattr(sg, "_spark", no_second_session)
    system = sg.System("ours", tmp_path, tmp_path, 10, spark=_StartedSession)
    assert system.spark is _StartedSession and _StartedSession.sparkContext.levels == ["ERROR"]


def test_ours_recovery_warms_the_workers_up_as_soon_as_its_context_exists(monkeypatch):
    """As ``SparkResource.start`` does: the workers' warm-up starts in the session's thread
    once the session's SparkContext exists, before the session is built on it, not when
    the runner starts (nor once the session is built: a restart's first job waited for
    the Python daemon's start)."""
    import pipelines.warm_up

    events = []
    context = object()

    def spark(app, deltas, on_context=None):
        events.append(("context", app))
        on_context(context)
        events.append(("built", app))
        return _StartedSession

    monkeypatch.setattr(sg, "_spark", spark)
    monkeypatch.setattr(pipelines.warm_up, "warm_up_workers",
                        lambda started: events.append(("warm-up", started)))
    start = sg._SessionStart("state_growth-ours", 10)
    start.start()
    start.join(30)
    assert events == [("context", "state_growth-ours"), ("warm-up", context),
                      ("built", "state_growth-ours")]
    assert start.session is _StartedSession
    assert start.stamps["context_started"] <= start.stamps["session_built"]


def test_both_systems_sessions_get_the_same_settings(monkeypatch):
    """``rocksdb_session`` with ``on_context`` (ours' recovery) makes the SparkContext from
    the settings the builder gets, the builder's own first step, and the builder gets the
    same settings as without it (SS's): only when the context is made differs."""
    from _common import rocksdb_session
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    made, built = [], []

    class Builder:
        def __init__(self, options):
            self.options = options

        def config(self, key, value):
            return Builder({**self.options, key: value})

        def getOrCreate(self):  # noqa: N802
            built.append(self.options)
            return "session"

    monkeypatch.setattr(SparkSession, "builder", Builder({}))
    monkeypatch.setattr(SparkContext, "getOrCreate",
                        classmethod(lambda cls, conf: made.append(dict(conf.getAll()))
                                    or "context"))
    contexts = []
    arguments = dict(driver_java_options="-Xshare:auto", conf={"spark.a": "1"})
    assert rocksdb_session("app", 10, **arguments) == "session" == rocksdb_session(
        "app", 10, on_context=contexts.append, **arguments)
    # the context's conf: the builder's options (and, with a JVM running, its defaults)
    assert contexts == ["context"] and built[0] == built[1]
    assert built[0].items() <= made[0].items()
    assert built[0]["spark.master"] == "local[2]" and built[0]["spark.a"] == "1"
    assert built[0]["spark.driver.extraJavaOptions"] == "-Xshare:auto"


def test_the_benchmarks_give_a_jvm_the_projects_class_archive_as_the_product_does(
        monkeypatch, tmp_path):
    """The baselines' sessions (state_growth's SS, cold_run's second floor) get the archive's
    options from the product's own module, read without importing ``pipelines``; none while
    there is no whole archive."""
    from _common import class_archive_options

    from pipelines import class_archive

    monkeypatch.setenv("PIPELINES_CLASS_ARCHIVE_DIR", str(tmp_path))
    assert class_archive_options() == "" == class_archive.java_options()
    path = class_archive.archive_path()
    path.write_bytes(b"x" * 8)
    path.with_name(path.name + ".bytes").write_text("8")
    assert class_archive_options() == class_archive.java_options() != ""
