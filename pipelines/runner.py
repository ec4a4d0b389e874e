"""The stateful runner: drives a pipeline's source batches through its stages, partition by
partition, and checkpoints their state the way Flink does.

The driver is the coordinator: it creates a checkpoint location, ships the storage config,
checkpoint id and location reference to the executors, and each partition task resolves
the reference through the worker view and streams its slice of the state into it
(``state_io.write_state_partition``). The driver collects the handles, stores
``CheckpointMetadata`` with the source position and the pipeline's name as master states,
and finalizes: `_metadata` appears last, so a checkpoint is complete or invisible.

Exactly once: state is versioned by source position, ``(partition, batches applied,
complete)``. Processing partition P needs the state after the partition before P (or a
checkpoint inside P); the runner restores the newest such snapshot and replays only the
batches after it. Sinks write per partition (and batch) idempotently, so replays replace.
"""

import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pyspark.sql import DataFrame, SparkSession

from checkpoint_storage import (
    CheckpointMetadata,
    CheckpointRetentionPolicy,
    CheckpointStorage,
    CommitStateUnknownError,
    RestoreMode,
    VerificationProblem,
    url_to_fs,
)
from checkpoint_storage.exceptions import CheckpointAlreadyExistsError
from checkpoint_storage.spi import (
    DEFAULT_LEASE_TTL,
    JOB_NAME_STATE,
    SOURCE_POSITION_STATE,
    STATISTICS_STATE,
    CheckpointProperties,
    CheckpointStorageLocation,
    CompletedCheckpoint,
    CompletedCheckpointStorageLocation,
    FileSystemCompletedCheckpointStore,
    compute_checkpoint_statistics,
    encode_checkpoint_statistics,
    format_size,
    store_checkpoint_metadata,
    verify_state_handles,
)
from pipelines._bootstrap import rows_of
from pipelines._positions import (
    SourcePosition,
    _position_key,
    batches_digest,
    head_of,
    job_id_for,
    partition_ends,
    position_retention,
)
from pipelines._restore_checks import (
    ClaimRefusedError,
    CorruptStateError,
    DamagedState,
    MissingStateError,
    NonRestoredStateError,
    _does_not_fit_message,
    _handle_key,
    _starts_after,
    check_claim,
    check_non_restored_state,
    check_restore_from,
    damaged_state,
    evolved_keyed_stages,
)
from pipelines._spec import SOURCE, StatefulPipeline
from pipelines._stage_kinds import empty_state, stage_kinds
from pipelines.keyed import DEFAULT_LOCAL_STORE_MAX_AGE

__all__ = [
    "SCHEDULED_SAVEPOINTS",
    "BatchListChangedError",
    "CheckpointSummary",
    "ClaimRefusedError",
    "CorruptStateError",
    "DamagedState",
    "MissingStateError",
    "NonRestoredStateError",
    "PartitionResult",
    "SourcePosition",
    "StageError",
    "StatefulRunner",
    "batches_digest",
    "check_claim",
    "check_restore_from",
    "damaged_state",
    "empty_state",
    "head_of",
    "job_id_for",
    "partition_ends",
    "position_retention",
]

logger = logging.getLogger(__name__)

# The subdirectory of the savepoint directory that scheduled savepoints go to (sensors/).
SCHEDULED_SAVEPOINTS = "scheduled"


class BatchListChangedError(RuntimeError):
    """A partition's batch list no longer starts with the batches a checkpoint applied: some
    vanished or were reordered after the checkpoint was taken."""


class StageError(RuntimeError):
    """A stage failed on a batch, in the driver or in a Spark Python worker. Its message is one
    line: pipeline, stage, partition and batch (its number, from 1, and id), then the original
    error's own last line (``ValueError: ...``; a worker's Python exception without Spark's
    Java traces). The original, with its full traceback, is ``__cause__``; ``batch_index``
    counts from 0."""

    def __init__(self, message: str, *, pipeline: str | None = None, stage: str | None = None,
                 partition: str | None = None, batch_index: int | None = None,
                 batch_id: str | None = None) -> None:
        super().__init__(message)
        self.pipeline, self.stage, self.partition = pipeline, stage, partition
        self.batch_index, self.batch_id = batch_index, batch_id


_TRACEBACK = "Traceback (most recent call last):"
_PY4J_CALL = "An error occurred while calling "


def error_line(error: BaseException) -> str:
    """The one line that says what ``error`` is: ``Type: message`` (its first line). For an
    error of a Spark Python worker (PySpark's ``PythonException``, or a Py4J error carrying
    the worker's traceback among Java frames), the worker's own exception line."""
    text = str(error)
    if _TRACEBACK in text:
        # The last traceback is the exception raised last; its frames are indented, its
        # exception line is not.
        for line in text.rsplit(_TRACEBACK, 1)[1].splitlines()[1:]:
            if line.strip() and not line[0].isspace():
                return line.removesuffix(" SQLSTATE: 38000").strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and lines[0].startswith(_PY4J_CALL):
        # Py4J: "An error occurred while calling o42.x." then ": java.lang.Error: ..."
        return next((line.lstrip(": ") for line in lines[1:]), lines[0])
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


@dataclass(frozen=True)
class CheckpointSummary:
    """A checkpoint (or savepoint) the runner completed: its id and pointer, the position its
    state is at, its state size in bytes, the state files it wrote and the states it kept
    inline in `_metadata`, and its rows per stage."""

    checkpoint_id: int
    pointer: str
    position: SourcePosition
    savepoint: bool
    state_bytes: int
    files_written: int
    inline_states: int
    state_rows: dict[str, int]
    """Live rows per stage: a keyed stage's expired rows (kept until a full snapshot drops
    them) are in ``expired_rows``, not here."""
    expired_rows: dict[str, int | None] = field(default_factory=dict)
    """Rows per stage that the TTL had expired, not dropped yet (0 for a DataFrame stage;
    None: not known, a keyed state restored from a checkpoint that did not record it)."""
    statistics: dict | None = None
    """Its statistics (``checkpoint_storage.spi.checkpoint_statistics``): what `_metadata`
    recorded, with the `_metadata` publication's duration that only the runner knows."""


