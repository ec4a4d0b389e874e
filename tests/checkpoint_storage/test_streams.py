"""State output streams: Flink's FsCheckpointStateOutputStreamTest, FsCheckpointStreamFactoryTest
and MemoryCheckpointOutputStreamTest, ported to fsspec backends (memory://, local disk, S3)."""

import random
import threading
import uuid
from dataclasses import dataclass

import fsspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_storage import (
    ByteStreamStateHandle,
    CheckpointedStateScope,
    CheckpointStorageLocationReference,
    FileStateHandle,
    FileSystemCheckpointStorage,
    JobID,
    MemoryCheckpointStorage,
    RelativeFileStateHandle,
)
from checkpoint_storage.exceptions import StateSizeExceededError, StreamClosedError

EXCLUSIVE = CheckpointedStateScope.EXCLUSIVE
SHARED = CheckpointedStateScope.SHARED
DEFAULT_REF = CheckpointStorageLocationReference.get_default()
MiB = 1024 * 1024


# --- helpers -------------------------------------------------------------------------------


@dataclass
class Job:
    """One job's checkpoint storage with base locations and chk-1 initialized."""

    storage_options: dict
    storage: FileSystemCheckpointStorage
    access: object
    visible_while_writing: bool  # a file shows up on open (local, memory), not on close (S3)

    @property
    def exclusive_dir(self) -> str:
        return self.access.checkpoints_directory.rstrip("/") + "/chk-1"

    @property
    def shared_dir(self) -> str:
        return self.access.shared_state_directory

    def factory(self, checkpoint_id: int = 1):
        """The worker's view: resolve the default reference, as a Spark executor does."""
        return self.access.resolve_checkpoint_storage_location(checkpoint_id, DEFAULT_REF)

    def stream(self, scope=EXCLUSIVE):
        return self.factory().create_checkpoint_state_output_stream(scope)

    def files(self, directory: str) -> list[str]:
        """Names of the files below ``directory``, read fresh from the filesystem."""
        fs, path = fsspec.core.url_to_fs(directory, **self.storage_options)
        fs.invalidate_cache()
        try:
            found = fs.find(path, detail=True)
        except FileNotFoundError:
            return []
        return sorted(
            p.rstrip("/").rsplit("/", 1)[-1]
            for p, info in found.items()
            if info.get("type") == "file" and not p.endswith("/")
        )


def make_job(backend, **options) -> Job:
    storage = FileSystemCheckpointStorage(
        backend.url("checkpoints"),
        backend.url("savepoints"),
        storage_options=backend.storage_options,
        **options,
    )
    access = storage.create_checkpoint_storage(JobID.generate())
    access.initialize_base_locations()
    access.initialize_location_for_checkpoint(1)
    return Job(backend.storage_options, storage, access, backend.name != "s3")


def random_bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def write_mixed(stream, data: bytes, seed: int = 1) -> None:
    """Flink's pattern: a mixture of single-byte writes and array writes of random length."""
    rng = random.Random(seed)
    pos = 0
    while pos < len(data):
        if rng.random() < 0.5:
            stream.write(data[pos : pos + 1])
            pos += 1
        else:
            n = len(data) - pos if rng.random() < 0.5 else rng.randint(0, len(data) - pos)
            stream.write(data[pos : pos + n])
            pos += n


def read_all(handle) -> bytes:
    with handle.open() as f:
        return f.read()


# --- threshold boundaries ------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_empty_stream_gives_no_handle(backend):
    """A stream nothing was written to returns None and leaves no file."""
    job = make_job(backend)
    stream = job.stream()

    assert None is stream.close_and_get_handle()
    assert [] == job.files(job.exclusive_dir)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scope", [EXCLUSIVE, SHARED])
@pytest.mark.parametrize("delta", [-1, 0])
def test_at_most_threshold_bytes_stay_inline(backend, scope, delta):
    """threshold - 1 and threshold bytes give a ByteStreamStateHandle with exactly those bytes,
    and no file is written."""
    threshold = 1000
    job = make_job(backend, file_state_size_threshold=threshold, write_buffer_size=1024)
    data = random_bytes(threshold + delta)

    stream = job.stream(scope)
    write_mixed(stream, data)
    handle = stream.close_and_get_handle()

    assert ByteStreamStateHandle is type(handle)
    assert data == handle.data
    assert data == read_all(handle)
    assert len(data) == handle.state_size
    assert [] == job.files(job.exclusive_dir)
    assert [] == job.files(job.shared_dir)


