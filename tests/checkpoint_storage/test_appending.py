"""Appended physical files: a writer that lives one checkpoint resumes its subtask's physical
file from the previous checkpoint's segment; the shared state registry keeps the file while a
retained checkpoint references a segment in it, and deletes it after."""

import datetime as dt
import os
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_storage import (
    APPENDED_FILE_PREFIX,
    AppendingSegmentStreamFactory,
    ByteStreamStateHandle,
    FileStateHandle,
    FileSystemCheckpointStorage,
    FileSystemCompletedCheckpointStore,
    JobID,
    RestoreMode,
    SegmentFileStateHandle,
    SubtaskKey,
    abort_checkpoint,
    collect_garbage,
    is_appended_segment,
)
from tests.support import EXCLUSIVE, SHARED, finalize, metadata, payload, read

JOB = JobID(uuid.uuid4().hex)


def storage_of(tmp_path: Path, **options) -> FileSystemCheckpointStorage:
    options = {"file_merging_enabled": True, "file_merging_across_checkpoint_boundary": True,
               "file_state_size_threshold": 0} | options
    return FileSystemCheckpointStorage(str(tmp_path / "cp"), str(tmp_path / "sp"), **options)


def key(subtask: int = 0, parallelism: int = 2, operator: str = "op") -> SubtaskKey:
    return SubtaskKey(JOB.hex, operator, subtask, parallelism)


def factory_of(storage, checkpoint_id: int, previous=None, subtask_key=None):
    access = storage.create_checkpoint_storage(JOB)
    location = access.initialize_location_for_checkpoint(checkpoint_id)
    appending = access.to_appending_storage(subtask_key or key(), previous)
    return appending.resolve_checkpoint_storage_location(
        checkpoint_id, location.location_reference), location


def write(factory, data: bytes, scope=SHARED):
    out = factory.create_checkpoint_state_output_stream(scope)
    out.write(data)
    return out.close_and_get_handle()


def size_of(handle) -> int:
    return os.path.getsize(handle.path)


def test_a_writer_appends_after_the_previous_checkpoints_segment(tmp_path):
    """The second checkpoint's segment starts where the first ends, in the same physical
    file, and each reads back exactly its bytes."""
    storage = storage_of(tmp_path)
    first = write(factory_of(storage, 1)[0], payload(300, 1))
    second = write(factory_of(storage, 2, previous=first)[0], payload(200, 2))
    assert (True, True, first.path, 300, 500, payload(300, 1), payload(200, 2)) == (
        is_appended_segment(first), is_appended_segment(second), second.path,
        second.start_position, size_of(second), read(first), read(second))


@pytest.mark.parametrize("damage", ["missing", "shorter", "full", "other subtask", "plain file"])
def test_a_writer_starts_a_new_file_when_the_previous_one_cannot_be_resumed(tmp_path, damage):
    """A previous file that vanished, is shorter than its segment's end, reached the maximum
    size, belongs to another subtask, or is not an appended file is never written to."""
    storage = storage_of(tmp_path, file_merging_max_file_size=250)
    subtask = key(1) if damage == "other subtask" else key(0)
    previous = write(factory_of(storage, 1, subtask_key=subtask)[0],
                     payload(300 if damage == "full" else 100, 1))
    before = None
    if damage == "missing":
        os.unlink(previous.path)
    elif damage == "shorter":
        os.truncate(previous.path, 50)
    elif damage == "plain file":
        previous = FileStateHandle(previous.path, previous.state_size, previous.checksum)
    if damage not in ("missing", "plain file"):
        before = Path(previous.path).read_bytes()
    after = write(factory_of(storage, 2, previous=previous)[0], payload(80, 2))
    assert (True, 0, payload(80, 2), before) == (
        after.path != previous.path, after.start_position, read(after),
        None if before is None else Path(previous.path).read_bytes())


@pytest.mark.parametrize("resumed", [False, True])
def test_an_aborted_writer_leaves_the_file_as_it_found_it(tmp_path, resumed):
    """A stream closed without commit truncates a resumed file back to where its segment
    began, and removes a file it created."""
    storage = storage_of(tmp_path)
    previous = write(factory_of(storage, 1)[0], payload(100, 1)) if resumed else None
    factory, _ = factory_of(storage, 2, previous=previous)
    out = factory.create_checkpoint_state_output_stream(SHARED)
    out.write(payload(5000, 2))
    out.flush()
    out.close()
    files = sorted(p.name for p in (tmp_path / "cp").rglob(f"{APPENDED_FILE_PREFIX}*"))
    assert ((1, 100, payload(100, 1)) if resumed else (0,)) == (
        (len(files), size_of(previous), read(previous)) if resumed else (len(files),))


