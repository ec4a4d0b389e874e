"""Listing the checkpoints and savepoints below a directory (their kind, status, size and
statistics, without reading their state) and finding the latest: the ``checkpoints list``
and ``latest`` commands are thin layers over these functions.

Functions that take a directory take the fsspec ``storage_options`` of its filesystem (e.g.
an S3 ``endpoint_url``); they go to fsspec and are never put into messages.
"""

import dataclasses
import logging
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from fsspec import AbstractFileSystem

from checkpoint_storage._discovery import discover_checkpoint_directories, lists_by_prefix
from checkpoint_storage._filesystems import (
    METADATA_FILE_NAME,
    parent_and_name,
    to_url,
    url_to_fs,
)
from checkpoint_storage._filesystems import modification_time as _epoch_modification_time
from checkpoint_storage._handles import FileStateHandle, SegmentFileStateHandle
from checkpoint_storage._ids import JobID, checkpoint_directory_id, is_job_id
from checkpoint_storage._lease import LeaseRecord, abandoned_by_writer, read_job_lease
from checkpoint_storage._metadata import FLINK, CheckpointMetadata
from checkpoint_storage._statistics import checkpoint_statistics
from checkpoint_storage._storage import FileSystemCheckpointStorage
from checkpoint_storage._tools import (
    KIND_CHECKPOINT,
    KIND_SAVEPOINT,
    _one_line,
    _resolve,
    snapshot_kind,
)
from checkpoint_storage.exceptions import (
    CheckpointNotFoundError,
    ForeignCheckpointError,
    InvalidCheckpointError,
    UnreadableCheckpointError,
    UnsafePathError,
)

__all__ = [
    "CheckpointInfo",
    "job_storage",
    "latest_checkpoint",
    "list_checkpoints",
    "list_checkpoints_below",
    "modification_time",
]

logger = logging.getLogger("checkpoint_storage")

LIST_PARALLELISM = 8
SEARCH_DEPTH = 2  # list_checkpoints_below: e.g. <data>/savepoints/scheduled

_SAVEPOINT_DIR = re.compile(r"savepoint-([0-9a-f]{6})-[0-9a-f]+")

STATUS_COMPLETED = "completed"
STATUS_INVALID = "invalid"
STATUS_IN_PROGRESS = "in-progress"
STATUS_ABANDONED = "abandoned"
STATUS_FOREIGN = "foreign"
STATUS_UNREADABLE = "unreadable"
KIND_FLINK = "flink"


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
