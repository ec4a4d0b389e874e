"""Contract of the checkpoint storage access over real filesystems.

Every test that takes ``backend`` runs against fsspec's ``memory://``, local disk and S3 (moto).
The behaviours are those Flink pins in AbstractFileCheckpointStorageAccessTestBase,
FsCheckpointStorageAccessTest, FsStorageEntropyTest and FileSystemCheckpointStorageTest,
rewritten for this library's API (issue 2, docs/design.md §3).
"""

import os
import pickle
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from checkpoint_storage import (
    ByteStreamStateHandle,
    CheckpointedStateScope,
    CheckpointNotFoundError,
    CheckpointStorageLocationReference,
    FileStateHandle,
    FileSystemCheckpointStorage,
    JobID,
    RelativeFileStateHandle,
    encode_path_as_reference,
    load_checkpoint_metadata,
    store_checkpoint_metadata,
)
from tests.support import (
    finalize,
    fs_of,
    loaded_handles,
    metadata,
    norm,
    parent,
    payload,
    read,
    write_state,
)

EXCLUSIVE = CheckpointedStateScope.EXCLUSIVE
SHARED = CheckpointedStateScope.SHARED
DEFAULT_REF = CheckpointStorageLocationReference.get_default()

THRESHOLD = 1024  # small inline threshold, so that BIG states go to files
BIG = 2048

pytestmark = pytest.mark.timeout(60)  # the backend fixture includes S3


# --------------------------------------------------------------------------------------------
#  helpers
# --------------------------------------------------------------------------------------------


def make_storage(backend, name: str = "cp", **kwargs) -> FileSystemCheckpointStorage:
    kwargs.setdefault("file_state_size_threshold", THRESHOLD)
    return FileSystemCheckpointStorage(
        backend.url(name), storage_options=dict(backend.storage_options), **kwargs
    )


def complete_checkpoint(access, checkpoint_id: int, states=(), master: bytes = b"pos-0"):
    location = access.initialize_location_for_checkpoint(checkpoint_id)
    handles = [write_state(location, data) for data in states]
    md = metadata(checkpoint_id, handles, master)
    return finalize(location, md), md


def new_access(backend, job=None, **kwargs):
    access = make_storage(backend, **kwargs).create_checkpoint_storage(job or JobID.generate())
    access.initialize_base_locations()
    return access


# --------------------------------------------------------------------------------------------
#  pointers
# --------------------------------------------------------------------------------------------


def test_pointer_dir_dir_slash_and_metadata_file_resolve_to_one_pointer(backend):
    """The directory, the directory + '/' and its _metadata all resolve to the directory."""
    access = new_access(backend)
    completed, md = complete_checkpoint(access, 1, [payload(BIG, 1), b"inline"])
    pointer = completed.external_pointer
    other_storage = make_storage(backend, "somewhere-else")
    pointers = [pointer, pointer + "/", pointer + "/_metadata"]

    resolved = [
        resolve(p)
        for resolve in (access.resolve_checkpoint, other_storage.resolve_checkpoint)
        for p in pointers
    ]

    assert [pointer] * 6 == [r.external_pointer for r in resolved]
    assert [read(completed.metadata_handle)] * 6 == [read(r.metadata_handle) for r in resolved]
    assert [md] * 6 == [load_checkpoint_metadata(r) for r in resolved]


def test_one_external_pointer_whichever_call_produced_it(backend):
    """finalize, resolve (of the configured path) and latest give the same pointer string."""
    job = JobID.generate()
    access = new_access(backend, job)
    completed, _ = complete_checkpoint(access, 1)
    configured = backend.url("cp", str(job), "chk-1")

    assert completed.external_pointer == access.resolve_checkpoint(configured).external_pointer
    assert completed.external_pointer == access.latest_completed_checkpoint().external_pointer
    assert re.search(rf"/{job}/chk-1$", completed.external_pointer)


def test_resolve_none_pointer_raises_type_error(backend):
    """A None pointer is a TypeError, on the access and on the storage."""
    storage = make_storage(backend)
    access = storage.create_checkpoint_storage(JobID.generate())
    with pytest.raises(TypeError):
        access.resolve_checkpoint(None)
    with pytest.raises(TypeError):
        storage.resolve_checkpoint(None)


def test_resolve_empty_pointer_raises_value_error(backend):
    """An empty pointer is a ValueError, on the access and on the storage."""
    storage = make_storage(backend)
    access = storage.create_checkpoint_storage(JobID.generate())
    with pytest.raises(ValueError):
        access.resolve_checkpoint("")
    with pytest.raises(ValueError):
        storage.resolve_checkpoint("")


