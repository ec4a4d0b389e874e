"""File merging (Flink FLIP-306): segments, physical/logical files, pools, notifications.

Ports Flink's FileMergingSnapshotManagerTestBase, WithinCheckpoint/AcrossCheckpoint
FileMergingSnapshotManagerTest and FileMergingCheckpointStateOutputStreamTest cases, plus the
`_metadata` encoding of SegmentFileStateHandle, the storage wiring, GC, verify and the CLI.
"""

import io
import threading
import uuid
import zlib

import pytest
from fsspec.implementations.local import LocalFileSystem

from checkpoint_storage import (
    ByteStreamStateHandle,
    CheckpointMetadata,
    CheckpointStorageLocationReference,
    FileMergingType,
    FileSystemCheckpointStorage,
    InvalidCheckpointError,
    JobID,
    OperatorState,
    OperatorSubtaskState,
    PhysicalFilePoolType,
    RelativeFileStateHandle,
    SegmentFileStateHandle,
    StateIntegrityError,
    StorageConfigurationError,
    SubtaskKey,
    UnsafePathError,
    collect_garbage,
    create_file_merging_snapshot_manager,
    verify_checkpoint,
)
from checkpoint_storage._filesystems import PathRoots, roots_for_directory
from checkpoint_storage._metadata import decode_metadata, encode_metadata
from tests.support import EXCLUSIVE, SHARED, finalize, fs_of, payload, read

KIB = 1024
JOB = JobID(uuid.uuid4().hex)
WITHIN = FileMergingType.WITHIN_CHECKPOINT
ACROSS = FileMergingType.ACROSS_CHECKPOINTS


def key(subtask: int = 0, parallelism: int = 4, operator: str = "op") -> SubtaskKey:
    return SubtaskKey(JOB.hex, operator, subtask, parallelism)


def new_manager(base: str, merging_type=WITHIN, threshold: int = 0, **kwargs):
    """A manager initialised on ``base`` (local dir) with subtasks 0..3 of "op" registered."""
    manager = create_file_merging_snapshot_manager("worker-1", merging_type=merging_type, **kwargs)
    fs = LocalFileSystem()
    job = f"{base}/{JOB.hex}"
    manager.init_file_system(fs, job, f"{job}/shared", f"{job}/taskowned", 4096, threshold)
    for i in range(4):
        manager.register_subtask_for_shared_states(key(i))
    return manager


def write_segment(manager, subtask_key, checkpoint_id, data: bytes, scope=SHARED):
    out = manager.create_checkpoint_state_output_stream(subtask_key, checkpoint_id, scope)
    out.write(data)
    return out.close_and_get_handle()


def physical(manager, handle: SegmentFileStateHandle):
    return manager.get_logical_file(handle.logical_file_id).physical_file


def exists(path: str) -> bool:
    return LocalFileSystem().exists(path)


def merging_storage(backend, **kwargs) -> FileSystemCheckpointStorage:
    return FileSystemCheckpointStorage(
        backend.url("cp"),
        backend.url("sp"),
        storage_options=backend.storage_options,
        file_merging_enabled=True,
        **kwargs,
    )


def subtask_metadata(checkpoint_id: int, handles_by_subtask: dict, parallelism: int):
    return CheckpointMetadata(
        checkpoint_id,
        (
            OperatorState(
                "op",
                parallelism,
                subtask_states={
                    i: OperatorSubtaskState(tuple(hs)) for i, hs in handles_by_subtask.items()
                },
            ),
        ),
    )


# --------------------------------------------------------------------------------------------
#  managed directories and initialisation
# --------------------------------------------------------------------------------------------


def test_managed_directory_names_are_sanitised_as_in_flink(tmp_path):
    """shared/<op>_<subtask>_<parallelism>_/ per subtask, taskowned/<worker id>/ per worker,
    every character but letters, digits and '-' replaced by '_'."""
    manager = create_file_merging_snapshot_manager("tm:1/a b")
    job = f"{tmp_path}/{JOB.hex}"
    manager.init_file_system(LocalFileSystem(), job, f"{job}/shared", f"{job}/taskowned", 4096)
    subtask = SubtaskKey(JOB.hex, "op-1:x.y", 3, 128)
    manager.register_subtask_for_shared_states(subtask)

    expected = (f"{job}/shared/op-1_x_y_3_128_", f"{job}/taskowned/tm_1_a_b")
    actual = (manager.get_managed_dir(subtask, SHARED), manager.get_managed_dir(subtask, EXCLUSIVE))
    assert expected == actual


