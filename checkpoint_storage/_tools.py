"""Operator tools over completed checkpoints and savepoints: verify, list, find the latest,
dispose and copy savepoints. The ``checkpoints`` command (``checkpoint_storage.cli``) is a thin
layer over these functions.

Functions that take a pointer or directory take the fsspec ``storage_options`` of its
filesystem (e.g. an S3 ``endpoint_url``); they go to fsspec and are never put into messages.
"""

import contextlib
import dataclasses
import logging
import re
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from checkpoint_storage._access import resolve_checkpoint_pointer
from checkpoint_storage._discovery import discover_checkpoint_directories, lists_by_prefix
from checkpoint_storage._filesystems import (
    METADATA_FILE_NAME,
    abort_file,
    check_relative_path,
    delete_files,
    delete_recursively,
    join,
    parent_and_name,
    put_if_absent,
    to_url,
    url_to_fs,
)
from checkpoint_storage._filesystems import modification_time as _epoch_modification_time
from checkpoint_storage._handles import (
    ByteStreamStateHandle,
    FileStateHandle,
    RelativeFileStateHandle,
    SegmentFileStateHandle,
    StreamStateHandle,
)
from checkpoint_storage._ids import JobID, checkpoint_directory_id, is_job_id
from checkpoint_storage._lease import LeaseRecord, abandoned_by_writer, read_job_lease
from checkpoint_storage._locations import CompletedCheckpointStorageLocation
from checkpoint_storage._metadata import (
    FLINK,
    CheckpointMetadata,
    OperatorState,
    OperatorSubtaskState,
    SnapshotType,
    decode_metadata,
    encode_metadata,
)
from checkpoint_storage._statistics import checkpoint_statistics
from checkpoint_storage._storage import FileSystemCheckpointStorage
from checkpoint_storage.exceptions import (
    CheckpointNotFoundError,
    ForeignCheckpointError,
    InvalidCheckpointError,
    StateIntegrityError,
    UnreadableCheckpointError,
    UnsafePathError,
)

__all__ = [
    "CheckpointInfo",
    "VerificationProblem",
    "VerificationReport",
    "copy_savepoint",
    "dispose_savepoint",
    "latest_checkpoint",
    "list_checkpoints",
    "list_checkpoints_below",
    "verify_checkpoint",
    "verify_state_handles",
]

logger = logging.getLogger("checkpoint_storage")

