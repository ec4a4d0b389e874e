"""One writer per job (issue 13): the job lease, its fencing epoch in `_metadata`, ids that
stay unique across owners, and the ``checkpoints lease`` commands."""

import json
import time

import pytest

from checkpoint_storage import (
    CheckpointMetadata,
    FileSystemCheckpointStorage,
    JobID,
    JobLeaseHeldError,
    JobLeaseLostError,
    MemoryCheckpointStorage,
    read_job_lease,
    store_checkpoint_metadata,
)
from checkpoint_storage.cli import main
from tests.support import EXCLUSIVE, fs_of, norm, write_state

pytestmark = pytest.mark.timeout(60)


def _access(backend, job_id: JobID):
    storage = FileSystemCheckpointStorage(
        backend.url("cp"), storage_options=dict(backend.storage_options)
    )
    return storage.create_checkpoint_storage(job_id)


def _coordinators(backend, n: int = 2):
    """``n`` independent accesses of one job (no shared objects but the storage)."""
    job_id = JobID.generate()
    accesses = [_access(backend, job_id) for _ in range(n)]
    accesses[0].initialize_base_locations()
    return accesses


def _commit(access, checkpoint_id: int | None = None, master: bytes = b"m"):
    checkpoint_id = access.next_checkpoint_id() if checkpoint_id is None else checkpoint_id
    location = access.initialize_location_for_checkpoint(checkpoint_id)
    out = location.create_metadata_output_stream()
    store_checkpoint_metadata(CheckpointMetadata(checkpoint_id, master_states={"m": master}), out)
    return out.close_and_finalize_checkpoint()


def _metadata_exists(backend, access, checkpoint_id: int) -> bool:
    fs = fs_of(backend)
    try:
        fs.info(norm(fs, f"{access.checkpoints_directory}/chk-{checkpoint_id}/_metadata"))
    except FileNotFoundError:
        return False
    return True


def test_a_second_coordinator_fails_at_once_naming_the_holder(backend):
    """While A holds the lease, B's acquire raises JobLeaseHeldError naming A and its epoch."""
    a, b = _coordinators(backend)
    with a.acquire_job_lease("run-A", ttl=30):
        started = time.monotonic()
        with pytest.raises(JobLeaseHeldError) as raised:
            b.acquire_job_lease("run-B", ttl=30)
        elapsed = time.monotonic() - started

    assert ("run-A", 1) == (raised.value.holder, raised.value.epoch)
    assert "run-A" in str(raised.value) and "checkpoints lease break" in str(raised.value)
    assert elapsed < 15  # at once, not after a wait (generous: a loaded machine, S3 mock)


def test_each_commit_records_the_fencing_epoch_and_epochs_only_grow(backend):
    """Owners one after another get epochs 1, 2, 3, each recorded in its `_metadata`;
    without a lease nothing is recorded."""
    accesses = _coordinators(backend, 4)
    epochs = []
    for access in accesses[:3]:
        with access.acquire_job_lease(ttl=30):
            epochs.append(_commit(access).load_metadata().lease_epoch)
    unleased = _commit(accesses[3]).load_metadata()

    assert [1, 2, 3] == epochs
    assert (None, 4) == (unleased.lease_epoch, unleased.checkpoint_id)


def test_waiting_acquires_once_the_holder_releases(backend):
    """B waiting for the lease gets it right after A releases it, with the next epoch."""
    a, b = _coordinators(backend)
    lease = a.acquire_job_lease("A", ttl=30)
    import threading

    threading.Timer(0.5, lease.release).start()
    started = time.monotonic()
    with b.acquire_job_lease("B", ttl=30, wait=10) as taken:
        waited = time.monotonic() - started
        epoch = taken.epoch

    assert 2 == epoch
    assert 0.4 < waited < 10  # after the release, within the wait (a loaded machine)


def test_an_expired_lease_is_taken_over_and_its_holder_cannot_publish(backend):
    """A stops renewing; after its ttl B takes the lease; A's finalize then raises
    JobLeaseLostError and publishes nothing."""
    a, b = _coordinators(backend)
    a.acquire_job_lease("A", ttl=0.5, auto_renew=False)
    location = a.initialize_location_for_checkpoint(1)
    write_state(location, b"state", EXCLUSIVE)
    time.sleep(0.7)
    lease_b = b.acquire_job_lease("B", ttl=30)
    out = location.create_metadata_output_stream()
    store_checkpoint_metadata(CheckpointMetadata(1), out)

    with pytest.raises(JobLeaseLostError):
        out.close_and_finalize_checkpoint()

    assert (False, True, 2) == (_metadata_exists(backend, a, 1), lease_b.valid, lease_b.epoch)
    lease_b.release()


def test_a_stale_holder_that_thinks_it_is_valid_is_fenced_by_the_newer_epoch(backend):
    """A lease taken over while its holder still counts itself valid (its clock says so) is
    caught by the check right before the conditional PUT: a newer epoch exists."""
    a, b = _coordinators(backend)
    lease_a = a.acquire_job_lease("A", ttl=30, auto_renew=False)
    location = a.initialize_location_for_checkpoint(1)
    # B breaks the lease by force (as an operator would) and takes it.
    assert 0 == main(["lease", "break", b.checkpoints_directory, "--force", *_options(backend)])
    lease_b = b.acquire_job_lease("B", ttl=30)
    out = location.create_metadata_output_stream()
    store_checkpoint_metadata(CheckpointMetadata(1), out)

    with pytest.raises(JobLeaseLostError, match="taken over"):
        out.close_and_finalize_checkpoint()

    assert (False, False, 3) == (_metadata_exists(backend, a, 1), lease_a.valid, lease_b.epoch)
    lease_b.release()