def test_initialising_twice_with_other_directories_raises(tmp_path):
    """A second init_file_system with the same directories is a no-op; other ones raise."""
    manager = new_manager(str(tmp_path))
    job = f"{tmp_path}/{JOB.hex}"
    manager.init_file_system(LocalFileSystem(), job, f"{job}/shared", f"{job}/taskowned", 4096)
    with pytest.raises(StorageConfigurationError, match="initialised with the directories"):
        manager.init_file_system(LocalFileSystem(), job, f"{job}/shared2", f"{job}/taskowned", 4096)


# --------------------------------------------------------------------------------------------
#  within-checkpoint reuse (WithinCheckpointFileMergingSnapshotManagerTest)
# --------------------------------------------------------------------------------------------


def test_within_checkpoint_second_request_while_the_first_is_out_gets_a_new_file(tmp_path):
    """A physical file is handed to one writer at a time."""
    manager = new_manager(str(tmp_path))
    first = manager._get_or_create_physical_file(key(0), 1, SHARED)
    second = manager._get_or_create_physical_file(key(0), 1, SHARED)
    assert first is not second


def test_within_checkpoint_returned_file_is_reused_for_same_checkpoint_and_subtask(tmp_path):
    """A returned file goes to the next writer of that checkpoint and subtask only."""
    manager = new_manager(str(tmp_path))
    first = manager._get_or_create_physical_file(key(0), 1, SHARED)
    manager._return_physical_file(key(0), 1, first)

    expected = (True, False, False)
    actual = (
        manager._get_or_create_physical_file(key(0), 1, SHARED) is first,
        manager._get_or_create_physical_file(key(1), 1, SHARED) is first,
        manager._get_or_create_physical_file(key(0), 2, SHARED) is first,
    )
    assert expected == actual


def test_within_checkpoint_exclusive_files_are_shared_across_subtasks(tmp_path):
    """EXCLUSIVE files come from one pool per worker: another subtask reuses them; the
    file lies in taskowned/<worker id>/."""
    manager = new_manager(str(tmp_path))
    first = manager._get_or_create_physical_file(key(0), 1, EXCLUSIVE)
    manager._return_physical_file(key(0), 1, first)
    again = manager._get_or_create_physical_file(key(1), 1, EXCLUSIVE)

    expected = (True, manager.get_managed_dir(key(0), EXCLUSIVE))
    assert expected == (again is first, first.url.rsplit("/", 1)[0])


def test_within_checkpoint_file_is_closed_when_the_checkpoint_completes(tmp_path):
    """notify_checkpoint_complete closes the subtask's pooled files: no file spans two
    checkpoints."""
    manager = new_manager(str(tmp_path))
    handle = write_segment(manager, key(0), 1, payload(100, 1))
    manager.notify_checkpoint_complete(key(0), 1)
    assert (False, True) == (physical(manager, handle).is_open(), exists(handle.path))


# --------------------------------------------------------------------------------------------
#  across-checkpoint reuse (AcrossCheckpointFileMergingSnapshotManagerTest)
# --------------------------------------------------------------------------------------------


def test_across_checkpoints_a_file_keeps_being_appended(tmp_path):
    """Checkpoint 2 appends to the file checkpoint 1 used, even after 1 completed."""
    manager = new_manager(str(tmp_path), ACROSS)
    h1 = write_segment(manager, key(0), 1, payload(100, 1))
    manager.notify_checkpoint_complete(key(0), 1)
    h2 = write_segment(manager, key(0), 2, payload(50, 2))
    assert (h1.path, 100) == (h2.path, h2.start_position)


