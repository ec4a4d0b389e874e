"""Operator tools (issue 3, "Operator CLI"): verify, list, latest, dispose and copy savepoints.

Real checkpoints and savepoints are written with the library on memory://, local disk and S3
(moto); damage is done to the stored bytes directly.
"""

import datetime as dt

import pytest

from checkpoint_storage import (
    CheckpointMetadata,
    CheckpointNotFoundError,
    CheckpointProperties,
    FileStateHandle,
    FileSystemCheckpointStorage,
    InvalidCheckpointError,
    JobID,
    OperatorState,
    OperatorSubtaskState,
    RelativeFileStateHandle,
    StateIntegrityError,
    _tools,
    load_checkpoint_metadata,
    verify_state_handles,
)
from checkpoint_storage._listing import (
    CheckpointInfo,
    latest_checkpoint,
    list_checkpoints,
    modification_time,
)
from checkpoint_storage._tools import (
    copy_savepoint,
    dispose_savepoint,
    verify_checkpoint,
)
from tests.support import SHARED, finalize, fs_of, metadata, payload, read, write_state

THRESHOLD = 1024
JOB_A = JobID("a" * 32)
JOB_B = JobID("b" * 32)
ONE_HOUR = dt.timedelta(hours=1)

pytestmark = pytest.mark.timeout(60)  # the backend fixture includes S3


# --------------------------------------------------------------------------------------------
#  helpers
# --------------------------------------------------------------------------------------------


def storage(backend, base="cp", savepoints=None) -> FileSystemCheckpointStorage:
    return FileSystemCheckpointStorage(
        backend.url(base),
        None if savepoints is None else backend.url(savepoints),
        storage_options=dict(backend.storage_options),
        file_state_size_threshold=THRESHOLD,
    )


def checkpoint(access, checkpoint_id, sizes=(2048, 3000, 10), properties=None, seed=0):
    """A completed checkpoint with one state per size (files above THRESHOLD, inline below);
    returns (completed, the payloads)."""
    location = access.initialize_location_for_checkpoint(checkpoint_id)
    data = [payload(n, seed + i) for i, n in enumerate(sizes)]
    handles = [write_state(location, d) for d in data]
    md = CheckpointMetadata(
        checkpoint_id,
        (OperatorState("op", 1, subtask_states={0: OperatorSubtaskState(tuple(handles))}),),
        {"pos": b"batch-7"},
        properties or CheckpointProperties.for_checkpoint(),
        access.job_id,
        1_700_000_000_000,
    )
    return finalize(location, md), data


def savepoint(access, checkpoint_id=42, sizes=(2048, 5000, 10), target=None):
    """A completed savepoint (properties say savepoint); returns (completed, payloads)."""
    location = access.initialize_location_for_savepoint(checkpoint_id, target)
    data = [payload(n, 100 + i) for i, n in enumerate(sizes)]
    handles = [write_state(location, d) for d in data]
    md = CheckpointMetadata(
        checkpoint_id,
        (OperatorState("op", 2, subtask_states={1: OperatorSubtaskState(tuple(handles))}),),
        {"pos": b"batch-9"},
        CheckpointProperties.for_savepoint(),
        access.job_id,
    )
    return finalize(location, md), data


def file_paths(fs, completed) -> list[str]:
    """The stripped paths of the checkpoint's state files, in handle order."""
    handles = load_checkpoint_metadata(completed).all_handles()
    return [fs._strip_protocol(h.path) for h in handles if isinstance(h, FileStateHandle)]


def exists(fs, path: str) -> bool:
    fs.invalidate_cache()
    try:
        fs.info(path)
    except FileNotFoundError:
        return False
    return True


def metadata_path(fs, completed) -> str:
    return fs._strip_protocol(completed.metadata_handle.path)


# --------------------------------------------------------------------------------------------
#  verify
# --------------------------------------------------------------------------------------------


def test_verify_intact_checkpoint_reads_every_byte(backend):
    """An intact checkpoint verifies ok; every handle is checked and every byte read."""
    access = storage(backend).create_checkpoint_storage(JOB_A)
    completed, data = checkpoint(access, 5)

    report = verify_checkpoint(completed)

    assert (True, 5, 3, sum(map(len, data)), ()) == (
        report.ok,
        report.checkpoint_id,
        report.handles_checked,
        report.bytes_read,
        report.problems,
    )


