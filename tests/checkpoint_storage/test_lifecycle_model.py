"""Hypothesis stateful model of the checkpoint lifecycle (issue 3), on local disk and on S3.

A coordinator writes checkpoints (incremental, full, some failing midway, some completed just
before a crash), takes savepoints, restarts from storage and collects garbage, in any order.
The model predicts the store's content from Flink's subsumption rules and checks the storage
against it after every step.
"""

import random
import time
import uuid
from dataclasses import dataclass

import fsspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from checkpoint_storage import (
    CheckpointMetadata,
    CheckpointProperties,
    CompletedCheckpointStorageLocation,
    FileStateHandle,
    FileSystemCheckpointStorage,
    FileSystemCompletedCheckpointStore,
    JobID,
    JobStatus,
    OperatorState,
    OperatorSubtaskState,
    abort_checkpoint,
    store_checkpoint_metadata,
)
from checkpoint_storage._gc import collect_garbage
from tests.support import EXCLUSIVE, SHARED, norm, read, write_state

pytestmark = pytest.mark.timeout(300)

THRESHOLD = 64
FAR_FUTURE = time.time() + 100 * 365 * 24 * 3600

FILE_SIZES = st.integers(100, 500)  # above THRESHOLD: a file each
PRIVATE = st.lists(FILE_SIZES, min_size=1, max_size=3)
NEW_SHARED = st.lists(FILE_SIZES, max_size=2)
INLINE = st.one_of(st.none(), st.integers(1, THRESHOLD))  # an inline state, or none
REUSE = st.integers(0, 255)  # bit i set: reuse the i-th shared file of the latest checkpoint

