"""Filesystem plumbing: URLs, root checks, entropy, and publishing `_metadata` atomically.

Paths travel through the library as canonical URL strings: a plain absolute path for local
disk (``/data/cp/...``) and ``protocol://path`` for everything else (``s3://bucket/cp/...``,
``memory:///cp/...``). One canonical form per location is what lets a checkpoint have one
external pointer whichever call produced it, and what makes root checks a prefix comparison.
"""

import datetime as _dt
import logging
import math
import os
import posixpath
import re
import secrets
import string
import threading
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.spec import AbstractBufferedFile

from checkpoint_storage._ids import checkpoint_directory_id
from checkpoint_storage.exceptions import (
    CheckpointAlreadyExistsError,
    CheckpointCommitFailedError,
    CommitStateUnknownError,
    StorageConfigurationError,
    UnsafePathError,
    UnsupportedFileSystemError,
)

logger = logging.getLogger("checkpoint_storage")

METADATA_FILE_NAME = "_metadata"
_ENTROPY_ALPHABET = string.ascii_letters + string.digits
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


def _check_url_text(url: object, what: str) -> str:
    if url is None:
        raise TypeError(f"{what} must not be None")
    if not isinstance(url, str):
        raise TypeError(f"{what} must be a string, got {type(url).__name__}")
    if not url.strip():
        raise ValueError(f"{what} must not be empty")
    if _CONTROL_CHARS.search(url):
        raise ValueError(f"{what} contains control characters: {url!r}")
    return url


# fsspec option names that hold credentials in s3fs, gcsfs, adlfs and friends.
_SECRET_OPTIONS = {
    "key", "secret", "token", "password", "session_token", "secret_access_key",
    "aws_secret_access_key", "aws_session_token", "account_key", "sas_token", "client_secret",
    "connection_string", "credentials",
}  # fmt: skip


def refuse_credentials(options: dict) -> dict:
    """``options`` unchanged, unless a key looks like a credential: those would travel to every
    executor inside the objects shipped there, so they must come from the environment."""
    secrets = sorted(k for k in options if str(k).lower() in _SECRET_OPTIONS)
    if secrets:
        raise StorageConfigurationError(
            f"storage_options {secrets} look like credentials, which would travel to every "
            "executor: put them in environment variables and name those in "
            "storage_options_from_env (e.g. {'secret': 'AWS_SECRET_ACCESS_KEY'})"
        )
    return options


def options_with_environment(static: dict, from_env: dict, used_for: str) -> dict:
    """fsspec options: ``static`` plus each option of ``from_env`` (option -> environment
    variable) read from this process's environment now, so that secrets never travel in the
    objects shipped to executors. ``used_for`` says in the error what needs them."""
    options = dict(static)
    for option, variable in from_env.items():
        value = os.environ.get(variable)
        if value is None:
            raise StorageConfigurationError(
                f"storage option {option!r} comes from environment variable {variable!r}, "
                f"which is not set in this process (pid {os.getpid()}): set it wherever "
                f"{used_for} are written or read, on the driver and on every executor"
            )
        options[option] = value
    return options


def url_to_fs(url: str, storage_options: dict | None = None) -> tuple[AbstractFileSystem, str]:
    """The filesystem and the stripped path of a URL or local path, without any I/O."""
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if isinstance(fs, LocalFileSystem):
        path = posixpath.normpath(path)
    elif len(path) > 1:
        path = path.rstrip("/")
    return fs, path


def to_url(fs: AbstractFileSystem, path: str) -> str:
    """The canonical URL of a stripped path on ``fs``."""
    if isinstance(fs, LocalFileSystem):
        return path
    return fs.unstrip_protocol(path)


def canonical_url(url: str, storage_options: dict | None = None) -> str:
    """A configured directory (trusted input) in canonical form."""
    fs, path = url_to_fs(_check_url_text(url, "directory"), storage_options)
    return to_url(fs, path)


def join(url: str, *names: str) -> str:
    return "/".join((url.rstrip("/"), *names))


def parent_and_name(url: str) -> tuple[str, str]:
    parent, _, name = url.rstrip("/").rpartition("/")
    return parent, name


