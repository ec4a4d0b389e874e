"""Garbage collection of a job's checkpoint directory (issue 3, "Garbage collection").

Real checkpoints are written with the library on memory://, local disk and S3 (moto), next to
the garbage a crashing job leaves behind; files are aged with ``now=`` in the future instead
of sleeping.
"""

import datetime as dt
import logging
import os
import random
import time
import uuid
from dataclasses import dataclass, field

import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoint_storage import (
    CheckpointNotFoundError,
    CheckpointStorageError,
    FileSystemCheckpointStorage,
    JobID,
    MemoryCheckpointStorage,
    load_checkpoint_metadata,
)
from checkpoint_storage._gc import GarbageCollectionResult, collect_garbage, modification_time
from checkpoint_storage._metadata import FORMAT_VERSION, HEADER_SIZE, MAGIC
from tests.support import SHARED, finalize, fs_of, metadata, payload, read, write_state

THRESHOLD = 1024
BIG = 2048
GRACE = dt.timedelta(hours=1)

pytestmark = pytest.mark.timeout(60)  # the backend fixture includes S3


# --------------------------------------------------------------------------------------------
#  helpers
# --------------------------------------------------------------------------------------------


def future(days: float = 10) -> float:
    """Epoch seconds far enough ahead that every file written now is older than GRACE."""
    return time.time() + days * 86400


def url_of(fs, path: str) -> str:
    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)


def files_under(fs, url: str) -> set[str]:
    """Canonical URLs of every file below ``url`` (fresh listing)."""
    path = type(fs)._strip_protocol(url).rstrip("/")
    fs.invalidate_cache()
    return {url_of(fs, p) for p in fs.find(path)}


def put(fs, url: str, data: bytes) -> str:
    """Write a raw file (what a crashed writer leaves behind) and return its URL."""
    fs.pipe_file(type(fs)._strip_protocol(url), data)
    return url


def new_access(backend, name: str = "cp"):
    storage = FileSystemCheckpointStorage(
        backend.url(name),
        backend.url(name),  # savepoints next to the job directories, under the same base
        storage_options=dict(backend.storage_options),
        file_state_size_threshold=THRESHOLD,
    )
    access = storage.create_checkpoint_storage(JobID.generate())
    access.initialize_base_locations()
    return access


@dataclass
class Scenario:
    access: object
    fs: object
    job: str
    referenced: set[str]  # _metadata and state files of the valid checkpoints 1 and 2
    garbage: set[str]  # unreferenced files below chk-<id>/ and shared/
    garbage_bytes: int
    untouchable: set[str]  # taskowned/, a savepoint in the job dir, a foreign top-level file
    handles: list = field(default_factory=list)
    chk_dirs: dict = field(default_factory=dict)


