"""The stage kinds, as the runner runs them: one interface, ``StageKind``, that a DataFrame
stage (``Stage``, Flink's operator state) and a keyed stage (``KeyedStage``, Flink's keyed
state) both implement, so that the runner treats every stage alike: restore its state, prepare
a checkpoint interval, apply a batch, snapshot it into a checkpoint, read it whole.

``stage_kinds`` picks each stage's kind; it is the one place that tells the kinds apart.
"""

import datetime as dt
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import from_arrow_schema as to_spark_schema
from pyspark.sql.pandas.types import to_arrow_schema

from checkpoint_storage import CheckpointMetadata, CheckpointStorage, InvalidCheckpointError
from checkpoint_storage.spi import (
    DEFAULT_LEASE_TTL,
    STATE_FORMAT_PREFIX,
    STATE_SCHEMA_PREFIX,
    CheckpointStorageLocation,
    OperatorState,
    OperatorSubtaskState,
)
from pipelines import state_io
from pipelines._spec import Stage, StatefulPipeline
from pipelines.keyed import (
    DEFAULT_LOCAL_STORE_MAX_AGE,
    KeyedStage,
    KeyedStageDriver,
    KeyedStageState,
    check_evolution,
    evolve_table,
)
from pipelines.state_io import (
    HANDLE_ROW_SCHEMA,
    HANDLE_ROW_TYPE,
    StateReadTask,
    StateWriteTask,
    handle_from_row,
    handle_to_row,
    read_state_partition,
)

__all__ = [
    "DataFrameStageKind",
    "KeyedStageKind",
    "PendingLocation",
    "StageBatch",
    "StageKind",
    "StageSnapshot",
    "empty_state",
    "stage_kinds",
]

logger = logging.getLogger(__name__)

PendingLocation = Callable[[], tuple[int, CheckpointStorageLocation]]
"""The id and location of the checkpoint being written, allocated on first call."""


@dataclass
class StageBatch:
    """What applying one batch to a stage gave: its ``output`` (pinned until the runner
    unpersists it; or a function that makes it, called only if something reads it), its
    output rows, the input rows it counted in the same pass (None: it did
    not count them), progress notes, ``release`` to call once the output is consumed, and
    its named outputs besides ``output`` (a keyed stage's late rows, under
    ``Watermark.late_rows``), which sinks write as they write ``output``."""

    output: DataFrame | Callable[[], DataFrame]
    output_rows: int
    input_rows: int | None = None
    notes: list[str] = field(default_factory=list)
    release: Callable[[], None] = lambda: None
    named_outputs: dict[str, DataFrame] = field(default_factory=dict)


@dataclass(frozen=True)
class StageSnapshot:
    """What a checkpoint records of one stage: its operator state, master states besides it,
    and its live and expired (not dropped yet; None: not known) rows; ``parts`` for the
    checkpoint's statistics: the stage's ``kind`` and, for a keyed stage, the handles of its
    ``full_snapshots`` and ``change_files``."""

    operator_state: OperatorState
    master_states: dict[str, bytes]
    rows: int
    expired_rows: int | None
    parts: dict = field(default_factory=dict)


