"""What a range's store holds in a run's later batches (issue 28, the 8M run's peak RSS): a
merge of the runs into a new segment and a full snapshot of a store with runs read the old
segment whole, through its memory map, and its pages counted in the worker's resident memory
until the store let the map go (+250 MiB a worker at 8M keys); a full snapshot built a copy of
the whole state before writing it (+390 MiB a worker). Both now hand the mapped pages back as
they go, and a full snapshot merges the runs into each batch as it is written. Resident file
pages of this process (``RssFile``, sampled) and Arrow's pool counted: proxies of a worker's
RSS that load does not change."""

import datetime as dt
import threading

import numpy as np
import pyarrow as pa
import pytest

from pipelines.keyed import ArrowKeyedStateStore, write_full_snapshot
from pipelines.keyed._key_groups import KeyGroupRange, group_hash_order, hash_keys
from pipelines.keyed._layout import KEY_GROUP, KeyedStateLayout
from tests.pipelines.support import Job, counting_pool

ROWS = 300_000
CHANGED = 35_000  # a run's rows: two stay runs, 25% of the segment (75,000 rows) merges
SCHEMA = pa.schema([pa.field("user", pa.string(), False), ("clicks", pa.int64()),
                    ("total", pa.decimal128(22, 2)), ("first", pa.timestamp("us", "UTC")),
                    ("last", pa.timestamp("us", "UTC"))])
LAYOUT = KeyedStateLayout(("user",), SCHEMA, 8)
RANGE = KeyGroupRange(0, 7)
T0 = dt.datetime(2026, 3, 10, tzinfo=dt.UTC)


def _rows(numbers: np.ndarray, clicks: int, layout: KeyedStateLayout = LAYOUT) -> pa.Table:
    """State rows of users ``numbers`` (state_growth's columns), in ``layout``'s store
    order."""
    seen = pa.array(np.full(len(numbers), np.datetime64(T0.replace(tzinfo=None), "us")),
                    SCHEMA.field("first").type)
    table = pa.table({"user": pa.array([f"u{i:09d}" for i in numbers]),
                      "clicks": pa.array(np.full(len(numbers), clicks), pa.int64()),
                      "total": pa.array(numbers * 7, pa.int64()).cast(pa.decimal128(22, 2)),
                      "first": seen, "last": seen}, schema=SCHEMA)
    hashes = hash_keys(table, layout.key)
    order = group_hash_order(hashes % np.uint64(layout.max_parallelism), hashes)
    return table.take(pa.array(order)).combine_chunks()


def _store_with_runs(tmp_path, runs: int) -> ArrowKeyedStateStore:
    """``ROWS`` keys in the segment, then ``runs`` runs of ``CHANGED`` keys each: changed
    keys, new keys and deletes among them."""
    rng = np.random.default_rng(5)
    store = ArrowKeyedStateStore(tmp_path / "store", LAYOUT, RANGE)
    store.apply(_rows(np.arange(ROWS), 1), pa.table({"user": pa.array([], pa.string())}),
                version="v0")
    for run in range(runs):
        changed = rng.choice(ROWS + 50_000, CHANGED, replace=False)  # some keys new
        doomed = pa.table({"user": [f"u{i:09d}" for i in
                                    rng.choice(ROWS, 1_000, replace=False)
                                    if i not in set(changed.tolist())]})
        store.apply(_rows(changed, run + 2), doomed, version=f"v{run + 1}")
    return store


def _resident_file_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status
                    if line.startswith("RssFile:"))


class _FilePeak:
    """The most resident file pages of this process above their level at the start, sampled
    every millisecond in a thread."""

    def __init__(self) -> None:
        self.start, self.peak = _resident_file_bytes(), 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, _resident_file_bytes() - self.start)

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(self.peak, _resident_file_bytes() - self.start)


def _written(handle) -> bytes:
    with handle.open() as stream:
        return stream.read()