@pytest.mark.timeout(60)
def test_threshold_bytes_in_one_write_stay_inline_when_buffer_equals_threshold(backend):
    """With buffer == threshold, one write of exactly threshold bytes is still inline (Flink
    would create a file here; the spec says 'at most the threshold' is inline)."""
    job = make_job(backend, file_state_size_threshold=100, write_buffer_size=100)
    data = random_bytes(100)

    stream = job.stream()
    stream.write(data)
    assert [] == job.files(job.exclusive_dir)
    handle = stream.close_and_get_handle()

    assert ByteStreamStateHandle is type(handle)
    assert data == handle.data
    assert [] == job.files(job.exclusive_dir)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("size", "threshold", "buffer"),
    [
        (1001, 1000, 1024),  # threshold + 1
        (1025, 1000, 1024),  # one byte beyond the buffer
        (896, 15, 1024),  # Flink testStateOneBufferAboveThreshold
        (576446, 17, 259),  # Flink testStateAboveMemThreshold
        (16678, 0, 4096),  # Flink testZeroThreshold
        (3 * MiB + 17, 20480, 4096),  # several MiB with the defaults
    ],
)
def test_above_threshold_gives_a_file_with_the_exact_bytes(backend, size, threshold, buffer):
    """More than threshold bytes give a file handle whose file holds exactly those bytes."""
    job = make_job(backend, file_state_size_threshold=threshold, write_buffer_size=buffer)
    data = random_bytes(size, seed=size)

    stream = job.stream()
    write_mixed(stream, data, seed=size)
    handle = stream.close_and_get_handle()

    assert isinstance(handle, FileStateHandle)
    assert size == handle.state_size
    assert data == read_all(handle)
    assert [handle.relative_path] == job.files(job.exclusive_dir)


@pytest.mark.timeout(60)
def test_one_byte_above_zero_threshold_is_a_file(backend):
    """With threshold 0 a single byte already goes to a file (Flink's relative-path test)."""
    job = make_job(backend, file_state_size_threshold=0)

    stream = job.stream()
    stream.write(b"\x79")
    handle = stream.close_and_get_handle()

    assert isinstance(handle, RelativeFileStateHandle)
    assert b"\x79" == read_all(handle)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefix", [0, 1, 60])
def test_writes_larger_than_the_buffer(backend, prefix):
    """A single write larger than the whole buffer (after `prefix` buffered bytes) is kept
    byte for byte and in order."""
    job = make_job(backend, file_state_size_threshold=50, write_buffer_size=100)
    head = random_bytes(prefix, seed=1)
    big = random_bytes(1000, seed=2)
    tail = random_bytes(7, seed=3)

    stream = job.stream()
    stream.write(head)
    stream.write(big)
    stream.write(tail)
    handle = stream.close_and_get_handle()

    assert head + big + tail == read_all(handle)
    assert len(head + big + tail) == handle.state_size


def test_stream_copies_the_callers_buffer():
    """Mutating a bytearray after writing it does not change the state (no aliasing)."""
    job = make_job(_memory_backend(), file_state_size_threshold=100, write_buffer_size=100)
    for size in (10, 150, 500):
        buf = bytearray(random_bytes(size))
        original = bytes(buf)

        stream = job.stream()
        stream.write(buf)
        buf[:] = b"\x00" * size
        handle = stream.close_and_get_handle()

        assert original == read_all(handle)


def test_stream_accepts_memoryview_and_bytearray():
    """write() takes any bytes-like object: bytes, bytearray and memoryview."""
    job = make_job(_memory_backend(), file_state_size_threshold=10, write_buffer_size=16)
    data = random_bytes(100)

    stream = job.stream()
    stream.write(data[:30])
    stream.write(bytearray(data[30:60]))
    stream.write(memoryview(data)[60:])
    handle = stream.close_and_get_handle()

    assert data == read_all(handle)


# --- handle kinds and directories ----------------------------------------------------------


