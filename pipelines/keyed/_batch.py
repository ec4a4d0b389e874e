"""A keyed stage's Spark jobs, driven from the driver: one batch (``apply_keyed_batch``), the
full snapshot of ranges, and reading the whole state; and the driver's bookkeeping of the
chains (``extend_chains``, ``FullSnapshotPolicy``) (docs/design.md, "Keyed state", 7.5).
"""

import contextlib
import datetime as dt
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import partial

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

from pipelines._handles import StateHandleRef
from pipelines._map_in_arrow import (
    arrow_mapped,
    chained,
    jvm_object,
    map_in_arrow,
    repartition_by,
    with_literal,
)
from pipelines.keyed._chain import (
    KeyedStateChain,
)
from pipelines.keyed._executor import (
    _decode_output,
    _replay_ranges,
    _snapshot_ranges,
    _spark_arrow_schema,
)
from pipelines.keyed._routing import (
    _ROUTE,
    _ROUTING_FIELDS,
    OPERATOR_INDEX,
    Routing,
    _operator_indices,
    _routes,
)
from pipelines.keyed._task import (
    _CHANGE,
    _EPOCH,
    _HANDLE_KIND,
    _LATE,
    _NO_LOCAL_STORE,
    _OUTPUT,
    _RESULT_SCHEMA,
    _SUMMARY,
    KeyedRangeResult,
    KeyedStageTask,
)
from pipelines.keyed._task_property import (
    BATCH_TOKEN,
    _run_batch_range,
    clear_task,
    new_token,
    set_task,
)

_RESULT_TYPE = from_arrow_schema(_RESULT_SCHEMA)

__all__ = [
    "KeyedBatch",
    "FullSnapshotPolicy",
    "apply_keyed_batch",
    "extend_chains",
    "snapshot_keyed_state",
    "ranges_to_snapshot",
    "read_keyed_state",
    "snapshot_from_local_stores",
]


@dataclass(frozen=True)
class KeyedBatch:
    """The result of ``apply_keyed_batch``: the ranges' results, the pass they come from
    (``cached``: persisted, unless the batch was applied without its output), the input rows
    the batch had (late rows included) and their newest event time (a stage with
    ``event_time``; None: no event time); ``output``, the output rows (in the stage's output
    schema, read from ``cached``; its plan made when first asked for).
    Call ``release()`` once the output is consumed: a batch's rows are not read after it."""

    ranges: list[KeyedRangeResult]
    cached: DataFrame = field(repr=False)
    input_rows: int = 0
    newest: dt.datetime | None = None
    late_rows: int = 0
    """Input rows dropped as late (behind the watermark, or the clock minus the ttl)."""
    late: DataFrame | None = None
    """With ``Watermark(late_rows=...)``: the late rows, in the input's schema, read from
    ``cached`` (None: the stage has no late-rows output)."""
    output_schema: pa.Schema | None = field(default=None, repr=False)
    """The output rows' Arrow schema as Spark hands it back (``_spark_arrow_schema``)."""
    stage: str | None = field(default=None, repr=False)
    """The stage whose batch task (``_task_property``) ``release`` forgets."""
    kept: bool = field(default=True, repr=False)
    """Whether ``cached`` is persisted, so that ``output`` can read it (False:
    ``apply_keyed_batch(..., output=False)``)."""

    @property
    def fired_timers(self) -> int:
        return sum(r.fired_timers for r in self.ranges)

    @property
    def output_rows(self) -> int:
        return sum(r.output_rows for r in self.ranges)

    @functools.cached_property
    def output(self) -> DataFrame:
        # Made when asked for: a batch whose output nothing reads (a stage without sinks or
        # later stages) does not pay its plan's py4j round trips.
        if not self.kept:
            raise RuntimeError(f"keyed stage {self.stage}: this batch was applied without its "
                               "output (apply_keyed_batch(..., output=False)); apply it with "
                               "output=True to read its output rows")
        return map_in_arrow(self.cached.filter(_kind_in(_OUTPUT)).select("payload"),
                            partial(_decode_output, self.output_schema),
                            from_arrow_schema(self.output_schema, prefer_timestamp_ntz=False),
                            ("keyed output", self.output_schema), ["payload"])

    def release(self) -> None:
        if self.kept:
            self.cached.unpersist()
        if self.stage is not None:
            clear_task(self.cached.sparkSession.sparkContext, self.stage)