class StageKind(ABC):
    """One stage of a pipeline, as the runner runs it. The state is whatever the kind keeps
    between batches (a pinned DataFrame, a keyed stage's chains); the runner only hands it
    back, and calls its ``unpersist()`` once done with it."""

    stage: Stage | KeyedStage

    counts_its_input: bool = False
    """Whether ``apply`` counts the input rows in its own pass (the runner then does not pin
    the source batch first when this stage is its only reader)."""

    writes_between_checkpoints: bool = False
    """Whether ``apply`` writes into the pending checkpoint (so ``prepare`` runs first, once
    per checkpoint interval)."""

    @abstractmethod
    def empty(self):
        """The state before the pipeline's first batch."""

    @abstractmethod
    def bootstrap(self, rows: DataFrame, state, pending: PendingLocation):
        """``state`` (empty) with ``rows`` as the stage's state: its initial state, or the
        state a savepoint is written from (``write_savepoint``); a ValueError naming the stage
        when the rows do not fit its state schema."""

    @abstractmethod
    def restore(self, metadata: CheckpointMetadata, parallelism: int | None = None):
        """The stage's state in ``metadata``, or InvalidCheckpointError naming what does not
        fit. ``parallelism``: the partitions of a DataFrame state (a hint)."""

    def restore_frame(self, metadata: CheckpointMetadata, parallelism: int | None = None, *,
                      include_expired: bool = False) -> DataFrame:
        """The stage's state in ``metadata`` as a pinned DataFrame (``parallelism``
        partitions when given); expired rows not dropped yet only with ``include_expired``."""
        return self.restore(metadata, parallelism)

    def prepare(self, state, pending: PendingLocation, *, full: bool) -> tuple[object, list[str]]:
        """At the start of a checkpoint interval, before anything is written into it: the
        state and progress notes. ``full``: the interval must snapshot the state whole."""
        return state, []

    @abstractmethod
    def apply(self, input: DataFrame, state, pending: PendingLocation,
              batch: int, *, output: bool = True) -> tuple[object, StageBatch]:
        """Apply batch number ``batch`` (``input``) to ``state``, input first as a stage's own
        ``apply``: the new state and the batch's result. ``output=False``: nothing reads the
        batch's output (no later stage, no sink), which a kind may then leave unkept."""

    @abstractmethod
    def snapshot(self, state, checkpoint_id: int, location: CheckpointStorageLocation, *,
                 savepoint: bool) -> StageSnapshot:
        """Write what ``location`` must hold of the state (``savepoint``: self-contained)."""

    @abstractmethod
    def frame(self, state) -> DataFrame:
        """The stage's whole state as a DataFrame of its state schema (for state sinks)."""

    def repair(self, state, subtasks: list[int], pending: PendingLocation
               ) -> tuple[object, list[int]]:
        """Rewrite the state of ``subtasks``, whose files do not verify, from a copy elsewhere;
        returns the state and the subtasks that could not be."""
        raise InvalidCheckpointError(
            f"stage {self.stage.name}: its snapshot is its only copy; it cannot be repaired")


def empty_state(spark: SparkSession, stage) -> DataFrame:
    """A DataFrame stage's state before its first batch: no rows of its ``state_schema``."""
    return spark.createDataFrame([], stage.state_schema)