def test_resolve_missing_path_raises_not_found_saying_what_to_pass(backend):
    """A pointer to nothing raises CheckpointNotFoundError, a FileNotFoundError with a hint."""
    storage = make_storage(backend)
    access = storage.create_checkpoint_storage(JobID.generate())
    missing = backend.url("does", "not", "exist", "chk-3")

    for resolve in (access.resolve_checkpoint, storage.resolve_checkpoint):
        with pytest.raises(CheckpointNotFoundError) as info:
            resolve(missing)
        assert isinstance(info.value, FileNotFoundError)
        message = str(info.value)
        assert "_metadata" in message or "directory" in message.lower(), message


def test_resolve_directory_without_metadata_raises_not_found(backend):
    """An existing chk directory that holds state but no _metadata is not a checkpoint."""
    job = JobID.generate()
    access = new_access(backend, job)
    location = access.initialize_location_for_checkpoint(4)
    write_state(location, payload(BIG, 4))  # so the directory exists on S3 too
    directory = backend.url("cp", str(job), "chk-4")

    for pointer in (directory, directory + "/", directory + "/_metadata"):
        with pytest.raises(FileNotFoundError):
            access.resolve_checkpoint(pointer)


def test_resolve_pointer_to_a_state_file_raises_not_found(backend):
    """A pointer to a state file (not a checkpoint directory nor _metadata) is not found."""
    access = new_access(backend)
    location = access.initialize_location_for_checkpoint(2)
    state = write_state(location, payload(BIG, 2))
    finalize(location, metadata(2, [state]))

    with pytest.raises(FileNotFoundError):
        access.resolve_checkpoint(state.path)


def test_file_url_and_plain_path_resolve_to_one_pointer_on_local_disk(tmp_path):
    """On local disk, file:// URLs and plain paths of a checkpoint give one pointer string."""
    job = JobID.generate()
    access = FileSystemCheckpointStorage(str(tmp_path / "cp")).create_checkpoint_storage(job)
    access.initialize_base_locations()
    completed, _ = complete_checkpoint(access, 1)
    plain = str(tmp_path / "cp" / str(job) / "chk-1")

    pointers = [plain, plain + "/", "file://" + plain, "file://" + plain + "/_metadata"]

    assert [completed.external_pointer] * 4 == [
        access.resolve_checkpoint(p).external_pointer for p in pointers
    ]


# --------------------------------------------------------------------------------------------
#  checkpoints
# --------------------------------------------------------------------------------------------


def test_two_jobs_on_one_base_with_same_checkpoint_id_do_not_interfere(backend):
    """Two jobs writing chk-177 under one base get two directories and their own metadata."""
    job1, job2 = JobID.generate(), JobID.generate()
    access1 = new_access(backend, job1)
    access2 = new_access(backend, job2)

    completed1, md1 = complete_checkpoint(access1, 177, [payload(BIG, 1)], master=b"job-one")
    completed2, md2 = complete_checkpoint(access2, 177, [payload(BIG, 2)], master=b"job-two")

    fs = fs_of(backend)
    job_dirs = sorted(
        p.rsplit("/", 1)[-1] for p in fs.ls(norm(fs, backend.url("cp")), detail=False)
    )
    assert sorted([str(job1), str(job2)]) == job_dirs
    assert norm(fs, completed1.external_pointer) != norm(fs, completed2.external_pointer)
    for access in (access1, access2):
        assert [md1, md2] == [
            load_checkpoint_metadata(access.resolve_checkpoint(c.external_pointer))
            for c in (completed1, completed2)
        ]


def test_second_metadata_stream_on_finalized_location_fails(backend):
    """Writing _metadata twice raises FileExistsError and leaves the first one unchanged."""
    access = new_access(backend)
    location = access.initialize_location_for_checkpoint(177)
    md = metadata(177, [write_state(location, payload(BIG, 7))])
    completed = finalize(location, md)
    fs = fs_of(backend)
    metadata_path = norm(fs, completed.external_pointer) + "/_metadata"
    before = fs.cat_file(metadata_path)

    with pytest.raises(FileExistsError):
        out = location.create_metadata_output_stream()
        store_checkpoint_metadata(metadata(177, master=b"overwrite"), out)
        out.close_and_finalize_checkpoint()

    assert before == fs_of(backend).cat_file(metadata_path)
    assert md == load_checkpoint_metadata(access.resolve_checkpoint(completed.external_pointer))