@pytest.mark.timeout(60)
def test_exclusive_state_gets_relative_handles_in_the_checkpoint_directory(backend):
    """EXCLUSIVE files are RelativeFileStateHandles whose relative path is the file's name
    inside chk-<id>."""
    job = make_job(backend, file_state_size_threshold=0)

    stream = job.stream(EXCLUSIVE)
    stream.write(b"exclusive")
    handle = stream.close_and_get_handle()

    assert RelativeFileStateHandle is type(handle)
    assert "/" not in handle.relative_path
    assert job.exclusive_dir + "/" + handle.relative_path == handle.path
    assert [handle.relative_path] == job.files(job.exclusive_dir)
    assert [] == job.files(job.shared_dir)


@pytest.mark.timeout(60)
def test_shared_state_gets_absolute_handles_in_the_shared_directory(backend):
    """SHARED files are plain (absolute) FileStateHandles inside shared/."""
    job = make_job(backend, file_state_size_threshold=0)

    stream = job.stream(SHARED)
    stream.write(b"shared")
    handle = stream.close_and_get_handle()

    assert FileStateHandle is type(handle)
    assert not isinstance(handle, RelativeFileStateHandle)
    directory, _, name = handle.path.rpartition("/")
    assert job.shared_dir.rstrip("/") == directory
    assert [name] == job.files(job.shared_dir)
    assert [] == job.files(job.exclusive_dir)
    assert b"shared" == read_all(handle)


@pytest.mark.timeout(60)
def test_every_stream_gets_its_own_file(backend):
    """Streams into one directory never share (or overwrite) a file."""
    job = make_job(backend, file_state_size_threshold=0)
    payloads = [random_bytes(10 + i, seed=i) for i in range(20)]

    handles = []
    for payload in payloads:
        stream = job.stream()
        stream.write(payload)
        handles.append(stream.close_and_get_handle())

    assert 20 == len({h.path for h in handles})
    assert sorted(h.relative_path for h in handles) == job.files(job.exclusive_dir)
    assert payloads == [read_all(h) for h in handles]


@pytest.mark.timeout(60)
def test_discard_state_deletes_the_file(backend):
    """discard_state() of a file handle removes its file; a second discard is harmless."""
    job = make_job(backend, file_state_size_threshold=0)
    stream = job.stream()
    stream.write(b"to be discarded")
    handle = stream.close_and_get_handle()

    handle.discard_state()
    handle.discard_state()

    assert [] == job.files(job.exclusive_dir)


# --- tell and flush ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_tell_counts_single_byte_writes(backend):
    """tell() is the number of bytes written, across buffer flushes (Flink testGetPos)."""
    job = make_job(backend, file_state_size_threshold=17, write_buffer_size=31)

    stream = job.stream()
    positions = []
    for _ in range(64):
        positions.append(stream.tell())
        stream.write(b"\x42")
    handle = stream.close_and_get_handle()

    assert list(range(64)) == positions
    assert b"\x42" * 64 == read_all(handle)


@pytest.mark.timeout(60)
def test_tell_counts_mixed_writes_and_explicit_flushes(backend):
    """tell() keeps counting through array writes and explicit flush() calls."""
    job = make_job(backend, file_state_size_threshold=17, write_buffer_size=31)
    data = b"testme!"

    stream = job.stream()
    positions = []
    for i in range(7):
        positions.append(stream.tell())
        stream.write(b"\x42")
        stream.write(data)
        if i % 2:
            stream.flush()
    positions.append(stream.tell())
    handle = stream.close_and_get_handle()

    assert [i * 8 for i in range(8)] == positions
    assert (b"\x42" + data) * 7 == read_all(handle)


@pytest.mark.timeout(60)
def test_flush_at_or_below_threshold_creates_no_file(backend):
    """flush() with at most threshold bytes buffered writes nothing (Flink testFlushUnderThreshold);
    the state then stays inline."""
    job = make_job(backend, file_state_size_threshold=10)

    stream = job.stream()
    stream.write(b"0123456789")
    stream.flush()

    assert [] == job.files(job.exclusive_dir)
    handle = stream.close_and_get_handle()
    assert ByteStreamStateHandle is type(handle)
    assert b"0123456789" == handle.data


@pytest.mark.parametrize("backend_name", ["memory", "local"])
def test_flush_above_threshold_writes_a_file(backend_name, tmp_path):
    """flush() with more than threshold bytes buffered writes them to a file
    (Flink testFlushAboveThreshold)."""
    job = make_job(_plain_backend(backend_name, tmp_path), file_state_size_threshold=10)

    stream = job.stream()
    stream.write(b"0123456789A")
    stream.flush()

    assert 1 == len(job.files(job.exclusive_dir))
    handle = stream.close_and_get_handle()
    assert b"0123456789A" == read_all(handle)