class DataFrameStageKind(StageKind):
    """A ``Stage``: its state is a DataFrame, pinned between batches and written whole at
    every checkpoint, one file per Spark task (EXCLUSIVE scope)."""

    def __init__(self, stage: Stage, spark: SparkSession, storage: CheckpointStorage,
                 job_id: str, after_write: Callable[[int, int], None] | None) -> None:
        self.stage = stage
        self.spark = spark
        self.storage = storage
        self.job_id = job_id
        self.after_write = after_write

    def empty(self) -> DataFrame:
        return empty_state(self.spark, self.stage)

    def bootstrap(self, rows: DataFrame, state: DataFrame, pending: PendingLocation
                  ) -> DataFrame:
        """The rows, their columns selected by name and cast to the state schema."""
        declared = self.stage.state_schema
        missing = [n for n in declared.names if n not in rows.columns]
        if missing:
            raise ValueError(f"initial state of stage {self.stage.name}: column(s) {missing} "
                             f"missing; the state schema has {declared.names}, the rows "
                             f"{rows.columns}")
        rows = rows.select([rows[f.name].cast(f.dataType).alias(f.name) for f in declared])
        _check_state_schema(self.stage, rows)
        state.unpersist()
        return rows.localCheckpoint(eager=True)

    def restore(self, metadata: CheckpointMetadata, parallelism: int | None = None
                ) -> DataFrame:
        """Read by the executors, which verify their handles through fsspec (inline handles
        carry their bytes): one task per handle, then ``parallelism`` partitions when given."""
        stage = self.stage
        operators = {op.operator_id: op for op in metadata.operator_states}
        op = operators.get(stage.name)
        if op is None:
            raise InvalidCheckpointError(
                f"checkpoint {metadata.checkpoint_id} holds no state for stage "
                f"{stage.name!r} (it has {sorted(operators)})"
            )
        recorded = metadata.master_states.get(STATE_FORMAT_PREFIX + stage.name)
        if recorded is not None:  # only keyed stages record a format
            raise InvalidCheckpointError(
                f"checkpoint {metadata.checkpoint_id}, stage {stage.name!r}: the snapshot holds "
                f"the stage's state as {recorded.decode(errors='replace')}, the stage is a "
                "DataFrame stage; restore a snapshot written by the DataFrame stage, or run "
                "the stage as it was")
        schema = to_arrow_schema(stage.state_schema, timezone="UTC")
        stored = metadata.master_states.get(STATE_SCHEMA_PREFIX + stage.name)
        # The files are read as written, then evolved into the stage's schema (checked first).
        written = schema if stored is None else pa.ipc.read_schema(pa.py_buffer(stored))
        try:
            evolved = check_evolution(written, schema, stage.renamed, stage.defaults,
                                      f"checkpoint {metadata.checkpoint_id}, stage "
                                      f"{stage.name!r}")
        except ValueError as exc:
            raise InvalidCheckpointError(str(exc)) from exc
        rows = [
            handle_to_row(handle, subtask, 0, -1)
            for subtask, subtask_state in op.subtask_states.items()
            for handle in subtask_state.handles
        ]
        handles = self.spark.createDataFrame(
            self.spark.sparkContext.parallelize(
                [tuple(r[k] for k in HANDLE_ROW_SCHEMA.names) for r in rows],
                max(len(rows), 1),
            ),
            HANDLE_ROW_TYPE,
        )
        state = handles.mapInArrow(
            partial(read_state_partition, StateReadTask(self.storage, written)),
            to_spark_schema(written) if evolved else stage.state_schema,
        )
        if evolved:
            state = state.mapInArrow(partial(_evolve_batches, schema, dict(stage.renamed),
                                             dict(stage.defaults), stage.name),
                                     stage.state_schema)
        if parallelism is not None:
            state = state.repartition(parallelism)
        return state.localCheckpoint(eager=True)

    def apply(self, input: DataFrame, state: DataFrame, pending: PendingLocation,
              batch: int, *, output: bool = True) -> tuple[DataFrame, StageBatch]:
        # ``output`` does not apply: the output is computed to count its rows anyway.
        new_state, rows_out = self.stage.apply(input, state)
        # Before any Spark job: a state unlike its schema never reaches a checkpoint.
        _check_state_schema(self.stage, new_state)
        # Compute once (checkpointed) and cut the lineage, so that state does not grow a plan of
        # every batch ever applied; the checkpoint then writes from these blocks.
        rows_out = rows_out.localCheckpoint(eager=True)
        rows = rows_out.count()
        new_state = new_state.localCheckpoint(eager=True)
        state.unpersist()
        return new_state, StageBatch(rows_out, rows)

    def snapshot(self, state: DataFrame, checkpoint_id: int,
                 location: CheckpointStorageLocation, *, savepoint: bool) -> StageSnapshot:
        stage = self.stage
        schema = to_arrow_schema(state.schema, timezone="UTC")
        task = StateWriteTask(self.storage, self.job_id, checkpoint_id,
                              location.location_reference, stage.name, schema,
                              self.after_write)
        written = state.mapInArrow(
            # looked up at each snapshot, so that an experiment can patch the writer
            partial(state_io.write_state_partition, task), HANDLE_ROW_TYPE
        ).collect()
        options = self.storage.storage_options
        subtasks = {
            row["subtask"]: OperatorSubtaskState(
                (handle_from_row(row.asDict(), options),),
                {"rows": str(row["rows"]), "expired_rows": "0", "attempt": str(row["attempt"])},
            )
            for row in written
        }
        if sorted(subtasks) != list(range(len(written))):
            raise RuntimeError(f"stage {stage.name}: subtasks {sorted(subtasks)} reported")
        return StageSnapshot(
            OperatorState(stage.name, max(len(written), 1), subtask_states=subtasks),
            {STATE_SCHEMA_PREFIX + stage.name: schema.serialize().to_pybytes()},
            sum(row["rows"] for row in written), 0, {"kind": "plain"})

    def frame(self, state: DataFrame) -> DataFrame:
        return state