def build_scenario(backend) -> Scenario:
    """Two valid checkpoints (the second incremental) plus every kind of garbage."""
    access = new_access(backend)
    fs = fs_of(backend)
    job = access.checkpoints_directory
    chk = {i: f"{job}/chk-{i}" for i in range(1, 6)}

    loc1 = access.initialize_location_for_checkpoint(1)
    e1 = write_state(loc1, payload(BIG, 1))
    s1 = write_state(loc1, payload(BIG, 2), SHARED)
    inline = write_state(loc1, b"inline state")
    c1 = finalize(loc1, metadata(1, [e1, s1, inline]))

    loc2 = access.initialize_location_for_checkpoint(2)
    e2 = write_state(loc2, payload(BIG, 3))
    s2 = write_state(loc2, payload(BIG, 4), SHARED)
    failed_attempt = write_state(loc2, payload(BIG + 1, 5))  # a task attempt that failed
    failed_shared = write_state(loc2, payload(BIG + 2, 6), SHARED)
    c2 = finalize(loc2, metadata(2, [e2, s1, s2], master=b"pos-2"))  # reuses s1: incremental

    temp = put(fs, f"{chk[1]}/._metadata.{uuid.uuid4().hex}.inprogress", b"half a publish")
    crashed = put(fs, f"{job}/shared/{uuid.uuid4().hex}", payload(BIG + 3, 7))

    loc3 = access.initialize_location_for_checkpoint(3)  # aborted: no _metadata
    e3 = write_state(loc3, payload(BIG + 4, 8))
    s3 = write_state(loc3, payload(BIG + 5, 9), SHARED)

    loc4 = access.initialize_location_for_checkpoint(4)  # completed, then subsumed by a
    e4 = write_state(loc4, payload(BIG + 6, 10))  # discard that crashed after `_metadata`
    s4 = write_state(loc4, payload(BIG + 7, 11), SHARED)
    finalize(loc4, metadata(4, [e4, s4])).metadata_handle.discard_state()

    access.initialize_location_for_checkpoint(5)  # aborted before anything was written

    with access.create_task_owned_state_stream() as out:
        out.write(payload(BIG, 12))
        owned = out.close_and_get_handle()
    savepoint = access.initialize_location_for_savepoint(100, job)  # inside the job dir
    sp_state = write_state(savepoint, payload(BIG, 13))
    sp = finalize(savepoint, metadata(100, [sp_state]))
    access.initialize_location_for_savepoint(101)  # in the default savepoint dir (the base)
    foreign = put(fs, f"{job}/notes.txt", b"an operator's notes")

    sized = [
        (temp, 14),
        (crashed, BIG + 3),
        (failed_attempt.path, BIG + 1),
        (failed_shared.path, BIG + 2),
        (e3.path, BIG + 4),
        (s3.path, BIG + 5),
        (e4.path, BIG + 6),
        (s4.path, BIG + 7),
    ]
    return Scenario(
        access=access,
        fs=fs,
        job=job,
        referenced={
            c1.metadata_handle.path,
            e1.path,
            s1.path,
            c2.metadata_handle.path,
            e2.path,
            s2.path,
        },
        garbage={url for url, _ in sized},
        garbage_bytes=sum(size for _, size in sized),
        untouchable={owned.path, sp.metadata_handle.path, sp_state.path, foreign},
        handles=[e1, s1, inline, e2, s2],
        chk_dirs=chk,
    )


def removed_directories(backend, s: Scenario) -> tuple[str, ...]:
    """Empty chk dirs a collection removes: local disk dates its directories; memory dates
    them by their (deleted) contents, so the never-written chk-5 stays; S3 has none."""
    if backend.name == "local":
        return tuple(sorted((s.chk_dirs[3], s.chk_dirs[4], s.chk_dirs[5])))
    if backend.name == "memory":
        return tuple(sorted((s.chk_dirs[3], s.chk_dirs[4])))
    return ()


def assert_restorable(s: Scenario) -> None:
    latest = s.access.latest_completed_checkpoint()
    assert f"{s.job}/chk-2" == latest.external_pointer
    md = load_checkpoint_metadata(latest)
    assert b"pos-2" == md.master_states["pos"]
    assert [payload(BIG, 3), payload(BIG, 2), payload(BIG, 4)] == [
        read(h) for h in md.all_handles()
    ]
    assert [payload(BIG, 1), payload(BIG, 2), b"inline state", payload(BIG, 3)] == [
        read(h) for h in s.handles[:4]
    ]


# --------------------------------------------------------------------------------------------
#  what is deleted and what is kept
# --------------------------------------------------------------------------------------------


