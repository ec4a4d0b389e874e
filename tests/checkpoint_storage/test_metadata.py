"""`_metadata`: exact round trip, fail-closed loading of corrupt or foreign files, state file
integrity, path containment of handles read from storage, relocatable savepoints, and the
documented format."""

import io
import json
import pickle
import random
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoint_storage import (
    ByteStreamStateHandle,
    CheckpointedStateScope,
    CheckpointMetadata,
    CheckpointProperties,
    FileStateHandle,
    FileSystemCheckpointStorage,
    JobID,
    OperatorState,
    OperatorSubtaskState,
    RelativeFileStateHandle,
    SavepointFormatType,
    load_checkpoint_metadata,
    store_checkpoint_metadata,
)
from checkpoint_storage.exceptions import (
    InvalidCheckpointError,
    StateIntegrityError,
    UnsafePathError,
)

ROOT = Path(__file__).resolve().parents[2]
EXCLUSIVE = CheckpointedStateScope.EXCLUSIVE
SHARED = CheckpointedStateScope.SHARED
NOT_VALID = re.compile(r"not a valid|not a complete|valid or complete", re.IGNORECASE)

HYPOTHESIS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --- helpers -------------------------------------------------------------------------------


@dataclass
class Job:
    storage: FileSystemCheckpointStorage
    access: object
    storage_options: dict

    @property
    def job_dir(self) -> str:
        return self.access.checkpoints_directory.rstrip("/")

    def chk_dir(self, checkpoint_id: int) -> str:
        return f"{self.job_dir}/chk-{checkpoint_id}"

    @property
    def shared_dir(self) -> str:
        return self.access.shared_state_directory.rstrip("/")

    @property
    def taskowned_dir(self) -> str:
        return self.access.task_owned_state_directory.rstrip("/")

    def fs(self, url: str):
        fs, path = fsspec.core.url_to_fs(url, **self.storage_options)
        fs.invalidate_cache()
        return fs, path

    def read(self, url: str) -> bytes:
        fs, path = self.fs(url)
        return fs.cat_file(path)

    def write(self, url: str, data: bytes) -> None:
        fs, path = self.fs(url)
        fs.pipe_file(path, data)
        fs.invalidate_cache()

    def complete(self, metadata: CheckpointMetadata, checkpoint_id: int, location=None):
        """Write `_metadata` through the library and finalize: the coordinator's last step."""
        if location is None:
            location = self.access.initialize_location_for_checkpoint(checkpoint_id)
        out = location.create_metadata_output_stream()
        store_checkpoint_metadata(metadata, out)
        return out.close_and_finalize_checkpoint()

    def load(self, pointer: str) -> CheckpointMetadata:
        """Restore as a new process would: resolve the pointer, then read `_metadata`."""
        return load_checkpoint_metadata(self.access.resolve_checkpoint(pointer))


def make_job(base_url: str, storage_options: dict | None = None, **options) -> Job:
    storage_options = dict(storage_options or {})
    storage = FileSystemCheckpointStorage(
        f"{base_url}/checkpoints",
        f"{base_url}/savepoints",
        storage_options=storage_options,
        **options,
    )
    access = storage.create_checkpoint_storage(JobID.generate())
    access.initialize_base_locations()
    return Job(storage, access, storage_options)


def backend_job(backend, **options) -> Job:
    return make_job(backend.base_url, backend.storage_options, **options)


def memory_job(**options) -> Job:
    return make_job(f"memory://metadata-{uuid.uuid4().hex}", **options)


def write_state(factory, data: bytes, scope=EXCLUSIVE):
    stream = factory.create_checkpoint_state_output_stream(scope)
    stream.write(data)
    return stream.close_and_get_handle()


def read_all(handle) -> bytes:
    with handle.open() as f:
        return f.read()


def handle_details(handle):
    """What must survive a round trip beyond a handle's identity."""
    details = (type(handle).__name__, handle.state_size)
    if isinstance(handle, ByteStreamStateHandle):
        return (*details, handle.handle_name, handle.data)
    if isinstance(handle, RelativeFileStateHandle):
        return (*details, handle.path, handle.relative_path, handle.checksum)
    return (*details, handle.path, handle.checksum)


def all_handle_details(metadata: CheckpointMetadata):
    return [
        (op.operator_id, index, [handle_details(h) for h in sub.handles])
        for op in metadata.operator_states
        for index, sub in op.subtask_states.items()
    ]