# --- lazy file creation and the effective buffer -------------------------------------------


@pytest.mark.timeout(60)
def test_no_file_before_the_buffer_overflows(backend):
    """Up to a full buffer nothing is created on storage, even above the threshold."""
    job = make_job(backend, file_state_size_threshold=10, write_buffer_size=1000)

    stream = job.stream()
    for _ in range(100):
        stream.write(b"0123456789")  # exactly fills the buffer

    assert [] == job.files(job.exclusive_dir)
    stream.close()


@pytest.mark.parametrize("backend_name", ["memory", "local"])
def test_file_is_created_when_the_buffer_overflows(backend_name, tmp_path):
    """The byte after a full buffer creates the file (it is visible on local and memory)."""
    job = make_job(
        _plain_backend(backend_name, tmp_path), file_state_size_threshold=10, write_buffer_size=1000
    )

    stream = job.stream()
    stream.write(random_bytes(1000))
    before = job.files(job.exclusive_dir)
    stream.write(b"!")
    after = job.files(job.exclusive_dir)
    handle = stream.close_and_get_handle()

    assert [] == before
    assert [handle.relative_path] == after
    assert random_bytes(1000) + b"!" == read_all(handle)


@pytest.mark.parametrize("backend_name", ["memory", "local"])
def test_effective_buffer_is_at_least_the_threshold(backend_name, tmp_path):
    """With write_buffer_size < threshold the buffer holds threshold bytes: writing up to the
    threshold in small pieces creates no file and gives an inline handle."""
    job = make_job(
        _plain_backend(backend_name, tmp_path), file_state_size_threshold=1000, write_buffer_size=10
    )
    data = random_bytes(1000)

    stream = job.stream()
    for i in range(0, 1000, 10):
        stream.write(data[i : i + 10])
    files_while_writing = job.files(job.exclusive_dir)
    handle = stream.close_and_get_handle()

    assert [] == files_while_writing
    assert ByteStreamStateHandle is type(handle)
    assert data == handle.data


@pytest.mark.parametrize("backend_name", ["memory", "local"])
def test_effective_buffer_is_the_write_buffer_when_larger(backend_name, tmp_path):
    """With write_buffer_size > threshold, state between the two is buffered (no file yet) and
    still committed to a file."""
    job = make_job(
        _plain_backend(backend_name, tmp_path), file_state_size_threshold=10, write_buffer_size=4096
    )
    data = random_bytes(4096)

    stream = job.stream()
    stream.write(data)
    files_while_writing = job.files(job.exclusive_dir)
    handle = stream.close_and_get_handle()

    assert [] == files_while_writing
    assert isinstance(handle, RelativeFileStateHandle)
    assert data == read_all(handle)


# --- abort ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scope", [EXCLUSIVE, SHARED])
def test_close_deletes_the_partial_file(backend, scope):
    """close() without close_and_get_handle() deletes the file it created (Flink
    testCleanupWhenClosingStream)."""
    job = make_job(backend, file_state_size_threshold=10, write_buffer_size=100)
    directory = job.exclusive_dir if scope is EXCLUSIVE else job.shared_dir

    stream = job.stream(scope)
    stream.write(random_bytes(5000))
    existed = job.files(directory)
    stream.close()

    if job.visible_while_writing:
        assert 1 == len(existed)
    assert [] == job.files(directory)


@pytest.mark.timeout(60)
def test_close_is_idempotent_and_returns_none(backend):
    """close() can be called repeatedly, on any stream state, without raising."""
    job = make_job(backend, file_state_size_threshold=10, write_buffer_size=100)

    empty = job.stream()
    inline = job.stream()
    inline.write(b"abc")
    filed = job.stream()
    filed.write(random_bytes(500))

    results = [s.close() for s in (empty, inline, filed) for _ in range(2)]

    assert [None] * 6 == results
    assert [] == job.files(job.exclusive_dir)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("written", [0, 5, 5000])