def test_deletes_exactly_the_unreferenced_files_older_than_the_grace_period(backend, caplog):
    """Old unreferenced files under chk-<id>/ and shared/ go; referenced ones stay and read."""
    s = build_scenario(backend)
    base = backend.url("cp")
    outside_before = files_under(s.fs, base) - files_under(s.fs, s.job)

    with caplog.at_level(logging.WARNING, logger="checkpoint_storage"):
        result = collect_garbage(s.access, grace_period=GRACE, now=future())

    assert (
        GarbageCollectionResult(
            deleted=tuple(sorted(s.garbage)),
            kept=tuple(sorted(s.referenced)),
            bytes_deleted=s.garbage_bytes,
            dry_run=False,
            removed_directories=removed_directories(backend, s),
        )
        == result
    )
    assert s.referenced | s.untouchable == files_under(s.fs, s.job)
    assert outside_before == files_under(s.fs, base) - files_under(s.fs, s.job)
    assert [] == [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert_restorable(s)


def test_files_younger_than_the_grace_period_are_kept(backend):
    """With a grace period longer than the files' age, nothing is deleted and all is kept."""
    s = build_scenario(backend)
    before = files_under(s.fs, s.job)

    result = collect_garbage(s.access, grace_period=dt.timedelta(days=1))

    assert () == result.deleted
    assert 0 == result.bytes_deleted
    assert () == result.removed_directories
    assert tuple(sorted(s.referenced | s.garbage)) == result.kept
    assert before == files_under(s.fs, s.job)


def test_dry_run_deletes_nothing_and_reports_what_the_real_run_deletes(backend):
    """A dry run leaves storage as it was and lists exactly what the real run then deletes."""
    s = build_scenario(backend)
    before = files_under(s.fs, s.job)
    now = future()

    dry = collect_garbage(s.access, grace_period=GRACE, now=now, dry_run=True)
    assert before == files_under(s.fs, s.job)
    real = collect_garbage(s.access, grace_period=GRACE, now=now)

    assert dry.dry_run and not real.dry_run
    assert tuple(sorted(s.garbage)) == dry.deleted
    assert (real.deleted, real.kept, real.bytes_deleted, real.removed_directories) == (
        dry.deleted,
        dry.kept,
        dry.bytes_deleted,
        dry.removed_directories,
    )
    assert dry.summary().startswith("dry run: would delete 8 files")


def test_storage_holds_exactly_the_referenced_files_and_taskowned_after_gc(backend):
    """Grace 0, now in the future: the job dir keeps only referenced files and taskowned/."""
    s = build_scenario(backend)
    sp_dir = next(
        u.rsplit("/", 1)[0] for u in s.untouchable if "/savepoint-" in u and "_metadata" in u
    )
    s.fs.rm(type(s.fs)._strip_protocol(sp_dir), recursive=True)
    s.fs.rm_file(type(s.fs)._strip_protocol(f"{s.job}/notes.txt"))
    owned = {u for u in s.untouchable if "/taskowned/" in u}

    collect_garbage(s.access, grace_period=0, now=future())

    assert s.referenced | owned == files_under(s.fs, s.job)
    assert_restorable(s)


def test_second_collection_finds_nothing_more_to_delete(backend):
    """Collection is idempotent: a second run deletes nothing and keeps the same files."""
    s = build_scenario(backend)
    first = collect_garbage(s.access, grace_period=GRACE, now=future())
    second = collect_garbage(s.access, grace_period=GRACE, now=future())
    assert ((), first.kept, ()) == (second.deleted, second.kept, second.removed_directories)


def test_garbage_named_with_glob_characters_is_deleted_alone(backend):
    """A garbage file named '*' is deleted literally, not as a pattern over its directory."""
    access = new_access(backend)
    fs = fs_of(backend)
    loc = access.initialize_location_for_checkpoint(1)
    state = write_state(loc, payload(BIG, 1))
    completed = finalize(loc, metadata(1, [state]))
    star = put(fs, f"{access.checkpoints_directory}/chk-1/*", b"junk")
    bracket = put(fs, f"{access.checkpoints_directory}/shared/[ab]?", b"junk")

    result = collect_garbage(access, grace_period=0, now=future())

    assert tuple(sorted((star, bracket))) == result.deleted
    assert {completed.metadata_handle.path, state.path} == files_under(
        fs, access.checkpoints_directory
    )
    assert payload(BIG, 1) == read(state)


def test_extra_references_keep_files_and_directories(backend):
    """Files and directories named in extra_references are kept although unreferenced."""
    s = build_scenario(backend)
    chk3 = s.chk_dirs[3]
    kept_file = next(u for u in s.garbage if "/shared/" in u)

    result = collect_garbage(
        s.access, grace_period=GRACE, now=future(), extra_references=[kept_file, chk3 + "/"]
    )

    protected = {kept_file} | {u for u in s.garbage if u.startswith(chk3 + "/")}
    assert tuple(sorted(s.garbage - protected)) == result.deleted
    assert tuple(sorted(s.referenced | protected)) == result.kept
    assert protected <= files_under(s.fs, s.job)


def test_savepoint_named_entries_inside_a_chk_dir_are_never_deleted():
    """A savepoint-* directory below an aborted chk dir survives, and so does that chk dir."""
    backend = _memory_backend()
    access = new_access(backend)
    fs = fs_of(backend)
    job = access.checkpoints_directory
    access.initialize_location_for_checkpoint(7)
    inside = put(fs, f"{job}/chk-7/savepoint-abc123-0123456789ab/_metadata", b"user's")
    junk = put(fs, f"{job}/chk-7/{uuid.uuid4().hex}", b"junk")

    result = collect_garbage(access, grace_period=0, now=future())

    assert ((junk,), (inside,), ()) == (result.deleted, result.kept, result.removed_directories)
    assert {inside} == files_under(fs, job)


def test_symbolic_links_are_neither_followed_nor_deleted(tmp_path):
    """A link inside the job dir to a directory outside it never costs the outside files."""
    backend = _local_backend(tmp_path)
    access = new_access(backend)
    job = access.checkpoints_directory
    access.initialize_location_for_checkpoint(3)
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data").write_bytes(b"keep me")
    os.symlink(outside, f"{job}/chk-3/link-to-dir")
    os.symlink(outside / "data", f"{job}/shared/link-to-file")

    result = collect_garbage(access, grace_period=0, now=future())

    assert () == result.deleted
    assert (f"{job}/chk-3/link-to-dir", f"{job}/shared/link-to-file") == result.kept
    assert b"keep me" == (outside / "data").read_bytes()


def test_a_job_directory_that_does_not_exist_has_no_garbage(backend):
    """Collecting a job that never wrote anything deletes and keeps nothing."""
    storage = FileSystemCheckpointStorage(
        backend.url("cp"), storage_options=dict(backend.storage_options)
    )
    access = storage.create_checkpoint_storage(JobID.generate())
    assert GarbageCollectionResult() == collect_garbage(access, grace_period=0, now=future())


def test_summary_says_what_was_deleted_and_kept():
    """summary() counts files, bytes, removed directories and kept files."""
    result = GarbageCollectionResult(
        deleted=("a", "b"), kept=("c",), bytes_deleted=3 * 1024, removed_directories=("d",)
    )
    assert "deleted 2 files (3.0 KiB) and 1 empty directory; kept 1 file" == result.summary()


# --------------------------------------------------------------------------------------------
#  invalid and concurrently changing checkpoints
# --------------------------------------------------------------------------------------------


def test_a_newer_format_version_keeps_its_checkpoint_and_shared():
    """A _metadata of a newer format version is not garbage: its directory and shared/ are
    kept and the result names it (issue 13: reported, no longer raised)."""
    backend = _memory_backend()
    access = new_access(backend)
    fs = fs_of(backend)
    job = access.checkpoints_directory
    access.initialize_location_for_checkpoint(9)
    newer_version = FORMAT_VERSION + 1
    header = MAGIC + newer_version.to_bytes(2, "big") + bytes(HEADER_SIZE - len(MAGIC) - 2)
    newer = put(fs, f"{job}/chk-9/_metadata", header + b"body")
    junk = put(fs, f"{job}/shared/{uuid.uuid4().hex}", b"junk")

    result = collect_garbage(access, grace_period=0, now=future())

    assert ((), ("unknown format",)) == (result.deleted, tuple(s.reason for s in result.skipped))
    assert f"format version {newer_version}" in result.skipped[0].detail
    assert {newer, junk} == files_under(fs, job)


def test_a_checkpoint_subsumed_while_it_is_read_restarts_the_collection():
    """chk-2 completing and chk-1 vanishing mid-collection cannot cost chk-2's shared files."""
    backend = _memory_backend()
    access = new_access(backend)
    fs = fs_of(backend)
    loc1 = access.initialize_location_for_checkpoint(1)
    s1 = write_state(loc1, payload(BIG, 1), SHARED)
    c1 = finalize(loc1, metadata(1, [s1]))
    loc2 = access.initialize_location_for_checkpoint(2)  # in progress when the listing is made
    real_resolve = access.resolve_checkpoint
    calls = []

    def resolve_while_the_job_moves_on(pointer):
        calls.append(pointer)
        if len(calls) == 1:  # chk-2 completes reusing s1; chk-1 is subsumed (_metadata first)
            finalize(loc2, metadata(2, [s1]))
            c1.metadata_handle.discard_state()
        return real_resolve(pointer)

    access.resolve_checkpoint = resolve_while_the_job_moves_on
    result = collect_garbage(access, grace_period=0, now=future())

    assert [f"{access.checkpoints_directory}/chk-{i}" for i in (1, 2)] == calls
    assert s1.path in result.kept
    assert payload(BIG, 1) == read(s1)
    assert fs.exists(type(fs)._strip_protocol(s1.path))


def test_checkpoints_that_keep_vanishing_raise_rather_than_guess():
    """When every listed checkpoint disappears before it is read, the collection gives up."""
    backend = _memory_backend()
    access = new_access(backend)
    fs = fs_of(backend)
    loc = access.initialize_location_for_checkpoint(1)
    state = write_state(loc, payload(BIG, 1))
    finalize(loc, metadata(1, [state]))

    def vanished(pointer):
        raise CheckpointNotFoundError(f"{pointer} has no _metadata")

    access.resolve_checkpoint = vanished
    with pytest.raises(CheckpointStorageError, match="kept disappearing"):
        collect_garbage(access, grace_period=0, now=future())
    assert state.path in files_under(fs, access.checkpoints_directory)


# --------------------------------------------------------------------------------------------
#  errors are raised, never read as "unreferenced"
# --------------------------------------------------------------------------------------------


class DenyingMemoryFileSystem(MemoryFileSystem):
    """The shared memory store, with every listing refused as S3 refuses one (403)."""

    cachable = False

    def ls(self, path, detail=True, **kwargs):
        raise PermissionError(13, "Access Denied", path)

    def find(self, path, *args, **kwargs):
        raise PermissionError(13, "Access Denied", path)


class DenyingSubdirLocalFileSystem(LocalFileSystem):
    """Local disk that refuses to list directories named ``denied`` (chmod 000 as root)."""

    cachable = False

    def __init__(self, denied: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.denied = denied

    def ls(self, path, detail=False, **kwargs):
        if self._strip_protocol(path).rstrip("/").endswith("/" + self.denied):
            raise PermissionError(13, "Permission denied", path)
        return super().ls(path, detail=detail, **kwargs)


@pytest.mark.parametrize("where", ["memory", "local-subdirectory"])
def test_a_permission_error_while_listing_is_raised_and_nothing_is_deleted(
    where, tmp_path, monkeypatch
):
    """A refused listing, even of one subdirectory, raises instead of hiding references."""
    backend = _memory_backend() if where == "memory" else _local_backend(tmp_path)
    s = build_scenario(backend)
    denying = (
        DenyingMemoryFileSystem() if where == "memory" else DenyingSubdirLocalFileSystem("shared")
    )
    monkeypatch.setattr(s.access, "_fs_cache", denying)
    before = files_under(s.fs, s.job)

    with pytest.raises(PermissionError):
        collect_garbage(s.access, grace_period=0, now=future())
    assert before == files_under(s.fs, s.job)


@pytest.mark.parametrize(
    "error", [PermissionError(13, "Access Denied"), OSError(5, "503 Slow Down"), TimeoutError()]
)
def test_an_io_error_while_loading_metadata_is_raised_and_nothing_is_deleted(error):
    """Permission, 5xx or timeout errors reading _metadata raise; nothing is deleted."""
    s = build_scenario(_memory_backend())
    before = files_under(s.fs, s.job)

    def failing(pointer):
        raise error

    s.access.resolve_checkpoint = failing
    with pytest.raises(type(error)):
        collect_garbage(s.access, grace_period=0, now=future())
    assert before == files_under(s.fs, s.job)


def test_files_without_a_modification_time_are_kept(monkeypatch):
    """What cannot be dated is never deleted; it is listed as kept."""
    s = build_scenario(_memory_backend())

    class Undated(MemoryFileSystem):
        cachable = False

        def find(self, path, *args, **kwargs):
            found = super().find(path, *args, **kwargs)
            return {k: {**v, "created": None} for k, v in found.items()}

    monkeypatch.setattr(s.access, "_fs_cache", Undated())
    result = collect_garbage(s.access, grace_period=0, now=future())

    assert ((), tuple(sorted(s.referenced | s.garbage))) == (result.deleted, result.kept)


def test_bulk_deletes_that_fail_per_key_on_s3_are_raised(s3_server, monkeypatch):
    """A DeleteObjects response listing per-key errors (HTTP 200) is raised, not ignored."""
    from tests.support import Backend

    backend = Backend("s3", f"s3://{s3_server.new_bucket()}/base", s3_server.storage_options)
    s = build_scenario(backend)
    fs = s.access._fs
    real_call = fs.call_s3

    def refusing(method, *args, **kwargs):
        if method != "delete_objects":
            return real_call(method, *args, **kwargs)
        keys = [o["Key"] for o in kwargs["Delete"]["Objects"]]
        return {"Errors": [{"Key": k, "Code": "AccessDenied", "Message": "denied"} for k in keys]}

    monkeypatch.setattr(fs, "call_s3", refusing)

    with pytest.raises(OSError, match="S3 refused to delete 8 of 8 objects"):
        collect_garbage(s.access, grace_period=0, now=future())


# --------------------------------------------------------------------------------------------
#  arguments and modification times
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"grace_period": -1}, ValueError),
        ({"grace_period": dt.timedelta(seconds=-1)}, ValueError),
        ({"grace_period": float("nan")}, ValueError),
        ({"grace_period": None}, TypeError),
        ({"grace_period": "1h"}, TypeError),
        ({"grace_period": 0, "now": dt.datetime(2030, 1, 1)}, ValueError),
        ({"grace_period": 0, "now": float("inf")}, ValueError),
        ({"grace_period": 0, "extra_references": "memory:///one/string"}, TypeError),
        ({"grace_period": 0, "extra_references": [None]}, TypeError),
        ({"grace_period": 0, "max_workers": 0}, ValueError),
    ],
)
def test_bad_arguments_are_rejected_before_any_io(kwargs, error, monkeypatch):
    """Negative/NaN grace periods, naive datetimes and other bad arguments raise first."""
    access = new_access(_memory_backend())
    monkeypatch.setattr(access, "_fs_cache", DenyingMemoryFileSystem())
    with pytest.raises(error):
        collect_garbage(access, **kwargs)


