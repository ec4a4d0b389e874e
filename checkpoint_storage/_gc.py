"""Garbage collection of a job's checkpoint directory (issue 3, docs/design.md §3.2-3.3).

Deletes the files below ``<job>/chk-<id>/`` and ``<job>/shared/`` that no retained checkpoint
references and that are older than a grace period: orphans of crashed writers and failed task
attempts, aborted checkpoints (``chk-<id>`` without `_metadata`) and temp files of a crashed
local `_metadata` publish. Then it removes the ``chk-<id>`` directories this left empty (local
disk and memory; on object stores a directory vanishes with its last object).

Fail closed: it deletes only what it proves unreferenced. A ``chk-<id>`` whose `_metadata`
exists but cannot be read keeps every file, and is reported in ``skipped``:

- ``"foreign"``: Apache Flink's `_metadata` (magic ``0x4960672d``). The job directory is
  another system's: nothing in it is deleted at all.
- ``"unknown format"``: an unknown magic number or a newer format version of this library.
- ``"id mismatch"``: the id inside differs from ``chk-<id>`` (a copied or renamed directory).
- ``"corrupt"``: this library's format, but truncated or corrupt. Deleted only with
  ``delete_corrupt=True`` (then it references nothing), never because of a grace period alone.
- ``"unreadable"``: it cannot be opened (permission, symbolic link loop, a directory or FIFO).

While any checkpoint is skipped nothing in ``shared/`` is collected: it may be referenced.

File merging: a physical file below ``shared/<operator>_<subtask>_<parallelism>_/`` is
referenced while any retained checkpoint holds a ``SegmentFileStateHandle`` in it, and is
collected like any other shared file once none does (after the grace period).

Never deleted: anything a retained checkpoint or ``extra_references`` names, anything younger
than the grace period or without a modification time, ``taskowned/``, anything with a
``savepoint-*`` path segment, symbolic links, and anything outside the job directory.

Nor a ``chk-<id>`` without `_metadata` that the job lease's holder may still be writing
(``abandoned_by_writer``: the lease is held, or unreadable, and the holder acquired it before
the directory was last written): a checkpoint slower than the grace period is not taken from
under its writer. Once the lease is released or expired, or a later holder took it, the
directory is abandoned and collected after the grace period. A job that was never leased
keeps the grace period alone.

Retained checkpoints are the ``chk-<id>`` directories whose `_metadata` exists, validates and
holds checkpoint ``<id>``. Any other I/O error (timeout, 5xx) while listing or loading is
raised, never read as "unreferenced".

Concurrency: the job's directory is listed once, then the `_metadata` of every ``chk-<id>`` in
that listing is loaded. A checkpoint completed after the listing references only files that a
listed checkpoint referenced too, or files younger than the grace period, provided the grace
period exceeds the longest checkpoint (plus clock skew between writers and storage). A listed
checkpoint whose `_metadata` vanished before it was loaded (subsumed meanwhile) restarts the
collection.

Files with entropy-injected paths lie outside the job directory and are never collected.
"""

import datetime as _dt
import errno
import logging
import math
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from checkpoint_storage._filesystems import (
    DEFAULT_DELETE_PARALLELISM,
    METADATA_FILE_NAME,
    _protocols,
    delete_files,
    format_size,
    join,
    modification_time,
    to_url,
)
from checkpoint_storage._handles import FileStateHandle, SegmentFileStateHandle
from checkpoint_storage._ids import checkpoint_directory_id
from checkpoint_storage._lease import abandoned_by_writer, read_job_lease
from checkpoint_storage._metadata import FLINK
from checkpoint_storage.exceptions import (
    CheckpointIdMismatchError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    ForeignCheckpointError,
    InvalidCheckpointError,
    UnreadableCheckpointError,
    UnsafePathError,
)

__all__ = ["GarbageCollectionResult", "SkippedCheckpoint", "collect_garbage"]

logger = logging.getLogger("checkpoint_storage")

_SHARED_DIR = "shared"
_SAVEPOINT_PREFIX = "savepoint-"
_ATTEMPTS = 3
# Keys of fsspec info/listing entries that carry a modification time, most precise first:
# local disk (mtime), S3 (LastModified), Azure (last_modified), GCS (updated), memory
# (created: memory files are never modified in place).


