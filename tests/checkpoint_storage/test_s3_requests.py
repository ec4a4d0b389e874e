"""S3 request counts of the checkpoint path, measured on moto's server log (docs/design.md §3.3).

The coordinator creates the directories once; everything after that is counted: the worker
path (resolve a location reference, write state streams) must issue no HEAD/GET/LIST, a file
state below the s3fs block size is one PUT, an inline state is no request at all, and
`_metadata` is published with exactly one conditional PUT (``If-None-Match: *``). Aborted
streams leave neither an object nor an open multipart upload behind.
"""

from collections import Counter

import boto3
import pytest

from checkpoint_storage import (
    ByteStreamStateHandle,
    CheckpointedStateScope,
    CheckpointMetadata,
    FileSystemCheckpointStorage,
    JobID,
    OperatorState,
    OperatorSubtaskState,
    RelativeFileStateHandle,
    store_checkpoint_metadata,
)

KIB = 1024
MIB = 1024 * KIB
THRESHOLD = 20 * KIB  # default file_state_size_threshold
S3_MIN_BLOCK_SIZE = 5 * MIB  # s3fs refuses smaller write blocks; every state below it is one PUT
CHUNK = 64 * KIB
CHECKPOINT_ID = 7

# Above the inline threshold, below any s3fs block size: one object, one PUT each.
FILE_STATE_SIZES = (THRESHOLD + 1, 64 * KIB, 300 * KIB + 3, MIB, S3_MIN_BLOCK_SIZE - 1)
# At most the threshold: inline ByteStreamStateHandles, no object at all.
INLINE_STATE_SIZES = (1, 1000, THRESHOLD - 1, THRESHOLD)


