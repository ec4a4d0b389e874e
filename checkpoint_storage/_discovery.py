"""Discovery of a job's ``chk-<id>`` directories and their `_metadata` (docs/design.md §3.3,
"Discovery lists").

``discover_checkpoint_directories(fs, job)`` is the one place that finds them; the access's
``latest_completed_checkpoint()``, store recovery, ``list_checkpoints`` and the next
checkpoint id all start from it.

- On object stores (S3, GCS: ``fs.find(job, prefix="chk-")`` is one flat, paginated listing of
  the keys below ``<job>/chk-``), every directory, its files and its `_metadata` come from that
  listing: a few LIST requests per thousand objects, never requests per directory. A
  directory on an object store exists only while it holds an object, so an aborted
  checkpoint that wrote nothing is not seen (its id may be reused; the put-if-absent of
  `_metadata` refuses a duplicate either way).
- Elsewhere (local disk, memory, others) the job directory is listed once and each
  directory's `_metadata` is looked up when asked for, newest first, so finding the latest of
  many completed checkpoints stays cheap.

Any error but "the job directory does not exist" is raised, never read as "no checkpoint".
"""

import logging
from dataclasses import dataclass, field

from fsspec import AbstractFileSystem

from checkpoint_storage._filesystems import METADATA_FILE_NAME, _protocols, join, parent_and_name
from checkpoint_storage._ids import checkpoint_directory_id

__all__ = ["CheckpointDirectory", "discover_checkpoint_directories", "lists_by_prefix"]

logger = logging.getLogger("checkpoint_storage")

CHK_PREFIX = "chk-"
_PREFIX_LISTING_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs"})
_NOT_LOOKED_UP = object()


def lists_by_prefix(fs: AbstractFileSystem) -> bool:
    """Whether ``fs`` is an object store that lists every key below a prefix in one flat,
    paginated listing (``find(path, prefix=...)``)."""
    return bool(_PREFIX_LISTING_PROTOCOLS.intersection(_protocols(fs)))


@dataclass
class CheckpointDirectory:
    """One ``chk-<id>`` directory of a job: its id, stripped path and (when the listing had
    them) its files' fsspec info entries."""

    checkpoint_id: int
    path: str
    files: list[dict] | None = None  # every object below it, from a prefix listing
    _metadata: object = field(default=_NOT_LOOKED_UP, repr=False)

    @property
    def metadata_path(self) -> str:
        return join(self.path, METADATA_FILE_NAME)

    def metadata_info(self, fs: AbstractFileSystem) -> dict | None:
        """The fsspec info of its `_metadata` (a file, or whatever else carries the name),
        None when there is none. From the listing on object stores, else looked up once."""
        if self._metadata is _NOT_LOOKED_UP:
            try:
                self._metadata = fs.info(self.metadata_path)
            except (FileNotFoundError, NotADirectoryError):
                self._metadata = None
        return self._metadata


def discover_checkpoint_directories(fs: AbstractFileSystem, job: str) -> list[CheckpointDirectory]:
    """Every ``chk-<id>`` directory of the job directory ``job`` (a stripped path), newest
    (highest id) first; [] when the job directory does not exist."""
    job = job.rstrip("/")
    fs.invalidate_cache(job)
    if lists_by_prefix(fs):
        return _from_prefix_listing(fs, job)
    try:
        entries = fs.ls(job, detail=True)
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        if entry.get("type") != "directory":
            continue
        name = entry["name"].rstrip("/")
        checkpoint_id = checkpoint_directory_id(parent_and_name(name)[1])
        if checkpoint_id is not None:
            found.append(CheckpointDirectory(checkpoint_id, join(job, f"chk-{checkpoint_id}")))
    return sorted(found, key=lambda d: d.checkpoint_id, reverse=True)


def _from_prefix_listing(fs: AbstractFileSystem, job: str) -> list[CheckpointDirectory]:
    listed = fs.find(job, prefix=CHK_PREFIX, detail=True)
    fs.invalidate_cache(job)  # s3fs fills its directory cache from a find: never trust it
    directories: dict[int, CheckpointDirectory] = {}
    for name, info in listed.items():
        relative = name.rstrip("/")[len(job) + 1 :]
        top, _, rest = relative.partition("/")
        checkpoint_id = checkpoint_directory_id(top)
        if checkpoint_id is None or not rest or info.get("type") == "directory":
            continue
        directory = directories.get(checkpoint_id)
        if directory is None:
            directory = CheckpointDirectory(checkpoint_id, join(job, top), [], None)
            directories[checkpoint_id] = directory
        directory.files.append(info)
        if rest == METADATA_FILE_NAME:
            directory._metadata = info
    return sorted(directories.values(), key=lambda d: d.checkpoint_id, reverse=True)