def test_put_if_absent_between_two_independent_coordinators(backend):
    """Of two coordinators finalizing chk-5, exactly one wins; the stored bytes are its own."""
    job = JobID.generate()
    coordinators = []
    for _ in range(2):
        storage = FileSystemCheckpointStorage(
            backend.url("cp"),
            storage_options=dict(backend.storage_options),
            file_state_size_threshold=THRESHOLD,
        )
        access = storage.create_checkpoint_storage(str(job))
        access.initialize_base_locations()
        coordinators.append(access)
    locations = [access.initialize_location_for_checkpoint(5) for access in coordinators]
    mds = [metadata(5, master=b"coordinator-a"), metadata(5, master=b"coordinator-b")]
    outs = []
    for location, md in zip(locations, mds, strict=True):
        out = location.create_metadata_output_stream()
        store_checkpoint_metadata(md, out)
        outs.append(out)

    winner = outs[0].close_and_finalize_checkpoint()
    fs = fs_of(backend)
    metadata_path = norm(fs, winner.external_pointer) + "/_metadata"
    winner_bytes = fs.cat_file(metadata_path)
    with pytest.raises(FileExistsError):
        outs[1].close_and_finalize_checkpoint()

    assert winner_bytes == fs_of(backend).cat_file(metadata_path)
    for access in coordinators:
        resolved = access.resolve_checkpoint(winner.external_pointer)
        assert mds[0] == load_checkpoint_metadata(resolved)


def test_put_if_absent_between_two_coordinators_finalizing_at_once(backend):
    """Two independent coordinators finalizing chk-5 at the same moment: exactly one wins."""
    job = JobID.generate()
    outs, mds = [], []
    for tag in (b"a", b"b"):
        access = make_storage(backend).create_checkpoint_storage(str(job))
        access.initialize_base_locations()
        location = access.initialize_location_for_checkpoint(5)
        md = metadata(5, master=tag)
        out = location.create_metadata_output_stream()
        store_checkpoint_metadata(md, out)
        outs.append(out)
        mds.append(md)
    barrier = threading.Barrier(2)

    def commit(out):
        barrier.wait()
        try:
            return out.close_and_finalize_checkpoint()
        except FileExistsError as exc:
            return exc

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(commit, outs))

    winners = [i for i, r in enumerate(results) if not isinstance(r, FileExistsError)]
    assert 1 == len(winners), results
    resolved = make_storage(backend).create_checkpoint_storage(job).latest_completed_checkpoint()
    assert mds[winners[0]] == load_checkpoint_metadata(resolved)


# --------------------------------------------------------------------------------------------
#  directories
# --------------------------------------------------------------------------------------------


def test_directory_layout_under_job_subdirectory(backend):
    """checkpoints_directory is <base>/<job>, with shared/ and taskowned/ below it."""
    job = JobID.generate()
    fs = fs_of(backend)
    base = norm(fs, backend.url("cp"))

    for job_arg in (job, str(job)):
        access = make_storage(backend).create_checkpoint_storage(job_arg)
        assert (
            str(job),
            f"{base}/{job}",
            f"{base}/{job}/shared",
            f"{base}/{job}/taskowned",
        ) == (
            str(access.job_id),
            norm(fs, access.checkpoints_directory),
            norm(fs, access.shared_state_directory),
            norm(fs, access.task_owned_state_directory),
        )


def test_directory_layout_without_job_subdirectory(backend):
    """With create_checkpoint_subdir=False the checkpoints live directly in the base dir."""
    fs = fs_of(backend)
    base = norm(fs, backend.url("cp"))
    access = make_storage(backend, create_checkpoint_subdir=False).create_checkpoint_storage(
        JobID.generate()
    )
    access.initialize_base_locations()
    completed, _ = complete_checkpoint(access, 3)

    assert (base, f"{base}/shared", f"{base}/taskowned", f"{base}/chk-3") == (
        norm(fs, access.checkpoints_directory),
        norm(fs, access.shared_state_directory),
        norm(fs, access.task_owned_state_directory),
        norm(fs, completed.external_pointer),
    )


def test_constructor_creates_no_directory_on_local_disk(tmp_path):
    """Building the storage and the access creates nothing on disk."""
    base = tmp_path / "cp"
    storage = FileSystemCheckpointStorage(str(base), savepoint_dir=str(tmp_path / "sp"))
    storage.create_checkpoint_storage(JobID.generate())

    assert [] == sorted(os.listdir(tmp_path))


