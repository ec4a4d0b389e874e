"""Abandoned checkpoints (issue 25, item 5): a ``chk-<id>`` without `_metadata` whose writer
can no longer complete it (job lease released or expired, or taken since) is listed as
``abandoned`` and collected after the grace period; one whose writer still holds the job
lease is listed as ``in-progress`` and never collected, however old its files."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pytest

from checkpoint_storage import (
    FileSystemCheckpointStorage,
    JobID,
    collect_garbage,
    list_checkpoints,
    read_job_lease,
)
from checkpoint_storage.cli import main
from tests.support import EXCLUSIVE, write_state

ROOT = Path(__file__).resolve().parents[2]
HOUR = 3600.0

# A writer that takes the job lease (1 s ttl, renewed while it lives), writes a state file
# into chk-1, says so, and waits to be killed.
WRITER = """
import sys, time
from checkpoint_storage import FileSystemCheckpointStorage, JobID
from tests.support import EXCLUSIVE, write_state
access = FileSystemCheckpointStorage(sys.argv[1]).create_checkpoint_storage(JobID(sys.argv[2]))
access.initialize_base_locations()
access.acquire_job_lease("killed-writer", ttl=1)
write_state(access.initialize_location_for_checkpoint(1), b"s" * 65536, EXCLUSIVE)
print("written", flush=True)
time.sleep(600)
"""


def _killed_writer(base: str, job: JobID) -> None:
    """Run WRITER and SIGKILL it once chk-1 is written; return once its lease expired."""
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, base, job.hex], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert "written" == writer.stdout.readline().strip()
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    fs = fsspec.filesystem("file")
    # Bounded by the test's timeout: the ttl is 1 s.
    while read_job_lease(fs, f"{base}/{job.hex}").state() != "expired":
        time.sleep(0.2)


def _statuses(directory: str) -> dict[str, tuple[str, str | None]]:
    return {
        i.pointer.rsplit("/", 1)[1]: (i.status, i.reason) for i in list_checkpoints(directory)
    }


def _age(directory: Path, seconds: float) -> None:
    """Set the modification times of ``directory`` and everything below it ``seconds`` back."""
    then = time.time() - seconds
    for path in [directory, *directory.rglob("*")]:
        os.utime(path, (then, then))


@pytest.mark.timeout(120)
def test_killed_writer_is_abandoned_live_writer_in_progress_and_gc_tells_them_apart(
    tmp_path, capsys
):
    """chk-1 of a writer killed with SIGKILL, once its lease expired: abandoned (in the
    library's listing and `checkpoints list`). A new holder takes the lease and writes chk-2:
    in-progress, and chk-1 stays abandoned once it is older than the lease allows for clock
    skew. GC after the grace period (files 3 h old, grace 1 h) removes chk-1 and keeps every
    file of chk-2, whose writer holds the lease."""
    base = str(tmp_path / "cp")
    job = JobID.generate()
    job_dir = tmp_path / "cp" / job.hex
    _killed_writer(base, job)

    statuses = _statuses(str(job_dir))
    assert "abandoned" == statuses["chk-1"][0]
    assert "the job lease is expired" in statuses["chk-1"][1]
    assert "killed-writer" in statuses["chk-1"][1]
    assert 0 == main(["list", str(job_dir)])
    out = capsys.readouterr().out.splitlines()
    assert ["1", "checkpoint", "abandoned"] == next(r for r in out if "chk-1" in r).split()[:3]
    assert any(r.startswith("abandoned: ") and "lease is expired" in r for r in out)

    access = FileSystemCheckpointStorage(base).create_checkpoint_storage(job)
    with access.acquire_job_lease("live-writer", ttl=60):
        write_state(access.initialize_location_for_checkpoint(2), b"t" * 65536, EXCLUSIVE)
        # Written moments before the new holder came: it might be the holder's (clock skew).
        assert "in-progress" == _statuses(str(job_dir))["chk-1"][0]
        _age(job_dir / "chk-1", 3 * HOUR)
        statuses = _statuses(str(job_dir))
        assert ("in-progress", None) == statuses["chk-2"]
        assert "abandoned" == statuses["chk-1"][0]
        assert "before the lease's holder acquired it" in statuses["chk-1"][1]

        # chk-2's files as old as chk-1's: only the lease tells them apart.
        result = collect_garbage(access, grace_period=HOUR, now=time.time() + 3 * HOUR)
        assert not (job_dir / "chk-1").exists()
        assert [] == [p for p in result.deleted if "/chk-2/" in p]
        assert 1 == len(list((job_dir / "chk-2").iterdir()))
        assert ["chk-2"] == [name for name in _statuses(str(job_dir))]

    # Released: chk-2 is abandoned now, and collected after the grace period.
    assert "the job lease is released" in _statuses(str(job_dir))["chk-2"][1]
    collect_garbage(access, grace_period=HOUR, now=time.time() + 3 * HOUR)
    assert not (job_dir / "chk-2").exists()


def test_abandoned_directories_are_kept_within_the_grace_period(tmp_path):
    """An abandoned chk-<id> younger than the grace period stays (a slow storage listing,
    clock skew): abandoned only makes it collectable, after the grace period as before."""
    job = JobID.generate()
    access = FileSystemCheckpointStorage(str(tmp_path / "cp")).create_checkpoint_storage(job)
    access.initialize_base_locations()
    with access.acquire_job_lease("writer", ttl=60):
        write_state(access.initialize_location_for_checkpoint(1), b"s" * 65536, EXCLUSIVE)
    assert "abandoned" == _statuses(access.checkpoints_directory)["chk-1"][0]

    collect_garbage(access, grace_period=HOUR)
    assert "abandoned" == _statuses(access.checkpoints_directory)["chk-1"][0]


def test_a_job_never_leased_keeps_in_progress_and_the_grace_period_alone(tmp_path):
    """Without a lease nothing tells a live writer from a dead one: in-progress, and
    collected after the grace period as before leases existed."""
    job = JobID.generate()
    access = FileSystemCheckpointStorage(str(tmp_path / "cp")).create_checkpoint_storage(job)
    access.initialize_base_locations()
    write_state(access.initialize_location_for_checkpoint(1), b"s" * 65536, EXCLUSIVE)
    assert ("in-progress", None) == _statuses(access.checkpoints_directory)["chk-1"]

    collect_garbage(access, grace_period=HOUR, now=time.time() + 3 * HOUR)
    assert [] == list_checkpoints(access.checkpoints_directory)