@pytest.mark.slow  # waits out ttls: ~11 s per backend
def test_the_renewal_thread_keeps_the_lease_beyond_its_ttl(backend):
    """With auto_renew the lease stays valid and held for several ttls; a commit works."""
    a, b = _coordinators(backend)
    # A ttl of 5 s renewed every 1.7 s: a renewal may be late by 3 s on a loaded machine.
    with a.acquire_job_lease("A", ttl=5.0) as lease:
        time.sleep(11)
        with pytest.raises(JobLeaseHeldError):
            b.acquire_job_lease("B")
        completed = _commit(a)
        valid = lease.valid

    assert (True, 1) == (valid, completed.load_metadata().lease_epoch)


def test_a_released_lease_cannot_publish():
    """After release, a location of that access refuses to finalize (JobLeaseLostError)."""
    storage = MemoryCheckpointStorage("memory://lease-released")
    access = storage.create_checkpoint_storage(JobID.generate())
    access.initialize_base_locations()
    lease = access.acquire_job_lease("A", ttl=30)
    location = access.initialize_location_for_checkpoint(1)
    lease.release()
    out = location.create_metadata_output_stream()
    store_checkpoint_metadata(CheckpointMetadata(1), out)

    with pytest.raises(JobLeaseLostError, match="released"):
        out.close_and_finalize_checkpoint()


def test_ids_stay_unique_across_owners_above_aborted_directories(backend):
    """A new owner's first id is above every chk-<id> listed, including aborted ones."""
    a, b = _coordinators(backend)
    with a.acquire_job_lease("A", ttl=30):
        _commit(a, 3)
        aborted = a.initialize_location_for_checkpoint(9)
        # Above the inline threshold: on S3 a directory exists once it holds a file.
        write_state(aborted, b"o" * 64 * 1024, EXCLUSIVE)
    with b.acquire_job_lease("B", ttl=30):
        first = b.next_checkpoint_id()

    assert 10 == first


def test_an_unreadable_lease_record_counts_as_held_until_broken(backend):
    """A corrupt record is never taken as free (fail closed); `lease break` frees it."""
    a, b = _coordinators(backend)
    a.acquire_job_lease("A", ttl=30).release()
    fs = fs_of(backend)
    record = norm(fs, f"{a.checkpoints_directory}/_lease/epoch-{1:020d}")
    fs.pipe_file(record, b"\x00garbage")

    with pytest.raises(JobLeaseHeldError, match="cannot be read"):
        b.acquire_job_lease("B")
    assert 0 == main(["lease", "break", b.checkpoints_directory, *_options(backend)])
    with b.acquire_job_lease("B", ttl=30) as lease:
        assert 3 == lease.epoch


def _options(backend) -> list[str]:
    return [a for k, v in backend.storage_options.items() for a in ("-o", f"{k}={v}")]


def test_lease_show_and_break_on_the_command_line(backend, capsys):
    """`lease show` names holder and epoch; `lease break` refuses a live lease (exit 2) and
    breaks it with --force, after which its holder cannot publish."""
    a, _ = _coordinators(backend)
    job = a.checkpoints_directory
    lease = a.acquire_job_lease("run-42", ttl=60, auto_renew=False)
    capsys.readouterr()

    show = main(["lease", "show", job, "--json", *_options(backend)])
    shown = json.loads(capsys.readouterr().out)
    refused = main(["lease", "break", job, *_options(backend)])
    refused_err = capsys.readouterr().err
    forced = main(["lease", "break", job, "--force", *_options(backend)])
    capsys.readouterr()
    after = main(["lease", "show", job, "--json", *_options(backend)])
    after_shown = json.loads(capsys.readouterr().out)

    assert (0, "held", 1, "run-42") == (show, shown["state"], shown["epoch"], shown["owner"])
    assert (2, True) == (refused, "--force" in refused_err)
    assert (0, 0, "released", 2) == (forced, after, after_shown["state"], after_shown["epoch"])
    with pytest.raises(JobLeaseLostError):
        lease.check()


def test_lease_show_of_a_job_never_leased(tmp_path, capsys):
    """`lease show` of a job without a lease says so and exits 0."""
    job = tmp_path / ("a" * 32)
    job.mkdir()

    code = main(["lease", "show", str(job)])

    assert (0, f"{job}: no lease has been taken\n") == (code, capsys.readouterr().out)


def test_reading_the_lease_changes_nothing(backend):
    """read_job_lease of a never-leased job returns None and creates nothing."""
    a, _ = _coordinators(backend)
    fs = fs_of(backend)
    job = norm(fs, a.checkpoints_directory)
    before = sorted(fs.find(job, withdirs=True))

    record = read_job_lease(fs, job)

    fs.invalidate_cache()
    assert (None, before) == (record, sorted(fs.find(job, withdirs=True)))
