"""Discovery by listing (issue 13): on object stores the latest completed checkpoint, store
recovery and ``list_checkpoints`` find `_metadata` objects with a few LIST requests per
thousand objects, not with requests per directory."""

import math

import pytest

from checkpoint_storage import (
    CheckpointMetadata,
    FileSystemCheckpointStorage,
    FileSystemCompletedCheckpointStore,
    JobID,
    list_checkpoints,
    store_checkpoint_metadata,
)
from checkpoint_storage._metadata import encode_metadata
from tests.support import fs_of, norm

pytestmark = pytest.mark.timeout(120)

ABORTED = 1000


def _job(backend):
    storage = FileSystemCheckpointStorage(
        backend.url("cp"), storage_options=dict(backend.storage_options)
    )
    access = storage.create_checkpoint_storage(JobID.generate())
    access.initialize_base_locations()
    return access


def _commit(access, checkpoint_id: int):
    location = access.initialize_location_for_checkpoint(checkpoint_id)
    out = location.create_metadata_output_stream()
    store_checkpoint_metadata(CheckpointMetadata(checkpoint_id), out)
    return out.close_and_finalize_checkpoint()


def _abort_many(backend, access, ids) -> None:
    """``chk-<id>`` directories holding one orphaned state file each and no `_metadata`."""
    fs = fs_of(backend)
    job = norm(fs, access.checkpoints_directory)
    files = {f"{job}/chk-{i}/orphan": b"x" for i in ids}
    if backend.name == "local":
        for i in ids:
            fs.makedirs(f"{job}/chk-{i}", exist_ok=True)
    fs.pipe(files)
    fs.invalidate_cache()


@pytest.fixture(scope="module")
def _s3_job_written(s3_server):
    from tests.support import Backend

    backend = Backend("s3", f"s3://{s3_server.new_bucket()}/base", s3_server.storage_options)
    access = _job(backend)
    _commit(access, 1)
    _abort_many(backend, access, range(2, ABORTED + 2))
    return backend, access


@pytest.fixture
def s3_job(s3_server, _s3_job_written):
    """One completed chk-1 below 1,000 aborted directories (read-only: shared by the tests)."""
    s3_server.clear_log()
    return _s3_job_written


def _requests(s3_server) -> dict[str, int]:
    counts: dict[str, int] = {}
    for request in s3_server.requests:
        counts[request.kind] = counts.get(request.kind, 0) + 1
    return counts


def test_latest_behind_a_thousand_aborted_directories_costs_a_few_requests(s3_server, s3_job):
    """`latest` with 1,000 aborted chk-<id> above the only completed one: one LIST page per
    1,000 objects plus reading that `_metadata` (HEAD, GET), not ~4 requests per directory."""
    _, access = s3_job

    latest = access.latest_completed_checkpoint()

    counts = _requests(s3_server)
    assert latest.external_pointer.endswith("/chk-1")
    assert math.ceil((ABORTED + 1) / 1000) + 1 >= counts.get("LIST", 0)
    assert 6 >= sum(counts.values()), counts


def test_store_recovery_lists_instead_of_probing(s3_server, s3_job):
    """Recovering a store over the same job: a few LISTs, then one read per completed one."""
    _, access = s3_job

    store = FileSystemCompletedCheckpointStore(access, max_retained=2)

    counts = _requests(s3_server)
    assert [1] == [c.checkpoint_id for c in store.all()]
    assert 6 >= sum(counts.values()), counts


def test_list_checkpoints_lists_instead_of_probing(s3_server, s3_job):
    """`checkpoints list` of the job: every row from listings, far below one request per
    directory."""
    backend, access = s3_job

    infos = list_checkpoints(access.checkpoints_directory, storage_options=backend.storage_options)

    counts = _requests(s3_server)
    assert (ABORTED + 1, 1) == (len(infos), sum(1 for i in infos if i.completed))
    assert 12 >= sum(counts.values()), counts


def test_discovery_is_numeric_skips_aborted_and_invalid_and_huge_ids(backend):
    """chk-100 beats chk-99; an aborted chk-200, a corrupt chk-150 and an id beyond 63 bits
    are skipped; next_checkpoint_id is above every listed directory."""
    access = _job(backend)
    for checkpoint_id in (7, 99, 100):
        _commit(access, checkpoint_id)
    fs = fs_of(backend)
    job = norm(fs, access.checkpoints_directory)
    _abort_many(backend, access, [200])
    if backend.name == "local":
        fs.makedirs(f"{job}/chk-150", exist_ok=True)
        fs.makedirs(f"{job}/chk-{2**64}", exist_ok=True)
    fs.pipe(
        {
            f"{job}/chk-150/_metadata": encode_metadata(CheckpointMetadata(150))[:-3],
            f"{job}/chk-{2**64}/_metadata": encode_metadata(CheckpointMetadata(5)),
        }
    )
    fs.invalidate_cache()

    latest = access.latest_completed_checkpoint()
    store = FileSystemCompletedCheckpointStore(access, max_retained=5)

    assert latest.external_pointer.endswith("/chk-100")
    assert [7, 99, 100] == [c.checkpoint_id for c in store.all()]
    assert 201 == access.next_checkpoint_id()


def test_a_job_without_checkpoints_has_none(backend):
    """An empty or missing job directory: latest is None, next id is 1."""
    access = _job(backend)

    assert (None, 1) == (access.latest_completed_checkpoint(), access.next_checkpoint_id())
