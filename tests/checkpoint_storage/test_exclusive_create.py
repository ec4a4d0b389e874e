"""Honest commits on any endpoint (issue 13): a filesystem whose put-if-absent is not
exclusive (an S3-compatible server that ignores If-None-Match) is refused at
``initialize_base_locations()``, before any checkpoint is written."""

import uuid

import boto3
import fsspec
import pytest
from fsspec.implementations.dirfs import DirFileSystem

from checkpoint_storage import (
    CheckpointAlreadyExistsError,
    CheckpointMetadata,
    FileSystemCheckpointStorage,
    JobID,
    UnsupportedFileSystemError,
    store_checkpoint_metadata,
)
from tests.reliability.proxy import IGNORES_CONDITIONAL_WRITES, FaultProxy

pytestmark = pytest.mark.timeout(60)


def _keys(s3_server, bucket: str) -> set[str]:
    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {obj["Key"] for page in pages for obj in page.get("Contents", ())}


def _access(endpoint_url: str, bucket: str, job_id: JobID):
    storage = FileSystemCheckpointStorage(
        f"s3://{bucket}/cp", storage_options={"endpoint_url": endpoint_url}
    )
    return storage.create_checkpoint_storage(job_id)


def _finalize(location, checkpoint_id: int, master: bytes):
    out = location.create_metadata_output_stream()
    store_checkpoint_metadata(CheckpointMetadata(checkpoint_id, master_states={"w": master}), out)
    return out.close_and_finalize_checkpoint()


@pytest.fixture
def ignoring_endpoint(s3_server):
    """moto behind a proxy that drops If-None-Match: a server ignoring conditional writes."""
    with FaultProxy(s3_server.endpoint_url, drop_headers=IGNORES_CONDITIONAL_WRITES) as proxy:
        yield proxy


def test_the_proxy_really_ignores_conditional_writes(ignoring_endpoint, s3_server):
    """Through the proxy a second If-None-Match PUT of one key succeeds (the harness works)."""
    bucket = s3_server.new_bucket()
    fs = fsspec.filesystem(
        "s3", endpoint_url=ignoring_endpoint.endpoint_url, skip_instance_cache=True
    )
    fs.pipe_file(f"{bucket}/k", b"first", mode="create")
    fs.pipe_file(f"{bucket}/k", b"second", mode="create")

    assert b"second" == fs.cat_file(f"{bucket}/k")


def test_an_endpoint_ignoring_if_none_match_is_refused_at_setup(ignoring_endpoint, s3_server):
    """initialize_base_locations() raises UnsupportedFileSystemError naming the endpoint and
    the bucket; the probe object is removed."""
    bucket = s3_server.new_bucket()
    access = _access(ignoring_endpoint.endpoint_url, bucket, JobID.generate())

    with pytest.raises(UnsupportedFileSystemError) as raised:
        access.initialize_base_locations()

    message = str(raised.value)
    assert (True, True, True) == (
        ignoring_endpoint.endpoint_url in message,
        f"s3://{bucket}" in message,
        "If-None-Match" in message,
    )
    assert set() == _keys(s3_server, bucket)


def test_a_second_coordinator_cannot_overwrite_a_completed_checkpoint(ignoring_endpoint, s3_server):
    """The issue's case: behind an endpoint ignoring If-None-Match, a second, independent
    coordinator of checkpoint 42 is refused before it writes; the first writer's `_metadata`
    stays as it was."""
    bucket = s3_server.new_bucket()
    job_id = JobID.generate()
    first = _access(s3_server.endpoint_url, bucket, job_id)  # honest endpoint
    first.initialize_base_locations()
    completed = _finalize(first.initialize_location_for_checkpoint(42), 42, b"first")
    second = _access(ignoring_endpoint.endpoint_url, bucket, job_id)

    with pytest.raises(UnsupportedFileSystemError):
        second.initialize_base_locations()
    with pytest.raises(UnsupportedFileSystemError):
        _finalize(second.initialize_location_for_checkpoint(42), 42, b"second")

    assert {"w": b"first"} == completed.load_metadata().master_states


def test_the_verdict_is_asked_once_per_endpoint_and_process(s3_server):
    """On an honest endpoint the probe costs two conditional PUTs, the read-back of the
    refused one and a DELETE, once; a second job in the same bucket, and every checkpoint
    after setup, cost no probe."""
    bucket = s3_server.new_bucket()
    s3_server.clear_log()
    _access(s3_server.endpoint_url, bucket, JobID.generate()).initialize_base_locations()
    probes = [r for r in s3_server.requests if ".put-if-absent-probe-" in r.path]
    s3_server.clear_log()
    other = _access(s3_server.endpoint_url, bucket, JobID.generate())
    other.initialize_base_locations()
    _finalize(other.initialize_location_for_checkpoint(1), 1, b"x")

    assert ["PUT", "PUT", "HEAD", "GET", "DELETE"] == [r.method for r in probes]
    assert [True, True] == [r.conditional_create for r in probes[:2]]
    assert [] == [r for r in s3_server.requests if ".put-if-absent-probe-" in r.path]
    assert set() == {k for k in _keys(s3_server, bucket) if ".put-if-absent-probe-" in k}


class _NonExclusiveFileSystem(DirFileSystem):
    """An fsspec filesystem whose exclusive create ('xb') silently overwrites."""

    protocol = "nonexclusive"

    def __init__(self, **kwargs) -> None:
        super().__init__(path="/nonexclusive", fs=fsspec.filesystem("memory"), **kwargs)

    def open(self, path, mode="rb", **kwargs):
        return super().open(path, mode.replace("x", "w"), **kwargs)


def test_any_filesystem_whose_exclusive_create_is_not_exclusive_is_refused():
    """The same check for any fsspec filesystem: 'xb' that overwrites is refused."""
    fsspec.register_implementation("nonexclusive", _NonExclusiveFileSystem, clobber=True)
    storage = FileSystemCheckpointStorage(f"nonexclusive://cp-{uuid.uuid4().hex}")
    access = storage.create_checkpoint_storage(JobID.generate())

    with pytest.raises(UnsupportedFileSystemError, match="nonexclusive://"):
        access.initialize_base_locations()


def test_an_honest_endpoint_still_refuses_a_second_commit(s3_server):
    """With the verdict cached, a duplicate `_metadata` is still refused by the conditional
    PUT itself."""
    bucket = s3_server.new_bucket()
    job_id = JobID.generate()
    first = _access(s3_server.endpoint_url, bucket, job_id)
    first.initialize_base_locations()
    _finalize(first.initialize_location_for_checkpoint(7), 7, b"first")
    second = _access(s3_server.endpoint_url, bucket, job_id)
    second.initialize_base_locations()

    with pytest.raises(CheckpointAlreadyExistsError):
        _finalize(second.initialize_location_for_checkpoint(7), 7, b"second")