def test_across_checkpoints_a_full_file_is_not_reused(tmp_path):
    """A file that reached the maximum size is closed; the next writer gets a new file."""
    manager = new_manager(str(tmp_path), ACROSS, max_file_size=150)
    h1 = write_segment(manager, key(0), 1, payload(100, 1))
    h2 = write_segment(manager, key(0), 2, payload(100, 2))  # 200 bytes: full afterwards
    h3 = write_segment(manager, key(0), 3, payload(10, 3))

    expected = (True, False, False)
    actual = (h1.path == h2.path, h3.path == h2.path, physical(manager, h2).is_open())
    assert expected == actual


# --------------------------------------------------------------------------------------------
#  reference counting (FileMergingSnapshotManagerTestBase)
# --------------------------------------------------------------------------------------------


def test_reference_counting_keeps_files_a_later_checkpoint_uses(tmp_path):
    """A segment reused by checkpoint 2 survives the subsumption of 1; an open file is never
    deleted; a closed file with no reference left is."""
    manager = new_manager(str(tmp_path), ACROSS)
    h1 = write_segment(manager, key(0), 1, payload(100, 1))
    h1b = write_segment(manager, key(0), 1, payload(100, 2))
    manager.reuse_previous_state_handle(2, [h1])
    file = physical(manager, h1)

    manager.notify_checkpoint_subsumed(key(0), 1)
    after_first = (file.ref_count, manager.get_logical_file(h1b.logical_file_id))
    manager.notify_checkpoint_subsumed(key(0), 2)
    open_unreferenced = (file.ref_count, exists(file.url))
    manager.close()

    expected = ((1, None), (0, True), False)
    assert expected == (after_first, open_unreferenced, exists(file.url))


def test_abort_discards_only_the_aborting_subtasks_segments(tmp_path):
    """Aborting checkpoint 1 for subtask 0 releases its segments, not subtask 1's."""
    manager = new_manager(str(tmp_path))
    h0 = write_segment(manager, key(0), 1, payload(100, 1))
    h1 = write_segment(manager, key(1), 1, payload(100, 2))
    manager.notify_checkpoint_aborted(key(0), 1)

    expected = (None, True, False, True)
    actual = (
        manager.get_logical_file(h0.logical_file_id),
        manager.get_logical_file(h1.logical_file_id) is not None,
        exists(h0.path),
        exists(h1.path),
    )
    assert expected == actual


def test_checkpoint_is_released_only_after_every_registered_subtask_reported(tmp_path):
    """Notification order: complete, then subsumed by each of the four subtasks; the
    checkpoint (and its pool) is released with the last report only."""
    manager = new_manager(str(tmp_path))
    handles = [write_segment(manager, key(i), 1, payload(64, i), EXCLUSIVE) for i in range(4)]
    released = []
    for i in range(4):
        manager.notify_checkpoint_complete(key(i), 1)
    for i in range(4):
        released.append(manager.is_checkpoint_released(1))
        manager.notify_checkpoint_subsumed(key(i), 1)
    released.append(manager.is_checkpoint_released(1))

    expected = ([False, False, False, False, True], False)
    assert expected == (released, any(exists(h.path) for h in handles))


# --------------------------------------------------------------------------------------------
#  streams (FileMergingCheckpointStateOutputStreamTest)
# --------------------------------------------------------------------------------------------


def test_ten_streams_of_128_bytes_land_in_one_physical_file(tmp_path):
    """10 x 128 bytes, written one after another, are 10 segments of one physical file; each
    reads back exactly its own bytes."""
    manager = new_manager(str(tmp_path))
    data = [payload(128, i) for i in range(10)]
    handles = [write_segment(manager, key(0), 1, d) for d in data]

    expected = ({handles[0].path}, list(range(0, 1280, 128)), data)
    actual = (
        {h.path for h in handles},
        [h.start_position for h in handles],
        [read(h) for h in handles],
    )
    assert expected == actual


def test_state_at_most_the_threshold_stays_inline(tmp_path):
    """The inline threshold still applies: a small state is a ByteStreamStateHandle."""
    manager = new_manager(str(tmp_path), threshold=1024)
    handle = write_segment(manager, key(0), 1, b"x" * 1024)
    assert (ByteStreamStateHandle, 0) == (type(handle), manager.files_created)