class KeyedStageKind(StageKind):
    """A ``KeyedStage``: its state is the chains of its key group ranges
    (``KeyedStageState``); ``driver`` (shared by a runner's keyed stages) runs its tasks."""

    counts_its_input = True
    writes_between_checkpoints = True

    def __init__(self, stage: KeyedStage, driver: KeyedStageDriver) -> None:
        self.stage = stage
        self.driver = driver

    def empty(self) -> KeyedStageState:
        return self.driver.empty(self.stage)

    def bootstrap(self, rows: DataFrame, state: KeyedStageState, pending: PendingLocation
                  ) -> KeyedStageState:
        """The rows (one per key) grouped by key group and written into the pending
        checkpoint as each range's first change file (the base of a chain that starts
        empty)."""
        checkpoint_id, location = pending()
        return self.driver.bootstrap(state, rows, checkpoint_id, location.location_reference)

    def restore(self, metadata: CheckpointMetadata, parallelism: int | None = None
                ) -> KeyedStageState:
        """The chains (their files are read when a task needs them); ``parallelism`` does not
        apply: the state is rescaled when a batch needs it."""
        return self.driver.restore(self.stage, metadata)

    def restore_frame(self, metadata: CheckpointMetadata, parallelism: int | None = None, *,
                      include_expired: bool = False) -> DataFrame:
        frame = self.driver.frame(self.restore(metadata), include_expired=include_expired)
        if parallelism is not None:
            frame = frame.repartition(parallelism)
        return frame.localCheckpoint(eager=True)

    def prepare(self, state: KeyedStageState, pending: PendingLocation, *, full: bool
                ) -> tuple[KeyedStageState, list[str]]:
        """Rescale to the driver's parallelism, or snapshot the ranges that are due (every
        range with ``full``)."""
        checkpoint_id, location = pending()
        state, results = self.driver.prepare(state, checkpoint_id, location.location_reference,
                                             full=full)
        return state, _rebuild_notes(self.stage.name, results)

    def apply(self, input: DataFrame, state: KeyedStageState, pending: PendingLocation,
              batch: int, *, output: bool = True) -> tuple[KeyedStageState, StageBatch]:
        checkpoint_id, location = pending()
        state, result = self.driver.apply(state, input, checkpoint_id,
                                          location.location_reference, batch, output=output)
        # Read from the batch's persisted pass by each consumer, released by the runner (not
        # persisted when nothing reads it: ``output``).
        notes = _rebuild_notes(self.stage.name, result.ranges)
        late_output = self.stage.watermark.late_rows if self.stage.watermark else None
        if result.late_rows:
            notes.append(f"{self.stage.name}: {result.late_rows} late row(s) "
                         + (f"sent to {late_output}" if late_output else "dropped"))
        if result.fired_timers:
            notes.append(f"{self.stage.name}: {result.fired_timers} timer(s) fired")
        # the output's plan is made only if a later stage or a sink reads it
        return state, StageBatch(lambda: result.output, result.output_rows, result.input_rows,
                                 notes, result.release,
                                 {late_output: result.late} if late_output else {})

    def snapshot(self, state: KeyedStageState, checkpoint_id: int,
                 location: CheckpointStorageLocation, *, savepoint: bool) -> StageSnapshot:
        if savepoint:  # self-contained: full snapshots inside it
            state = self.driver.snapshot(state, checkpoint_id, location.location_reference)
        expired = state.expired_rows
        parts = {"kind": "keyed",
                 "full_snapshots": [c.full_snapshot for c in state.chains
                                    if c.full_snapshot is not None],
                 "change_files": [h for c in state.chains for h in c.changes]}
        return StageSnapshot(state.operator_state(), state.master_states(),
                             state.rows - (expired or 0), expired, parts)

    def frame(self, state: KeyedStageState) -> DataFrame:
        return self.driver.frame(state)

    def repair(self, state: KeyedStageState, subtasks: list[int], pending: PendingLocation
               ) -> tuple[KeyedStageState, list[int]]:
        """Start new chains for the ranges ``subtasks`` from the local stores that hold their
        chains (warm executors)."""
        checkpoint_id, location = pending()
        state, _, missing = self.driver.repair(state, subtasks, checkpoint_id,
                                               location.location_reference)
        return state, missing


