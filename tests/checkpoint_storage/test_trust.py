"""Trust (issue 13, "Fail closed" and "CLI consistency"): never delete what cannot be read,
recognise Apache Flink's `_metadata`, one checkpoint = one id, unreadable `_metadata` named,
`_metadata` size bounded, one pointer rule, copy-savepoint decided by content.

Real checkpoints are written with the library on memory://, local disk and S3 (moto); Flink's
job directories are laid out byte for byte by ``tests.support.make_flink_job_directory``.
"""

import logging
import os
import time
import tracemalloc
import urllib.parse
import uuid
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_storage import (
    CheckpointIdMismatchError,
    CheckpointMetadata,
    CheckpointNotFoundError,
    CheckpointProperties,
    FileSystemCheckpointStorage,
    FileSystemCompletedCheckpointStore,
    ForeignCheckpointError,
    InvalidCheckpointError,
    JobID,
    OperatorState,
    OperatorSubtaskState,
    UnreadableCheckpointError,
    UnsafePathError,
    collect_garbage,
    copy_savepoint,
    dispose_savepoint,
    list_checkpoints,
    load_checkpoint_metadata,
)
from checkpoint_storage._access import resolve_checkpoint_pointer
from checkpoint_storage._filesystems import normalize_pointer
from checkpoint_storage._ids import checkpoint_directory_id
from checkpoint_storage._metadata import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAX_METADATA_BYTES,
    check_metadata_header,
)
from tests.support import (
    SHARED,
    finalize,
    flink_metadata,
    fs_of,
    make_flink_job_directory,
    metadata,
    payload,
    read,
    write_state,
)

BIG = 2048
THRESHOLD = 1024
FUTURE = 10 * 86400  # seconds ahead: every file written now is older than any grace period

pytestmark = pytest.mark.timeout(60)  # the backend fixture includes S3


# --------------------------------------------------------------------------------------------
#  helpers
# --------------------------------------------------------------------------------------------


def new_access(backend, job: JobID | None = None):
    storage = FileSystemCheckpointStorage(
        backend.url("cp"),
        storage_options=dict(backend.storage_options),
        file_state_size_threshold=THRESHOLD,
    )
    access = storage.create_checkpoint_storage(job or JobID.generate())
    access.initialize_base_locations()
    return access


def files_under(fs, url: str) -> set[str]:
    path = type(fs)._strip_protocol(url).rstrip("/")
    fs.invalidate_cache()
    return {p if url.startswith("/") else fs.unstrip_protocol(p) for p in fs.find(path)}


def put(fs, url: str, data: bytes) -> str:
    path = type(fs)._strip_protocol(url)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, data)
    fs.invalidate_cache()
    return url


def gc(access, **kwargs):
    return collect_garbage(access, grace_period=0, now=time.time() + FUTURE, **kwargs)


def complete(access, checkpoint_id: int, shared=None, seed: int = 0):
    """chk-<id> with one exclusive file, one new shared file and ``shared`` reused."""
    location = access.initialize_location_for_checkpoint(checkpoint_id)
    exclusive = write_state(location, payload(BIG, seed))
    new_shared = write_state(location, payload(BIG, seed + 1), SHARED)
    handles = [exclusive, new_shared, *(shared or [])]
    return finalize(location, metadata(checkpoint_id, handles)), exclusive, new_shared


def flip_body_bit(data: bytes) -> bytes:
    """This library's `_metadata` with one bit of its body flipped: corrupt, still ours."""
    mutated = bytearray(data)
    mutated[-1] ^= 0x01
    return bytes(mutated)


def reseal(data: bytes, checkpoint_id: int) -> bytes:
    """The same `_metadata` with another checkpoint id and a correct checksum."""
    body = bytearray(data[HEADER_SIZE:])
    body[:8] = checkpoint_id.to_bytes(8, "big")
    header = bytearray(data[:HEADER_SIZE])
    header[20:24] = zlib.crc32(bytes(body)).to_bytes(4, "big")
    return bytes(header) + bytes(body)


def copy_tree(fs, source_url: str, target_url: str) -> None:
    """``cp -r`` of a checkpoint directory, file by file."""
    source = type(fs)._strip_protocol(source_url)
    for path in fs.find(source):
        target = type(fs)._strip_protocol(target_url) + path[len(source) :]
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(target, fs.cat_file(path))
    fs.invalidate_cache()


# --------------------------------------------------------------------------------------------
#  Apache Flink's _metadata and other formats
# --------------------------------------------------------------------------------------------