def _summary(task: KeyedStageTask, rows) -> tuple[int, dt.datetime | None, int]:
    """The batch's input rows and newest event time from the ranges' summary rows, which
    must agree: each range's task received every routing task's summary; and the late rows
    the ranges dropped (each its own)."""
    seen = {(row["input_rows"], row["newest"]) for row in rows if row["row_kind"] == _SUMMARY}
    if len(seen) > 1:
        raise RuntimeError(f"keyed stage {task.stage.name}: the ranges saw different input "
                           f"(rows, newest event time: {sorted(seen, key=str)}): the batch "
                           "changed between task attempts; the source must be replayable "
                           "(read the same rows again when a task is retried)")
    count, newest = seen.pop() if seen else (0, None)
    late = sum(row["late_rows"] or 0 for row in rows if row["row_kind"] == _SUMMARY)
    return count, None if newest is None else _EPOCH + dt.timedelta(microseconds=newest), late


def _results(task: KeyedStageTask, rows) -> list[KeyedRangeResult]:
    options = task.storage.storage_options
    results = {}
    for row in rows:
        row = row.asDict()
        if row["row_kind"] == _SUMMARY:
            continue
        ref = {f.name: row[_HANDLE_KIND if f.name == "kind" else f.name]
               for f in fields(StateHandleRef)}
        index = row["operator_index"]
        results[index] = KeyedRangeResult(
            index, task.key_groups(index), StateHandleRef(**ref).handle(options),
            row["row_kind"], row["attempt"], row["rows"], row["input_rows"] or 0,
            bool(row["rebuilt"]), row["rebuild_rows"] or 0, row["rebuild_seconds"] or 0.0,
            row["state_rows"] or 0, row["output_rows"] or 0, row["expired_rows"] or 0,
            row["damage"], bool(row["private"]), row["lock_wait_seconds"] or 0.0,
            row["fired_timers"] or 0)
    return [results[i] for i in sorted(results)]


def _kind_in(*kinds: str, negated: bool = False) -> str:
    """The result rows of ``kinds`` (of other kinds: ``negated``), as SQL: a string condition
    is one py4j call where a ``Column`` expression is dozens (each function and literal a JVM
    lookup), and the driver builds these at every batch."""
    return f"row_kind {'NOT ' * negated}IN ({', '.join(repr(k) for k in kinds)})"


_ADAPTIVE = "spark.sql.adaptive.enabled"
_CACHED_BATCH_ROWS = "spark.sql.inMemoryColumnarStorage.batchSize"
# What a keyed batch's pass is planned and run with (``_one_job_per_pass``).
_PASS_SETTINGS = {
    _ADAPTIVE: "false",
    # The persisted pass is built in batches of this many result rows: one output payload (an
    # Arrow stream of up to 65,536 rows) at a time. Spark's 10,000 built a range's every
    # payload into one column buffer, grown by doubling and copied once more when built:
    # ~3x the range's output in the JVM's heap at once, 0.4-0.9 GB at a first batch of 4M
    # keys (docs/benchmarks.md, "state_growth: the batch's pass on disk").
    _CACHED_BATCH_ROWS: "1",
}


@contextlib.contextmanager
def _one_job_per_pass(spark: SparkSession, persisted: bool = True) -> Iterator[None]:
    """Plan and run a keyed batch's pass without adaptive execution: with it, the pass is
    three Spark jobs (the routing shuffle's map stage, the persisted ranges, the collect),
    each a scheduling round trip that a small batch pays in full; without it, one job of
    two stages. Adaptive execution has nothing to adapt here: ``repartition(n, column)``
    is never coalesced, and the ranges' tasks have no join or aggregate. Also the persisted
    pass's batch size (``_PASS_SETTINGS``; not for a pass that is not ``persisted``). The
    settings are the session's, restored at once; the runner plans one batch at a time."""
    settings = _PASS_SETTINGS if persisted else {_ADAPTIVE: _PASS_SETTINGS[_ADAPTIVE]}
    previous = {key: spark.conf.get(key) for key in settings}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, value in previous.items():
            spark.conf.set(key, value)


