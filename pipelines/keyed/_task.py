"""A keyed stage's task: what travels from the driver to the executors for one batch (or one
full snapshot) of a keyed stage, and what comes back (docs/design.md, "Keyed state", 7.5).

Only plain, picklable values travel to executors: the ``CheckpointStorage`` config, ids, the
location reference, the stage (its function pickled by cloudpickle, as Spark does) and the
chains as ``StateHandleRef`` values. One result schema carries a range's output rows (Arrow IPC
bytes), its change-file or snapshot handle and the batch's summary, so the stage's function
runs once per range (once per slice of its keys for a large batch: ``_executor._key_slices``).
"""

import datetime as dt
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import TaskContext

from checkpoint_storage import CheckpointStorage
from checkpoint_storage.spi import (
    DEFAULT_LEASE_TTL,
    CheckpointStorageLocationReference,
    StreamStateHandle,
)
from pipelines._handles import StateHandleRef
from pipelines.keyed._chain import (
    KeyedStateChain,
)
from pipelines.keyed._key_groups import (
    KeyGroupRange,
    compute_key_group_range_for_operator_index,
)
from pipelines.keyed._layout import KeyedStateLayout
from pipelines.keyed._stage import KeyedStage

__all__ = [
    "ChainRef",
    "KeyedRangeResult",
    "KeyedStageTask",
    "chain_version",
]


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


_OUTPUT = "output"
_LATE = "late"  # a payload of input rows the watermark dropped (Watermark.late_rows)
_CHANGE = "change"
_FULL_SNAPSHOT = "full_snapshot"
_SUMMARY = "summary"
_NO_LOCAL_STORE = "no_local_store"  # a range whose local store does not hold its chain
_OUTPUT_ROWS_PER_PAYLOAD = 1 << 16
_RESULT_SCHEMA = pa.schema([
    # "output" or "late" (payload), "change"/"full_snapshot" (handle) or "summary" (the batch's
    # rows and newest event time, as a range's task saw them)
    ("row_kind", pa.string()),
    ("operator_index", pa.int32()),
    ("attempt", pa.int32()),
    ("payload", pa.binary()),  # output rows as one Arrow IPC stream
    ("input_rows", pa.int64()),
    ("rows", pa.int64()),  # rows in the written file
    ("state_rows", pa.int64()),  # the range's state rows after it
    ("expired_rows", pa.int64()),  # of those, expired by the ttl at the task's cutoff
    ("output_rows", pa.int64()),  # the range's output rows this batch
    ("rebuilt", pa.bool_()),
    ("rebuild_rows", pa.int64()),
    ("rebuild_seconds", pa.float64()),
    ("damage", pa.string()),  # why the local store could not be used (None: it could)
    ("private", pa.bool_()),  # ran on a private copy of the local store (its lock was held)
    ("lock_wait_seconds", pa.float64()),
    ("newest", pa.int64()),  # the batch's newest event time, microseconds since the epoch
    ("late_rows", pa.int64()),  # a summary: the range's input rows dropped as late
    ("fired_timers", pa.int64()),  # timers that fired in the range this batch
    *[(f.name, t) for f, t in zip(fields(StateHandleRef), (
        pa.string(), pa.string(), pa.int64(), pa.int64(), pa.binary(), pa.string(), pa.int64(),
        pa.string(), pa.string()), strict=True)],
])
_HANDLE_KIND = "handle_kind"  # StateHandleRef.kind, renamed: "kind" would read as the row's
_RESULT_SCHEMA = _RESULT_SCHEMA.set(
    _RESULT_SCHEMA.get_field_index("kind"), pa.field(_HANDLE_KIND, pa.string()))


