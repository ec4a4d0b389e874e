"""A keyed stage in a run, on the driver: its chains between checkpoints, its event-time
clock, when its ranges are snapshotted or rescaled, and what a checkpoint records of it
(docs/design.md, "Keyed state", 7.6).

The runner holds one ``KeyedStageState`` per keyed stage where it holds a DataFrame for a
DataFrame stage, and calls ``KeyedStageDriver`` to restore, prepare, apply and snapshot it.
Full snapshot happens only at the start of a checkpoint interval, when every change file in
the chains is referenced by the last completed checkpoint: a snapshot never supersedes a file
no checkpoint referenced, so nothing is written that only garbage collection would remove.
"""

import datetime as dt
from dataclasses import dataclass, replace

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession

from checkpoint_storage import CheckpointMetadata, CheckpointStorage, InvalidCheckpointError
from checkpoint_storage.spi import (
    DEFAULT_LEASE_TTL,
    STATE_FORMAT_PREFIX,
    STATE_SCHEMA_PREFIX,
    CheckpointStorageLocationReference,
    OperatorState,
)
from pipelines.keyed._batch import (
    FullSnapshotPolicy,
    KeyedBatch,
    apply_keyed_batch,
    extend_chains,
    ranges_to_snapshot,
    read_keyed_state,
    snapshot_from_local_stores,
    snapshot_keyed_state,
)
from pipelines.keyed._chain import (
    CHAIN_FORMAT,
    KEYED_STATE_PREFIX,
    KeyedStateChain,
    KeyedStateFormatError,
    chains_from_operator_state,
    chains_to_operator_state,
    decode_keyed_master_state,
    encode_keyed_master_state,
)
from pipelines.keyed._evolution import check_evolution
from pipelines.keyed._key_groups import compute_key_group_range_for_operator_index
from pipelines.keyed._layout import KeyedStateLayout
from pipelines.keyed._local_stores import DEFAULT_LOCAL_STORE_MAX_AGE
from pipelines.keyed._stage import KeyedResult, KeyedStage, TimeMode, TtlTimeCharacteristic
from pipelines.keyed._task import _EPOCH, KeyedRangeResult, KeyedStageTask, _newer

__all__ = ["KeyedStageDriver", "KeyedStageState", "loader_stage"]


def loader_stage(stage: KeyedStage) -> KeyedStage:
    """``stage`` as the pass that loads its initial state: ``apply`` upserts the rows as they
    are; the rows' clock is the event-time TTL's timestamp column (else none); no watermark
    (the rows are state, not input: none is late). A stage with timers keeps a
    ``time_mode`` so that the rows carry the ``_timers`` column, processing time because the
    rows have no event time; loaded rows hold no timers, so none fires."""
    ttl = stage.ttl
    event_time = (ttl.timestamp_column if ttl is not None
                  and ttl.time_characteristic is TtlTimeCharacteristic.EVENT_TIME else None)
    return replace(
        stage, apply=_LoadRows(stage.name, stage.key, stage.state_schema.names),
        output_schema=stage.state_schema, event_time=event_time, watermark=None,
        time_mode=None if stage.time_mode is None else TimeMode.PROCESSING_TIME)


@dataclass(frozen=True)
class KeyedStageState:
    """One keyed stage's state in a run: the chains of its ranges (the last batch's, which
    may reference change files no checkpoint has yet), and ``clock``, the newest event time
    the stage has seen (event-time expiry; None otherwise)."""

    stage: KeyedStage
    max_parallelism: int
    chains: tuple[KeyedStateChain, ...]
    clock: dt.datetime | None = None

    @property
    def parallelism(self) -> int:
        return len(self.chains)

    @property
    def rows(self) -> int:
        """State rows (expired rows not yet dropped count); chains of unknown size count 0."""
        return sum(chain.rows or 0 for chain in self.chains)

    @property
    def expired_rows(self) -> int | None:
        """Of ``rows``, those expired by the TTL and not dropped yet, as each range's last
        task counted them; None when a chain does not know (restored from a checkpoint
        written before they were counted, and not run since)."""
        counts = [chain.expired_rows for chain in self.chains if chain.rows != 0]
        return None if None in counts else sum(counts)

    @property
    def layout(self) -> KeyedStateLayout:
        return KeyedStateLayout.of(self.stage, self.max_parallelism)

    def unpersist(self) -> None:
        """Nothing to release on the driver (the runner releases every stage's state alike)."""

    def operator_state(self) -> OperatorState:
        return chains_to_operator_state(self.stage.name, self.max_parallelism, self.chains)

    def master_states(self) -> dict[str, bytes]:
        """What a snapshot records of the stage besides its chains, for readers and restores:
        its format, state schema, layout and clock."""
        name = self.stage.name
        return {
            STATE_FORMAT_PREFIX + name: CHAIN_FORMAT.encode(),
            STATE_SCHEMA_PREFIX + name: self.stage.state_schema.serialize().to_pybytes(),
            KEYED_STATE_PREFIX + name: encode_keyed_master_state(self.layout, self.clock),
        }