def test_writes_after_close_raise(backend, written):
    """After close(), write() raises StreamClosedError, an OSError (Flink
    testWriteFailsFastWhenClosed)."""
    job = make_job(backend, file_state_size_threshold=10, write_buffer_size=100)
    stream = job.stream()
    stream.write(random_bytes(written))
    stream.close()

    with pytest.raises(StreamClosedError) as info:
        stream.write(b"x")

    assert isinstance(info.value, OSError)
    with pytest.raises(OSError):
        stream.write(random_bytes(1000))


@pytest.mark.timeout(60)
def test_close_and_get_handle_after_close_raises(backend):
    """A closed (aborted) stream cannot be committed any more (Flink stream5)."""
    job = make_job(backend, file_state_size_threshold=15, write_buffer_size=1024)
    stream = job.stream()
    stream.write(random_bytes(177))
    stream.close()

    with pytest.raises(StreamClosedError):
        stream.close_and_get_handle()
    assert [] == job.files(job.exclusive_dir)


def test_close_never_raises_when_the_partial_file_vanished(tmp_path):
    """close() swallows failures: the partial file was already removed by someone else."""
    job = make_job(
        _plain_backend("local", tmp_path), file_state_size_threshold=10, write_buffer_size=100
    )
    stream = job.stream()
    stream.write(random_bytes(5000))
    fs, path = fsspec.core.url_to_fs(job.exclusive_dir)
    for name in job.files(job.exclusive_dir):
        fs.rm_file(path + "/" + name)

    assert None is stream.close()
    with pytest.raises(StreamClosedError):
        stream.write(b"x")


def test_close_never_raises_when_the_directory_vanished(tmp_path):
    """close() swallows failures: the whole checkpoint directory was removed under it."""
    job = make_job(
        _plain_backend("local", tmp_path), file_state_size_threshold=10, write_buffer_size=100
    )
    stream = job.stream()
    stream.write(random_bytes(5000))
    fs, path = fsspec.core.url_to_fs(job.exclusive_dir)
    fs.rm(path, recursive=True)

    assert None is stream.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [5, 5000])
def test_leaving_with_block_without_commit_aborts(backend, size):
    """A with block left without close_and_get_handle() aborts: no file remains and the
    stream is closed."""
    job = make_job(backend, file_state_size_threshold=10, write_buffer_size=100)

    with job.stream() as stream:
        stream.write(random_bytes(size))

    assert [] == job.files(job.exclusive_dir)
    with pytest.raises(StreamClosedError):
        stream.write(b"x")
    with pytest.raises(StreamClosedError):
        stream.close_and_get_handle()


@pytest.mark.timeout(60)
def test_exception_in_with_block_aborts_and_propagates(backend):
    """An exception inside the with block propagates unchanged and the partial file is gone."""
    job = make_job(backend, file_state_size_threshold=10, write_buffer_size=100)
    marker = RuntimeError("boom")

    with pytest.raises(RuntimeError) as info, job.stream() as stream:
        stream.write(random_bytes(5000))
        raise marker

    assert marker is info.value
    assert [] == job.files(job.exclusive_dir)
    with pytest.raises(StreamClosedError):
        stream.write(b"x")


@pytest.mark.timeout(60)
def test_commit_inside_with_block_keeps_the_file(backend):
    """Leaving a with block after close_and_get_handle() keeps the committed file."""
    job = make_job(backend, file_state_size_threshold=10, write_buffer_size=100)
    data = random_bytes(5000)

    with job.stream() as stream:
        stream.write(data)
        handle = stream.close_and_get_handle()

    assert [handle.relative_path] == job.files(job.exclusive_dir)
    assert data == read_all(handle)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [0, 5, 5000])
def test_second_close_and_get_handle_raises(backend, size):
    """close_and_get_handle() commits once; a second call raises StreamClosedError (an
    OSError) and does not touch the committed file."""
    job = make_job(backend, file_state_size_threshold=10, write_buffer_size=100)
    data = random_bytes(size)
    stream = job.stream()
    stream.write(data)
    first = stream.close_and_get_handle()

    with pytest.raises(OSError) as info:
        stream.close_and_get_handle()

    assert isinstance(info.value, StreamClosedError)
    if size:
        assert data == read_all(first)
    stream.close()  # closing a committed stream must not delete its file
    if size > 10:
        assert [first.relative_path] == job.files(job.exclusive_dir)
        assert data == read_all(first)


# --- failing creates do not delete the parent ----------------------------------------------