def test_flinks_metadata_is_named_as_flinks_with_its_version(backend):
    """Loading Apache Flink's `_metadata` says who wrote it and which version, as a
    ForeignCheckpointError (an InvalidCheckpointError)."""
    access = new_access(backend, JobID("f" * 32))
    job = access.checkpoints_directory
    make_flink_job_directory(fs_of(backend), job, ids=(3,))

    with pytest.raises(ForeignCheckpointError) as caught:
        access.resolve_checkpoint(f"{job}/chk-3").load_metadata()

    assert str(caught.value).startswith(
        f"{job}/chk-3/_metadata was written by Apache Flink (metadata format version 6); this "
        "library cannot read it"
    )
    assert ("Apache Flink", 6) == (caught.value.format_name, caught.value.format_version)


@settings(max_examples=200, deadline=None)
@given(version=st.integers(0, 2**32 - 1), rest=st.binary(max_size=64))
def test_any_header_with_flinks_magic_is_flinks_with_its_version(version, rest):
    """Every header starting with 0x4960672d is recognised as Flink's, naming its version."""
    header = bytes.fromhex("4960672d") + version.to_bytes(4, "big") + rest

    with pytest.raises(ForeignCheckpointError) as caught:
        check_metadata_header(header[:HEADER_SIZE], "m")

    assert f"(metadata format version {version})" in str(caught.value)


@settings(max_examples=300, deadline=None)
@given(header=st.binary(max_size=HEADER_SIZE))
def test_every_header_is_ours_corrupt_or_foreign(header):
    """Any first bytes are either this library's (a header prefix or magic with a readable
    version), too short to be ours (invalid), or foreign; nothing else escapes."""
    try:
        check_metadata_header(header, "m")
        outcome = "ours"
    except ForeignCheckpointError:
        outcome = "foreign"
    except InvalidCheckpointError:
        outcome = "short"

    if header.startswith(MAGIC):
        version = int.from_bytes(header[8:10], "big") if len(header) >= 10 else 0
        expected = "foreign" if version > FORMAT_VERSION else "ours"
    elif MAGIC.startswith(header):
        expected = "short"
    else:
        expected = "foreign"
    assert expected == outcome


def test_list_shows_flinks_checkpoints_as_flinks_not_invalid(backend):
    """`list` of Flink's job directory has one row per chk-<id>: kind flink, status foreign,
    the reason naming the format."""
    job = new_access(backend, JobID("f" * 32)).checkpoints_directory
    make_flink_job_directory(fs_of(backend), job)

    infos = list_checkpoints(job, storage_options=dict(backend.storage_options))

    assert [(i, "flink", "foreign") for i in (3, 5, 6)] == [
        (i.checkpoint_id, i.kind, i.status) for i in infos
    ]
    assert all("written by Apache Flink (metadata format version 6)" in i.reason for i in infos)


def test_latest_skips_a_flink_checkpoint_among_ours(backend, caplog):
    """A Flink `_metadata` in a newer chk-<id> is skipped with a warning naming Flink."""
    access = new_access(backend)
    completed, _, _ = complete(access, 1)
    put(fs_of(backend), f"{access.checkpoints_directory}/chk-2/_metadata", flink_metadata())

    with caplog.at_level(logging.WARNING, logger="checkpoint_storage"):
        latest = access.latest_completed_checkpoint()

    assert completed.external_pointer == latest.external_pointer
    assert any(
        "Apache Flink" in r.getMessage() and "chk-2" in r.getMessage() for r in caplog.records
    )


# --------------------------------------------------------------------------------------------
#  GC fails closed
# --------------------------------------------------------------------------------------------


def test_gc_of_a_flink_job_directory_deletes_nothing_and_names_each_file(backend):
    """GC (dry run or not, grace 0) in Flink's job directory deletes no file, not even an
    in-progress Flink checkpoint's, and reports each `_metadata` as Flink's."""
    fs = fs_of(backend)
    access = new_access(backend, JobID("f" * 32))
    job = access.checkpoints_directory
    written = make_flink_job_directory(fs, job)
    written.add(put(fs, f"{job}/chk-7/{uuid.uuid4()}", payload(100, 7)))  # in progress

    dry = gc(access, dry_run=True)
    real = gc(access)

    assert ((), (), ()) == (dry.deleted, real.deleted, real.removed_directories)
    assert written == files_under(fs, job)
    assert [(f"{job}/chk-{i}", f"{job}/chk-{i}/_metadata", "foreign") for i in (3, 5, 6)] == [
        (s.pointer, s.metadata, s.reason) for s in real.skipped
    ]
    assert all("Apache Flink (metadata format version 6)" in s.detail for s in real.skipped)
    assert not real.shared_collected