def stage_kinds(spark: SparkSession, storage: CheckpointStorage, pipeline: StatefulPipeline,
                job_id: str, *, after_write: Callable[[int, int], None] | None = None,
                keyed_local_dir: str | None = None,
                keyed_local_max_age: dt.timedelta | None = DEFAULT_LOCAL_STORE_MAX_AGE,
                local_lock_timeout: dt.timedelta = DEFAULT_LEASE_TTL) -> dict[str, StageKind]:
    """Each stage's kind, by name, in the pipeline's order. The keyed stages share one
    ``KeyedStageDriver`` (made only if there is one), on the pipeline's ``keyed_parallelism``
    and ``full_snapshot`` (``KeyedStageDriver`` says what the other arguments are)."""
    driver = None
    if pipeline.keyed_stages:
        driver = KeyedStageDriver(
            spark, storage, job_id, pipeline.max_parallelism, pipeline.keyed_parallelism,
            pipeline.full_snapshot, keyed_local_dir, after_write, keyed_local_max_age,
            local_lock_timeout=local_lock_timeout)
    kinds: dict[str, StageKind] = {}
    for stage in pipeline.stages:
        kinds[stage.name] = (KeyedStageKind(stage, driver) if isinstance(stage, KeyedStage)
                             else DataFrameStageKind(stage, spark, storage, job_id, after_write))
    return kinds


def _check_state_schema(stage, state: DataFrame) -> None:
    """Refuse a DataFrame stage's new state unless it has the declared ``state_schema``: its
    columns by name in the declared order (the checkpoint records them in order), their exact
    types, and no column nullable that is declared NOT NULL (nullable where declared NOT NULL
    is stricter, and allowed). The error names the stage and lists every difference."""
    declared, actual = stage.state_schema, state.schema
    problems = []
    names = [f.name for f in actual.fields]
    extra = [n for n in names if n not in declared.names]
    missing = [n for n in declared.names if n not in names]
    if extra:
        problems.append(f"column(s) {extra} not in state_schema")
    if missing:
        problems.append(f"column(s) {missing} missing")
    common = [n for n in names if n in declared.names]
    if not extra and not missing and names != declared.names:
        problems.append(f"columns in the order {names}, declared {declared.names}")
    for name in common:
        have, want = actual[name], declared[name]
        if have.dataType != want.dataType:
            problems.append(f"column {name!r} is {have.dataType.simpleString()}, declared "
                            f"{want.dataType.simpleString()}")
        elif have.nullable and not want.nullable:
            problems.append(f"column {name!r} is nullable, declared NOT NULL")
    if problems:
        raise ValueError(
            f"stage {stage.name}: the new state does not match the stage's state_schema: "
            + "; ".join(problems) + ". Return the declared columns, in order, of the declared "
            "types (select and cast them at the end of apply), or change state_schema")


def _evolve_batches(schema: pa.Schema, renamed: dict, defaults: dict, stage: str,
                    batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: a DataFrame stage's restored rows, written under an older state
    schema, converted into ``schema``."""
    for batch in batches:
        table = evolve_table(pa.Table.from_batches([batch]), schema, renamed, defaults,
                             f"stage {stage}: restored state")
        yield from table.to_batches()


def _rebuild_notes(stage: str, ranges) -> list[str]:
    """A progress note when ranges had to rebuild their local store from the checkpoint (a
    task on another executor, or stores lost), with what it cost, and one when ranges ran on
    a private copy of their store (its lock held elsewhere past the lock timeout)."""
    rebuilt = [r for r in ranges if r.rebuilt]
    private = [r for r in ranges if r.private]
    damaged = [r for r in rebuilt if r.damage]
    for result in damaged:  # the executor logged it too, in its own log
        logger.warning("keyed stage %s, range %d (key groups %s): %s; the local store was "
                       "rebuilt from the checkpoint", stage, result.operator_index,
                       result.key_groups, result.damage)
    notes = []
    if rebuilt:
        notes.append(f"{stage}: rebuilt {len(rebuilt)} local store(s) from the checkpoint "
                     f"({sum(r.rebuild_rows for r in rebuilt)} rows, "
                     f"{max(r.rebuild_seconds for r in rebuilt):.1f} s"
                     + (f", {len(damaged)} damaged or unreadable" if damaged else "") + ")")
    if private:
        notes.append(f"{stage}: {len(private)} range(s) ran on a private copy of their local "
                     "store, locked by another process (a stalled task?; waited "
                     f"{max(r.lock_wait_seconds for r in private):.1f} s)")
    return notes