def test_grace_period_as_timedelta_or_seconds_and_now_as_datetime_or_epoch_agree():
    """timedelta and seconds, aware datetime and epoch seconds give the same plan."""
    s = build_scenario(_memory_backend())
    now = future()
    as_datetime = dt.datetime.fromtimestamp(now, dt.timezone(dt.timedelta(hours=-5)))
    a = collect_garbage(s.access, grace_period=GRACE, now=now, dry_run=True)
    b = collect_garbage(s.access, grace_period=3600.0, now=as_datetime, dry_run=True)
    assert a == b


def test_memory_storage_without_a_directory_has_nothing_to_collect():
    """Checkpoints kept in process memory are not on storage: collecting them is an error."""
    access = MemoryCheckpointStorage().create_checkpoint_storage(JobID.generate())
    with pytest.raises(ValueError, match="process memory"):
        collect_garbage(access, grace_period=0)


def test_modification_time_normalises_local_memory_and_s3_entries():
    """mtime floats, created floats/datetimes and LastModified datetimes become epoch seconds."""
    when = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    epoch = when.timestamp()
    assert epoch == modification_time({"mtime": epoch, "created": 0.0})  # local disk
    assert epoch == modification_time({"created": epoch})  # memory listing
    assert epoch == modification_time({"created": when})  # memory info()
    assert epoch == modification_time({"LastModified": when})  # S3
    assert epoch == modification_time({"LastModified": when.replace(tzinfo=None)})  # naive: UTC
    assert epoch == modification_time({"updated": "2030-01-02T03:04:05Z"})  # GCS
    assert None is modification_time({"name": "x", "size": 1, "type": "file"})
    assert None is modification_time({"created": None, "mtime": True})