@pytest.mark.timeout(60)
def test_concurrent_writers_never_interleave_segments(tmp_path):
    """8 threads writing 40 states each in small chunks: segments are disjoint and each
    reads back its own bytes."""
    manager = new_manager(str(tmp_path), ACROSS)
    results: dict[int, list] = {}
    errors = []

    def writer(n: int) -> None:
        try:
            out_list = []
            for j in range(40):
                data = payload(900 + j, n * 1000 + j)
                out = manager.create_checkpoint_state_output_stream(key(n % 4), 1, EXCLUSIVE)
                for start in range(0, len(data), 97):
                    out.write(data[start : start + 97])
                out_list.append((out.close_and_get_handle(), data))
            results[n] = out_list
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pairs = [p for n in sorted(results) for p in results[n]]
    spans: dict[str, list] = {}
    for h, _ in pairs:
        spans.setdefault(h.path, []).append((h.start_position, h.end_position))
    overlapping = [
        path
        for path, ranges in spans.items()
        for a, b in zip(sorted(ranges), sorted(ranges)[1:], strict=False)
        if a[1] > b[0]
    ]
    expected = ([], 320, [], [d for _, d in pairs])
    assert expected == (errors, len(pairs), overlapping, [read(h) for h, _ in pairs])


def test_aborted_stream_leaves_no_segment_and_retires_its_file(tmp_path):
    """close() without commit: no logical file, the physical file is closed (a torn segment
    is never appended to) and deleted when nothing else is in it."""
    manager = new_manager(str(tmp_path))
    out = manager.create_checkpoint_state_output_stream(key(0), 1, SHARED)
    out.write(payload(5000, 1))
    out.flush()
    file = out._file
    out.close()
    assert ({}, True, False) == (manager.uploaded_states(), file.closed, exists(file.url))


@pytest.mark.timeout(30)
def test_blocking_pool_waits_for_the_file_to_come_back(tmp_path):
    """With a blocking pool the second writer waits for the first writer's file."""
    manager = new_manager(str(tmp_path), pool_type=PhysicalFilePoolType.BLOCKING)
    first = manager._get_or_create_physical_file(key(0), 1, SHARED)
    got = []
    waiter = threading.Thread(
        target=lambda: got.append(manager._get_or_create_physical_file(key(0), 1, SHARED))
    )
    waiter.start()
    waiter.join(0.3)
    waiting = waiter.is_alive()
    manager._return_physical_file(key(0), 1, first)
    waiter.join(10)
    assert (True, [first]) == (waiting, got)


# --------------------------------------------------------------------------------------------
#  SegmentFileStateHandle and `_metadata`
# --------------------------------------------------------------------------------------------


def test_segment_handle_reads_exactly_its_segment_and_discard_does_nothing(tmp_path):
    """open() yields the segment's bytes only (seek and partial reads included);
    discard_state() leaves the physical file."""
    path = tmp_path / "physical"
    path.write_bytes(b"a" * 10 + b"segment!" + b"z" * 10)
    handle = SegmentFileStateHandle(str(path), 10, 8, SHARED, "id", zlib.crc32(b"segment!"))
    handle.discard_state()
    with handle.open() as stream:
        head = stream.read(3)
        stream.seek(-2, io.SEEK_END)
        tail = stream.read()
    assert (b"segment!", b"seg", b"t!", True) == (read(handle), head, tail, path.exists())


def test_segment_reader_detects_truncation_and_corruption(tmp_path):
    """A physical file too short for the segment, or a changed byte in it, is an integrity
    error."""
    path = tmp_path / "physical"
    path.write_bytes(b"0123456789")
    good = zlib.crc32(b"2345")
    errors = []
    for handle in (
        SegmentFileStateHandle(str(path), 8, 4, SHARED, "id", good),
        SegmentFileStateHandle(str(path), 2, 4, SHARED, "id", good ^ 1),
    ):
        with pytest.raises(StateIntegrityError) as info:
            read(handle)
        errors.append(type(info.value))
    assert [StateIntegrityError, StateIntegrityError] == errors


