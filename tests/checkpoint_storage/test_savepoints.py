"""Savepoints: target resolution, one self-contained directory, relocation.

Ported from the savepoint behaviours Flink pins in AbstractFileCheckpointStorageAccessTestBase
(the four target cases) and FsCheckpointStorageAccessTest (savepoints in one directory), plus
the relocatable-savepoint rule of docs/design.md §3.3. Runs on memory://, local disk and S3 (moto).
"""

import os
import pickle
import re

import fsspec
import pytest

from checkpoint_storage import (
    CheckpointedStateScope,
    FileStateHandle,
    FileSystemCheckpointStorage,
    JobID,
    decode_path_from_reference,
    load_checkpoint_metadata,
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

THRESHOLD = 1024
BIG = 2048
SAVEPOINT_ID = 52452

pytestmark = pytest.mark.timeout(60)  # the backend fixture includes S3


# --------------------------------------------------------------------------------------------
#  helpers
# --------------------------------------------------------------------------------------------


def name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def make_storage(backend, savepoint_dir=None) -> FileSystemCheckpointStorage:
    return FileSystemCheckpointStorage(
        backend.url("cp"),
        savepoint_dir,
        storage_options=dict(backend.storage_options),
        file_state_size_threshold=THRESHOLD,
    )


def take_savepoint(backend, default_dir, target, job=None):
    """Write one file state and finalize a savepoint; returns (access, completed, data)."""
    access = make_storage(backend, default_dir).create_checkpoint_storage(job or JobID.generate())
    location = access.initialize_location_for_savepoint(SAVEPOINT_ID, target)
    data = payload(BIG, 1)
    completed = finalize(location, metadata(SAVEPOINT_ID, [write_state(location, data)]))
    return access, completed, data


# --------------------------------------------------------------------------------------------
#  target resolution (Flink's four cases)
# --------------------------------------------------------------------------------------------


def test_savepoint_target_wins_over_configured_default(backend):
    """Default configured and a target given: the savepoint goes under the target."""
    fs = fs_of(backend)
    access, completed, data = take_savepoint(
        backend, backend.url("default-sp"), backend.url("custom")
    )

    assert access.has_default_savepoint_location()
    assert norm(fs, backend.url("custom")) == parent(norm(fs, completed.external_pointer))
    assert norm(fs, completed.external_pointer) == parent(norm(fs, completed.metadata_handle.path))
    assert [data] == [read(h) for h in loaded_handles(load_checkpoint_metadata(completed))]


def test_savepoint_without_target_uses_configured_default(backend):
    """Default configured and no target: the savepoint goes under the default."""
    fs = fs_of(backend)
    access, completed, data = take_savepoint(backend, backend.url("default-sp"), None)

    assert norm(fs, backend.url("default-sp")) == parent(norm(fs, completed.external_pointer))
    assert norm(fs, completed.external_pointer) == parent(norm(fs, completed.metadata_handle.path))
    assert [data] == [read(h) for h in loaded_handles(load_checkpoint_metadata(completed))]


def test_savepoint_target_without_configured_default(backend):
    """No default, a target given: the savepoint goes under the target."""
    fs = fs_of(backend)
    access, completed, data = take_savepoint(backend, None, backend.url("custom"))

    assert not access.has_default_savepoint_location()
    assert norm(fs, backend.url("custom")) == parent(norm(fs, completed.external_pointer))
    assert [data] == [read(h) for h in loaded_handles(load_checkpoint_metadata(completed))]


def test_savepoint_without_target_and_without_default_fails(backend):
    """No default and no target is a ValueError."""
    access = make_storage(backend).create_checkpoint_storage(JobID.generate())

    assert not access.has_default_savepoint_location()
    with pytest.raises(ValueError):
        access.initialize_location_for_savepoint(1337, None)
    with pytest.raises(ValueError):
        access.initialize_location_for_savepoint(1337)


# --------------------------------------------------------------------------------------------
#  the savepoint directory
# --------------------------------------------------------------------------------------------


def test_savepoint_directory_name(backend):
    """The directory is savepoint-<job_id[:6]>-<12 hex>, and each savepoint gets a new one."""
    job = JobID.generate()
    access = make_storage(backend, backend.url("sp")).create_checkpoint_storage(job)
    fs = fs_of(backend)

    directories = [
        decode_path_from_reference(access.initialize_location_for_savepoint(i).location_reference)
        for i in (1, 2)
    ]

    for directory in directories:
        assert re.fullmatch(rf"savepoint-{str(job)[:6]}-[0-9a-f]{{12}}", name(directory)), directory
        assert norm(fs, backend.url("sp")) == parent(norm(fs, directory))
    assert directories[0] != directories[1]


def test_savepoint_reference_is_not_default_and_decodes_to_the_directory(backend):
    """A savepoint location's reference encodes its directory (= the external pointer)."""
    access = make_storage(backend, backend.url("sp")).create_checkpoint_storage(JobID.generate())
    location = access.initialize_location_for_savepoint(SAVEPOINT_ID)
    fs = fs_of(backend)

    completed = finalize(location, metadata(SAVEPOINT_ID))

    assert not location.location_reference.is_default_reference()
    assert norm(fs, completed.external_pointer) == norm(
        fs, decode_path_from_reference(location.location_reference)
    )


def test_savepoint_creates_missing_parent_directories(backend):
    """A target under directories that do not exist yet works (they are created)."""
    fs = fs_of(backend)
    target = backend.url("not", "yet", "there")
    access, completed, data = take_savepoint(backend, None, target)

    assert norm(fs, target) == parent(norm(fs, completed.external_pointer))
    assert [data] == [read(h) for h in loaded_handles(load_checkpoint_metadata(completed))]


def test_savepoint_directory_exists_on_local_disk_before_any_state(tmp_path):
    """On local disk initialize_location_for_savepoint creates the directory and its parents."""
    storage = FileSystemCheckpointStorage(str(tmp_path / "cp"))
    access = storage.create_checkpoint_storage(JobID.generate())

    location = access.initialize_location_for_savepoint(7, str(tmp_path / "a" / "b" / "c"))

    directory = decode_path_from_reference(location.location_reference)
    assert os.path.isdir(type(fsspec.filesystem("file"))._strip_protocol(directory))
    assert str(tmp_path / "a" / "b" / "c") == parent(
        type(fsspec.filesystem("file"))._strip_protocol(directory)
    )


def test_savepoint_state_all_in_one_directory(backend):
    """Exclusive and shared state, written by the coordinator's location or by a worker that
    resolved the savepoint reference, all land directly in the savepoint directory."""
    job = JobID.generate()
    storage = make_storage(backend, backend.url("sp"))
    access = storage.create_checkpoint_storage(job)
    access.initialize_base_locations()
    location = access.initialize_location_for_savepoint(SAVEPOINT_ID)
    worker = pickle.loads(pickle.dumps(storage)).create_checkpoint_storage(job)
    factory = worker.resolve_checkpoint_storage_location(SAVEPOINT_ID, location.location_reference)
    data = [payload(BIG, i) for i in range(4)]

    handles = [
        write_state(location, data[0], EXCLUSIVE),
        write_state(location, data[1], SHARED),
        write_state(factory, data[2], EXCLUSIVE),
        write_state(factory, data[3], SHARED),
    ]
    completed = finalize(location, metadata(SAVEPOINT_ID, handles))

    fs = fs_of(backend)
    directory = norm(fs, completed.external_pointer)
    assert [directory] * 4 == [parent(norm(fs, h.path)) for h in handles]
    assert sorted(["_metadata", *(name(norm(fs, h.path)) for h in handles)]) == sorted(
        name(p) for p in fs.find(directory)
    )
    assert [True] * 4 == [isinstance(h, FileStateHandle) for h in handles]
    for directory_url in (access.shared_state_directory, access.task_owned_state_directory):
        assert [] == fs.find(norm(fs, directory_url))
    assert data == [read(h) for h in loaded_handles(load_checkpoint_metadata(completed))]


def test_savepoint_is_not_a_checkpoint(backend):
    """A savepoint under the default savepoint dir is not returned as latest checkpoint."""
    access, completed, _ = take_savepoint(backend, backend.url("sp"), None)

    assert None is access.latest_completed_checkpoint()


@pytest.mark.parametrize("backend", ["memory", "s3"], indirect=True)
def test_savepoint_on_another_filesystem_than_the_checkpoints(backend, tmp_path):
    """Checkpoints on memory:// or S3, savepoint target on local disk: coordinator and worker
    both write there and the savepoint resolves and restores."""
    job = JobID.generate()
    storage = make_storage(backend)
    access = storage.create_checkpoint_storage(job)
    access.initialize_base_locations()
    target = str(tmp_path / "savepoints")
    location = access.initialize_location_for_savepoint(SAVEPOINT_ID, target)
    worker = pickle.loads(pickle.dumps(storage)).create_checkpoint_storage(job)
    factory = worker.resolve_checkpoint_storage_location(SAVEPOINT_ID, location.location_reference)
    data = [payload(BIG, 1), payload(BIG, 2)]

    handles = [write_state(location, data[0]), write_state(factory, data[1], SHARED)]
    completed = finalize(location, metadata(SAVEPOINT_ID, handles))

    local = fsspec.filesystem("file")
    directory = norm(local, completed.external_pointer)
    assert target == parent(directory)
    assert sorted(["_metadata", *(name(norm(local, h.path)) for h in handles)]) == sorted(
        os.listdir(directory)
    )
    resolved = storage.resolve_checkpoint(directory)
    assert data == [read(h) for h in loaded_handles(load_checkpoint_metadata(resolved))]


def test_savepoint_dispose_removes_its_directory_recursively(backend):
    """dispose_on_failure() of a savepoint location and dispose_storage_location() of a
    completed savepoint remove the savepoint directory and its files."""
    access = make_storage(backend, backend.url("sp")).create_checkpoint_storage(JobID.generate())
    failed = access.initialize_location_for_savepoint(1)
    write_state(failed, payload(BIG, 1))
    write_state(failed, payload(BIG, 2), SHARED)
    done = access.initialize_location_for_savepoint(2)
    completed = finalize(done, metadata(2, [write_state(done, payload(BIG, 3))]))
    fs = fs_of(backend)
    directories = [
        norm(fs, decode_path_from_reference(failed.location_reference)),
        norm(fs, completed.external_pointer),
    ]

    failed.dispose_on_failure()
    completed.dispose_storage_location()

    fs.invalidate_cache()
    assert [(False, [])] * 2 == [(fs.exists(d), fs.find(d)) for d in directories]


# --------------------------------------------------------------------------------------------
#  relocation
# --------------------------------------------------------------------------------------------


def test_copied_savepoint_directory_resolves_and_restores(backend):
    """A savepoint directory copied elsewhere (original deleted) resolves and all its states,
    exclusive and shared, read back from the new place."""
    job = JobID.generate()
    storage = make_storage(backend, backend.url("sp"))
    access = storage.create_checkpoint_storage(job)
    location = access.initialize_location_for_savepoint(SAVEPOINT_ID)
    data = [payload(BIG, 1), payload(BIG * 3, 2), b"inline", payload(BIG, 3)]
    scopes = [EXCLUSIVE, EXCLUSIVE, EXCLUSIVE, SHARED]
    handles = [write_state(location, d, s) for d, s in zip(data, scopes, strict=True)]
    md = metadata(SAVEPOINT_ID, handles, master=b"offset-17")
    completed = finalize(location, md)
    fs = fs_of(backend)
    source = norm(fs, completed.external_pointer)
    moved_url = backend.url("moved", "restore-here")

    fs.copy(source, norm(fs, moved_url), recursive=True)
    fs.rm(source, recursive=True)
    fs.invalidate_cache()

    for resolver in (access, make_storage(backend)):
        for pointer in (moved_url, moved_url + "/", moved_url + "/_metadata"):
            moved = resolver.resolve_checkpoint(pointer)
            loaded = load_checkpoint_metadata(moved)
            assert norm(fs, moved_url) == norm(fs, moved.external_pointer)
            assert {"pos": b"offset-17"} == loaded.master_states
            assert data == [read(h) for h in loaded_handles(loaded)]
            file_handles = [h for h in loaded_handles(loaded) if isinstance(h, FileStateHandle)]
            assert [norm(fs, moved_url)] * 3 == [parent(norm(fs, h.path)) for h in file_handles]


def test_task_owned_state_of_a_savepoint_lands_in_the_savepoint_directory(backend):
    """A worker's task-owned stream for a savepoint writes into the savepoint directory, and
    the savepoint still restores after the directory is moved."""
    access = make_storage(backend, backend.url("sp")).create_checkpoint_storage(JobID.generate())
    location = access.initialize_location_for_savepoint(SAVEPOINT_ID)
    worker = access.resolve_checkpoint_storage_location(SAVEPOINT_ID, location.location_reference)
    data = payload(BIG, 3)
    with worker.create_task_owned_state_stream() as out:
        out.write(data)
        handle = out.close_and_get_handle()
    completed = finalize(location, metadata(SAVEPOINT_ID, [handle]))
    fs = fs_of(backend)
    moved = backend.url("moved")
    fs.copy(norm(fs, completed.external_pointer), norm(fs, moved), recursive=True)
    fs.invalidate_cache()

    restored = loaded_handles(load_checkpoint_metadata(access.resolve_checkpoint(moved)))

    assert norm(fs, completed.external_pointer) == parent(norm(fs, handle.path))
    assert [data] == [read(h) for h in restored]
