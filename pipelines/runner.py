"""The stateful runner: drives each day's input batches through the stages and checkpoints
their state the way Flink does (DESIGN §4).

The driver is the coordinator: it creates a checkpoint location, ships the storage config,
checkpoint id and location reference to the executors, and each partition task resolves
the reference through the worker view and streams its slice of the state into it
(``state_io.write_state_partition``). The driver collects the handles, stores
``CheckpointMetadata`` with the source position as master state, and finalizes: `_metadata`
appears last, so a checkpoint is complete or invisible.

Exactly once: state is versioned by source position, ``(partition, batches applied,
complete)``. Processing partition P needs the state after P-1 (or a checkpoint inside P);
the runner restores the newest such snapshot and replays only the batches after it.
"""

import datetime as dt
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import to_arrow_schema

from checkpoint_storage import (
    CheckpointMetadata,
    CheckpointProperties,
    CheckpointRetentionPolicy,
    CheckpointStorage,
    CheckpointStorageLocation,
    CompletedCheckpoint,
    CompletedCheckpointStorageLocation,
    FileSystemCompletedCheckpointStore,
    InvalidCheckpointError,
    JobID,
    OperatorState,
    OperatorSubtaskState,
    RestoreMode,
    store_checkpoint_metadata,
)
from checkpoint_storage._filesystems import url_to_fs
from checkpoint_storage.exceptions import (
    CheckpointAlreadyExistsError,
    CheckpointNotFoundError,
    CommitStateUnknownError,
)
from pipelines.events import batch_urls
from pipelines.stages import EVENT_SCHEMA, STAGES, Stage, empty_state
from pipelines.state_io import (
    HANDLE_ROW_DDL,
    StateReadTask,
    StateWriteTask,
    handle_from_row,
    handle_to_row,
    read_state_partition,
    write_state_partition,
)

__all__ = [
    "POSITION_STATE",
    "SCHEDULED_SAVEPOINTS",
    "CheckpointSummary",
    "MissingStateError",
    "PartitionResult",
    "SourcePosition",
    "StatefulRunner",
    "check_restore_from",
    "job_id_for",
]

logger = logging.getLogger(__name__)

POSITION_STATE = "source-position"
SCHEMA_STATE_PREFIX = "state-schema/"
# The subdirectory of the savepoint directory that scheduled savepoints go to (sensors/).
SCHEDULED_SAVEPOINTS = "scheduled"


def job_id_for(pipeline_name: str) -> JobID:
    """A stable job id per pipeline, so that every run of it shares one checkpoint directory
    and recovery finds the previous runs' checkpoints."""
    return JobID.from_hex(hashlib.sha256(pipeline_name.encode()).hexdigest()[:32])


def previous_partition(partition: str) -> str:
    return (dt.date.fromisoformat(partition) - dt.timedelta(days=1)).isoformat()