def test_a_small_state_stays_inline_and_exclusive_state_goes_to_the_checkpoint(tmp_path):
    """At most the inline threshold, state is inline; EXCLUSIVE-scope state is a plain file
    in the checkpoint's own directory, not a segment."""
    storage = storage_of(tmp_path, file_state_size_threshold=100)
    factory, _ = factory_of(storage, 1)
    inline, exclusive = write(factory, b"x" * 100), write(factory, payload(500, 1), EXCLUSIVE)
    assert (ByteStreamStateHandle, True, False, True) == (
        type(inline), isinstance(exclusive, FileStateHandle), is_appended_segment(exclusive),
        "/chk-1/" in exclusive.path)


@pytest.mark.parametrize("options", [
    {"file_merging_enabled": False},
    {"file_merging_across_checkpoint_boundary": False},
])
def test_without_merging_across_checkpoints_the_access_is_the_plain_one(tmp_path, options):
    """Merging off, or merging within checkpoints only: state goes to one file per stream."""
    storage = storage_of(tmp_path, **options)
    access = storage.create_checkpoint_storage(JOB)
    assert (False, access) == (storage.resumes_physical_files,
                               access.to_appending_storage(key(), None))


def test_object_stores_do_not_resume_files():
    """On a filesystem that cannot append in place (memory, object stores) nothing resumes."""
    storage = FileSystemCheckpointStorage(
        "memory://appending/cp", file_merging_enabled=True,
        file_merging_across_checkpoint_boundary=True)
    with pytest.raises(ValueError, match="cannot append"):
        AppendingSegmentStreamFactory(None, storage.create_checkpoint_storage(JOB)._fs, "/x",
                                      None, 100, 100, 0)
    assert False is storage.resumes_physical_files


@pytest.mark.timeout(30)  # a writer waiting for the lock would hang here
def test_a_second_attempt_finding_the_file_locked_writes_a_new_one(tmp_path):
    """While one attempt holds the resumed file, another attempt of the subtask starts a new
    file at once instead of waiting; both segments read back."""
    storage = storage_of(tmp_path)
    previous = write(factory_of(storage, 1)[0], payload(100, 1))
    first = factory_of(storage, 2, previous=previous)[0].create_checkpoint_state_output_stream(
        SHARED)
    first.write(payload(3000, 2))
    first.flush()  # holds the lock now
    second = write(factory_of(storage, 2, previous=previous)[0], payload(700, 3))
    committed = first.close_and_get_handle()
    assert ((previous.path, 100), 0, payload(3000, 2), payload(700, 3)) == (
        (committed.path, committed.start_position), second.start_position, read(committed),
        read(second))
    assert second.path != previous.path


@pytest.mark.timeout(30)
def test_a_write_beside_the_lock_fails_the_commit_and_is_not_truncated(tmp_path):
    """Bytes appended by a writer that ignored the lock (a filesystem whose flock does not
    span writers) fail the commit, and the abort leaves them."""
    storage = storage_of(tmp_path)
    previous = write(factory_of(storage, 1)[0], payload(100, 1))
    out = factory_of(storage, 2, previous=previous)[0].create_checkpoint_state_output_stream(
        SHARED)
    out.write(payload(3000, 2))
    out.flush()
    with open(previous.path, "ab") as other:
        other.write(b"other writer")
    with pytest.raises(OSError, match="does not honour flock"):
        out.close_and_get_handle()
    assert (3100 + len(b"other writer"), payload(100, 1)) == (size_of(previous),
                                                              read(previous))


def test_aborting_a_checkpoint_keeps_the_appended_file_of_earlier_ones(tmp_path):
    """abort_checkpoint given a segment the aborted checkpoint appended leaves its physical
    file: an earlier checkpoint's segment in it still reads back."""
    storage = storage_of(tmp_path)
    previous = write(factory_of(storage, 1)[0], payload(100, 1))
    factory, location = factory_of(storage, 2, previous=previous)
    aborted = write(factory, payload(200, 2))
    abort_checkpoint(location, [aborted])
    assert (previous.path, payload(100, 1)) == (aborted.path, read(previous))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["commit", "abort", "torn"]),
                          st.integers(1, 400)), min_size=1, max_size=12))