def test_real_backends_report_a_modification_time(backend):
    """Every backend's listing entry for a fresh file dates it to about now."""
    fs = fs_of(backend)
    path = type(fs)._strip_protocol(backend.url("dated", "file"))
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, b"x")
    entry = fs.find(path.rsplit("/", 1)[0], detail=True)[path]
    assert abs(time.time() - modification_time(entry)) < 120


# --------------------------------------------------------------------------------------------
#  property: what survives a collection is exactly what valid checkpoints reference
# --------------------------------------------------------------------------------------------

_steps = st.lists(
    st.one_of(
        st.tuples(st.just("complete"), st.integers(0, 2), st.integers(0, 2), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 2), st.integers(0, 2), st.just(False)),
        st.tuples(st.just("orphan"), st.integers(0, 1), st.integers(0, 1), st.just(False)),
        st.tuples(st.just("corrupt"), st.just(0), st.just(0), st.just(False)),
        st.tuples(st.just("subsume"), st.just(0), st.just(0), st.just(False)),
    ),
    max_size=7,
)


def shared_of(valid: dict) -> list:
    return [h for _, handles in valid.values() for h in handles if "/shared/" in h.path]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=_steps, seed=st.integers(0, 2**16), delete_corrupt=st.booleans())
def test_property_only_files_of_valid_checkpoints_and_taskowned_survive(
    steps, seed, delete_corrupt
):
    """After grace 0 and now in the future, the job dir is exactly the referenced files and
    taskowned/ (plus, without delete_corrupt, every file of a corrupt checkpoint and all of
    shared/); every retained checkpoint still reads back."""
    backend = _memory_backend()
    access = new_access(backend)
    fs = fs_of(backend)
    job = access.checkpoints_directory
    rng = random.Random(seed)
    valid: dict[int, tuple] = {}  # id -> (completed, handles)
    live_shared: list = []
    owned = set()
    corrupted: list[str] = []
    try:
        for checkpoint_id, (kind, n_exclusive, n_shared, reuse) in enumerate(steps, start=1):
            if kind in ("complete", "abort"):
                loc = access.initialize_location_for_checkpoint(checkpoint_id)
                handles = [write_state(loc, rng.randbytes(BIG)) for _ in range(n_exclusive)]
                handles += [write_state(loc, rng.randbytes(BIG), SHARED) for _ in range(n_shared)]
                if kind == "complete":
                    if reuse and live_shared:
                        handles.append(rng.choice(live_shared))
                    valid[checkpoint_id] = (
                        finalize(loc, metadata(checkpoint_id, handles)),
                        handles,
                    )
                    live_shared = [
                        h for _, hs in valid.values() for h in hs if "/shared/" in h.path
                    ]
            elif kind == "orphan":
                put(fs, f"{job}/{'shared' if n_exclusive else 'chk-1'}/{uuid.uuid4().hex}", b"o")
                if n_shared:
                    with access.create_task_owned_state_stream() as out:
                        out.write(rng.randbytes(BIG))
                        owned.add(out.close_and_get_handle().path)
            elif kind in ("corrupt", "subsume") and valid:
                victim = min(valid) if kind == "subsume" else max(valid)
                completed, _ = valid.pop(victim)
                if kind == "subsume":  # crashed after deleting _metadata, before the state
                    completed.metadata_handle.discard_state()
                else:  # one flipped bit in the body: still this library's format
                    data = bytearray(read(completed.metadata_handle))
                    data[-1] ^= 1
                    put(fs, completed.metadata_handle.path, bytes(data))
                    corrupted.append(completed.external_pointer + "/")
                live_shared = shared_of(valid)
        before = files_under(fs, job)

        collect_garbage(access, grace_period=0, now=future(), delete_corrupt=delete_corrupt)

        referenced = {c.metadata_handle.path for c, _ in valid.values()}
        referenced |= {h.path for _, hs in valid.values() for h in hs}
        if corrupted and not delete_corrupt:
            referenced |= {
                f for f in before if "/shared/" in f or any(f.startswith(c) for c in corrupted)
            }
        assert referenced | owned == files_under(fs, job)
        for completed, handles in valid.values():
            assert len(handles) == len(load_checkpoint_metadata(completed).all_handles())
            for handle in handles:
                read(handle)
    finally:
        fs.rm(type(fs)._strip_protocol(backend.base_url), recursive=True)


# --------------------------------------------------------------------------------------------
#  backends without the fixture (tests that need one specific filesystem)
# --------------------------------------------------------------------------------------------


def _memory_backend():
    from tests.support import Backend

    return Backend("memory", f"memory://gc-{uuid.uuid4().hex}", {})


def _local_backend(tmp_path):
    from tests.support import Backend

    return Backend("local", str(tmp_path / "base"), {})