def test_segment_handle_round_trips_through_metadata():
    """Tag 4 encodes path, start, length, scope, logical file id and checksum; decoding
    gives an equal handle with every field."""
    directory = "memory:///cp/job/chk-3"
    handle = SegmentFileStateHandle(
        "memory:///cp/job/shared/op_0_1_/f", 7, 300, SHARED, "lf-1", 0xDEADBEEF
    )
    exclusive = SegmentFileStateHandle(
        "memory:///cp/job/taskowned/worker/g", 0, 5, EXCLUSIVE, "lf-2"
    )
    md = subtask_metadata(3, {0: [handle, exclusive]}, 1)
    loaded = decode_metadata(
        encode_metadata(md), source="t", directory=directory, roots=roots_for_directory(directory)
    )
    fields = [
        (h.path, h.start_position, h.state_size, h.scope, h.logical_file_id, h.checksum)
        for h in loaded.all_handles()
    ]
    expected = [
        ("memory:///cp/job/shared/op_0_1_/f", 7, 300, SHARED, "lf-1", 0xDEADBEEF),
        ("memory:///cp/job/taskowned/worker/g", 0, 5, EXCLUSIVE, "lf-2", None),
    ]
    assert (expected, md) == (fields, loaded)


@pytest.mark.parametrize(
    "path",
    [
        "memory:///cp/job/../evil/f",
        "memory:///cp/job-evil/shared/f",
        "memory:///elsewhere/f",
        "s3://bucket/cp/job/shared/f",
    ],
)
def test_segment_paths_outside_the_roots_are_rejected(path):
    """A segment's physical file must lie below the checkpoint's roots (shared/ and
    taskowned/ of its job qualify; anything else is refused)."""
    directory = "memory:///cp/job/chk-1"
    md = subtask_metadata(1, {0: [SegmentFileStateHandle(path, 0, 1, SHARED, "x")]}, 1)
    with pytest.raises(UnsafePathError):
        decode_metadata(
            encode_metadata(md),
            source="t",
            directory=directory,
            roots=roots_for_directory(directory),
        )


def test_managed_directories_lie_within_the_checkpoint_roots():
    """shared/<subtask dir>/ and taskowned/<worker>/ pass the roots of chk-<id>; a savepoint
    directory's roots admit neither."""
    checkpoint_roots = roots_for_directory("s3://b/cp/job/chk-5")
    savepoint_roots = PathRoots(("s3://b/sp/savepoint-abc",))
    paths = ["s3://b/cp/job/shared/op_0_1_/f", "s3://b/cp/job/taskowned/job_x_worker_w/f"]
    expected = ([PathRoots.SHARED, PathRoots.TASK_OWNED], [None, None])
    actual = (
        [checkpoint_roots.index_of(p) for p in paths],
        [savepoint_roots.index_of(p) for p in paths],
    )
    assert expected == actual


def test_unknown_segment_scope_is_invalid():
    """A scope byte other than 0 or 1 fails closed."""
    directory = "memory:///cp/job/chk-1"
    md = subtask_metadata(
        1, {0: [SegmentFileStateHandle("memory:///cp/job/shared/f", 0, 1, SHARED, "x")]}, 1
    )
    data = bytearray(encode_metadata(md))
    marker = data.index(b"memory:///cp/job/shared/f") + len("memory:///cp/job/shared/f") + 16
    data[marker] = 7
    # The body checksum must match for the scope check to be reached.
    from checkpoint_storage._metadata import HEADER_SIZE

    data[20:24] = zlib.crc32(bytes(data[HEADER_SIZE:])).to_bytes(4, "big")
    with pytest.raises(InvalidCheckpointError, match="unknown segment scope 7"):
        decode_metadata(
            bytes(data), source="t", directory=directory, roots=roots_for_directory(directory)
        )


# --------------------------------------------------------------------------------------------
#  restore and space amplification
# --------------------------------------------------------------------------------------------


