"""Appended physical files: file merging across writer processes, on disks that append in place.

Flink's ``FileMergingSnapshotManager`` keeps a physical file open in one worker process and
appends the next checkpoints' segments to it (``ACROSS_CHECKPOINTS``). A writer that lives
for one checkpoint only (a Spark task) cannot keep a file open: the next checkpoint's writer
is another process, maybe on another machine. Here it *resumes* the file instead: it learns
the file from its subtask's last segment (the ``previous`` handle: in the checkpoint it
starts from, or written since) and appends after it.

- **Where.** Physical files live in the subtask's managed directory (``SubtaskKey``), named
  ``APPENDED_FILE_PREFIX`` + a UUID. A writer resumes ``previous``'s file only if it is one
  of those, in its own managed directory, not shorter than ``previous`` ends, and below the
  maximum file size; otherwise it starts a new file. So a file never receives segments of
  another job, subtask or parallelism, and a snapshot restored from elsewhere is never
  written to.
- **One writer at a time.** A writer holds an exclusive ``flock`` on the file from its first
  byte to its commit, and writes at the end it found under the lock. A writer that finds the
  file locked (another attempt of its subtask: a retry, a speculative copy) starts a new file
  instead of waiting; the segment of the attempt that is not committed is dead bytes. A
  failed write truncates the file back to where its segment began (it still holds the lock);
  a killed writer leaves a torn tail that the next writer appends after. A commit checks that
  the file ends with its segment, so a filesystem whose ``flock`` does not hold across
  writers fails the write instead of losing one. Bytes of committed segments never change.
- **Lifetime.** An appended file is shared state owned by the shared-state registry, keyed
  by the file: it lives while a retained checkpoint references a segment in it, and is
  deleted after (``is_appended_segment``), by the registry only (``abort_checkpoint`` and
  ``discard_checkpoint`` leave it: other checkpoints' segments share it). A writer resumes
  the file of its chain's last segment, which a retained checkpoint references (the one
  restored from, or the newest) or no checkpoint yet (written in the running interval), so
  the registry never deletes a file being appended to. State of a snapshot restored in
  NO_CLAIM mode is never deleted, as for any shared file.
- **Filesystems.** Local disk only (``appends_in_place``): an object store cannot append to
  an object, and a file there is readable only once closed. Elsewhere the factory is the
  plain one: one file per stream.
"""

import contextlib
import fcntl
import os
import posixpath
import uuid

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from checkpoint_storage._filesystems import join
from checkpoint_storage._handles import (
    SegmentFileStateHandle,
    StreamStateHandle,
)
from checkpoint_storage._references import CheckpointedStateScope
from checkpoint_storage._streams import (
    CheckpointStateOutputStream,
    CheckpointStreamFactory,
    SegmentStateOutputStream,
)

__all__ = [
    "APPENDED_FILE_PREFIX",
    "AppendingSegmentStreamFactory",
    "appends_in_place",
    "is_appended_segment",
]

APPENDED_FILE_PREFIX = "appended-"
"""The name prefix of appended physical files: only such files are ever resumed."""


def appends_in_place(fs: AbstractFileSystem) -> bool:
    """Whether physical files on ``fs`` can be resumed by another process (local disk)."""
    return isinstance(fs, LocalFileSystem)


def is_appended_segment(handle: StreamStateHandle) -> bool:
    """Whether ``handle`` is a segment of an appended physical file (owned by the registry)."""
    return isinstance(handle, SegmentFileStateHandle) and posixpath.basename(
        handle.path
    ).startswith(APPENDED_FILE_PREFIX)


