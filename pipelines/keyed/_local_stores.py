"""The local stores of a keyed stage on an executor: where they live, their locks, the private
copies a task runs on when a store's lock is held elsewhere, and the sweeps that remove stores
no batch needs (docs/design.md, "Keyed state", 7.5).

A local store is a cache of its range's chain as of the last completed checkpoint; its
``version`` names the chain it holds (``chain_version``). A store holding anything else (none,
stale, another attempt's or another executor's result) is rebuilt from the chain first, so an
attempt that runs twice applies the batch once to the state that was checkpointed.
"""

import contextlib
import datetime as dt
import fcntl
import logging
import os
import re
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

from pipelines.keyed._chain import KeyedStateChain
from pipelines.keyed._key_groups import (
    KeyGroupRange,
)
from pipelines.keyed._layout import KeyedStateLayout
from pipelines.keyed._rebuild import rebuild_store
from pipelines.keyed._store import ArrowKeyedStateStore
from pipelines.keyed._store_directory import LocalStoreError, remove_store, stored_version
from pipelines.keyed._task import (
    KeyedStageTask,
    chain_version,
)

__all__ = [
    "DEFAULT_LOCAL_STORE_MAX_AGE",
    "local_store_directory",
    "prebuild_local_store",
    "store_directory",
    "sweep_idle_stores",
    "sweep_other_ranges",
]


logger = logging.getLogger(__name__)


def _local_root(local_dir: str | None) -> Path:
    """The directory holding every job's local stores on an executor (``local_dir``: the
    task's ``local_dir``)."""
    return Path(local_dir or tempfile.gettempdir()) / "pipelines-keyed"


def local_store_directory(task: KeyedStageTask, key_groups: KeyGroupRange) -> Path:
    """Where an executor keeps the local store of one range: per job, stage and range."""
    return store_directory(task.local_dir, task.job_id, task.stage.name, task.max_parallelism,
                           key_groups)


def store_directory(local_dir: str | None, job_id: str, stage: str, max_parallelism: int,
                    key_groups: KeyGroupRange) -> Path:
    """``local_store_directory`` without a task: the store a task of ``job_id`` (hex) with
    these settings opens on a machine whose executors use ``local_dir``."""
    return (_local_root(local_dir) / job_id / stage
            / f"m{max_parallelism}-kg{key_groups.start}-{key_groups.end}")


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
        _OPEN_STORES.discard(store)
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


def prebuild_local_store(directory: Path, layout: KeyedStateLayout, key_groups: KeyGroupRange,
                         chains: list[KeyedStateChain], version: str) -> str:
    """Bring the local store at ``directory`` to the state of ``chains`` (``version``: their
    ``chain_version``) ahead of the task that will need it, as the task would
    (``rebuild_store``), under the store's lock. Returns what it did: ``"present"`` (the
    store holds ``version`` already), ``"built"``, or ``"busy"`` (a task holds the lock: the
    task brings the store to its chains itself). A failure to read the chains raises before
    the store is touched. A store is used only when its ``version`` is the task's chains', so
    a build for another checkpoint, or one cut short (the manifest naming ``version`` is
    written last), is rebuilt by the task, never used."""
    with _Locked(directory, blocking=False) as locked:
        if not locked.held:
            return "busy"
        if stored_version(directory) == version:  # a hint: the task verifies the store
            return "present"
        rebuild_store(directory, layout, key_groups, chains, version).close()
        return "built"


OPEN_STORE_BYTES = 32 << 20
"""The file bytes of the local stores a Python worker keeps open between tasks."""


class _OpenStores:
    """The local stores this process keeps open between its tasks (Spark reuses Python
    workers), least recently used first, at most ``OPEN_STORE_BYTES`` of files: opening a
    store reads and checks its manifest and parses each of its files, about as long as a
    small batch's stage takes. A kept store serves a task only while ``unchanged()`` (no
    other process wrote it since: a few stat calls) and, as any store, only when its
    ``version`` is the shipped chain's. Bounded because a kept store's memory maps count in
    the worker's resident memory; a larger store is opened at each task, as before."""

    def __init__(self) -> None:
        self._stores: OrderedDict[Path, ArrowKeyedStateStore] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, directory: Path, task: KeyedStageTask,
             key_groups: KeyGroupRange) -> ArrowKeyedStateStore | None:
        with self._lock:
            store = self._stores.pop(directory, None)
        if store is None:
            return None
        if store.layout == task.layout and store.key_groups == key_groups and store.unchanged():
            return store
        store.close()
        return None

    def keep(self, store: ArrowKeyedStateStore) -> None:
        closing = []
        with self._lock:
            self._stores[store.directory] = store
            total = sum(s.file_bytes for s in self._stores.values())
            while total > OPEN_STORE_BYTES and self._stores:
                _, evicted = self._stores.popitem(last=False)
                total -= evicted.file_bytes
                closing.append(evicted)
        for evicted in closing:
            evicted.close()

    def discard(self, directory: Path) -> None:
        with self._lock:
            store = self._stores.pop(directory, None)
        if store is not None:
            store.close()

    def clear(self) -> None:
        with self._lock:
            stores, self._stores = list(self._stores.values()), OrderedDict()
        for store in stores:
            store.close()


_OPEN_STORES = _OpenStores()


def forget_open_stores() -> None:
    """Close the local stores this process keeps open, so that the next task opens its store
    from disk, as the first task in a new Python worker does (tests, benchmarks)."""
    _OPEN_STORES.clear()


def _open_held(task: KeyedStageTask, key_groups: KeyGroupRange, directory: Path,
               version: str) -> tuple[ArrowKeyedStateStore | None, str | None]:
    """The range's local store if it holds the chain state ``version`` names (None if not),
    and why it could not be opened (None: it could, or there was none): the one this process
    kept open if it is unchanged on disk, else opened (and verified) from disk."""
    store = _OPEN_STORES.take(directory, task, key_groups)
    try:
        if store is None:
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
            held.push(partial(_release, store))
        yield store


def _release(store: ArrowKeyedStateStore, failed, *_) -> None:
    """At the end of a task's use of ``store``, under its lock: kept open for the process's
    next task, or closed if the task failed (its state in memory may be ahead of the disk's)."""
    if failed is None:
        _OPEN_STORES.keep(store)
    else:
        store.close()


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
