"""The local keyed-state store verifies what it opens (issue 24): a flipped bit, a truncated,
deleted or stale file, or a manifest that does not match its files, is a ``LocalStoreError``
naming the file; the runner then rebuilds the range from the checkpoint and says so."""

import dataclasses
import json
import os
import shutil
import sys
import zlib
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark import cloudpickle

from pipelines import FullSnapshotPolicy, StatefulRunner, read_state
from pipelines.keyed import (
    ArrowKeyedStateStore,
    LocalStoreError,
    _store_files,
    _store_verification,
    remove_store,
)
from tests.pipelines.support import (
    ALL,
    LAYOUT,
    NO_KEYS,
    GeneratedOrders,
    clicks_table,
    storage_of,
    store_state,
    totals_pipeline,
)

CLICKS = {f"user_{i}": 7_000_001 + 977 * i for i in range(200)}  # distinctive int64 bytes


def flip_bit_in(path: Path, value: int) -> None:
    """Flip the lowest bit of the int64 ``value`` where ``path`` stores it, in place (same
    inode and size): damage that only a checksum sees, and that changes a state value."""
    data = path.read_bytes()
    at = data.find(value.to_bytes(8, "little", signed=True))
    assert at >= 0, f"{value} is not in {path}"
    with open(path, "r+b") as file:
        file.seek(at)
        file.write(bytes([data[at] ^ 1]))


def flip_bit_of_value(path: Path, column: str, row: int) -> int:
    """Flip the lowest bit of an int64 ``column``'s value in ``row`` of the Arrow file
    ``path``, in place; returns the value it was. Where the value lies in the file: its
    buffer's address in a memory map of the file, less the map's."""
    source = pa.memory_map(str(path))
    base = source.read_buffer(1).address
    source.seek(0)
    array = pa.ipc.open_file(source).read_all().column(column).chunk(0)
    value = array[row].as_py()
    at = array.buffers()[1].address - base + 8 * (array.offset + row)
    data = path.read_bytes()
    assert int.from_bytes(data[at:at + 8], "little", signed=True) == value
    with open(path, "r+b") as file:
        file.seek(at)
        file.write(bytes([data[at] ^ 1]))
    return value


def files(directory: Path, prefix: str) -> list[Path]:
    return sorted(directory.glob(f"{prefix}-*.arrow"))


@pytest.fixture
def store_dir(tmp_path) -> Path:
    """A store whose segment holds ``CLICKS`` and whose one run changes user_0."""
    store = ArrowKeyedStateStore(tmp_path / "store", LAYOUT, ALL)
    store.load(clicks_table(CLICKS), version="v1")
    store.apply(clicks_table({"user_0": 5_550_001}), NO_KEYS, version="v2")
    store.close()
    assert (1, 1) == (len(files(tmp_path / "store", "segment")),
                      len(files(tmp_path / "store", "run")))
    return tmp_path / "store"


def reopen_fails_naming(directory: Path, path: Path) -> str:
    _store_verification._VERIFIED.clear()  # as a new process: nothing verified yet
    with pytest.raises(LocalStoreError) as raised:
        ArrowKeyedStateStore(directory, LAYOUT, ALL)
    assert str(path) in str(raised.value)
    return str(raised.value)


def test_an_intact_store_reopens_with_its_state(store_dir):
    """The control: nothing damaged, the store opens with its state and version."""
    _store_verification._VERIFIED.clear()
    store = ArrowKeyedStateStore(store_dir, LAYOUT, ALL)
    assert (CLICKS | {"user_0": 5_550_001}, "v2") == (store_state(store), store.version)


def test_a_bit_flip_in_the_segment_is_refused(store_dir):
    segment = files(store_dir, "segment")[0]
    flip_bit_in(segment, CLICKS["user_7"])

    message = reopen_fails_naming(store_dir, segment)

    assert "is damaged: its CRC-32 is" in message
    assert "rebuild it from the checkpoint chain" in message


def test_a_bit_flip_in_a_run_is_refused(store_dir):
    run = files(store_dir, "run")[0]
    flip_bit_in(run, 5_550_001)

    assert "is damaged" in reopen_fails_naming(store_dir, run)