@dataclass(frozen=True)
class ChainRef:
    """A ``KeyedStateChain`` as plain values (``StateHandleRef``s), to ship to executors."""

    start: int
    end: int
    full_snapshot: StateHandleRef | None
    changes: tuple[StateHandleRef, ...] = ()

    @classmethod
    def of(cls, chain: KeyedStateChain) -> "ChainRef":
        return cls(chain.key_groups.start, chain.key_groups.end,
                   None if chain.full_snapshot is None
                   else StateHandleRef.of(chain.full_snapshot),
                   tuple(StateHandleRef.of(h) for h in chain.changes))

    @property
    def key_groups(self) -> KeyGroupRange:
        return KeyGroupRange(self.start, self.end)

    def chain(self, storage_options: Mapping | None) -> KeyedStateChain:
        return KeyedStateChain(
            self.key_groups,
            None if self.full_snapshot is None else self.full_snapshot.handle(
                storage_options),
            tuple(h.handle(storage_options) for h in self.changes))


def _handle_identity(ref: StateHandleRef) -> str:
    return f"{ref.kind}:{ref.path}:{ref.start}:{ref.size}"


def chain_version(key_groups: KeyGroupRange, chains: Sequence[KeyedStateChain]) -> str:
    """The local store ``version`` of a range holding exactly the state of ``chains``: a digest
    of the range and the chains' handles, so a store that applied another attempt's change
    file, or a stale one, never passes for the checkpointed state."""
    digest = hashlib.sha256(str(key_groups).encode())
    for chain in chains:
        ref = ChainRef.of(chain)
        digest.update(f"|{ref.start}-{ref.end}".encode())
        for handle in (ref.full_snapshot, *ref.changes):
            digest.update(b"|" + (b"-" if handle is None
                                  else _handle_identity(handle).encode()))
    return "chain-" + digest.hexdigest()[:32]


@dataclass(frozen=True)
class KeyedStageTask:
    """Everything an executor needs to run one batch of one keyed stage, or to snapshot
    its ranges: the checkpoint to write into, the stage, the layout and the chains as of the
    last completed checkpoint.

    ``chains``: for a batch, chain ``i`` is range ``i`` of ``parallelism`` (Flink's ranges);
    for a full snapshot any chains covering all key groups (e.g. another parallelism's:
    that is rescaling). ``now``: the batch's time for state expiry (processing-time stamps and
    the cutoff); None when the stage has no ``ttl``. For a batch of a stage with event-time
    expiry, ``now`` is the clock before the batch: each range's task advances it by the
    batch's newest event time. ``clock``: a stage with ``event_time``: the newest event time
    seen before this batch (None: none yet); input rows behind the clock, advanced by the
    batch, minus the ``ttl`` are dropped. ``local_dir``: the base directory of the
    local stores on each executor (None: the executor's temp directory). ``local_max_age``:
    a batch's task removes the local stores below that directory (any job's) not written
    for this long (``sweep_idle_stores``; None: never). ``after_write``: a
    test seam, ``after_write(operator_index, attempt)`` runs on the executor once a range's
    change file or snapshot is written and its local store updated, before the result
    reaches the driver (the runner's ``task_after_write``). ``local_lock_timeout``: the
    longest a task waits for a local store's lock before it runs on a private copy of the
    store (``_locked_store``); the runner passes its lease ttl. ``processing_time``: the
    batch's wall-clock time, taken once on the driver, at or before which processing-time
    timers fire (None: a stage without them). ``output_read``: whether the batch's output
    rows are read (``apply_keyed_batch`` sets it from its ``output``); False, the ranges'
    tasks count the stage's output rows and let them go where they were made."""

    storage: CheckpointStorage
    job_id: str
    checkpoint_id: int
    reference: CheckpointStorageLocationReference
    stage: KeyedStage
    output_schema: pa.Schema
    max_parallelism: int
    parallelism: int
    chains: tuple[ChainRef, ...]
    batch: int
    now: dt.datetime | None = None
    clock: dt.datetime | None = None
    local_dir: str | None = None
    local_max_age: dt.timedelta | None = None
    after_write: Callable[[int, int], None] | None = field(default=None, compare=False,
                                                            repr=False)
    local_lock_timeout: dt.timedelta = DEFAULT_LEASE_TTL
    processing_time: dt.datetime | None = None
    output_read: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "chains", tuple(
            c if isinstance(c, ChainRef) else ChainRef.of(c) for c in self.chains))
        where = f"keyed stage {self.stage.name}"
        compute_key_group_range_for_operator_index(self.max_parallelism, self.parallelism, 0)
        covered = sorted((c.start, c.end) for c in self.chains)
        expected, position = [], 0
        for start, end in covered:
            if start != position:
                break
            expected.append((start, end))
            position = end + 1
        if position != self.max_parallelism or len(expected) != len(covered):
            raise ValueError(f"{where}: the chains {[f'{s}-{e}' for s, e in covered]} must cover "
                             f"key groups 0-{self.max_parallelism - 1} once each; pass the "
                             "chains of the last completed checkpoint")
        if self.local_lock_timeout < dt.timedelta(0):
            raise ValueError(f"{where}: local_lock_timeout must not be negative, got "
                             f"{self.local_lock_timeout}")
        if self.stage.ttl is not None and (self.now is None or self.now.tzinfo is None):
            raise ValueError(f"{where}: a stage with ttl needs the task's now (a timezone-aware "
                             "datetime: the batch's time)")

    @property
    def layout(self) -> KeyedStateLayout:
        return KeyedStateLayout.of(self.stage, self.max_parallelism)

    def key_groups(self, operator_index: int) -> KeyGroupRange:
        return compute_key_group_range_for_operator_index(self.max_parallelism,
                                                          self.parallelism, operator_index)

    def is_aligned(self) -> bool:
        """Whether chain ``i`` is range ``i`` of ``parallelism`` (a batch needs it)."""
        return len(self.chains) == self.parallelism and all(
            c.key_groups == self.key_groups(i) for i, c in enumerate(self.chains))

    def sources(self, key_groups: KeyGroupRange) -> list[KeyedStateChain]:
        """The chains holding the state of ``key_groups`` (several after a rescale)."""
        options = self.storage.storage_options
        return [c.chain(options) for c in self.chains if len(c.key_groups.intersection(
            key_groups))]


