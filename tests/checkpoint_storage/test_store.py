"""Completed-checkpoint store, retention, discarding, shared state and restore modes
(Flink's DefaultCompletedCheckpointStoreTest, CheckpointSubsumeHelperTest,
SharedStateRegistryTest and CheckpointPropertiesTest behaviours)."""

import logging
import random

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from checkpoint_storage import (
    CheckpointMetadata,
    CheckpointProperties,
    CheckpointRetentionPolicy,
    CompletedCheckpoint,
    FileStateHandle,
    FileSystemCheckpointStorage,
    FileSystemCompletedCheckpointStore,
    JobID,
    JobStatus,
    OperatorState,
    OperatorSubtaskState,
    RestoreMode,
    SharedStateRegistry,
    StandaloneCompletedCheckpointStore,
    abort_checkpoint,
    discard_checkpoint,
    store_checkpoint_metadata,
)
from tests.support import EXCLUSIVE, SHARED, norm, read, write_state

pytestmark = pytest.mark.timeout(60)

THRESHOLD = 64
NEVER = CheckpointRetentionPolicy.NEVER_RETAIN_AFTER_TERMINATION
ON_FAILURE = CheckpointRetentionPolicy.RETAIN_ON_FAILURE
ON_CANCELLATION = CheckpointRetentionPolicy.RETAIN_ON_CANCELLATION


def payload(seed: int, n: int = 200) -> bytes:
    return random.Random(seed).randbytes(n)


class Job:
    """One job on a backend, writing real checkpoints through the library."""

    def __init__(self, backend, name: str = "cp", job_id: JobID | None = None) -> None:
        self.storage = FileSystemCheckpointStorage(
            backend.url(name),
            backend.url("sp"),
            storage_options=dict(backend.storage_options),
            file_state_size_threshold=THRESHOLD,
        )
        self.access = self.storage.create_checkpoint_storage(job_id or JobID.generate())
        self.access.initialize_base_locations()
        self.fs = fsspec.core.url_to_fs(backend.base_url, **backend.storage_options)[0]

    def exists(self, url: str) -> bool:
        self.fs.invalidate_cache()
        try:
            self.fs.info(norm(self.fs, url))
        except FileNotFoundError:
            return False
        return True

    def checkpoint(self, checkpoint_id, *, reuse=(), shared=1, savepoint=False, full=False):
        """Complete a checkpoint with one private file, ``shared`` new shared files and the
        given reused shared handles; returns (location, metadata)."""
        if savepoint:
            location = self.access.initialize_location_for_savepoint(checkpoint_id)
            properties = CheckpointProperties.for_savepoint()
        else:
            location = self.access.initialize_location_for_checkpoint(checkpoint_id)
            properties = (
                CheckpointProperties.for_full_checkpoint()
                if full
                else CheckpointProperties.for_checkpoint()
            )
        handles = [write_state(location, payload(checkpoint_id), EXCLUSIVE)]
        handles += [
            write_state(location, payload(checkpoint_id * 100 + i), SHARED) for i in range(shared)
        ]
        handles += list(reuse)
        metadata = CheckpointMetadata(
            checkpoint_id,
            (OperatorState("op", 1, subtask_states={0: OperatorSubtaskState(tuple(handles))}),),
            properties=properties,
        )
        out = location.create_metadata_output_stream()
        store_checkpoint_metadata(metadata, out)
        return out.close_and_finalize_checkpoint(), metadata

    def store(self, **kwargs) -> FileSystemCompletedCheckpointStore:
        return FileSystemCompletedCheckpointStore(self.access, **kwargs)


def ids(store) -> list[int]:
    return [c.checkpoint_id for c in store.all()]


# --- retention matrix --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "discarded_on"),
    [
        (NEVER, {"FINISHED", "CANCELED", "FAILED", "SUSPENDED"}),
        (ON_FAILURE, {"FINISHED", "CANCELED"}),
        (ON_CANCELLATION, {"FINISHED"}),
    ],
)
def test_retention_policy_discard_matrix(policy, discarded_on):
    """Each policy discards on exactly Flink's set of job statuses, and always on subsumed."""
    assert discarded_on == {s.value for s in JobStatus if policy.discard_on(s)}
    assert policy.discard_on_subsumed()


def test_restore_mode_defaults_to_no_claim():
    """NO_CLAIM is the default restore mode, as in Flink."""
    assert RestoreMode.NO_CLAIM == RestoreMode.default()


@pytest.mark.parametrize("bad", [0, -1])
def test_max_retained_must_be_at_least_one(bad):
    """max_retained below 1 is rejected; the default is 1."""
    with pytest.raises(ValueError, match="at least 1"):
        StandaloneCompletedCheckpointStore(max_retained=bad)
    assert 1 == StandaloneCompletedCheckpointStore().max_retained