# Local disk is cheap: more examples there; S3 (moto) keeps the file under a minute.
MODEL_SETTINGS = settings(
    max_examples=15,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
LOCAL_EXAMPLES = 100


@dataclass(frozen=True)
class Snapshot:
    """A completed snapshot as written: location, metadata, bytes of each handle in order."""

    checkpoint_id: int
    savepoint: bool
    location: CompletedCheckpointStorageLocation
    metadata: CheckpointMetadata
    expected: tuple[bytes, ...]


class LifecycleModel(RuleBasedStateMachine):
    """One job's coordinator against real storage, and the model of what must be there."""

    def __init__(self, base_url: str, storage_options: dict) -> None:
        super().__init__()
        self.base = f"{base_url}/{uuid.uuid4().hex[:12]}"
        self.storage_options = dict(storage_options)
        self.fs = fsspec.core.url_to_fs(base_url, **self.storage_options)[0]
        self.local = "file" in (
            (self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol
        )
        self.job_id = JobID.generate()
        self.access = self._connect()
        self.access.initialize_base_locations()
        self.job = norm(self.fs, self.access.checkpoints_directory)
        self.store: FileSystemCompletedCheckpointStore | None = None
        self.max_retained = 1
        self.next_id = 1
        self.writes = 0
        self.snapshots: dict[int, Snapshot] = {}  # every completed checkpoint and savepoint
        self.entries: list[int] = []  # the ids the store must hold, oldest first
        self.savepoints: list[int] = []  # every savepoint ever taken: the user's, forever
        self.contents: dict[str, bytes] = {}  # path of every file written -> its bytes
        self.task_owned: set[str] = set()
        self.orphans: set[str] = set()  # files of crashed attempts, until collected
        self.orphan_dirs: set[int] = set()  # chk-<id> of crashed attempts (local disk)

    # --- plumbing ------------------------------------------------------------------------

    def _connect(self):
        """A new storage and access object, as a restarted coordinator builds them."""
        storage = FileSystemCheckpointStorage(
            f"{self.base}/cp",
            f"{self.base}/sp",
            storage_options=self.storage_options,
            file_state_size_threshold=THRESHOLD,
        )
        return storage.create_checkpoint_storage(self.job_id)

    def _new_store(self) -> FileSystemCompletedCheckpointStore:
        return FileSystemCompletedCheckpointStore(self.access, max_retained=self.max_retained)

    def _next_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def _payload(self, size: int) -> bytes:
        self.writes += 1
        return random.Random(self.writes).randbytes(size)

    def _write(self, location, sizes, scope, handles: list, expected: list) -> None:
        for size in sizes:
            data = self._payload(size)
            handle = write_state(location, data, scope)
            handles.append(handle)
            expected.append(data)
            if isinstance(handle, FileStateHandle):
                self.contents[norm(self.fs, handle.path)] = data

    def _write_task_owned(self, handles: list, expected: list) -> None:
        data = self._payload(200)
        with self.access.create_task_owned_state_stream() as out:
            out.write(data)
            handle = out.close_and_get_handle()
        handles.append(handle)
        expected.append(data)
        path = norm(self.fs, handle.path)
        self.contents[path] = data
        self.task_owned.add(path)

    def _finalize(self, location, checkpoint_id, handles, properties) -> tuple:
        metadata = CheckpointMetadata(
            checkpoint_id,
            (
                OperatorState(
                    "op",
                    2,
                    subtask_states={
                        0: OperatorSubtaskState(tuple(handles[::2])),
                        1: OperatorSubtaskState(tuple(handles[1::2])),
                    },
                ),
            ),
            master_states={"pos": checkpoint_id.to_bytes(8, "big")},
            properties=properties,
            job_id=self.job_id,
        )
        out = location.create_metadata_output_stream()
        store_checkpoint_metadata(metadata, out)
        completed = out.close_and_finalize_checkpoint()
        path = norm(self.fs, completed.metadata_handle.path)
        self.contents[path] = self.fs.cat_file(path)
        return completed, metadata

    @staticmethod
    def _in_handle_order(expected: list) -> tuple:
        """Bytes in ``all_handles()`` order: subtask 0 got the even handles, 1 the odd."""
        return tuple(expected[0::2]) + tuple(expected[1::2])

    def _latest_regular(self) -> int | None:
        return next((i for i in reversed(self.entries) if not self.snapshots[i].savepoint), None)

    def _subsume(self) -> list[int]:
        """Flink 2.x subsumption: excess regular checkpoints, then savepoints older than every
        retained checkpoint; never the newest entry. Returns the subsumed ids."""
        latest = self.entries[-1]
        regular = [i for i in self.entries if not self.snapshots[i].savepoint]
        gone = [i for i in regular[: max(0, len(regular) - self.max_retained)] if i != latest]
        retained = [i for i in regular if i not in gone]
        if retained:
            gone += [
                i
                for i in self.entries
                if self.snapshots[i].savepoint and i != latest and i < min(retained)
            ]
        self.entries = [i for i in self.entries if i not in gone]
        return sorted(gone)

    def _add(self, snapshot: Snapshot) -> None:
        self.snapshots[snapshot.checkpoint_id] = snapshot
        subsumed = self.store.add_checkpoint(snapshot.location, snapshot.metadata)
        self.entries.append(snapshot.checkpoint_id)
        expected = self._subsume()
        assert expected == sorted(c.checkpoint_id for c in subsumed), "subsumed other entries"

    def _restart(self, completed_but_not_added: int | None = None) -> None:
        self.store.shared_state_registry.wait_for_pending_deletions()
        self.access = self._connect()
        self.store = self._new_store()
        regular = [i for i in self.entries if not self.snapshots[i].savepoint]
        if completed_but_not_added is not None:
            regular.append(completed_but_not_added)
        # Savepoints are forgotten; recovery reads only, so a surplus over max_retained stays
        # until the next add subsumes it (Flink's semantics).
        self.entries = sorted(regular)

    def _referenced(self) -> set[str]:
        """Paths in the job directory that the retained checkpoints reference."""
        paths = set()
        for i in self.entries:
            snapshot = self.snapshots[i]
            if snapshot.savepoint:
                continue
            paths.add(norm(self.fs, snapshot.location.metadata_handle.path))
            paths |= {
                norm(self.fs, h.path)
                for h in snapshot.metadata.all_handles()
                if isinstance(h, FileStateHandle)
            }
        return paths - self.task_owned

    def _settle(self) -> None:
        """Wait for the store's background deletions and drop cached listings."""
        self.store.shared_state_registry.wait_for_pending_deletions()
        self.fs.invalidate_cache()

    def _job_files(self) -> set[str]:
        self._settle()
        taskowned = f"{self.job}/taskowned/"
        return {
            p.rstrip("/")
            for p in self.fs.find(self.job)
            if not p.startswith(taskowned) and not p.rstrip("/").endswith("/taskowned")
        }

    def _chk_directories(self) -> set[int]:
        self.fs.invalidate_cache()
        names = (p.rstrip("/").rsplit("/", 1)[1] for p in self.fs.ls(self.job, detail=False))
        return {int(n[4:]) for n in names if n.startswith("chk-")}

    # --- rules ---------------------------------------------------------------------------

    @initialize(max_retained=st.integers(1, 3))
    def start(self, max_retained: int) -> None:
        self.max_retained = max_retained
        self.store = self._new_store()

    @rule(
        private=PRIVATE,
        new_shared=NEW_SHARED,
        inline=INLINE,
        reuse=REUSE,
        full=st.booleans(),
        task_owned=st.integers(0, 3).map(lambda n: n == 0),
        crash_before_add=st.integers(0, 3).map(lambda n: n == 0),
    )
    def checkpoint(self, private, new_shared, inline, reuse, full, task_owned, crash_before_add):
        """Incremental or full checkpoint, added, or published just before a crash."""
        checkpoint_id = self._next_id()
        location = self.access.initialize_location_for_checkpoint(checkpoint_id)
        handles: list = []
        expected: list = []
        self._write(location, private, EXCLUSIVE, handles, expected)
        self._write(location, [inline] if inline else [], EXCLUSIVE, handles, expected)
        self._write(location, new_shared, SHARED, handles, expected)
        if task_owned:
            self._write_task_owned(handles, expected)
        if full:
            properties = CheckpointProperties.for_full_checkpoint()
        else:
            properties = CheckpointProperties.for_checkpoint()
            base = self.store.latest()
            if base is not None and base.is_savepoint():
                base = next((c for c in reversed(self.store.all()) if not c.is_savepoint()), None)
            for bit, handle in enumerate(base.shared_handles() if base else []):
                if reuse >> (bit % 8) & 1:
                    handles.append(handle)
                    expected.append(self.contents[norm(self.fs, handle.path)])
        completed, metadata = self._finalize(location, checkpoint_id, handles, properties)
        expected = self._in_handle_order(expected)
        snapshot = Snapshot(checkpoint_id, False, completed, metadata, expected)
        if crash_before_add:
            self.snapshots[checkpoint_id] = snapshot
            self._restart(completed_but_not_added=checkpoint_id)
        else:
            self._add(snapshot)

    @rule(private=PRIVATE, shared=NEW_SHARED, inline=INLINE)
    def savepoint(self, private, shared, inline):
        """A savepoint, all state written through its own location, added to the store."""
        checkpoint_id = self._next_id()
        location = self.access.initialize_location_for_savepoint(checkpoint_id)
        handles: list = []
        expected: list = []
        self._write(location, private, EXCLUSIVE, handles, expected)
        self._write(location, [inline] if inline else [], EXCLUSIVE, handles, expected)
        self._write(location, shared, SHARED, handles, expected)
        completed, metadata = self._finalize(
            location, checkpoint_id, handles, CheckpointProperties.for_savepoint()
        )
        self.savepoints.append(checkpoint_id)
        expected = self._in_handle_order(expected)
        self._add(Snapshot(checkpoint_id, True, completed, metadata, expected))

    @rule(
        private=PRIVATE,
        new_shared=NEW_SHARED,
        abandoned_stream=st.booleans(),
        clean=st.booleans(),
        torn_publish=st.booleans(),
    )
    def failed_checkpoint(self, private, new_shared, abandoned_stream, clean, torn_publish):
        """A checkpoint failing midway: aborted cleanly, or crashed leaving its files."""
        checkpoint_id = self._next_id()
        location = self.access.initialize_location_for_checkpoint(checkpoint_id)
        written: list = []
        self._write(location, private, EXCLUSIVE, written, [])
        self._write(location, new_shared, SHARED, written, [])
        if abandoned_stream:
            stream = location.create_checkpoint_state_output_stream(EXCLUSIVE)
            stream.write(self._payload(300))
            stream.close()  # the task failed: nothing is committed
        if clean:
            abort_checkpoint(location, written)
        else:
            self.orphans |= {norm(self.fs, h.path) for h in written}
            self.orphan_dirs.add(checkpoint_id)
            if torn_publish:
                temp = f"{self.job}/chk-{checkpoint_id}/._metadata.{uuid.uuid4().hex}.inprogress"
                self.fs.pipe_file(temp, self._payload(100)[:37])
                self.orphans.add(temp)

    @rule()
    def crash_and_restart(self):
        """A new coordinator rebuilds the store from storage alone; savepoints are forgotten."""
        self._restart()

    @rule()
    def garbage_collection(self):
        """GC without grace leaves exactly what retained checkpoints reference, all of it."""
        self.store.shared_state_registry.wait_for_pending_deletions()
        result = collect_garbage(self.access, grace_period=0, now=FAR_FUTURE)
        self.store.shared_state_registry.wait_for_pending_deletions()
        referenced = self._referenced()
        deleted = {norm(self.fs, url) for url in result.deleted}
        kept = {norm(self.fs, url) for url in result.kept}
        assert not deleted & referenced, f"GC deleted referenced files {deleted & referenced}"
        assert referenced == kept, f"GC kept {kept - referenced}, missed {referenced - kept}"
        found = self._job_files()
        assert referenced == found, (
            f"after GC: unreferenced {sorted(found - referenced)}, "
            f"missing {sorted(referenced - found)}"
        )
        self.orphans.clear()
        self.orphan_dirs.clear()
        if self.local:
            regular = {i for i in self.entries if not self.snapshots[i].savepoint}
            assert regular == self._chk_directories()

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    @precondition(lambda self: self.store is not None)
    def store_holds_what_subsumption_predicts(self):
        """The store holds the predicted entries, at most max_retained regular ones unless
        it recovered a surplus that the next add subsumes."""
        self._settle()
        actual = [(c.checkpoint_id, c.is_savepoint()) for c in self.store.all()]
        assert [(i, self.snapshots[i].savepoint) for i in self.entries] == actual
        regular = sum(not savepoint for _, savepoint in actual)
        assert (regular > self.max_retained) == self.store.needs_subsumption

    @invariant()
    @precondition(lambda self: self.store is not None)
    def newest_completed_checkpoint_restores(self):
        """latest_completed_checkpoint() is the store's newest checkpoint and restores exactly."""
        self._settle()
        latest_id = self._latest_regular()
        found = self.access.latest_completed_checkpoint()
        if latest_id is None:
            assert found is None
            return
        snapshot = self.snapshots[latest_id]
        latest = self.store.latest()
        if not latest.is_savepoint():
            assert found == latest.location
        assert found == snapshot.location
        metadata = found.load_metadata()
        assert snapshot.metadata == metadata
        assert list(snapshot.expected) == [read(h) for h in metadata.all_handles()]

    @invariant()
    @precondition(lambda self: self.store is not None)
    def nothing_referenced_is_gone(self):
        """Retained checkpoints, every savepoint ever taken and task-owned state read back."""
        self._settle()
        paths = set(self.task_owned)
        for i in set(self.entries) | set(self.savepoints):
            snapshot = self.snapshots[i]
            paths.add(norm(self.fs, snapshot.location.metadata_handle.path))
            paths |= {
                norm(self.fs, h.path)
                for h in snapshot.metadata.all_handles()
                if isinstance(h, FileStateHandle)
            }
        stored = self.fs.cat(sorted(paths), on_error="return") if paths else {}
        damaged = {
            p: stored.get(p) for p in paths if stored.get(p) != self.contents[p]
        }  # missing files come back as exceptions
        assert not damaged, f"referenced files gone or changed: {damaged}"

    @invariant()
    @precondition(lambda self: self.store is not None)
    def job_directory_holds_nothing_unexpected(self):
        """The job directory holds only referenced files and uncollected crash leftovers."""
        unexpected = self._job_files() - self._referenced() - self.orphans
        assert not unexpected, f"unreferenced files left behind: {sorted(unexpected)}"
        if self.local:
            regular = {i for i in self.entries if not self.snapshots[i].savepoint}
            assert self._chk_directories() <= regular | self.orphan_dirs

    def teardown(self):
        if self.store is not None:
            self.store.shutdown(JobStatus.SUSPENDED)  # keeps everything, stops its thread


def run_model(base_url: str, storage_options: dict, **overrides) -> None:
    run_state_machine_as_test(
        lambda: LifecycleModel(base_url, storage_options),
        settings=settings(MODEL_SETTINGS, **overrides),
    )


@pytest.mark.slow
def test_lifecycle_model_on_local_disk(tmp_path):
    """The lifecycle model holds on local disk."""
    run_model(str(tmp_path), {}, max_examples=LOCAL_EXAMPLES)


def test_lifecycle_model_on_s3(s3_server):
    """The lifecycle model holds on S3 (moto server)."""
    run_model(f"s3://{s3_server.new_bucket()}", s3_server.storage_options)