@dataclass(frozen=True, order=True)
class SourcePosition:
    """How far the input has been applied to the state: the first ``batches`` batches of
    ``partition`` (and every earlier partition); ``complete`` once all of its batches are."""

    partition: str
    batches: int
    complete: bool

    def to_bytes(self) -> bytes:
        return json.dumps(
            {"partition": self.partition, "batches": self.batches, "complete": self.complete},
            sort_keys=True,
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "SourcePosition":
        try:
            raw = json.loads(data)
            position = cls(str(raw["partition"]), int(raw["batches"]), bool(raw["complete"]))
            dt.date.fromisoformat(position.partition)
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidCheckpointError(f"malformed source position {data[:100]!r}") from exc
        return position

    @classmethod
    def of(cls, metadata: CheckpointMetadata) -> "SourcePosition":
        data = metadata.master_states.get(POSITION_STATE)
        if data is None:
            raise InvalidCheckpointError(
                f"checkpoint {metadata.checkpoint_id} has no source position: it was not "
                "written by this pipeline"
            )
        return cls.from_bytes(data)

    def fits(self, partition: str) -> bool:
        """Whether this state is where processing ``partition`` can start: after the whole
        previous partition, or part-way into ``partition``."""
        return (self.partition == previous_partition(partition) and self.complete) or (
            self.partition == partition and not self.complete
        )

    def __str__(self) -> str:
        if self.complete:
            return f"end of {self.partition}"
        return f"{self.partition} after batch {self.batches}"


class MissingStateError(LookupError):
    """No snapshot holds the state a partition needs to start from."""


def _does_not_fit_message(pointer: str, position: SourcePosition, partition: str) -> str:
    return (
        f"{pointer} holds the state at {position}, but processing {partition} starts from "
        f"the end of {previous_partition(partition)} (or from within {partition}): choose a "
        "snapshot that fits, or a range that starts right after it"
    )


def check_restore_from(
    storage: CheckpointStorage,
    pointer: str,
    partition: str,
    pipeline_name: str = "user_activity",
) -> SourcePosition:
    """The position ``pointer`` (a checkpoint or savepoint) holds, once it is known to exist,
    to validate and to fit ``partition``; ``MissingStateError`` with a clear message
    otherwise. Storage only (reads one `_metadata`): run it before any Spark work."""
    partition = dt.date.fromisoformat(partition).isoformat()
    access = storage.create_checkpoint_storage(job_id_for(pipeline_name))
    try:
        location = access.resolve_checkpoint(pointer)
        position = SourcePosition.of(location.load_metadata())
    except CheckpointNotFoundError as exc:
        raise MissingStateError(
            f"restore_from {pointer} does not exist (no completed `_metadata` there: {exc}): "
            "name a savepoint or checkpoint directory that holds a `_metadata`, e.g. from "
            "`checkpoints list <savepoint_dir>` (scheduled ones are in <savepoint_dir>/scheduled)"
        ) from exc
    except InvalidCheckpointError as exc:
        raise MissingStateError(f"restore_from {pointer} is not a usable snapshot: {exc}") from exc
    if not position.fits(partition):
        pointer = location.external_pointer
        raise MissingStateError(_does_not_fit_message(pointer, position, partition))
    return position


@dataclass(frozen=True)
class CheckpointSummary:
    checkpoint_id: int
    pointer: str
    position: SourcePosition
    savepoint: bool
    state_bytes: int
    files_written: int
    inline_states: int
    state_rows: dict[str, int]


@dataclass
class PartitionResult:
    partition: str
    restored_from: str | None
    batches_applied: int
    checkpoint: CheckpointSummary
    checkpoints_taken: list[CheckpointSummary] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0


FaultHook = Callable[..., None]


class StatefulRunner:
    """Runs the stages over daily partitions of landed input, checkpointing through
    ``storage``. ``first_partition`` is the one that starts from empty state."""

    def __init__(
        self,
        spark: SparkSession,
        storage: CheckpointStorage,
        *,
        landing_dir: str,
        report_dir: str,
        first_partition: str,
        pipeline_name: str = "user_activity",
        stages: Sequence[Stage] = STAGES,
        checkpoint_interval: int = 2,
        max_retained: int = 3,
        landing_options: dict | None = None,
        fault_hook: FaultHook | None = None,
        task_after_write: Callable[[int, int], None] | None = None,
    ) -> None:
        if checkpoint_interval < 1:
            raise ValueError(f"checkpoint_interval must be >= 1, got {checkpoint_interval}")
        self.spark = spark
        self.storage = storage
        self.landing_dir = landing_dir
        self.report_dir = report_dir
        self.first_partition = dt.date.fromisoformat(first_partition).isoformat()
        self.job_id = job_id_for(pipeline_name)
        self.stages = tuple(stages)
        self.checkpoint_interval = checkpoint_interval
        self.landing_options = landing_options
        self._fault = fault_hook or (lambda point, **info: None)
        self._task_after_write = task_after_write
        self._last_checkpoint_id = 0
        self.access = storage.create_checkpoint_storage(self.job_id)
        self.access.initialize_base_locations()
        # Checkpoints outlive runs: the job is suspended between partitions, never finished.
        self.store = FileSystemCompletedCheckpointStore(
            self.access, max_retained, CheckpointRetentionPolicy.RETAIN_ON_CANCELLATION
        )

    # --- running partitions ------------------------------------------------------------

    def run(
        self,
        partitions: Sequence[str],
        *,
        restore_from: str | None = None,
        restore_mode: RestoreMode | str = RestoreMode.NO_CLAIM,
        on_partition_done: Callable[[PartitionResult], None] | None = None,
    ) -> list[PartitionResult]:
        """Process consecutive ``partitions`` in order in this session, starting from the
        snapshot that fits the first one (``restore_from``, else the newest retained
        checkpoint that fits), and checkpointing every ``checkpoint_interval`` batches and at
        the end of each partition. ``on_partition_done`` hears of each partition as soon as
        its final checkpoint completed."""
        partitions = [dt.date.fromisoformat(p).isoformat() for p in partitions]
        if not partitions:
            return []
        for before, after in zip(partitions, partitions[1:], strict=False):
            if previous_partition(after) != before:
                raise ValueError(f"partitions must be consecutive days, got {before}, {after}")
        origin, states, position = self._starting_point(
            partitions[0], restore_from, RestoreMode(restore_mode)
        )
        results = []
        try:
            for partition in partitions:
                result = self._run_partition(partition, states, position, origin)
                results.append(result)
                if on_partition_done is not None:
                    on_partition_done(result)
                position = result.checkpoint.position
                origin = result.checkpoint.pointer
        finally:
            for state in states.values():
                state.unpersist()
        return results

    def _run_partition(
        self,
        partition: str,
        states: dict[str, DataFrame],
        position: SourcePosition,
        origin: str | None,
    ) -> PartitionResult:
        started = time.monotonic()
        urls = batch_urls(self.landing_dir, partition, self.landing_options)
        first = position.batches if position.partition == partition else 0
        rows = {"input": 0} | {stage.name: 0 for stage in self.stages}
        taken: list[CheckpointSummary] = []
        for index in range(first, len(urls)):
            self._apply_batch(states, urls[index], rows)
            self._fault("batch_applied", partition=partition, batch=index)
            done = index + 1
            position = SourcePosition(partition, done, done == len(urls))
            if not position.complete and (done - first) % self.checkpoint_interval == 0:
                taken.append(self.checkpoint(states, position))
        if first == len(urls):  # nothing (left) to apply: still a full partition checkpoint
            position = SourcePosition(partition, len(urls), True)
        self._write_report(states, partition)
        final = self.checkpoint(states, position)
        taken.append(final)
        return PartitionResult(
            partition,
            origin,
            len(urls) - first,
            final,
            taken,
            rows,
            time.monotonic() - started,
        )

    def _apply_batch(self, states: dict[str, DataFrame], url: str, rows: dict[str, int]) -> None:
        data = self.spark.read.schema(EVENT_SCHEMA).parquet(url)
        rows["input"] += data.count()
        for stage in self.stages:
            old = states[stage.name]
            new_state, output = stage.apply(old, data)
            # Materialise once and cut the lineage, so that state does not grow a plan of
            # every batch ever applied; the checkpoint then writes from these blocks.
            output = output.localCheckpoint(eager=True)
            rows[stage.name] += output.count()
            states[stage.name] = new_state.localCheckpoint(eager=True)
            old.unpersist()
            data = output

    def _write_report(self, states: dict[str, DataFrame], partition: str) -> None:
        """The daily report: each user's activity as of the end of ``partition``. Spark's
        dynamic partition overwrite replaces the day's directory, so a re-run replaces it."""
        if "user_activity" not in states:
            return
        day = F.lit(partition).cast("date")
        report = (
            states["user_activity"]
            .withColumn("active_on_day", F.to_date("last_seen") == day)
            .withColumn("report_date", day)
        )
        (
            report.write.mode("overwrite")
            .option("partitionOverwriteMode", "dynamic")
            .partitionBy("report_date")
            .parquet(self.report_dir)
        )

    # --- checkpoints and savepoints ----------------------------------------------------

    def next_checkpoint_id(self) -> int:
        """Above every id this runner used or sees in storage: like Flink's counter, an id
        is never reused, not even that of a checkpoint that failed and was disposed."""
        ids = [c.checkpoint_id for c in self.store.all()] + self.access._checkpoint_ids()
        self._last_checkpoint_id = max([*ids, self._last_checkpoint_id]) + 1
        return self._last_checkpoint_id

    def checkpoint(
        self, states: dict[str, DataFrame], position: SourcePosition
    ) -> CheckpointSummary:
        checkpoint_id = self.next_checkpoint_id()
        location = self.access.initialize_location_for_checkpoint(checkpoint_id)
        summary, completed, metadata = self._snapshot(
            states, position, checkpoint_id, location, CheckpointProperties.for_checkpoint()
        )
        self.store.add_checkpoint(CompletedCheckpoint(completed, metadata))
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
        states = self.restore_states(metadata)
        try:
            return self.savepoint(states, SourcePosition.of(metadata), metadata.checkpoint_id,
                                  target_directory)
        finally:
            for state in states.values():
                state.unpersist()

    def savepoint(
        self,
        states: dict[str, DataFrame],
        position: SourcePosition,
        checkpoint_id: int,
        target_directory: str | None = None,
    ) -> CheckpointSummary:
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
    ) -> tuple[CheckpointSummary, CompletedCheckpointStorageLocation, CheckpointMetadata]:
        master = {POSITION_STATE: position.to_bytes()}
        operator_states = []
        state_rows = {}
        options = self.storage.storage_options if hasattr(self.storage, "storage_options") else {}
        try:
            for stage in self.stages:
                state = states[stage.name]
                schema = to_arrow_schema(state.schema, timezone="UTC")
                task = StateWriteTask(
                    self.storage,
                    str(self.job_id),
                    checkpoint_id,
                    location.location_reference,
                    stage.name,
                    schema,
                    self._task_after_write,
                )
                written = state.mapInArrow(
                    partial(write_state_partition, task), HANDLE_ROW_DDL
                ).collect()
                subtasks = {
                    row["subtask"]: OperatorSubtaskState(
                        (handle_from_row(row.asDict(), options),),
                        {"rows": str(row["rows"]), "attempt": str(row["attempt"])},
                    )
                    for row in written
                }
                if sorted(subtasks) != list(range(len(written))):
                    raise RuntimeError(f"stage {stage.name}: subtasks {sorted(subtasks)} reported")
                operator_states.append(
                    OperatorState(stage.name, max(len(written), 1), subtask_states=subtasks)
                )
                state_rows[stage.name] = sum(row["rows"] for row in written)
                master[SCHEMA_STATE_PREFIX + stage.name] = schema.serialize().to_pybytes()
            metadata = CheckpointMetadata(
                checkpoint_id,
                tuple(operator_states),
                master,
                properties,
                self.job_id,
                int(time.time() * 1000),
            )
            self._fault("before_metadata", checkpoint_id=checkpoint_id)
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
        )
        logger.info("completed %s %s at %s", "savepoint" if summary.savepoint else "checkpoint",
                    summary.pointer, position)
        return summary, completed, metadata

    # --- restore -----------------------------------------------------------------------

    def restore_states(
        self, metadata: CheckpointMetadata, parallelism: int | None = None
    ) -> dict[str, DataFrame]:
        """The stages' state DataFrames from a snapshot: the executors read and verify
        their handles through fsspec (inline handles carry their bytes). Any parallelism:
        one task per handle, then ``parallelism`` partitions when given."""
        operators = {op.operator_id: op for op in metadata.operator_states}
        states = {}
        for stage in self.stages:
            op = operators.get(stage.name)
            if op is None:
                raise InvalidCheckpointError(
                    f"checkpoint {metadata.checkpoint_id} holds no state for stage "
                    f"{stage.name!r} (it has {sorted(operators)})"
                )
            schema = to_arrow_schema(stage.state_schema, timezone="UTC")
            stored = metadata.master_states.get(SCHEMA_STATE_PREFIX + stage.name)
            if stored is not None:
                stored_schema = pa.ipc.read_schema(pa.py_buffer(stored))
                if stored_schema.names != schema.names:
                    raise InvalidCheckpointError(
                        f"stage {stage.name!r}: checkpoint {metadata.checkpoint_id} has columns "
                        f"{stored_schema.names}, the stage now expects {schema.names}"
                    )
            rows = [
                handle_to_row(handle, subtask, 0, -1)
                for subtask, subtask_state in op.subtask_states.items()
                for handle in subtask_state.handles
            ]
            handles = self.spark.createDataFrame(
                self.spark.sparkContext.parallelize(
                    [tuple(r.get(k) for k in _HANDLE_COLUMNS) for r in rows], max(len(rows), 1)
                ),
                HANDLE_ROW_DDL,
            )
            state = handles.mapInArrow(
                partial(read_state_partition, StateReadTask(self.storage, schema)),
                stage.state_schema,
            )
            if parallelism is not None:
                state = state.repartition(parallelism)
            states[stage.name] = state.localCheckpoint(eager=True)
        return states

    def _starting_point(
        self, partition: str, restore_from: str | None, mode: RestoreMode
    ) -> tuple[str | None, dict[str, DataFrame], SourcePosition]:
        if restore_from is not None:
            location = self.access.resolve_checkpoint(restore_from)
            metadata = location.load_metadata()
            position = SourcePosition.of(metadata)
            if not position.fits(partition):
                raise MissingStateError(
                    _does_not_fit_message(location.external_pointer, position, partition)
                )
            checkpoint = self.store.restore(location, mode)
            return checkpoint.external_pointer, self.restore_states(metadata), position
        for checkpoint in reversed(self.store.all()):
            position = SourcePosition.of(checkpoint.metadata)
            if position.fits(partition):
                states = self.restore_states(checkpoint.metadata)
                return checkpoint.external_pointer, states, position
        if partition <= self.first_partition:
            fresh = {stage.name: empty_state(self.spark, stage) for stage in self.stages}
            return None, fresh, SourcePosition(previous_partition(partition), 0, True)
        raise MissingStateError(self._missing_state_message(partition))

    def _missing_state_message(self, partition: str) -> str:
        previous = previous_partition(partition)
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
            f"processing {partition} needs the state after {previous}, and no retained "
            f"checkpoint holds it (retained: {retained}): {advice}"
        )

    def _fitting_savepoints(self, partition: str) -> list[str]:
        directory = getattr(self.storage, "savepoint_directory", None)
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
        fitting = []
        for entry in sorted(entries):
            pointer = fs.unstrip_protocol(entry) if "://" in directory else entry
            try:
                metadata = self.access.resolve_checkpoint(pointer).load_metadata()
                if SourcePosition.of(metadata).fits(partition):
                    fitting.append(pointer)
            except (OSError, ValueError) as exc:
                logger.debug("not a usable savepoint: %s (%s)", pointer, exc)
        return fitting

    def latest_position(self) -> SourcePosition | None:
        latest = self.store.latest()
        return None if latest is None else SourcePosition.of(latest.metadata)


_HANDLE_COLUMNS = [name.split()[0] for name in HANDLE_ROW_DDL.split(", ")]
