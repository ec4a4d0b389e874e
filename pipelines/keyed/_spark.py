"""The Spark side of a keyed stage: what runs on the executors for one batch, and the driver's
bookkeeping of the chains (docs/design.md, "Keyed state", 7.5).

Rows reach their key group range by ``repartition(<range's route>).mapInArrow``: one call per
range and batch, whichever task or executor runs it, so correctness never depends on
placement. Each call is shipped its range's chain as of the last completed checkpoint; the
local store is a cache of that chain, and its ``version`` names the chain it holds (a digest of
the chain's handles). A store holding anything else (none, stale, another attempt's or another
executor's result) is rebuilt from the chain first, so an attempt that runs twice applies the
batch once to the state that was checkpointed. One result schema carries the output rows (Arrow
IPC bytes) and the range's change-file handle, so the stage's function runs once per range.

Only plain, picklable values travel to executors: the ``CheckpointStorage`` config, ids, the
location reference, the stage (its function pickled by cloudpickle, as Spark does) and the
chains as ``StateHandleRef`` values.
"""

import contextlib
import datetime as dt
import fcntl
import hashlib
import logging
import os
import re
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
from pyspark import StorageLevel, TaskContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

from checkpoint_storage import CheckpointStorage, FileSystemCheckpointStorage
from checkpoint_storage.spi import (
    DEFAULT_LEASE_TTL,
    ByteStreamStateHandle,
    CheckpointStorageLocationReference,
    StreamStateHandle,
    SubtaskKey,
    is_appended_segment,
)
from pipelines._handles import StateHandleRef
from pipelines.keyed._chain import (
    KeyedStateChain,
    rebuild_store,
    replay_chains,
    write_change_file,
    write_materialisation,
)
from pipelines.keyed._key_groups import (
    KeyGroupRange,
    compute_key_group_range_for_operator_index,
    hash_keys,
)
from pipelines.keyed._layout import KeyedStateLayout
from pipelines.keyed._stage import KeyedStage, TtlTimeCharacteristic
from pipelines.keyed._store import (
    ArrowKeyedStateStore,
    LocalStoreError,
    remove_store,
    stored_version,
)

__all__ = [
    "OPERATOR_INDEX",
    "ChainRef",
    "KeyedBatch",
    "KeyedRangeResult",
    "KeyedStageTask",
    "MaterialisationPolicy",
    "apply_keyed_batch",
    "chain_version",
    "extend_chains",
    "local_store_directory",
    "materialise_keyed_state",
    "ranges_to_materialise",
    "read_keyed_state",
    "rematerialise_from_local_stores",
    "DEFAULT_LOCAL_STORE_MAX_AGE",
    "sweep_idle_stores",
    "sweep_other_ranges",
]

logger = logging.getLogger(__name__)

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
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)

_OUTPUT = "output"
_CHANGE = "change"
_MATERIALISATION = "materialisation"
_SUMMARY = "summary"
_NO_LOCAL_STORE = "no_local_store"  # a range whose local store does not hold its chain
_OUTPUT_ROWS_PER_PAYLOAD = 1 << 16
_RESULT_SCHEMA = pa.schema([
    # "output" (payload), "change"/"materialisation" (handle) or "summary" (the batch's
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
    *[(f.name, t) for f, t in zip(fields(StateHandleRef), (
        pa.string(), pa.string(), pa.int64(), pa.int64(), pa.binary(), pa.string(), pa.int64(),
        pa.string(), pa.string()), strict=True)],
])
_HANDLE_KIND = "handle_kind"  # StateHandleRef.kind, renamed: "kind" would read as the row's
_RESULT_SCHEMA = _RESULT_SCHEMA.set(
    _RESULT_SCHEMA.get_field_index("kind"), pa.field(_HANDLE_KIND, pa.string()))


# --- what travels to executors --------------------------------------------------------------