Progress = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``, called from worker threads as bytes move."""

VERIFY_PARALLELISM = 8
COPY_PARALLELISM = 4
LIST_PARALLELISM = 8
SEARCH_DEPTH = 2  # list_checkpoints_below: e.g. <data>/savepoints/scheduled
_CHUNK = 1 << 20

_SAVEPOINT_DIR = re.compile(r"savepoint-([0-9a-f]{6})-[0-9a-f]+")

KIND_CHECKPOINT = "checkpoint"
KIND_FULL_CHECKPOINT = "full checkpoint"
KIND_SAVEPOINT = "savepoint"
STATUS_COMPLETED = "completed"
STATUS_INVALID = "invalid"
STATUS_IN_PROGRESS = "in-progress"
STATUS_ABANDONED = "abandoned"
STATUS_FOREIGN = "foreign"
STATUS_UNREADABLE = "unreadable"
KIND_FLINK = "flink"

_KINDS = {
    SnapshotType.CHECKPOINT: KIND_CHECKPOINT,
    SnapshotType.FULL_CHECKPOINT: KIND_FULL_CHECKPOINT,
    SnapshotType.SAVEPOINT: KIND_SAVEPOINT,
}


def snapshot_kind(metadata: CheckpointMetadata) -> str:
    """ "checkpoint", "full checkpoint" or "savepoint"."""
    return _KINDS[metadata.properties.snapshot_type]


def _resolve(pointer: str, storage_options: dict | None) -> CompletedCheckpointStorageLocation:
    return resolve_checkpoint_pointer(pointer, dict(storage_options or {}))


def _unique_file_handles(handles: Iterable[StreamStateHandle]) -> list[FileStateHandle]:
    seen: dict[tuple, FileStateHandle] = {}
    for handle in handles:
        if isinstance(handle, FileStateHandle):
            seen.setdefault((handle.path, handle.state_size, handle.checksum), handle)
    return list(seen.values())


class _ProgressCounter:
    """Thread-safe running total that reports to an optional progress callback (called under
    a lock, so it must be quick)."""

    def __init__(self, total: int, progress: Progress | None) -> None:
        self.total = total
        self.done = 0
        self._progress = progress
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:  # reports in order: ``done`` never goes backwards
            self.done += n
            if self._progress is not None and n:
                self._progress(self.done, self.total)

    def start(self) -> None:
        if self._progress is not None:
            self._progress(0, self.total)


# --- verify ------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerificationProblem:
    """One state handle that could not be verified: ``kind`` is ``"missing"`` (the file does
    not exist), ``"corrupt"`` (size or checksum differ) or ``"unreadable"`` (an I/O error,
    which says nothing about the file itself)."""

    path: str
    kind: str
    reason: str
    # The handle that failed, so a caller can tell which state (stage, range) it belongs to.
    handle: StreamStateHandle | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class VerificationReport:
    """What ``verify_checkpoint`` read, and every handle that failed."""

    pointer: str
    checkpoint_id: int
    handles_checked: int
    bytes_read: int
    problems: tuple[VerificationProblem, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.problems


def _handle_label(handle: StreamStateHandle) -> str:
    if isinstance(handle, SegmentFileStateHandle):
        return f"{handle.path}[{handle.start_position}:{handle.end_position}]"
    if isinstance(handle, FileStateHandle):
        return handle.path
    if isinstance(handle, ByteStreamStateHandle):
        return f"inline:{handle.handle_name}"
    return repr(handle)


def _read_to_end(handle: StreamStateHandle, counter: _ProgressCounter) -> int:
    read = 0
    with handle.open() as stream:
        while chunk := stream.read(_CHUNK):
            read += len(chunk)
            counter.add(len(chunk))
    return read


def _problem(handle: StreamStateHandle, exc: BaseException) -> VerificationProblem:
    path = _handle_label(handle)
    if isinstance(exc, InvalidCheckpointError | UnsafePathError):
        return VerificationProblem(path, "corrupt", _one_line(exc), handle)
    if isinstance(exc, FileNotFoundError):
        return VerificationProblem(path, "missing", f"state file {path} does not exist", handle)
    reason = _one_line(exc) or type(exc).__name__
    return VerificationProblem(path, "unreadable", f"could not read {path}: {reason}", handle)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def verify_checkpoint(
    completed_location: CompletedCheckpointStorageLocation,
    *,
    progress: Progress | None = None,
    max_workers: int = VERIFY_PARALLELISM,
) -> VerificationReport:
    """Load `_metadata` and read every state handle to its end, so that each file's size and
    CRC-32 are checked. Every handle is tried (``max_workers`` at a time); each failure is one
    problem in the report. An invalid `_metadata` raises ``InvalidCheckpointError``."""
    metadata = completed_location.load_metadata()
    handles = metadata.all_handles()
    bytes_read, problems = verify_state_handles(
        handles, progress=progress, max_workers=max_workers
    )
    return VerificationReport(
        pointer=completed_location.external_pointer,
        checkpoint_id=metadata.checkpoint_id,
        handles_checked=len(handles),
        bytes_read=bytes_read,
        problems=problems,
    )


def verify_state_handles(
    handles: Iterable[StreamStateHandle],
    *,
    progress: Progress | None = None,
    max_workers: int = VERIFY_PARALLELISM,
) -> tuple[int, tuple[VerificationProblem, ...]]:
    """Read each of ``handles`` to its end (size and CRC-32 checked), ``max_workers`` at a
    time; returns the bytes read and one problem per handle that failed (its ``handle`` set).
    A file referenced twice with the same size and checksum is read once."""
    unique: dict[object, StreamStateHandle] = {}
    for handle in handles:
        if isinstance(handle, FileStateHandle):
            key = ("file", handle.path, handle.state_size, handle.checksum)
        elif isinstance(handle, SegmentFileStateHandle):
            # Each segment is checked: its own bytes and checksum within the physical file.
            key = ("segment", handle.path, handle.start_position, handle.state_size)
        else:
            key = ("other", id(handle))
        unique.setdefault(key, handle)
    to_check = list(unique.values())
    counter = _ProgressCounter(sum(h.state_size for h in to_check), progress)
    counter.start()

    def check(handle: StreamStateHandle) -> tuple[int, VerificationProblem | None]:
        try:
            return _read_to_end(handle, counter), None
        except Exception as exc:  # noqa: BLE001 - one problem per handle, never the first only
            return 0, _problem(handle, exc)

    if len(to_check) <= 1 or max_workers <= 1:
        results = [check(h) for h in to_check]
    else:
        with ThreadPoolExecutor(max_workers=min(max_workers, len(to_check))) as pool:
            results = list(pool.map(check, to_check))
    return sum(n for n, _ in results), tuple(p for _, p in results if p is not None)


# --- dispose -----------------------------------------------------------------------------


def dispose_savepoint(
    pointer: str,
    *,
    storage_options: dict | None = None,
    force: bool = False,
    corrupt: bool = False,
) -> None:
    """Delete a savepoint in Flink's order (``Checkpoints.disposeSavepoint``): resolve it,
    load `_metadata` to learn its state, delete `_metadata` first (from then on the savepoint
    is no longer addressable, even if the rest fails), discard every state handle (in
    parallel), then delete the directory. A failure to delete `_metadata` is raised at once
    and nothing else is touched; later failures are collected and the first is raised after
    everything was tried.

    A pointer whose `_metadata` says it is a checkpoint is refused (``ValueError``) unless
    ``force``; even then only files inside its own directory are deleted, never the job's
    ``shared/`` or ``taskowned/`` state, which other checkpoints may reference.

    ``corrupt`` disposes a checkpoint or savepoint of this library whose `_metadata` is
    corrupt (and only such a one: a valid, foreign or unreadable `_metadata` is refused):
    `_metadata` first, then its own directory, never anything outside it.
    """
    completed = _resolve(pointer, storage_options)
    if corrupt:
        _dispose_corrupt(completed)
        return
    metadata = completed.load_metadata()
    if not metadata.properties.is_savepoint() and not force:
        raise ValueError(
            f"{completed.external_pointer} is a {snapshot_kind(metadata)}, not a savepoint: "
            "checkpoints are disposed by their job's retention; pass force=True "
            "(--force) to dispose it anyway"
        )
    directory = completed.external_pointer
    metadata_handle = completed.metadata_handle
    # 1. `_metadata` first: a failure here leaves the savepoint intact and addressable.
    metadata_handle.discard_state()

    errors: list[BaseException] = []
    # 2. the state, in parallel, grouped by filesystem.
    by_fs: dict[int, tuple[AbstractFileSystem, list[str]]] = {}
    outside = []
    for handle in _unique_file_handles(metadata.all_handles()):
        if not handle.path.startswith(directory.rstrip("/") + "/"):
            outside.append(handle.path)
            continue
        fs = handle.filesystem
        by_fs.setdefault(id(fs), (fs, []))[1].append(fs._strip_protocol(handle.path))
    if outside:
        logger.warning(
            "not deleting %d state file(s) outside %s (shared or task-owned state other "
            "checkpoints may reference; garbage collection reclaims them), e.g. %s",
            len(outside),
            directory,
            outside[0],
        )
    for fs, paths in by_fs.values():
        try:
            delete_files(fs, paths)
        except Exception as exc:  # noqa: BLE001 - collected, the first is raised below
            errors.append(exc)
    # 3. the directory (and whatever else is left in it).
    try:
        completed.dispose_storage_location()
    except Exception as exc:  # noqa: BLE001
        errors.append(exc)
    if errors:
        first = errors[0]
        if len(errors) > 1:
            first.add_note(f"{len(errors) - 1} more error(s) while disposing {directory}")
        raise first


def corruption_of(completed: CompletedCheckpointStorageLocation) -> InvalidCheckpointError | None:
    """Why ``completed``'s `_metadata` is corrupt, or None when it is valid. Raises for what
    is not corruption of this library's format: ``ForeignCheckpointError`` (another system's
    or a newer format), ``UnreadableCheckpointError`` and I/O errors."""
    try:
        completed.load_metadata()
    except ForeignCheckpointError:
        raise
    except (InvalidCheckpointError, UnsafePathError) as exc:
        return exc
    return None


def _dispose_corrupt(completed: CompletedCheckpointStorageLocation) -> None:
    problem = corruption_of(completed)
    if problem is None:
        raise ValueError(
            f"{completed.external_pointer} is not corrupt: its _metadata is valid; dispose it "
            "without the corrupt flag (--corrupt)"
        )
    logger.warning("disposing corrupt %s: %s", completed.external_pointer, problem)
    completed.metadata_handle.discard_state()
    completed.dispose_storage_location()


# --- copy --------------------------------------------------------------------------------


_NAMED_OUTSIDE = 5


def _relocatable_metadata(
    metadata: CheckpointMetadata, directory: str, data: bytes
) -> tuple[bytes, list[tuple[FileStateHandle, str]]]:
    """The `_metadata` bytes for the copy and each state file with its path relative to the
    directory. The decision is by content, whatever the properties say: inline handles and
    files inside the directory copy (absolute ones are rewritten as relative); any file or
    segment outside it is refused, naming the files."""
    prefix = directory.rstrip("/") + "/"
    files: dict[str, tuple[FileStateHandle, str]] = {}
    outside: list[str] = []
    rewritten = False

    def relocate(handle: StreamStateHandle) -> StreamStateHandle:
        nonlocal rewritten
        if isinstance(handle, SegmentFileStateHandle) or (
            isinstance(handle, FileStateHandle)
            and not isinstance(handle, RelativeFileStateHandle)
            and not handle.path.startswith(prefix)
        ):
            outside.append(handle.path)
            return handle
        if not isinstance(handle, FileStateHandle):
            return handle
        if isinstance(handle, RelativeFileStateHandle):
            relative = handle.relative_path
        elif handle.path.startswith(prefix):
            relative = check_relative_path(handle.path[len(prefix) :])
            rewritten = True
            handle = RelativeFileStateHandle(
                handle.path,
                relative,
                handle.state_size,
                handle.checksum,
                filesystem=handle.filesystem,
            )
        previous = files.setdefault(relative, (handle, relative))[0]
        if (previous.state_size, previous.checksum) != (handle.state_size, handle.checksum):
            raise InvalidCheckpointError(
                f"{directory}: two handles name {relative} with different sizes or checksums"
            )
        return handle

    operators = tuple(
        OperatorState(
            op.operator_id,
            op.parallelism,
            op.max_parallelism,
            {
                index: OperatorSubtaskState(
                    tuple(relocate(h) for h in subtask.handles), subtask.properties
                )
                for index, subtask in op.subtask_states.items()
            },
        )
        for op in metadata.operator_states
    )
    if outside:
        named = sorted(set(outside))
        more = len(named) - _NAMED_OUTSIDE
        raise ValueError(
            f"{directory} references {len(named)} state file(s) outside its directory, which "
            f"a copy of the directory would not contain: {', '.join(named[:_NAMED_OUTSIDE])}"
            + (f" and {more} more" if more > 0 else "")
            + "; refusing to copy (take a savepoint, which is self-contained, and copy that)"
        )
    if rewritten:
        data = encode_metadata(
            CheckpointMetadata(
                metadata.checkpoint_id,
                operators,
                metadata.master_states,
                metadata.properties,
                metadata.job_id,
                metadata.timestamp_ms,
            )
        )
    return data, list(files.values())


def _copy_file(
    handle: FileStateHandle,
    target_fs: AbstractFileSystem,
    target_path: str,
    counter: _ProgressCounter,
) -> None:
    """Stream one state file across filesystems; the source is verified as it is read."""
    with handle.open() as source:
        out = target_fs.open(target_path, "wb")
        try:
            while chunk := source.read(_CHUNK):
                out.write(chunk)
                counter.add(len(chunk))
            out.close()
        except BaseException:
            abort_file(target_fs, out, target_path)
            raise


def copy_savepoint(
    pointer: str,
    target_directory: str,
    *,
    storage_options: dict | None = None,
    target_storage_options: dict | None = None,
    progress: Progress | None = None,
    max_workers: int = COPY_PARALLELISM,
) -> str:
    """Copy a savepoint into ``target_directory`` (any filesystem, e.g. local disk to S3) and
    return the pointer of the copy, ``<target_directory>/<savepoint directory name>``.

    Every state file is streamed across (verified while read); `_metadata` is published last,
    with put-if-absent, so the copy is complete or invisible; then the copy is verified.
    ``target_storage_options`` default to ``storage_options``. Raises ``FileExistsError`` when
    the copy's directory exists and ``ValueError`` naming the state files outside the directory,
    if any: whether a directory can be copied is decided by its content (inline state and
    files inside it), not by whether its properties say savepoint or checkpoint.
    """
    completed = _resolve(pointer, storage_options)
    source_dir = completed.external_pointer
    data = completed.read_metadata_bytes()
    source_fs = url_to_fs(source_dir, dict(storage_options or {}))[0]
    metadata = decode_metadata(
        data,
        source=join(source_dir, METADATA_FILE_NAME),
        directory=source_dir,
        roots=completed.roots,
        filesystem=source_fs,
    )
    data, files = _relocatable_metadata(metadata, source_dir, data)

    target_options = dict(
        (storage_options if target_storage_options is None else target_storage_options) or {}
    )
    target_fs, target_base = url_to_fs(target_directory, target_options)
    name = parent_and_name(source_dir)[1]
    new_path = join(target_base, name)
    new_url = to_url(target_fs, new_path)
    target_base_url = to_url(target_fs, target_base)
    if type(target_fs) is type(source_fs) and (
        target_base_url == source_dir or target_base_url.startswith(source_dir.rstrip("/") + "/")
    ):
        raise ValueError(f"cannot copy {source_dir} into itself ({target_base_url})")
    target_fs.invalidate_cache(new_path)
    try:
        target_fs.info(new_path)
    except FileNotFoundError:
        pass
    else:
        raise FileExistsError(
            f"{new_url} already exists: remove it or choose another target directory"
        )

    target_fs.makedirs(new_path, exist_ok=True)
    counter = _ProgressCounter(sum(h.state_size for h, _ in files), progress)
    counter.start()
    if isinstance(target_fs, LocalFileSystem):
        for parent in {parent_and_name(join(new_path, r))[0] for _, r in files}:
            target_fs.makedirs(parent, exist_ok=True)

    errors: list[BaseException] = []

    def copy(item: tuple[FileStateHandle, str]) -> None:
        handle, relative = item
        try:
            _copy_file(handle, target_fs, join(new_path, relative), counter)
        except Exception as exc:  # noqa: BLE001 - collected, the first is raised below
            errors.append(exc)

    if len(files) <= 1 or max_workers <= 1:
        for item in files:
            copy(item)
    else:
        with ThreadPoolExecutor(max_workers=min(max_workers, len(files))) as pool:
            list(pool.map(copy, files))
    if not errors:
        try:
            put_if_absent(target_fs, join(new_path, METADATA_FILE_NAME), data)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    if errors:
        # `_metadata` was not published: nothing addresses the partial copy. Remove it.
        with contextlib.suppress(Exception):
            delete_recursively(target_fs, new_path)
        raise errors[0]

    report = verify_checkpoint(_resolve(new_url, target_options))
    if not report.ok:
        first = report.problems[0]
        raise StateIntegrityError(
            f"the copy {new_url} failed verification ({len(report.problems)} problem(s); "
            f"first: {first.reason}); it is left in place for inspection: dispose it"
        )
    return new_url


# --- list --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointInfo:
    """One ``chk-<id>`` or ``savepoint-*`` directory found by ``list_checkpoints``.

    ``status`` is ``"completed"`` (valid `_metadata`), ``"invalid"`` (`_metadata` present but
    not valid, or of another checkpoint id than its ``chk-<id>``: ``reason`` says why),
    ``"foreign"`` (Apache Flink's `_metadata`; ``kind`` is ``"flink"``), ``"unreadable"``
    (`_metadata` exists but cannot be opened), ``"in-progress"`` (no `_metadata` yet: the job
    lease's holder may still complete it, or the job was never leased so nobody can tell) or
    ``"abandoned"`` (a ``chk-<id>`` without `_metadata` that nobody can complete any more: the
    job lease is released or expired, or its holder acquired it after this directory was last
    written; ``reason`` says which). Garbage collection removes abandoned ones after its grace
    period, and never a ``chk-<id>`` the lease's holder may still be writing.
    ``state_size`` and ``file_count`` come from `_metadata` for a completed checkpoint (inline
    state included in the size; files counted once); otherwise ``state_size`` is None and
    ``file_count`` is the number of files present in the directory. ``modified`` is when
    `_metadata` was last modified (UTC), if the filesystem says. ``master_states`` are a
    completed checkpoint's (from the `_metadata` the listing read), else empty.
    """

    pointer: str
    kind: str
    checkpoint_id: int | None
    status: str
    job_id: str | None = None
    reason: str | None = None
    state_size: int | None = None
    file_count: int = 0
    modified: datetime | None = None
    master_states: dict[str, bytes] = field(default_factory=dict, compare=False, repr=False)
    statistics: dict | None = field(default=None, compare=False, repr=False)
    """A completed checkpoint's statistics (``checkpoint_statistics``): recorded, or derived
    from its handles and those of the job's checkpoints listed before it; else None."""
    metadata: CheckpointMetadata | None = field(default=None, compare=False, repr=False)
    """A completed checkpoint's `_metadata`, as the listing read it; else None."""

    @property
    def completed(self) -> bool:
        return self.status == STATUS_COMPLETED

    def age(self, now: datetime | None = None) -> timedelta | None:
        if self.modified is None:
            return None
        return (now or datetime.now(UTC)) - self.modified


def modification_time(info: dict) -> datetime | None:
    """The modification time in an fsspec ``info``/``ls`` entry, as an aware UTC datetime."""
    epoch = _epoch_modification_time(info)
    if epoch is None:
        return None
    try:
        return datetime.fromtimestamp(epoch, UTC)
    except (OverflowError, OSError, ValueError):
        return None


@dataclass(frozen=True)
class _Candidate:
    path: str  # stripped path on fs
    name: str
    job_id: str | None


def _ls(fs: AbstractFileSystem, path: str) -> list[dict]:
    fs.invalidate_cache(path)
    return fs.ls(path, detail=True)


def _is_dir(entry: dict) -> bool:
    return entry.get("type") == "directory"


def _candidates_in(entries: list[dict], job_id: str | None) -> tuple[list[_Candidate], list[str]]:
    """Checkpoint/savepoint directories among ``entries`` and the job directories."""
    found, jobs = [], []
    for entry in entries:
        if not _is_dir(entry):
            continue
        path = entry["name"].rstrip("/")
        name = parent_and_name(path)[1]
        if checkpoint_directory_id(name) is not None or _SAVEPOINT_DIR.fullmatch(name):
            found.append(
                _Candidate(
                    path, name, job_id if checkpoint_directory_id(name) is not None else None
                )
            )
        elif is_job_id(name):
            jobs.append(path)
    return found, jobs


def _listed_files(fs: AbstractFileSystem, candidates: list[_Candidate]) -> dict[str, list[dict]]:
    """On object stores, the files of every ``chk-<id>`` candidate from one prefix listing
    per job directory (``discover_checkpoint_directories``), so that examining a directory
    costs no request of its own; {} elsewhere (each directory is listed when examined)."""
    if not lists_by_prefix(fs):
        return {}
    jobs = {
        parent_and_name(c.path)[0]
        for c in candidates
        if checkpoint_directory_id(c.name) is not None
    }
    files: dict[str, list[dict]] = {}
    for job in jobs:
        for directory in discover_checkpoint_directories(fs, job):
            files[directory.path] = directory.files or []
    return files


def _lease_reader(fs: AbstractFileSystem) -> Callable[[str], LeaseRecord | None]:
    """The job lease of a job directory (stripped path), read once per listing."""
    leases: dict[str, LeaseRecord | None] = {}
    lock = threading.Lock()

    def lease_of(job: str) -> LeaseRecord | None:
        # read under the lock: the listing's threads would otherwise all read it at once
        # (a LIST and a GET each), before the first of them cached it
        with lock:
            if job not in leases:
                leases[job] = read_job_lease(fs, job)
            return leases[job]

    return lease_of


def _examine(
    fs: AbstractFileSystem,
    candidate: _Candidate,
    options: dict,
    listed: dict[str, list[dict]] | None = None,
    lease_of: Callable[[str], LeaseRecord | None] = lambda job: None,
) -> CheckpointInfo:
    url = to_url(fs, candidate.path)
    name_id = checkpoint_directory_id(candidate.name)
    name_kind = KIND_CHECKPOINT if name_id is not None else KIND_SAVEPOINT
    if listed and candidate.path in listed:
        # Direct children only, as an `ls` would show them.
        entries = [e for e in listed[candidate.path]
                   if parent_and_name(e["name"])[0] == candidate.path]
    else:
        try:
            entries = _ls(fs, candidate.path)
        except FileNotFoundError:  # deleted while we listed
            entries = []
        except OSError as exc:  # e.g. no permission to list it: mark the row, go on
            reason = f"cannot list {url}: {_one_line(exc)}"
            return CheckpointInfo(
                url, name_kind, name_id, STATUS_UNREADABLE, candidate.job_id, reason=reason
            )
    meta_entry = next((e for e in entries if _is_metadata_entry(e)), None)
    present = sum(1 for e in entries if e.get("type") == "file" and not _is_metadata_entry(e))
    if meta_entry is None:
        status, reason = STATUS_IN_PROGRESS, None
        record = None if name_id is None else lease_of(parent_and_name(candidate.path)[0])
        if record is not None:  # never leased: nothing tells a live writer from a dead one
            times = [_epoch_modification_time(e) for e in entries]
            newest = max((t for t in times if t is not None), default=None)
            reason = abandoned_by_writer(record, newest)
            status = STATUS_IN_PROGRESS if reason is None else STATUS_ABANDONED
        return CheckpointInfo(
            url, name_kind, name_id, status, candidate.job_id, reason=reason, file_count=present
        )
    modified = modification_time(meta_entry)

    def problem(status: str, exc: BaseException, kind: str = name_kind) -> CheckpointInfo:
        return CheckpointInfo(
            url,
            kind,
            name_id,
            status,
            candidate.job_id,
            reason=_one_line(exc),
            file_count=present,
            modified=modified,
        )

    try:
        metadata = _resolve(url, options).load_metadata(name_id)
    except CheckpointNotFoundError:  # disposed while we listed
        return CheckpointInfo(
            url, name_kind, name_id, STATUS_IN_PROGRESS, candidate.job_id, file_count=present
        )
    except ForeignCheckpointError as exc:
        if exc.format_name == FLINK:
            return problem(STATUS_FOREIGN, exc, KIND_FLINK)
        return problem(STATUS_INVALID, exc)  # unknown, or damaged beyond recognition: say so
    except (InvalidCheckpointError, UnsafePathError) as exc:
        return problem(STATUS_INVALID, exc)
    except UnreadableCheckpointError as exc:
        return problem(STATUS_UNREADABLE, exc)
    job = candidate.job_id or (metadata.job_id.hex if metadata.job_id else None)
    return CheckpointInfo(
        url,
        snapshot_kind(metadata),
        metadata.checkpoint_id,
        STATUS_COMPLETED,
        job,
        state_size=metadata.state_size,
        file_count=len(
            {
                h.path
                for h in metadata.all_handles()
                if isinstance(h, FileStateHandle | SegmentFileStateHandle)
            }
        ),
        modified=modified,
        master_states=dict(metadata.master_states),
        metadata=metadata,
    )


def _with_statistics(infos: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """``infos`` (in listing order) with each completed one's statistics: a checkpoint's new
    files are those no checkpoint of its job listed before it references (unknown for the
    first one listed, unless recorded); a savepoint is self-contained: all its files are its
    own."""
    before: dict[str | None, list[CheckpointMetadata]] = {}
    result = []
    for info in infos:
        if info.metadata is not None:
            if info.kind == KIND_SAVEPOINT:
                previous = ()
            else:
                previous = before.setdefault(info.job_id, [])
                previous = list(previous) if previous else None
                before[info.job_id].append(info.metadata)
            info = dataclasses.replace(
                info, statistics=checkpoint_statistics(info.metadata, previous))
        result.append(info)
    return result


def _is_metadata_entry(entry: dict) -> bool:
    """Whatever is named `_metadata` (a file, or a directory, link or FIFO in its place)."""
    return parent_and_name(entry["name"])[1] == METADATA_FILE_NAME


def list_checkpoints(
    directory: str, *, storage_options: dict | None = None
) -> list[CheckpointInfo]:
    """Every ``chk-<id>`` and ``savepoint-*`` directory under ``directory``: a job directory
    (``<base>/<job_id>``), a base directory holding job directories, a savepoint directory's
    parent, or one checkpoint directory itself. Sorted by job, then id (numerically).

    Raises ``FileNotFoundError`` when ``directory`` does not exist; I/O errors are raised,
    never reported as an invalid checkpoint.
    """
    options = dict(storage_options or {})
    fs, path = url_to_fs(directory, options)
    parent, name = parent_and_name(path)
    try:
        entries = _ls(fs, path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{to_url(fs, path)} does not exist") from None
    if not entries:
        try:  # S3 lists nothing for a missing prefix: tell "empty" from "absent"
            fs.info(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{to_url(fs, path)} does not exist") from None
    if len(entries) == 1 and not _is_dir(entries[0]) and entries[0]["name"].rstrip("/") == path:
        raise NotADirectoryError(  # fsspec lists a file as itself
            f"{to_url(fs, path)} is a file, not a directory: pass a job directory, a directory "
            "of jobs or savepoints, or a checkpoint or savepoint directory"
        )
    own_job = name if is_job_id(name) else None
    if any(_is_metadata_entry(e) for e in entries):
        parent_job = parent_and_name(parent)[1]
        job = (
            parent_job
            if checkpoint_directory_id(name) is not None and is_job_id(parent_job)
            else None
        )
        candidates = [_Candidate(path, name, job)]
    else:
        candidates, jobs = _candidates_in(entries, own_job)
        if jobs:
            with ThreadPoolExecutor(max_workers=min(LIST_PARALLELISM, len(jobs))) as pool:
                listings = list(pool.map(lambda p: (p, _ls(fs, p)), jobs))
            for job_path, job_entries in listings:
                more, _ = _candidates_in(job_entries, parent_and_name(job_path)[1])
                candidates.extend(more)
    if not candidates:
        return []
    listed = _listed_files(fs, candidates)
    lease_of = _lease_reader(fs)
    with ThreadPoolExecutor(max_workers=min(LIST_PARALLELISM, len(candidates))) as pool:
        infos = list(pool.map(lambda c: _examine(fs, c, options, listed, lease_of), candidates))
    return _with_statistics(sorted(_attribute_savepoints(infos), key=_listing_order))


def _attribute_savepoints(infos: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """A savepoint without a readable job id belongs to the one listed job its name's
    ``savepoint-<job[:6]>-`` prefix matches, if exactly one does."""
    jobs = {i.job_id for i in infos if i.job_id}
    result = []
    for info in infos:
        match = _SAVEPOINT_DIR.fullmatch(parent_and_name(info.pointer)[1])
        if info.job_id is None and match:
            owners = [j for j in jobs if j.startswith(match.group(1))]
            if len(owners) == 1:
                info = dataclasses.replace(info, job_id=owners[0])
        result.append(info)
    return result


def _holds_snapshots_or_jobs(name: str) -> bool:
    return (
        checkpoint_directory_id(name) is not None
        or _SAVEPOINT_DIR.fullmatch(name) is not None
        or is_job_id(name)
    )


def _listing_below(fs: AbstractFileSystem, path: str) -> list[dict]:
    """The entries of a directory below the one asked for; one that cannot be listed is
    skipped with a warning (it was not asked for by name)."""
    try:
        return _ls(fs, path)
    except FileNotFoundError:
        return []
    except OSError as exc:
        logger.warning("skipped %s: cannot list it (%s)", to_url(fs, path), _one_line(exc))
        return []


def _holders_below(
    fs: AbstractFileSystem, entries: list[dict], depth: int, max_depth: int
) -> list[str]:
    """The directories among ``entries`` and below them (to ``max_depth``) that hold job,
    ``chk-<id>`` or ``savepoint-*`` directories. Hidden (``.x``) and internal (``_x``)
    ones are skipped, and so is a directory holding a `_metadata` (a checkpoint directory
    under another name)."""
    found = []
    for entry in entries:
        name = parent_and_name(entry["name"])[1]
        if not _is_dir(entry) or _holds_snapshots_or_jobs(name) or name.startswith((".", "_")):
            continue
        child = entry["name"].rstrip("/")
        child_entries = _listing_below(fs, child)
        if any(_is_metadata_entry(e) for e in child_entries):
            continue
        if any(
            _is_dir(e) and _holds_snapshots_or_jobs(parent_and_name(e["name"])[1])
            for e in child_entries
        ):
            found.append(child)
        if depth < max_depth:
            found += _holders_below(fs, child_entries, depth + 1, max_depth)
    return found


def list_checkpoints_below(
    directory: str, *, storage_options: dict | None = None, depth: int = SEARCH_DEPTH
) -> list[CheckpointInfo]:
    """What ``list_checkpoints`` finds in ``directory`` and, when ``directory`` is neither
    a job directory nor a checkpoint or savepoint directory, in every directory below it (up
    to ``depth`` levels) that holds job, ``chk-<id>`` or ``savepoint-*`` directories: e.g.
    for a data directory, ``<data>/checkpoints`` and ``<data>/savepoints/scheduled``.
    Hidden (``.x``) and internal (``_x``) directories are not searched; one below
    ``directory`` that cannot be listed is skipped with a warning (logged). A savepoint
    whose `_metadata` names no job is attributed as ``list_checkpoints`` does, across
    everything found. Sorted by job, then id.

    Raises as ``list_checkpoints`` does for ``directory`` itself."""
    options = dict(storage_options or {})
    infos = list_checkpoints(directory, storage_options=options)
    fs, path = url_to_fs(directory, options)
    if is_job_id(parent_and_name(path)[1]):
        return infos
    entries = _ls(fs, path)
    if any(_is_metadata_entry(e) for e in entries):
        return infos
    holders = _holders_below(fs, entries, 1, depth)
    for holder in holders:
        infos = [*infos, *list_checkpoints(to_url(fs, holder), storage_options=options)]
    return sorted(_attribute_savepoints(infos), key=_listing_order) if holders else infos


def _listing_order(info: CheckpointInfo) -> tuple:
    return (info.job_id or "", info.checkpoint_id is None, info.checkpoint_id or 0, info.pointer)


# --- latest ------------------------------------------------------------------------------


def job_storage(directory: str, storage_options: dict | None = None):
    """The ``CheckpointStorageAccess`` of a job directory ``<base>/<job_id>``; a directory
    whose name is not a job id holds ``chk-<id>`` directly (``create_checkpoint_subdir=False``)."""
    options = dict(storage_options or {})
    fs, path = url_to_fs(directory, options)
    base, name = parent_and_name(path)
    if is_job_id(name) and base:
        storage = FileSystemCheckpointStorage(to_url(fs, base), storage_options=options)
        return storage.create_checkpoint_storage(JobID(name))
    storage = FileSystemCheckpointStorage(
        to_url(fs, path), storage_options=options, create_checkpoint_subdir=False
    )
    return storage.create_checkpoint_storage(JobID("0" * 32))


def latest_checkpoint(directory: str, *, storage_options: dict | None = None) -> str | None:
    """The pointer of the newest completed checkpoint (by id, with a valid `_metadata`) of a
    job directory ``<base>/<job_id>``, or None when it has none."""
    completed = job_storage(directory, storage_options).latest_completed_checkpoint()
    return None if completed is None else completed.external_pointer
