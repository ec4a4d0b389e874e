"""The job lease: one coordinator per job directory (docs/design.md §3.3, "one writer per job").

Layout::

    <job dir>/_lease/epoch-<n>     n: 20 decimal digits, so names sort like numbers

Each ``epoch-<n>`` object is a small JSON record (plain data only): format, epoch, owner, token,
acquired_at, renewed_at (epoch seconds, the holder's clock), ttl_seconds, released,
broken_by. The lease is the record with the highest epoch:

- **acquire**: list ``_lease/``; if the highest record is held (not released, not expired:
  ``now <= renewed_at + ttl_seconds``) fail with ``JobLeaseHeldError`` naming the holder, or
  poll until ``wait`` seconds passed; else publish ``epoch-<n+1>`` with the library's
  put-if-absent (conditional PUT on S3, ``os.link`` on local disk). Two coordinators that race
  for ``n+1`` get one winner; the other sees a held lease. Epochs only grow: the highest
  record is never deleted (older ones are pruned, the previous one kept for ``lease show``).
- **renew**: the holder overwrites its own record with a new ``renewed_at`` (atomic: a PUT on
  object stores, a temp file and ``os.replace`` on local disk), after checking that no newer
  epoch exists. A daemon thread renews every ``ttl / 3`` (``auto_renew=True``, the default);
  ``renew()`` renews by hand.
- **valid**: held, not released, no newer epoch seen, and the last renewal started less than
  ``ttl`` ago by the holder's monotonic clock (so it ends no later than other coordinators,
  reading ``renewed_at``, may take over, as long as clocks agree to within the margin that
  ``ttl`` leaves; ``ttl`` should exceed the worst clock skew by far).
- **check** (fencing): right before the conditional PUT of `_metadata`, the location lists
  ``_lease/`` once and raises ``JobLeaseLostError`` when a newer epoch exists or the lease is
  no longer valid. The epoch is recorded in every `_metadata` published under the lease.
- **release**: the holder marks its record released; the next coordinator takes over at once.
- **break** (``checkpoints lease break``): publishes ``epoch-<n+1>`` as a released tombstone,
  which fences the old holder; a lease that is still held is only broken with ``force``.
- **abandoned** (``abandoned_by_writer``): a ``chk-<id>`` without `_metadata` can only still
  be completed by the lease's current holder, so it is abandoned when the lease is released
  or expired, or when it was last modified more than a ttl (the clock skew the lease allows)
  before the holder acquired it: a coordinator never continues an earlier one's checkpoint.

A record that cannot be read counts as held (fail closed) until it is broken.
"""

import contextlib
import json
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, replace
from datetime import timedelta

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from checkpoint_storage._filesystems import _CONTROL_CHARS, join, put_if_absent, to_url
from checkpoint_storage.exceptions import (
    CheckpointAlreadyExistsError,
    JobLeaseError,
    JobLeaseHeldError,
    JobLeaseLostError,
)

__all__ = [
    "DEFAULT_LEASE_TTL",
    "JobLease",
    "LeaseRecord",
    "abandoned_by_writer",
    "acquire_job_lease",
    "break_job_lease",
    "default_lease_owner",
    "read_job_lease",
]

logger = logging.getLogger("checkpoint_storage")

LEASE_DIRECTORY = "_lease"
DEFAULT_LEASE_TTL = timedelta(seconds=60)
"""How long a job lease lives without renewal; the holder renews it every ``ttl / 3``."""
MIN_LEASE_TTL = timedelta(milliseconds=100)
RECORD_FORMAT = "checkpoint-storage-job-lease/1"
MAX_RECORD_SIZE = 64 * 1024
MAX_OWNER_LENGTH = 256
_EPOCH_NAME = re.compile(r"epoch-([0-9]{20})")
_KEEP_EPOCHS = 2