def test_failed_create_raises_and_keeps_the_parent(tmp_path):
    """When the state file cannot be created (chk-7 was never initialized, and workers never
    create directories), the stream raises an OSError and deletes no directory."""
    job = make_job(
        _plain_backend("local", tmp_path), file_state_size_threshold=1, write_buffer_size=1024
    )
    job_dir = job.access.checkpoints_directory
    sentinel = tmp_path / "sentinel"
    sentinel.write_bytes(b"keep me")
    stream1 = job.factory(7).create_checkpoint_state_output_stream(EXCLUSIVE)
    stream2 = job.factory(7).create_checkpoint_state_output_stream(EXCLUSIVE)

    with pytest.raises(OSError):
        stream1.write(bytes(61))
        stream1.write(bytes(2000))
        stream1.close_and_get_handle()
    stream2.write(bytes(61))
    stream2.close()
    stream1.close()

    fs, job_path = fsspec.core.url_to_fs(job_dir)
    assert fs.isdir(job_path)
    assert fs.isdir(job_path + "/chk-1")
    assert fs.isdir(fsspec.core.url_to_fs(job.shared_dir)[1])
    assert not fs.exists(job_path + "/chk-7")
    assert b"keep me" == sentinel.read_bytes()


def test_failed_create_does_not_delete_what_blocks_it(tmp_path):
    """If chk-7 is a file instead of a directory, creating state in it fails with an OSError
    and the file chk-7 is left alone (Flink testStreamDoesNotTryToCleanUpParentOnError)."""
    job = make_job(
        _plain_backend("local", tmp_path), file_state_size_threshold=1, write_buffer_size=1024
    )
    fs, job_path = fsspec.core.url_to_fs(job.access.checkpoints_directory)
    fs.pipe_file(job_path + "/chk-7", b"not a directory")
    stream = job.factory(7).create_checkpoint_state_output_stream(EXCLUSIVE)

    with pytest.raises(OSError):
        stream.write(bytes(61))
        stream.close_and_get_handle()
    stream.close()

    assert fs.isfile(job_path + "/chk-7")
    assert b"not a directory" == fs.cat_file(job_path + "/chk-7")


# --- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"file_state_size_threshold": -1},
        {"file_state_size_threshold": MiB + 1},
        {"file_state_size_threshold": 10 * MiB},
        {"write_buffer_size": -1},
    ],
)
def test_invalid_sizes_are_rejected(tmp_path, options):
    """threshold < 0 or > 1 MiB, or buffer < 0, raise ValueError at construction."""
    with pytest.raises(ValueError):
        FileSystemCheckpointStorage(str(tmp_path), **options)


@pytest.mark.parametrize(
    "options",
    [
        {"file_state_size_threshold": 0},
        {"file_state_size_threshold": MiB},
        {"write_buffer_size": 0},
        {"write_buffer_size": 0, "file_state_size_threshold": 0},
    ],
)
def test_boundary_sizes_are_accepted(tmp_path, options):
    """threshold 0 and 1 MiB, and buffer 0, are valid."""
    storage = FileSystemCheckpointStorage(str(tmp_path), **options)

    assert isinstance(storage, FileSystemCheckpointStorage)


def test_one_mib_threshold_keeps_one_mib_inline():
    """With the maximum threshold of 1 MiB, exactly 1 MiB is inline and 1 MiB + 1 is a file."""
    job = make_job(_memory_backend(), file_state_size_threshold=MiB)
    data = random_bytes(MiB + 1)

    at = job.stream()
    at.write(data[:MiB])
    above = job.stream()
    above.write(data)

    assert ByteStreamStateHandle is type(at.close_and_get_handle())
    assert data == read_all(above.close_and_get_handle())


def test_zero_buffer_and_zero_threshold_still_write_correctly():
    """buffer 0 and threshold 0: every byte goes to a file and comes back in order."""
    job = make_job(_memory_backend(), file_state_size_threshold=0, write_buffer_size=0)
    data = random_bytes(3000)

    stream = job.stream()
    write_mixed(stream, data)
    handle = stream.close_and_get_handle()

    assert data == read_all(handle)