def test_verify_reports_every_damaged_file_not_only_the_first(backend):
    """A truncated, a bit-flipped and a missing file are three problems, each naming its file."""
    fs = fs_of(backend)
    access = storage(backend).create_checkpoint_storage(JOB_A)
    completed, data = checkpoint(access, 5, sizes=(2048, 2049, 2050, 2051))
    truncated, flipped, missing, intact = file_paths(fs, completed)
    fs.pipe_file(truncated, data[0][:-1])
    damaged = bytearray(data[1])
    damaged[100] ^= 0x01
    fs.pipe_file(flipped, bytes(damaged))
    fs.rm_file(missing)

    report = verify_checkpoint(completed)

    found = sorted((fs._strip_protocol(p.path), p.kind) for p in report.problems)
    expected = sorted([(truncated, "corrupt"), (flipped, "corrupt"), (missing, "missing")])
    assert expected == found
    assert not report.ok
    assert all(fs._strip_protocol(p.path) in " ".join(p.reason.split()) for p in report.problems)
    assert intact not in [fs._strip_protocol(p.path) for p in report.problems]


def test_verify_state_handles_checks_a_subset_and_names_each_failing_handle(backend):
    """Some handles of a checkpoint (e.g. the files a run newly referenced): each is read
    whole once, and a problem carries the handle that failed, so its owner can be named."""
    fs = fs_of(backend)
    access = storage(backend).create_checkpoint_storage(JOB_A)
    completed, data = checkpoint(access, 5, sizes=(2048, 2049, 2050))
    handles = completed.load_metadata().operator_states[0].subtask_states[0].handles
    flipped = bytearray(data[1])
    flipped[7] ^= 0x01
    fs.pipe_file(fs._strip_protocol(handles[1].path), bytes(flipped))

    read, problems = verify_state_handles([handles[1], handles[2], handles[2]])

    assert (2050, ["corrupt"]) == (read, [p.kind for p in problems])
    assert (handles[1].path, handles[1].checksum) == (problems[0].handle.path,
                                                      problems[0].handle.checksum)


def test_verify_io_error_is_unreadable_not_a_verdict(backend, monkeypatch):
    """An I/O error while reading a file is an "unreadable" problem, never "corrupt" or
    "missing": it says nothing about the file."""
    access = storage(backend).create_checkpoint_storage(JOB_A)
    completed, _ = checkpoint(access, 5)
    victim = next(
        h.path
        for h in load_checkpoint_metadata(completed).all_handles()
        if isinstance(h, FileStateHandle)
    )
    original = FileStateHandle.open

    def denied(self):
        if self.path == victim:
            raise PermissionError("simulated: access denied")
        return original(self)

    monkeypatch.setattr(FileStateHandle, "open", denied)

    report = verify_checkpoint(completed)

    assert [(victim, "unreadable")] == [(p.path, p.kind) for p in report.problems]


def test_verify_progress_ends_at_the_total(backend):
    """The progress callback's last report is (total bytes, total bytes)."""
    access = storage(backend).create_checkpoint_storage(JOB_A)
    completed, data = checkpoint(access, 5, sizes=(4096, 8192))
    calls = []

    verify_checkpoint(completed, progress=lambda done, total: calls.append((done, total)))

    assert (sum(map(len, data)), sum(map(len, data))) == max(calls)
    assert (0, sum(map(len, data))) == calls[0]


def test_verify_invalid_metadata_raises(backend):
    """A corrupt `_metadata` is an InvalidCheckpointError, not a report."""
    fs = fs_of(backend)
    access = storage(backend).create_checkpoint_storage(JOB_A)
    completed, _ = checkpoint(access, 5)
    raw = bytearray(fs.cat_file(metadata_path(fs, completed)))
    raw[-1] ^= 0xFF
    fs.pipe_file(metadata_path(fs, completed), bytes(raw))

    with pytest.raises(InvalidCheckpointError):
        verify_checkpoint(access.resolve_checkpoint(completed.external_pointer))


# --------------------------------------------------------------------------------------------
#  dispose
# --------------------------------------------------------------------------------------------