def test_restore_rebuilds_bookkeeping_and_never_deletes_foreign_files(tmp_path):
    """Restored segments are known again; when subsumed, a file in this manager's directories
    is deleted, one from elsewhere is kept."""
    writer = new_manager(str(tmp_path))
    own = write_segment(writer, key(0), 1, payload(100, 1))
    writer.close()
    foreign_path = tmp_path / "elsewhere"
    foreign_path.write_bytes(b"f" * 10)
    foreign = SegmentFileStateHandle(str(foreign_path), 0, 10, SHARED, "foreign")

    manager = new_manager(str(tmp_path))
    manager.restore_state_handles(1, key(0), [own, foreign])
    known = (
        manager.get_logical_file(own.logical_file_id).physical_file.owned,
        manager.get_logical_file("foreign").physical_file.owned,
    )
    manager.notify_checkpoint_subsumed(key(0), 1)
    assert ((True, False), False, True) == (known, exists(own.path), foreign_path.exists())


def test_space_amplification_retires_the_most_wasteful_closed_files(tmp_path):
    """Above the bound (here 1.5), the closed file with the least live data is retired (its
    segments may no longer be reused) until the projected amplification is within it."""
    manager = new_manager(str(tmp_path), ACROSS, max_file_size=1000, max_space_amplification=1.5)
    sizes = [500, 500, 500, 500, 300, 700]  # files: [h1 h2] [h3 h4] [h5 h6], each 1000 bytes
    handles = [write_segment(manager, key(0), i, payload(n, i)) for i, n in enumerate(sizes, 1)]
    manager.reuse_previous_state_handle(20, [handles[1], handles[5]])  # h2, h6 stay live
    manager.notify_checkpoint_subsumed(key(0), 10)
    stat = manager.space_stat()
    reusable = [manager.could_reuse_previous_state_handle(h) for h in (handles[1], handles[5])]
    # 2000 bytes on storage, 1200 live (1.67 > 1.5): [h1 h2] (half live) goes, [h5 h6] stays.
    expected = ((2, 2000, 2, 1200), [False, True])
    actual = (
        (
            stat.physical_file_count,
            stat.physical_file_size,
            stat.logical_file_count,
            stat.logical_file_size,
        ),
        reusable,
    )
    assert expected == actual


def test_space_amplification_below_one_disables_the_control(tmp_path):
    """max_space_amplification < 1: no file is ever retired."""
    manager = new_manager(str(tmp_path), ACROSS, max_file_size=1000, max_space_amplification=0.5)
    handles = [write_segment(manager, key(0), i, payload(500, i)) for i in range(1, 5)]
    manager.reuse_previous_state_handle(20, [handles[1]])
    for cp in range(1, 11):
        manager.notify_checkpoint_subsumed(key(0), cp)
    assert manager.could_reuse_previous_state_handle(handles[1]) is True


# --------------------------------------------------------------------------------------------
#  wiring into FileSystemCheckpointStorage
# --------------------------------------------------------------------------------------------


def test_merging_is_off_by_default(tmp_path):
    """Without file_merging_enabled, to_file_merging_storage returns the access itself."""
    access = FileSystemCheckpointStorage(str(tmp_path)).create_checkpoint_storage(JOB)
    manager = create_file_merging_snapshot_manager("w")
    assert access is access.to_file_merging_storage(manager, key(0))


def test_savepoints_never_merge(tmp_path):
    """A savepoint reference resolves to ordinary self-contained files, merging or not."""
    storage = FileSystemCheckpointStorage(
        str(tmp_path / "cp"), str(tmp_path / "sp"), file_merging_enabled=True
    )
    access = storage.create_checkpoint_storage(JOB)
    access.initialize_base_locations()
    location = access.initialize_location_for_savepoint(5)
    merging = access.to_file_merging_storage(create_file_merging_snapshot_manager("w"), key(0))
    factory = merging.resolve_checkpoint_storage_location(5, location.location_reference)
    with factory.create_checkpoint_state_output_stream(EXCLUSIVE) as out:
        out.write(payload(50 * KIB, 1))
        handle = out.close_and_get_handle()
    assert RelativeFileStateHandle is type(handle)


@pytest.fixture(params=["local", "s3"])
def disk_or_s3(request, tmp_path):
    from tests.support import Backend

    if request.param == "local":
        return Backend("local", str(tmp_path), {})
    server = request.getfixturevalue("s3_server")
    return Backend("s3", f"s3://{server.new_bucket()}/base", server.storage_options)


