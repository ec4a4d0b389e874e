"""Garbage collection of a job's checkpoint directory (issue 3, DESIGN §3.2-3.3).

Deletes the files below ``<job>/chk-<id>/`` and ``<job>/shared/`` that no retained checkpoint
references and that are older than a grace period: orphans of crashed writers and failed task
attempts, aborted checkpoints (``chk-<id>`` without `_metadata`), invalid checkpoints and temp
files of a crashed local `_metadata` publish. Then it removes the ``chk-<id>`` directories this
left empty (local disk and memory; on object stores a directory vanishes with its last object).

File merging: a physical file below ``shared/<operator>_<subtask>_<parallelism>_/`` is
referenced while any retained checkpoint holds a ``SegmentFileStateHandle`` in it, and is
collected like any other shared file once none does (after the grace period).

Never deleted: anything a retained checkpoint or ``extra_references`` names, anything younger
than the grace period or without a modification time, ``taskowned/``, anything with a
``savepoint-*`` path segment, symbolic links, and anything outside the job directory.

Retained checkpoints are the ``chk-<id>`` directories whose `_metadata` exists and validates.
A provably invalid `_metadata` (corrupt, truncated, unsafe paths) references nothing and is
logged; one of a newer format version stops the collection (its references are unknown). Any
I/O error (permission, timeout, 5xx) while listing or loading is raised, never read as
"unreferenced".

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
import re
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
from checkpoint_storage._metadata import FORMAT_VERSION, HEADER_SIZE, MAGIC
from checkpoint_storage.exceptions import (
    CheckpointNotFoundError,
    CheckpointStorageError,
    InvalidCheckpointError,
    UnsafePathError,
)

__all__ = ["GarbageCollectionResult", "collect_garbage"]

logger = logging.getLogger("checkpoint_storage")

_CHK_DIR = re.compile(r"chk-(0|[1-9][0-9]*)")
_SHARED_DIR = "shared"
_SAVEPOINT_PREFIX = "savepoint-"
_ATTEMPTS = 3
# Keys of fsspec info/listing entries that carry a modification time, most precise first:
# local disk (mtime), S3 (LastModified), Azure (last_modified), GCS (updated), memory
# (created: memory files are never modified in place).


@dataclass(frozen=True)
class GarbageCollectionResult:
    """What `collect_garbage` deleted (or, in a dry run, would delete) and what it kept.

    ``deleted`` and ``kept`` are canonical file URLs, sorted; ``kept`` lists every file below
    ``chk-<id>/`` and ``shared/`` that stays. ``removed_directories`` are the empty
    ``chk-<id>`` directories (and empty directories inside them) removed.
    """

    deleted: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    bytes_deleted: int = 0
    dry_run: bool = False
    removed_directories: tuple[str, ...] = ()

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
        return f"{text}; kept {n} {_plural(n, 'file')}"


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
) -> GarbageCollectionResult:
    """Delete unreferenced files older than ``grace_period`` below the job's ``chk-<id>/``
    and ``shared/`` directories, then the ``chk-<id>`` directories left empty.

    ``access`` is a job's ``CheckpointStorageAccess`` with a checkpoint directory.
    ``grace_period`` is a ``timedelta`` or seconds, >= 0; it must exceed the longest time a
    checkpoint takes to complete. ``now`` (an aware datetime or epoch seconds; default: the
    current time) is what ages are measured against. ``extra_references`` are URLs to keep
    as well (a directory keeps everything below it), e.g. the files of a restored snapshot.
    With ``dry_run`` nothing is deleted and the result lists what would be.

    Raises ``ValueError`` for bad arguments, the filesystem's ``OSError`` for any I/O failure
    while listing, loading or deleting, and ``CheckpointStorageError`` when a `_metadata` has
    a newer format version or checkpoints kept disappearing while they were read.
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

    listing, referenced = _list_and_load(access, fs, job, job_url, max_workers)
    plan = _plan(fs, job, listing, referenced, extra, cutoff)
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
    )
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