def test_dispose_savepoint_removes_metadata_state_and_directory(backend):
    """After disposal the savepoint resolves to nothing and its directory is gone."""
    fs = fs_of(backend)
    access = storage(backend, savepoints="sp").create_checkpoint_storage(JOB_A)
    completed, _ = savepoint(access)
    files = file_paths(fs, completed)

    dispose_savepoint(completed.external_pointer, storage_options=backend.storage_options)

    assert [] == [p for p in files if exists(fs, p)]
    assert not exists(fs, fs._strip_protocol(completed.external_pointer))
    with pytest.raises(CheckpointNotFoundError):
        access.resolve_checkpoint(completed.external_pointer)


def test_dispose_savepoint_deletes_metadata_before_any_state(backend, monkeypatch):
    """State deletion failing: `_metadata` was already gone when it started, the error is
    raised after the directory was still tried."""
    fs = fs_of(backend)
    access = storage(backend, savepoints="sp").create_checkpoint_storage(JOB_A)
    completed, _ = savepoint(access)
    files = file_paths(fs, completed)
    seen = {}

    def failing_delete(fs_, paths):
        seen["metadata_exists"] = exists(fs, metadata_path(fs, completed))
        seen["state_exists"] = all(exists(fs, p) for p in files)
        raise OSError("simulated: the state could not be deleted")

    monkeypatch.setattr(_tools, "delete_files", failing_delete)

    with pytest.raises(OSError, match="simulated"):
        dispose_savepoint(completed.external_pointer, storage_options=backend.storage_options)

    assert {"metadata_exists": False, "state_exists": True} == seen
    assert not exists(fs, metadata_path(fs, completed))


def test_dispose_savepoint_keeps_everything_when_metadata_cannot_be_deleted(backend, monkeypatch):
    """If `_metadata` cannot be deleted, no state is touched: the savepoint stays usable."""
    fs = fs_of(backend)
    access = storage(backend, savepoints="sp").create_checkpoint_storage(JOB_A)
    completed, data = savepoint(access)

    def refuse(self):
        raise PermissionError("simulated: _metadata is protected")

    monkeypatch.setattr(FileStateHandle, "discard_state", refuse)

    with pytest.raises(PermissionError):
        dispose_savepoint(completed.external_pointer, storage_options=backend.storage_options)

    monkeypatch.undo()
    fs.invalidate_cache()
    restored = access.resolve_checkpoint(completed.external_pointer)
    assert data == [read(h) for h in load_checkpoint_metadata(restored).all_handles()]


def test_dispose_refuses_a_checkpoint_unless_forced(backend):
    """A checkpoint is refused (ValueError, nothing deleted); forced, its own directory goes
    but the job's shared state stays."""
    fs = fs_of(backend)
    access = storage(backend).create_checkpoint_storage(JOB_A)
    access.initialize_base_locations()
    location = access.initialize_location_for_checkpoint(3)
    shared = write_state(location, payload(2048, 1), SHARED)
    own = write_state(location, payload(2048, 2))
    completed = finalize(location, metadata(3, [shared, own]))

    with pytest.raises(ValueError, match="not a savepoint"):
        dispose_savepoint(completed.external_pointer, storage_options=backend.storage_options)
    assert exists(fs, metadata_path(fs, completed))

    dispose_savepoint(
        completed.external_pointer, storage_options=backend.storage_options, force=True
    )

    assert (False, False, True) == (
        exists(fs, metadata_path(fs, completed)),
        exists(fs, fs._strip_protocol(own.path)),
        exists(fs, fs._strip_protocol(shared.path)),
    )


def test_dispose_missing_savepoint_is_not_found(backend):
    """Disposing a pointer with nothing there raises CheckpointNotFoundError."""
    with pytest.raises(CheckpointNotFoundError):
        dispose_savepoint(backend.url("sp", "nothing"), storage_options=backend.storage_options)


# --------------------------------------------------------------------------------------------
#  copy
# --------------------------------------------------------------------------------------------


