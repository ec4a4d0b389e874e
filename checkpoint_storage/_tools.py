"""Operator tools over completed checkpoints and savepoints: verify, dispose and copy
savepoints (listing and finding the latest: ``checkpoint_storage._listing``). The
``checkpoints`` command (``checkpoint_storage.cli``) is a thin layer over these functions.

Functions that take a pointer or directory take the fsspec ``storage_options`` of its
filesystem (e.g. an S3 ``endpoint_url``); they go to fsspec and are never put into messages.
"""

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from checkpoint_storage._access import resolve_checkpoint_pointer
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
from checkpoint_storage._handles import (
    ByteStreamStateHandle,
    FileStateHandle,
    RelativeFileStateHandle,
    SegmentFileStateHandle,
    StreamStateHandle,
)
from checkpoint_storage._locations import CompletedCheckpointStorageLocation
from checkpoint_storage._metadata import (
    CheckpointMetadata,
    OperatorState,
    OperatorSubtaskState,
    SnapshotType,
    decode_metadata,
    encode_metadata,
)
from checkpoint_storage.exceptions import (
    ForeignCheckpointError,
    InvalidCheckpointError,
    StateIntegrityError,
    UnsafePathError,
)

__all__ = [
    "VerificationProblem",
    "VerificationReport",
    "copy_savepoint",
    "dispose_savepoint",
    "verify_checkpoint",
    "verify_state_handles",
]

logger = logging.getLogger("checkpoint_storage")

Progress = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``, called from worker threads as bytes move."""

VERIFY_PARALLELISM = 8
COPY_PARALLELISM = 4
_CHUNK = 1 << 20

KIND_CHECKPOINT = "checkpoint"
KIND_FULL_CHECKPOINT = "full checkpoint"
KIND_SAVEPOINT = "savepoint"

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