# --- subsumption -------------------------------------------------------------------------


def test_adding_beyond_max_retained_discards_the_oldest(backend):
    """With max_retained=2 the third checkpoint subsumes the first: its _metadata, private
    files and directory are gone; the two retained ones still restore."""
    job = Job(backend)
    store = job.store(max_retained=2)
    added = [job.checkpoint(i) for i in (1, 2, 3)]
    subsumed = [store.add_checkpoint(*c) for c in added]
    first = CompletedCheckpoint(*added[0])

    assert [[], [], [1]] == [[c.checkpoint_id for c in s] for s in subsumed]
    assert [2, 3] == ids(store)
    assert [False, False] == [
        job.exists(first.external_pointer),
        job.exists(first.private_handles()[0].path),
    ]
    assert [payload(2), payload(3)] == [read(c.private_handles()[0]) for c in store.all()]


def test_savepoints_do_not_count_and_are_never_discarded(backend):
    """A savepoint does not count toward max_retained and is never discarded; it leaves the
    store once older than every retained checkpoint, and its files stay."""
    job = Job(backend)
    store = job.store(max_retained=1)
    store.add_checkpoint(*job.checkpoint(1))
    savepoint = job.checkpoint(2, savepoint=True, shared=0)
    store.add_checkpoint(*savepoint)
    with_savepoint = ids(store)
    store.add_checkpoint(*job.checkpoint(3))

    assert [[1, 2], [3]] == [with_savepoint, ids(store)]
    assert job.exists(savepoint[0].external_pointer + "/_metadata")


def test_the_newest_entry_is_never_subsumed(backend):
    """A savepoint added last stays in the store, even beside max_retained checkpoints."""
    job = Job(backend)
    store = job.store(max_retained=1)
    store.add_checkpoint(*job.checkpoint(1))
    store.add_checkpoint(*job.checkpoint(2, savepoint=True, shared=0))
    assert 2 == store.latest().checkpoint_id


# --- shutdown ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "status", "kept"),
    [
        (NEVER, JobStatus.FAILED, False),
        (ON_FAILURE, JobStatus.FAILED, True),
        (ON_FAILURE, JobStatus.CANCELED, False),
        (ON_CANCELLATION, JobStatus.CANCELED, True),
        (ON_CANCELLATION, JobStatus.FINISHED, False),
        (NEVER, JobStatus.SUSPENDED, True),
    ],
)
def test_shutdown_applies_the_retention_policy(tmp_path, policy, status, kept):
    """On shutdown a retained checkpoint survives exactly when the policy keeps it for the
    job status; a suspended job keeps everything."""
    from tests.support import Backend

    job = Job(Backend("local", str(tmp_path), {}))
    store = job.store(retention_policy=policy)
    location, _ = job.checkpoint(1)
    store.add_checkpoint(location)
    store.shutdown(status)
    assert kept == job.exists(location.external_pointer + "/_metadata")


def test_stop_with_savepoint_keeps_the_savepoint_and_drops_checkpoints(backend):
    """After a stop-with-savepoint (FINISHED) the checkpoints follow the finished-job policy
    and the savepoint stays."""
    job = Job(backend)
    store = job.store(max_retained=2, retention_policy=ON_CANCELLATION)
    checkpoint = job.checkpoint(1)
    savepoint = job.checkpoint(2, savepoint=True, shared=0)
    store.add_checkpoint(*checkpoint)
    store.add_checkpoint(*savepoint)
    discarded = store.shutdown(JobStatus.FINISHED)

    assert [1] == [c.checkpoint_id for c in discarded]
    assert [False, True] == [
        job.exists(checkpoint[0].external_pointer + "/_metadata"),
        job.exists(savepoint[0].external_pointer + "/_metadata"),
    ]


# --- discarding --------------------------------------------------------------------------


class FailingDeletes(MemoryFileSystem):
    """memory:// whose single-file deletes fail for paths containing 'state' (S3-like
    permission errors on data files)."""

    protocol = "failmem"

    def rm_file(self, path):
        if "_metadata" not in path:
            raise PermissionError(f"denied: {path}")
        return super().rm_file(path)


def test_discard_removes_metadata_first_and_tries_every_step():
    """When deleting state fails, _metadata is already gone (the checkpoint is no longer
    addressable), the directory step still ran, and the first error is raised."""
    from tests.support import Backend

    job = Job(Backend("memory", f"memory://discard-{random.getrandbits(32)}", {}))
    location, metadata = job.checkpoint(1, shared=0)
    failing = FailingDeletes()
    private = metadata.all_handles()[0]
    rigged = CheckpointMetadata(
        1,
        (
            OperatorState(
                "op",
                1,
                subtask_states={
                    0: OperatorSubtaskState(
                        (FileStateHandle(private.path, private.state_size, filesystem=failing),)
                    )
                },
            ),
        ),
    )
    with pytest.raises(PermissionError):
        discard_checkpoint(CompletedCheckpoint(location, rigged))
    assert [False, False] == [
        job.exists(location.external_pointer + "/_metadata"),
        job.exists(location.external_pointer),
    ]