def test_gc_keeps_a_corrupt_checkpoint_and_all_of_shared_and_collects_the_rest(backend):
    """Our chk-2 with a corrupt `_metadata` keeps every file, shared/ is not collected at all,
    and an aborted chk-3's files still go."""
    access = new_access(backend)
    fs = fs_of(backend)
    c1, e1, s1 = complete(access, 1)
    c2, e2, s2 = complete(access, 2, [s1], seed=10)
    put(fs, c2.metadata_handle.path, flip_body_bit(read(c2.metadata_handle)))
    aborted = access.initialize_location_for_checkpoint(3)
    e3 = write_state(aborted, payload(BIG, 20))
    s3 = write_state(aborted, payload(BIG, 21), SHARED)  # unreferenced, but shared is on hold

    result = gc(access)

    assert (e3.path,) == result.deleted
    kept = [c1.metadata_handle.path, e1.path, s1.path, c2.metadata_handle.path, e2.path]
    assert sorted([*kept, s2.path, s3.path]) == list(result.kept)
    assert [("corrupt", c2.external_pointer)] == [(s.reason, s.pointer) for s in result.skipped]
    assert "body checksum mismatch" in result.skipped[0].detail


def test_gc_deletes_a_corrupt_checkpoint_only_with_delete_corrupt(backend):
    """With delete_corrupt the corrupt chk-2 references nothing: its files and the shared
    file only it referenced go; chk-1's stay."""
    access = new_access(backend)
    fs = fs_of(backend)
    c1, e1, s1 = complete(access, 1)
    c2, e2, s2 = complete(access, 2, [s1], seed=10)
    put(fs, c2.metadata_handle.path, flip_body_bit(read(c2.metadata_handle)))

    result = gc(access, delete_corrupt=True)

    assert sorted([c2.metadata_handle.path, e2.path, s2.path]) == list(result.deleted)
    assert () == result.skipped
    assert [payload(BIG, 0), payload(BIG, 1)] == [read(e1), read(s1)]


def test_gc_never_deletes_an_unknown_format_even_with_delete_corrupt(backend):
    """An unknown magic number or a newer version is another format, not corruption: kept."""
    access = new_access(backend)
    fs = fs_of(backend)
    complete(access, 1)
    newer = MAGIC + (FORMAT_VERSION + 1).to_bytes(2, "big") + bytes(HEADER_SIZE - 10) + b"x"
    unknown = put(fs, f"{access.checkpoints_directory}/chk-2/_metadata", b"PK\x03\x04 a zip?")
    later = put(fs, f"{access.checkpoints_directory}/chk-3/_metadata", newer)

    result = gc(access, delete_corrupt=True)

    assert () == result.deleted
    assert [("unknown format", unknown), ("unknown format", later)] == [
        (s.reason, s.metadata) for s in result.skipped
    ]


def test_gc_keeps_a_copied_checkpoint_directory_whose_id_differs(backend):
    """`cp -r chk-1 chk-7`: GC keeps chk-7 whole (id mismatch, naming both ids)."""
    access = new_access(backend)
    fs = fs_of(backend)
    c1, _, _ = complete(access, 1)
    copy_tree(fs, c1.external_pointer, f"{access.checkpoints_directory}/chk-7")
    copied = files_under(fs, f"{access.checkpoints_directory}/chk-7")

    result = gc(access, delete_corrupt=True)

    assert () == result.deleted
    assert copied <= set(result.kept)
    assert ["id mismatch"] == [s.reason for s in result.skipped]
    assert "holds checkpoint 1 but its directory is chk-7" in result.skipped[0].detail


@pytest.mark.parametrize("kind", ["symlink loop", "directory", "fifo"])
def test_gc_keeps_a_checkpoint_whose_metadata_cannot_be_opened(tmp_path, kind):
    """A `_metadata` that is a symlink loop, a directory or a FIFO: GC keeps its directory
    and shared/, never blocks, and reports it unreadable."""
    access = new_access(_local(tmp_path))
    complete(access, 1)
    chk2 = f"{access.checkpoints_directory}/chk-2"
    os.makedirs(chk2)
    kept_file = put(fs_of(_local(tmp_path)), f"{chk2}/{uuid.uuid4()}", b"state")
    _plant_unopenable(f"{chk2}/_metadata", kind)

    result = gc(access)

    assert () == result.deleted
    assert kept_file in result.kept
    assert [("unreadable", chk2)] == [(s.reason, s.pointer) for s in result.skipped]
    assert os.path.lexists(f"{chk2}/_metadata")