def _snapshot_as_before(job: Job, store: ArrowKeyedStateStore):
    """The full snapshot as it was written before: the whole state merged into one table
    first (``_as_full_snapshot``), then its batches."""
    table, offsets = store._as_full_snapshot()
    groups = np.repeat(np.arange(RANGE.start, RANGE.end + 1, dtype=np.int16),
                       np.diff(offsets))
    table = table.append_column(KEY_GROUP, pa.array(groups))
    table = table.select([*LAYOUT.stored_schema.names, KEY_GROUP])
    return write_full_snapshot(job.factory, LAYOUT, RANGE, table.to_batches(1 << 16), "m")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("runs", [0, 1, 2])
def test_a_full_snapshot_is_the_file_the_merged_copy_wrote(tmp_path, runs):
    """The full snapshot of a store (a segment alone, with one run, with two: changed and new
    keys, deletes) is byte for byte the file written from the whole state merged first."""
    store = _store_with_runs(tmp_path, runs)
    try:
        assert len(store._runs) == runs
        job = Job(tmp_path / "job")
        expected = _written(_snapshot_as_before(job, store))
        actual = _written(write_full_snapshot(job.factory, LAYOUT, RANGE,
                                              store.sorted_batches(), "m"))
        assert actual == expected
    finally:
        store.close()


@pytest.mark.timeout(300)
def test_a_full_snapshot_of_a_store_with_runs_holds_a_batch_not_the_state(tmp_path):
    """A full snapshot of 300,000 rows and two runs of 35,000: Arrow's pool peaks under 1.1x
    the segment's file bytes beside what the store holds (0.84x: the runs' latest rows, a
    batch of 65,536 rows and the Parquet writer's; 0.52x at twice the rows), and the
    resident file pages under 0.75x (0.5x: the search of the runs' keys in the segment, then
    a batch's pages). It held the whole merged state (1.42x) and the segment's every page
    (1.03x) by its end."""
    store = _store_with_runs(tmp_path, 2)
    job = Job(tmp_path / "job")
    segment_bytes = store._files.checksums[store._segment_file][0]
    with counting_pool() as proxy:
        try:
            held = proxy.bytes_allocated()
            pages = _FilePeak()
            write_full_snapshot(job.factory, LAYOUT, RANGE, store.sorted_batches(), "m")
            file_peak = pages.stop()
            peak = proxy.max_memory() - held
        finally:
            store.close()
    assert peak < 1.1 * segment_bytes, peak / segment_bytes
    assert file_peak < 0.75 * segment_bytes, file_peak / segment_bytes


@pytest.mark.timeout(300)
def test_a_merge_hands_the_old_segments_pages_back_as_it_reads_them(tmp_path):
    """A merge of the runs into a new segment of 300,000 rows: the resident file pages stay
    under 0.6x the old segment's file bytes (0.36x: the search of the changed keys, then a
    column's pages at a time), where the old segment's every page was resident beside the
    merged copy (1.01x); the merged state is the one the runs made."""
    store = _store_with_runs(tmp_path, 2)
    try:
        expected = pa.Table.from_batches(list(store.sorted_batches()))
        segment_bytes = store._files.checksums[store._segment_file][0]
        store._files.drop_mapped_pages()
        pages = _FilePeak()
        store.apply(_rows(np.arange(ROWS + 50_000, ROWS + 60_000), 9),
                    pa.table({"user": pa.array([], pa.string())}), version="merged")
        file_peak = pages.stop()
        assert not store._runs  # merged
        merged = pa.Table.from_batches(list(store.sorted_batches()))
        assert merged.filter(pa.compute.less(merged.column("user"), f"u{ROWS:09d}")).equals(
            expected.filter(pa.compute.less(expected.column("user"), f"u{ROWS:09d}")))
    finally:
        store.close()
    assert file_peak < 0.6 * segment_bytes, file_peak / segment_bytes