@pytest.mark.timeout(300)
def test_thousand_subtask_states_make_few_physical_files(disk_or_s3):
    """1,000 subtask states above the inline threshold, written by 4 threads: at most one
    physical file per concurrent writer of the one exclusive pool (4), all read back after a
    round trip through `_metadata`; verify checks every segment."""
    backend = disk_or_s3
    storage = merging_storage(backend)
    coordinator = storage.create_checkpoint_storage(JOB)
    coordinator.initialize_base_locations()
    location = coordinator.initialize_location_for_checkpoint(1)
    manager = create_file_merging_snapshot_manager(f"w-{uuid.uuid4().hex[:8]}")
    size = 21 * KIB
    n = 1000
    handles: dict[int, list] = {}

    def run(worker: int) -> None:
        for i in range(worker, n, 4):
            subtask = SubtaskKey(JOB.hex, "op", i, n)
            access = coordinator.to_file_merging_storage(manager, subtask)
            factory = access.resolve_checkpoint_storage_location(
                1, CheckpointStorageLocationReference.get_default()
            )
            with factory.create_checkpoint_state_output_stream(EXCLUSIVE) as out:
                out.write(payload(size, i))
                handles[i] = [out.close_and_get_handle()]

    threads = [threading.Thread(target=run, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    manager.sync_checkpoint(1)
    completed = finalize(location, subtask_metadata(1, handles, n))
    loaded = completed.load_metadata().all_handles()
    fs = fs_of(backend)
    physical_files = fs.find(
        fs._strip_protocol(manager.get_managed_dir(SubtaskKey(JOB.hex, "op", 0, n), EXCLUSIVE))
    )
    sample = [read(h) == payload(size, i) for i, h in list(enumerate(loaded))[::97]]
    report = verify_checkpoint(completed)

    assert (n, True, True, [True] * len(sample), True, n) == (
        len(loaded),
        all(isinstance(h, SegmentFileStateHandle) for h in loaded),
        1 <= len(physical_files) <= 4,
        sample,
        report.ok,
        report.handles_checked,
    )


def test_memory_filesystem_segments_are_readable_after_sync(tmp_path):
    """Where bytes are visible only on close (memory, object stores), sync_checkpoint closes
    the files holding the checkpoint's segments, which then read back."""
    storage = FileSystemCheckpointStorage(
        f"memory://fm-{uuid.uuid4().hex}/cp", file_merging_enabled=True
    )
    access = storage.create_checkpoint_storage(JOB)
    access.initialize_base_locations()
    manager = create_file_merging_snapshot_manager("w")
    merging = access.to_file_merging_storage(manager, key(0))
    factory = merging.resolve_checkpoint_storage_location(
        1, CheckpointStorageLocationReference.get_default()
    )
    data = [payload(30 * KIB, i) for i in range(3)]
    handles = []
    for d in data:
        with factory.create_checkpoint_state_output_stream(SHARED) as out:
            out.write(d)
            handles.append(out.close_and_get_handle())
    manager.sync_checkpoint(1)
    assert (False, 1, data) == (
        manager.segments_visible_on_flush,
        len({h.path for h in handles}),
        [read(h) for h in handles],
    )


def test_gc_keeps_physical_files_referenced_by_any_segment(tmp_path):
    """A physical file in shared/ is live while a retained checkpoint references a segment
    in it; once none does it is collected like any unreferenced shared file."""
    storage = FileSystemCheckpointStorage(str(tmp_path / "cp"), file_merging_enabled=True)
    access = storage.create_checkpoint_storage(JOB)
    access.initialize_base_locations()
    manager = create_file_merging_snapshot_manager("w")
    merging = access.to_file_merging_storage(manager, key(0))
    location = access.initialize_location_for_checkpoint(1)
    factory = merging.resolve_checkpoint_storage_location(
        1, CheckpointStorageLocationReference.get_default()
    )
    with factory.create_checkpoint_state_output_stream(SHARED) as out:
        out.write(payload(30 * KIB, 1))
        kept = out.close_and_get_handle()
    access.to_file_merging_storage(manager, key(1))
    orphan = write_segment(manager, key(1), 1, payload(30 * KIB, 2))
    manager.close()
    finalize(location, subtask_metadata(1, {0: [kept]}, 4))

    result = collect_garbage(access, grace_period=0, now=10**11)
    assert ((kept.path,), (orphan.path,)) == (
        tuple(p for p in result.kept if p == kept.path),
        result.deleted,
    )


def test_cli_inspect_shows_segments_and_verify_checks_each(tmp_path, capsys):
    """`checkpoints inspect` lists each segment with its range and scope; `verify` reads every
    segment and reports a corrupted one."""
    from checkpoint_storage.cli import main

    storage = FileSystemCheckpointStorage(str(tmp_path / "cp"), file_merging_enabled=True)
    access = storage.create_checkpoint_storage(JOB)
    access.initialize_base_locations()
    manager = create_file_merging_snapshot_manager("w")
    merging = access.to_file_merging_storage(manager, key(0))
    location = access.initialize_location_for_checkpoint(1)
    factory = merging.resolve_checkpoint_storage_location(
        1, CheckpointStorageLocationReference.get_default()
    )
    handles = []
    for i in range(2):
        with factory.create_checkpoint_state_output_stream(SHARED) as out:
            out.write(payload(30 * KIB, i))
            handles.append(out.close_and_get_handle())
    completed = finalize(location, subtask_metadata(1, {0: handles}, 4))
    capsys.readouterr()
    main(["inspect", completed.external_pointer])
    out = capsys.readouterr().out
    with open(handles[1].path, "r+b") as f:
        f.seek(handles[1].start_position + 5)
        byte = f.read(1)[0]
        f.seek(handles[1].start_position + 5)
        f.write(bytes([byte ^ 0xFF]))
    report = verify_checkpoint(completed)

    segment = f"{handles[1].path}[{30 * KIB}:{60 * KIB}]"
    expected = (True, True, True, [(segment, "corrupt")])
    actual = (
        f"[0:{30 * KIB}] (shared)" in out,
        f"[{30 * KIB}:{60 * KIB}] (shared)" in out,
        "2 segments in 1 physical file" in out,
        [(p.path, p.kind) for p in report.problems],
    )
    assert expected == actual


def test_a_physical_file_is_deleted_once_closed_and_unreferenced_and_only_if_owned():
    """The files of file merging (their own module): a logical file keeps its physical file;
    a file restored from elsewhere (not owned) is never deleted."""
    from checkpoint_storage._physical_files import LogicalFile, PhysicalFile

    deleted = []
    owned = PhysicalFile(io.BytesIO(), "memory://a", deleted.append, SHARED)
    owned.write(memoryview(b"abc"))
    segment = LogicalFile("l1", owned, 0, 3, key(0))
    owned.close()
    kept = list(deleted)
    segment.discard_with_checkpoint_id(1)
    restored = PhysicalFile(None, "memory://b", deleted.append, SHARED, owned=False)
    LogicalFile("l2", restored, 0, 1, key(0)).discard_with_checkpoint_id(1)

    assert (kept, deleted, restored.deleted) == ([], [owned], True)


def test_the_non_blocking_pool_takes_back_a_file_until_it_is_full():
    from checkpoint_storage._physical_files import NonBlockingPhysicalFilePool, PhysicalFile

    created = []

    def create(subtask_key, scope):
        created.append(PhysicalFile(io.BytesIO(), f"memory://{len(created)}", None, scope))
        return created[-1]

    pool = NonBlockingPhysicalFilePool(4, create)
    first = pool.poll_file(key(0), SHARED)
    first.write(memoryview(b"ab"))
    returned = pool.try_put_file(key(0), first)
    again = pool.poll_file(key(0), SHARED)
    again.write(memoryview(b"cd"))
    full_returned = pool.try_put_file(key(0), again)
    other = pool.poll_file(key(0), SHARED)

    assert (returned, again is first, full_returned, other is first, len(created)) == (
        True, True, False, False, 2)