def real_checkpoint(job: Job, checkpoint_id: int = 1):
    """A checkpoint of real state: inline, relative (exclusive) and absolute (shared) handles."""
    location = job.access.initialize_location_for_checkpoint(checkpoint_id)
    rng = random.Random(checkpoint_id)
    payloads = [rng.randbytes(n) for n in (10, 30_000, 25_000, 5)]
    handles = [
        write_state(location, payloads[0]),
        write_state(location, payloads[1]),
        write_state(location, payloads[2], SHARED),
        write_state(location, payloads[3], SHARED),
    ]
    metadata = CheckpointMetadata(
        checkpoint_id,
        operator_states=(
            OperatorState(
                "dedup",
                2,
                128,
                {
                    0: OperatorSubtaskState(tuple(handles[:2]), {"partition": "0"}),
                    1: OperatorSubtaskState(tuple(handles[2:]), {"partition": "1"}),
                },
            ),
            OperatorState("aggregate", 1),
        ),
        master_states={"source-position": b"2024-01-01T00:00:00Z", "empty": b""},
        properties=CheckpointProperties.for_checkpoint(),
        job_id=job.access.job_id,
        timestamp_ms=1_700_000_000_123,
    )
    completed = job.complete(metadata, checkpoint_id, location)
    return metadata, completed, payloads


# --- strategies ----------------------------------------------------------------------------

texts = st.text(max_size=20)
file_names = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=24
).filter(lambda s: s not in (".", ".."))
sizes = st.integers(0, 2**63 - 1)
checksums = st.none() | st.integers(0, 2**32 - 1)
properties = st.sampled_from(
    [
        CheckpointProperties.for_checkpoint(),
        CheckpointProperties.for_full_checkpoint(),
        CheckpointProperties.for_savepoint(),
        CheckpointProperties.for_savepoint(SavepointFormatType.NATIVE),
    ]
)


def handles(chk_dir: str, shared_dir: str, taskowned_dir: str):
    byte_handles = st.builds(ByteStreamStateHandle, texts, st.binary(max_size=200))
    relative = st.builds(
        lambda name, size, crc: RelativeFileStateHandle(f"{chk_dir}/{name}", name, size, crc),
        file_names,
        sizes,
        checksums,
    )
    absolute = st.builds(
        lambda d, name, size, crc: FileStateHandle(f"{d}/{name}", size, crc),
        st.sampled_from([chk_dir, shared_dir, taskowned_dir]),
        file_names,
        sizes,
        checksums,
    )
    return byte_handles | relative | absolute


@st.composite
def operator_states(draw, handle_strategy):
    parallelism = draw(st.integers(1, 6) | st.integers(1, 2**31 - 1))
    max_parallelism = draw(st.none() | st.integers(parallelism, 2**31 - 1))
    indexes = draw(st.sets(st.integers(0, min(parallelism, 6) - 1), max_size=4))
    subtasks = {
        i: OperatorSubtaskState(
            tuple(draw(st.lists(handle_strategy, max_size=4))),
            draw(st.dictionaries(texts, texts, max_size=3)),
        )
        for i in indexes
    }
    return lambda operator_id: OperatorState(operator_id, parallelism, max_parallelism, subtasks)


@st.composite
def checkpoint_metadata(draw, job: Job, checkpoint_id: int | None = None):
    handle_strategy = handles(job.chk_dir(checkpoint_id or 0), job.shared_dir, job.taskowned_dir)
    ids = draw(st.lists(st.text(min_size=1, max_size=20), unique=True, max_size=4))
    ops = tuple(draw(operator_states(handle_strategy))(i) for i in ids)
    return CheckpointMetadata(
        checkpoint_id if checkpoint_id is not None else draw(st.integers(0, 2**63 - 1)),
        operator_states=ops,
        master_states=draw(st.dictionaries(texts, st.binary(max_size=100), max_size=4)),
        properties=draw(properties),
        job_id=draw(st.none() | st.builds(JobID.generate)),
        timestamp_ms=draw(st.none() | st.integers(-(2**63), 2**63 - 1)),
        lease_epoch=draw(st.none() | st.integers(1, 2**63 - 1)),
    )


_ids = iter(range(1, 10**9))


# --- round trip ----------------------------------------------------------------------------