def test_discard_is_idempotent_and_parallel(backend):
    """Discarding a checkpoint of many private files deletes all of them; a second discard
    is a no-op."""
    job = Job(backend)
    location = job.access.initialize_location_for_checkpoint(9)
    handles = tuple(write_state(location, payload(i), EXCLUSIVE) for i in range(60))
    metadata = CheckpointMetadata(
        9, (OperatorState("op", 1, subtask_states={0: OperatorSubtaskState(handles)}),)
    )
    out = location.create_metadata_output_stream()
    store_checkpoint_metadata(metadata, out)
    checkpoint = CompletedCheckpoint(out.close_and_finalize_checkpoint(), metadata)
    discard_checkpoint(checkpoint, max_workers=8)
    discard_checkpoint(checkpoint, max_workers=8)
    assert [False] * 61 == [job.exists(h.path) for h in handles] + [
        job.exists(checkpoint.external_pointer)
    ]


def test_task_owned_state_is_never_discarded(backend):
    """A checkpoint that references task-owned state is discarded without touching it."""
    job = Job(backend)
    with job.access.create_task_owned_state_stream() as out:
        out.write(payload(5))
        owned = out.close_and_get_handle()
    location, metadata = job.checkpoint(1, reuse=[owned], shared=0)
    discard_checkpoint(CompletedCheckpoint(location, metadata))
    assert payload(5) == read(owned)


def test_abort_removes_written_state_and_the_directory(backend):
    """A failed checkpoint's written files and its chk directory are removed."""
    job = Job(backend)
    location = job.access.initialize_location_for_checkpoint(3)
    written = [
        write_state(location, payload(i), scope) for i, scope in enumerate((EXCLUSIVE, SHARED))
    ]
    abort_checkpoint(location, written)
    assert [False, False, False] == [job.exists(h.path) for h in written] + [
        job.exists(job.access.checkpoints_directory + "/chk-3")
    ]


# --- shared state ------------------------------------------------------------------------


def test_registry_advances_last_use_and_rejects_a_different_handle():
    """Re-registering a key advances its last use; another handle under the key raises."""
    registry = SharedStateRegistry()
    handle = FileStateHandle("memory:///s/a", 10, 1)
    registry.register_reference(handle, 1)
    registry.register_reference(FileStateHandle("memory:///s/a", 10, 1), 4)
    assert 4 == registry.last_used("memory:///s/a")
    with pytest.raises(ValueError, match="different handle"):
        registry.register_reference(FileStateHandle("memory:///s/a", 11, 2), 5)
    registry.close()


def test_shared_state_lives_exactly_as_long_as_a_retained_checkpoint_uses_it(backend):
    """Incremental: a shared file reused by checkpoint 2 survives the subsumption of 1, and
    is deleted once no retained checkpoint references it."""
    job = Job(backend)
    store = job.store(max_retained=1)
    first = job.checkpoint(1, shared=1)
    reused = CompletedCheckpoint(*first).shared_handles()[0]
    store.add_checkpoint(*first)
    store.add_checkpoint(*job.checkpoint(2, reuse=[reused], shared=0))
    store.shared_state_registry.wait_for_pending_deletions()
    alive_while_used = job.exists(reused.path)
    store.add_checkpoint(*job.checkpoint(3, full=True, shared=1))
    store.shared_state_registry.wait_for_pending_deletions()
    assert [True, False] == [alive_while_used, job.exists(reused.path)]


def test_also_retained_checkpoints_stay_and_a_gap_between_them_is_released(backend):
    """An ``also_retain`` rule (a pipeline's head or partition end) keeps checkpoint 1 beyond
    ``max_retained``; checkpoint 2, subsumed between 1 and 3, takes its own shared file with
    it although its id is above the lowest retained one (release by reference, not by id),
    and the store reopened with the rule keeps the same."""
    job = Job(backend)
    store = job.store(max_retained=1, also_retain=lambda checkpoints: {1})
    added = [job.checkpoint(i, shared=1) for i in (1, 2, 3)]
    own = [CompletedCheckpoint(*c).shared_handles()[0].path for c in added]
    for checkpoint in added:
        store.add_checkpoint(*checkpoint)
    store.shared_state_registry.wait_for_pending_deletions()
    assert ids(store) == [1, 3]
    assert [job.exists(path) for path in own] == [True, False, True]
    assert not job.store(max_retained=1, also_retain=lambda checkpoints: {1}).needs_subsumption
    assert job.store(max_retained=1).needs_subsumption