@dataclass(frozen=True)
class ChainRef:
    """A ``KeyedStateChain`` as plain values (``StateHandleRef``s), to ship to executors."""

    start: int
    end: int
    materialisation: StateHandleRef | None
    changes: tuple[StateHandleRef, ...] = ()

    @classmethod
    def of(cls, chain: KeyedStateChain) -> "ChainRef":
        return cls(chain.key_groups.start, chain.key_groups.end,
                   None if chain.materialisation is None
                   else StateHandleRef.of(chain.materialisation),
                   tuple(StateHandleRef.of(h) for h in chain.changes))

    @property
    def key_groups(self) -> KeyGroupRange:
        return KeyGroupRange(self.start, self.end)

    def chain(self, storage_options: Mapping | None) -> KeyedStateChain:
        return KeyedStateChain(
            self.key_groups,
            None if self.materialisation is None else self.materialisation.handle(
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
        for handle in (ref.materialisation, *ref.changes):
            digest.update(b"|" + (b"-" if handle is None
                                  else _handle_identity(handle).encode()))
    return "chain-" + digest.hexdigest()[:32]


@dataclass(frozen=True)
class KeyedStageTask:
    """Everything an executor needs to run one batch of one keyed stage, or to materialise
    its ranges: the checkpoint to write into, the stage, the layout and the chains as of the
    last completed checkpoint.

    ``chains``: for a batch, chain ``i`` is range ``i`` of ``parallelism`` (Flink's ranges);
    for a materialisation any chains covering all key groups (e.g. another parallelism's:
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
    store (``_locked_store``); the runner passes its lease ttl."""

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


def _local_root(task: KeyedStageTask) -> Path:
    """The directory holding every job's local stores on an executor."""
    return Path(task.local_dir or tempfile.gettempdir()) / "pipelines-keyed"


def local_store_directory(task: KeyedStageTask, key_groups: KeyGroupRange) -> Path:
    """Where an executor keeps the local store of one range: per job, stage and range."""
    return (_local_root(task) / task.job_id / task.stage.name
            / f"m{task.max_parallelism}-kg{key_groups.start}-{key_groups.end}")


# --- on executors ---------------------------------------------------------------------------

class _Locked:
    """An exclusive lock on a range's store directory, so two tasks of one executor (e.g. a
    speculative attempt) never write the same store at once. A sweep unlinks the lock file
    of a store it removes, so a lock taken on a file that is no longer at its path (a waiter
    got it after the unlink) is dropped and taken again on the path's file.

    ``blocking=False`` tries once; ``timeout`` (seconds) waits at most that long (polling, as
    ``flock`` has no timeout); else it waits for as long as the holder keeps the lock.
    ``held`` says whether the lock was taken."""

    def __init__(self, directory: Path, *, blocking: bool = True,
                 timeout: float | None = None) -> None:
        self.path = directory.with_name(directory.name + ".lock")
        self._blocking = blocking
        self._timeout = timeout
        self._file = None
        self.held = False

    def _open(self):
        for _ in range(100):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                return open(self.path, "a")  # noqa: SIM115
            except FileNotFoundError:
                continue  # a sweep removed the emptied parent meanwhile: make it again
        raise LocalStoreError(f"cannot create the lock file {self.path}: its directory keeps "
                              "vanishing; is something else cleaning the local store directory?")

    def _lock(self, file, deadline: float | None) -> None:
        """Take the lock on ``file``; BlockingIOError once it cannot be had (by ``deadline``)."""
        if not self._blocking:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        if deadline is None:
            fcntl.flock(file, fcntl.LOCK_EX)
            return
        pause = 0.01
        while True:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
                time.sleep(min(pause, remaining))
                pause = min(pause * 2, 0.25)

    def __enter__(self):
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        while True:
            file = self._open()
            try:
                self._lock(file, deadline)
            except BlockingIOError:
                file.close()
                return self
            locked = os.fstat(file.fileno())
            try:
                current = os.stat(self.path)
                same = (current.st_ino, current.st_dev) == (locked.st_ino, locked.st_dev)
            except FileNotFoundError:
                same = False
            if same:
                self._file, self.held = file, True
                return self
            file.close()  # a lock on an unlinked file excludes no one: take the new one

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file, self.held = None, False


def _is_held(directory: Path) -> bool:
    """Whether a task holds the lock of the store at ``directory`` right now."""
    if not directory.with_name(directory.name + ".lock").exists():
        return False
    with _Locked(directory, blocking=False) as locked:
        return not locked.held


_STORE_DIRECTORY = re.compile(r"m\d+-kg\d+-\d+")
# A private copy of a range's store, beside it: what a task runs on when another process
# holds the store's lock for longer than the task's lock timeout (``_locked_store``).
_PRIVATE = ".private-"
_PRIVATE_DIRECTORY = re.compile(r"(m\d+-kg\d+-\d+)\.private-[0-9a-f]{32}")


DEFAULT_LOCAL_STORE_MAX_AGE = dt.timedelta(days=7)
"""How long a local store may go unwritten before a batch's task on its executor removes it."""
_SWEEP_MARKER = ".last-sweep"
_SWEEP_EVERY = dt.timedelta(hours=1)


def _remove_unheld(store: Path, still: Callable[[], bool] = lambda: True) -> bool:
    """Remove a local store no task holds (its lock free) and for which ``still()`` holds
    once its lock is taken, and its lock file; False if it is held, not a store, or no
    longer to be removed."""
    with _Locked(store, blocking=False) as locked:
        if not locked.held or not still():
            return False
        try:
            remove_store(store)
        except LocalStoreError:
            return False
        locked.path.unlink(missing_ok=True)
        return True


def sweep_other_ranges(task: KeyedStageTask) -> list[Path]:
    """Remove this stage's local stores on this executor that belong to no range of the task's
    parallelism (an earlier parallelism's, after rescaling): caches no batch will ship a chain
    for; and private copies of stores (``_locked_store``) no task holds, but a current
    range's while its store is held (the copy is then the range's state for its next task).
    A store another task holds (its lock taken) and anything that is not a store are left
    alone. Returns the directories removed."""
    wanted = {local_store_directory(task, task.key_groups(i)).name
              for i in range(task.parallelism)}
    parent = local_store_directory(task, task.key_groups(0)).parent
    try:
        entries = list(parent.iterdir())
    except FileNotFoundError:
        return []
    removed = []
    for entry in entries:
        private = _private_of(entry)
        if private is not None:
            # A wanted range's private copy stays while its store is held: it holds the
            # range's current state, for the range's next task to run on.
            entry = private
            still = ((lambda p=private: _private_abandoned(p))
                     if _private_base(private).name in wanted else (lambda: True))
        elif entry.name in wanted or not _STORE_DIRECTORY.fullmatch(entry.name):
            continue
        else:
            still = lambda: True  # noqa: E731
        try:
            if entry not in removed and _remove_unheld(entry, still):
                removed.append(entry)
        except (OSError, LocalStoreError) as exc:
            logger.warning("local keyed-state store %s not swept: %s", entry, exc)
    return removed


def _private_of(entry: Path) -> Path | None:
    """The private copy ``entry`` is, or is the lock file of (a copy whose task was killed
    before it made the directory); None for anything else."""
    name = entry.name.removesuffix(".lock")
    private = entry.with_name(name)
    if not _PRIVATE_DIRECTORY.fullmatch(name) or (private.exists() and not private.is_dir()):
        return None
    return private


def _private_base(private: Path) -> Path:
    """The store a private copy stands in for."""
    return private.with_name(private.name.split(_PRIVATE)[0])


def _private_abandoned(private: Path) -> bool:
    """Whether a private copy is no longer needed: its store's lock is free, so the range's
    next task runs on the store (and rebuilds it, as it is stale)."""
    return not _is_held(_private_base(private))


def _last_written(store: Path) -> float:
    """The newest modification time of a store's directory and files (its manifest is
    rewritten by every batch)."""
    times = [store.stat().st_mtime]
    times += [entry.stat().st_mtime for entry in store.iterdir()]
    return max(times)


def sweep_idle_stores(root: Path, max_age: dt.timedelta, *, keep: Path | None = None,
                      now: float | None = None) -> list[Path]:
    """Remove the local stores below ``root`` (``<root>/<job>/<stage>/<range>``, any job's)
    not written for ``max_age``: caches of finished jobs, or of ranges now run elsewhere,
    which a batch that needs one again rebuilds from its chain. Runs at most once an hour
    per ``root`` (a marker file's time). Private copies of stores (``_locked_store``) go
    when idle too, or as soon as no task holds them nor their store (a killed task's).
    ``keep`` (the calling task's store), a store another task holds and anything that is
    not a store are left alone; emptied job and
    stage directories go too. Housekeeping: an I/O error skips what it hit (logged), never
    fails the caller. Returns the stores removed."""
    now = time.time() if now is None else now
    marker = root / _SWEEP_MARKER
    try:
        with contextlib.suppress(FileNotFoundError):
            if 0 <= now - marker.stat().st_mtime < _SWEEP_EVERY.total_seconds():
                return []
        root.mkdir(parents=True, exist_ok=True)
        marker.touch()
        os.utime(marker, (now, now))
    except OSError as exc:
        logger.warning("local keyed-state stores below %s not swept: %s", root, exc)
        return []

    def idle(store: Path) -> bool:
        try:
            return now - _last_written(store) > max_age.total_seconds()
        except FileNotFoundError:
            return False  # removed meanwhile

    def private_done(private: Path) -> bool:
        return not private.exists() or idle(private) or _private_abandoned(private)

    removed = []
    for entry in sorted(root.glob("*/*/*")):
        private = _private_of(entry)
        if private is not None:  # a private copy (or its lock file): idle, or not needed
            store, due = private, private_done
        elif entry == keep or not _STORE_DIRECTORY.fullmatch(entry.name) or not entry.is_dir():
            continue
        else:
            store, due = entry, idle
        try:
            # Checked again under the store's lock: a task may have written it meanwhile.
            if store not in removed and due(store) and _remove_unheld(
                    store, lambda s=store, due=due: due(s)):
                removed.append(store)
        except (OSError, LocalStoreError) as exc:
            logger.warning("local keyed-state store %s not swept: %s", store, exc)
    for directory in sorted({p.parent for p in removed} | {p.parent.parent for p in removed},
                            key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            directory.rmdir()  # only if empty; a task recreates it if it needs it
    return removed


def _open_held(task: KeyedStageTask, key_groups: KeyGroupRange, directory: Path,
               version: str) -> tuple[ArrowKeyedStateStore | None, str | None]:
    """The range's local store if it holds the chain state ``version`` names (None if not),
    and why it could not be opened (None: it could, or there was none)."""
    try:
        store = ArrowKeyedStateStore(directory, task.layout, key_groups)
    except LocalStoreError as exc:
        return None, str(exc)  # damaged, unverifiable (an older format) or another stage's
    # a stale store (or a stale copy of one) holds another chain's digest
    if store.version == version:
        return store, None
    store.close()
    return None, None


def _open_current(task: KeyedStageTask, key_groups: KeyGroupRange, directory: Path,
                  stats: dict) -> ArrowKeyedStateStore:
    """The range's local store holding exactly the shipped chains' state, rebuilt if not."""
    sources = task.sources(key_groups)
    version = chain_version(key_groups, sources)
    store, damage = _open_held(task, key_groups, directory, version)
    if store is not None:
        return store
    started = time.perf_counter()
    store = rebuild_store(directory, task.layout, key_groups, sources, version)
    stats.update(rebuilt=True, rebuild_rows=store.num_rows,
                 rebuild_seconds=time.perf_counter() - started, damage=damage)
    if damage is not None:
        logger.warning("keyed stage %s, key groups %s: the local store was unusable and has "
                       "been rebuilt from the checkpoint: %s", task.stage.name, key_groups,
                       damage)
    return store


def _open_local(task: KeyedStageTask, key_groups: KeyGroupRange,
                directory: Path) -> ArrowKeyedStateStore | None:
    """The range's local store if it holds exactly the shipped chains' state; None if not
    (never rebuilt: the chains are what cannot be trusted)."""
    version = chain_version(key_groups, task.sources(key_groups))
    return _open_held(task, key_groups, directory, version)[0]


@contextlib.contextmanager
def _locked_store(task: KeyedStageTask, key_groups: KeyGroupRange, directory: Path,
                  stats: dict, *, local_only: bool = False
                  ) -> Iterator[ArrowKeyedStateStore | None]:
    """The range's local store holding exactly the shipped chains' state (``_open_current``),
    locked for the caller until the block ends, then closed.

    A task never waits for the store's lock longer than ``task.local_lock_timeout``: a
    process stopped while it holds it (e.g. a fenced writer of an earlier run, SIGSTOPped)
    must not stall the job. Once the lock is held elsewhere, the task runs on a private copy
    beside the store instead (``<store>.private-<uuid>``, locked too): an unheld one holding
    the shipped chains' state at once (one an earlier batch's task left), else, after the
    timeout, a new one rebuilt from the chains. Copies stay for the range's next task while
    the store is held, and are swept once it is free again. Correctness does not rest on the
    lock: a store or copy is used only when its ``version`` is the shipped chains'.
    ``local_only``: the store as it is (``_open_local``), None if it does not hold the chains'
    state: never rebuilt from them."""
    version = chain_version(key_groups, task.sources(key_groups))
    with contextlib.ExitStack() as held:
        where = _lock_for(task, directory, version, stats, held)
        store = (_open_local(task, key_groups, where) if local_only
                 else _open_current(task, key_groups, where, stats))
        if store is not None:
            held.callback(store.close)
        yield store


def _lock_for(task: KeyedStageTask, directory: Path, version: str, stats: dict,
              held: contextlib.ExitStack) -> Path:
    """Lock the range's store, or a private copy of it (see ``_locked_store``), on ``held``;
    returns the directory locked."""
    if held.enter_context(_Locked(directory, blocking=False)).held:
        return directory
    try:
        copies = sorted(p for p in directory.parent.iterdir()
                        if p.name.startswith(directory.name + _PRIVATE)
                        and _PRIVATE_DIRECTORY.fullmatch(p.name) and p.is_dir())
    except FileNotFoundError:
        copies = []
    for copy in copies:
        with contextlib.ExitStack() as attempt:
            if not attempt.enter_context(_Locked(copy, blocking=False)).held:
                continue  # another task runs on it
            if copy.is_dir() and stored_version(copy) == version:
                held.enter_context(attempt.pop_all())
                stats["private"] = True
                return copy
        with contextlib.suppress(OSError, LocalStoreError):
            _remove_unheld(copy)  # a stale copy: no chain will match it again
    timeout = task.local_lock_timeout.total_seconds()
    started = time.monotonic()
    locked = held.enter_context(_Locked(directory, timeout=timeout))
    stats["lock_wait_seconds"] = time.monotonic() - started
    if locked.held:
        return directory
    copy = directory.with_name(f"{directory.name}{_PRIVATE}{uuid.uuid4().hex}")
    if not held.enter_context(_Locked(copy, blocking=False)).held:
        raise LocalStoreError(f"the new private store {copy} is locked already; is something "
                              "else writing the local store directory?")
    logger.warning("local keyed-state store %s: locked by another process for more than "
                   "%.1f s (a stalled task?); this task rebuilds the range in %s", directory,
                   timeout, copy.name)
    stats["private"] = True
    return copy


def _change_file_storage(storage: CheckpointStorage,
                         chain: KeyedStateChain) -> CheckpointStorage:
    """The storage a range's next change file is written through. An inline change file is
    repeated in every ``_metadata`` until its chain is materialised, so the inline change
    files of a chain share one inline threshold: past it, change files go to files."""
    if not isinstance(storage, FileSystemCheckpointStorage):
        return storage
    inline = sum(h.state_size for h in chain.changes if isinstance(h, ByteStreamStateHandle))
    return storage.with_file_state_size_threshold(
        max(0, storage.file_state_size_threshold - inline))


def _file_prefix(task: KeyedStageTask, key_groups: KeyGroupRange, kind: str,
                 attempt: int) -> str:
    """``<stage>-kg<start>-<end>-<kind><batch>-a<attempt>-``, the stage name shortened so
    that the prefix fits the 64 characters a stream's name prefix may have."""
    tail = f"-kg{key_groups.start}-{key_groups.end}-{kind}{task.batch}-a{attempt}-"
    return task.stage.name[:64 - len(tail)] + tail


def _context() -> tuple[int, int]:
    context = TaskContext.get()
    return (context.partitionId(), context.attemptNumber()) if context else (0, 0)


def _handle_row(kind: str, operator_index: int, attempt: int, handle: StreamStateHandle,
                rows: int, stats: dict) -> dict:
    ref = asdict(StateHandleRef.of(handle))
    ref[_HANDLE_KIND] = ref.pop("kind")
    return {"row_kind": kind, "operator_index": operator_index, "attempt": attempt,
            "rows": rows, **stats, **ref}


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


def _routed_schema(input: pa.Schema) -> pa.Schema:
    """The routed rows: the input's columns, nullable (a summary row has no values), and the
    routing columns."""
    return pa.schema([*(f.with_nullable(True) for f in input), *_ROUTING_FIELDS])


def _operator_indices(task: KeyedStageTask, routes: tuple[int, ...], input: pa.Schema,
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


def _operator_indices_of(task: KeyedStageTask, table: pa.Table) -> np.ndarray:
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


def _micros(times: pa.Array) -> pa.Array:
    """A zoned timestamp column as microseconds since the epoch (Spark's ``unix_micros``)."""
    return pc.cast(pc.cast(times, pa.timestamp("us", times.type.tz)), pa.int64())


def _newer(a, b):
    """The later of two times (ints or datetimes), either of which may be None."""
    return a if b is None else b if a is None else max(a, b)


def _run_partition(task: KeyedStageTask,
                   batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body after routing: the routing tasks' summaries and the rows of one
    range (or none). Advances the clock by the batch's newest event time, drops rows behind
    it minus the ``ttl``, runs the range if rows are left, and reports the batch as this
    task saw it (a summary row): every range's task sees the same summaries."""
    batches = [b for b in batches if b.num_rows]
    if not batches:
        return  # no routing task ran: the input had no partitions
    table = pa.Table.from_batches(batches)
    summary = pc.equal(table.column(OPERATOR_INDEX), _SUMMARY_INDEX)
    summaries, table = table.filter(summary), table.filter(pc.invert(summary))
    newest = pc.max(summaries.column(_NEWEST)).as_py()
    partition, attempt = _context()
    yield pa.RecordBatch.from_pylist([{
        "row_kind": _SUMMARY, "operator_index": partition, "attempt": attempt,
        "input_rows": pc.sum(summaries.column(_ROWS)).as_py(), "newest": newest}],
        schema=_RESULT_SCHEMA)
    stage = task.stage
    if stage.event_time is not None:
        clock = task.clock if newest is None else _newer(
            task.clock, _EPOCH + dt.timedelta(microseconds=newest))
        if stage.ttl is not None and clock is not None:
            late = (stage.ttl.cutoff(clock) - _EPOCH) // dt.timedelta(microseconds=1)
            table = table.filter(pc.greater_equal(_micros(table.column(stage.event_time)),
                                                  late))
            if stage.ttl.time_characteristic is TtlTimeCharacteristic.EVENT_TIME:
                task = replace(task, now=clock)
    if not table.num_rows:
        return
    if any(table.column(name).null_count for name in stage.key):
        hash_keys(table.select(list(stage.key)), stage.key)  # says: keys must not be null
    indices = pc.unique(table.column(OPERATOR_INDEX))
    if len(indices) != 1:
        raise RuntimeError(f"keyed stage {task.stage.name}: rows of ranges "
                           f"{indices.to_pylist()} reached one task; routing is broken")
    yield from _run_range(task, (indices[0],),
                          table.drop_columns([_ROUTE, _ROWS, _NEWEST])).to_batches()


def _run_range(task: KeyedStageTask, group_key: tuple, table: pa.Table) -> pa.Table:
    """The work of one range and batch: bring the local store to the shipped
    chain, run the stage, write the change file, apply the changes to the store; return the
    output rows (IPC payloads) and one handle row."""
    operator_index = group_key[0].as_py()
    key_groups = task.key_groups(operator_index)
    layout, stage = task.layout, task.stage
    _, attempt = _context()
    stats = {"rebuilt": False, "rebuild_rows": 0, "rebuild_seconds": 0.0,
             "private": False, "lock_wait_seconds": 0.0, "input_rows": table.num_rows}
    table = table.drop_columns([OPERATOR_INDEX])
    directory = local_store_directory(task, key_groups)
    cutoff = None if stage.ttl is None else stage.ttl.cutoff(task.now)
    sweep_other_ranges(task)
    if task.local_max_age is not None:
        sweep_idle_stores(_local_root(task), task.local_max_age, keep=directory)
    with _locked_store(task, key_groups, directory, stats) as store:
        state = store.get(table.select(list(stage.key)), cutoff=cutoff)
        if layout.processing_time_ttl:
            state = state.drop_columns(["_written_at"])
        result = stage.run(table, state)
        upserts = layout.stamp(result.upserts, task.now) if task.now else result.upserts
        (chain,) = task.sources(key_groups)
        access = _change_file_storage(task.storage, chain).create_checkpoint_storage(
            task.job_id)
        # file merging across checkpoints: this range's change files go, one after the
        # other, into the physical file of its last appended one (checkpoint_storage's
        # _appending.py); None: a new chain, or the chain of another parallelism
        previous = next((h for h in reversed(chain.changes) if is_appended_segment(h)),
                        None) if chain.key_groups == key_groups else None
        access = access.to_appending_storage(
            SubtaskKey(access.job_id.hex, stage.name, operator_index, task.parallelism),
            previous)
        factory = access.resolve_checkpoint_storage_location(task.checkpoint_id,
                                                             task.reference)
        change = write_change_file(factory, layout, key_groups, upserts, result.deletes,
                                   _file_prefix(task, key_groups, "b", attempt))
        store.apply(upserts, result.deletes,
                    version=chain_version(key_groups, [chain.appended(change)]))
        stats["state_rows"] = store.num_rows
        # at this batch's cutoff, while the store is open: one vectorised comparison
        stats["expired_rows"] = 0 if cutoff is None else store.expired_rows(cutoff)
    if task.after_write is not None:
        task.after_write(operator_index, attempt)
    output = _conform_output(result.output, task)
    stats["output_rows"] = output.num_rows
    rows = [_handle_row(_CHANGE, operator_index, attempt, change,
                        upserts.num_rows + result.deletes.num_rows, stats)]
    for batch in output.to_batches(max_chunksize=_OUTPUT_ROWS_PER_PAYLOAD):
        sink = pa.BufferOutputStream()
        with ipc.new_stream(sink, output.schema) as writer:
            writer.write_batch(batch)
        rows.append({"row_kind": _OUTPUT, "operator_index": operator_index,
                     "attempt": attempt, "payload": sink.getvalue().to_pybytes()})
    return pa.Table.from_pylist(rows, schema=_RESULT_SCHEMA)


def _spark_arrow_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` as Spark hands it back (timestamps in UTC), so decoded rows fit exactly."""
    return to_arrow_schema(from_arrow_schema(schema, prefer_timestamp_ntz=False),
                           timezone="UTC")


def _conform_output(output: pa.Table, task: KeyedStageTask) -> pa.Table:
    target = _spark_arrow_schema(task.output_schema)
    missing = [n for n in target.names if n not in output.column_names]
    if missing:
        raise ValueError(f"keyed stage {task.stage.name}: output lacks column(s) {missing}; "
                         f"the task's output_schema is {task.output_schema.names}")
    try:
        return output.select(target.names).cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
        raise ValueError(f"keyed stage {task.stage.name}: output does not fit the output "
                         f"schema {task.output_schema}: {exc}") from exc


def _decode_output(schema: pa.Schema,
                   batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: the output rows of the payloads."""
    for batch in batches:
        for payload in batch.column("payload").to_pylist():
            for rows in ipc.open_stream(pa.py_buffer(payload)):
                yield rows if rows.schema == schema else rows.cast(schema)


# --- on the driver --------------------------------------------------------------------------

@dataclass(frozen=True)
class KeyedRangeResult:
    """What one range's task wrote for a batch (or a materialisation): the handle of its change
    file (or snapshot), its rows, whether the local store had to be rebuilt first, and
    whether the task ran on a private copy of it (``private``: another process held the
    store's lock) and how long it waited for the lock."""

    operator_index: int
    key_groups: KeyGroupRange
    handle: StreamStateHandle
    kind: str  # "change" or "materialisation"
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


@dataclass(frozen=True)
class KeyedBatch:
    """The result of ``apply_keyed_batch``: the output rows (in the stage's output schema,
    read from ``cached``), the ranges' results, the persisted pass both come from, the input
    rows the batch had (late rows included) and their newest event time (a stage with
    ``event_time``; None: no event time). Call ``release()`` once the output is consumed."""

    output: DataFrame
    ranges: list[KeyedRangeResult]
    cached: DataFrame = field(repr=False)
    input_rows: int = 0
    newest: dt.datetime | None = None

    @property
    def output_rows(self) -> int:
        return sum(r.output_rows for r in self.ranges)

    def release(self) -> None:
        self.cached.unpersist()


def _summary(task: KeyedStageTask, rows) -> tuple[int, dt.datetime | None]:
    """The batch's input rows and newest event time from the ranges' summary rows, which
    must agree: each range's task received every routing task's summary."""
    seen = {(row["input_rows"], row["newest"]) for row in rows if row["row_kind"] == _SUMMARY}
    if len(seen) > 1:
        raise RuntimeError(f"keyed stage {task.stage.name}: the ranges saw different input "
                           f"(rows, newest event time: {sorted(seen, key=str)}): the batch "
                           "changed between task attempts; the source must be replayable "
                           "(read the same rows again when a task is retried)")
    count, newest = seen.pop() if seen else (0, None)
    return count, None if newest is None else _EPOCH + dt.timedelta(microseconds=newest)


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
            row["damage"], bool(row["private"]), row["lock_wait_seconds"] or 0.0)
    return [results[i] for i in sorted(results)]


def apply_keyed_batch(input: DataFrame, task: KeyedStageTask) -> KeyedBatch:
    """Run one batch of a keyed stage: route rows to their range by key group, run the stage
    once per range that has rows (after late rows are dropped; one Spark task per range),
    write each range's change file; returns the output and one ``KeyedRangeResult`` per range
    that ran.
    A stage with ``event_time``: each range's task advances ``task.clock`` by the batch's
    newest event time (the routing tasks send it along with the rows: no Spark job of its
    own), drops rows behind the clock minus the ``ttl`` and, with event-time expiry, expires
    state at it.
    ``task.chains`` must be range ``i`` of ``task.parallelism`` each: after a change of
    parallelism, ``materialise_keyed_state`` the new ranges first."""
    if not task.is_aligned():
        raise ValueError(f"keyed stage {task.stage.name}: the chains are not the ranges of "
                         f"parallelism {task.parallelism} (rescaled?); materialise the new "
                         "ranges with materialise_keyed_state first")
    missing = [k for k in task.stage.key if k not in input.columns]
    reserved = [f.name for f in _ROUTING_FIELDS]
    if missing or set(reserved) & set(input.columns):
        raise ValueError(f"keyed stage {task.stage.name}: the input needs the key column(s) "
                         f"{list(task.stage.key)} and none of the columns {reserved} (they "
                         f"route rows; rename them); it has {input.columns}")
    event_time = task.stage.event_time
    if event_time is not None and not isinstance(
            input.schema[event_time].dataType if event_time in input.columns else None,
            T.TimestampType):
        raise ValueError(f"keyed stage {task.stage.name}: event_time column {event_time!r} "
                         f"must be a TIMESTAMP column of its input (cast a date or "
                         f"TIMESTAMP_NTZ column first); the input is "
                         f"{input.schema.simpleString()}")
    input_schema = to_arrow_schema(input.schema, timezone=input.sparkSession.conf.get(
        "spark.sql.session.timeZone"))
    # Here, before the batch's Spark job: a key of another type would fail in every range's
    # task, or worse, be cast into another key.
    task.stage.check_key_types(input_schema, "the input's")
    routed_type = T.StructType([
        *(T.StructField(f.name, f.dataType, True, f.metadata) for f in input.schema.fields),
        *from_arrow_schema(pa.schema(_ROUTING_FIELDS)).fields])
    routes = _routes(task.parallelism)
    routed = input.mapInArrow(partial(_operator_indices, task, routes, input_schema),
                              routed_type)
    # One Spark task per range: repartition(n, column) is never coalesced by adaptive
    # execution, and each range's route hashes to its own partition.
    cached = routed.repartition(task.parallelism, _ROUTE).mapInArrow(
        partial(_run_partition, task), from_arrow_schema(_RESULT_SCHEMA)
    ).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        handles = cached.filter(F.col("row_kind") != _OUTPUT).drop("payload").collect()
    except BaseException:
        cached.unpersist()
        raise
    target = _spark_arrow_schema(task.output_schema)
    output = cached.filter(F.col("row_kind") == _OUTPUT).select("payload").mapInArrow(
        partial(_decode_output, target), from_arrow_schema(target, prefer_timestamp_ntz=False))
    return KeyedBatch(output, _results(task, handles), cached, *_summary(task, handles))


def extend_chains(chains: Sequence[KeyedStateChain],
                  results: Sequence[KeyedRangeResult]) -> list[KeyedStateChain]:
    """The chains after a batch: each range with a change file gets it appended, a
    materialised range restarts from its snapshot; ranges without rows stay as they were."""
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
class MaterialisationPolicy:
    """When a range's chain is replaced by a snapshot (Flink's periodic materialisation):
    when the change files since its base outgrow ``ratio`` times the base (at least
    ``min_bytes``, so that small states do not snapshot at every checkpoint), or after
    ``every`` change files if set. The base is the chain's snapshot, or, for a chain that
    started empty, its first change file (which then holds the whole range).

    Bytes written per batch are then about the change files' times ``1 + 1/ratio``, whatever
    the state's size; a restore without local stores replays at most ``1 + ratio`` times the
    snapshot's bytes."""

    every: int | None = None
    ratio: float = 1.0
    min_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if (self.every is not None and self.every < 1) or self.ratio <= 0 or self.min_bytes < 0:
            raise ValueError(f"MaterialisationPolicy: every >= 1 (or None), ratio > 0 and "
                             f"min_bytes >= 0, got {self}")

    def due(self, chain: KeyedStateChain) -> bool:
        if not chain.changes:
            return False
        if self.every is not None and len(chain.changes) >= self.every:
            return True
        if chain.materialisation is None:
            base, since = chain.changes[0].state_size, chain.changes[1:]
        else:
            base, since = chain.materialisation.state_size, chain.changes
        changed = sum(h.state_size for h in since)
        return changed > self.ratio * max(base, self.min_bytes)


def ranges_to_materialise(chains: Sequence[KeyedStateChain],
                          policy: MaterialisationPolicy) -> list[int]:
    """The operator indices whose chains the policy says to materialise now."""
    return [i for i, chain in enumerate(chains) if policy.due(chain)]


def _unexpired(batches: Iterator[pa.RecordBatch], layout: KeyedStateLayout,
               cutoff: dt.datetime | None, counted: list[int]) -> Iterator[pa.RecordBatch]:
    """``batches`` without the rows expired at ``cutoff`` (None: all), counting the rows."""
    for batch in batches:
        if cutoff is not None:
            batch = layout.ttl.live(batch, cutoff)
        counted[0] += batch.num_rows
        yield batch


def _materialise_ranges(task: KeyedStageTask, adopt: bool, local_only: bool,
                        batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: for each operator index, bring the local store to the shipped
    chains (rebuilding it from them, e.g. another parallelism's) and write a sorted snapshot
    without expired rows. ``adopt``: the snapshot starts the range's new chain, so the store
    drops the expired rows and is marked as holding it; otherwise (a savepoint) the store is
    left as it is. ``local_only``: only from a local store that holds the chains already (a
    range without one is reported in a ``_NO_LOCAL_STORE`` row, nothing written)."""
    _, attempt = _context()
    layout = task.layout
    cutoff = None if layout.ttl is None else layout.ttl.cutoff(task.now)
    for batch in batches:
        for operator_index in batch.column(OPERATOR_INDEX).to_pylist():
            key_groups = task.key_groups(operator_index)
            directory = local_store_directory(task, key_groups)
            stats = {"rebuilt": False, "rebuild_rows": 0, "rebuild_seconds": 0.0,
                     "private": False, "lock_wait_seconds": 0.0, "input_rows": 0}
            with _locked_store(task, key_groups, directory, stats,
                               local_only=local_only) as store:
                if store is None:
                    yield pa.RecordBatch.from_pylist([{
                        "row_kind": _NO_LOCAL_STORE, "operator_index": operator_index,
                        "attempt": attempt}], schema=_RESULT_SCHEMA)
                    continue
                if adopt and cutoff is not None:
                    store.drop_expired(cutoff)
                access = task.storage.create_checkpoint_storage(task.job_id)
                factory = access.resolve_checkpoint_storage_location(task.checkpoint_id,
                                                                     task.reference)
                written = [0]
                handle = write_materialisation(
                    factory, layout, key_groups,
                    _unexpired(store.sorted_batches(), layout, cutoff, written),
                    _file_prefix(task, key_groups, "m", attempt))
                if adopt:
                    store.apply(layout.stored_schema.empty_table(),
                                layout.key_schema.empty_table(),
                                version=chain_version(key_groups,
                                                      [KeyedStateChain(key_groups, handle)]))
            if task.after_write is not None:
                task.after_write(operator_index, attempt)
            stats["state_rows"] = written[0]
            stats["expired_rows"] = 0  # the snapshot leaves expired rows out
            row = _handle_row(_MATERIALISATION, operator_index, attempt, handle, written[0],
                              stats)
            yield pa.RecordBatch.from_pylist([row], schema=_RESULT_SCHEMA)


def _operator_index_frame(spark: SparkSession, task: KeyedStageTask,
                          operator_indices: Sequence[int] | None) -> DataFrame | None:
    """One row per operator index, one Spark partition each (None: no indices)."""
    indices = list(range(task.parallelism)) if operator_indices is None else list(
        operator_indices)
    if not indices:
        return None
    for index in indices:
        task.key_groups(index)  # checks the index
    # One row per slice: one Spark task per range, no shuffle.
    rows = spark.sparkContext.parallelize([(i,) for i in indices], len(indices))
    return spark.createDataFrame(rows, f"{OPERATOR_INDEX} int")


def materialise_keyed_state(spark: SparkSession, task: KeyedStageTask,
                            operator_indices: Sequence[int] | None = None, *,
                            adopt: bool = True) -> list[KeyedRangeResult]:
    """Write a snapshot of each range in ``operator_indices`` (all ranges if None) of
    ``task.parallelism``, one Spark task per range, expired rows left out. With ``adopt``
    (periodic materialisation) ``extend_chains`` with the results resets their chains, and the
    local stores hold the new chains; with ``task.chains`` of another parallelism this is
    rescaling: every new range is rebuilt from the chains it overlaps. Without ``adopt`` (a
    savepoint's full snapshot, written into ``task.reference``'s location) the stores and
    chains are untouched."""
    frame = _operator_index_frame(spark, task, operator_indices)
    if frame is None:
        return []
    rows = frame.mapInArrow(partial(_materialise_ranges, task, adopt, False),
                            from_arrow_schema(_RESULT_SCHEMA)).collect()
    return _results(task, rows)


def rematerialise_from_local_stores(spark: SparkSession, task: KeyedStageTask,
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
    rows = frame.mapInArrow(partial(_materialise_ranges, task, True, True),
                            from_arrow_schema(_RESULT_SCHEMA)).collect()
    missing = sorted({row["operator_index"] for row in rows if row["row_kind"] == _NO_LOCAL_STORE})
    return _results(task, [r for r in rows if r["row_kind"] != _NO_LOCAL_STORE]), missing


def _replay_ranges(task: KeyedStageTask, include_expired: bool,
                   batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: each operator index's state rows (the state schema's columns),
    replayed from the shipped chains; the local stores are not touched."""
    layout = task.layout
    target = _spark_arrow_schema(task.stage.state_schema)
    cutoff = None if layout.ttl is None or include_expired else layout.ttl.cutoff(task.now)
    for batch in batches:
        for operator_index in batch.column(OPERATOR_INDEX).to_pylist():
            key_groups = task.key_groups(operator_index)
            state = replay_chains(task.sources(key_groups), layout, key_groups)
            if cutoff is not None:
                state = layout.ttl.live(state, cutoff)
            state = state.select(target.names).cast(target)
            yield from state.to_batches(max_chunksize=_OUTPUT_ROWS_PER_PAYLOAD)


def read_keyed_state(spark: SparkSession, task: KeyedStageTask, *,
                     include_expired: bool = False) -> DataFrame:
    """The state of every range of ``task.parallelism`` as a DataFrame of the stage's state
    schema, replayed from ``task.chains`` on the executors (one task per range). Rows expired
    at ``task.now`` are left out, as a stage never sees them, unless ``include_expired`` (the
    rows a checkpoint holds until the next materialisation drops them, which its recorded
    row counts include)."""
    frame = _operator_index_frame(spark, task, None)
    target = _spark_arrow_schema(task.stage.state_schema)
    return frame.mapInArrow(partial(_replay_ranges, task, include_expired),
                            from_arrow_schema(target, prefer_timestamp_ntz=False))