@HYPOTHESIS
@given(data=st.data())
def test_metadata_round_trips_through_a_real_metadata_file(data):
    """Any metadata written to `_metadata`, finalized and loaded back compares equal,
    including the bytes of inline handles and the sizes and checksums of file handles."""
    job = _shared_memory_job()
    checkpoint_id = next(_ids)
    metadata = data.draw(checkpoint_metadata(job, checkpoint_id))

    completed = job.complete(metadata, checkpoint_id)
    loaded = job.load(completed.external_pointer)

    assert metadata == loaded
    assert all_handle_details(metadata) == all_handle_details(loaded)
    assert metadata == load_checkpoint_metadata(completed)


@HYPOTHESIS
@given(data=st.data())
def test_any_checkpoint_id_and_header_fields_round_trip(data):
    """Checkpoint ids over the whole range, job ids, timestamps and properties round trip
    independently of the location's own checkpoint id."""
    job = _shared_memory_job()
    metadata = data.draw(checkpoint_metadata(job))
    location_id = next(_ids)
    # handles point into chk-0, so keep them out: this test is about the header fields
    metadata = CheckpointMetadata(
        metadata.checkpoint_id,
        master_states=metadata.master_states,
        properties=metadata.properties,
        job_id=metadata.job_id,
        timestamp_ms=metadata.timestamp_ms,
    )

    completed = job.complete(metadata, location_id)
    loaded = job.load(completed.external_pointer)

    assert metadata == loaded
    assert (metadata.checkpoint_id, metadata.job_id, metadata.timestamp_ms) == (
        loaded.checkpoint_id,
        loaded.job_id,
        loaded.timestamp_ms,
    )
    assert metadata.properties == loaded.properties


@pytest.mark.timeout(60)
def test_real_checkpoint_round_trips_and_reads_back_state(backend):
    """A checkpoint of real streamed state round trips on every backend and each loaded
    handle reads back the bytes that were written."""
    job = backend_job(backend, file_state_size_threshold=1024)
    metadata, completed, payloads = real_checkpoint(job)

    loaded = job.load(completed.external_pointer)

    assert metadata == loaded
    assert all_handle_details(metadata) == all_handle_details(loaded)
    assert payloads == [
        read_all(h) for h in loaded.operator_states[0].subtask_states[0].handles
    ] + [read_all(h) for h in loaded.operator_states[0].subtask_states[1].handles]
    kinds = [type(h).__name__ for h in loaded.operator_states[0].subtask_states[0].handles] + [
        type(h).__name__ for h in loaded.operator_states[0].subtask_states[1].handles
    ]
    assert ["ByteStreamStateHandle", "RelativeFileStateHandle", "FileStateHandle"] == kinds[:3]


def test_empty_metadata_round_trips():
    """Metadata without any state or master state round trips."""
    job = memory_job()
    metadata = CheckpointMetadata(3)

    completed = job.complete(metadata, 3)

    assert metadata == job.load(completed.external_pointer)


def test_job_id_may_be_given_as_hex_string():
    """Metadata built with a job id hex string loads back with the equal JobID."""
    job = memory_job()
    hex_id = "00112233445566778899aabbccddeeff"
    metadata = CheckpointMetadata(2, job_id=hex_id)

    loaded = job.load(job.complete(metadata, 2).external_pointer)

    assert JobID.from_hex(hex_id) == loaded.job_id
    assert hex_id == str(loaded.job_id)


def test_large_inline_state_round_trips():
    """Inline handles of 1 MiB and master states of 1 MiB round trip byte for byte."""
    job = memory_job()
    big = random.Random(7).randbytes(1024 * 1024)
    metadata = CheckpointMetadata(
        1,
        operator_states=(
            OperatorState(
                "op", 1, None, {0: OperatorSubtaskState((ByteStreamStateHandle("h", big),))}
            ),
        ),
        master_states={"m": big[::-1]},
    )

    loaded = job.load(job.complete(metadata, 1).external_pointer)

    assert big == loaded.operator_states[0].subtask_states[0].handles[0].data
    assert big[::-1] == loaded.master_states["m"]


# --- corrupt and foreign files -------------------------------------------------------------


def _outcome(job: Job, pointer: str):
    """'invalid' when loading raised InvalidCheckpointError with the expected message, else
    what happened instead (a returned value or another exception)."""
    try:
        loaded = job.load(pointer)
    except InvalidCheckpointError as exc:
        return "invalid" if NOT_VALID.search(str(exc)) else f"message: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported as the failure
        return f"{type(exc).__name__}: {exc}"
    return f"returned {loaded!r}"


