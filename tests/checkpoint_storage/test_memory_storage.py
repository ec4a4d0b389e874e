"""MemoryCheckpointStorage: Flink's JobManagerCheckpointStorage.

Ported from the behaviours Flink pins in MemoryCheckpointStorageAccessTest,
MemoryCheckpointOutputStreamTest and JobManagerCheckpointStorageTest: states are always inline,
a state above ``max_state_size`` fails at ``close_and_get_handle()``, ``_metadata`` is persisted
only when a checkpoint directory is configured. The persistent cases run on memory:// and local
disk (this storage takes no storage options, so it is not pointed at the moto S3 server).
"""

import os
import re
import uuid

import fsspec
import pytest

from checkpoint_storage import (
    ByteStreamStateHandle,
    CheckpointedStateScope,
    CheckpointStorageLocationReference,
    FileSystemCheckpointStorage,
    JobID,
    MemoryCheckpointStorage,
    decode_path_from_reference,
    load_checkpoint_metadata,
    store_checkpoint_metadata,
)
from tests.support import (
    finalize,
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

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------------------------
#  helpers
# --------------------------------------------------------------------------------------------


@pytest.fixture(params=["memory", "local"])
def base_url(request, tmp_path) -> str:
    """A fresh directory URL on a filesystem MemoryCheckpointStorage can persist to."""
    if request.param == "memory":
        return f"memory://mem-{uuid.uuid4().hex}"
    return str(tmp_path / "base")


def fs_for(url: str):
    fs, _ = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return fs


# --------------------------------------------------------------------------------------------
#  configuration
# --------------------------------------------------------------------------------------------


def test_defaults_are_not_highly_available_and_have_no_savepoint_dir():
    """Without directories: not highly available, no default savepoint location."""
    access = MemoryCheckpointStorage().create_checkpoint_storage(JobID.generate())

    assert (False, False) == (
        access.supports_highly_available_storage(),
        access.has_default_savepoint_location(),
    )


def test_directories_make_it_highly_available_with_default_savepoint_dir(base_url):
    """With a checkpoint dir it is highly available; a savepoint dir gives a default location."""
    storage = MemoryCheckpointStorage(base_url + "/cp", base_url + "/sp")
    access = storage.create_checkpoint_storage(JobID.generate())

    assert (True, True) == (
        access.supports_highly_available_storage(),
        access.has_default_savepoint_location(),
    )


# --------------------------------------------------------------------------------------------
#  streams
# --------------------------------------------------------------------------------------------


def test_every_stream_returns_inline_handles():
    """Exclusive, shared, worker-resolved and task-owned streams all give byte handles, even
    above the file storage's default threshold."""
    access = MemoryCheckpointStorage().create_checkpoint_storage(JobID.generate())
    location = access.initialize_location_for_checkpoint(1)
    worker = access.resolve_checkpoint_storage_location(1, DEFAULT_REF)
    data = [payload(100 * 1024, seed) for seed in range(4)]

    handles = [
        write_state(location, data[0], EXCLUSIVE),
        write_state(location, data[1], SHARED),
        write_state(worker, data[2], SHARED),
    ]
    with access.create_task_owned_state_stream() as out:
        out.write(data[3])
        handles.append(out.close_and_get_handle())

    assert [True] * 4 == [isinstance(h, ByteStreamStateHandle) for h in handles]
    assert [len(d) for d in data] == [h.state_size for h in handles]
    assert data == [read(h) for h in handles]


def test_state_of_exactly_max_size_is_accepted():
    """A state of exactly max_state_size bytes is fine."""
    storage = MemoryCheckpointStorage(max_state_size=4321)
    location = storage.create_checkpoint_storage(
        JobID.generate()
    ).initialize_location_for_checkpoint(1)

    handle = write_state(location, payload(4321, 1))

    assert (4321, payload(4321, 1)) == (handle.state_size, read(handle))


def test_oversized_state_fails_at_close_and_get_handle_naming_both_sizes():
    """Writing past max_state_size fails at close_and_get_handle() with an OSError that names
    the state size and the maximum and suggests the file system storage."""
    storage = MemoryCheckpointStorage(max_state_size=4321)
    location = storage.create_checkpoint_storage(
        JobID.generate()
    ).initialize_location_for_checkpoint(1)
    out = location.create_checkpoint_state_output_stream(EXCLUSIVE)
    out.write(payload(4000, 1))
    for _ in range(22):
        out.write(b"x")  # single-byte writes count too: 4022 bytes
    out.write(payload(978, 2))  # 5000 bytes, all accepted by write()

    with pytest.raises(OSError) as info:
        out.close_and_get_handle()

    message = str(info.value)
    assert ("5000" in message, "4321" in message) == (True, True), message
    assert "filesystem" in message.lower().replace(" ", ""), message


# --------------------------------------------------------------------------------------------
#  checkpoints without a directory (in memory)
# --------------------------------------------------------------------------------------------


def test_non_persistent_checkpoint_keeps_metadata_inline():
    """Without a checkpoint dir the metadata handle is a byte handle and round-trips."""
    access = MemoryCheckpointStorage().create_checkpoint_storage(JobID.generate())
    location = access.initialize_location_for_checkpoint(9)
    md = metadata(9, [write_state(location, payload(300, 9))])

    completed = finalize(location, md)

    assert isinstance(completed.metadata_handle, ByteStreamStateHandle)
    assert md == load_checkpoint_metadata(completed)
    assert DEFAULT_REF == location.location_reference


def test_non_persistent_pointer_is_not_resolvable():
    """Without a checkpoint dir the external pointer cannot be resolved (FileNotFoundError)."""
    storage = MemoryCheckpointStorage()
    access = storage.create_checkpoint_storage(JobID.generate())
    completed = finalize(access.initialize_location_for_checkpoint(9), metadata(9))

    for resolve in (access.resolve_checkpoint, storage.resolve_checkpoint):
        with pytest.raises(FileNotFoundError):
            resolve(completed.external_pointer)


def test_non_persistent_latest_completed_checkpoint_is_numeric():
    """In memory, the latest completed checkpoint of the access is the highest id."""
    access = MemoryCheckpointStorage().create_checkpoint_storage(JobID.generate())
    assert None is access.latest_completed_checkpoint()
    for checkpoint_id in (9, 100, 99):
        finalize(
            access.initialize_location_for_checkpoint(checkpoint_id),
            metadata(checkpoint_id, master=str(checkpoint_id).encode()),
        )

    latest = access.latest_completed_checkpoint()

    assert {"pos": b"100"} == load_checkpoint_metadata(latest).master_states


def test_non_persistent_second_metadata_stream_fails():
    """In memory too, a finalized location refuses a second _metadata."""
    access = MemoryCheckpointStorage().create_checkpoint_storage(JobID.generate())
    location = access.initialize_location_for_checkpoint(3)
    md = metadata(3, master=b"first")
    finalize(location, md)

    with pytest.raises(FileExistsError):
        finalize(location, metadata(3, master=b"second"))

    assert md == load_checkpoint_metadata(access.latest_completed_checkpoint())


# --------------------------------------------------------------------------------------------
#  checkpoints with a directory (persisted _metadata)
# --------------------------------------------------------------------------------------------


def test_persistent_checkpoint_writes_metadata_into_chk_dir(base_url):
    """With a checkpoint dir, _metadata lands in <dir>/<job>/chk-<id>/ and states stay inline."""
    job = JobID.generate()
    storage = MemoryCheckpointStorage(base_url + "/cp")
    access = storage.create_checkpoint_storage(job)
    access.initialize_base_locations()
    location = access.initialize_location_for_checkpoint(5)
    data = payload(50 * 1024, 5)
    md = metadata(5, [write_state(location, data)])

    completed = finalize(location, md)

    fs = fs_for(base_url)
    chk = norm(fs, f"{base_url}/cp/{job}/chk-5")
    assert [f"{chk}/_metadata"] == [norm(fs, p) for p in fs.find(chk)]
    assert chk == norm(fs, completed.external_pointer)
    assert read(completed.metadata_handle) == fs.cat_file(f"{chk}/_metadata")
    assert DEFAULT_REF == location.location_reference


def test_persistent_checkpoint_resolves_from_a_fresh_storage(base_url):
    """A persisted checkpoint resolves (dir, dir/, _metadata) and is the latest for a new access."""
    job = JobID.generate()
    access = MemoryCheckpointStorage(base_url + "/cp").create_checkpoint_storage(job)
    location = access.initialize_location_for_checkpoint(5)
    data = payload(1000, 5)
    md = metadata(5, [write_state(location, data)], master=b"offset-5")
    pointer = finalize(location, md).external_pointer

    fresh = MemoryCheckpointStorage(base_url + "/cp")
    resolved = [
        fresh.resolve_checkpoint(p) for p in (pointer, pointer + "/", pointer + "/_metadata")
    ]
    latest = fresh.create_checkpoint_storage(job).latest_completed_checkpoint()

    assert [pointer] * 4 == [r.external_pointer for r in (*resolved, latest)]
    assert [md] * 4 == [load_checkpoint_metadata(r) for r in (*resolved, latest)]
    assert [data] == [read(h) for h in loaded_handles(load_checkpoint_metadata(latest))]


def test_persistent_constructor_creates_nothing_and_location_creates_chk_dir(tmp_path):
    """Only initialize_location_for_checkpoint creates directories (Flink's mkdirs test)."""
    job = JobID.generate()
    storage = MemoryCheckpointStorage(str(tmp_path / "cp"), str(tmp_path / "sp"))
    access = storage.create_checkpoint_storage(job)
    assert [] == os.listdir(tmp_path)

    access.initialize_location_for_checkpoint(177)

    assert os.path.isdir(tmp_path / "cp" / str(job) / "chk-177")


def test_persistent_put_if_absent_between_two_independent_accesses(base_url):
    """Two independent coordinators on one job: one finalize of chk-5 wins, the other fails."""
    job = JobID.generate()
    accesses = [
        MemoryCheckpointStorage(base_url + "/cp").create_checkpoint_storage(str(job))
        for _ in range(2)
    ]
    locations = [a.initialize_location_for_checkpoint(5) for a in accesses]
    mds = [metadata(5, master=b"a"), metadata(5, master=b"b")]
    outs = []
    for location, md in zip(locations, mds, strict=True):
        out = location.create_metadata_output_stream()
        store_checkpoint_metadata(md, out)
        outs.append(out)

    winner = outs[0].close_and_finalize_checkpoint()
    with pytest.raises(FileExistsError):
        outs[1].close_and_finalize_checkpoint()

    for access in accesses:
        assert mds[0] == load_checkpoint_metadata(
            access.resolve_checkpoint(winner.external_pointer)
        )


# --------------------------------------------------------------------------------------------
#  savepoints and task-owned state
# --------------------------------------------------------------------------------------------


def test_savepoint_persists_metadata_with_inline_state(base_url):
    """A savepoint goes to savepoint-<job[:6]>-<12 hex>/ under the default dir, state inline."""
    job = JobID.generate()
    access = MemoryCheckpointStorage(None, base_url + "/sp").create_checkpoint_storage(job)
    location = access.initialize_location_for_savepoint(1337)
    data = payload(64 * 1024, 7)
    handle = write_state(location, data)
    md = metadata(1337, [handle], master=b"sp")

    completed = finalize(location, md)

    fs = fs_for(base_url)
    directory = norm(fs, completed.external_pointer)
    assert norm(fs, base_url + "/sp") == parent(directory)
    assert re.fullmatch(rf"savepoint-{str(job)[:6]}-[0-9a-f]{{12}}", directory.rsplit("/", 1)[1])
    assert [f"{directory}/_metadata"] == [norm(fs, p) for p in fs.find(directory)]
    assert isinstance(handle, ByteStreamStateHandle)
    resolved = FileSystemCheckpointStorage(base_url + "/elsewhere").resolve_checkpoint(
        completed.external_pointer
    )
    assert md == load_checkpoint_metadata(resolved)


def test_savepoint_target_without_any_directory_configured(base_url):
    """Without any configured dir, a savepoint with a target still persists there."""
    access = MemoryCheckpointStorage().create_checkpoint_storage(JobID.generate())
    location = access.initialize_location_for_savepoint(1, base_url + "/target")
    md = metadata(1, [write_state(location, b"state")])

    completed = finalize(location, md)

    fs = fs_for(base_url)
    assert norm(fs, base_url + "/target") == parent(norm(fs, completed.external_pointer))
    assert norm(fs, completed.external_pointer) == norm(
        fs, decode_path_from_reference(location.location_reference)
    )
    assert md == load_checkpoint_metadata(
        MemoryCheckpointStorage().resolve_checkpoint(completed.external_pointer)
    )


def test_savepoint_without_target_or_default_fails():
    """No target and no default savepoint dir is a ValueError."""
    access = MemoryCheckpointStorage().create_checkpoint_storage(JobID.generate())
    with pytest.raises(ValueError):
        access.initialize_location_for_savepoint(1337, None)


def test_task_owned_toolset_duplicates_inline_handles():
    """Duplicating inline task-owned state yields handles with the same bytes."""
    access = MemoryCheckpointStorage().create_checkpoint_storage(JobID.generate())
    location = access.initialize_location_for_checkpoint(1)
    data = [payload(10, 1), payload(30 * 1024, 2)]
    handles = [write_state(location, d) for d in data]

    copies = list(access.create_task_owned_checkpoint_state_toolset().duplicate(handles))

    assert data == [read(c) for c in copies]


def test_storages_declare_their_capabilities_with_the_base_class_defaults(tmp_path):
    """The runner reads a storage's capabilities instead of probing for them: a storage that
    declares none (only the two abstract methods) has the base class's defaults."""
    from checkpoint_storage import CheckpointStorage

    class Minimal(CheckpointStorage):
        def create_checkpoint_storage(self, job_id):
            raise NotImplementedError

        def resolve_checkpoint(self, pointer):
            raise NotImplementedError

    def capabilities(storage):
        return (storage.storage_options, storage.savepoint_directory,
                storage.file_merging_enabled, storage.resumes_physical_files)

    memory = MemoryCheckpointStorage(storage_options={"skip_instance_cache": True})
    merging = FileSystemCheckpointStorage(
        str(tmp_path / "chk"), str(tmp_path / "sp"), file_merging_enabled=True,
        file_merging_across_checkpoint_boundary=True)
    assert [capabilities(s) for s in (Minimal(), memory, merging)] == [
        ({}, None, False, False),
        ({"skip_instance_cache": True}, None, False, False),
        ({}, merging.savepoint_directory, True, True),
    ]
    assert merging.savepoint_directory.endswith("sp")