def test_copy_savepoint_restores_from_its_new_place(backend):
    """The copy is <target>/<same name>, verifies, and its handles read the original bytes
    from the new directory; the source is untouched."""
    fs = fs_of(backend)
    access = storage(backend, savepoints="sp").create_checkpoint_storage(JOB_A)
    completed, data = savepoint(access)
    name = completed.external_pointer.rstrip("/").rsplit("/", 1)[1]
    calls = []

    pointer = copy_savepoint(
        completed.external_pointer,
        backend.url("copies"),
        storage_options=backend.storage_options,
        progress=lambda done, total: calls.append((done, total)),
    )

    copy = access.resolve_checkpoint(pointer)
    handles = load_checkpoint_metadata(copy).all_handles()
    assert fs._strip_protocol(backend.url("copies", name)) == fs._strip_protocol(pointer)
    assert data == [read(h) for h in handles]
    assert all(h.path.startswith(pointer + "/") for h in handles if isinstance(h, FileStateHandle))
    assert verify_checkpoint(copy).ok
    assert verify_checkpoint(completed).ok
    total = sum(len(d) for d in data if len(d) > THRESHOLD)
    assert (total, total) == max(calls)


def test_copy_savepoint_local_to_s3(tmp_path, s3_server):
    """A local savepoint copied to S3 restores there (load + read every handle)."""
    local = FileSystemCheckpointStorage(
        str(tmp_path / "cp"), str(tmp_path / "sp"), file_state_size_threshold=THRESHOLD
    )
    completed, data = savepoint(local.create_checkpoint_storage(JOB_A))
    target = f"s3://{s3_server.new_bucket()}/savepoints"

    pointer = copy_savepoint(
        completed.external_pointer,
        target,
        target_storage_options=s3_server.storage_options,
    )

    remote = FileSystemCheckpointStorage(target, storage_options=s3_server.storage_options)
    restored = load_checkpoint_metadata(remote.resolve_checkpoint(pointer))
    assert pointer.startswith(target + "/savepoint-")
    assert data == [read(h) for h in restored.all_handles()]
    assert CheckpointProperties.for_savepoint() == restored.properties


def test_copy_savepoint_between_local_directories_without_options(tmp_path):
    """Without any storage options (both None) a local copy works and restores."""
    local = FileSystemCheckpointStorage(
        str(tmp_path / "cp"), str(tmp_path / "sp"), file_state_size_threshold=THRESHOLD
    )
    completed, data = savepoint(local.create_checkpoint_storage(JOB_A))

    pointer = copy_savepoint(completed.external_pointer, str(tmp_path / "moved"))

    restored = load_checkpoint_metadata(local.resolve_checkpoint(pointer))
    assert str(tmp_path / "moved") == pointer.rsplit("/", 1)[0]
    assert data == [read(h) for h in restored.all_handles()]


def test_copy_savepoint_refuses_an_existing_target(backend):
    """Copying twice into the same target is a FileExistsError; the first copy stays valid."""
    access = storage(backend, savepoints="sp").create_checkpoint_storage(JOB_A)
    completed, _ = savepoint(access)
    options = backend.storage_options
    pointer = copy_savepoint(completed.external_pointer, backend.url("c"), storage_options=options)

    with pytest.raises(FileExistsError):
        copy_savepoint(completed.external_pointer, backend.url("c"), storage_options=options)

    assert verify_checkpoint(access.resolve_checkpoint(pointer)).ok


def test_copy_refuses_a_checkpoint_with_state_in_shared(backend):
    """A checkpoint whose state lies in shared/ is not copied: ValueError naming the file
    (issue 13: decided by content, not by the properties)."""
    access = storage(backend).create_checkpoint_storage(JOB_A)
    access.initialize_base_locations()
    location = access.initialize_location_for_checkpoint(4)
    shared = write_state(location, payload(2048, 1), SHARED)
    completed = finalize(location, metadata(4, [shared]))

    with pytest.raises(ValueError, match=f"outside its directory.*{shared.path}"):
        copy_savepoint(
            completed.external_pointer,
            backend.url("c"),
            storage_options=backend.storage_options,
        )


def test_copy_of_a_corrupt_savepoint_leaves_nothing_behind(backend):
    """A corrupt source file fails the copy with StateIntegrityError; no copy exists."""
    fs = fs_of(backend)
    access = storage(backend, savepoints="sp").create_checkpoint_storage(JOB_A)
    completed, data = savepoint(access)
    first = file_paths(fs, completed)[0]
    fs.pipe_file(first, b"x" * len(data[0]))
    name = completed.external_pointer.rstrip("/").rsplit("/", 1)[1]

    with pytest.raises(StateIntegrityError):
        copy_savepoint(
            completed.external_pointer,
            backend.url("c"),
            storage_options=backend.storage_options,
        )

    assert not exists(fs, fs._strip_protocol(backend.url("c", name, "_metadata")))
    assert not exists(fs, fs._strip_protocol(backend.url("c", name)))