@dataclass
class PartitionResult:
    """What running one partition did: the snapshot it restored from (None: empty state),
    the batches it applied, its last checkpoint and every checkpoint it took, the rows each
    stage (and the source) handled, and how long it took in seconds."""

    partition: str
    restored_from: str | None
    batches_applied: int
    checkpoint: CheckpointSummary
    checkpoints_taken: list[CheckpointSummary] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0
    rewound: str | None = None
    """For the first partition of a run that started before the pipeline's head: "rewound
    from end of X to end of Y; the head is kept at <pointer>"."""


FaultHook = Callable[..., None]


def _unmerged_state(storage: CheckpointStorage, pipeline: StatefulPipeline) -> str | None:
    """What file merging, enabled on ``storage``, leaves unmerged in ``pipeline`` (None:
    nothing, or merging is off). A Spark task writes one file per checkpoint, so only a
    keyed range's change files, appended across checkpoints, can be packed."""
    if not storage.file_merging_enabled:
        return None
    unmerged = []
    if len(pipeline.keyed_stages) < len(pipeline.stages):
        unmerged.append("the state of DataFrame stages is written one file per Spark task "
                        "and checkpoint")
    if pipeline.keyed_stages and not storage.resumes_physical_files:
        unmerged.append("the change files of keyed stages are packed only with "
                        "file_merging_across_checkpoint_boundary=True, on local disk (an "
                        "object cannot be appended to); they are one file per range and "
                        "checkpoint")
    return "; ".join(unmerged) or None