def _persist_on_disk(frame: DataFrame) -> DataFrame:
    """``frame.persist(StorageLevel.DISK_ONLY)`` in one py4j round trip (the level's JVM
    object is made once per context). A batch's pass holds every output row of the batch, as
    Arrow streams of up to 65,536 rows each: in the JVM's heap (``cache()``), a first batch
    of 8M keys kept ~0.5 GB of them there, in G1's humongous regions, until the runner
    released the batch, and G1 kept the heap it grew for them into the next batches
    (docs/benchmarks.md, "state_growth: the batch's pass on disk"). On disk, the block
    manager streams each partition to a local file and reads it back for each consumer."""
    jdf = getattr(frame, "_jdf", None)
    if jdf is None:  # Spark Connect: its own persist
        from pyspark import StorageLevel

        return frame.persist(StorageLevel.DISK_ONLY)
    level = jvm_object(frame, ("StorageLevel.DISK_ONLY",), lambda: getattr(
        frame.sparkSession.sparkContext._jvm, "org.apache.spark.storage.StorageLevel"
    ).DISK_ONLY())
    jdf.persist(level)
    frame.is_cached = True
    return frame


def apply_keyed_batch(input: DataFrame, task: KeyedStageTask, *,
                      output: bool = True) -> KeyedBatch:
    """Run one batch of a keyed stage: route rows to their range by key group, run the stage
    once per range that has rows (after late rows are dropped; one Spark task per range),
    write each range's change file; returns the output and one ``KeyedRangeResult`` per range
    that ran.
    ``output=False`` when nothing reads the batch's output (no later stage or sink, no
    late-rows output): the pass is not persisted, its handle rows are collected straight
    from it and its output rows are dropped in the ranges' tasks; ``KeyedBatch.output`` then
    raises. The same one Spark job and the same files and state.
    A stage with ``event_time``: each range's task advances ``task.clock`` by the batch's
    newest event time (the routing tasks send it along with the rows: no Spark job of its
    own), drops rows behind the clock minus the ``ttl`` and, with event-time expiry, expires
    state at it.
    ``task.chains`` must be range ``i`` of ``task.parallelism`` each: after a change of
    parallelism, ``snapshot_keyed_state`` the new ranges first."""
    if not task.is_aligned():
        raise ValueError(f"keyed stage {task.stage.name}: the chains are not the ranges of "
                         f"parallelism {task.parallelism} (rescaled?); snapshot the new "
                         "ranges with snapshot_keyed_state first")
    columns = input.schema.names  # the schema is fetched once; each .columns asks the JVM
    missing = [k for k in task.stage.key if k not in columns]
    reserved = [f.name for f in _ROUTING_FIELDS] + [BATCH_TOKEN]
    if missing or set(reserved) & set(columns):
        raise ValueError(f"keyed stage {task.stage.name}: the input needs the key column(s) "
                         f"{list(task.stage.key)} and none of the columns {reserved} (they "
                         f"route rows; rename them); it has {columns}")
    event_time = task.stage.event_time
    if event_time is not None and not isinstance(
            input.schema[event_time].dataType if event_time in columns else None,
            T.TimestampType):
        raise ValueError(f"keyed stage {task.stage.name}: event_time column {event_time!r} "
                         f"must be a TIMESTAMP column of its input (cast a date or "
                         f"TIMESTAMP_NTZ column first); the input is "
                         f"{input.schema.simpleString()}")
    spark = input.sparkSession
    input_schema = to_arrow_schema(input.schema, timezone=spark.conf.get(
        "spark.sql.session.timeZone"))
    # Here, before the batch's Spark job: a key of another type would fail in every range's
    # task, or worse, be cast into another key.
    task.stage.check_key_types(input_schema, "the input's")
    routed_type = T.StructType([
        *(T.StructField(f.name, f.dataType, True, f.metadata) for f in input.schema.fields),
        *from_arrow_schema(pa.schema(_ROUTING_FIELDS)).fields])
    routes = _routes(task.parallelism)
    # The routing and the ranges' UDFs are made once per stage (``_map_in_arrow``): the
    # routing needs only what stays the same between batches (``Routing``), the ranges get
    # the batch's task in a local property of its job, checked by its token
    # (``_task_property``). The stage's identity keys them: its function is in them.
    routing = Routing.of(task)
    route = partial(_operator_indices, routing, routes, input_schema)
    key = ("keyed routing", id(task.stage), routing.max_parallelism, routing.parallelism,
           input_schema, routed_type.json())
    source = arrow_mapped(input)
    if source is None:
        routed = map_in_arrow(input, route, routed_type, key, columns)
    else:
        # The input is a mapInArrow (a file source's read): the routing runs after it in its
        # Python worker, where it ran in a second one, its rows handed over through the JVM.
        routed = map_in_arrow(source.frame, partial(chained, source.function, input_schema,
                                                    route),
                              routed_type, (key, source.key), list(source.columns))
    context = spark.sparkContext
    token = new_token()
    watermark = task.stage.watermark
    # Output rows no one reads are dropped in the ranges' tasks, not shipped to the JVM to
    # be filtered there: a first batch's output is a row per key, held in each range's
    # worker beside its store's merge (docs/benchmarks.md, "state_growth: a first batch's memory").
    task = replace(task, output_read=output)
    set_task(context, task, token)
    # The late rows are an output too: their pass is kept for them.
    output = output or (watermark is not None and bool(watermark.late_rows))
    # One Spark task per range: repartition(n, column) is never coalesced by adaptive
    # execution, and each range's route hashes to its own partition.
    try:
        with _one_job_per_pass(spark, persisted=output):
            # the persisted plan is made here, so the later reads of the output use it too
            ranges = with_literal(repartition_by(routed, task.parallelism, _ROUTE),
                                  BATCH_TOKEN, token)
            cached = map_in_arrow(
                ranges, partial(_run_batch_range, task.stage.name), _RESULT_TYPE,
                ("keyed ranges", task.stage.name), [*routed_type.names, BATCH_TOKEN])
            # Kept only for an output that something reads: persisting plans the pass once
            # more (Spark's cache manager), writes its every output row to local disk and
            # builds it one row per cached batch, all for nothing when no one reads it
            # (docs/design.md, 7.26).
            if output:
                cached = _persist_on_disk(cached)
            try:
                # the handle and summary rows carry no payload: nothing to drop
                handles = cached.filter(_kind_in(_OUTPUT, _LATE, negated=True)).collect()
                results, summary = _results(task, handles), _summary(task, handles)
            except BaseException:
                if output:
                    cached.unpersist()
                raise
    except BaseException:  # no KeyedBatch to release: later jobs must not carry the task
        clear_task(context, task.stage.name)
        raise
    late = None
    if watermark is not None and watermark.late_rows:
        late_schema = to_arrow_schema(input.schema, timezone="UTC")
        late = map_in_arrow(cached.filter(_kind_in(_LATE)).select("payload"),
                            partial(_decode_output, late_schema), input.schema,
                            ("keyed late rows", input.schema.json()), ["payload"])
    return KeyedBatch(results, cached, *summary, late=late,
                      output_schema=_spark_arrow_schema(task.output_schema),
                      stage=task.stage.name, kept=output)