def test_copy_rewrites_absolute_handles_inside_the_savepoint_as_relative(backend):
    """Absolute handles that lie inside the savepoint directory become relative in the copy,
    so the copy reads its own files."""
    fs = fs_of(backend)
    access = storage(backend, savepoints="sp").create_checkpoint_storage(JOB_A)
    location = access.initialize_location_for_savepoint(9)
    data = payload(4096, 9)
    relative = write_state(location, data)
    absolute = FileStateHandle(relative.path, relative.state_size, relative.checksum)
    md = CheckpointMetadata(
        9,
        (OperatorState("op", 1, subtask_states={0: OperatorSubtaskState((absolute,))}),),
        properties=CheckpointProperties.for_savepoint(),
    )
    completed = finalize(location, md)

    pointer = copy_savepoint(
        completed.external_pointer, backend.url("c"), storage_options=backend.storage_options
    )

    (handle,) = load_checkpoint_metadata(access.resolve_checkpoint(pointer)).all_handles()
    assert isinstance(handle, RelativeFileStateHandle)
    assert pointer + "/" + handle.relative_path == handle.path
    assert data == read(handle)
    fs.rm_file(fs._strip_protocol(relative.path))
    assert data == read(handle)


# --------------------------------------------------------------------------------------------
#  list and latest
# --------------------------------------------------------------------------------------------


def summary(infos: list[CheckpointInfo]) -> list[tuple]:
    return [
        (i.job_id, i.checkpoint_id, i.kind, i.status, i.pointer.rsplit("/", 1)[1]) for i in infos
    ]


def build_base(backend):
    """Base dir with job A (chk-1, corrupt chk-2, in-progress chk-3, full chk-10), job B
    (chk-5) and one savepoint of job A next to the job directories."""
    fs = fs_of(backend)
    cp = storage(backend, base="base", savepoints="base")
    a, b = cp.create_checkpoint_storage(JOB_A), cp.create_checkpoint_storage(JOB_B)
    a.initialize_base_locations()
    b.initialize_base_locations()
    c1, d1 = checkpoint(a, 1)
    c2, _ = checkpoint(a, 2)
    fs.pipe_file(metadata_path(fs, c2), b"not a checkpoint")
    write_state(a.initialize_location_for_checkpoint(3), payload(2048, 3))
    c10, _ = checkpoint(a, 10, properties=CheckpointProperties.for_full_checkpoint())
    c5, _ = checkpoint(b, 5)
    sp, _ = savepoint(a, 11)
    return a, b, {"c1": c1, "c2": c2, "c10": c10, "c5": c5, "sp": sp, "d1": d1}


def test_list_base_directory_finds_every_checkpoint_and_savepoint(backend):
    """A base directory lists both jobs' checkpoints and the savepoint, sorted by job and then
    numerically by id, with their kind and status."""
    _, _, made = build_base(backend)
    sp_name = made["sp"].external_pointer.rsplit("/", 1)[1]

    infos = list_checkpoints(backend.url("base"), storage_options=backend.storage_options)

    assert [
        (JOB_A.hex, 1, "checkpoint", "completed", "chk-1"),
        (JOB_A.hex, 2, "checkpoint", "invalid", "chk-2"),
        (JOB_A.hex, 3, "checkpoint", "in-progress", "chk-3"),
        (JOB_A.hex, 10, "full checkpoint", "completed", "chk-10"),
        (JOB_A.hex, 11, "savepoint", "completed", sp_name),
        (JOB_B.hex, 5, "checkpoint", "completed", "chk-5"),
    ] == summary(infos)