def _list_and_load(access, fs, job: str, job_url: str, max_workers: int):
    """The listing of the job directory and the stripped paths its retained checkpoints
    reference; restarts when a listed checkpoint disappears before it is loaded."""
    for attempt in range(1, _ATTEMPTS + 1):
        listing = _list_tree(fs, job)
        completed = sorted(
            name
            for name in _top_level_names(job, listing)
            if _CHK_DIR.fullmatch(name)
            and listing.get(join(job, name, METADATA_FILE_NAME), {}).get("type") == "file"
        )
        try:
            if len(completed) <= 1 or max_workers <= 1:
                loaded = [_references_of(access, fs, job, job_url, n) for n in completed]
            else:
                with ThreadPoolExecutor(max_workers=min(max_workers, len(completed))) as pool:
                    loaded = list(
                        pool.map(lambda n: _references_of(access, fs, job, job_url, n), completed)
                    )
        except _CheckpointVanished as exc:
            logger.info("%s; listing again (attempt %d of %d)", exc, attempt, _ATTEMPTS)
            last = exc
            continue
        return listing, set().union(*loaded)
    raise CheckpointStorageError(
        f"checkpoints of {job_url} kept disappearing while garbage was collected ({last}); "
        "the job is discarding checkpoints right now: run the collection again later"
    )


def _top_level_names(job: str, listing: Mapping[str, dict]) -> set[str]:
    return {name[len(job) + 1 :].split("/", 1)[0] for name in listing}


def _references_of(access, fs, job: str, job_url: str, name: str) -> set[str]:
    """The stripped paths checkpoint ``name`` references: its `_metadata` and file handles;
    nothing when its `_metadata` is provably invalid."""
    directory = join(job_url, name)
    try:
        metadata = access.resolve_checkpoint(directory).load_metadata()
    except CheckpointNotFoundError as exc:
        raise _CheckpointVanished(f"{directory} disappeared while it was read") from exc
    except (InvalidCheckpointError, UnsafePathError) as exc:
        _refuse_newer_format(fs, join(job, name, METADATA_FILE_NAME), directory)
        logger.warning(
            "checkpoint %s is invalid and references nothing; its files are garbage once "
            "older than the grace period: %s",
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


def _refuse_newer_format(fs, metadata_path: str, directory: str) -> None:
    """A `_metadata` of a newer format version is unreadable here, not invalid: what it
    references is unknown, so nothing may be collected."""
    try:
        header = fs.cat_file(metadata_path, start=0, end=HEADER_SIZE)
    except FileNotFoundError as exc:
        raise _CheckpointVanished(f"{directory} disappeared while it was read") from exc
    if len(header) < len(MAGIC) + 2 or header[: len(MAGIC)] != MAGIC:
        return
    version = int.from_bytes(header[len(MAGIC) : len(MAGIC) + 2], "big")
    if version > FORMAT_VERSION:
        raise CheckpointStorageError(
            f"{directory} is a checkpoint of format version {version}, newer than this "
            f"library reads ({FORMAT_VERSION}); what it references is unknown, so no garbage "
            "was collected: upgrade the library and run the collection again"
        )


# --- planning ----------------------------------------------------------------------------


@dataclass
class _Plan:
    delete: list[str]
    keep: list[str]
    directories: list[str]


def _plan(fs, job: str, listing, referenced: set[str], extra: set[str], cutoff: float) -> _Plan:
    delete: list[str] = []
    keep: list[str] = []
    # chk-<id> directory -> (its directories, whether everything below it goes, newest time)
    trees: dict[str, list] = {}
    for path, info in listing.items():
        parts = path[len(job) + 1 :].split("/")
        top = parts[0]
        is_chk = bool(_CHK_DIR.fullmatch(top))
        if not (is_chk or top == _SHARED_DIR):
            continue  # taskowned/, savepoint-*, anything else in the job directory
        is_dir = info.get("type") == "directory"
        if is_chk:
            tree = trees.setdefault(join(job, top), [[], True, None])
            tree[2] = _newest(tree[2], modification_time(info))
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
        if _deletable(path, info, parts, referenced, extra, cutoff):
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