class StatefulRunner:
    """Runs ``pipeline`` over its partitions, checkpointing through ``storage``. The first of
    the pipeline's partitions starts from empty state; every other one from a snapshot.

    One writer per pipeline: ``run`` holds the job directory's lease (``lease_owner`` names
    this runner, e.g. the Dagster run; ``lease_ttl`` is how long a lease outlives a crashed
    holder) for as long as it runs, and every `_metadata` it publishes records the lease's
    epoch; a second runner of the pipeline waits up to ``lease_wait`` seconds (default: the
    ttl and a half, long enough for a crashed holder's lease to expire), then fails with
    ``JobLeaseHeldError`` naming the holder.

    Keyed stages run on the pipeline's ``keyed_parallelism`` key group ranges (default:
    Spark's default parallelism, at most ``max_parallelism``); state restored at another
    parallelism is rescaled first. Their local stores live below ``keyed_local_dir`` on each
    executor (default: its temp directory); a batch's task removes the stores there (any
    job's) not written for ``keyed_local_max_age`` (default 7 days; None: never), caches a
    later batch would rebuild from the checkpoint. A task waits at most ``lease_ttl`` for a
    local store's lock (held by a stalled task, e.g. of a fenced earlier run), then rebuilds
    the range in a private copy beside it.

    ``fault_hook(point, **info)`` is a test seam called at ``batch_applied`` and
    ``before_metadata``; ``task_after_write(subtask, attempt)`` runs on the executors after a
    state file is written (a keyed stage's: subtask = range, after a change file or
    full snapshot and the local store's update)."""

    def __init__(
        self,
        spark: SparkSession,
        storage: CheckpointStorage,
        pipeline: StatefulPipeline,
        *,
        fault_hook: FaultHook | None = None,
        task_after_write: Callable[[int, int], None] | None = None,
        lease_owner: str | None = None,
        lease_ttl: dt.timedelta = DEFAULT_LEASE_TTL,
        lease_wait: float | None = None,
        keyed_local_dir: str | None = None,
        keyed_local_max_age: dt.timedelta | None = DEFAULT_LOCAL_STORE_MAX_AGE,
    ) -> None:
        self.spark = spark
        self.storage = storage
        self.pipeline = pipeline
        self.order = pipeline.order
        self.job_id = job_id_for(pipeline.name)
        self.stages = pipeline.stages
        self._fault = fault_hook or (lambda point, **info: None)
        self._task_after_write = task_after_write
        self._last_checkpoint_id = 0
        self.access = storage.create_checkpoint_storage(self.job_id)
        self._store: FileSystemCompletedCheckpointStore | None = None
        self._coordinating = False
        self._lease_owner = lease_owner
        self._lease_ttl = lease_ttl
        self._lease_wait = lease_ttl.total_seconds() * 1.5 if lease_wait is None else lease_wait
        unmerged = _unmerged_state(storage, pipeline)
        if unmerged:
            # Said once, not ignored silently: a user who enabled it expects packed files.
            logger.warning("pipeline %s: the checkpoint storage enables file merging, but %s "
                           "(docs/design.md, 7.7)", pipeline.name, unmerged)
        # How each stage is run, by name: one interface for both stage kinds.
        self._kinds = stage_kinds(
            spark, storage, pipeline, str(self.job_id), after_write=task_after_write,
            keyed_local_dir=keyed_local_dir, keyed_local_max_age=keyed_local_max_age,
            local_lock_timeout=lease_ttl)
        # The index of the stage that is the source's only reader, if one is and it counts its
        # input in its one pass (a keyed stage): the batch is then not pinned first.
        readers = [n for n in range(len(self.stages)) if pipeline.input_of(n) == SOURCE]
        self._counting_source_reader = (
            readers[0] if len(readers) == 1
            and self._kinds[self.stages[readers[0]].name].counts_its_input else None)
        # The next checkpoint's id and location, allocated by the first write into it (keyed
        # stages write change files into it batch by batch).
        self._pending: tuple[int, CheckpointStorageLocation] | None = None
        # Whether keyed state was prepared (snapshotted or rescaled where due) since the
        # last checkpoint: done once per interval, before anything is written into it.
        self._interval_prepared = False
        # Whether the next interval must snapshot keyed state whole: after a restore of a
        # snapshot this job does not own for good (any savepoint, a checkpoint in NO_CLAIM
        # mode), so no checkpoint of ours references its files.
        self._full_snapshot_due = False
        # The restored snapshot's keyed ranges whose files did not verify (repaired before
        # the first batch), and what verifying its files cost: (files, bytes, seconds).
        self._damaged: list[DamagedState] = []
        self.restore_verification: tuple[int, int, float] | None = None
        # Whether a restore may leave behind the state of stages the pipeline no longer has,
        # and the stages that start from their initial state (before the first batch).
        self._allow_non_restored_state = False
        self._to_bootstrap: list[str] = []
        # For the statistics: when the current checkpoint interval's batches began (None:
        # not applying batches), and how long the last `_metadata` publication took (a
        # `_metadata` cannot record its own: the next one records it).
        self._interval_started: float | None = None
        self._last_publication: dict | None = None

    @property
    def store(self) -> FileSystemCompletedCheckpointStore:
        """The pipeline's completed checkpoints, recovered from storage when first needed (a
        run recovers it again once it holds the job lease)."""
        if self._store is None:
            self._store = self._recover_store()
        return self._store

    def _recover_store(self) -> FileSystemCompletedCheckpointStore:
        """The completed checkpoints of the pipeline's job directory (reads only). Checkpoints
        outlive runs: the job is suspended between partitions, never finished."""
        return FileSystemCompletedCheckpointStore(
            self.access,
            self.pipeline.max_retained_checkpoints,
            CheckpointRetentionPolicy.RETAIN_ON_CANCELLATION,
            also_retain=position_retention(self.pipeline),
        )

    def _coordinate(self) -> None:
        """Coordinator setup before the first checkpoint or savepoint this runner writes
        (never on construction: reading changes nothing)."""
        if not self._coordinating:
            self.access.initialize_base_locations()
            self._coordinating = True

    # --- running partitions ------------------------------------------------------------

    def run(
        self,
        partitions: Sequence[str],
        *,
        restore_from: str | None = None,
        restore_mode: RestoreMode | str = RestoreMode.NO_CLAIM,
        on_partition_done: Callable[[PartitionResult], None] | None = None,
        on_progress: Callable[[str], None] | None = None,
        allow_non_restored_state: bool = False,
    ) -> list[PartitionResult]:
        """Process consecutive ``partitions`` in order in this session, starting from the
        snapshot that fits the first one (``restore_from``, else the newest retained
        checkpoint that fits), and checkpointing every ``checkpoint_interval`` batches and at
        the end of each partition. ``on_partition_done`` hears of each partition as soon as
        its final checkpoint completed; ``on_progress`` gets a line for the restored state, and
        per partition a line when it starts, per batch, per checkpoint and when it is done.

        A restored snapshot's state evolves into the stages' state schemas (docs/pipelines.md,
        "Upgrading a pipeline"); a stage it lacks starts from its initial state, or empty; the
        state of a stage the pipeline no longer has is refused (``NonRestoredStateError``)
        unless ``allow_non_restored_state``."""
        partitions = self.order.check_consecutive(partitions)
        if not partitions:
            return []
        self._allow_non_restored_state = allow_non_restored_state
        self._coordinate()
        with self.access.acquire_job_lease(
            self._lease_owner, ttl=self._lease_ttl, wait=self._lease_wait
        ):
            return self._run_holding_lease(
                partitions, restore_from, RestoreMode(restore_mode), on_partition_done,
                on_progress,
            )

    def _run_holding_lease(
        self, partitions, restore_from, restore_mode, on_partition_done, on_progress
    ) -> list[PartitionResult]:
        # Recovered under the lease: whatever another coordinator committed before is seen.
        self._store = self._recover_store()
        head = head_of(self._store.all(), self.order)
        origin, states, position = self._starting_point(partitions[0], restore_from, restore_mode)
        if on_progress is not None:
            on_progress(
                f"restored {origin} ({position})" if origin else "starting from empty state"
            )
        rewound = self._rewind_note(head, origin, position)
        if rewound is not None:
            logger.warning("pipeline %s: %s", self.pipeline.name, rewound)
            if on_progress is not None:
                on_progress(rewound)
        results = []
        try:
            if self._damaged:
                repaired = self._repair(states, origin, partitions[0])
                if on_progress is not None:
                    on_progress(repaired)
            for name in self._to_bootstrap:
                states[name] = self._bootstrap(states, name)
                if on_progress is not None:
                    on_progress(f"{name}: started from its initial state")
            self._to_bootstrap = []
            for partition in partitions:
                result = self._run_partition(partition, states, position, origin, on_progress)
                if not results:
                    result.rewound = rewound
                results.append(result)
                if on_partition_done is not None:
                    on_partition_done(result)
                position = result.checkpoint.position
                origin = result.checkpoint.pointer
        finally:
            for state in states.values():
                state.unpersist()
        return results

    def _rewind_note(self, head: CompletedCheckpoint | None, origin: str | None,
                     position: SourcePosition) -> str | None:
        """What a run that starts before the pipeline's ``head`` says (None: it does not).
        The head is secured by retention (``position_retention``) for as long as it is the
        furthest position, so nothing needs copying here."""
        if head is None:
            return None
        at = SourcePosition.of(head.metadata)
        start = _position_key(position, self.order)
        if start is None or start >= _position_key(at, self.order):
            return None
        started = str(position) if origin is not None else "empty state"
        following = self.order.following(at.partition) if at.complete else at.partition
        return (f"rewound from {at} to {started}; the head is kept at {head.external_pointer}"
                + (f" (a run of {following} continues from it)" if following else ""))

    def _batches_after(self, partition: str, position: SourcePosition) -> tuple[list[str], int]:
        """The partition's batches, and how many of them ``position`` already applied; a
        clear error when the list no longer starts with the batches it applied."""
        batches = self.pipeline.source.batches(self.spark, partition)
        if position.partition != partition:
            return batches, 0
        applied = position.batches
        if position.digest is not None and (
            len(batches) < applied or batches_digest(batches[:applied]) != position.digest
        ):
            where = self.pipeline.source.describe(partition)
            raise BatchListChangedError(
                f"the batches of partition {partition} ({where}) changed after the checkpoint "
                f"at {position} applied {applied} of them: {len(batches)} batches are listed "
                f"now and the first {min(applied, len(batches))} are not the ones applied "
                "(files vanished, were renamed or sort differently). New batches may only be "
                f"appended. Restore the original batches, or process {partition} again from "
                f"{_starts_after(self.order, partition)} (restore_from a snapshot there)"
            )
        if len(batches) < applied:  # positions without a digest: at least the count must hold
            raise BatchListChangedError(
                f"partition {partition} lists {len(batches)} batches, but the checkpoint at "
                f"{position} applied {applied}: batches vanished"
            )
        return batches, applied

    def _run_partition(
        self,
        partition: str,
        states: dict[str, DataFrame],
        position: SourcePosition,
        origin: str | None,
        on_progress: Callable[[str], None] | None = None,
    ) -> PartitionResult:
        started = time.monotonic()
        progress = on_progress or (lambda line: None)
        batches, first = self._batches_after(partition, position)
        progress(
            f"{partition}: {len(batches) - first} of {len(batches)} batches to apply"
            + (f" (the first {first} are in the restored state)" if first else "")
        )
        if first == 0:
            for sink in self.pipeline.sinks:
                if sink.of == "output":
                    sink.clear(self.spark, partition)
        rows = {SOURCE: 0} | {stage.name: 0 for stage in self.stages}
        taken: list[CheckpointSummary] = []
        self._interval_started = time.monotonic()
        interval = self.pipeline.checkpoint_interval
        for index in range(first, len(batches)):
            applied, notes = self._apply_batch(states, partition, batches, index, rows)
            progress(
                f"{partition}: batch {index + 1} of {len(batches)} ({applied} rows in)"
                + "".join(f"; {note}" for note in notes)
            )
            self._fault("batch_applied", partition=partition, batch=index)
            done = index + 1
            position = SourcePosition(
                partition, done, done == len(batches), batches_digest(batches[:done])
            )
            if not position.complete and (done - first) % interval == 0:
                taken.append(self.checkpoint(states, position))
                progress(_checkpoint_line(taken[-1]))
        if first == len(batches):  # nothing (left) to apply: still a full partition checkpoint
            position = SourcePosition(partition, len(batches), True, batches_digest(batches))
        for sink in self.pipeline.sinks:
            if sink.of == "state":
                sink.write(self.spark, self._kinds[sink.stage].frame(states[sink.stage]),
                           partition, None)
        final = self.checkpoint(states, position)
        self._interval_started = None
        taken.append(final)
        progress(_checkpoint_line(final))
        duration = time.monotonic() - started
        progress(
            f"{partition}: done, {len(batches) - first} batches, {rows[SOURCE]} rows in, "
            f"{duration:.1f} s"
        )
        return PartitionResult(
            partition,
            origin,
            len(batches) - first,
            final,
            taken,
            rows,
            duration,
        )

    def _apply_batch(
        self, states: dict[str, DataFrame], partition: str, batches: list[str], index: int,
        rows: dict
    ) -> tuple[int, list[str]]:
        """Apply batch ``index`` of ``batches`` to every stage; returns the source rows read and
        notes for the progress line (keyed stages' local stores that had to be rebuilt, and
        their cost). A stage's failure is a ``StageError`` naming stage, partition and batch."""
        batch = batches[index]
        data = self.pipeline.source.read(self.spark, partition, batch)
        if self._counting_source_reader is not None:
            # Pinning it first would cost two Spark jobs per batch.
            outputs, count = {SOURCE: data}, None
        else:
            # Compute once (cached): every stage reading the source sees the same rows.
            outputs = {SOURCE: data.localCheckpoint(eager=True)}
            count = outputs[SOURCE].count()
        notes: list[str] = []
        applied = []
        for number, stage in enumerate(self.stages):
            kind = self._kinds[stage.name]
            if kind.writes_between_checkpoints:
                notes += self._prepare_interval(states)
            try:
                states[stage.name], result = kind.apply(
                    outputs[self.pipeline.input_of(number)], states[stage.name],
                    self._pending_location, index)
            except Exception as exc:
                raise self._stage_error(stage.name, partition, batches, index, exc) from exc
            applied.append(result)
            notes += result.notes
            rows[stage.name] += result.output_rows
            if number == self._counting_source_reader:
                count = result.input_rows
            outputs[stage.name] = result.output
            outputs.update(result.named_outputs)
        for sink in self.pipeline.sinks:
            if sink.of == "output":
                sink.write(self.spark, outputs[sink.stage], partition, index)
        for output in outputs.values():
            output.unpersist()
        for result in applied:
            result.release()
        rows[SOURCE] += count
        return count, notes

    def _stage_error(self, stage: str, partition: str, batches: list[str], index: int,
                     error: Exception) -> StageError:
        """``error`` of ``stage`` on batch ``index`` of ``batches``, as one line."""
        if isinstance(error, StageError):
            return error
        return StageError(
            f"pipeline {self.pipeline.name}, stage {stage}, partition {partition}, batch "
            f"{index + 1} of {len(batches)} (id {batches[index]}): {error_line(error)}",
            pipeline=self.pipeline.name, stage=stage, partition=partition, batch_index=index,
            batch_id=batches[index])

    # --- checkpoints and savepoints ----------------------------------------------------

    def next_checkpoint_id(self) -> int:
        """Above every id this runner used or sees in storage: like Flink's counter, an id
        is never reused, not even that of a checkpoint that failed and was disposed."""
        ids = [c.checkpoint_id for c in self.store.all()]
        self._last_checkpoint_id = max(
            [*(i + 1 for i in ids), self._last_checkpoint_id + 1, self.access.next_checkpoint_id()]
        )
        return self._last_checkpoint_id

    def _pending_location(self) -> tuple[int, CheckpointStorageLocation]:
        """The id and location of the next checkpoint, allocated on first use."""
        if self._pending is None:
            self._coordinate()
            checkpoint_id = self.next_checkpoint_id()
            self._pending = (checkpoint_id,
                             self.access.initialize_location_for_checkpoint(checkpoint_id))
        return self._pending

    def _prepare_interval(self, states: dict) -> list[str]:
        """Once per checkpoint interval, before its first write: rescale keyed state to this
        runner's parallelism, and snapshot the ranges that are due (every range after a
        restore of a savepoint or a NO_CLAIM restore, so that the next checkpoint references
        no file of the restored snapshot). Returns notes on local stores rebuilt meanwhile."""
        writing = [k for k in self._kinds.values() if k.writes_between_checkpoints]
        if self._interval_prepared or not writing:
            return []
        self._pending_location()
        full = self._full_snapshot_due or self.store.requires_full_checkpoint()
        notes = []
        for kind in writing:
            states[kind.stage.name], prepared = kind.prepare(
                states[kind.stage.name], self._pending_location, full=full)
            notes += prepared
        self._interval_prepared = True
        self._full_snapshot_due = False
        return notes

    def checkpoint(
        self, states: dict[str, DataFrame], position: SourcePosition
    ) -> CheckpointSummary:
        batch_ms = (None if self._interval_started is None
                    else (time.monotonic() - self._interval_started) * 1000)
        self._prepare_interval(states)
        checkpoint_id, location = self._pending_location()
        self._pending = None
        summary, completed, metadata = self._snapshot(
            states, position, checkpoint_id, location, CheckpointProperties.for_checkpoint(),
            batch_ms,
        )
        self.store.add_checkpoint(CompletedCheckpoint(completed, metadata))
        self._interval_prepared = False
        if self._interval_started is not None:
            self._interval_started = time.monotonic()
        return summary

    def take_savepoint(
        self, target_directory: str | None = None, *, restore_from: str | None = None
    ) -> CheckpointSummary:
        """Write a self-contained savepoint of the latest completed checkpoint (or of
        ``restore_from``): the state is restored on the executors and written straight into
        the savepoint directory through the savepoint location's reference."""
        if restore_from is not None:
            source = self.access.resolve_checkpoint(restore_from)
            metadata = source.load_metadata()
        else:
            latest = self.store.latest()
            if latest is None:
                raise MissingStateError(
                    f"no completed checkpoint in {self.access.checkpoints_directory} to take a "
                    "savepoint of: run the pipeline first"
                )
            metadata = latest.metadata
        states = self._restore(metadata)
        try:
            return self.savepoint(states, SourcePosition.of(metadata), metadata.checkpoint_id,
                                  target_directory)
        finally:
            for state in states.values():
                state.unpersist()

    def write_savepoint(self, rows: Mapping[str, DataFrame], position: SourcePosition,
                        target_directory: str | None = None) -> CheckpointSummary:
        """Write a self-contained savepoint whose state is ``rows`` (per stage name; a stage
        not given holds no rows) at ``position``, like a savepoint taken of a run that built
        that state (Flink's State Processor API). Keyed stages' rows are routed by key group
        into the savepoint directory, then written as full snapshots there."""
        unknown = [name for name in rows if name not in self._kinds]
        if unknown:
            raise ValueError(f"pipeline {self.pipeline.name} has no stage(s) {unknown} (its "
                             f"stages: {[stage.name for stage in self.stages]})")
        self._coordinate()
        checkpoint_id = self.next_checkpoint_id()
        location = self.access.initialize_location_for_savepoint(checkpoint_id, target_directory)
        states = {stage.name: self._kinds[stage.name].empty() for stage in self.stages}
        try:
            try:
                for name, frame in rows.items():
                    states[name] = self._kinds[name].bootstrap(
                        frame, states[name], lambda: (checkpoint_id, location))
            except BaseException:
                location.dispose_on_failure()
                raise
            # The routed rows, superseded by the full snapshots the savepoint references.
            loaded = [handle for state in states.values()
                      for chain in getattr(state, "chains", ()) for handle in chain.changes]
            summary, _, _ = self._snapshot(
                states, position, checkpoint_id, location, CheckpointProperties.for_savepoint())
        finally:
            for state in states.values():
                state.unpersist()
        for handle in loaded:
            try:
                handle.discard_state()
            except OSError as exc:  # an unreferenced file left in the savepoint directory
                logger.warning("could not remove %s: %s", handle, exc)
        return summary

    def savepoint(
        self,
        states: dict[str, DataFrame],
        position: SourcePosition,
        checkpoint_id: int,
        target_directory: str | None = None,
    ) -> CheckpointSummary:
        self._coordinate()
        location = self.access.initialize_location_for_savepoint(checkpoint_id, target_directory)
        summary, _, _ = self._snapshot(
            states, position, checkpoint_id, location, CheckpointProperties.for_savepoint()
        )
        return summary

    def _snapshot(
        self,
        states: dict[str, DataFrame],
        position: SourcePosition,
        checkpoint_id: int,
        location: CheckpointStorageLocation,
        properties: CheckpointProperties,
        batch_ms: float | None = None,
    ) -> tuple[CheckpointSummary, CompletedCheckpointStorageLocation, CheckpointMetadata]:
        master = {
            SOURCE_POSITION_STATE: position.to_bytes(),
            JOB_NAME_STATE: self.pipeline.name.encode(),
        }
        operator_states = []
        state_rows, expired_rows, parts = {}, {}, {}
        writing = time.monotonic()
        try:
            for stage in self.stages:
                snapshot = self._kinds[stage.name].snapshot(
                    states[stage.name], checkpoint_id, location,
                    savepoint=properties.is_savepoint())
                operator_states.append(snapshot.operator_state)
                master.update(snapshot.master_states)
                state_rows[stage.name] = snapshot.rows
                expired_rows[stage.name] = snapshot.expired_rows
                parts[stage.name] = snapshot.parts
            metadata = CheckpointMetadata(
                checkpoint_id,
                tuple(operator_states),
                master,
                properties,
                self.job_id,
                int(time.time() * 1000),
            )
            # New files: those no retained checkpoint references (a savepoint's are all new).
            previous = ([] if properties.is_savepoint()
                        else [c.metadata for c in self.store.all()])
            statistics = compute_checkpoint_statistics(
                metadata, previous, stages=parts,
                durations_ms={"batch": batch_ms,
                              "state_write": (time.monotonic() - writing) * 1000},
                previous_publication=self._last_publication)
            metadata = dataclasses.replace(metadata, master_states={
                **master, STATISTICS_STATE: encode_checkpoint_statistics(statistics)})
            self._fault("before_metadata", checkpoint_id=checkpoint_id)
            publishing = time.monotonic()
            out = location.create_metadata_output_stream()
            store_checkpoint_metadata(metadata, out)
        except BaseException:
            location.dispose_on_failure()
            raise
        try:
            completed = out.close_and_finalize_checkpoint()
        except (CheckpointAlreadyExistsError, CommitStateUnknownError):
            raise  # the files may belong to a committed checkpoint: keep them
        except BaseException:
            location.dispose_on_failure()
            raise
        published_ms = round((time.monotonic() - publishing) * 1000, 1)
        self._last_publication = {"checkpoint_id": checkpoint_id, "ms": published_ms}
        statistics["durations_ms"]["metadata_publication"] = published_ms
        handles = metadata.all_handles()
        files = [h for h in handles if hasattr(h, "path")]
        summary = CheckpointSummary(
            checkpoint_id,
            completed.external_pointer,
            position,
            properties.is_savepoint(),
            metadata.state_size,
            len(files),
            len(handles) - len(files),
            state_rows,
            expired_rows,
            statistics,
        )
        logger.info("completed %s %s at %s", "savepoint" if summary.savepoint else "checkpoint",
                    summary.pointer, position)
        return summary, completed, metadata

    # --- restore -----------------------------------------------------------------------

    def restore_states(
        self, metadata: CheckpointMetadata, parallelism: int | None = None, *,
        include_expired: bool = False,
    ) -> dict[str, DataFrame]:
        """The stages' state DataFrames from a snapshot: the executors read and verify
        their handles through fsspec (inline handles carry their bytes). Any parallelism:
        one task per handle (a keyed stage: per key group range), then ``parallelism``
        partitions when given. A keyed stage's expired rows (not dropped yet) only with
        ``include_expired``."""
        return {stage.name: self._kinds[stage.name].restore_frame(
                    metadata, parallelism, include_expired=include_expired)
                for stage in self.stages}

    def _restore(self, metadata: CheckpointMetadata, pointer: str | None = None) -> dict:
        """The stages' states from a snapshot: DataFrames read by the executors, and keyed
        stages' chains (their files are read when a task needs them), evolved into the
        stages' state schemas. A stage the snapshot lacks (added since) starts empty; one it
        has that the pipeline lacks is refused unless non-restored state is allowed."""
        pointer = pointer or f"checkpoint {metadata.checkpoint_id}"
        gone = check_non_restored_state(metadata, self.pipeline, pointer,
                                        self._allow_non_restored_state)
        if gone:
            logger.warning("pipeline %s: the state of stage(s) %s in %s is not restored "
                           "(allow_non_restored_state)", self.pipeline.name, gone, pointer)
        held = {op.operator_id for op in metadata.operator_states}
        states = {}
        for stage in self.stages:
            kind = self._kinds[stage.name]
            if stage.name in held:
                states[stage.name] = kind.restore(metadata)
            else:
                logger.info("pipeline %s: %s holds no state of stage %s (added since): it "
                            "starts %s", self.pipeline.name, pointer, stage.name,
                            "from its initial state" if stage.name in self.pipeline.initial_state
                            else "empty")
                states[stage.name] = kind.empty()
        return states

    def _restored(self, metadata: CheckpointMetadata, pointer: str) -> dict:
        """``_restore`` for a run: the stages the snapshot lacks that have an initial state
        are bootstrapped before the first batch; a stage whose state schema changed makes
        the first interval snapshot keyed state whole, so that no later checkpoint references
        a file written under the old schema."""
        states = self._restore(metadata, pointer)
        held = {op.operator_id for op in metadata.operator_states}
        self._to_bootstrap = [n for n in self.pipeline.initial_state if n not in held]
        ignored = [n for n in self.pipeline.initial_state if n in held]
        if ignored:
            logger.info("pipeline %s: initial_state of stage(s) %s ignored: %s holds their "
                        "state", self.pipeline.name, ignored, pointer)
        if evolved_keyed_stages(metadata, self.pipeline):
            self._full_snapshot_due = True
        return states

    def _bootstrap(self, states: dict, name: str):
        """Stage ``name``'s initial state (``StatefulPipeline.initial_state``), written into
        the pending checkpoint by a keyed stage."""
        kind = self._kinds[name]
        if kind.writes_between_checkpoints:
            self._prepare_interval(states)
        rows = rows_of(self.spark, self.pipeline.initial_state[name],
                       f"pipeline {self.pipeline.name}, initial_state of stage {name}")
        try:
            return kind.bootstrap(rows, states[name], self._pending_location)
        except Exception as exc:
            raise ValueError(f"pipeline {self.pipeline.name}, initial state of stage {name}: "
                             f"{error_line(exc)}") from exc

    def _starting_point(
        self, partition: str, restore_from: str | None, mode: RestoreMode
    ) -> tuple[str | None, dict[str, DataFrame], SourcePosition]:
        self._damaged = []
        self._to_bootstrap = []
        if restore_from is not None:
            location = self.access.resolve_checkpoint(restore_from)
            metadata = location.load_metadata()
            position = SourcePosition.of(metadata)
            if not position.fits(partition, self.order):
                raise MissingStateError(
                    _does_not_fit_message(location.external_pointer, position, partition,
                                          self.order)
                )
            check_claim(self.access, location, metadata, mode)
            check_non_restored_state(metadata, self.pipeline, location.external_pointer,
                                     self._allow_non_restored_state)
            self._verify_restored(location.external_pointer, metadata, partition)
            # Before the snapshot joins the store: state that does not fit is refused first.
            states = self._restored(metadata, location.external_pointer)
            checkpoint = self.store.restore(location, mode)
            # A claimed savepoint is deleted once subsumed, an unclaimed snapshot belongs to
            # someone else: keyed chains must not go on referencing their files.
            self._full_snapshot_due = (checkpoint.is_savepoint() or mode is RestoreMode.NO_CLAIM
                                       or bool(evolved_keyed_stages(metadata, self.pipeline)))
            return checkpoint.external_pointer, states, position
        for checkpoint in reversed(self.store.all()):
            position = SourcePosition.of(checkpoint.metadata)
            if position.fits(partition, self.order):
                self._verify_restored(checkpoint.external_pointer, checkpoint.metadata,
                                      partition)
                states = self._restored(checkpoint.metadata, checkpoint.external_pointer)
                return checkpoint.external_pointer, states, position
        if self.order.previous(partition) is None:
            fresh = {stage.name: self._kinds[stage.name].empty() for stage in self.stages}
            self._to_bootstrap = list(self.pipeline.initial_state)
            return None, fresh, SourcePosition(partition, 0, False, batches_digest([]))
        raise MissingStateError(self._missing_state_message(partition))

    def _verify_restored(self, pointer: str, metadata: CheckpointMetadata,
                         partition: str) -> None:
        """Read every state file of the snapshot about to be restored (size and CRC-32, on
        the driver, several at a time): a keyed range with a bad file is noted for repair from
        a local store (``_repair``); anything else bad fails here, before any Spark work,
        naming the newest retained checkpoint that verifies."""
        started = time.perf_counter()
        handles = metadata.all_handles()
        read, problems = verify_state_handles(handles)
        self.restore_verification = (len(handles), read, time.perf_counter() - started)
        logger.info("verified %d state handles (%s) of %s in %.2f s", len(handles),
                    format_size(read), pointer, self.restore_verification[2])
        self._damaged = damaged_state(metadata, problems)
        placed = {_handle_key(p.handle) for d in self._damaged for p in d.problems}
        stray = [p for p in problems if p.handle is None or _handle_key(p.handle) not in placed]
        dataframe = [d for d in self._damaged if not d.keyed]
        if stray or dataframe:
            bad = "; ".join([*map(str, dataframe), *(f"{p.path} ({p.kind})" for p in stray)])
            raise CorruptStateError(
                f"{pointer} cannot be restored: state files do not verify ({bad}). A "
                "DataFrame stage's snapshot is its only copy. "
                + self._restore_advice(partition, {_handle_key(p.handle) for p in problems
                                                   if p.handle is not None}))
        for damage in self._damaged:
            logger.warning("%s: %s does not verify; a new full snapshot of its range is written "
                           "from a local store before the first batch", pointer, damage)

    def _repair(self, states: dict, origin: str, partition: str) -> str:
        """Start new chains for the damaged keyed ranges from the local stores that hold their
        chains, before the first batch, so that no checkpoint of this run references a bad
        file; a range no local store holds fails the run with the way out."""
        _, location = self._pending_location()
        unserved = []
        for name in dict.fromkeys(d.stage for d in self._damaged):
            damaged = [d for d in self._damaged if d.stage == name]
            states[name], missing = self._kinds[name].repair(
                states[name], [d.subtask for d in damaged], self._pending_location)
            unserved += [d for d in damaged if d.subtask in missing]
        if unserved:
            # Nothing of this run is committed: the snapshots of the ranges that were served
            # are unreferenced shared files (collected as such), its directory goes now.
            location.dispose_on_failure()
            self._pending = None
            bad = {_handle_key(p.handle) for d in self._damaged for p in d.problems}
            raise CorruptStateError(
                f"{origin} cannot be restored: state files do not verify and no local store "
                "on the executors holds the state of their range to write a new full snapshot "
                f"from (a cold run, or the stores are elsewhere): {'; '.join(map(str, unserved))}. "
                + self._restore_advice(partition, bad))
        repaired = ", ".join(f"{d.stage} key groups {d.key_groups}" for d in self._damaged)
        self._damaged = []
        return (f"wrote new full snapshots of {repaired} from local stores: {origin} has state "
                "files that do not verify, which no later checkpoint references")

    def _restore_advice(self, partition: str, bad: set) -> str:
        """What to restore instead: the newest retained checkpoint whose files verify (and the
        partitions to run from it), else savepoints that fit ``partition``."""
        newest = self._newest_verified(bad)
        if newest is not None:
            pointer = newest.external_pointer
            position = SourcePosition.of(newest.metadata)
            if position.fits(partition, self.order):
                return (f"Restore the newest retained checkpoint that verifies ({position}): "
                        f"run {partition} with restore_from={pointer}")
            start = (self.order.following(position.partition) if position.complete
                     else position.partition)
            return (f"The newest retained checkpoint that verifies holds the state at "
                    f"{position}: run the partitions from {start} through {partition} with "
                    f"restore_from={pointer}")
        for pointer, metadata in sorted(self._savepoints(), key=lambda s: s[1].checkpoint_id,
                                        reverse=True):
            if verify_state_handles(metadata.all_handles())[1]:
                continue
            position = SourcePosition.of(metadata)
            start = (partition if position.fits(partition, self.order)
                     else self.order.following(position.partition) if position.complete
                     else position.partition)
            return (f"No retained checkpoint verifies; the newest savepoint that does holds "
                    f"the state at {position}: run the partitions from {start} through "
                    f"{partition} with restore_from={pointer}")
        return (f"No retained checkpoint or savepoint verifies: reprocess the partitions from "
                f"the first, {self.order.first}, through {partition} (that run starts from "
                "empty state), or restore_from a savepoint kept elsewhere and run the "
                "partitions after it")

    def _newest_verified(self, bad: set) -> CompletedCheckpoint | None:
        """The newest retained checkpoint none of whose files is in ``bad`` (handle keys) or
        fails to verify; a file shared by several checkpoints is read once."""
        bad, good = set(bad), set()
        for checkpoint in reversed(self.store.all()):
            handles = [h for h in checkpoint.metadata.all_handles()
                       if _handle_key(h) not in good]
            if any(_handle_key(h) in bad for h in handles):
                continue
            _, problems = verify_state_handles(handles)
            failed = {_handle_key(p.handle) for p in problems if p.handle is not None}
            if not problems:
                return checkpoint
            bad |= failed
            good |= {_handle_key(h) for h in handles} - failed
        return None

    def newest_verified_checkpoint(self) -> CompletedCheckpoint | None:
        """The newest retained checkpoint whose every state file verifies (reads them)."""
        return self._newest_verified(set())

    def restore_advice(self, damaged_pointer: str, problems: Sequence[VerificationProblem]
                       ) -> str:
        """What a run after the checkpoint at ``damaged_pointer`` does about ``problems`` (its
        files that do not verify), for reports such as the integrity check."""
        metadata = self.access.resolve_checkpoint(damaged_pointer).load_metadata()
        position = SourcePosition.of(metadata)
        partition = (self.order.following(position.partition) if position.complete
                     else position.partition) or position.partition
        damaged = damaged_state(metadata, problems)
        advice = self._restore_advice(partition, {_handle_key(p.handle) for p in problems
                                                  if p.handle is not None})
        if damaged and all(d.keyed for d in damaged):
            return ("The next run writes new full snapshots of "
                    + ", ".join(f"{d.stage} key groups {d.key_groups}" for d in damaged)
                    + " from local stores that hold their chains (warm executors) before its "
                    "first batch, so that no later checkpoint references these files; without "
                    f"one it fails before any batch. {advice}")
        return f"The next run from this checkpoint fails before any batch. {advice}"

    def _missing_state_message(self, partition: str) -> str:
        previous = self.order.previous(partition)
        retained = ", ".join(
            f"chk-{c.checkpoint_id} ({SourcePosition.of(c.metadata)})" for c in self.store.all()
        ) or "none"
        fitting = self._fitting_savepoints(partition)
        advice = (
            f"backfill from a savepoint with run config restore_from: {', '.join(fitting)}"
            if fitting
            else f"materialize {previous} first, or backfill from a savepoint taken at the end "
            f"of {previous} (run config restore_from)"
        )
        return (
            f"processing {partition} of pipeline {self.pipeline.name} needs the state after "
            f"{previous}, and no retained checkpoint holds it (retained: {retained}): {advice}"
        )

    def _fitting_savepoints(self, partition: str) -> list[str]:
        return [pointer for pointer, metadata in self._savepoints()
                if SourcePosition.of(metadata).fits(partition, self.order)]

    def _savepoints(self) -> list[tuple[str, CheckpointMetadata]]:
        """The pipeline's savepoints in the savepoint directory (and its scheduled/), sorted by
        pointer, with their `_metadata`; those that cannot be read are left out."""
        directory = self.storage.savepoint_directory
        if directory is None:
            return []
        fs, path = url_to_fs(directory, self.storage.storage_options)
        entries = []
        # Hand-made savepoints lie in the savepoint directory, scheduled ones in scheduled/.
        for folder in (path, f"{path.rstrip('/')}/{SCHEDULED_SAVEPOINTS}"):
            try:
                entries += fs.ls(folder, detail=False)
            except FileNotFoundError:
                continue
        found = []
        for entry in sorted(entries):
            pointer = fs.unstrip_protocol(entry) if "://" in directory else entry
            try:
                metadata = self.access.resolve_checkpoint(pointer).load_metadata()
                SourcePosition.of(metadata)
                found.append((pointer, metadata))
            except (OSError, ValueError) as exc:
                logger.debug("not a usable savepoint: %s (%s)", pointer, exc)
        return found

    def latest_position(self) -> SourcePosition | None:
        latest = self.store.latest()
        return None if latest is None else SourcePosition.of(latest.metadata)


def _checkpoint_line(summary: CheckpointSummary) -> str:
    return (
        f"{summary.position.partition}: checkpoint {summary.checkpoint_id} at {summary.position} "
        f"({format_size(summary.state_bytes)}, {summary.files_written} files)"
    )