def test_a_truncated_file_is_refused(store_dir):
    segment = files(store_dir, "segment")[0]
    os.truncate(segment, segment.stat().st_size // 2)

    assert "the manifest recorded" in reopen_fails_naming(store_dir, segment)


def test_a_deleted_file_is_refused(store_dir):
    run = files(store_dir, "run")[0]
    run.unlink()

    assert "is missing" in reopen_fails_naming(store_dir, run)


def test_a_deleted_manifest_is_refused_and_the_store_can_be_rebuilt(store_dir, tmp_path):
    """Without its manifest, a directory of store files is a store that lost it: refused,
    and removable by the rebuild (a directory with other files still is not)."""
    (store_dir / "MANIFEST.json").unlink()

    assert "is missing" in reopen_fails_naming(store_dir, store_dir / "MANIFEST.json")
    remove_store(store_dir)
    assert not store_dir.exists()


def test_a_manifest_with_a_wrong_checksum_for_a_file_is_refused(store_dir):
    """A manifest self-consistent (its own checksum right) but recording another CRC-32 for
    the segment than the segment's: the file is refused, not trusted."""
    manifest = store_dir / "MANIFEST.json"
    document = json.loads(manifest.read_text())
    segment = files(store_dir, "segment")[0]
    document["body"]["files"][segment.name][1] ^= 0x10
    document["crc32"] = zlib.crc32(json.dumps(document["body"], sort_keys=True).encode())
    manifest.write_text(json.dumps(document))

    assert "is damaged" in reopen_fails_naming(store_dir, segment)


def test_a_damaged_manifest_is_refused(store_dir):
    """A value changed in the manifest (the key group offsets) fails its own checksum."""
    manifest = store_dir / "MANIFEST.json"
    document = json.loads(manifest.read_text())
    document["body"]["offsets"][1] += 1
    manifest.write_text(json.dumps(document))

    assert "checksum does not match" in reopen_fails_naming(store_dir, manifest)


def test_a_stale_copy_of_the_directory_is_never_taken_for_the_current_state(store_dir, tmp_path):
    """An older copy of the directory copied back over the current one opens as the version
    it was (the caller compares it with the chain's digest and rebuilds), never as the current
    one; the old manifest alone over the current files names a file that is gone."""
    backup = tmp_path / "backup"
    shutil.copytree(store_dir, backup)
    store = ArrowKeyedStateStore(store_dir, LAYOUT, ALL, min_merge_rows=1, merge_ratio=0.0)
    # merges: a new segment, no runs
    store.apply(clicks_table({"user_1": 1}), NO_KEYS, version="v3")
    store.close()
    old_run = files(backup, "run")[0]
    assert not (store_dir / old_run.name).exists()

    shutil.copy2(backup / "MANIFEST.json", store_dir / "MANIFEST.json")
    reopen_fails_naming(store_dir, store_dir / files(backup, "segment")[0].name)

    shutil.rmtree(store_dir)
    shutil.copytree(backup, store_dir)
    _store_verification._VERIFIED.clear()
    stale = ArrowKeyedStateStore(store_dir, LAYOUT, ALL)
    assert ("v2", CLICKS["user_1"]) == (stale.version, store_state(stale)["user_1"])


def test_a_store_of_the_previous_format_is_refused_not_crashed_on(store_dir):
    """A manifest written before stores recorded checksums cannot be verified: refused with
    a clear error (the caller rebuilds), whatever its files hold."""
    manifest = store_dir / "MANIFEST.json"
    body = json.loads(manifest.read_text())["body"]
    body["format"] = "arrow-keyed-store-v2"
    del body["files"]
    manifest.write_text(json.dumps(body))

    message = reopen_fails_naming(store_dir, manifest)

    assert "records no checksums (format 'arrow-keyed-store-v2'" in message


def test_a_file_is_hashed_once_per_process_while_unchanged(store_dir, monkeypatch):
    """Reopening (a task at every batch) hashes nothing already verified or written by this
    process; a write to a file, even one that puts its mtime back, is hashed again and
    refused."""
    hashed = []
    real = _store_files._file_checksum
    monkeypatch.setattr(_store_files, "_file_checksum", lambda path: hashed.append(path.name)
                        or real(path))
    _store_verification._VERIFIED.clear()
    ArrowKeyedStateStore(store_dir, LAYOUT, ALL).close()
    first = len(hashed)
    store = ArrowKeyedStateStore(store_dir, LAYOUT, ALL)
    store.apply(clicks_table({"user_2": 3}), NO_KEYS, version="v3")  # its new run: known good
    store.close()
    ArrowKeyedStateStore(store_dir, LAYOUT, ALL).close()
    again = len(hashed)
    segment = files(store_dir, "segment")[0]
    before = segment.stat()
    flip_bit_in(segment, CLICKS["user_9"])
    os.utime(segment, ns=(before.st_atime_ns, before.st_mtime_ns))

    with pytest.raises(LocalStoreError, match=segment.name):
        ArrowKeyedStateStore(store_dir, LAYOUT, ALL)
    assert (2, 2, 3) == (first, again, len(hashed))


@dataclasses.dataclass(frozen=True)
class TwoBatchOrders(GeneratedOrders):
    """Two batches per partition: a run costs two batches."""

    def batches(self, spark, partition):
        return super().batches(spark, partition)[:2]


cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.mark.timeout(300)
def test_damaged_store_between_runs_is_rebuilt_and_the_checkpoint_is_right(spark, tmp_path,
                                                                          caplog):
    """Through the runner: a bit flipped in a state value of a warm local store's segment
    between two runs, in the value of a key the next run reads. That run's checkpoint equals
    a recomputation, a warning names the file, and the progress line counts the damaged
    store."""
    source = TwoBatchOrders(customers=300)
    pipeline = dataclasses.replace(totals_pipeline(tmp_path, keyed_parallelism=1,
                                                   full_snapshot=FullSnapshotPolicy()),
                                   source=source)
    local = tmp_path / "local"
    StatefulRunner(spark, storage_of(tmp_path), pipeline,
                   keyed_local_dir=str(tmp_path / "first")).run(["p1"])
    # another local directory: its first batch rebuilds the store, the chain's first change
    # file as the segment (the later changes as runs), so the segment holds state values
    StatefulRunner(spark, storage_of(tmp_path), pipeline, keyed_local_dir=str(local)).run(["p2"])
    (directory,) = {p.parent for p in local.rglob("MANIFEST.json")}
    segment = files(directory, "segment")[0]
    in_runs = set()
    for run in files(directory, "run"):
        in_runs |= set(pa.ipc.open_file(str(run)).read_all().column("customer").to_pylist())
    next_run_reads = {c for b in source.batches(None, "p3") for c, _ in source.rows(b)}
    customers = pa.ipc.open_file(str(segment)).read_all().column("customer").to_pylist()
    rows_read = [row for row, c in enumerate(customers)
                 if c not in in_runs and c in next_run_reads]
    assert rows_read, "no value of the warm store's segment is current and read by p3"
    flip_bit_of_value(segment, "total", rows_read[0])
    runner = StatefulRunner(spark, storage_of(tmp_path), pipeline, keyed_local_dir=str(local))
    lines = []

    with caplog.at_level("WARNING", logger="pipelines.runner"):
        runner.run(["p3"], on_progress=lines.append)

    assert recomputed(source, ["p1", "p2", "p3"]) == state_of(runner)
    warned = [r.getMessage() for r in caplog.records if segment.name in r.getMessage()]
    assert 1 == len(warned) and "rebuilt from the checkpoint" in warned[0]
    assert any("1 damaged or unreadable" in line for line in lines)


def recomputed(source: GeneratedOrders, partitions) -> dict[str, tuple[int, int]]:
    totals: dict[str, tuple[int, int]] = {}
    for partition in partitions:
        for batch in source.batches(None, partition):
            for customer, amount in source.rows(batch):
                orders, total = totals.get(customer, (0, 0))
                totals[customer] = (orders + 1, total + amount)
    return totals


def state_of(runner: StatefulRunner) -> dict[str, tuple[int, int]]:
    """The latest checkpoint's state, read with the public state reader."""
    table = read_state(runner.store.latest().external_pointer, "totals")
    customers = table.column("customer").to_pylist()
    assert len(customers) == len(set(customers)), "a key is in the state twice"
    return dict(zip(customers, zip(table.column("orders").to_pylist(),
                                   table.column("total").to_pylist(), strict=True),
                    strict=True))