@pytest.mark.timeout(300)
def test_a_lookup_hands_the_segments_pages_back_a_column_at_a_time(tmp_path, monkeypatch):
    """A steady batch's lookup of 3% of a 300,000-row segment's keys (as state_growth's 1% of
    8M keys a batch, 40,000 of a range's 4M rows, it touches nearly every page of every
    column): the resident file pages stay under 0.5x the segment's file bytes (0.37x: the
    search's hash and key columns, then a column at a time), where every column's pages were
    resident by the take's end (1.0x); the rows found are the segment's."""
    store = ArrowKeyedStateStore(tmp_path / "store", LAYOUT, RANGE)
    store.apply(_rows(np.arange(ROWS), 1), pa.table({"user": pa.array([], pa.string())}),
                version="v0")
    earlier, wanted = np.random.default_rng(3).choice(ROWS, (2, 9_000), replace=False)
    # an earlier lookup's: the code it runs resident (its file pages, counted too)
    store.get(pa.table({"user": [f"u{i:09d}" for i in earlier]}))
    segment_bytes = store._files.checksums[store._segment_file][0]
    drop = store._files.drop_mapped_pages
    drop()
    start, before_drops = _resident_file_bytes(), []

    def measured_drop() -> None:  # the pages resident at each hand-back: a lookup's highs
        before_drops.append(_resident_file_bytes() - start)
        drop()

    monkeypatch.setattr(store._files, "drop_mapped_pages", measured_drop)
    try:
        pages = _FilePeak()
        found = store.get(pa.table({"user": [f"u{i:09d}" for i in wanted]}))
        file_peak = max(pages.stop(), *before_drops)
    finally:
        store.close()
    assert found.sort_by("user").equals(_rows(wanted, 1).sort_by("user"))
    assert len(before_drops) > len(SCHEMA)  # the search's, then each column's
    assert file_peak < 0.5 * segment_bytes, (file_peak / segment_bytes, before_drops)


@pytest.mark.timeout(300)
def test_a_lookup_reads_the_segment_a_part_at_a_time(tmp_path, monkeypatch):
    """A lookup of 1% of a 1.2M-row segment's keys (state_growth's steady batch at 8M keys:
    40,000 of a range's 4M rows) with parts of 32,768 rows (``_store_segment.PART_ROWS``;
    262,144 in a run, 1/16 of a 4M-row range): the search and each column's take hand back
    their pages after each part, so the resident file pages stay under 0.2x the segment's
    file bytes (0.09-0.11x), where the search's hash and key columns, then a whole column at
    a time, held 0.36x; the rows found are the segment's."""
    import pipelines.keyed._store as store_module
    import pipelines.keyed._store_segment as segment_module

    monkeypatch.setattr(segment_module, "PART_ROWS", 1 << 15)
    monkeypatch.setattr(store_module, "PART_ROWS", 1 << 15)
    rows = 4 * ROWS
    # 128 key groups of ~9,400 rows: a part is a few of them (a key group is never cut)
    layout = KeyedStateLayout(("user",), SCHEMA, 128)
    store = ArrowKeyedStateStore(tmp_path / "store", layout, KeyGroupRange(0, 127))
    store.apply(_rows(np.arange(rows), 1, layout), pa.table({"user": pa.array([], pa.string())}),
                version="v0")
    earlier, wanted = np.random.default_rng(3).choice(rows, (2, rows // 100), replace=False)
    store.get(pa.table({"user": [f"u{i:09d}" for i in earlier]}))  # its code resident
    segment_bytes = store._files.checksums[store._segment_file][0]
    store._files.drop_mapped_pages()
    try:
        pages = _FilePeak()
        found = store.get(pa.table({"user": [f"u{i:09d}" for i in wanted]}))
        file_peak = pages.stop()
    finally:
        store.close()
    assert found.sort_by("user").equals(_rows(wanted, 1, layout).sort_by("user"))
    assert file_peak < 0.2 * segment_bytes, file_peak / segment_bytes