SKIPPED_FOREIGN = "foreign"
SKIPPED_UNKNOWN_FORMAT = "unknown format"
SKIPPED_ID_MISMATCH = "id mismatch"
SKIPPED_CORRUPT = "corrupt"
SKIPPED_UNREADABLE = "unreadable"


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A ``chk-<id>`` whose `_metadata` could not be read, so all its files were kept.

    ``reason`` is one of ``"foreign"`` (Apache Flink's), ``"unknown format"``, ``"id
    mismatch"``, ``"corrupt"`` or ``"unreadable"``; ``detail`` names the file and the format
    or problem."""

    pointer: str
    metadata: str
    reason: str
    detail: str


@dataclass(frozen=True)
class GarbageCollectionResult:
    """What `collect_garbage` deleted (or, in a dry run, would delete) and what it kept.

    ``deleted`` and ``kept`` are canonical file URLs, sorted; ``kept`` lists every file below
    ``chk-<id>/`` and ``shared/`` that stays. ``removed_directories`` are the empty
    ``chk-<id>`` directories (and empty directories inside them) removed. ``skipped`` are the
    checkpoints whose `_metadata` could not be read (all their files kept); while there are
    any, ``shared/`` was not collected (``shared_collected`` is False).
    """

    deleted: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    bytes_deleted: int = 0
    dry_run: bool = False
    removed_directories: tuple[str, ...] = ()
    skipped: tuple[SkippedCheckpoint, ...] = ()

    @property
    def shared_collected(self) -> bool:
        return not self.skipped

    def summary(self) -> str:
        verb = "would delete" if self.dry_run else "deleted"
        text = (
            f"{'dry run: ' if self.dry_run else ''}{verb} {len(self.deleted)} "
            f"{_plural(len(self.deleted), 'file')} ({_size(self.bytes_deleted)})"
        )
        if self.removed_directories:
            n = len(self.removed_directories)
            text += f" and {n} empty {_plural(n, 'directory', 'directories')}"
        n = len(self.kept)
        text = f"{text}; kept {n} {_plural(n, 'file')}"
        if self.skipped:
            n = len(self.skipped)
            reasons = sorted({s.reason for s in self.skipped})
            text += (
                f"; {n} {_plural(n, 'checkpoint')} could not be read ({', '.join(reasons)}): "
                "all their files and shared/ kept"
            )
        return text


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return word if n == 1 else (plural or word + "s")


def _size(n: int) -> str:
    return f"{n} {_plural(n, 'byte')}" if n < 1024 else format_size(n)


def collect_garbage(
    access,
    *,
    grace_period: _dt.timedelta | float,
    dry_run: bool = False,
    now: _dt.datetime | float | None = None,
    extra_references: Iterable[str] = (),
    max_workers: int = DEFAULT_DELETE_PARALLELISM,
    delete_corrupt: bool = False,
) -> GarbageCollectionResult:
    """Delete unreferenced files older than ``grace_period`` below the job's ``chk-<id>/``
    and ``shared/`` directories, then the ``chk-<id>`` directories left empty.

    ``access`` is a job's ``CheckpointStorageAccess`` with a checkpoint directory.
    ``grace_period`` is a ``timedelta`` or seconds, >= 0; it must exceed the longest time a
    checkpoint takes to complete. ``now`` (an aware datetime or epoch seconds; default: the
    current time) is what ages are measured against. ``extra_references`` are URLs to keep
    as well (a directory keeps everything below it), e.g. the files of a restored snapshot.
    With ``dry_run`` nothing is deleted and the result lists what would be.

    A checkpoint whose `_metadata` cannot be read keeps all its files and suspends the
    collection of ``shared/``; it is listed in the result's ``skipped`` (see the module
    docstring). ``delete_corrupt`` makes checkpoints of this library whose `_metadata` is
    corrupt garbage like aborted ones (still subject to the grace period); foreign, unknown,
    mismatched and unreadable ones are never deleted.

    Raises ``ValueError`` for bad arguments, the filesystem's ``OSError`` for any I/O failure
    while listing or deleting, and ``CheckpointStorageError`` when checkpoints kept
    disappearing while they were read.
    """
    grace = _grace_seconds(grace_period)
    cutoff = _epoch_seconds(now) - grace
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
    if isinstance(extra_references, str):
        raise TypeError("extra_references must be an iterable of URLs, not one string")
    job_url = access.checkpoints_directory
    if job_url is None:
        raise ValueError(
            "this checkpoint storage keeps checkpoints in process memory (no checkpoint "
            "directory): there is nothing on storage to collect"
        )
    fs: AbstractFileSystem = access._fs
    job = access._path(job_url).rstrip("/")
    extra = {_extra_reference(access, url) for url in extra_references}

    listing, referenced, skipped = _list_and_load(
        access, fs, job, job_url, max_workers, bool(delete_corrupt)
    )
    protected = {access._path(s.pointer).rstrip("/") for s in skipped}
    protected |= _being_written(fs, job, listing)
    if any(s.reason == SKIPPED_FOREIGN for s in skipped):
        protected |= {join(job, n) for n in _top_level_names(job, listing)}  # Flink's job
    plan = _plan(fs, job, listing, referenced, extra, cutoff, protected, not skipped)
    if not dry_run:
        _delete(fs, job, plan.delete, max_workers)
        removed = _remove_directories(fs, plan.directories)
    else:
        removed = plan.directories
    result = GarbageCollectionResult(
        deleted=tuple(sorted(to_url(fs, p) for p in plan.delete)),
        kept=tuple(sorted(to_url(fs, p) for p in plan.keep)),
        bytes_deleted=sum(_entry_size(listing[p]) for p in plan.delete),
        dry_run=bool(dry_run),
        removed_directories=tuple(sorted(to_url(fs, p) for p in removed)),
        skipped=tuple(sorted(skipped, key=lambda s: s.pointer)),
    )
    for s in result.skipped:
        logger.warning("garbage collection kept %s (%s): %s", s.pointer, s.reason, s.detail)
    logger.info("garbage collection of %s: %s", job_url, result.summary())
    return result


# --- arguments ---------------------------------------------------------------------------


def _grace_seconds(grace_period: object) -> float:
    if grace_period is None:
        raise TypeError("grace_period must not be None")
    if isinstance(grace_period, _dt.timedelta):
        seconds = grace_period.total_seconds()
    elif isinstance(grace_period, int | float) and not isinstance(grace_period, bool):
        seconds = float(grace_period)
    else:
        raise TypeError(
            f"grace_period must be a timedelta or seconds, got {type(grace_period).__name__}"
        )
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"grace_period must be >= 0, got {grace_period!r}")
    return seconds


def _epoch_seconds(now: object) -> float:
    if now is None:
        return _dt.datetime.now(_dt.UTC).timestamp()
    if isinstance(now, _dt.datetime):
        if now.tzinfo is None or now.utcoffset() is None:
            raise ValueError("now must be an aware datetime (with a time zone) or epoch seconds")
        return now.timestamp()
    if isinstance(now, int | float) and not isinstance(now, bool) and math.isfinite(now):
        return float(now)
    raise ValueError(f"now must be an aware datetime or finite epoch seconds, got {now!r}")


def _extra_reference(access, url: object) -> str:
    if not isinstance(url, str) or not url:
        raise TypeError(f"extra_references must be non-empty URL strings, got {url!r}")
    return access._path(url).rstrip("/")


# --- listing and loading -----------------------------------------------------------------


def _list_tree(fs: AbstractFileSystem, root: str) -> dict[str, dict]:
    """Every entry strictly below ``root`` (stripped path -> info), {} if root is missing.

    Memory and S3 list the whole tree in one pass (one paginated LIST on S3). Elsewhere the
    tree is walked with ``ls``, raising every error but FileNotFoundError of a directory
    that vanished meanwhile (fsspec's ``walk`` silently omits failed subdirectories), and not
    descending into symbolic links.
    """
    fs.invalidate_cache(root)
    if isinstance(fs, MemoryFileSystem) or "s3" in _protocols(fs):
        found = fs.find(root, withdirs=True, detail=True)
        return {
            name.rstrip("/"): info
            for name, info in found.items()
            if name.rstrip("/").startswith(root + "/")
        }
    out: dict[str, dict] = {}
    pending = [root]
    while pending:
        directory = pending.pop()
        try:
            entries = fs.ls(directory, detail=True)
        except FileNotFoundError:
            continue
        for info in entries:
            name = info["name"].rstrip("/")
            if name == directory or not name.startswith(directory + "/"):
                continue
            out[name] = info
            if info.get("type") == "directory" and not info.get("islink"):
                pending.append(name)
    return out


class _CheckpointVanished(Exception):
    pass


def _list_and_load(access, fs, job: str, job_url: str, max_workers: int, delete_corrupt: bool):
    """The listing of the job directory, the stripped paths its retained checkpoints
    reference and the checkpoints that could not be read; restarts when a listed checkpoint
    disappears before it is loaded."""
    for attempt in range(1, _ATTEMPTS + 1):
        listing = _list_tree(fs, job)
        # Any entry named _metadata (a file, a directory, a link, a FIFO) makes the checkpoint
        # one to read: only a missing _metadata means "aborted".
        completed = sorted(
            name
            for name in _top_level_names(job, listing)
            if checkpoint_directory_id(name) is not None
            and join(job, name, METADATA_FILE_NAME) in listing
        )

        def load(name: str):
            return _references_of(access, fs, job, job_url, name, delete_corrupt)

        try:
            if len(completed) <= 1 or max_workers <= 1:
                loaded = [load(n) for n in completed]
            else:
                with ThreadPoolExecutor(max_workers=min(max_workers, len(completed))) as pool:
                    loaded = list(pool.map(load, completed))
        except _CheckpointVanished as exc:
            logger.info("%s; listing again (attempt %d of %d)", exc, attempt, _ATTEMPTS)
            last = exc
            continue
        referenced = set().union(*(r for r in loaded if isinstance(r, set)))
        return listing, referenced, [r for r in loaded if isinstance(r, SkippedCheckpoint)]
    raise CheckpointStorageError(
        f"checkpoints of {job_url} kept disappearing while garbage was collected ({last}); "
        "the job is discarding checkpoints right now: run the collection again later"
    )


def _being_written(fs: AbstractFileSystem, job: str, listing: Mapping[str, dict]) -> set[str]:
    """The ``chk-<id>`` directories without `_metadata` that the job lease's current holder
    may still be writing (stripped paths), judged by the lease now and the newest
    modification time below each."""
    newest: dict[str, float | None] = {}
    for path, info in listing.items():
        top = path[len(job) + 1 :].split("/", 1)[0]
        if checkpoint_directory_id(top) is None or join(job, top, METADATA_FILE_NAME) in listing:
            continue
        directory = join(job, top)
        newest[directory] = _newest(newest.get(directory), modification_time(info))
    if not newest:
        return set()
    record = read_job_lease(fs, job)
    if record is None:  # never leased: the grace period alone
        return set()
    kept = set()
    for directory, modified in sorted(newest.items()):
        if abandoned_by_writer(record, modified) is None:
            logger.info(
                "garbage collection kept %s (no _metadata): the job lease's holder may still "
                "be writing it (%s)", to_url(fs, directory), record.describe(),
            )  # fmt: skip
            kept.add(directory)
    return kept


def _top_level_names(job: str, listing: Mapping[str, dict]) -> set[str]:
    return {name[len(job) + 1 :].split("/", 1)[0] for name in listing}


def _references_of(
    access, fs, job: str, job_url: str, name: str, delete_corrupt: bool
) -> "set[str] | SkippedCheckpoint":
    """The stripped paths checkpoint ``name`` references (its `_metadata` and file handles),
    or why it cannot be read; an empty set for a corrupt one when ``delete_corrupt``."""
    directory = join(job_url, name)
    metadata_url = join(directory, METADATA_FILE_NAME)
    try:
        metadata = access.resolve_checkpoint(directory).load_metadata(checkpoint_directory_id(name))
    except CheckpointNotFoundError as exc:
        raise _CheckpointVanished(f"{directory} disappeared while it was read") from exc
    except ForeignCheckpointError as exc:
        reason = SKIPPED_FOREIGN if exc.format_name == FLINK else SKIPPED_UNKNOWN_FORMAT
        return SkippedCheckpoint(directory, metadata_url, reason, _one_line(exc))
    except CheckpointIdMismatchError as exc:
        return SkippedCheckpoint(directory, metadata_url, SKIPPED_ID_MISMATCH, _one_line(exc))
    except UnreadableCheckpointError as exc:
        return SkippedCheckpoint(directory, metadata_url, SKIPPED_UNREADABLE, _one_line(exc))
    except (InvalidCheckpointError, UnsafePathError) as exc:
        if not delete_corrupt:
            return SkippedCheckpoint(directory, metadata_url, SKIPPED_CORRUPT, _one_line(exc))
        logger.warning(
            "checkpoint %s is corrupt and references nothing (delete_corrupt): its files are "
            "garbage once older than the grace period: %s",
            directory,
            exc,
        )
        return set()
    paths = {join(job, name, METADATA_FILE_NAME)}
    for handle in metadata.all_handles():
        if isinstance(handle, FileStateHandle | SegmentFileStateHandle):
            # A physical file of file merging is live while any segment in it is referenced.
            paths.add(access._path(handle.path).rstrip("/"))
    return paths


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# --- planning ----------------------------------------------------------------------------


@dataclass
class _Plan:
    delete: list[str]
    keep: list[str]
    directories: list[str]


def _plan(
    fs,
    job: str,
    listing,
    referenced: set[str],
    extra: set[str],
    cutoff: float,
    protected: set[str],
    collect_shared: bool,
) -> _Plan:
    """What to delete and keep. ``protected`` are ``chk-<id>`` directories (stripped paths)
    kept whole; ``shared/`` is only collected when ``collect_shared``."""
    delete: list[str] = []
    keep: list[str] = []
    # chk-<id> directory -> (its directories, whether everything below it goes, newest time)
    trees: dict[str, list] = {}
    for path, info in listing.items():
        parts = path[len(job) + 1 :].split("/")
        top = parts[0]
        is_chk = checkpoint_directory_id(top) is not None
        if not (is_chk or top == _SHARED_DIR):
            continue  # taskowned/, savepoint-*, anything else in the job directory
        is_dir = info.get("type") == "directory"
        if is_chk:
            tree = trees.setdefault(join(job, top), [[], True, None])
            tree[2] = _newest(tree[2], modification_time(info))
            if join(job, top) in protected:
                tree[1] = False  # kept whole, even its empty directories
        if is_dir and info.get("islink"):
            keep.append(path)  # a link to a directory: never followed, never removed
            if is_chk:
                tree[1] = False
            continue
        if is_dir:
            if is_chk:
                tree[0].append(path)
                if any(part.startswith(_SAVEPOINT_PREFIX) for part in parts):
                    tree[1] = False
            continue
        if len(parts) < 2:
            continue  # a file named like a directory of the job: not ours to judge
        guarded = join(job, top) in protected or (top == _SHARED_DIR and not collect_shared)
        if not guarded and _deletable(path, info, parts, referenced, extra, cutoff):
            delete.append(path)
        else:
            keep.append(path)
            if is_chk:
                tree[1] = False
    directories: list[str] = []
    if _has_real_directories(fs):
        for top, (dirs, all_gone, newest) in trees.items():
            if all_gone and top in dirs and newest is not None and newest < cutoff:
                directories.extend(dirs)
    directories.sort(key=lambda d: (-d.count("/"), d))
    return _Plan(delete, keep, directories)


def _newest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else max(a, b)


def _deletable(path: str, info, parts, referenced: set[str], extra: set[str], cutoff) -> bool:
    if info.get("type") != "file" or info.get("islink"):
        return False
    if any(part.startswith(_SAVEPOINT_PREFIX) for part in parts):
        return False
    if path in referenced or _under_any(path, extra):
        return False
    modified = modification_time(info)
    return modified is not None and modified < cutoff


def _under_any(path: str, roots: set[str]) -> bool:
    if path in roots:
        return True
    parent = path
    while "/" in parent:
        parent = parent.rsplit("/", 1)[0]
        if parent in roots:
            return True
    return False


def _has_real_directories(fs: AbstractFileSystem) -> bool:
    """Whether empty directories persist (and may be removed): local disk and memory. On
    object stores a directory is a key prefix and never removed here (s3fs's ``rmdir``
    deletes buckets)."""
    return isinstance(fs, LocalFileSystem | MemoryFileSystem)


# --- deleting ----------------------------------------------------------------------------


def _delete(fs: AbstractFileSystem, job: str, paths: list[str], max_workers: int) -> None:
    delete_files(fs, paths, max_workers)
    fs.invalidate_cache(job)


def _remove_directories(fs: AbstractFileSystem, directories: list[str]) -> list[str]:
    """Remove empty directories, deepest first; one that gained content meanwhile stays."""
    removed: list[str] = []
    for directory in directories:
        try:
            fs.rmdir(directory)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                logger.info("not removing %s: it is no longer empty", directory)
                continue
            raise
        finally:
            fs.invalidate_cache(directory)
        removed.append(directory)
    return removed


def _entry_size(info: Mapping) -> int:
    size = info.get("size")
    return int(size) if isinstance(size, int | float) and size > 0 else 0