def test_initialize_base_locations_creates_shared_and_taskowned_on_local_disk(tmp_path):
    """initialize_base_locations() creates <job>/shared and <job>/taskowned, and no chk dir."""
    job = JobID.generate()
    access = FileSystemCheckpointStorage(str(tmp_path / "cp")).create_checkpoint_storage(job)
    access.initialize_base_locations()

    job_dir = tmp_path / "cp" / str(job)
    assert (True, True) == (os.path.isdir(job_dir / "shared"), os.path.isdir(job_dir / "taskowned"))
    assert ["shared", "taskowned"] == sorted(os.listdir(job_dir))


def test_initialize_location_for_checkpoint_creates_chk_dir_on_local_disk(tmp_path):
    """initialize_location_for_checkpoint(id) creates chk-<id>."""
    job = JobID.generate()
    access = FileSystemCheckpointStorage(str(tmp_path / "cp")).create_checkpoint_storage(job)
    access.initialize_base_locations()
    access.initialize_location_for_checkpoint(42)

    assert os.path.isdir(tmp_path / "cp" / str(job) / "chk-42")


def test_negative_checkpoint_id_is_rejected(backend):
    """A negative checkpoint id is a ValueError."""
    access = new_access(backend)
    with pytest.raises(ValueError):
        access.initialize_location_for_checkpoint(-1)


def test_checkpoint_location_reference_is_the_default_reference(backend):
    """A checkpoint location is addressed by the default reference."""
    access = new_access(backend)
    location = access.initialize_location_for_checkpoint(8)

    assert DEFAULT_REF == location.location_reference
    assert location.location_reference.is_default_reference()


# --------------------------------------------------------------------------------------------
#  worker view
# --------------------------------------------------------------------------------------------


def test_worker_default_reference_writes_exclusive_to_chk_and_shared_to_shared(backend):
    """Default reference: EXCLUSIVE state lands in <job>/chk-<id>/, SHARED in <job>/shared/."""
    job = JobID.generate()
    coordinator = new_access(backend, job)
    coordinator.initialize_location_for_checkpoint(7)
    worker = make_storage(backend).create_checkpoint_storage(job)
    factory = worker.resolve_checkpoint_storage_location(7, DEFAULT_REF)
    data_ex, data_sh = payload(BIG, 1), payload(BIG, 2)

    exclusive = write_state(factory, data_ex, EXCLUSIVE)
    shared = write_state(factory, data_sh, SHARED)

    fs = fs_of(backend)
    job_dir = norm(fs, backend.url("cp", str(job)))
    assert [f"{job_dir}/chk-7", f"{job_dir}/shared"] == [
        parent(norm(fs, exclusive.path)),
        parent(norm(fs, shared.path)),
    ]
    assert (True, False) == (
        isinstance(exclusive, RelativeFileStateHandle),
        isinstance(shared, RelativeFileStateHandle),
    )
    assert [data_ex, data_sh] == [read(exclusive), read(shared)]
    assert [data_ex, data_sh] == [fs.cat_file(norm(fs, h.path)) for h in (exclusive, shared)]


def test_worker_non_default_reference_writes_into_decoded_directory(backend):
    """A path reference sends both scopes to the directory it encodes."""
    access = new_access(backend)
    target = backend.url("elsewhere", "dir")
    fs = fs_of(backend)
    fs.makedirs(norm(fs, target), exist_ok=True)  # the coordinator's job, done by hand here
    factory = access.resolve_checkpoint_storage_location(3, encode_path_as_reference(target))

    handles = [write_state(factory, payload(BIG, 3), s) for s in (EXCLUSIVE, SHARED)]

    assert [norm(fs, target)] * 2 == [parent(norm(fs, h.path)) for h in handles]
    assert [payload(BIG, 3)] * 2 == [read(h) for h in handles]


def test_task_owned_state_stream_writes_into_taskowned(backend):
    """create_task_owned_state_stream() writes files into <job>/taskowned/."""
    job = JobID.generate()
    access = new_access(backend, job)
    data = payload(BIG, 11)

    with access.create_task_owned_state_stream() as out:
        out.write(data)
        handle = out.close_and_get_handle()

    fs = fs_of(backend)
    assert isinstance(handle, FileStateHandle)
    assert norm(fs, backend.url("cp", str(job), "taskowned")) == parent(norm(fs, handle.path))
    assert data == read(handle)