# --------------------------------------------------------------------------------------------
#  one checkpoint = one id
# --------------------------------------------------------------------------------------------


def test_a_copied_checkpoint_directory_is_not_the_latest(backend, caplog):
    """`cp -r chk-1 chk-7`: latest is chk-1, the store recovers [1], `list` marks chk-7
    invalid; the warning and the reason name both ids."""
    access = new_access(backend)
    fs = fs_of(backend)
    c1, _, _ = complete(access, 1)
    copy_tree(fs, c1.external_pointer, f"{access.checkpoints_directory}/chk-7")

    with caplog.at_level(logging.WARNING, logger="checkpoint_storage"):
        latest = access.latest_completed_checkpoint()
        store = FileSystemCompletedCheckpointStore(access, max_retained=5)
    infos = list_checkpoints(access.checkpoints_directory, storage_options=backend.storage_options)

    assert c1.external_pointer == latest.external_pointer
    assert [1] == [c.checkpoint_id for c in store.all()]
    assert [(1, "completed"), (7, "invalid")] == [(i.checkpoint_id, i.status) for i in infos]
    assert "holds checkpoint 1 but its directory is chk-7" in infos[1].reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert 2 == sum("holds checkpoint 1 but its directory is chk-7" in w for w in warnings)


def test_a_resealed_metadata_of_another_id_is_a_mismatch_not_a_checkpoint(backend):
    """A `_metadata` whose id was rewritten (checksum intact) raises CheckpointIdMismatchError
    when loaded for its chk-<id>, and loads when asked without an id."""
    access = new_access(backend)
    c1, _, _ = complete(access, 1)
    put(fs_of(backend), c1.metadata_handle.path, reseal(read(c1.metadata_handle), 5))

    with pytest.raises(CheckpointIdMismatchError, match="holds checkpoint 5 .* chk-1"):
        access.resolve_checkpoint(c1.external_pointer).load_metadata(1)
    assert 5 == access.resolve_checkpoint(c1.external_pointer).load_metadata().checkpoint_id


@pytest.mark.parametrize("name", ["chk-99999999999999999999", f"chk-{2**63}", "chk-0"])
def test_ids_outside_1_to_2_pow_63_are_not_checkpoint_directories(backend, name):
    """chk-<id> with id 0 or >= 2^63 is ignored by latest, even holding a valid `_metadata`."""
    access = new_access(backend)
    c1, _, _ = complete(access, 1)
    put(
        fs_of(backend), f"{access.checkpoints_directory}/{name}/_metadata", read(c1.metadata_handle)
    )

    assert c1.external_pointer == access.latest_completed_checkpoint().external_pointer


@given(checkpoint_id=st.integers(0, 2**70))
def test_checkpoint_directory_names_map_to_63_bit_ids(checkpoint_id):
    """chk-<n> names id n exactly when 0 < n < 2^63; leading zeros and signs never do."""
    expected = checkpoint_id if 0 < checkpoint_id < 2**63 else None

    assert expected == checkpoint_directory_id(f"chk-{checkpoint_id}")
    assert None is checkpoint_directory_id(f"chk-0{checkpoint_id}")
    assert None is checkpoint_directory_id(f"chk-+{checkpoint_id}")


# --------------------------------------------------------------------------------------------
#  _metadata that cannot be opened, and its size
# --------------------------------------------------------------------------------------------


def _local(tmp_path):
    from tests.support import Backend

    return Backend("local", str(tmp_path), {})


def _plant_unopenable(path: str, kind: str) -> None:
    if kind == "symlink loop":
        os.symlink(path, path)
    elif kind == "directory":
        os.makedirs(path)
    else:
        os.mkfifo(path)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["symlink loop", "directory", "fifo"])