def test_committed_segments_always_read_back_whatever_failed_between(tmp_path_factory, steps):
    """Any sequence of committed, aborted and killed (torn tail) writers, each resuming the
    last committed segment: every committed segment reads back its bytes, and a file never
    grows past the maximum size by more than one segment."""
    storage = storage_of(tmp_path_factory.mktemp("steps"), file_merging_max_file_size=1000)
    previous, committed = None, []
    for i, (step, size) in enumerate(steps, start=1):
        factory, _ = factory_of(storage, i, previous=previous)
        data = payload(size, i)
        if step == "commit":
            previous = write(factory, data)
            committed.append((previous, data))
            continue
        out = factory.create_checkpoint_state_output_stream(SHARED)
        out.write(data)
        out.flush()
        if step == "abort":
            out.close()
        else:  # killed: the bytes stay, the lock goes with the process
            os.close(out._fd)
            out._fd, out._closed = None, True
    assert [data for _, data in committed] == [read(h) for h, _ in committed]
    files = {h.path for h, _ in committed}
    assert all(os.path.getsize(path) < 1000 + 400 for path in files)


def test_the_registry_deletes_an_appended_file_once_no_retained_checkpoint_uses_it(tmp_path):
    """Checkpoints 1-3 append to one file, checkpoint 4 starts a new one: the first file
    lives while a retained checkpoint references a segment in it, and goes after."""
    storage = storage_of(tmp_path, file_merging_max_file_size=300)
    access = storage.create_checkpoint_storage(JOB)
    store = FileSystemCompletedCheckpointStore(access, max_retained=2)
    previous, handles, alive = None, [], []
    for checkpoint_id in range(1, 7):
        factory, location = factory_of(storage, checkpoint_id, previous=previous)
        previous = write(factory, payload(100, checkpoint_id))
        handles.append(previous)
        # each checkpoint references its range's segments since the file began (a chain)
        chain = [h for h in handles if h.path == previous.path]
        store.add_checkpoint(finalize(location, metadata(checkpoint_id, chain)))
        store.shared_state_registry.wait_for_pending_deletions()
        alive.append(sorted({h.path for h in handles if os.path.exists(h.path)}))
    first, second = handles[0].path, handles[3].path
    assert ([[first]] * 3 + [sorted([first, second])] + [[second]] * 2) == alive


def test_a_no_claim_restore_never_deletes_the_snapshots_appended_file(tmp_path):
    """An appended file of a snapshot restored in NO_CLAIM mode survives every later
    subsumption, while the restoring job's own appended files go with theirs."""
    storage = storage_of(tmp_path)
    factory, location = factory_of(storage, 1)
    restored = write(factory, payload(100, 1))
    snapshot = finalize(location, metadata(1, [restored]))
    other_job = JobID(uuid.uuid4().hex)
    access = storage.create_checkpoint_storage(other_job)
    store = FileSystemCompletedCheckpointStore(access, max_retained=1)
    store.restore(snapshot, RestoreMode.NO_CLAIM)
    own = []
    for checkpoint_id in (2, 3, 4):
        location = access.initialize_location_for_checkpoint(checkpoint_id)
        streams = access.to_appending_storage(
            SubtaskKey(other_job.hex, "op", 0, 2), restored).resolve_checkpoint_storage_location(
            checkpoint_id, location.location_reference)
        own.append(write(streams, payload(50, checkpoint_id)))
        store.add_checkpoint(finalize(location, metadata(checkpoint_id, own[-1:])))
    store.shared_state_registry.wait_for_pending_deletions()
    # another job's file is never resumed: each checkpoint started a file of its own
    assert (payload(100, 1), [False, False, True], 3) == (
        read(restored), [os.path.exists(h.path) for h in own], len({h.path for h in own}))


def test_gc_keeps_a_referenced_appended_file_and_collects_an_orphan(tmp_path):
    """Garbage collection keeps an appended file a retained checkpoint references and
    removes one no checkpoint references (a failed attempt's file), past the grace period."""
    storage = storage_of(tmp_path)
    factory, location = factory_of(storage, 1)
    kept = write(factory, payload(100, 1))
    orphan = write(factory_of(storage, 2, subtask_key=key(1))[0], payload(100, 2))
    finalize(location, metadata(1, [kept]))
    collect_garbage(storage.create_checkpoint_storage(JOB), grace_period=dt.timedelta(0))
    assert (True, True, False) == (isinstance(kept, SegmentFileStateHandle),
                                   os.path.exists(kept.path), os.path.exists(orphan.path))