def test_every_truncation_is_rejected():
    """`_metadata` cut at any length (0 .. n-1 bytes) raises InvalidCheckpointError saying it
    is not a valid or complete checkpoint."""
    job = memory_job(file_state_size_threshold=1024)
    _, completed, _ = real_checkpoint(job)
    pointer = completed.external_pointer
    original = job.read(pointer + "/_metadata")

    outcomes = {}
    for length in range(len(original)):
        job.write(pointer + "/_metadata", original[:length])
        outcomes[length] = _outcome(job, pointer)

    assert {n: "invalid" for n in range(len(original))} == outcomes


def test_every_single_bit_flip_is_rejected():
    """Flipping any one bit of `_metadata` raises InvalidCheckpointError: never wrong data,
    never another exception."""
    job = memory_job(file_state_size_threshold=1024)
    _, completed, _ = real_checkpoint(job)
    pointer = completed.external_pointer
    original = job.read(pointer + "/_metadata")

    failures = []
    for byte in range(len(original)):
        for bit in range(8):
            corrupt = bytearray(original)
            corrupt[byte] ^= 1 << bit
            job.write(pointer + "/_metadata", bytes(corrupt))
            outcome = _outcome(job, pointer)
            if outcome != "invalid":
                failures.append((byte, bit, outcome))

    assert [] == failures


def test_intact_file_still_loads_after_corruption_is_repaired():
    """The corruption checks are not over-eager: writing the original bytes back loads."""
    job = memory_job(file_state_size_threshold=1024)
    metadata, completed, _ = real_checkpoint(job)
    pointer = completed.external_pointer
    original = job.read(pointer + "/_metadata")

    job.write(pointer + "/_metadata", original[:-1])
    broken = _outcome(job, pointer)
    job.write(pointer + "/_metadata", original)

    assert "invalid" == broken
    assert metadata == job.load(pointer)


@pytest.mark.parametrize("extra", [b"\x00", b"garbage", b"\x89CKPT"])
def test_appended_bytes_are_rejected(extra):
    """A `_metadata` with bytes after the documented body is rejected, not half-read."""
    job = memory_job()
    _, completed, _ = real_checkpoint(job)
    pointer = completed.external_pointer
    original = job.read(pointer + "/_metadata")

    job.write(pointer + "/_metadata", original + extra)

    assert "invalid" == _outcome(job, pointer)


def _parquet_bytes() -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table({"key": ["a", "b"], "count": [1, 2]}), sink)
    return sink.getvalue()


