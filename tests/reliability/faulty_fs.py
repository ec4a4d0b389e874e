"""A fault-injecting fsspec layer around real filesystems (local disk and s3fs).

``FaultyLocalFileSystem`` and ``FaultyS3FileSystem`` subclass the real implementations and
delegate every operation to them; at named points they consult the active ``FaultPlan``, which
may fail, delay or cut the operation before or after the real one ran. ``injecting(plan)``
registers them for the ``file`` and ``s3`` protocols (so the library's own ``url_to_fs`` picks
them up, unchanged) and restores the real implementations afterwards.

Fault points:

- ``state.open`` / ``state.write`` / ``state.close``: a file opened for writing through the
  filesystem (state files). ``after`` on ``state.open`` loses the new handle (closed by the
  harness, so on local disk an empty file is left where the library asked for one).
- ``metadata.put``: publishing ``_metadata``: the conditional PUT on S3 (``pipe_file`` with
  ``mode="create"``), ``os.link`` on local disk. ``after`` means applied, then the call failed
  (a lost response).
- local disk only, the steps around the link: ``metadata.write`` (the temp file),
  ``metadata.fsync`` (the temp file), ``metadata.dirsync`` (the directory) and
  ``metadata.cleanup`` (unlinking the temp file). The library runs these through the
  filesystem's ``local_syscalls`` attribute (``os`` for the real filesystem).

Actions: ``fail`` raises ``error`` (default ``OSError(EIO)``), ``delay`` sleeps ``seconds``
and carries on, ``cut`` (write points only) writes a prefix of the bytes, then raises.
"""

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import fsspec
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem
from fsspec.registry import _registry
from s3fs import S3FileSystem
from s3fs.core import S3File

STATE_POINTS = ("state.open", "state.write", "state.close")
COMMON_METADATA_POINTS = ("metadata.put",)
LOCAL_METADATA_POINTS = (
    "metadata.write",
    "metadata.fsync",
    "metadata.put",
    "metadata.dirsync",
    "metadata.cleanup",
)
PHASES = ("before", "after")
WRITE_POINTS = ("state.write", "metadata.write")


class InjectedFault(OSError):
    """The error a ``fail`` fault raises by default: an I/O error, as a disk or network gives."""


@dataclass
class Fault:
    point: str
    phase: str = "before"
    action: str = "fail"
    times: int = 1  # how often it fires; -1 for always
    skip: int = 0  # passes through the point to let by before it fires
    seconds: float = 0.0  # for delay
    error: Callable[[str], BaseException] | None = None

    def make_error(self) -> BaseException:
        where = f"{self.point}/{self.phase}"
        if self.error is not None:
            return self.error(where)
        return InjectedFault(errno.EIO, f"injected fault at {where}")