def _payload(size: int, seed: int) -> bytes:
    pattern = bytes((seed * 31 + i) % 251 for i in range(4099))
    return (pattern * (size // len(pattern) + 1))[:size]


def _write(stream, data: bytes) -> None:
    view = memoryview(data)
    for start in range(0, len(data), CHUNK):
        stream.write(view[start : start + CHUNK].tobytes())


def _counts(s3_server, bucket: str) -> Counter:
    """Requests against ``bucket`` since the last ``clear_log()``, by kind."""
    mine = [r for r in list(s3_server.requests) if f"{r.path}/".startswith(f"/{bucket}/")]
    return Counter(r.kind for r in mine)


def _keys(s3_server, bucket: str) -> set[str]:
    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {obj["Key"] for page in pages for obj in page.get("Contents", ())}


def _open_uploads(s3_server, bucket: str) -> list[str]:
    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    return [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", ())]


def _prepare(s3_server, bucket: str):
    """Coordinator work done, log cleared; returns (storage, job id, location, worker factory)."""
    storage = FileSystemCheckpointStorage(
        f"s3://{bucket}/cp", storage_options=s3_server.storage_options
    )
    job_id = JobID.generate()
    coordinator = storage.create_checkpoint_storage(job_id)
    coordinator.initialize_base_locations()
    location = coordinator.initialize_location_for_checkpoint(CHECKPOINT_ID)
    s3_server.clear_log()
    worker = storage.create_checkpoint_storage(job_id).resolve_checkpoint_storage_location(
        CHECKPOINT_ID, location.location_reference
    )
    return storage, job_id, location, worker


def _metadata(job_id, handles) -> CheckpointMetadata:
    subtasks = {i: OperatorSubtaskState(handles=(h,)) for i, h in enumerate(handles)}
    operator = OperatorState("0" * 32, len(handles), subtask_states=subtasks)
    return CheckpointMetadata(
        CHECKPOINT_ID,
        operator_states=(operator,),
        master_states={"source-position": b"42"},
        job_id=job_id,
    )


@pytest.mark.timeout(60)
def test_worker_file_states_cost_one_put_each_and_no_head_get_list(s3_server, s3_bucket):
    """N exclusive states above the inline threshold and below the block size cost N PUTs."""
    _, _, _, worker = _prepare(s3_server, s3_bucket)

    handles = []
    for seed, size in enumerate(FILE_STATE_SIZES):
        stream = worker.create_checkpoint_state_output_stream(CheckpointedStateScope.EXCLUSIVE)
        _write(stream, _payload(size, seed))
        handles.append(stream.close_and_get_handle())

    assert [RelativeFileStateHandle] * len(FILE_STATE_SIZES) == [type(h) for h in handles]
    assert list(FILE_STATE_SIZES) == [h.state_size for h in handles]
    assert Counter({"PUT": len(FILE_STATE_SIZES)}) == _counts(s3_server, s3_bucket)


@pytest.mark.timeout(60)
def test_inline_states_cost_no_request(s3_server, s3_bucket):
    """States of at most the threshold bytes (and empty streams) issue no S3 request at all."""
    _, _, _, worker = _prepare(s3_server, s3_bucket)

    handles = []
    for seed, size in enumerate(INLINE_STATE_SIZES):
        stream = worker.create_checkpoint_state_output_stream(CheckpointedStateScope.EXCLUSIVE)
        data = _payload(size, seed)
        stream.write(data[:1])
        stream.flush()
        stream.write(data[1:])
        stream.flush()
        handles.append(stream.close_and_get_handle())
    empty = worker.create_checkpoint_state_output_stream(CheckpointedStateScope.EXCLUSIVE)

    assert empty.close_and_get_handle() is None
    assert [ByteStreamStateHandle] * len(INLINE_STATE_SIZES) == [type(h) for h in handles]
    assert list(INLINE_STATE_SIZES) == [h.state_size for h in handles]
    assert Counter() == _counts(s3_server, s3_bucket)


@pytest.mark.timeout(60)
def test_finalize_costs_exactly_one_conditional_put(s3_server, s3_bucket):
    """Storing `_metadata` and finalizing is one PUT, and that PUT carries If-None-Match: *."""
    _, job_id, location, worker = _prepare(s3_server, s3_bucket)
    handles = []
    for seed, size in enumerate((THRESHOLD + 1, 100, 64 * KIB)):
        stream = worker.create_checkpoint_state_output_stream(CheckpointedStateScope.EXCLUSIVE)
        _write(stream, _payload(size, seed))
        handles.append(stream.close_and_get_handle())
    s3_server.clear_log()

    out = location.create_metadata_output_stream()
    store_checkpoint_metadata(_metadata(job_id, handles), out)
    out.close_and_finalize_checkpoint()

    assert Counter({"PUT": 1}) == _counts(s3_server, s3_bucket)
    put = next(r for r in s3_server.requests if r.kind == "PUT")
    assert (True, f"/{s3_bucket}/cp/{job_id}/chk-{CHECKPOINT_ID}/_metadata") == (
        put.conditional_create,
        put.path,
    )


@pytest.mark.timeout(60)
def test_checkpoint_of_n_file_states_costs_n_puts_plus_one_conditional_put(s3_server, s3_bucket):
    """A whole checkpoint after the coordinator's setup is N plain PUTs and 1 conditional PUT."""
    _, job_id, location, worker = _prepare(s3_server, s3_bucket)

    handles = []
    for seed, size in enumerate(FILE_STATE_SIZES + INLINE_STATE_SIZES):
        stream = worker.create_checkpoint_state_output_stream(CheckpointedStateScope.EXCLUSIVE)
        _write(stream, _payload(size, seed))
        handles.append(stream.close_and_get_handle())
    out = location.create_metadata_output_stream()
    store_checkpoint_metadata(_metadata(job_id, handles), out)
    out.close_and_finalize_checkpoint()

    puts = [r for r in s3_server.requests if r.kind == "PUT"]
    assert Counter({"PUT": len(FILE_STATE_SIZES) + 1}) == _counts(s3_server, s3_bucket)
    assert [False] * len(FILE_STATE_SIZES) + [True] == [r.conditional_create for r in puts]


@pytest.mark.timeout(60)
def test_aborted_stream_above_block_size_leaves_no_object_and_no_multipart_upload(
    s3_server, s3_bucket
):
    """close() after a multipart upload started aborts it and leaves no object behind."""
    _, _, _, worker = _prepare(s3_server, s3_bucket)
    keys_before = _keys(s3_server, s3_bucket)
    s3_server.clear_log()

    stream = worker.create_checkpoint_state_output_stream(CheckpointedStateScope.EXCLUSIVE)
    chunk = _payload(CHUNK, 1)
    written = 0
    # Write until s3fs has started a multipart upload (it does once a full block is buffered):
    # at least the 5 MiB minimum block, at most a little above s3fs's 50 MiB default.
    while written <= S3_MIN_BLOCK_SIZE or (
        s3_server.count("POST", s3_bucket) == 0 and written <= 56 * MIB
    ):
        stream.write(chunk)
        written += len(chunk)
    started = s3_server.count("POST", s3_bucket)
    stream.close()

    assert (1, True) == (started, written > S3_MIN_BLOCK_SIZE)
    assert [] == _open_uploads(s3_server, s3_bucket)
    assert keys_before == _keys(s3_server, s3_bucket)


@pytest.mark.timeout(60)
def test_aborted_stream_below_block_size_issues_no_put(s3_server, s3_bucket):
    """close() of a file-sized stream below the block size uploads nothing (a DELETE is allowed)."""
    _, _, _, worker = _prepare(s3_server, s3_bucket)
    keys_before = _keys(s3_server, s3_bucket)
    s3_server.clear_log()

    stream = worker.create_checkpoint_state_output_stream(CheckpointedStateScope.EXCLUSIVE)
    _write(stream, _payload(MIB, 2))
    stream.flush()
    stream.close()

    counts = _counts(s3_server, s3_bucket)
    assert (0, 0) == (counts["PUT"], counts["POST"])
    assert [] == _open_uploads(s3_server, s3_bucket)
    assert keys_before == _keys(s3_server, s3_bucket)