def test_task_owned_toolset_duplicates_into_taskowned(backend):
    """duplicate(handles) copies file states into taskowned/; the copies outlive the originals."""
    job = JobID.generate()
    access = new_access(backend, job)
    location = access.initialize_location_for_checkpoint(1)
    data = [payload(BIG, 21), payload(BIG, 22)]
    originals = [write_state(location, data[0], EXCLUSIVE), write_state(location, data[1], SHARED)]

    copies = list(access.create_task_owned_checkpoint_state_toolset().duplicate(originals))

    fs = fs_of(backend)
    taskowned = norm(fs, backend.url("cp", str(job), "taskowned"))
    assert [taskowned] * 2 == [parent(norm(fs, c.path)) for c in copies]
    assert data == [read(c) for c in copies]
    location.dispose_on_failure()
    originals[1].discard_state()
    assert data == [read(c) for c in copies]


# --------------------------------------------------------------------------------------------
#  no mkdirs / no checks from the constructor and the worker path
# --------------------------------------------------------------------------------------------


def test_worker_path_creates_no_directory_on_local_disk(tmp_path):
    """Resolving a location and using streams below the threshold creates nothing on disk."""
    storage = FileSystemCheckpointStorage(str(tmp_path / "cp"), file_state_size_threshold=THRESHOLD)
    access = storage.create_checkpoint_storage(JobID.generate())
    factory = access.resolve_checkpoint_storage_location(177, DEFAULT_REF)

    small = factory.create_checkpoint_state_output_stream(EXCLUSIVE)
    small.write(b"x" * (THRESHOLD - 1))
    small.flush()
    inline = small.close_and_get_handle()
    aborted = factory.create_checkpoint_state_output_stream(SHARED)
    aborted.write(b"y" * 10)
    aborted.close()
    with access.create_task_owned_state_stream() as task_owned:
        task_owned.write(b"z")
        task_owned_inline = task_owned.close_and_get_handle()

    assert (True, True) == (
        isinstance(inline, ByteStreamStateHandle),
        isinstance(task_owned_inline, ByteStreamStateHandle),
    )
    assert [] == os.listdir(tmp_path)


def test_worker_path_on_s3_issues_puts_only(s3_server, s3_bucket):
    """On S3, building the access, resolving and writing N files costs N PUTs, no HEAD/GET/LIST."""
    storage = FileSystemCheckpointStorage(
        f"s3://{s3_bucket}/cp",
        storage_options=s3_server.storage_options,
        file_state_size_threshold=THRESHOLD,
    )
    job = JobID.generate()
    savepoint_dir = f"s3://{s3_bucket}/sp/savepoint-{str(job)[:6]}-0123456789ab"
    data = [payload(BIG, i) for i in range(5)]
    s3_server.clear_log()

    access = storage.create_checkpoint_storage(job)
    factory = access.resolve_checkpoint_storage_location(7, DEFAULT_REF)
    handles = [write_state(factory, data[i], EXCLUSIVE if i % 2 else SHARED) for i in range(3)]
    savepoint_factory = access.resolve_checkpoint_storage_location(
        8, encode_path_as_reference(savepoint_dir)
    )
    handles += [write_state(savepoint_factory, data[i]) for i in range(3, 5)]

    kinds = [r.kind for r in s3_server.requests]
    assert ["PUT"] * 5 == kinds
    assert data == [read(h) for h in handles]


# --------------------------------------------------------------------------------------------
#  metadata visibility
# --------------------------------------------------------------------------------------------


def test_metadata_does_not_exist_until_finalized(backend):
    """_metadata appears only at close_and_finalize_checkpoint()."""
    job = JobID.generate()
    access = new_access(backend, job)
    location = access.initialize_location_for_checkpoint(1)
    fs = fs_of(backend)
    directory = norm(fs, backend.url("cp", str(job), "chk-1"))
    md = metadata(1, [write_state(location, payload(BIG, 1))])

    out = location.create_metadata_output_stream()
    store_checkpoint_metadata(md, out)

    with pytest.raises(FileNotFoundError):
        fs.cat_file(directory + "/_metadata")
    assert None is access.latest_completed_checkpoint()
    with pytest.raises(FileNotFoundError):
        access.resolve_checkpoint(backend.url("cp", str(job), "chk-1"))

    completed = out.close_and_finalize_checkpoint()

    assert read(completed.metadata_handle) == fs_of(backend).cat_file(directory + "/_metadata")
    assert completed.external_pointer == access.latest_completed_checkpoint().external_pointer