def test_list_reports_sizes_files_age_and_why_invalid(backend):
    """Completed: state size from _metadata (inline included) and its file count; in-progress:
    the files present; invalid: a reason; ages come from `_metadata`'s modification time."""
    _, _, made = build_base(backend)
    now = dt.datetime.now(dt.UTC)

    infos = {
        i.pointer.rsplit("/", 1)[1]: i
        for i in list_checkpoints(
            backend.url("base", JOB_A.hex), storage_options=backend.storage_options
        )
    }

    c1 = infos["chk-1"]
    assert (sum(map(len, made["d1"])), 2) == (c1.state_size, c1.file_count)
    assert made["c1"].external_pointer == c1.pointer
    assert dt.timedelta(0) <= c1.age(now + dt.timedelta(seconds=1)) < dt.timedelta(minutes=5)
    assert (None, 1, None) == (
        infos["chk-3"].state_size,
        infos["chk-3"].file_count,
        infos["chk-3"].modified,
    )
    assert "not a valid or complete checkpoint" in infos["chk-2"].reason
    assert ["chk-1", "chk-10", "chk-2", "chk-3"] == sorted(infos)


def test_list_savepoint_parent_directory(backend):
    """A directory of savepoints lists each savepoint."""
    access = storage(backend, savepoints="sp").create_checkpoint_storage(JOB_A)
    one, _ = savepoint(access, 7)
    two, _ = savepoint(access, 8)

    infos = list_checkpoints(backend.url("sp"), storage_options=backend.storage_options)

    assert [(7, one.external_pointer), (8, two.external_pointer)] == [
        (i.checkpoint_id, i.pointer) for i in infos
    ]
    assert {"savepoint"} == {i.kind for i in infos}


def test_list_one_checkpoint_directory(backend):
    """A checkpoint directory itself lists as that one checkpoint, with its job."""
    access = storage(backend).create_checkpoint_storage(JOB_A)
    completed, _ = checkpoint(access, 6)

    infos = list_checkpoints(completed.external_pointer, storage_options=backend.storage_options)

    assert [(JOB_A.hex, 6, "completed", completed.external_pointer)] == [
        (i.job_id, i.checkpoint_id, i.status, i.pointer) for i in infos
    ]


def test_list_missing_directory_is_not_found(backend):
    """Listing a directory that does not exist raises FileNotFoundError."""
    with pytest.raises(FileNotFoundError):
        list_checkpoints(backend.url("nowhere"), storage_options=backend.storage_options)


def test_latest_checkpoint_is_the_newest_valid_one(backend):
    """latest_checkpoint skips the corrupt and in-progress ones and picks chk-10 over chk-2."""
    a, b, made = build_base(backend)
    options = backend.storage_options

    assert made["c10"].external_pointer == latest_checkpoint(
        backend.url("base", JOB_A.hex), storage_options=options
    )
    assert made["c5"].external_pointer == latest_checkpoint(
        backend.url("base", JOB_B.hex), storage_options=options
    )
    assert a.latest_completed_checkpoint().external_pointer == made["c10"].external_pointer


def test_latest_checkpoint_of_an_empty_job_is_none(backend):
    """A job directory without completed checkpoints (or none at all) has no latest."""
    access = storage(backend).create_checkpoint_storage(JOB_A)
    access.initialize_base_locations()
    access.initialize_location_for_checkpoint(1)

    assert None is latest_checkpoint(
        backend.url("cp", JOB_A.hex), storage_options=backend.storage_options
    )
    assert None is latest_checkpoint(
        backend.url("cp", JOB_B.hex), storage_options=backend.storage_options
    )


@pytest.mark.parametrize(
    "entry",
    [
        {"mtime": 1_700_000_000.0},
        {"mtime": 1_700_000_000_000},
        {"LastModified": dt.datetime(2023, 11, 14, 22, 13, 20, tzinfo=dt.UTC)},
        {"LastModified": dt.datetime(2023, 11, 14, 22, 13, 20)},
        {"updated": "2023-11-14T22:13:20Z"},
        {"created": 1_700_000_000},
        {
            "created": dt.datetime(
                2023, 11, 14, 23, 13, 20, tzinfo=dt.timezone(dt.timedelta(hours=1))
            )
        },
    ],
)
def test_modification_time_normalises_every_fsspec_spelling(entry):
    """Local mtime, S3 LastModified, GCS updated and memory created all give one UTC time."""
    assert dt.datetime(2023, 11, 14, 22, 13, 20, tzinfo=dt.UTC) == modification_time(entry)


def test_modification_time_unknown_is_none():
    """An entry without any time field has no modification time."""
    assert None is modification_time({"name": "x", "size": 1})