def test_no_claim_restore_never_deletes_the_snapshot(backend):
    """NO_CLAIM: the restored checkpoint of another job survives every later subsumption, and
    a checkpoint that reuses its shared state is refused."""
    old = Job(backend, job_id=JobID.generate())
    snapshot, snapshot_metadata = old.checkpoint(1, shared=1)
    job = Job(backend)
    store = job.store(max_retained=1)
    store.restore(snapshot, RestoreMode.NO_CLAIM)
    assert store.requires_full_checkpoint()
    reused = CompletedCheckpoint(snapshot, snapshot_metadata).shared_handles()
    with pytest.raises(ValueError, match="NO_CLAIM"):
        store.add_checkpoint(*job.checkpoint(5, reuse=reused, shared=0))
    store.add_checkpoint(*job.checkpoint(6, full=True))
    store.add_checkpoint(*job.checkpoint(7, full=True))
    store.shared_state_registry.wait_for_pending_deletions()

    assert not store.requires_full_checkpoint()
    assert [True, True] == [
        old.exists(snapshot.external_pointer + "/_metadata"),
        old.exists(reused[0].path),
    ]


def test_claim_restore_deletes_the_snapshot_once_subsumed(backend):
    """CLAIM: the job owns the restored checkpoint and discards it, shared state included,
    once it is subsumed."""
    old = Job(backend, job_id=JobID.generate())
    snapshot, snapshot_metadata = old.checkpoint(1, shared=1)
    shared = CompletedCheckpoint(snapshot, snapshot_metadata).shared_handles()[0]
    job = Job(backend)
    store = job.store(max_retained=1)
    store.restore(snapshot, RestoreMode.CLAIM)
    store.add_checkpoint(*job.checkpoint(2))
    store.shared_state_registry.wait_for_pending_deletions()
    assert [False, False] == [
        old.exists(snapshot.external_pointer + "/_metadata"),
        old.exists(shared.path),
    ]


# --- durability --------------------------------------------------------------------------


def test_file_system_store_rebuilds_itself_after_a_restart(backend):
    """A new store over the same job directory holds the same retained checkpoints, and its
    latest agrees with latest_completed_checkpoint()."""
    job = Job(backend)
    store = job.store(max_retained=2)
    for i in (1, 2, 3):
        store.add_checkpoint(*job.checkpoint(i))
    recovered = job.store(max_retained=2)
    assert [2, 3] == ids(recovered)
    assert job.access.latest_completed_checkpoint().external_pointer == (
        recovered.latest().external_pointer
    )


def test_recovery_keeps_what_a_crash_left_behind_until_the_next_add(backend):
    """Checkpoints completed but never added (a crash before subsumption) are recovered and
    kept: constructing the store deletes nothing; the next add subsumes the surplus."""
    job = Job(backend)
    locations = [job.checkpoint(i)[0] for i in (1, 2, 3)]
    store = job.store(max_retained=1)
    assert ([1, 2, 3], True) == (ids(store), store.needs_subsumption)
    assert [True, True, True] == [job.exists(c.external_pointer + "/_metadata") for c in locations]

    subsumed = store.add_checkpoint(*job.checkpoint(4))

    assert ([1, 2, 3], [4], False) == (
        sorted(c.checkpoint_id for c in subsumed),
        ids(store),
        store.needs_subsumption,
    )
    assert [False, False, False] == [
        job.exists(c.external_pointer + "/_metadata") for c in locations
    ]


def test_recovery_skips_an_invalid_checkpoint_with_a_warning(backend, caplog):
    """A chk whose _metadata is corrupt is skipped during recovery, naming it; the previous
    valid one is the latest."""
    job = Job(backend)
    job.checkpoint(1)
    broken, _ = job.checkpoint(2)
    job.fs.pipe_file(norm(job.fs, broken.external_pointer + "/_metadata"), b"garbage")
    with caplog.at_level(logging.WARNING, logger="checkpoint_storage"):
        store = job.store(max_retained=3)
    assert [1] == ids(store)
    assert "chk-2" in caplog.text


def test_subsume_applies_retention_to_a_recovered_surplus_on_request(backend):
    """store.subsume() (an explicit retention step) subsumes what exceeds max_retained right
    away, the newest kept; without it recovery keeps everything."""
    job = Job(backend)
    locations = [job.checkpoint(i)[0] for i in (1, 2, 3)]
    store = job.store(max_retained=1)

    subsumed = store.subsume()

    assert ([1, 2], [3], False) == (
        [c.checkpoint_id for c in subsumed],
        ids(store),
        store.needs_subsumption,
    )
    assert [False, False, True] == [
        job.exists(c.external_pointer + "/_metadata") for c in locations
    ]