@dataclass
class FaultPlan:
    """The faults to inject; ``fired`` records ``(point, phase, action)`` of each that fired."""

    faults: list[Fault] = field(default_factory=list)
    fired: list[tuple[str, str, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, point: str, phase: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.point == point and fault.phase == phase and fault.times != 0:
                    if fault.skip > 0:
                        fault.skip -= 1
                        continue
                    if fault.times > 0:
                        fault.times -= 1
                    self.fired.append((point, phase, fault.action))
                    return fault
        return None


_active: FaultPlan | None = None


def fire(point: str, phase: str) -> Fault | None:
    """Apply a fail or delay fault at ``point``/``phase``; return a cut fault to the caller."""
    plan = _active
    fault = plan.take(point, phase) if plan is not None else None
    if fault is None:
        return None
    if fault.action == "delay":
        time.sleep(fault.seconds)
        return None
    if fault.action == "cut" and point in WRITE_POINTS and phase == "before":
        return fault
    raise fault.make_error()


def _write_cut(fault: Fault | None, data, write) -> int | None:
    """For a cut fault: write the first half of ``data`` with ``write``, then raise."""
    if fault is None:
        return None
    view = memoryview(data).cast("B")
    write(view[: len(view) // 2])
    raise fault.make_error()


# --- local disk --------------------------------------------------------------------------


class _StateFilePoints:
    """The ``state.write``/``state.close`` points of a file opened for writing; mixed in
    before the real file class it wraps."""

    def write(self, data) -> int:
        _write_cut(fire("state.write", "before"), data, super().write)
        n = super().write(data)
        fire("state.write", "after")
        return n

    def close(self) -> None:
        if self.closed:
            return
        fire("state.close", "before")
        super().close()
        fire("state.close", "after")


class FaultyLocalFileOpener(_StateFilePoints, LocalFileOpener):
    """A local file opened for writing, with the ``state.write``/``state.close`` points."""


class _Syscalls:
    """``os`` for the library's local `_metadata` publication, with fault points."""

    def __init__(self) -> None:
        self._dir_fds: set[int] = set()

    def __getattr__(self, name):
        return getattr(os, name)

    def open(self, path, flags, mode=0o777):
        fd = os.open(path, flags, mode)
        if os.path.isdir(path):
            self._dir_fds.add(fd)
        return fd

    def close(self, fd) -> None:
        self._dir_fds.discard(fd)
        os.close(fd)

    def write(self, fd, data) -> int:
        _write_cut(fire("metadata.write", "before"), data, lambda part: os.write(fd, part))
        n = os.write(fd, data)
        fire("metadata.write", "after")
        return n

    def fsync(self, fd) -> None:
        point = "metadata.dirsync" if fd in self._dir_fds else "metadata.fsync"
        fire(point, "before")
        os.fsync(fd)
        fire(point, "after")

    def link(self, src, dst) -> None:
        fire("metadata.put", "before")
        os.link(src, dst)
        fire("metadata.put", "after")

    def unlink(self, path) -> None:
        fire("metadata.cleanup", "before")
        os.unlink(path)
        fire("metadata.cleanup", "after")


def _writing(mode: str) -> bool:
    return any(c in mode for c in "wxa")


def _opened(fs, open_real, path, mode, cls):
    writing = _writing(mode)
    if writing:
        fire("state.open", "before")
    f = open_real()
    if writing:
        f.__class__ = cls
        try:
            fire("state.open", "after")
        except BaseException:
            _lose(f)
            raise
    return f


def _lose(f) -> None:
    """The handle is lost to its caller: release it without publishing anything new."""
    with contextlib.suppress(Exception):
        if isinstance(f, S3File):
            f.discard()
            f.closed = True
        else:
            LocalFileOpener.close(f)


class FaultyLocalFileSystem(LocalFileSystem):
    protocol = LocalFileSystem.protocol

    @property
    def local_syscalls(self) -> _Syscalls:
        return _Syscalls()

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        real = super()._open
        return _opened(
            self,
            lambda: real(path, mode, block_size, **kwargs),
            path,
            mode,
            FaultyLocalFileOpener,
        )


# --- S3 ----------------------------------------------------------------------------------


class FaultyS3File(_StateFilePoints, S3File):
    """An S3 object opened for writing, with the ``state.write``/``state.close`` points."""


class FaultyS3FileSystem(S3FileSystem):
    protocol = S3FileSystem.protocol

    def _open(self, path, mode="rb", **kwargs):
        real = super()._open
        return _opened(self, lambda: real(path, mode, **kwargs), path, mode, FaultyS3File)

    async def _pipe_file(self, path, data, *args, mode="overwrite", **kwargs):
        conditional = mode == "create"
        if conditional:
            fire("metadata.put", "before")
        result = await super()._pipe_file(path, data, *args, mode=mode, **kwargs)
        if conditional:
            fire("metadata.put", "after")
        return result


# --- plugging in -------------------------------------------------------------------------

_REPLACEMENTS = {"file": FaultyLocalFileSystem, "s3": FaultyS3FileSystem}


@contextlib.contextmanager
def injecting(plan: FaultPlan | None = None) -> Iterator[FaultPlan]:
    """Route the ``file`` and ``s3`` protocols through the faulty filesystems, with ``plan``
    active; restore the real implementations (and deactivate the plan) on exit.

    Filesystems obtained inside stay faulty afterwards but inject nothing without a plan.
    """
    global _active
    plan = plan if plan is not None else FaultPlan()
    saved = {name: _registry.get(name) for name in _REPLACEMENTS}
    for name, cls in _REPLACEMENTS.items():
        fsspec.register_implementation(name, cls, clobber=True)
    _active = plan
    try:
        yield plan
    finally:
        _active = None
        for name, cls in saved.items():
            if cls is None:
                _registry.pop(name, None)
            else:
                fsspec.register_implementation(name, cls, clobber=True)


@contextlib.contextmanager
def active(plan: FaultPlan) -> Iterator[FaultPlan]:
    """Activate ``plan`` for filesystems already obtained inside ``injecting()``."""
    global _active
    previous, _active = _active, plan
    try:
        yield plan
    finally:
        _active = previous