def test_an_unopenable_newest_metadata_is_named_with_what_to_do(tmp_path, kind):
    """latest, the store and resolve raise UnreadableCheckpointError naming the file and what
    to do, never a bare errno and never blocking on a FIFO."""
    access = new_access(_local(tmp_path))
    complete(access, 1)
    chk2 = f"{access.checkpoints_directory}/chk-2"
    os.makedirs(chk2)
    _plant_unopenable(f"{chk2}/_metadata", kind)

    errors = []
    for attempt in (
        access.latest_completed_checkpoint,
        lambda: FileSystemCompletedCheckpointStore(access, max_retained=5),
        lambda: access.resolve_checkpoint(chk2),
    ):
        with pytest.raises(UnreadableCheckpointError) as caught:
            attempt()
        errors.append(str(caught.value))

    for message in errors:
        assert message.startswith(f"cannot read {chk2}/_metadata (")
        assert "move the checkpoint directory aside" in message
        assert not message.startswith("[Errno")


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["symlink loop", "directory", "fifo"])
def test_list_marks_an_unopenable_metadata_and_goes_on(tmp_path, kind):
    """`list` marks the chk-<id> whose `_metadata` cannot be opened and lists the others."""
    access = new_access(_local(tmp_path))
    complete(access, 1)
    chk2 = f"{access.checkpoints_directory}/chk-2"
    os.makedirs(chk2)
    _plant_unopenable(f"{chk2}/_metadata", kind)

    infos = list_checkpoints(access.checkpoints_directory)

    assert [(1, "completed"), (2, "unreadable")] == [(i.checkpoint_id, i.status) for i in infos]
    assert infos[1].reason.startswith(f"cannot read {chk2}/_metadata (")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_a_metadata_without_read_permission_is_unreadable(tmp_path):
    """A `_metadata` this process may not read raises UnreadableCheckpointError naming it."""
    access = new_access(_local(tmp_path))
    c1, _, _ = complete(access, 1)
    os.chmod(c1.metadata_handle.path, 0)

    with pytest.raises(UnreadableCheckpointError, match="Permission denied"):
        access.latest_completed_checkpoint()


@pytest.mark.parametrize("header", [MAGIC + FORMAT_VERSION.to_bytes(2, "big"), flink_metadata()])
def test_a_200_mib_metadata_is_refused_after_reading_its_header(tmp_path, header):
    """A 200 MiB `_metadata` (ours: too large, naming file and size; Flink's: foreign) is
    refused with less than 4 MiB read into memory."""
    access = new_access(_local(tmp_path))
    path = f"{access.checkpoints_directory}/chk-1/_metadata"
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(200 * 1024 * 1024)  # sparse: nothing big on disk

    tracemalloc.start()
    try:
        with pytest.raises(InvalidCheckpointError) as caught:
            access.resolve_checkpoint(path).load_metadata()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    assert peak < 4 * 1024 * 1024
    if header.startswith(MAGIC):
        assert f"{path} is not a valid or complete checkpoint ({200 * 1024 * 1024} bytes" in str(
            caught.value
        )
        assert f"more than the {MAX_METADATA_BYTES}" in str(caught.value)
    else:
        assert isinstance(caught.value, ForeignCheckpointError)


# --------------------------------------------------------------------------------------------
#  pointers: one rule for the CLI and restore_from
# --------------------------------------------------------------------------------------------


def test_file_urls_name_the_local_path(tmp_path):
    """file:/abs, file:///abs, file://localhost/abs and percent-encoded file URLs resolve to the
    checkpoint at that path, with its plain path as pointer."""
    base = tmp_path / "a dir \u00e9"
    storage = FileSystemCheckpointStorage(str(base), file_state_size_threshold=THRESHOLD)
    access = storage.create_checkpoint_storage(JobID.generate())
    access.initialize_base_locations()
    c1, _, _ = complete(access, 1)
    path = c1.external_pointer
    quoted = urllib.parse.quote(path)

    pointers = [
        f"file:{path}",
        f"file:{quoted}",
        f"file://{quoted}",
        f"file://localhost{quoted}",
        f"FILE://{quoted}",
    ]

    assert [path] * 5 == [storage.resolve_checkpoint(p).external_pointer for p in pointers]


def test_a_file_url_of_another_host_is_refused():
    """file://otherhost/... names a file elsewhere: ValueError before any I/O."""
    with pytest.raises(ValueError, match="host 'otherhost'"):
        normalize_pointer("file://otherhost/data/chk-1")


@settings(max_examples=100, deadline=None)
@given(
    parts=st.lists(st.text("abc-_%2A", min_size=1, max_size=5), min_size=1, max_size=4).filter(
        lambda ps: all(p not in (".", "..") for p in ps)
    ),
    ups=st.integers(0, 2),
)
def test_leading_dot_segments_of_relative_paths_resolve_against_the_cwd(parts, ups):
    """A relative path with leading ./ and ../ names the path below the current directory
    (as a shell would), in the library as in the CLI."""
    relative = "./" + "../" * ups + "/".join(parts)
    base = os.getcwd()
    for _ in range(ups):
        base = os.path.dirname(base)

    assert "/".join([base.rstrip("/"), *parts]) == normalize_pointer(relative)