def extend_chains(chains: Sequence[KeyedStateChain],
                  results: Sequence[KeyedRangeResult]) -> list[KeyedStateChain]:
    """The chains after a batch: each range with a change file gets it appended, a
    snapshotted range restarts from its snapshot; ranges without rows stay as they were."""
    chains = list(chains)
    for result in results:
        chain = chains[result.operator_index]
        if chain.key_groups != result.key_groups:
            raise ValueError(f"range {result.operator_index}: result of key groups "
                             f"{result.key_groups} for a chain of {chain.key_groups}")
        chains[result.operator_index] = (
            chain.appended(result.handle, result.state_rows, result.expired_rows)
            if result.kind == _CHANGE
            else KeyedStateChain(result.key_groups, result.handle, (), result.state_rows,
                                 result.expired_rows))
    return chains


@dataclass(frozen=True)
class FullSnapshotPolicy:
    """When a range's chain is replaced by a snapshot (Flink's periodic full snapshot):
    when the change files since its base outgrow ``ratio`` times the base (at least
    ``min_bytes``, so that small states do not snapshot at every checkpoint), or after
    ``every`` change files if set. The base is the chain's snapshot, or, for a chain that
    started empty, its first change file (which then holds the whole range).

    A small range (its base and change files together at most ``min_bytes``) is also
    snapshotted after ``small_every`` change files (None: never): below ``min_bytes`` the
    ratio would let its chain grow to dozens of small files, each a file (or an inline
    handle) of every later checkpoint, where the snapshot rewrites at most ``min_bytes``.

    Bytes written per batch are then about the change files' times ``1 + 1/ratio``, whatever
    the state's size (a small range's, at most ``min_bytes / small_every`` more); a restore
    without local stores replays at most ``1 + ratio`` times the snapshot's bytes."""

    every: int | None = None
    ratio: float = 1.0
    min_bytes: int = 1 << 20
    small_every: int | None = 4

    def __post_init__(self) -> None:
        if (self.every is not None and self.every < 1) or self.ratio <= 0 or self.min_bytes < 0 \
                or (self.small_every is not None and self.small_every < 1):
            raise ValueError(f"FullSnapshotPolicy: every and small_every >= 1 (or None), "
                             f"ratio > 0 and min_bytes >= 0, got {self}")

    def due(self, chain: KeyedStateChain) -> bool:
        if not chain.changes:
            return False
        if self.every is not None and len(chain.changes) >= self.every:
            return True
        if chain.full_snapshot is None:
            base, since = chain.changes[0].state_size, chain.changes[1:]
        else:
            base, since = chain.full_snapshot.state_size, chain.changes
        changed = sum(h.state_size for h in since)
        if (self.small_every is not None and len(since) >= self.small_every
                and base + changed <= self.min_bytes):
            return True
        return changed > self.ratio * max(base, self.min_bytes)


