"""Routing a keyed stage's rows to their key group range (docs/design.md, "Keyed state", 7.5).

Rows reach their range by ``repartition(<range's route>).mapInArrow``: one call per range and
batch, whichever task or executor runs it, so correctness never depends on placement. Each
routing task also sends every range a summary row (the rows it read and their newest event
time), so every range's task sees the whole batch's clock without a Spark job of its own.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.keyed._key_groups import (
    hash_keys,
)
from pipelines.keyed._memory import release_arrow_memory
from pipelines.keyed._stage import KeyedStage
from pipelines.keyed._task import (
    KeyedStageTask,
    _micros,
    _newer,
)

__all__ = [
    "OPERATOR_INDEX",
]


OPERATOR_INDEX = "_operator_index"
"""The column ``apply_keyed_batch`` adds to route rows: the task (range) that owns each key."""
_ROUTE = "_route"  # a value per range that Spark's hash partitioning sends to its own partition
_ROUTES: dict[int, tuple[int, ...]] = {}
# A routing task's summary, sent to every range's task among the rows (operator index -1):
# the rows it read and their newest event time. Every range's task thus sees the whole
# batch's clock without a Spark job of its own to compute it first.
_SUMMARY_INDEX = -1
_ROWS = "_rows"
_NEWEST = "_newest"
_ROUTING_FIELDS = [pa.field(OPERATOR_INDEX, pa.int32(), False), pa.field(_ROUTE, pa.int32(), False),
                   pa.field(_ROWS, pa.int64()), pa.field(_NEWEST, pa.int64())]


def _spark_int_hash(value: int) -> int:
    """Spark's ``hash(int)``: Murmur3 x86 32-bit of one int with seed 42, as a signed int
    (``Murmur3_x86_32.hashInt``)."""
    mask = 0xFFFFFFFF

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & mask

    k1 = rotl((value & mask) * 0xCC9E2D51 & mask, 15) * 0x1B873593 & mask
    h1 = (rotl(42 ^ k1, 13) * 5 + 0xE6546B64) & mask
    h1 ^= 4
    h1 = (h1 ^ (h1 >> 16)) * 0x85EBCA6B & mask
    h1 = (h1 ^ (h1 >> 13)) * 0xC2B2AE35 & mask
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1


def _routes(partitions: int) -> tuple[int, ...]:
    """For each partition ``i`` of ``partitions``, an int that Spark's hash partitioning
    (``pmod(murmur3(value, 42), partitions)``, what ``repartition(n, column)`` uses) sends to
    partition ``i``: routing by it gives each range a Spark task of its own. Computed here,
    not by a Spark job: that job was the first of a restarted run, 2 s of its recovery."""
    if partitions not in _ROUTES:
        found: dict[int, int] = {}
        value = 0
        while len(found) < partitions:
            found.setdefault(_spark_int_hash(value) % partitions, value)
            value += 1
        _ROUTES[partitions] = tuple(found[i] for i in range(partitions))
    return _ROUTES[partitions]


@dataclass(frozen=True)
class Routing:
    """What routing needs of a keyed task, the same for every batch of a run: the stage (its
    key, its event time) and its ranges. A batch's routing UDF is made once from it
    (``apply_keyed_batch``), where a whole ``KeyedStageTask`` changes every batch."""

    stage: KeyedStage
    max_parallelism: int
    parallelism: int

    @classmethod
    def of(cls, task: KeyedStageTask) -> "Routing":
        return cls(task.stage, task.max_parallelism, task.parallelism)


def _routed_schema(input: pa.Schema) -> pa.Schema:
    """The routed rows: the input's columns, nullable (a summary row has no values), and the
    routing columns."""
    return pa.schema([*(f.with_nullable(True) for f in input), *_ROUTING_FIELDS])


def _operator_indices(task: "KeyedStageTask | Routing", routes: tuple[int, ...], input: pa.Schema,
                      batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: each row's owning range, from the stable key hash, and its
    range's route; then one summary row per range: this task's rows read and their newest
    event time. ``input``: the input's Arrow schema, for a task that got no rows."""
    event_time = task.stage.event_time
    rows, newest = 0, None
    schema = _routed_schema(input)
    for batch in batches:
        schema = _routed_schema(batch.schema)  # the types Spark sent, e.g. its time zone
        rows += batch.num_rows
        if event_time is not None:
            newest = _newer(newest, pc.max(_micros(batch.column(event_time))).as_py())
        indices = _operator_indices_of(task, pa.Table.from_batches([batch]))
        yield pa.RecordBatch.from_arrays([
            *batch.columns, pa.array(indices.astype("int32")),
            pa.array(np.asarray(routes, dtype="int32")[indices]),
            pa.nulls(batch.num_rows, pa.int64()), pa.nulls(batch.num_rows, pa.int64())],
            schema=schema)
    count = len(routes)
    yield pa.RecordBatch.from_arrays([
        *(pa.nulls(count, f.type) for f in list(schema)[:-len(_ROUTING_FIELDS)]),
        pa.array([_SUMMARY_INDEX] * count, pa.int32()), pa.array(routes, pa.int32()),
        pa.array([rows] * count, pa.int64()), pa.array([newest] * count, pa.int64())],
        schema=schema)
    if rows > _RELEASE_AFTER_ROWS:
        # what the read and routing freed, back to the system: the range's task this worker
        # runs next stood on it (+230 MiB a worker after a first batch of 8M rows)
        release_arrow_memory()


_RELEASE_AFTER_ROWS = 1 << 17


def _operator_indices_of(task: "KeyedStageTask | Routing", table: pa.Table) -> np.ndarray:
    """Each row's range (Flink's compute_operator_index_for_key_group, vectorised). A row
    without a key goes to range 0, which refuses it unless it is late: only the range's task
    knows the batch's clock."""
    key = task.stage.key
    valid = None
    for name in key:
        if table.column(name).null_count:
            column = pc.is_valid(table.column(name))
            valid = column if valid is None else pc.and_(valid, column)
    if valid is None:
        # The keys as the state types them: the store looks them up cast, so they route cast.
        groups = hash_keys(task.stage.cast_keys(table), key) % task.max_parallelism
        return groups.astype("int64") * task.parallelism // task.max_parallelism
    valid = valid.to_numpy(zero_copy_only=False)
    indices = np.zeros(table.num_rows, np.int64)
    indices[valid] = _operator_indices_of(task, table.filter(pa.array(valid)))
    return indices