@settings(max_examples=100, deadline=None)
@given(
    threshold=st.integers(0, 64),
    buffer=st.integers(0, 64),
    chunks=st.lists(st.binary(max_size=100), max_size=12),
    flush_after=st.sets(st.integers(0, 11)),
)
def test_any_write_pattern_reads_back(threshold, buffer, chunks, flush_after):
    """For any sizes and write/flush pattern: None for 0 bytes, inline up to the threshold,
    a file above it, and always exactly the written bytes; tell() is the running total."""
    job = make_job(_memory_backend(), file_state_size_threshold=threshold, write_buffer_size=buffer)
    data = b"".join(chunks)

    stream = job.stream()
    total = 0
    for i, chunk in enumerate(chunks):
        stream.write(chunk)
        total += len(chunk)
        assert total == stream.tell()
        if i in flush_after:
            stream.flush()
    handle = stream.close_and_get_handle()

    if not data:
        assert handle is None
    elif len(data) <= threshold:
        assert ByteStreamStateHandle is type(handle)
        assert data == handle.data
    else:
        assert RelativeFileStateHandle is type(handle)
        assert data == read_all(handle)


# --- thread safety -------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("via", ["access", "location"])
def test_many_threads_write_streams_through_one_access_object(backend, via):
    """8 threads each write 50 streams at once, through one access object (each thread
    resolving the location, as executors do) or one shared location object; every handle
    reads back its own bytes and every file has its own name."""
    job = make_job(backend, file_state_size_threshold=1024, write_buffer_size=512)
    shared_location = job.access.initialize_location_for_checkpoint(1)

    def factory():
        if via == "location":
            return shared_location
        return job.access.resolve_checkpoint_storage_location(1, DEFAULT_REF)

    threads, per_thread = 8, 50
    barrier = threading.Barrier(threads)
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            rng = random.Random(t)
            barrier.wait()
            mine = []
            for i in range(per_thread):
                scope = EXCLUSIVE if i % 3 else SHARED
                data = rng.randbytes(rng.choice([0, 1, 100, 1024, 1025, 3000]))
                stream = factory().create_checkpoint_state_output_stream(scope)
                write_mixed(stream, data, seed=t * 1000 + i)
                mine.append((data, stream.close_and_get_handle()))
            results[t] = mine
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()

    assert [] == errors
    pairs = [pair for t in range(threads) for pair in results[t]]
    assert threads * per_thread == len(pairs)
    for data, handle in pairs:
        if not data:
            assert handle is None
        else:
            assert data == read_all(handle)
    file_handles = [h for _, h in pairs if isinstance(h, FileStateHandle)]
    names = [h.path.rsplit("/", 1)[1] for h in file_handles]
    assert len(names) == len(set(names))
    assert sorted(names) == sorted(job.files(job.exclusive_dir) + job.files(job.shared_dir))


# --- MemoryCheckpointStorage ---------------------------------------------------------------


def _memory_job(max_state_size: int = 5 * MiB):
    access = MemoryCheckpointStorage(max_state_size=max_state_size).create_checkpoint_storage(
        JobID.generate()
    )
    access.initialize_base_locations()
    location = access.initialize_location_for_checkpoint(1)
    return access, location


@pytest.mark.parametrize("scope", [EXCLUSIVE, SHARED])
@pytest.mark.parametrize("size", [1, 20481, 3 * MiB])
def test_memory_storage_streams_always_give_byte_handles(scope, size):
    """MemoryCheckpointStorage streams return ByteStreamStateHandles with the exact bytes,
    whatever the size (below max_state_size) and scope."""
    access, location = _memory_job()
    data = random_bytes(size)

    stream = location.create_checkpoint_state_output_stream(scope)
    write_mixed(stream, data)
    handle = stream.close_and_get_handle()

    assert ByteStreamStateHandle is type(handle)
    assert data == handle.data
    assert data == read_all(handle)
    assert size == handle.state_size


def test_memory_storage_worker_view_gives_byte_handles():
    """The worker path of MemoryCheckpointStorage (resolve the default reference) also
    returns ByteStreamStateHandles."""
    access, _ = _memory_job()

    stream = access.resolve_checkpoint_storage_location(
        1, DEFAULT_REF
    ).create_checkpoint_state_output_stream(EXCLUSIVE)
    stream.write(random_bytes(100_000))
    handle = stream.close_and_get_handle()

    assert ByteStreamStateHandle is type(handle)
    assert random_bytes(100_000) == handle.data


def test_memory_storage_stream_exactly_at_max_size_is_accepted():
    """A state of exactly max_state_size bytes is within the limit."""
    _, location = _memory_job(max_state_size=100)

    stream = location.create_checkpoint_state_output_stream(EXCLUSIVE)
    stream.write(bytes(100))

    assert bytes(100) == stream.close_and_get_handle().data


