"""The measuring parts of benchmarks/state_growth.py that its targets rest on, without Spark:
the recomputed state and its comparison, the bytes written between two listings, the chain
lengths that choose the recovery points, and the memory of a process tree."""

import os
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

import state_growth as sg  # noqa: E402
from _common import tree_memory  # noqa: E402


def test_amounts_are_exact_decimals():
    assert ["123.45", "-0.05", "0.00", "-1234.56"] == [
        str(v) for v in sg._decimal_cents(np.array([12345, -5, 0, -123456])).to_pylist()]


def test_recomputed_state_is_the_full_aggregate_and_a_difference_is_named(tmp_path):
    sg.write_batches(tmp_path, keys=50, batches=2, changed=10)
    expected = sg.expected_state(tmp_path, 3)
    events = pa.concat_tables(pq.read_table(p) for p in sorted(tmp_path.glob("*")))
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
    assert ({"0/0": 1, "0/1": 3}, {"0/0": 1, "0/1": 0}) == (ss.length, ss.snapshots)


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
