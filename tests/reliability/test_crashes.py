"""SIGKILL of a checkpoint writer at random moments, on local disk and on S3 (moto): after
every kill no checkpoint is visible as complete with missing or invalid files, recovery
picks the newest valid one, and no checkpoint the writer saw completed is lost.

The long version is ``benchmarks/reliability.py --trials N``; these run the same code with
10 kills per backend.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint_storage import FileSystemCheckpointStorage

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scenarios_crash  # noqa: E402 - the harness lives next to the tests

KILLS = 10


def _run_writer(checkpoint_dir: str, checkpoints: int, seed: int = 5) -> list[int]:
    """Run crash_writer.py to its end (no kill); the ids it reported completed."""
    command = [
        scenarios_crash.PYTHON,
        str(scenarios_crash.WRITER),
        "checkpoints",
        "--checkpoint-dir",
        checkpoint_dir,
        "--job-id",
        scenarios_crash.JOB_ID,
        "--max-checkpoints",
        str(checkpoints),
        "--seed",
        str(seed),
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    lines = out.stdout.splitlines()
    return [int(line.split()[1]) for line in lines if line.startswith("COMPLETED")]


@pytest.mark.timeout(120)
def test_sigkill_local_never_shows_a_broken_checkpoint_or_loses_one(tmp_path):
    """After each of 10 local SIGKILLs: only valid checkpoints, newest recovered, none lost."""
    stats = scenarios_crash.run_crash_trials(KILLS, str(tmp_path), seed=11)
    assert [] == stats.problems
    assert KILLS == stats.kills
    assert stats.completed_reported > 0  # the kills did land among completed checkpoints


@pytest.mark.timeout(180)
def test_sigkill_s3_never_shows_a_broken_checkpoint_or_loses_one(s3_server):
    """After each of 10 S3 SIGKILLs: only valid checkpoints, newest recovered, none lost."""
    bucket = s3_server.new_bucket()
    stats = scenarios_crash.run_crash_trials(
        KILLS, f"s3://{bucket}/crash", endpoint_url=s3_server.endpoint_url, seed=12, max_delay=0.3
    )
    assert [] == stats.problems
    assert KILLS == stats.kills
    assert stats.completed_reported > 0


@pytest.mark.timeout(60)
def test_writer_restart_continues_above_the_highest_id(tmp_path):
    """A restarted writer starts above every existing chk-<id>: ids are never reused."""
    first = _run_writer(str(tmp_path), 3)
    second = _run_writer(str(tmp_path), 2)
    assert ([1, 2, 3], [4, 5]) == (first, second)


@pytest.mark.timeout(60)
def test_recovery_check_reports_a_torn_metadata(tmp_path):
    """The recovery check flags a truncated `_metadata` of a completed checkpoint."""
    reported = _run_writer(str(tmp_path), 2)
    metadata = tmp_path / scenarios_crash.JOB_ID / "chk-2" / "_metadata"
    metadata.write_bytes(metadata.read_bytes()[:-7])
    storage = FileSystemCheckpointStorage(str(tmp_path))
    known = scenarios_crash._Known(reported=set(reported))
    problems = scenarios_crash.check_recovery(storage, scenarios_crash.JOB_ID, known)
    assert 2 == len(problems)  # chk-2 invalid, and so reported-but-lost
    assert ["chk-2", "reported"] == [p.split()[0] for p in problems]


@pytest.mark.timeout(60)
def test_recovery_check_reports_a_lost_state_file(tmp_path):
    """The recovery check flags a checkpoint whose verified state file later vanished."""
    storage = FileSystemCheckpointStorage(str(tmp_path), file_state_size_threshold=20 * 1024)
    known = scenarios_crash._Known()
    for seed in range(20):  # sizes vary by seed: find a checkpoint with a state file
        _run_writer(str(tmp_path), 1, seed)
        assert [] == scenarios_crash.check_recovery(storage, scenarios_crash.JOB_ID, known)
        with_files = [i for i, files in known.verified.items() if files]
        if with_files:
            break
    path = known.verified[with_files[0]][0][0]
    os.remove(path)
    problems = scenarios_crash.check_recovery(storage, scenarios_crash.JOB_ID, known)
    assert [f"chk-{with_files[0]}"] == [p.split()[0] for p in problems]
