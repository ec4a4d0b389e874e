"""Apache Flink's checkpoint directories on a filesystem: read, verify, and find (and, only
when asked, delete) the files of a job directory that no retained checkpoint references.

A Flink job directory is ``<base>/<job id>/`` with ``chk-<id>/`` (each with `_metadata` and
the exclusive state), ``shared/`` (incremental RocksDB files, file-merging shared segments)
and ``taskowned/``. Files in ``shared/`` stay when the checkpoints that used them are gone
after failures, cancellations or a restore in CLAIM mode; nothing in Flink lists them.
``find_orphans`` does: the files under ``shared/`` and ``taskowned/`` that no retained
checkpoint of the directory (Flink's or this library's) references, and the files the
directory's checkpoints reference outside it (another job's ``shared/``).

``delete_orphans`` deletes only with ``confirm=True``, only files older than the grace
period, only after listing again and finding the same retained checkpoints (a checkpoint
that appeared since could reference them), never a file a checkpoint under an
``also_referenced_by`` directory references, and never while some `_metadata` cannot be
read (what it references is unknown: it is reported and everything is kept).
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from fsspec import AbstractFileSystem

from checkpoint_storage._access import resolve_checkpoint_pointer
from checkpoint_storage._filesystems import modification_time, to_url, url_to_fs
from checkpoint_storage._flink_metadata import (
    FlinkCheckpointMetadata,
    is_flink_metadata,
    parse_flink_metadata,
)
from checkpoint_storage._handles import FileStateHandle, SegmentFileStateHandle
from checkpoint_storage._ids import checkpoint_directory_id
from checkpoint_storage._metadata import MAX_METADATA_BYTES
from checkpoint_storage.exceptions import (
    CheckpointNotFoundError,
    CheckpointStorageError,
    FlinkMetadataError,
    OrphanDeletionRefusedError,
)

METADATA = "_metadata"
ORPHAN_DIRECTORIES = ("shared", "taskowned")


# --- one checkpoint ----------------------------------------------------------------------


def _metadata_file(fs: AbstractFileSystem, path: str) -> tuple[str, str]:
    """(checkpoint directory, `_metadata` path) of a pointer to either."""
    if posixpath.basename(path) == METADATA and fs.isfile(path):
        return posixpath.dirname(path), path
    return path, posixpath.join(path, METADATA)


def _read_metadata_bytes(fs: AbstractFileSystem, metadata: str, url: str) -> bytes:
    try:
        size = fs.size(metadata)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no _metadata in {url}") from None
    if size is not None and size > MAX_METADATA_BYTES:
        raise FlinkMetadataError(
            f"{url}: _metadata has {size} bytes, more than the {MAX_METADATA_BYTES} a "
            "_metadata can reasonably have; it is kept as is"
        )
    with fs.open(metadata, "rb") as f:
        return f.read(MAX_METADATA_BYTES + 1)


def is_flink_checkpoint(pointer: str, storage_options: dict | None = None) -> bool:
    """Whether ``pointer`` (a checkpoint/savepoint directory or its `_metadata`) holds a
    `_metadata` written by Apache Flink (by its magic number; nothing else is read)."""
    fs, path = url_to_fs(pointer, storage_options)
    directory, metadata = _metadata_file(fs, path)
    try:
        with fs.open(metadata, "rb") as f:
            return is_flink_metadata(f.read(4))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError):
        return False


def read_flink_checkpoint(
    pointer: str, storage_options: dict | None = None, remap: Sequence[tuple[str, str]] = ()
) -> FlinkCheckpointMetadata:
    """The parsed `_metadata` of a Flink checkpoint or savepoint (its directory or the file).
    ``remap``: (old, new) prefixes for absolute paths written on another machine."""
    fs, path = url_to_fs(pointer, storage_options)
    directory, metadata = _metadata_file(fs, path)
    url = to_url(fs, metadata)
    data = _read_metadata_bytes(fs, metadata, url)
    return parse_flink_metadata(data, directory=to_url(fs, directory), source=url, remap=remap)


@dataclass(frozen=True)
class FlinkFileProblem:
    """A referenced file that is ``missing``, of the wrong size (``corrupt``) or
    ``unreadable``."""

    path: str
    kind: str
    reason: str


@dataclass(frozen=True)
class FlinkVerificationReport:
    """What ``verify_flink_checkpoint`` found: the files checked, the bytes in them and
    inline, and the problems (``ok`` when there are none)."""

    pointer: str
    checkpoint_id: int
    files_checked: int
    bytes_in_files: int
    inline_bytes: int
    problems: tuple[FlinkFileProblem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_flink_checkpoint(
    pointer: str, storage_options: dict | None = None, remap: Sequence[tuple[str, str]] = ()
) -> FlinkVerificationReport:
    """Check that every file a Flink checkpoint references exists with the size its handles
    record (a whole file exactly, a file-merging physical file at least to its last segment's
    end, a key-groups file beyond its last offset). Flink records no checksums, so sizes and
    offsets are what can be checked without reading the state. `_metadata` itself that cannot
    be parsed raises ``FlinkMetadataError``."""
    metadata = read_flink_checkpoint(pointer, storage_options, remap)
    fs, _ = url_to_fs(metadata.directory, storage_options)
    ends = _key_group_ends(metadata)
    problems = []
    total = 0
    for path, ref in sorted(metadata.referenced_files().items()):
        try:
            actual = file_size(path, storage_options)
        except FileNotFoundError:
            problems.append(FlinkFileProblem(path, "missing", f"{path} is referenced but missing"))
            continue
        except OSError as exc:
            problems.append(FlinkFileProblem(path, "unreadable", f"{path}: {exc}"))
            continue
        total += actual
        if ref.whole_file_size is not None and actual != ref.whole_file_size:
            reason = f"{path} has {actual} bytes, its handle records {ref.whole_file_size}"
        elif actual < ref.needed_bytes:
            reason = f"{path} has {actual} bytes, its segments need {ref.needed_bytes}"
        elif actual <= ends.get(path, -1):
            reason = f"{path} has {actual} bytes, a key group starts at {ends[path]}"
        else:
            continue
        problems.append(FlinkFileProblem(path, "corrupt", reason))
    return FlinkVerificationReport(
        to_url(fs, metadata.directory),
        metadata.checkpoint_id,
        len(metadata.referenced_files()),
        total,
        metadata.inline_bytes(),
        tuple(problems),
    )


def file_size(path: str, storage_options: dict | None = None) -> int:
    """The size of a referenced file, on the filesystem its own URL names (a checkpoint may
    reference files on another filesystem than its `_metadata`'s)."""
    fs, fs_path = url_to_fs(path, storage_options)
    return fs.size(fs_path)


def _key_group_ends(metadata: FlinkCheckpointMetadata) -> dict[str, int]:
    ends: dict[str, int] = {}
    for op in metadata.operators:
        for subtask in op.subtasks:
            for keyed in (subtask.managed_keyed_state, subtask.raw_keyed_state):
                if keyed is None or keyed.delegate is None or keyed.delegate.path is None:
                    continue
                if keyed.offsets:
                    path = keyed.delegate.path
                    ends[path] = max(ends.get(path, -1), max(keyed.offsets))
    return ends


# --- orphans -----------------------------------------------------------------------------


@dataclass(frozen=True)
class OrphanFile:
    """A file under ``shared/`` or ``taskowned/`` that no retained checkpoint references;
    ``modified`` is None when the filesystem does not say."""

    path: str
    size: int
    modified: datetime | None

    def age(self, now: datetime) -> timedelta | None:
        return None if self.modified is None else now - self.modified


@dataclass(frozen=True)
class ExternalReference:
    """A file the job's checkpoints reference outside its directory. ``size`` is its size
    now (None when ``missing``); ``checkpoint_ids`` the checkpoints that reference it."""

    path: str
    size: int | None
    checkpoint_ids: tuple[int, ...]

    @property
    def missing(self) -> bool:
        return self.size is None


@dataclass(frozen=True)
class RetainedCheckpoint:
    """A ``chk-<id>`` directory with a `_metadata` that was read: who wrote it and how many
    files it references."""

    pointer: str
    checkpoint_id: int
    writer: str  # "Apache Flink" or "this library"
    files: int


@dataclass(frozen=True)
class UnreadableCheckpoint:
    """A `_metadata` that could not be read (and why): it blocks ``delete_orphans``."""

    pointer: str
    reason: str


@dataclass(frozen=True)
class OrphanReport:
    """What ``find_orphans`` found in a job directory at ``listed_at``."""

    job_dir: str
    listed_at: datetime
    retained: tuple[RetainedCheckpoint, ...]
    unreadable: tuple[UnreadableCheckpoint, ...]
    incomplete: tuple[str, ...]  # chk-<id> directories without _metadata
    orphans: tuple[OrphanFile, ...]
    referenced_inside: int
    external: tuple[ExternalReference, ...]
    also_referenced_by: tuple[str, ...] = ()
    protected_by_others: tuple[str, ...] = ()
    remap: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    @property
    def orphan_bytes(self) -> int:
        return sum(f.size for f in self.orphans)

    @property
    def newest_checkpoint_id(self) -> int | None:
        return max((c.checkpoint_id for c in self.retained), default=None)


def _children(fs: AbstractFileSystem, path: str) -> list[dict]:
    try:
        return [e for e in fs.ls(path, detail=True)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _checkpoint_dirs(fs: AbstractFileSystem, path: str, depth: int = 2) -> list[str]:
    """The checkpoint or savepoint directories at or below ``path`` (a checkpoint, a job
    directory, a savepoints directory, or a base of job directories)."""
    if fs.exists(posixpath.join(path, METADATA)):
        return [path]
    found = []
    for entry in _children(fs, path):
        if entry.get("type") != "directory":
            continue
        name = posixpath.basename(entry["name"].rstrip("/"))
        child = posixpath.join(path, name)
        if checkpoint_directory_id(name) is not None or name.startswith("savepoint-"):
            if fs.exists(posixpath.join(child, METADATA)):
                found.append(child)
        elif depth > 1 and name not in ORPHAN_DIRECTORIES:
            found.extend(_checkpoint_dirs(fs, child, depth - 1))
    return found


def _references(
    fs: AbstractFileSystem, pointer: str, storage_options: dict | None, remap
) -> tuple[int, str, set[str]]:
    """(checkpoint id, writer, referenced file URLs) of one checkpoint directory."""
    url = to_url(fs, pointer)
    with fs.open(posixpath.join(pointer, METADATA), "rb") as f:
        head = f.read(4)
    if is_flink_metadata(head):
        metadata = read_flink_checkpoint(url, storage_options, remap)
        return metadata.checkpoint_id, "Apache Flink", set(metadata.referenced_files())
    completed = resolve_checkpoint_pointer(url, storage_options)
    ours = completed.load_metadata()
    paths = {
        h.path
        for h in ours.all_handles()
        if isinstance(h, (FileStateHandle, SegmentFileStateHandle))
    }
    return ours.checkpoint_id, "this library", paths


def _read_all(
    fs: AbstractFileSystem, pointers: Iterable[str], storage_options, remap
) -> tuple[list[RetainedCheckpoint], list[UnreadableCheckpoint], dict[str, list[int]]]:
    retained, unreadable, referenced = [], [], {}
    for pointer in sorted(pointers):
        url = to_url(fs, pointer)
        try:
            checkpoint_id, writer, paths = _references(fs, pointer, storage_options, remap)
        except (CheckpointStorageError, OSError, ValueError) as exc:
            unreadable.append(UnreadableCheckpoint(url, f"{type(exc).__name__}: {exc}"))
            continue
        retained.append(RetainedCheckpoint(url, checkpoint_id, writer, len(paths)))
        for path in paths:
            referenced.setdefault(path, []).append(checkpoint_id)
    return retained, unreadable, referenced


def _listing(fs: AbstractFileSystem, job: str) -> dict[str, dict]:
    files = {}
    for name in ORPHAN_DIRECTORIES:
        root = posixpath.join(job, name)
        if not fs.isdir(root):
            continue
        for path, info in fs.find(root, detail=True).items():
            if info.get("type") == "file":
                files[to_url(fs, path)] = info
    return files


def find_orphans(
    job_dir: str,
    *,
    storage_options: dict | None = None,
    remap: Sequence[tuple[str, str]] = (),
    also_referenced_by: Sequence[str] = (),
) -> OrphanReport:
    """The files under ``job_dir``'s ``shared/`` and ``taskowned/`` that no retained
    checkpoint of ``job_dir`` (``chk-<id>`` with a `_metadata`, Flink's or this library's)
    nor any checkpoint below an ``also_referenced_by`` directory references, and the files
    ``job_dir``'s checkpoints reference outside it. Reads and lists only; deletes nothing."""
    fs, job = url_to_fs(job_dir, storage_options)
    job_url = to_url(fs, job)
    listed_at = datetime.now(UTC)
    own = [
        posixpath.join(job, posixpath.basename(e["name"].rstrip("/")))
        for e in _children(fs, job)
        if e.get("type") == "directory"
        and checkpoint_directory_id(posixpath.basename(e["name"].rstrip("/"))) is not None
    ]
    with_metadata = [p for p in own if fs.exists(posixpath.join(p, METADATA))]
    incomplete = tuple(to_url(fs, p) for p in own if p not in with_metadata)
    retained, unreadable, referenced = _read_all(fs, with_metadata, storage_options, remap)
    others: set[str] = set()
    for other in also_referenced_by:
        ofs, opath = url_to_fs(other, storage_options)
        _, other_unreadable, other_refs = _read_all(
            ofs, _checkpoint_dirs(ofs, opath), storage_options, remap
        )
        unreadable.extend(other_unreadable)
        others.update(other_refs)
    files = _listing(fs, job)
    orphans, protected = [], []
    for path, info in sorted(files.items()):
        if path in referenced:
            continue
        if path in others:
            protected.append(path)
            continue
        mtime = modification_time(info)
        modified = None if mtime is None else datetime.fromtimestamp(mtime, UTC)
        orphans.append(OrphanFile(path, int(info.get("size") or 0), modified))
    external = []
    for path, ids in sorted(referenced.items()):
        if path == job_url or path.startswith(job_url.rstrip("/") + "/"):
            continue
        try:
            size = file_size(path, storage_options)
        except (FileNotFoundError, OSError):
            size = None
        external.append(ExternalReference(path, size, tuple(sorted(set(ids)))))
    inside = sum(1 for p in referenced if p in files)
    return OrphanReport(
        job_url,
        listed_at,
        tuple(sorted(retained, key=lambda c: c.checkpoint_id)),
        tuple(unreadable),
        incomplete,
        tuple(orphans),
        inside,
        tuple(external),
        tuple(also_referenced_by),
        tuple(protected),
        tuple(remap),
    )


@dataclass(frozen=True)
class OrphanDeletion:
    """What ``delete_orphans`` did: the files deleted, those kept (younger than the grace
    period, or referenced by an ``also_referenced_by`` directory) and those whose deletion
    failed, with the reason."""

    deleted: tuple[str, ...]
    bytes_deleted: int
    kept_young: tuple[str, ...]
    kept_referenced: tuple[str, ...]
    failed: tuple[tuple[str, str], ...]


def delete_orphans(
    report: OrphanReport,
    *,
    confirm: bool,
    grace_period: timedelta,
    storage_options: dict | None = None,
    clock=time.time,
) -> OrphanDeletion:
    """Delete the orphans of ``report`` that are still orphans when listed again and older
    than ``grace_period``. Refuses (``OrphanDeletionRefusedError``, nothing deleted) without
    ``confirm``, while a `_metadata` cannot be read, or when the retained checkpoints differ
    from the report's (one appeared or went since: list again and review)."""
    if not confirm:
        raise OrphanDeletionRefusedError(
            f"{report.job_dir}: deleting orphans needs explicit confirmation; nothing deleted"
        )
    if grace_period < timedelta(0):
        raise ValueError("the grace period cannot be negative")
    if report.unreadable:
        raise OrphanDeletionRefusedError(
            f"{report.job_dir}: {len(report.unreadable)} checkpoint(s) cannot be read (first: "
            f"{report.unreadable[0].pointer}); what they reference is unknown, so nothing is "
            "deleted: fix or remove them first"
        )
    fresh = find_orphans(
        report.job_dir,
        storage_options=storage_options,
        remap=report.remap,
        also_referenced_by=report.also_referenced_by,
    )
    before = {(c.pointer, c.checkpoint_id) for c in report.retained}
    after = {(c.pointer, c.checkpoint_id) for c in fresh.retained}
    if before != after or fresh.unreadable:
        appeared = sorted(p for p, _ in after - before) or [u.pointer for u in fresh.unreadable]
        raise OrphanDeletionRefusedError(
            f"{report.job_dir}: the retained checkpoints changed since the listing "
            f"({', '.join(appeared) or 'one went'}); nothing deleted: list the orphans again"
        )
    still = {f.path: f for f in fresh.orphans}
    now = datetime.fromtimestamp(clock(), UTC)
    fs, _ = url_to_fs(report.job_dir, storage_options)
    deleted, young, referenced, failed = [], [], [], []
    total = 0
    for orphan in report.orphans:
        current = still.get(orphan.path)
        if current is None:
            referenced.append(orphan.path)
            continue
        age = current.age(now)
        if age is None or age < grace_period:
            young.append(orphan.path)
            continue
        try:
            fs.rm_file(url_to_fs(orphan.path, storage_options)[1])
        except FileNotFoundError:
            continue
        except OSError as exc:
            failed.append((orphan.path, str(exc)))
            continue
        deleted.append(orphan.path)
        total += current.size
    return OrphanDeletion(tuple(deleted), total, tuple(young), tuple(referenced), tuple(failed))