def check_pointer(pointer: object) -> str:
    """Reject pointers that could walk out of where they name, before any I/O: no '.' or '..'
    segment, plain, percent-encoded or behind backslashes, and no control character."""
    pointer = _check_url_text(pointer, "checkpoint pointer")
    scheme, _, path = pointer.partition("://") if "://" in pointer else ("", "", pointer)
    if _has_traversal(path):
        if not any(segment in (".", "..") for segment in path.split("/")):
            advice = (
                "it hides them behind percent-encoding or backslashes: pass the directory's "
                "plain path or URL"
            )
        elif scheme:
            plain = f"{scheme}://{posixpath.normpath('/' + path).lstrip('/')}"
            advice = f"object stores take them literally: write the URL without them ({plain})"
        else:
            advice = (
                "only a relative path may start with ./ or ../: write it as "
                f"{posixpath.normpath(pointer)}"
            )
        raise UnsafePathError(
            f"checkpoint pointer {pointer!r} contains '.' or '..' segments; {advice}"
        )
    return pointer


def normalize_pointer(pointer: object) -> str:
    """A pointer as a person gives it (a CLI argument, a run's ``restore_from``), in the one
    form ``check_pointer`` accepts; the same rule wherever a pointer is resolved:

    - ``file:`` URLs (``file:/abs``, ``file:///abs``, ``file://localhost/abs``; percent-encoded
      as RFC 8089 says) name the local path they encode; a file URL of another host is refused;
    - a relative local path is relative to the current directory, and its leading ``./`` and
      ``../`` segments are resolved there, as a shell would;
    - any other '.' or '..' segment (plain, percent-encoded or behind backslashes) is refused
      with ``UnsafePathError``, before any I/O.
    """
    pointer = _check_url_text(pointer, "checkpoint pointer")
    if pointer[:5].lower() == "file:":
        pointer = _file_url_path(pointer)
    elif "://" not in pointer and not pointer.startswith("/"):
        segments = pointer.split("/")
        base = os.getcwd()
        while segments and segments[0] in (".", "..", ""):
            if segments.pop(0) == "..":
                base = os.path.dirname(base)
        pointer = "/".join([base.rstrip("/"), *segments]) if segments else base
    return check_pointer(pointer)