@pytest.mark.parametrize(
    "pointer, advice",
    [
        ("/data/cp/job/../job/chk-1", "write it as /data/cp/job/chk-1"),
        ("chk-1/../chk-2", f"write it as {os.getcwd()}/chk-2"),
        ("s3://b/cp/./chk-1", "write the URL without them (s3://b/cp/chk-1)"),
        ("s3://b/cp/%2e%2e/chk-1", "percent-encoding or backslashes"),
        ("file:///data/x/../chk-1", "write it as /data/chk-1"),
    ],
)
def test_dot_segments_inside_a_pointer_are_refused_with_advice_for_that_input(pointer, advice):
    """'.'/'..' inside a pointer raise UnsafePathError whose advice fits the input."""
    with pytest.raises(UnsafePathError) as caught:
        resolve_checkpoint_pointer(pointer, None)

    assert advice in str(caught.value)


def test_a_job_directory_given_as_pointer_suggests_latest(backend):
    """Resolving a job directory says it is one and suggests `checkpoints latest <dir>`."""
    access = new_access(backend)
    complete(access, 1)
    job = access.checkpoints_directory

    with pytest.raises(CheckpointNotFoundError) as caught:
        resolve_checkpoint_pointer(job, dict(backend.storage_options))

    assert f"`checkpoints latest {job}`" in str(caught.value)
    assert "does not exist" not in str(caught.value)


# --------------------------------------------------------------------------------------------
#  copy-savepoint decides by content; dispose of a corrupt checkpoint
# --------------------------------------------------------------------------------------------


def test_a_checkpoint_whose_files_all_lie_inside_it_copies_and_restores(backend):
    """A chk-<id> holding only its own files and inline state copies, and the copy loads the
    same state, although its properties say checkpoint."""
    access = new_access(backend)
    location = access.initialize_location_for_checkpoint(4)
    handles = [write_state(location, payload(BIG, 1)), write_state(location, b"inline")]
    md = CheckpointMetadata(
        4,
        (OperatorState("op", 1, subtask_states={0: OperatorSubtaskState(tuple(handles))}),),
        {"pos": b"p"},
        CheckpointProperties.for_checkpoint(),
    )
    completed = finalize(location, md)

    copy = copy_savepoint(
        completed.external_pointer, backend.url("copies"), storage_options=backend.storage_options
    )
    loaded = load_checkpoint_metadata(resolve_checkpoint_pointer(copy, backend.storage_options))

    assert [payload(BIG, 1), b"inline"] == [read(h) for h in loaded.all_handles()]


def test_copy_names_every_file_outside_the_directory(backend):
    """A checkpoint referencing shared/ files is refused, naming them."""
    access = new_access(backend)
    c1, _, s1 = complete(access, 1)
    c2, _, s2 = complete(access, 2, [s1], seed=5)

    with pytest.raises(ValueError) as caught:
        copy_savepoint(
            c2.external_pointer, backend.url("copies"), storage_options=backend.storage_options
        )

    assert "references 2 state file(s) outside its directory" in str(caught.value)
    assert s1.path in str(caught.value) and s2.path in str(caught.value)


def test_dispose_corrupt_deletes_only_a_corrupt_checkpoint_of_ours(backend):
    """dispose(corrupt=True) removes a corrupt chk-<id>; it refuses a valid one and Flink's."""
    access = new_access(backend)
    fs = fs_of(backend)
    c1, _, _ = complete(access, 1)
    c2, _, s2 = complete(access, 2, seed=3)
    put(fs, c2.metadata_handle.path, flip_body_bit(read(c2.metadata_handle)))
    flink = put(fs, f"{access.checkpoints_directory}/chk-3/_metadata", flink_metadata())
    options = dict(backend.storage_options)

    dispose_savepoint(c2.external_pointer, storage_options=options, corrupt=True)
    with pytest.raises(ValueError, match="is not corrupt"):
        dispose_savepoint(c1.external_pointer, storage_options=options, corrupt=True)
    with pytest.raises(ForeignCheckpointError):
        dispose_savepoint(flink, storage_options=options, corrupt=True)

    assert set() == files_under(fs, c2.external_pointer)
    assert payload(BIG, 4) == read(s2)  # shared state is left to gc
    assert {flink} == files_under(fs, f"{access.checkpoints_directory}/chk-3")