def test_metadata_stream_closed_before_finalize_leaves_no_metadata(backend):
    """close() before finalize aborts: no _metadata, invisible to latest and resolve."""
    job = JobID.generate()
    access = new_access(backend, job)
    location = access.initialize_location_for_checkpoint(1)
    fs = fs_of(backend)
    directory = norm(fs, backend.url("cp", str(job), "chk-1"))

    out = location.create_metadata_output_stream()
    store_checkpoint_metadata(metadata(1), out)
    out.close()

    with pytest.raises(FileNotFoundError):
        fs_of(backend).cat_file(directory + "/_metadata")
    assert None is access.latest_completed_checkpoint()
    with pytest.raises(FileNotFoundError):
        access.resolve_checkpoint(backend.url("cp", str(job), "chk-1"))


# --------------------------------------------------------------------------------------------
#  latest completed checkpoint
# --------------------------------------------------------------------------------------------


def test_latest_completed_checkpoint_is_numeric(backend):
    """chk-100 beats chk-99 (and chk-9)."""
    access = new_access(backend)
    for checkpoint_id in (9, 100, 99):
        complete_checkpoint(access, checkpoint_id, master=str(checkpoint_id).encode())

    latest = access.latest_completed_checkpoint()

    assert re.search(r"/chk-100$", latest.external_pointer)
    assert {"pos": b"100"} == load_checkpoint_metadata(latest).master_states


def _plant_metadata(backend, job, name: str, data: bytes) -> None:
    fs = fs_of(backend)
    directory = norm(fs, backend.url("cp", str(job), name))
    fs.makedirs(directory, exist_ok=True)
    fs.pipe_file(directory + "/_metadata", data)


def test_latest_completed_checkpoint_ignores_junk_names(backend):
    """chk-01, chk-x, chk--1, chk- and chk-0200 are not checkpoints, even with valid _metadata."""
    job = JobID.generate()
    access = new_access(backend, job)
    completed, _ = complete_checkpoint(access, 100)
    good = read(completed.metadata_handle)
    for name in ("chk-01", "chk-0200", "chk-x", "chk--1", "chk--500", "chk-", "chk-7x", "chk"):
        _plant_metadata(backend, job, name, good)

    assert completed.external_pointer == access.latest_completed_checkpoint().external_pointer


def test_latest_completed_checkpoint_ignores_names_only_int_accepts(backend):
    """Names Python's int() would parse but the library never writes (+, _, space, non-ASCII
    digits) are junk."""
    job = JobID.generate()
    access = new_access(backend, job)
    completed, _ = complete_checkpoint(access, 100)
    good = read(completed.metadata_handle)
    for name in ("chk-+400", "chk-4_00", "chk- 400", "chk-400 ", "chk-\u0665\u0660\u0660"):
        _plant_metadata(backend, job, name, good)

    assert completed.external_pointer == access.latest_completed_checkpoint().external_pointer