def test_memory_storage_empty_stream_gives_none():
    """An empty MemoryCheckpointStorage stream gives None."""
    _, location = _memory_job()

    assert None is location.create_checkpoint_state_output_stream(EXCLUSIVE).close_and_get_handle()


def test_memory_storage_oversized_state_fails_at_commit_naming_both_sizes():
    """Above max_state_size, writes succeed but close_and_get_handle() raises
    StateSizeExceededError (an OSError) naming both sizes and the file system storage."""
    _, location = _memory_job(max_state_size=100)
    stream = location.create_checkpoint_state_output_stream(EXCLUSIVE)
    for _ in range(1234):
        stream.write(b"x")

    with pytest.raises(StateSizeExceededError) as info:
        stream.close_and_get_handle()

    message = str(info.value)
    assert isinstance(info.value, OSError)
    assert "1234" in message
    assert "100" in message.replace("1234", "")
    assert "filesystem" in message.lower().replace(" ", "")


def test_memory_storage_stream_cannot_be_used_after_failed_commit():
    """After an oversized commit failed, the stream is closed: writes and commits raise."""
    _, location = _memory_job(max_state_size=10)
    stream = location.create_checkpoint_state_output_stream(EXCLUSIVE)
    stream.write(bytes(11))
    with pytest.raises(StateSizeExceededError):
        stream.close_and_get_handle()

    with pytest.raises(OSError):
        stream.write(b"x")
    with pytest.raises(OSError):
        stream.close_and_get_handle()


def test_memory_storage_stream_abort_and_second_commit():
    """MemoryCheckpointStorage streams follow the same close rules: writes after close() raise,
    a second close_and_get_handle() raises."""
    _, location = _memory_job()
    aborted = location.create_checkpoint_state_output_stream(EXCLUSIVE)
    aborted.write(b"abc")
    aborted.close()
    aborted.close()
    committed = location.create_checkpoint_state_output_stream(EXCLUSIVE)
    committed.write(b"abc")
    handle = committed.close_and_get_handle()

    with pytest.raises(StreamClosedError):
        aborted.write(b"x")
    with pytest.raises(StreamClosedError):
        aborted.close_and_get_handle()
    with pytest.raises(StreamClosedError):
        committed.close_and_get_handle()
    assert b"abc" == handle.data


def test_memory_storage_tell_counts_bytes():
    """tell() of a memory stream is the number of bytes written."""
    _, location = _memory_job()
    stream = location.create_checkpoint_state_output_stream(EXCLUSIVE)

    positions = []
    for i in range(10):
        positions.append(stream.tell())
        stream.write(bytes(i))

    assert [sum(range(i)) for i in range(10)] == positions


def test_memory_storage_rejects_negative_max_state_size():
    """A negative max_state_size is a ValueError."""
    with pytest.raises(ValueError):
        MemoryCheckpointStorage(max_state_size=-1)


# --- backends without the fixture (for hypothesis and local-only checks) -------------------


@dataclass(frozen=True)
class _PlainBackend:
    name: str
    base_url: str
    storage_options: dict

    def url(self, *parts: str) -> str:
        return "/".join((self.base_url, *parts))


def _memory_backend() -> _PlainBackend:
    return _PlainBackend("memory", f"memory://streams-{uuid.uuid4().hex}", {})


def _plain_backend(name: str, tmp_path) -> _PlainBackend:
    if name == "memory":
        return _memory_backend()
    return _PlainBackend("local", str(tmp_path / uuid.uuid4().hex), {})


def test_a_stream_whose_write_failed_never_commits(tmp_path):
    """A write that fails (here: chk-7 was never created) aborts the stream: no partial handle."""
    storage = FileSystemCheckpointStorage(
        str(tmp_path), file_state_size_threshold=100, write_buffer_size=100
    )
    access = storage.create_checkpoint_storage(JobID.generate())
    stream = access.resolve_checkpoint_storage_location(
        7, DEFAULT_REF
    ).create_checkpoint_state_output_stream(EXCLUSIVE)
    stream.write(b"a" * 50)
    with pytest.raises(FileNotFoundError):
        stream.write(b"b" * 60)
    with pytest.raises(StreamClosedError):
        stream.close_and_get_handle()