def _file_url_path(url: str) -> str:
    parsed = urllib.parse.urlsplit(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(
            f"{url!r} names a file on host {parsed.netloc!r}: only local file URLs "
            "(file:/path, file:///path, file://localhost/path) are supported"
        )
    if parsed.query or parsed.fragment or not parsed.path.startswith("/"):
        raise ValueError(f"{url!r} is not an absolute file URL: use file:///absolute/path")
    if _has_traversal(parsed.path):
        check_pointer(parsed.path)  # raises, with advice for the path it names
    path = urllib.parse.unquote(parsed.path)
    return _check_url_text(path, "checkpoint pointer")


_MAX_DECODINGS = 4


def _has_traversal(path: str) -> bool:
    """Whether ``path`` has a '.' or '..' segment or a control character, also once
    percent-decoded (repeatedly: ``%252e``) and with backslashes read as separators, as a
    filesystem that decodes URLs (or a Windows one) would see it."""
    for _ in range(_MAX_DECODINGS):
        if _CONTROL_CHARS.search(path) or any(
            segment in (".", "..") for segment in re.split(r"[/\\]", path)
        ):
            return True
        decoded = urllib.parse.unquote(path)
        if decoded == path:
            return False
        path = decoded
    return True  # encoded more than _MAX_DECODINGS times: no real path looks like this


# --- root checks -------------------------------------------------------------------------


def check_relative_path(relative_path: str) -> str:
    """A relative handle path must name a file strictly below its directory."""
    if (
        not isinstance(relative_path, str)
        or not relative_path
        or relative_path.startswith("/")
        or "\\" in relative_path
        or "://" in relative_path
        or _CONTROL_CHARS.search(relative_path)
        or any(seg in ("", ".", "..") for seg in relative_path.split("/"))
        or _has_traversal(relative_path)
    ):
        raise UnsafePathError(
            f"relative state path {relative_path!r} leaves its checkpoint directory: "
            "the _metadata was not written by this library or was tampered with"
        )
    return relative_path


class PathRoots:
    """The directories that state paths read from storage must stay within.

    ``roots`` are canonical directory URLs; ``patterns[i]`` is a regular expression of the
    entropy-injected forms of ``roots[i]`` (or None). A path passes when it lies strictly
    below one of them and has no ``.``, ``..`` or empty segment. For a checkpoint the roots
    are, in this order, its own directory, its job's ``shared/`` and ``taskowned/``.
    """

    __slots__ = ("roots", "patterns")

    OWN, SHARED, TASK_OWNED = 0, 1, 2

    def __init__(self, roots: tuple[str, ...], patterns: tuple[str | None, ...] = ()) -> None:
        self.roots = tuple(r.rstrip("/") for r in roots)
        self.patterns = tuple(patterns) or (None,) * len(self.roots)
        if len(self.patterns) != len(self.roots):
            raise ValueError("one entropy pattern (or None) per root")

    def __getstate__(self):
        return (self.roots, self.patterns)

    def __setstate__(self, state) -> None:
        self.roots, self.patterns = state

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PathRoots) and (self.roots, self.patterns) == (
            other.roots,
            other.patterns,
        )

    def __hash__(self) -> int:
        return hash((self.roots, self.patterns))

    def index_of(self, url: str) -> int | None:
        """Which root ``url`` lies below (see OWN, SHARED, TASK_OWNED), or None."""
        if not isinstance(url, str) or _CONTROL_CHARS.search(url) or "\\" in url:
            return None
        for index, (root, pattern) in enumerate(zip(self.roots, self.patterns, strict=True)):
            if url.startswith(root + "/") and _clean_tail(url[len(root) + 1 :]):
                return index
            if pattern is not None:
                match = re.match(pattern, url)
                if match and _clean_tail(url[match.end() :]):
                    return index
        return None

    def check(self, url: str) -> str:
        if self.index_of(url) is None:
            moved_from = self._moved_from(url)
            if moved_from is not None:
                raise UnsafePathError(
                    f"state path {url!r} lies outside the checkpoint's directories "
                    f"{list(self.roots)}: this job directory was moved or copied from "
                    f"{moved_from}. A checkpoint records its state files' absolute paths and "
                    "cannot be moved (a savepoint can): read or restore it where it was "
                    "written, or take a savepoint there and copy that (checkpoints "
                    "copy-savepoint); refusing to read or delete it"
                )
            raise UnsafePathError(
                f"state path {url!r} lies outside the checkpoint's directories "
                f"{list(self.roots)}: the _metadata was not written for this location or was "
                "tampered with; refusing to read or delete it"
            )
        return url

    def _moved_from(self, url: str) -> str | None:
        """The job directory a checkpoint's state path names when it has this checkpoint's
        layout (``<job>/chk-<id>/...``, ``<job>/shared/...``, ``<job>/taskowned/...``, the
        job directory named as this one's) elsewhere: the checkpoint was moved or copied."""
        own, _, own_name = self.roots[self.OWN].rpartition("/")
        job_name = own.rpartition("/")[2]
        if not own_name.startswith("chk-") or not job_name or not isinstance(url, str):
            return None
        for sub in (own_name, "shared", "taskowned"):
            old_job, sep, tail = url.rpartition(f"/{job_name}/{sub}/")
            if sep and old_job and _clean_tail(tail):
                return f"{old_job}/{job_name}"
        return None


def _clean_tail(tail: str) -> bool:
    return (
        bool(tail)
        and all(seg not in ("", ".", "..") for seg in tail.split("/"))
        and not _has_traversal(tail)
    )


def roots_for_directory(directory_url: str, entropy: "EntropyInjector | None" = None) -> PathRoots:
    """Roots of a completed checkpoint or savepoint directory (docs/design.md §3.3).

    A ``chk-<id>`` directory may reference its job's ``shared/`` and ``taskowned/`` siblings
    (and their entropy-injected forms); any other directory (a savepoint) only itself.
    """
    parent, name = parent_and_name(directory_url)
    if checkpoint_directory_id(name) is None:
        return PathRoots((directory_url,))
    dirs = (directory_url, join(parent, "shared"), join(parent, "taskowned"))
    if entropy is None:
        return PathRoots(dirs)
    return PathRoots(dirs, tuple(entropy.directory_pattern(d) for d in dirs))