def default_lease_owner() -> str:
    """``<host>:<pid>``: who a lease belongs to when no owner is given."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _epoch_name(epoch: int) -> str:
    return f"epoch-{epoch:020d}"


@dataclass(frozen=True)
class LeaseRecord:
    """One ``_lease/epoch-<n>`` record. ``unreadable`` says why a record could not be parsed
    (it then counts as held until broken)."""

    epoch: int
    owner: str
    token: str
    acquired_at: float
    renewed_at: float
    ttl_seconds: float
    released: bool = False
    broken_by: str | None = None
    unreadable: str | None = None

    @property
    def expires_at(self) -> float:
        return self.renewed_at + self.ttl_seconds

    def state(self, now: float | None = None) -> str:
        """``"held"``, ``"expired"``, ``"released"`` (also: broken) or ``"unreadable"``."""
        if self.unreadable is not None:
            return "unreadable"
        if self.released:
            return "released"
        return "expired" if (time.time() if now is None else now) > self.expires_at else "held"

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": RECORD_FORMAT,
                "epoch": self.epoch,
                "owner": self.owner,
                "token": self.token,
                "acquired_at": self.acquired_at,
                "renewed_at": self.renewed_at,
                "ttl_seconds": self.ttl_seconds,
                "released": self.released,
                "broken_by": self.broken_by,
            },
            sort_keys=True,
        ).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, epoch: int) -> "LeaseRecord":
        """Parse a record; any problem gives a record marked ``unreadable``."""
        try:
            if len(data) > MAX_RECORD_SIZE:
                raise ValueError(f"{len(data)} bytes")
            raw = json.loads(data.decode("utf-8"))
            if not isinstance(raw, dict) or raw.get("format") != RECORD_FORMAT:
                raise ValueError("not a job lease record of this library")
            record = cls(
                epoch=_int(raw["epoch"]),
                owner=_text(raw["owner"]),
                token=_text(raw["token"]),
                acquired_at=_number(raw["acquired_at"]),
                renewed_at=_number(raw["renewed_at"]),
                ttl_seconds=_number(raw["ttl_seconds"]),
                released=_bool(raw["released"]),
                broken_by=None if raw.get("broken_by") is None else _text(raw["broken_by"]),
            )
            if record.epoch != epoch:
                raise ValueError(f"records epoch {record.epoch} in the object of epoch {epoch}")
            return record
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            return cls(epoch, "<unreadable>", "", 0.0, math.inf, 0.0, unreadable=str(exc))

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        state = self.state(now)
        if state == "unreadable":
            return f"epoch {self.epoch}: unreadable record ({self.unreadable})"
        if self.broken_by is not None:
            return f"epoch {self.epoch}: broken by {self.broken_by}"
        text = f"epoch {self.epoch} held by {self.owner!r}"
        if state == "released":
            return text + ", released"
        delta = self.expires_at - now
        if state == "expired":
            return text + f", expired {-delta:.1f} s ago"
        return text + f", expires in {delta:.1f} s unless renewed"


def _int(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**63:
        raise ValueError(f"bad epoch {value!r}")
    return value


def _number(value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"bad number {value!r}")
    return float(value)


def _bool(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"bad flag {value!r}")
    return value


def _text(value) -> str:
    if not isinstance(value, str) or len(value) > MAX_OWNER_LENGTH or _CONTROL_CHARS.search(value):
        raise ValueError(f"bad text {value!r}")
    return value


def _ttl_seconds(ttl: object) -> float:
    if isinstance(ttl, timedelta):
        seconds = ttl.total_seconds()
    elif isinstance(ttl, int | float) and not isinstance(ttl, bool):
        seconds = float(ttl)
    else:
        raise TypeError(f"ttl must be a timedelta or seconds, got {type(ttl).__name__}")
    if not math.isfinite(seconds) or seconds < MIN_LEASE_TTL.total_seconds():
        raise ValueError(f"ttl must be at least {MIN_LEASE_TTL.total_seconds()} s, got {ttl!r}")
    return seconds


def _check_owner(owner: object) -> str:
    if owner is None:
        return default_lease_owner()
    if not isinstance(owner, str) or not owner.strip():
        raise ValueError(f"owner must be a non-empty string, got {owner!r}")
    return _text(owner)


# --- storage ---------------------------------------------------------------------------------


class _LeaseDirectory:
    """The ``_lease/`` directory of one job (stripped paths on ``fs``)."""

    def __init__(self, fs: AbstractFileSystem, job: str) -> None:
        self.fs = fs
        self.path = join(job.rstrip("/"), LEASE_DIRECTORY)

    @property
    def url(self) -> str:
        return to_url(self.fs, self.path)

    def epochs(self) -> list[int]:
        """The epochs present, ascending; [] when there is no lease directory."""
        self.fs.invalidate_cache(self.path)
        try:
            names = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return []
        epochs = []
        for name in names:
            match = _EPOCH_NAME.fullmatch(name.rstrip("/").rpartition("/")[2])
            if match:
                epochs.append(int(match.group(1)))
        return sorted(epochs)

    def read(self, epoch: int) -> LeaseRecord | None:
        path = join(self.path, _epoch_name(epoch))
        self.fs.invalidate_cache(path)
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        return LeaseRecord.from_bytes(data, epoch)

    def current(self) -> LeaseRecord | None:
        """The record of the highest epoch (None: never leased). Retries when the highest
        listed record vanished (pruned meanwhile: a newer one exists)."""
        for _ in range(5):
            epochs = self.epochs()
            if not epochs:
                return None
            record = self.read(epochs[-1])
            if record is not None:
                return record
        raise JobLeaseError(f"the records in {self.url} keep disappearing while read")

    def create(self, record: LeaseRecord) -> None:
        """Publish a new epoch's record with put-if-absent (``CheckpointAlreadyExistsError``
        when another coordinator took that epoch first)."""
        if isinstance(self.fs, LocalFileSystem):
            self.fs.makedirs(self.path, exist_ok=True)
        put_if_absent(self.fs, join(self.path, _epoch_name(record.epoch)), record.to_bytes())

    def overwrite(self, record: LeaseRecord) -> None:
        """Replace the holder's own record atomically (readers see the old or the new one)."""
        path = join(self.path, _epoch_name(record.epoch))
        data = record.to_bytes()
        if isinstance(self.fs, LocalFileSystem):
            temp = join(self.path, f".{_epoch_name(record.epoch)}.{uuid.uuid4().hex}.tmp")
            try:
                with open(temp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(temp, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp)
        else:
            self.fs.pipe_file(path, data)
        self.fs.invalidate_cache(self.path)

    def prune(self, below: int) -> None:
        """Delete records of epochs below ``below`` (never the highest); best effort."""
        for epoch in self.epochs():
            if epoch >= below:
                break
            try:
                self.fs.rm_file(join(self.path, _epoch_name(epoch)))
            except FileNotFoundError:
                pass
            except OSError:
                logger.info("could not prune lease record %d in %s", epoch, self.url)
                return


# --- the lease -----------------------------------------------------------------------------


class JobLease:
    """A held job lease. Use it as a context manager (released on exit), or call
    ``release()``. ``epoch`` is the fencing epoch recorded in every `_metadata` published
    under it; ``valid`` says whether it is still held by this coordinator as far as it knows
    without I/O; ``check()`` asks the storage (one listing); ``renew()`` renews by hand (a
    daemon thread renews every ``renew_interval`` when ``auto_renew``)."""

    def __init__(
        self,
        directory: _LeaseDirectory,
        record: LeaseRecord,
        started: float,
        *,
        auto_renew: bool,
        renew_interval: float,
    ) -> None:
        self._directory = directory
        self._record = record
        self._renew_started = started  # monotonic time the last successful renewal began
        self._lock = threading.RLock()
        self._lost: str | None = None
        self._released = False
        self._stop = threading.Event()
        self._renew_interval = renew_interval
        self._thread: threading.Thread | None = None
        if auto_renew:
            self._thread = threading.Thread(
                target=self._renew_loop, name=f"job-lease-{record.epoch}", daemon=True
            )
            self._thread.start()

    # --- what it is ------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._record.epoch

    @property
    def owner(self) -> str:
        return self._record.owner

    @property
    def token(self) -> str:
        """A random id of this acquisition (two leases of one owner differ in it)."""
        return self._record.token

    @property
    def ttl(self) -> timedelta:
        return timedelta(seconds=self._record.ttl_seconds)

    @property
    def directory(self) -> str:
        """The URL of the job's ``_lease`` directory."""
        return self._directory.url

    @property
    def record(self) -> LeaseRecord:
        return self._record

    @property
    def valid(self) -> bool:
        """Held by this coordinator as far as it knows: not released, not lost, renewed less
        than ``ttl`` ago (monotonic clock). No I/O."""
        with self._lock:
            return (
                not self._released
                and self._lost is None
                and time.monotonic() - self._renew_started < self._record.ttl_seconds
            )

    def __repr__(self) -> str:
        return f"JobLease(epoch={self.epoch}, owner={self.owner!r}, valid={self.valid})"

    # --- checking and renewing ---------------------------------------------------------------

    def _lose(self, reason: str) -> JobLeaseLostError:
        with self._lock:
            if self._lost is None:
                self._lost = reason
                logger.warning("job lease %s", reason)
            self._stop.set()
            return JobLeaseLostError(f"{reason}: this coordinator may not publish checkpoints")

    def _not_valid_error(self) -> JobLeaseLostError:
        if self._released:
            return JobLeaseLostError(
                f"the job lease (epoch {self.epoch}) in {self.directory} was released: "
                "acquire it again before publishing checkpoints"
            )
        if self._lost is not None:
            return JobLeaseLostError(f"{self._lost}: this coordinator may not publish checkpoints")
        age = time.monotonic() - self._renew_started
        return self._lose(
            f"the job lease (epoch {self.epoch}) in {self.directory} was last renewed "
            f"{age:.1f} s ago, longer than its ttl of {self._record.ttl_seconds:g} s: it may "
            "have been taken over"
        )

    def _newer_epoch(self) -> int | None:
        epochs = self._directory.epochs()
        newer = [e for e in epochs if e > self.epoch]
        return newer[-1] if newer else None

    def check(self) -> None:
        """Raise ``JobLeaseLostError`` unless this coordinator still holds the lease: valid by
        its own clock, and no newer epoch in the lease directory (one listing)."""
        if not self.valid:
            raise self._not_valid_error()
        newer = self._newer_epoch()
        if newer is not None:
            raise self._lose(self._taken_over_message(newer))
        if not self.valid:  # expired while listing
            raise self._not_valid_error()

    def _taken_over_message(self, newer: int) -> str:
        record = self._directory.read(newer)
        by = "" if record is None else f" ({record.describe()})"
        return (
            f"the job lease of epoch {self.epoch} in {self.directory} was taken over by epoch "
            f"{newer}{by}"
        )

    def renew(self) -> None:
        """Extend the lease by its ttl from now; ``JobLeaseLostError`` when it is no longer
        held (expired by this coordinator's clock, released, broken or taken over)."""
        with self._lock:
            if not self.valid:
                raise self._not_valid_error()
            started = time.monotonic()
            now = time.time()
            newer = self._newer_epoch()
            if newer is not None:
                raise self._lose(self._taken_over_message(newer))
            record = replace(self._record, renewed_at=now)
            self._directory.overwrite(record)
            if time.monotonic() - self._renew_started >= self._record.ttl_seconds:
                # The write landed after the lease had expired: someone may hold it now.
                raise self._not_valid_error()
            self._record = record
            self._renew_started = started

    def _renew_loop(self) -> None:
        while not self._stop.wait(self._renew_interval):
            try:
                self.renew()
            except JobLeaseLostError:
                return
            except Exception:  # noqa: BLE001 - a failed renewal is retried; expiry is the limit
                logger.warning(
                    "renewing the job lease (epoch %d) in %s failed; retrying",
                    self.epoch,
                    self.directory,
                    exc_info=True,
                )

    # --- releasing -----------------------------------------------------------------------------

    def release(self) -> None:
        """Give the lease up: the next coordinator may take it at once. Idempotent; a lease
        that was lost is left as it is."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        with self._lock:
            if self._released:
                return
            self._released = True
            if self._lost is not None:
                return
            try:
                if self._newer_epoch() is None:
                    self._directory.overwrite(replace(self._record, released=True))
            except Exception:  # noqa: BLE001 - it expires anyway
                logger.warning(
                    "could not mark the job lease (epoch %d) in %s released; it expires "
                    "after its ttl",
                    self.epoch,
                    self.directory,
                    exc_info=True,
                )

    def __enter__(self) -> "JobLease":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


def _held_error(record: LeaseRecord, directory: _LeaseDirectory, waited: float | None):
    now = time.time()
    waited_text = "" if waited is None else f" after waiting {waited:g} s"
    if record.state(now) == "unreadable":
        advice = (
            f"its record cannot be read ({record.unreadable}); if no coordinator runs, break it "
            f"with `checkpoints lease break {directory.url.rpartition('/')[0]}`"
        )
        holder = None
    else:
        advice = (
            f"held by {record.owner!r} (epoch {record.epoch}), expires in "
            f"{record.expires_at - now:.1f} s unless renewed; wait for it (wait=...), or, if "
            f"that coordinator is gone, break it with "
            f"`checkpoints lease break {directory.url.rpartition('/')[0]}`"
        )
        holder = record.owner
    return JobLeaseHeldError(
        f"the lease of job directory {directory.url.rpartition('/')[0]} is "
        f"{'still ' if waited is not None else ''}taken{waited_text}: {advice}",
        holder=holder,
        epoch=record.epoch,
        expires_at=None if record.unreadable else record.expires_at,
    )


def acquire_job_lease(
    fs: AbstractFileSystem,
    job: str,
    owner: str | None = None,
    *,
    ttl: timedelta | float = DEFAULT_LEASE_TTL,
    wait: float | None = None,
    auto_renew: bool = True,
    renew_interval: float | None = None,
) -> JobLease:
    """Take the lease of the job directory ``job`` (a stripped path on ``fs``); see the
    module docstring. ``wait`` None fails at once with ``JobLeaseHeldError`` when another
    coordinator holds it; a number of seconds polls until then."""
    owner = _check_owner(owner)
    ttl_seconds = _ttl_seconds(ttl)
    if wait is not None and (
        isinstance(wait, bool) or not isinstance(wait, int | float) or not wait >= 0
    ):
        raise ValueError(f"wait must be None or seconds >= 0, got {wait!r}")
    interval = ttl_seconds / 3 if renew_interval is None else float(renew_interval)
    if not 0 < interval < ttl_seconds:
        raise ValueError(f"renew_interval must be in (0, ttl), got {renew_interval!r}")
    directory = _LeaseDirectory(fs, job)
    deadline = None if wait is None else time.monotonic() + wait
    while True:
        current = directory.current()
        now = time.time()
        if current is None or current.state(now) in ("released", "expired"):
            epoch = 1 if current is None else current.epoch + 1
            started = time.monotonic()
            now = time.time()
            record = LeaseRecord(epoch, owner, uuid.uuid4().hex, now, now, ttl_seconds)
            try:
                directory.create(record)
            except CheckpointAlreadyExistsError:
                continue  # another coordinator took this epoch first: look again
            if current is not None:
                directory.prune(epoch - _KEEP_EPOCHS + 1)
            logger.info("job lease %s: epoch %d taken by %r", directory.url, epoch, owner)
            return JobLease(
                directory, record, started, auto_renew=auto_renew, renew_interval=interval
            )
        if deadline is None:
            raise _held_error(current, directory, None)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _held_error(current, directory, wait)
        until_expiry = current.expires_at - now if math.isfinite(current.expires_at) else 1.0
        time.sleep(min(remaining, max(0.02, min(1.0, until_expiry + 0.01, ttl_seconds / 4))))


def abandoned_by_writer(
    record: LeaseRecord, last_modified: float | None, now: float | None = None
) -> str | None:
    """Why a ``chk-<id>`` without `_metadata`, last modified at ``last_modified`` (epoch
    seconds; None: unknown), can no longer be completed under the job lease ``record``; None
    when its holder may still be writing it (held, or unreadable: fail closed)."""
    state = record.state(now)
    if state in ("released", "expired"):
        return f"no _metadata, and the job lease is {state} ({record.describe(now)})"
    if (
        state == "held"
        and last_modified is not None
        and last_modified < record.acquired_at - record.ttl_seconds
    ):
        return (
            "no _metadata, and it was last written before the lease's holder acquired it "
            f"({record.describe(now)})"
        )
    return None


def read_job_lease(fs: AbstractFileSystem, job: str) -> LeaseRecord | None:
    """The job's current lease record (highest epoch), None when it was never leased."""
    return _LeaseDirectory(fs, job).current()


def break_job_lease(
    fs: AbstractFileSystem, job: str, *, by: str | None = None, force: bool = False
) -> LeaseRecord | None:
    """Break the job's lease: publish the next epoch as a released tombstone, which fences
    the old holder and frees the lease. A lease that is still held (unexpired, readable) is
    refused with ``JobLeaseHeldError`` unless ``force``. Returns the record broken, None when
    there was nothing to break (never leased, or released)."""
    by = _check_owner(by)
    directory = _LeaseDirectory(fs, job)
    while True:
        current = directory.current()
        if current is None or (current.state() == "released" and current.unreadable is None):
            return None
        if current.state() == "held" and not force:
            raise _held_error(current, directory, None)
        now = time.time()
        tombstone = LeaseRecord(
            current.epoch + 1, by, uuid.uuid4().hex, now, now, 0.0, True, broken_by=by
        )
        try:
            directory.create(tombstone)
        except CheckpointAlreadyExistsError:
            continue
        logger.warning("job lease %s: %s broken by %r", directory.url, current.describe(now), by)
        return current