def test_latest_completed_checkpoint_skips_incomplete_and_corrupt(backend):
    """Newer chk dirs without _metadata, or with garbage or truncated _metadata, are skipped."""
    job = JobID.generate()
    access = new_access(backend, job)
    complete_checkpoint(access, 99)
    completed, md = complete_checkpoint(access, 100, [payload(BIG, 100)])
    good = read(completed.metadata_handle)
    incomplete = access.initialize_location_for_checkpoint(103)
    write_state(incomplete, payload(BIG, 103))
    _plant_metadata(backend, job, "chk-101", b"this is not a checkpoint" * 10)
    _plant_metadata(backend, job, "chk-102", good[: len(good) // 2])

    latest = access.latest_completed_checkpoint()

    assert completed.external_pointer == latest.external_pointer
    assert md == load_checkpoint_metadata(latest)


def test_latest_completed_checkpoint_is_none_without_checkpoints(backend):
    """A job with no checkpoint (no directory at all, or only base locations) has none."""
    storage = make_storage(backend)
    job = JobID.generate()
    fresh = storage.create_checkpoint_storage(job)
    assert None is fresh.latest_completed_checkpoint()
    fresh.initialize_base_locations()
    fresh.initialize_location_for_checkpoint(1)
    assert None is storage.create_checkpoint_storage(job).latest_completed_checkpoint()


# --------------------------------------------------------------------------------------------
#  entropy injection
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["memory", "s3"], indirect=True)
def test_entropy_injected_in_data_files_and_removed_from_metadata(backend):
    """Data files get random characters for the marker; _metadata and pointer drop it."""
    job = JobID.generate()
    storage = FileSystemCheckpointStorage(
        backend.url("_entropy_", "cp"),
        storage_options=dict(backend.storage_options),
        file_state_size_threshold=THRESHOLD,
        entropy_injection_key="_entropy_",
        entropy_length=6,
    )
    access = storage.create_checkpoint_storage(job)
    access.initialize_base_locations()
    location = access.initialize_location_for_checkpoint(1)
    data = [payload(BIG, 1), payload(BIG, 2), payload(BIG, 3), b"inline"]
    handles = [
        write_state(location, data[0], EXCLUSIVE),
        write_state(location, data[1], SHARED),
        write_state(access.resolve_checkpoint_storage_location(1, DEFAULT_REF), data[2]),
        write_state(location, data[3]),
    ]
    with access.create_task_owned_state_stream() as out:
        out.write(data[0])
        task_owned = out.close_and_get_handle()
    completed = finalize(location, metadata(1, handles))

    fs = fs_of(backend)
    base = norm(fs, backend.base_url)
    entropy = r"[A-Za-z0-9]{6}"
    file_paths = [norm(fs, h.path) for h in (*handles[:3], task_owned)]
    expected_dirs = ["chk-1", "shared", "chk-1", "taskowned"]
    for path, sub in zip(file_paths, expected_dirs, strict=True):
        assert re.fullmatch(rf"{re.escape(base)}/{entropy}/cp/{job}/{sub}/[^/]+", path), path
    assert [FileStateHandle] * 4 == [type(h) for h in (*handles[:3], task_owned)]
    assert f"{base}/cp/{job}/chk-1" == norm(fs, completed.external_pointer)
    assert f"{base}/cp/{job}/chk-1/_metadata" == norm(fs, completed.metadata_handle.path)
    assert read(completed.metadata_handle) == fs.cat_file(f"{base}/cp/{job}/chk-1/_metadata")
    resolved = access.resolve_checkpoint(completed.external_pointer)
    assert data == [read(h) for h in loaded_handles(load_checkpoint_metadata(resolved))]
    assert completed.external_pointer == access.latest_completed_checkpoint().external_pointer
    assert "_entropy_" not in completed.external_pointer


@pytest.mark.parametrize("backend", ["memory", "s3"], indirect=True)
def test_entropy_checkpoint_resolves_through_the_configured_storage(backend):
    """FileSystemCheckpointStorage.resolve_checkpoint (the entropy-configured storage itself,
    also after pickling) loads an entropy checkpoint's metadata and its states."""
    storage = FileSystemCheckpointStorage(
        backend.url("_entropy_", "cp"),
        storage_options=dict(backend.storage_options),
        file_state_size_threshold=THRESHOLD,
        entropy_injection_key="_entropy_",
    )
    access = storage.create_checkpoint_storage(JobID.generate())
    access.initialize_base_locations()
    location = access.initialize_location_for_checkpoint(1)
    data = [payload(BIG, 1), payload(BIG, 2)]
    handles = [write_state(location, data[0]), write_state(location, data[1], SHARED)]
    completed = finalize(location, metadata(1, handles))

    for resolver in (storage, pickle.loads(pickle.dumps(storage))):
        loaded = load_checkpoint_metadata(resolver.resolve_checkpoint(completed.external_pointer))
        assert data == [read(h) for h in loaded_handles(loaded)]


@pytest.mark.parametrize("backend", ["memory", "s3"], indirect=True)
def test_entropy_key_absent_from_checkpoint_dir_injects_nothing(backend):
    """A configured key that does not occur in the checkpoint dir changes no path."""
    job = JobID.generate()
    storage = make_storage(backend, entropy_injection_key="_entropy_")
    access = storage.create_checkpoint_storage(job)
    access.initialize_base_locations()
    location = access.initialize_location_for_checkpoint(1)

    handle = write_state(location, payload(BIG, 1))

    fs = fs_of(backend)
    assert isinstance(handle, RelativeFileStateHandle)
    assert norm(fs, backend.url("cp", str(job), "chk-1")) == parent(norm(fs, handle.path))


def test_entropy_on_local_disk_is_rejected(tmp_path):
    """Local disk has no key spreading: an entropy key there is a ValueError."""
    with pytest.raises(ValueError):
        storage = FileSystemCheckpointStorage(
            str(tmp_path / "_entropy_" / "cp"), entropy_injection_key="_entropy_"
        )
        storage.create_checkpoint_storage(JobID.generate()).initialize_base_locations()


# --------------------------------------------------------------------------------------------
#  dispose
# --------------------------------------------------------------------------------------------


def test_dispose_on_failure_removes_checkpoint_directory_recursively(backend):
    """dispose_on_failure() removes chk-<id> and its files; other checkpoints and shared stay."""
    job = JobID.generate()
    access = new_access(backend, job)
    survivor, survivor_md = complete_checkpoint(access, 2, [payload(BIG, 2)])
    location = access.initialize_location_for_checkpoint(3)
    for seed in (31, 32):
        write_state(location, payload(BIG, seed))
    shared = write_state(location, payload(BIG, 33), SHARED)

    location.dispose_on_failure()

    fs = fs_of(backend)
    chk3 = norm(fs, backend.url("cp", str(job), "chk-3"))
    assert (False, []) == (fs.exists(chk3), fs.find(chk3))
    resolved = access.resolve_checkpoint(survivor.external_pointer)
    assert [payload(BIG, 2)] == [
        read(h) for h in loaded_handles(load_checkpoint_metadata(resolved))
    ]
    assert payload(BIG, 33) == read(shared)
    assert survivor.external_pointer == access.latest_completed_checkpoint().external_pointer


def test_dispose_storage_location_removes_completed_checkpoint_recursively(backend):
    """dispose_storage_location() removes the completed chk dir; latest falls back."""
    job = JobID.generate()
    access = new_access(backend, job)
    older, older_md = complete_checkpoint(access, 1, [payload(BIG, 1)])
    newer, _ = complete_checkpoint(access, 2, [payload(BIG, 2), payload(BIG, 3)])

    newer.dispose_storage_location()

    fs = fs_of(backend)
    chk2 = norm(fs, backend.url("cp", str(job), "chk-2"))
    assert (False, []) == (fs.exists(chk2), fs.find(chk2))
    with pytest.raises(FileNotFoundError):
        access.resolve_checkpoint(newer.external_pointer)
    latest = access.latest_completed_checkpoint()
    assert older.external_pointer == latest.external_pointer
    assert older_md == load_checkpoint_metadata(latest)


# --------------------------------------------------------------------------------------------
#  pickling and configuration
# --------------------------------------------------------------------------------------------


def test_completed_location_is_picklable(backend):
    """A pickled completed location keeps its pointer and still loads its metadata."""
    access = new_access(backend)
    completed, md = complete_checkpoint(access, 6, [payload(BIG, 6), b"inline"])

    copy = pickle.loads(pickle.dumps(completed))

    assert completed.external_pointer == copy.external_pointer
    assert md == load_checkpoint_metadata(copy)
    assert [payload(BIG, 6), b"inline"] == [
        read(h) for h in loaded_handles(load_checkpoint_metadata(copy))
    ]


def test_storage_is_picklable_and_its_copy_reaches_the_same_checkpoints(backend):
    """A pickled FileSystemCheckpointStorage (as shipped to executors) sees the same layout."""
    job = JobID.generate()
    storage = make_storage(backend)
    access = storage.create_checkpoint_storage(job)
    access.initialize_base_locations()
    completed, md = complete_checkpoint(access, 4, [payload(BIG, 4)])

    copy = pickle.loads(pickle.dumps(storage)).create_checkpoint_storage(job)

    assert access.checkpoints_directory == copy.checkpoints_directory
    assert completed.external_pointer == copy.latest_completed_checkpoint().external_pointer
    assert md == load_checkpoint_metadata(copy.resolve_checkpoint(completed.external_pointer))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"file_state_size_threshold": -1},
        {"file_state_size_threshold": 1024 * 1024 + 1},
        {"write_buffer_size": -1},
    ],
)
def test_storage_rejects_bad_sizes(tmp_path, kwargs):
    """Threshold below 0 or above 1 MiB, or a negative buffer, is a ValueError."""
    with pytest.raises(ValueError):
        FileSystemCheckpointStorage(str(tmp_path), **kwargs)


@pytest.mark.parametrize("threshold", [0, 1024 * 1024])
def test_storage_accepts_threshold_bounds(tmp_path, threshold):
    """Thresholds 0 and 1 MiB are valid; at 0 every non-empty state goes to a file."""
    access = FileSystemCheckpointStorage(
        str(tmp_path), file_state_size_threshold=threshold
    ).create_checkpoint_storage(JobID.generate())
    access.initialize_base_locations()
    location = access.initialize_location_for_checkpoint(1)

    handle = write_state(location, b"x")

    assert (threshold == 0) == isinstance(handle, FileStateHandle)
    assert b"x" == read(handle)