# --- entropy injection -------------------------------------------------------------------


class EntropyInjector:
    """Flink's entropy injection: spread data files over object-store key prefixes.

    ``template`` is the configured checkpoint directory containing ``key``. Data files replace
    the key by random characters; `_metadata` and pointers drop the key and its separator.
    """

    __slots__ = ("key", "length", "template", "plain")

    def __init__(self, key: str, length: int, template: str) -> None:
        self.key, self.length, self.template = key, length, template
        self.plain = remove_entropy_marker(template, key)

    def __getstate__(self):
        return (self.key, self.length, self.template)

    def __setstate__(self, state) -> None:
        self.__init__(*state)

    def inject(self, plain_directory: str) -> str:
        """A data directory for ``plain_directory`` (below the plain base) with fresh entropy."""
        rest = plain_directory[len(self.plain) :]
        entropy = "".join(secrets.choice(_ENTROPY_ALPHABET) for _ in range(self.length))
        return self.template.replace(self.key, entropy, 1) + rest

    def directory_pattern(self, plain_directory: str) -> str | None:
        """A regex matching every entropy-injected form of ``plain_directory`` (plus '/')."""
        if not plain_directory.startswith(self.plain):
            return None
        head, _, tail = self.template.partition(self.key)
        rest = plain_directory[len(self.plain) :]
        return re.escape(head) + f"[A-Za-z0-9]{{{self.length}}}" + re.escape(tail + rest) + "/"


def remove_entropy_marker(url: str, key: str) -> str:
    """``s3://b/_entropy_/cp`` -> ``s3://b/cp``: the key goes together with one separator."""
    if key + "/" in url:
        return url.replace(key + "/", "", 1)
    if url.endswith("/" + key):
        return url[: -len(key) - 1]
    return url.replace(key, "", 1)


def format_size(n: int) -> str:
    """A byte count for people: ``512 B``, ``3.0 KiB``, ``1.5 GiB``."""
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def format_age(age: _dt.timedelta | None, *, compact: bool = False) -> str:
    """An age for people in its largest whole unit: ``42 s``, ``7 min``, ``3 h``, ``2 d``;
    ``compact``: ``42s``, ``7m``, ``3h``, ``2d`` (for narrow table columns). ``-`` when
    unknown."""
    if age is None:
        return "-"
    seconds = max(0, int(age.total_seconds()))
    for unit, short, size in (("d", "d", 86400), ("h", "h", 3600), ("min", "m", 60)):
        if seconds >= size:
            return f"{seconds // size}{short}" if compact else f"{seconds // size} {unit}"
    return f"{seconds}s" if compact else f"{seconds} s"


# --- modification times ------------------------------------------------------------------

_TIME_KEYS = ("mtime", "LastModified", "last_modified", "modified", "updated", "created")


def modification_time(entry) -> float | None:
    """The modification time of an fsspec info/listing entry as epoch seconds, None when it
    carries none: local ``mtime``, S3 ``LastModified``, GCS ``updated`` (ISO text), memory
    ``created``. Naive datetimes are taken as UTC; numbers above 1e11 as milliseconds."""
    for key in _TIME_KEYS:
        value = _to_epoch(entry.get(key))
        if value is not None:
            return value
    return None


def _to_epoch(value: object) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        if not math.isfinite(value):
            return None
        return value / 1000 if value > 1e11 else float(value)
    if isinstance(value, str):
        try:
            value = _dt.datetime.fromisoformat(value.strip())
        except ValueError:
            try:
                return _to_epoch(float(value))
            except ValueError:
                return None
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.UTC)
        return value.timestamp()
    return None


# --- writing and aborting files ----------------------------------------------------------


def abort_file(fs: AbstractFileSystem, handle, path: str) -> None:
    """Throw away a partly written file; never raises.

    fsspec commits buffered files on ``close()`` and even on garbage collection, so the
    upload is discarded and the file object marked closed before the path is deleted.
    """
    try:
        if isinstance(handle, AbstractBufferedFile):
            handle.discard()  # S3: aborts a multipart upload; others: no-op
            handle.closed = True
        else:
            handle.close()
    except Exception:  # noqa: BLE001 - aborting must not mask the original failure
        logger.warning("could not discard partial state file %s", path, exc_info=True)
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass
    except Exception:  # noqa: BLE001
        logger.warning("could not delete partial state file %s", path, exc_info=True)