FOREIGN = {
    "empty": b"",
    "json": json.dumps({"checkpoint_id": 1, "operator_states": []}).encode(),
    "parquet": _parquet_bytes(),
    "pickle": pickle.dumps({"checkpoint_id": 1}),
    "text": b"hello world\n",
    "random": random.Random(3).randbytes(4096),
    "flink-metadata-magic": bytes.fromhex("4960672d") + bytes(64),
    "zeros": bytes(1024),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_foreign_files_are_rejected(backend, kind):
    """A `_metadata` that is empty, JSON, Parquet, pickle or random bytes raises
    InvalidCheckpointError ('not a valid or complete checkpoint')."""
    job = backend_job(backend)
    job.access.initialize_location_for_checkpoint(5)
    pointer = job.chk_dir(5)
    job.write(pointer + "/_metadata", FOREIGN[kind])

    with pytest.raises(InvalidCheckpointError) as info:
        job.load(pointer)

    assert NOT_VALID.search(str(info.value))


def test_pickle_in_metadata_is_never_unpickled(tmp_path):
    """A pickle payload in `_metadata` is rejected without being executed."""
    job = make_job(str(tmp_path / "base"))
    job.access.initialize_location_for_checkpoint(1)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    job.write(job.chk_dir(1) + "/_metadata", pickle.dumps(Payload()))

    with pytest.raises(InvalidCheckpointError):
        job.load(job.chk_dir(1))
    assert not marker.exists()


@HYPOTHESIS
@given(data=st.data())
def test_random_corruption_of_random_metadata_is_rejected(data):
    """For any metadata, truncating `_metadata` or flipping one bit raises
    InvalidCheckpointError."""
    job = _shared_memory_job()
    checkpoint_id = next(_ids)
    metadata = data.draw(checkpoint_metadata(job, checkpoint_id))
    pointer = job.complete(metadata, checkpoint_id).external_pointer
    original = job.read(pointer + "/_metadata")
    if data.draw(st.booleans()):
        corrupt = original[: data.draw(st.integers(0, len(original) - 1))]
    else:
        position = data.draw(st.integers(0, len(original) * 8 - 1))
        flipped = bytearray(original)
        flipped[position // 8] ^= 1 << (position % 8)
        corrupt = bytes(flipped)

    job.write(pointer + "/_metadata", corrupt)

    assert "invalid" == _outcome(job, pointer)


@pytest.mark.timeout(60)
def test_latest_completed_checkpoint_skips_invalid_metadata(backend):
    """latest_completed_checkpoint() passes over chk dirs whose `_metadata` is truncated,
    bit-flipped, foreign or empty, and returns the newest valid one."""
    job = backend_job(backend)
    _, first, _ = real_checkpoint(job, 1)
    _, second, _ = real_checkpoint(job, 2)
    good = job.read(second.external_pointer + "/_metadata")
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x10
    for checkpoint_id, content in (
        (3, good[:-5]),
        (4, bytes(flipped)),
        (10, FOREIGN["json"]),
        (11, b""),
        (12, FOREIGN["parquet"]),
    ):
        job.access.initialize_location_for_checkpoint(checkpoint_id)
        job.write(job.chk_dir(checkpoint_id) + "/_metadata", content)

    latest = job.access.latest_completed_checkpoint()

    assert second.external_pointer == latest.external_pointer
    assert 2 == load_checkpoint_metadata(latest).checkpoint_id


@pytest.mark.timeout(60)
def test_latest_completed_checkpoint_is_none_when_all_are_invalid(backend):
    """With only invalid `_metadata` files, there is no completed checkpoint."""
    job = backend_job(backend)
    job.access.initialize_location_for_checkpoint(1)
    job.write(job.chk_dir(1) + "/_metadata", FOREIGN["random"])

    assert None is job.access.latest_completed_checkpoint()


# --- state file integrity ------------------------------------------------------------------


def _corruptions(data: bytes):
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    last_flipped = bytearray(data)
    last_flipped[-1] ^= 0x80
    return {
        "truncated": data[:-1],
        "half": data[: len(data) // 2],
        "empty": b"",
        "bit-flip": bytes(flipped),
        "last-bit-flip": bytes(last_flipped),
        "appended": data + b"\x00",
        "replaced": random.Random(9).randbytes(len(data)),
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(_corruptions(b"0123456789")))
@pytest.mark.parametrize("scope", [EXCLUSIVE, SHARED])
def test_corrupt_state_file_fails_when_read_through_its_handle(backend, kind, scope):
    """A state file truncated, bit-flipped, extended or replaced after the checkpoint
    completed raises StateIntegrityError when read through its loaded handle."""
    job = backend_job(backend, file_state_size_threshold=100)
    location = job.access.initialize_location_for_checkpoint(1)
    data = random.Random(1).randbytes(5000)
    handle = write_state(location, data, scope)
    metadata = CheckpointMetadata(
        1, operator_states=(OperatorState("op", 1, None, {0: OperatorSubtaskState((handle,))}),)
    )
    pointer = job.complete(metadata, 1, location).external_pointer
    job.write(handle.path, _corruptions(data)[kind])

    loaded = job.load(pointer).operator_states[0].subtask_states[0].handles[0]

    with pytest.raises(StateIntegrityError):
        read_all(loaded)
    with pytest.raises(StateIntegrityError):
        read_all(handle)


@pytest.mark.timeout(60)
def test_chunked_reads_of_a_corrupt_state_file_fail_before_the_end(backend):
    """Reading a bit-flipped state file in chunks raises StateIntegrityError by the time the
    last chunk would be returned."""
    job = backend_job(backend, file_state_size_threshold=100)
    location = job.access.initialize_location_for_checkpoint(1)
    data = random.Random(2).randbytes(10_000)
    handle = write_state(location, data)
    flipped = bytearray(data)
    flipped[9_999] ^= 0x04
    job.write(handle.path, bytes(flipped))

    received = bytearray()
    with pytest.raises(StateIntegrityError), handle.open() as f:
        while chunk := f.read(1000):
            received += chunk

    assert bytes(flipped) != bytes(received)


@pytest.mark.timeout(60)
def test_intact_state_file_reads_through_its_loaded_handle(backend):
    """Integrity checks pass for untouched files (control for the corruption tests)."""
    job = backend_job(backend, file_state_size_threshold=100)
    location = job.access.initialize_location_for_checkpoint(1)
    data = random.Random(1).randbytes(5000)
    handle = write_state(location, data)
    metadata = CheckpointMetadata(
        1, operator_states=(OperatorState("op", 1, None, {0: OperatorSubtaskState((handle,))}),)
    )
    pointer = job.complete(metadata, 1, location).external_pointer

    loaded = job.load(pointer).operator_states[0].subtask_states[0].handles[0]

    assert data == read_all(loaded)


# --- hostile paths -------------------------------------------------------------------------


def _metadata_with(handle, checkpoint_id: int) -> CheckpointMetadata:
    return CheckpointMetadata(
        checkpoint_id,
        operator_states=(
            OperatorState(
                "op",
                2,
                None,
                {
                    0: OperatorSubtaskState((ByteStreamStateHandle("ok", b"fine"),)),
                    1: OperatorSubtaskState((handle,)),
                },
            ),
        ),
    )


def hostile_absolute_paths(job: Job, checkpoint_id: int, base: str) -> list[str]:
    chk = job.chk_dir(checkpoint_id)
    return [
        f"{base}/elsewhere/state",
        f"{job.job_dir}/state",  # the job directory itself is no root
        f"{job.job_dir}-evil/shared/state",  # sibling prefix of the job directory
        f"{job.job_dir}evil/shared/state",
        f"{job.shared_dir}-evil/state",  # sibling prefix of shared/
        f"{chk}0/state",  # chk-10 next to chk-1
        f"{chk}/../../elsewhere/state",
        f"{chk}/../chk-{checkpoint_id}/state",
        f"{job.shared_dir}/../../../state",
        f"{job.shared_dir}/sub/../../../state",
        f"{chk}/./../state",
        "/etc/passwd",
        "/tmp/state",
        "file:///etc/passwd",
        "s3://another-bucket/checkpoints/state",
        "gs://bucket/state",
        "memory:///elsewhere/state",
        "http://127.0.0.1:1/state",
        "../state",
        "state",
        "",
    ]


HOSTILE_RELATIVE = [
    "..",
    "../state",
    "../../etc/passwd",
    "a/../../state",
    "a/b/../../../state",
    "/etc/passwd",
    "/state",
    "//state",
    "a//b",
    "a/",
    "",
    "s3://bucket/state",
    "file:///etc/passwd",
    "memory:///elsewhere/state",
]


def _assert_refused(job: Job, handle, checkpoint_id: int) -> None:
    completed = job.complete(_metadata_with(handle, checkpoint_id), checkpoint_id)

    with pytest.raises(UnsafePathError):
        job.load(completed.external_pointer)
    with pytest.raises(UnsafePathError):
        load_checkpoint_metadata(completed)


@pytest.mark.timeout(60)
def test_absolute_handles_outside_the_checkpoint_are_refused(backend, s3_server):
    """FileStateHandles outside chk-<id>/, shared/ and taskowned/ (elsewhere, `..`, sibling
    prefixes, other buckets and schemes) are stored by the trusted writer but refused on
    load with UnsafePathError."""
    job = backend_job(backend)
    base = job.job_dir.rsplit("/", 2)[0]
    paths = hostile_absolute_paths(job, 1, base)
    if backend.name == "s3":
        other = s3_server.new_bucket()
        paths.append(f"s3://{other}/checkpoints/{job.access.job_id}/shared/state")

    refused = []
    for n, path in enumerate(paths, start=1):
        completed = job.complete(_metadata_with(FileStateHandle(path, 10), n), n)
        try:
            load_checkpoint_metadata(job.access.resolve_checkpoint(completed.external_pointer))
        except UnsafePathError:
            refused.append(path)

    assert paths == refused


@pytest.mark.timeout(60)
def test_relative_handles_that_escape_are_refused(backend):
    """RelativeFileStateHandles with `..`, a leading `/`, empty segments or a scheme are
    refused on load with UnsafePathError."""
    job = backend_job(backend)

    refused = []
    for n, relative in enumerate(HOSTILE_RELATIVE, start=1):
        handle = RelativeFileStateHandle(f"{job.chk_dir(n)}/x", relative, 10)
        completed = job.complete(_metadata_with(handle, n), n)
        try:
            load_checkpoint_metadata(job.access.resolve_checkpoint(completed.external_pointer))
        except UnsafePathError:
            refused.append(relative)

    assert HOSTILE_RELATIVE == refused


def test_handles_inside_the_roots_are_accepted():
    """Control: absolute handles in chk-<id>/, shared/ and taskowned/ and plain relative
    names load fine."""
    job = memory_job()
    accepted = [
        FileStateHandle(f"{job.chk_dir(1)}/state", 1),
        FileStateHandle(f"{job.shared_dir}/state", 1),
        FileStateHandle(f"{job.taskowned_dir}/state", 1),
        FileStateHandle(f"{job.shared_dir}/sub/state", 1),
        RelativeFileStateHandle(f"{job.chk_dir(1)}/state", "state", 1),
        RelativeFileStateHandle(f"{job.chk_dir(1)}/..state", "..state", 1),
    ]
    metadata = CheckpointMetadata(
        1,
        operator_states=(OperatorState("op", 1, None, {0: OperatorSubtaskState(tuple(accepted))}),),
    )

    loaded = job.load(job.complete(metadata, 1).external_pointer)

    assert accepted == list(loaded.operator_states[0].subtask_states[0].handles)


def test_a_savepoint_may_not_reference_the_jobs_shared_directory():
    """A savepoint's only root is its own directory: a handle into the job's shared/ is
    refused."""
    job = memory_job()
    location = job.access.initialize_location_for_savepoint(1)
    handle = FileStateHandle(f"{job.shared_dir}/state", 10)
    completed = job.complete(_metadata_with(handle, 1), 1, location)

    with pytest.raises(UnsafePathError):
        load_checkpoint_metadata(job.storage.resolve_checkpoint(completed.external_pointer))


def _hostile_absolute(job: Job, checkpoint_id: int):
    chk = job.chk_dir(checkpoint_id)
    base = job.job_dir.rsplit("/", 2)[0]
    segment = st.text(alphabet="abcxyz0123456789-_", min_size=1, max_size=8)
    escapes = st.sampled_from(["..", "../..", "a/../..", "../../.."])
    roots = st.sampled_from([chk, job.shared_dir, job.taskowned_dir])
    return st.one_of(
        st.builds(lambda r, e, s: f"{r}/{e}/{s}", roots, escapes, segment),
        st.builds(lambda r, s, t: f"{r}{s}/{t}", roots, segment, segment),  # sibling prefix
        st.builds(lambda s, t: f"{job.job_dir}{s}/shared/{t}", segment, segment),
        st.builds(lambda s: f"{base}/{s}", segment),
        st.builds(
            lambda scheme, s: f"{scheme}://{s}/{s}",
            st.sampled_from(["s3", "gs", "file", "abfs", "http", "memory"]),
            segment,
        ),
        st.builds(lambda s: f"/{s}/{s}", segment),
    )


def _hostile_relative():
    segment = st.text(alphabet="abcxyz0123456789-_", min_size=1, max_size=8)
    return st.one_of(
        st.lists(segment | st.just(".."), min_size=1, max_size=5)
        .filter(lambda parts: ".." in parts)
        .map("/".join),
        st.lists(segment, min_size=1, max_size=3).map(lambda p: "/" + "/".join(p)),
        st.builds(lambda a, b: f"{a}//{b}", segment, segment),
        st.builds(lambda a: f"{a}/", segment),
        st.just(""),
    )


@HYPOTHESIS
@given(data=st.data())
def test_hostile_handle_paths_are_refused(data):
    """Any handle pointing outside the checkpoint's roots, hidden among valid metadata,
    makes loading fail with UnsafePathError."""
    job = _shared_memory_job()
    checkpoint_id = next(_ids)
    metadata = data.draw(checkpoint_metadata(job, checkpoint_id))
    if data.draw(st.booleans()):
        hostile = FileStateHandle(data.draw(_hostile_absolute(job, checkpoint_id)), 10)
    else:
        hostile = RelativeFileStateHandle(
            f"{job.chk_dir(checkpoint_id)}/x", data.draw(_hostile_relative()), 10
        )
    ops = [op for op in metadata.operator_states if op.operator_id != "hostile-op"] + [
        OperatorState(
            "hostile-op", 3, None, {data.draw(st.integers(0, 2)): OperatorSubtaskState((hostile,))}
        )
    ]
    data.draw(st.randoms()).shuffle(ops)
    metadata = CheckpointMetadata(
        metadata.checkpoint_id,
        tuple(ops),
        metadata.master_states,
        metadata.properties,
        metadata.job_id,
        metadata.timestamp_ms,
    )

    completed = job.complete(metadata, checkpoint_id)

    with pytest.raises(UnsafePathError):
        job.load(completed.external_pointer)


# --- relocatable savepoints ----------------------------------------------------------------


def _copy_tree(job: Job, source: str, target: str) -> None:
    fs, source_path = job.fs(source)
    _, target_path = job.fs(target)
    for path in fs.find(source_path):
        target_file = target_path + path[len(source_path) :]
        fs.makedirs(target_file.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(target_file, fs.cat_file(path))
    fs.rm(source_path, recursive=True)
    fs.invalidate_cache()


@pytest.mark.timeout(60)
def test_savepoint_moved_elsewhere_restores_from_its_new_place(backend):
    """A savepoint directory moved to another place loads, its relative handles resolve
    against the new directory, and every state reads back."""
    job = backend_job(backend, file_state_size_threshold=100)
    location = job.access.initialize_location_for_savepoint(9, backend.url("user-savepoints"))
    payloads = [random.Random(i).randbytes(n) for i, n in enumerate((50, 5000, 7000))]
    handles = tuple(write_state(location, p) for p in payloads)
    metadata = CheckpointMetadata(
        9,
        operator_states=(OperatorState("op", 1, None, {0: OperatorSubtaskState(handles)}),),
        properties=CheckpointProperties.for_savepoint(),
        job_id=job.access.job_id,
    )
    old = job.complete(metadata, 9, location).external_pointer
    new_dir = backend.url("moved", "restore-here")

    _copy_tree(job, old, new_dir)
    completed = job.storage.resolve_checkpoint(new_dir)
    loaded = load_checkpoint_metadata(completed)
    loaded_handles = loaded.operator_states[0].subtask_states[0].handles

    assert payloads == [read_all(h) for h in loaded_handles]
    relative = [h for h in loaded_handles if isinstance(h, RelativeFileStateHandle)]
    assert 2 == len(relative)
    assert [completed.external_pointer + "/" + h.relative_path for h in relative] == [
        h.path for h in relative
    ]
    assert [h.relative_path for h in handles[1:]] == [h.relative_path for h in relative]
    assert metadata.properties == loaded.properties


@pytest.mark.timeout(60)
def test_savepoint_with_shared_state_is_relocatable(backend):
    """A savepoint whose state was written with SHARED scope also restores after a move
    (all of a savepoint's state lives in its own directory)."""
    job = backend_job(backend, file_state_size_threshold=100)
    location = job.access.initialize_location_for_savepoint(4)
    data = random.Random(4).randbytes(3000)
    handle = write_state(location, data, SHARED)
    metadata = CheckpointMetadata(
        4, operator_states=(OperatorState("op", 1, None, {0: OperatorSubtaskState((handle,))}),)
    )
    old = job.complete(metadata, 4, location).external_pointer
    new_dir = backend.url("elsewhere", "sp")

    _copy_tree(job, old, new_dir)
    loaded = load_checkpoint_metadata(job.storage.resolve_checkpoint(new_dir))

    assert data == read_all(loaded.operator_states[0].subtask_states[0].handles[0])


# --- the format is documented --------------------------------------------------------------


def test_metadata_format_is_documented():
    """docs/metadata-format.md exists and describes the magic number, version, body length
    and checksum; the magic number it gives is the one real files start with."""
    doc = (ROOT / "docs" / "metadata-format.md").read_text(encoding="utf-8")
    job = memory_job()
    pointer = job.complete(CheckpointMetadata(1), 1).external_pointer
    head = job.read(pointer + "/_metadata")[:4]

    lowered = doc.lower()
    assert "magic" in lowered
    assert "version" in lowered
    assert "length" in lowered
    assert "checksum" in lowered or "crc" in lowered
    assert head.hex() in re.sub(r"[^0-9a-f]", "", lowered.replace("0x", ""))


# --- shared state for hypothesis tests (function-scoped fixtures do not mix with @given) --

_JOB: list[Job] = []


def _shared_memory_job() -> Job:
    if not _JOB:
        _JOB.append(memory_job())
    return _JOB[0]
