"""Spark task attempts killed mid-write (SIGKILL of the Python worker after its first bytes
reached the state file) and after the write (the worker exits before the handle reaches the
driver), on ``local[2,3]`` with retries and ``spark.speculation`` on, in a driver subprocess
(this pytest process may hold a SparkContext already; a JVM holds one).

Afterwards: one completed checkpoint per id; every referenced file exists and validates;
the killed attempts' files are unreferenced orphans that ``collect_garbage`` (grace 0)
removes, and it removes nothing else. Local mode never launches speculative copies (they
must run on another host than the original), so speculation is tested on a standalone
cluster of two worker hosts (127.0.0.1 and 127.0.0.2), where attempt 0 of partition 2
straggles after its write and a speculative copy overtakes it.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scenarios_crash  # noqa: E402 - the harness lives next to the tests

# Spark drivers and a standalone cluster in subprocesses.
pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> scenarios_crash.SparkKillReport:
    return scenarios_crash.check_spark_run(tmp_path_factory.mktemp("spark-kills"))


@pytest.mark.timeout(300)
def test_exactly_one_completed_checkpoint_per_id(report):
    """Each checkpoint the runner took is completed exactly once; no other one is."""
    assert {i: 1 for i in report.checkpoint_ids} == report.completed_per_id
    assert 3 == len(report.checkpoint_ids)


@pytest.mark.timeout(300)
def test_every_referenced_file_exists_and_validates(report):
    """verify_checkpoint finds no problem in any checkpoint, before or after GC."""
    assert [] == report.problems


@pytest.mark.timeout(300)
def test_killed_attempts_lost_and_their_retries_are_referenced(report):
    """Each killed first attempt left one unreferenced file; handles come from attempt 1."""
    assert report.expected_kills == report.killed_attempts
    assert [] == report.stray_orphans
    assert report.killed_attempts >= 2 * len(report.checkpoint_ids)  # both kill kinds ran
    assert {"1"} == report.referenced_attempts


@pytest.mark.timeout(300)
def test_garbage_collection_removes_exactly_the_orphans(report):
    """collect_garbage (grace 0) deletes exactly the unreferenced files, no referenced one."""
    assert report.orphans == report.gc_deleted
    assert report.killed_attempts == len(report.orphans)
    assert report.referenced_after_gc_ok


# --- speculation on a standalone cluster of two worker hosts -----------------------------


@pytest.fixture(scope="module")
def speculation(tmp_path_factory) -> scenarios_crash.SparkKillReport:
    return scenarios_crash.check_speculation_run(tmp_path_factory.mktemp("speculation"))


@pytest.mark.timeout(400, method="signal")  # signal: the cluster's teardown still runs
def test_speculative_copies_win_and_commit_once(speculation):
    """With a straggling attempt 0, a speculative copy wins; one completed checkpoint per id."""
    assert {i: 1 for i in speculation.checkpoint_ids} == speculation.completed_per_id
    assert speculation.expected_kills == speculation.speculative  # one winning copy per straggler
    assert speculation.expected_kills >= 1
    assert {"0"} == speculation.referenced_attempts  # partitions 0 and 1 were not touched
    assert [] == speculation.problems


@pytest.mark.timeout(400, method="signal")
def test_overtaken_attempts_are_orphans_that_gc_removes(speculation):
    """The overtaken attempts' files are unreferenced; GC (grace 0) removes exactly those."""
    # Spark kills an overtaken attempt: one killed mid-write aborts (deletes) its own file.
    assert speculation.killed_attempts <= speculation.expected_kills
    assert [] == speculation.stray_orphans
    assert speculation.orphans == speculation.gc_deleted
    assert speculation.referenced_after_gc_ok
