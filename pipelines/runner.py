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

This module is the runner itself (construction, lease, the run loop, applying a batch); its
restore is ``pipelines._restore``, its checkpoint and savepoint writing
``pipelines._checkpointing`` (both mixins of ``StatefulRunner``), what it reports and raises
``pipelines._results``.
"""

import datetime as dt
import logging
import time
from collections.abc import Callable, Sequence

from pyspark.sql import DataFrame, SparkSession

from checkpoint_storage import (
    CheckpointRetentionPolicy,
    CheckpointStorage,
    RestoreMode,
)
from checkpoint_storage.spi import (
    DEFAULT_LEASE_TTL,
    CheckpointStorageLocation,
    CompletedCheckpoint,
    FileSystemCompletedCheckpointStore,
)
from pipelines._bootstrap import rows_of
from pipelines._checkpointing import CheckpointWriting
from pipelines._positions import (
    SourcePosition,
    _position_key,
    batches_digest,
    head_of,
    job_id_for,
    partition_ends,
    position_retention,
)
from pipelines._restore import SCHEDULED_SAVEPOINTS, Restoring
from pipelines._restore_checks import (
    ClaimRefusedError,
    CorruptStateError,
    DamagedState,
    MissingStateError,
    NonRestoredStateError,
    _starts_after,
    check_claim,
    check_restore_from,
    damaged_state,
)
from pipelines._results import (
    BatchListChangedError,
    CheckpointSummary,
    PartitionResult,
    StageError,
    _checkpoint_line,
    error_line,
)
from pipelines._spec import SOURCE, StatefulPipeline
from pipelines._stage_kinds import empty_state, stage_kinds
from pipelines.keyed import DEFAULT_LOCAL_STORE_MAX_AGE
from pipelines.warm_up import wait_for_holds, warm_up_workers

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


def _frame(outputs: dict, name: str) -> DataFrame:
    """Output ``name`` of a batch, its plan made on first read (``StageBatch.output``)."""
    output = outputs[name]
    if callable(output):  # the function that makes it (a DataFrame is not callable)
        output = outputs[name] = output()
    return output


class StatefulRunner(Restoring, CheckpointWriting):
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
        # The stages whose batch output something reads (a later stage, a sink): a keyed
        # stage's other batches keep no output (their pass is not persisted).
        self._outputs_read = {pipeline.input_of(n) for n in range(len(self.stages))} | {
            sink.stage for sink in pipeline.sinks if sink.of == "output"}
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
        # the first batch's workers start while the driver plans it (a run whose restore
        # fails does no Spark work)
        warm_up_workers(self.spark.sparkContext)
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
            # A local store prefetch still running: the first job's tasks need its stores,
            # and the workers they fork beside its rebuild would hold memory for nothing
            # (warm_up).
            wait_for_holds()
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
                    _frame(outputs, self.pipeline.input_of(number)), states[stage.name],
                    self._pending_location, index, output=stage.name in self._outputs_read)
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
                sink.write(self.spark, _frame(outputs, sink.stage), partition, index)
        for output in outputs.values():
            if not callable(output):  # a plan nothing read was never made
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

    def latest_position(self) -> SourcePosition | None:
        latest = self.store.latest()
        return None if latest is None else SourcePosition.of(latest.metadata)