@dataclass(frozen=True)
class _LoadRows:
    """A keyed stage's ``apply`` that makes its input rows the state (initial state, and
    savepoints written from tables): one row per key, else an error naming a key."""

    stage: str
    key: tuple[str, ...]
    columns: list[str]

    def __call__(self, input: pa.Table, state: pa.Table) -> KeyedResult:
        counts = input.group_by(list(self.key)).aggregate([([], "count_all")])
        if counts.num_rows != input.num_rows:
            twice = counts.filter(pc.greater(counts.column("count_all"), 1)).slice(0, 1)
            example = twice.drop_columns(["count_all"]).to_pylist()[0]
            raise ValueError(
                f"initial state of keyed stage {self.stage}: key {example} has "
                f"{twice.column('count_all')[0].as_py()} rows; the state holds one row per key "
                "(deduplicate or aggregate the rows by the key first)")
        return KeyedResult(input.select(self.columns), input.select(list(self.key)).slice(0, 0),
                           input.slice(0, 0).select(self.columns))


def _results_as_chains(results: list[KeyedRangeResult]) -> tuple[KeyedStateChain, ...]:
    return tuple(KeyedStateChain(r.key_groups, r.handle, (), r.state_rows, r.expired_rows)
                 for r in results)


class KeyedStageDriver:
    """Runs a pipeline's keyed stages for one runner: ``parallelism`` ranges per stage (None:
    Spark's default parallelism; a restore at another parallelism is rescaled by
    snapshotting the new ranges), ``policy`` for periodic full snapshot, local stores
    below ``local_dir`` on each executor (None: its temp directory), removed there once not
    written for ``local_max_age`` (None: never); a task waits at most ``local_lock_timeout``
    for a store's lock (the runner's lease ttl), then runs on a private copy of the store."""

    def __init__(self, spark: SparkSession, storage: CheckpointStorage, job_id: str,
                 max_parallelism: int, parallelism: int | None, policy: FullSnapshotPolicy,
                 local_dir: str | None = None, after_write=None,
                 local_max_age: dt.timedelta | None = DEFAULT_LOCAL_STORE_MAX_AGE,
                 local_lock_timeout: dt.timedelta = DEFAULT_LEASE_TTL) -> None:
        self.spark = spark
        self.storage = storage
        self.job_id = job_id
        self.max_parallelism = max_parallelism
        self._parallelism = parallelism
        self.policy = policy
        self.local_dir = local_dir
        self.local_max_age = local_max_age
        self.after_write = after_write  # test seam: KeyedStageTask.after_write
        self.local_lock_timeout = local_lock_timeout

    @property
    def parallelism(self) -> int:
        """The ranges per keyed stage: as configured, else Spark's default parallelism (at
        most ``max_parallelism``), asked of Spark only when a run needs it."""
        if self._parallelism is None:
            self._parallelism = min(self.spark.sparkContext.defaultParallelism,
                                    self.max_parallelism)
        compute_key_group_range_for_operator_index(self.max_parallelism, self._parallelism, 0)
        return self._parallelism

    # --- states ----------------------------------------------------------------------------

    def empty(self, stage: KeyedStage) -> KeyedStageState:
        chains = tuple(KeyedStateChain(compute_key_group_range_for_operator_index(
            self.max_parallelism, self.parallelism, i), None, (), 0)
            for i in range(self.parallelism))
        return KeyedStageState(stage, self.max_parallelism, chains)

    def restore(self, stage: KeyedStage, metadata: CheckpointMetadata) -> KeyedStageState:
        """The stage's state in ``metadata``: its chains (at the parallelism they were
        written with) and clock; a clear error when the snapshot holds something else."""
        where = f"checkpoint {metadata.checkpoint_id}, keyed stage {stage.name!r}"
        operator = next((op for op in metadata.operator_states
                         if op.operator_id == stage.name), None)
        if operator is None:
            raise InvalidCheckpointError(
                f"{where}: no state for the stage (the checkpoint has "
                f"{sorted(op.operator_id for op in metadata.operator_states)})")
        recorded = metadata.master_states.get(STATE_FORMAT_PREFIX + stage.name, b"").decode(
            errors="replace")
        if recorded != CHAIN_FORMAT:
            raise InvalidCheckpointError(
                f"{where}: the snapshot holds the stage's state as {recorded or 'a DataFrame'}"
                f", the stage is keyed ({CHAIN_FORMAT}); restore a snapshot written by the "
                "keyed stage, or run the stage as it was")
        if operator.max_parallelism != self.max_parallelism:
            raise InvalidCheckpointError(
                f"{where}: written with max_parallelism {operator.max_parallelism}, the "
                f"pipeline has {self.max_parallelism}. The number of key groups is fixed for "
                "the life of the state: set max_parallelism back to "
                f"{operator.max_parallelism}, or start a new pipeline from a savepoint "
                "written with write_savepoint from the state (checkpoints read)")
        stored = pa.ipc.read_schema(pa.py_buffer(
            metadata.master_states.get(STATE_SCHEMA_PREFIX + stage.name, b"")))
        try:
            layout, clock = decode_keyed_master_state(
                metadata.master_states.get(KEYED_STATE_PREFIX + stage.name, b""),
                stored, where)
            chains = chains_from_operator_state(operator)
        except KeyedStateFormatError as exc:
            raise InvalidCheckpointError(str(exc)) from exc
        rekey = ("A key is fixed for the life of the state: keep it, or start a new pipeline "
                 "from a savepoint written with write_savepoint from the state re-keyed "
                 "(checkpoints read, then group it by the new key)")
        if layout.key != stage.key:
            raise InvalidCheckpointError(
                f"{where}: the state is keyed by {list(layout.key)}, the stage by "
                f"{list(stage.key)}. {rekey}")
        for name in stage.key:
            old, new = stored.field(name).type, stage.state_schema.field(name).type
            if old != new:
                raise InvalidCheckpointError(
                    f"{where}: key column {name!r} was {old}, is now {new}. {rekey}")
        if layout.timers != stage.has_timers:
            raise InvalidCheckpointError(
                f"{where}: the state was written by a stage "
                f"{'with' if layout.timers else 'without'} timers, the stage now has "
                f"{'a time_mode' if stage.has_timers else 'none'}: its rows "
                f"{'carry' if layout.timers else 'lack'} the _timers column. Run the stage "
                "with the time_mode it had, or start it from empty state")
        if layout.timers and layout.time_mode not in (None, stage.time_mode.value):
            # the timers are instants on the clock that wrote them: another clock would fire
            # them at the wrong time
            raise InvalidCheckpointError(
                f"{where}: the state's timers were written with time_mode "
                f"{layout.time_mode.upper()}, the stage now has {stage.time_mode.name}. Run "
                "the stage with the time_mode it had, or start it from empty state")
        try:
            check_evolution(stored, stage.state_schema, stage.renamed, stage.defaults, where)
        except ValueError as exc:
            raise InvalidCheckpointError(str(exc)) from exc
        return KeyedStageState(stage, self.max_parallelism, tuple(chains), clock)

    # --- tasks -----------------------------------------------------------------------------

    def _task(self, state: KeyedStageState, checkpoint_id: int,
              reference: CheckpointStorageLocationReference, batch: int,
              now: dt.datetime | None, parallelism: int | None = None) -> KeyedStageTask:
        return KeyedStageTask(
            self.storage, self.job_id, checkpoint_id, reference, state.stage,
            state.stage.output_schema, self.max_parallelism,
            parallelism or state.parallelism, state.chains, batch, now, state.clock,
            self.local_dir, self.local_max_age, self.after_write,
            local_lock_timeout=self.local_lock_timeout,
            processing_time=dt.datetime.now(dt.UTC)
            if state.stage.time_mode is TimeMode.PROCESSING_TIME else None)

    def _now(self, state: KeyedStageState) -> dt.datetime | None:
        """The expiry clock: the newest event time seen, or the wall clock."""
        ttl = state.stage.ttl
        if ttl is None:
            return None
        if ttl.time_characteristic is TtlTimeCharacteristic.PROCESSING_TIME:
            return dt.datetime.now(dt.UTC)
        return state.clock or _EPOCH

    def prepare(self, state: KeyedStageState, checkpoint_id: int,
                reference: CheckpointStorageLocationReference, *, full: bool = False
                ) -> tuple[KeyedStageState, list[KeyedRangeResult]]:
        """At the start of a checkpoint interval: rescale to this driver's parallelism, or
        snapshot every range (``full``: e.g. after a NO_CLAIM restore, whose shared files
        the next checkpoint must not reference), or the ranges the policy says are due.
        Snapshots are written into checkpoint ``checkpoint_id``'s shared state."""
        now = self._now(state)
        if full or state.parallelism != self.parallelism:
            task = self._task(state, checkpoint_id, reference, 0, now, self.parallelism)
            results = snapshot_keyed_state(self.spark, task)
            return replace(state, chains=_results_as_chains(results)), results
        due = ranges_to_snapshot(state.chains, self.policy)
        if not due:
            return state, []
        task = self._task(state, checkpoint_id, reference, 0, now)
        results = snapshot_keyed_state(self.spark, task, due)
        return replace(state, chains=tuple(extend_chains(state.chains, results))), results

    def repair(self, state: KeyedStageState, operator_indices: list[int], checkpoint_id: int,
               reference: CheckpointStorageLocationReference
               ) -> tuple[KeyedStageState, list[KeyedRangeResult], list[int]]:
        """Start new chains for the ranges ``operator_indices`` (of the state's own
        parallelism), whose chains hold a corrupt or missing file, from the local stores that
        hold exactly those chains; snapshots go into checkpoint ``checkpoint_id``'s shared
        state. Returns the new state, the results and the ranges no local store could serve
        (their chains are unchanged: the caller must not go on with them)."""
        task = self._task(state, checkpoint_id, reference, 0, self._now(state))
        results, missing = snapshot_from_local_stores(self.spark, task, operator_indices)
        return replace(state, chains=tuple(extend_chains(state.chains, results))), results, missing

    def apply(self, state: KeyedStageState, input: DataFrame, checkpoint_id: int,
              reference: CheckpointStorageLocationReference, batch: int, *,
              output: bool = True) -> tuple[KeyedStageState, KeyedBatch]:
        """One batch: run the stage on every range with rows, writing their change files
        into checkpoint ``checkpoint_id``'s shared state. Each range's task first advances
        the event-time clock over the whole batch and drops its rows behind the clock minus
        the ttl. Returns the new state (its clock advanced) and the batch's output and
        ranges (``release()`` it once its output is consumed). ``output=False``: nothing
        reads the output (``apply_keyed_batch``)."""
        task = self._task(state, checkpoint_id, reference, batch, self._now(state))
        result = apply_keyed_batch(input, task, output=output)
        state = replace(state, clock=_newer(state.clock, result.newest),
                        chains=tuple(extend_chains(state.chains, result.ranges)))
        return state, result

    def bootstrap(self, state: KeyedStageState, rows: DataFrame, checkpoint_id: int,
                  reference: CheckpointStorageLocationReference) -> KeyedStageState:
        """``state`` (empty) with ``rows`` (the state schema's columns, one row per key) as
        its state: routed by key group like a batch and written into checkpoint
        ``checkpoint_id``'s shared state as each range's first change file, which a chain
        that starts empty reads as its base. Under event-time expiry the rows' timestamps
        advance the clock, and rows already expired at it are left out."""
        stage = state.stage
        missing = [n for n in stage.state_schema.names if n not in rows.columns]
        if missing:
            raise ValueError(f"initial state of keyed stage {stage.name}: column(s) {missing} "
                             f"missing; the state schema has {stage.state_schema.names}, the "
                             f"rows {rows.columns}")
        rows = rows.select(*stage.state_schema.names)
        loader = loader_stage(stage)
        loaded, result = self.apply(replace(state, stage=loader), rows, checkpoint_id,
                                    reference, 0, output=False)
        result.release()
        return replace(loaded, stage=stage)

    def snapshot(self, state: KeyedStageState, checkpoint_id: int,
                 reference: CheckpointStorageLocationReference) -> KeyedStageState:
        """A self-contained copy for a savepoint: one full snapshot per range written into
        ``reference``'s location, expired rows left out; the run's chains and local stores
        are untouched."""
        task = self._task(state, checkpoint_id, reference, 0, self._now(state))
        results = snapshot_keyed_state(self.spark, task, adopt=False)
        return replace(state, chains=_results_as_chains(results))

    def frame(self, state: KeyedStageState, *, include_expired: bool = False) -> DataFrame:
        """The stage's whole state as a DataFrame of its state schema (for state sinks and
        checks), replayed on the executors from the chains; expired rows only with
        ``include_expired``."""
        task = self._task(state, 0, CheckpointStorageLocationReference.get_default(), 0,
                          self._now(state))
        return read_keyed_state(self.spark, task, include_expired=include_expired)