def _context() -> tuple[int, int]:
    context = TaskContext.get()
    return (context.partitionId(), context.attemptNumber()) if context else (0, 0)


def _handle_row(kind: str, operator_index: int, attempt: int, handle: StreamStateHandle,
                rows: int, stats: dict) -> dict:
    ref = asdict(StateHandleRef.of(handle))
    ref[_HANDLE_KIND] = ref.pop("kind")
    return {"row_kind": kind, "operator_index": operator_index, "attempt": attempt,
            "rows": rows, **stats, **ref}


def _micros(times: pa.Array) -> pa.Array:
    """A zoned timestamp column as microseconds since the epoch (Spark's ``unix_micros``)."""
    return pc.cast(pc.cast(times, pa.timestamp("us", times.type.tz)), pa.int64())


def _newer(a, b):
    """The later of two times (ints or datetimes), either of which may be None."""
    return a if b is None else b if a is None else max(a, b)


@dataclass(frozen=True)
class KeyedRangeResult:
    """What one range's task wrote for a batch (or a full snapshot): the handle of its change
    file (or snapshot), its rows, whether the local store had to be rebuilt first, and
    whether the task ran on a private copy of it (``private``: another process held the
    store's lock) and how long it waited for the lock."""

    operator_index: int
    key_groups: KeyGroupRange
    handle: StreamStateHandle
    kind: str  # "change" or "full_snapshot"
    attempt: int
    rows: int
    input_rows: int
    rebuilt: bool
    rebuild_rows: int
    rebuild_seconds: float
    state_rows: int
    output_rows: int = 0
    expired_rows: int = 0  # of state_rows, expired at the task's cutoff (not dropped yet)
    damage: str | None = None  # why the local store was unusable (damaged), naming the file
    private: bool = False
    lock_wait_seconds: float = 0.0
    fired_timers: int = 0