def ranges_to_snapshot(chains: Sequence[KeyedStateChain],
                          policy: FullSnapshotPolicy) -> list[int]:
    """The operator indices whose chains the policy says to snapshot now."""
    return [i for i, chain in enumerate(chains) if policy.due(chain)]


def _operator_index_frame(spark: SparkSession, task: KeyedStageTask,
                          operator_indices: Sequence[int] | None) -> DataFrame | None:
    """One row per operator index, one Spark partition each (None: no indices)."""
    indices = list(range(task.parallelism)) if operator_indices is None else list(
        operator_indices)
    if not indices:
        return None
    for index in indices:
        task.key_groups(index)  # checks the index
    # One row per slice: one Spark task per range, no shuffle. Built by `range`, not from a
    # Python list: an RDD of Python rows started a second Python daemon and its workers, with
    # their imports, in a fresh process (docs/benchmarks.md, "cold_run: the workers' imports").
    positions = spark.range(len(indices), numPartitions=len(indices))
    index = F.element_at(F.array(*(F.lit(i) for i in indices)), F.col("id").cast("int") + 1)
    return positions.select(index.cast("int").alias(OPERATOR_INDEX))


def snapshot_keyed_state(spark: SparkSession, task: KeyedStageTask,
                            operator_indices: Sequence[int] | None = None, *,
                            adopt: bool = True) -> list[KeyedRangeResult]:
    """Write a snapshot of each range in ``operator_indices`` (all ranges if None) of
    ``task.parallelism``, one Spark task per range, expired rows left out. With ``adopt``
    (periodic full snapshot) ``extend_chains`` with the results resets their chains, and the
    local stores hold the new chains; with ``task.chains`` of another parallelism this is
    rescaling: every new range is rebuilt from the chains it overlaps. Without ``adopt`` (a
    savepoint's full snapshot, written into ``task.reference``'s location) the stores and
    chains are untouched."""
    frame = _operator_index_frame(spark, task, operator_indices)
    if frame is None:
        return []
    rows = frame.mapInArrow(partial(_snapshot_ranges, task, adopt, False),
                            from_arrow_schema(_RESULT_SCHEMA)).collect()
    return _results(task, rows)


def snapshot_from_local_stores(spark: SparkSession, task: KeyedStageTask,
                                    operator_indices: Sequence[int]
                                    ) -> tuple[list[KeyedRangeResult], list[int]]:
    """Write a snapshot of each range in ``operator_indices`` from its executor's local store,
    only where that store holds exactly the range's shipped chain (its ``version``): for
    chains with a corrupt or missing file, which must not be replayed. Returns the results
    (``extend_chains`` with them starts the ranges' new chains) and the operator indices
    whose task found no such store (nothing written for them)."""
    frame = _operator_index_frame(spark, task, operator_indices)
    if frame is None:
        return [], []
    rows = frame.mapInArrow(partial(_snapshot_ranges, task, True, True),
                            from_arrow_schema(_RESULT_SCHEMA)).collect()
    missing = sorted({row["operator_index"] for row in rows if row["row_kind"] == _NO_LOCAL_STORE})
    return _results(task, [r for r in rows if r["row_kind"] != _NO_LOCAL_STORE]), missing


def read_keyed_state(spark: SparkSession, task: KeyedStageTask, *,
                     include_expired: bool = False) -> DataFrame:
    """The state of every range of ``task.parallelism`` as a DataFrame of the stage's state
    schema, replayed from ``task.chains`` on the executors (one task per range). Rows expired
    at ``task.now`` are left out, as a stage never sees them, unless ``include_expired`` (the
    rows a checkpoint holds until the next full snapshot drops them, which its recorded
    row counts include)."""
    frame = _operator_index_frame(spark, task, None)
    target = _spark_arrow_schema(task.stage.state_schema)
    return frame.mapInArrow(partial(_replay_ranges, task, include_expired),
                            from_arrow_schema(target, prefer_timestamp_ntz=False))