class AppendingSegmentOutputStream(SegmentStateOutputStream):
    """Buffers up to the inline threshold (inline handle); beyond it, appends a segment to
    the resumed or a new appended physical file, holding the file's lock until commit."""

    def __init__(
        self,
        fs: AbstractFileSystem,
        directory: str,
        previous: SegmentFileStateHandle | None,
        max_file_size: int,
        buffer_size: int,
        threshold: int,
    ) -> None:
        super().__init__(buffer_size, threshold)
        self._fs = fs
        self._directory = directory
        self._previous = previous
        self._max_file_size = max_file_size
        self._fd: int | None = None
        self._url: str | None = None
        self._created = False

    def _has_file(self) -> bool:
        return self._fd is not None

    def _inline_directory(self) -> str:
        return self._directory

    def _open_segment(self) -> int:
        if self._previous is not None and self._resume(self._previous):
            return self._start
        self._url = join(self._directory, APPENDED_FILE_PREFIX + uuid.uuid4().hex)
        self._created = True
        path = self._fs._strip_protocol(self._url)
        os.makedirs(posixpath.dirname(path), exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else knows the file
        return 0

    def _resume(self, previous: SegmentFileStateHandle) -> bool:
        """Hold ``previous``'s file, locked, with ``_start`` at its end; False: start anew."""
        path = self._fs._strip_protocol(previous.path)
        if not is_appended_segment(previous) or posixpath.dirname(path) != (
            self._fs._strip_protocol(self._directory).rstrip("/")
        ):
            return False
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        except FileNotFoundError:
            return False
        try:
            # Another attempt of this subtask holds it: a new file is as correct, and
            # waiting would stall a speculative copy behind the straggler it replaces.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            size = os.fstat(fd).st_size
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        if size < previous.end_position or size >= self._max_file_size:
            # shorter than the committed segment: damaged, never written to again
            os.close(fd)
            return False
        self._fd, self._url, self._start = fd, previous.path, size
        return True

    def _append(self, view: memoryview) -> None:
        while view:
            view = view[os.write(self._fd, view) :]

    def _ours_last(self) -> bool:
        """Whether the file ends with this segment: nothing was written beside the lock
        (a filesystem whose flock does not hold across writers is caught here)."""
        return os.fstat(self._fd).st_size == self._start + self._flushed

    def _commit_segment(self) -> StreamStateHandle:
        if not self._ours_last():
            raise OSError(
                f"appended file {self._url} changed while this stream held its lock: its "
                "filesystem does not honour flock across writers; turn file merging across "
                "checkpoints off for it"
            )
        fd, self._fd = self._fd, None
        os.close(fd)  # releases the lock
        return SegmentFileStateHandle(
            self._url,
            self._start,
            self._flushed,
            CheckpointedStateScope.SHARED,
            uuid.uuid4().hex,
            self._crc,
            filesystem=self._fs,
        )

    def _abort_segment(self) -> None:
        # Still under the lock: if nothing follows this segment's bytes, they can go.
        with contextlib.suppress(OSError):
            if self._created:
                os.unlink(self._fs._strip_protocol(self._url))
            elif self._ours_last():
                os.ftruncate(self._fd, self._start)
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.close(fd)


class AppendingSegmentStreamFactory(CheckpointStreamFactory):
    """SHARED-scope streams of one subtask that append to ``previous``'s physical file (the
    subtask's last segment) or to a new one; EXCLUSIVE-scope streams are ``plain``'s (they
    belong to one checkpoint: nothing to resume). A stream's ``name_prefix`` names nothing:
    its bytes go into a file shared with other streams."""

    def __init__(
        self,
        plain: CheckpointStreamFactory,
        fs: AbstractFileSystem,
        directory: str,
        previous: StreamStateHandle | None,
        max_file_size: int,
        buffer_size: int,
        threshold: int,
    ) -> None:
        if not appends_in_place(fs):
            raise ValueError(f"{type(fs).__name__} cannot append to a file in place")
        self._plain = plain
        self._fs = fs
        self._directory = directory
        self._previous = previous if isinstance(previous, SegmentFileStateHandle) else None
        self._max_file_size = max_file_size
        self._buffer_size = buffer_size
        self._threshold = threshold

    def create_checkpoint_state_output_stream(
        self, scope: CheckpointedStateScope, name_prefix: str = ""
    ) -> CheckpointStateOutputStream:
        if scope is not CheckpointedStateScope.SHARED:
            return self._plain.create_checkpoint_state_output_stream(scope, name_prefix)
        return AppendingSegmentOutputStream(
            self._fs,
            self._directory,
            self._previous,
            self._max_file_size,
            self._buffer_size,
            self._threshold,
        )