def delete_recursively(fs: AbstractFileSystem, path: str) -> None:
    """Delete a directory tree; a missing one is already deleted."""
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
    finally:
        fs.invalidate_cache(path)


DEFAULT_DELETE_PARALLELISM = 16
_S3_DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys


def delete_files(
    fs: AbstractFileSystem, paths: list[str], max_workers: int = DEFAULT_DELETE_PARALLELISM
) -> list[str]:
    """Delete many files (stripped paths) in parallel, bounded by ``max_workers``; missing
    files count as deleted. Every deletion is tried; then the first error is raised (a note
    says how many failed). Returns the paths deleted.

    S3 gets batched DeleteObjects requests, whose per-key errors are checked; other
    filesystems a bounded thread pool of single deletes. Names are never glob patterns.
    """
    paths = list(paths)
    if not paths:
        return []
    errors: list[BaseException] = []
    if "s3" in _protocols(fs):
        batches = _s3_delete_batches(fs, paths)
        tasks = [lambda batch=batch: _s3_delete_batch(fs, *batch) for batch in batches]
    else:
        # One task per worker, not per file: a local unlink is cheaper than a task hand-off.
        size = -(-len(paths) // max(1, max_workers))
        chunks = [paths[i : i + size] for i in range(0, len(paths), size)]
        tasks = [lambda chunk=chunk: _delete_all(fs, chunk) for chunk in chunks]

    def run(task) -> None:
        try:
            task()
        except Exception as exc:  # noqa: BLE001 - collected, the first is raised below
            errors.append(exc)

    if len(tasks) == 1 or max_workers <= 1:
        for task in tasks:
            run(task)
    else:
        with ThreadPoolExecutor(max_workers=min(max_workers, len(tasks))) as pool:
            list(pool.map(run, tasks))
    if errors:
        errors[0].add_note(f"{len(errors)} of {len(tasks)} delete batches failed")
        raise errors[0]
    return paths


def _delete_all(fs: AbstractFileSystem, paths: list[str]) -> None:
    """Delete ``paths`` one after another, trying each; raise the first error at the end."""
    first: BaseException | None = None
    for path in paths:
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001
            first = first or exc
    if first is not None:
        raise first


def _s3_delete_batches(fs, paths: list[str]) -> list[tuple[str, list[str]]]:
    by_bucket: dict[str, list[str]] = {}
    for path in paths:
        bucket, key, _ = fs.split_path(path)
        by_bucket.setdefault(bucket, []).append(key)
    return [
        (bucket, keys[i : i + _S3_DELETE_BATCH])
        for bucket, keys in by_bucket.items()
        for i in range(0, len(keys), _S3_DELETE_BATCH)
    ]


def _s3_delete_batch(fs, bucket: str, keys: list[str]) -> None:
    response = fs.call_s3(
        "delete_objects",
        Bucket=bucket,
        Delete={"Objects": [{"Key": key} for key in keys], "Quiet": True},
    )
    for key in keys:
        fs.invalidate_cache(f"{bucket}/{key}")
    failed = response.get("Errors") or []
    if failed:
        first = failed[0]
        raise OSError(
            f"S3 refused to delete {len(failed)} of {len(keys)} objects in {bucket}; first: "
            f"{first.get('Key')}: {first.get('Code')} {first.get('Message', '')}".rstrip()
        )


# --- put-if-absent -----------------------------------------------------------------------

_MEMORY_LOCK = threading.Lock()


def put_if_absent(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Publish ``data`` at ``path`` only if nothing is there yet, atomically.

    Raises ``CheckpointAlreadyExistsError`` when the path exists,
    ``CheckpointCommitFailedError`` when nothing was published, and
    ``CommitStateUnknownError`` when the outcome could not be determined.
    """
    url = to_url(fs, path)
    if isinstance(fs, LocalFileSystem):
        # Filesystems may route the syscalls (a fault-injecting test harness does).
        _put_if_absent_local(path, data, getattr(fs, "local_syscalls", os))
    elif isinstance(fs, MemoryFileSystem):
        with _MEMORY_LOCK:
            if path in fs.store:
                raise CheckpointAlreadyExistsError(f"{url} already exists")
            fs.pipe_file(path, data)
    elif "s3" in _protocols(fs):
        _put_if_absent_remote(fs, path, data, url, lambda: fs.pipe_file(path, data, mode="create"))
    else:
        _put_if_absent_remote(fs, path, data, url, lambda: _write_exclusive(fs, path, data, url))


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _write_exclusive(fs: AbstractFileSystem, path: str, data: bytes, url: str) -> None:
    try:
        f = fs.open(path, "xb")
    except (ValueError, NotImplementedError, TypeError) as exc:
        raise UnsupportedFileSystemError(
            f"{type(fs).__name__} cannot create {url} exclusively (mode 'xb'), so a completed "
            "checkpoint could be overwritten; use local disk, S3, GCS or memory storage"
        ) from exc
    f.write(data)
    f.close()


def _put_if_absent_remote(fs, path: str, data: bytes, url: str, put) -> None:
    try:
        put()
        return
    except FileExistsError as exc:
        # s3fs and botocore retry a PUT whose response was lost; the retry then finds the
        # object our first attempt stored (412). Only other bytes mean another writer.
        _resolve_by_read_back(fs, path, data, url, exc, seen_existing=True)
        return
    except UnsupportedFileSystemError:
        raise
    except PermissionError as exc:
        raise CheckpointCommitFailedError(
            f"not allowed to write {url}: check the credentials and bucket policy"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - the request may have been applied: read back
        failure = exc
    _resolve_by_read_back(fs, path, data, url, failure, seen_existing=False)


def _resolve_by_read_back(
    fs, path: str, data: bytes, url: str, cause: Exception, *, seen_existing: bool
) -> None:
    """A PUT whose outcome the error does not tell (``cause``; ``seen_existing`` when the
    conditional PUT found an object, possibly our own from a retried PUT that was applied):
    read the object back. Our bytes: committed. Other bytes: another writer's. Absent: not
    published (or, when an object was seen, another writer's that went away since). (A writer
    publishing byte-identical `_metadata` is indistinguishable from our retry; either way the
    stored checkpoint is ours.)"""
    fs.invalidate_cache(path)
    try:
        stored = fs.cat_file(path)
    except FileNotFoundError:
        if seen_existing:
            raise CheckpointAlreadyExistsError(
                f"{url} already exists: another writer completed this checkpoint"
            ) from cause
        raise CheckpointCommitFailedError(
            f"publishing {url} failed ({cause}); nothing was published, retrying is safe"
        ) from cause
    except Exception as exc:  # noqa: BLE001
        raise CommitStateUnknownError(
            f"publishing {url} failed ({cause}) and reading it back failed too ({exc}); "
            "the checkpoint may or may not be complete, possibly by this writer's own retried "
            "PUT: resolve it before retrying"
        ) from cause
    if stored != data:
        raise CheckpointAlreadyExistsError(
            f"{url} already exists with other content: another writer completed this checkpoint"
        ) from cause
    logger.info("commit of %s reported %r but the object holds our bytes: committed", url, cause)


def _put_if_absent_local(path: str, data: bytes, syscalls=os) -> None:
    directory, name = os.path.split(path)
    temp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.inprogress")
    try:
        fd = syscalls.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[syscalls.write(fd, view) :]
            syscalls.fsync(fd)
        finally:
            syscalls.close(fd)
        try:
            syscalls.link(temp, path)  # fails if the target exists: put-if-absent
        except OSError:
            # A link can report failure after it was made (a lost NFS reply, retried as
            # EEXIST): if the target is our temp file, the commit happened.
            if not _same_file(temp, path):
                raise
            logger.info("linking %s reported an error but the link is ours: committed", path)
    except FileExistsError as exc:
        raise CheckpointAlreadyExistsError(
            f"{path} already exists: another writer completed this checkpoint"
        ) from exc
    except OSError as exc:
        raise CheckpointCommitFailedError(
            f"could not publish {path}: {exc.strerror or exc}. Nothing was published; "
            "free space or fix permissions, then retry the checkpoint"
        ) from exc
    finally:
        try:
            syscalls.unlink(temp)
        except FileNotFoundError:
            pass
        except OSError:  # a leftover hidden temp file must not turn a commit into a failure
            logger.warning("could not delete temporary file %s", temp, exc_info=True)
    try:
        dir_fd = syscalls.open(directory, os.O_RDONLY)
        try:
            syscalls.fsync(dir_fd)
        finally:
            syscalls.close(dir_fd)
    except OSError as exc:
        raise CommitStateUnknownError(
            f"{path} was linked but its directory could not be synced ({exc}): it may not "
            "survive a crash of this machine"
        ) from exc


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# --- is put-if-absent exclusive? ----------------------------------------------------------

_EXCLUSIVE_VERDICTS: dict[tuple, bool] = {}
_EXCLUSIVE_LOCK = threading.Lock()
PROBE_PREFIX = ".put-if-absent-probe-"


def _endpoint_key(fs: AbstractFileSystem, path: str) -> tuple[tuple[str, ...], str, str]:
    """(protocols, endpoint, bucket or top-level directory) a verdict is cached under."""
    endpoint = (
        getattr(fs, "endpoint_url", None)
        or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
        or getattr(fs, "project", None)
        or getattr(fs, "account_name", None)
        or ""
    )
    return _protocols(fs), str(endpoint), path.lstrip("/").split("/", 1)[0]


def _describe_endpoint(key: tuple[tuple[str, ...], str, str]) -> str:
    protocols, endpoint, bucket = key
    where = f"{protocols[0]}://{bucket}"
    return f"{where} at {endpoint}" if endpoint else where


def verify_exclusive_create(fs: AbstractFileSystem, directory: str) -> None:
    """Make sure put-if-absent below ``directory`` (a stripped path) is exclusive on this
    filesystem: once per endpoint (protocol, endpoint URL, bucket) and process, publish a
    probe object twice with put-if-absent; the second must be refused. The probe is removed.
    Raises ``UnsupportedFileSystemError`` naming the endpoint when the second one succeeds
    (e.g. an S3-compatible server that ignores ``If-None-Match: *``), every time it is asked.

    Local disk (``os.link``) and memory (a lock) are exclusive by construction: no probe.
    """
    if isinstance(fs, LocalFileSystem | MemoryFileSystem):
        return
    key = _endpoint_key(fs, directory)
    with _EXCLUSIVE_LOCK:
        verdict = _EXCLUSIVE_VERDICTS.get(key)
        if verdict is None:
            verdict = _probe_exclusive_create(fs, directory)
            _EXCLUSIVE_VERDICTS[key] = verdict
    if not verdict:
        raise UnsupportedFileSystemError(
            f"{_describe_endpoint(key)} does not honour exclusive creation: a second "
            "put-if-absent (S3: a PUT with If-None-Match: *) of one key succeeded, so another "
            "writer could silently overwrite a completed checkpoint's _metadata. Use an "
            "endpoint that supports conditional writes (enable or upgrade the server's "
            "If-None-Match support) or write checkpoints to another filesystem (local disk, "
            "AWS S3, GCS)"
        )


def _probe_exclusive_create(fs: AbstractFileSystem, directory: str) -> bool:
    probe = join(directory, PROBE_PREFIX + uuid.uuid4().hex)
    try:
        put_if_absent(fs, probe, b"first")
        try:
            put_if_absent(fs, probe, b"second")
        except CheckpointAlreadyExistsError:
            return True
        logger.error("a second put-if-absent of %s succeeded", to_url(fs, probe))
        return False
    finally:
        try:
            fs.rm_file(probe)
        except FileNotFoundError:
            pass
        except Exception:  # noqa: BLE001 - a leftover probe is harmless; say so
            logger.warning("could not delete the probe object %s", to_url(fs, probe), exc_info=True)
        fs.invalidate_cache(directory)


def forget_exclusive_create_verdicts() -> None:
    """Drop the cached verdicts (tests; after reconfiguring an endpoint)."""
    with _EXCLUSIVE_LOCK:
        _EXCLUSIVE_VERDICTS.clear()
