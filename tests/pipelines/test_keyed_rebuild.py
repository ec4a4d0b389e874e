"""The rebuild of a local store from its chains in one pass (``rebuild_store``): the same
state as the per-file replay, loaded as one segment, and a damaged file still refused by
name before the store is touched. No Spark: real checkpoint storage on local disk."""

import tempfile
import tracemalloc
from pathlib import Path
from unittest import mock

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipelines.keyed import (
    ArrowKeyedStateStore,
    KeyedStateChain,
    KeyedStateFormatError,
    KeyedStateLayout,
    KeyGroupRange,
    _chain,
    _rebuild,
    rebuild_store,
    replay_chains,
    write_change_file,
    write_full_snapshot,
)
from tests.pipelines.support import (
    ALL,
    LAYOUT,
    NO_KEYS,
    SCHEMA,
    Job,
    as_model,
    clicks_table,
    counting_pool,
    deletes,
    store_state,
)


@pytest.fixture
def job(tmp_path) -> Job:
    return Job(tmp_path)


USERS = [f"user_{i}" for i in range(12)]
FILE = st.tuples(st.dictionaries(st.sampled_from(USERS), st.integers(0, 99), max_size=8),
                 st.sets(st.sampled_from(USERS), max_size=4))
# a change file holds a key once: an upsert or a delete
FILES = st.lists(FILE.map(lambda f: (f[0], f[1] - f[0].keys())), min_size=1, max_size=6)
# 8 key groups: (key group, hash) sorted as one number; 6: two sorts
LAYOUTS = st.sampled_from([LAYOUT, KeyedStateLayout(("user",), SCHEMA, 6)])


def _owned(layout: KeyedStateLayout, keys, key_groups: KeyGroupRange) -> set[str]:
    keys = sorted(keys)
    groups = layout.key_groups_of(pa.table({"user": pa.array(keys, pa.string())}))
    return {k for k, g in zip(keys, groups, strict=True)
            if key_groups.start <= g <= key_groups.end}


def _chains(job: Job, tmp: Path, layout: KeyedStateLayout, base: dict, files: list,
            snapshot: bool) -> tuple[list[KeyedStateChain], dict]:
    """Two chains (the two halves of the key groups): a full snapshot of ``base`` (else the
    chain starts empty and ``base`` is its first change file), then ``files`` of upserts and
    deletes; and the state they replay to, as a dict."""
    half = layout.max_parallelism // 2
    chains = []
    for key_groups in (KeyGroupRange(0, half - 1),
                       KeyGroupRange(half, layout.max_parallelism - 1)):
        rows = clicks_table({k: base[k] for k in _owned(layout, base, key_groups)})
        if snapshot:
            store = ArrowKeyedStateStore(tmp / f"base-{key_groups.start}", layout, key_groups)
            store.load(rows)
            chain = KeyedStateChain(key_groups, write_full_snapshot(
                job.factory, layout, key_groups, store.sorted_batches()))
            store.close()
        else:
            chain = KeyedStateChain(key_groups, None, (write_change_file(
                job.factory, layout, key_groups, rows, NO_KEYS),))
        for upserts, doomed in files:
            mine = _owned(layout, upserts, key_groups)
            chain = chain.appended(write_change_file(
                job.factory, layout, key_groups, clicks_table({k: upserts[k] for k in mine}),
                deletes(_owned(layout, doomed, key_groups))))
        chains.append(chain)
    model = dict(base)
    for upserts, doomed in files:
        model.update(upserts)
        for key in doomed:
            model.pop(key, None)
    return chains, model


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(LAYOUTS, st.dictionaries(st.sampled_from(USERS), st.integers(0, 99), max_size=12),
       FILES, st.booleans(), st.sampled_from([1 << 20, 1, 5]))
# a key changed in several files, deleted, then added again; another deleted for good
@example(LAYOUT, {"user_1": 1, "user_2": 2},
         [({"user_1": 10}, {"user_2"}), ({"user_1": 11}, set()), ({}, {"user_1"}),
          ({"user_1": 12, "user_3": 3}, set()), ({"user_3": 4}, set())], False, 1 << 20)
@example(LAYOUT, {"user_1": 1, "user_2": 2},
         [({"user_1": 10}, {"user_2"}), ({"user_1": 11}, set()), ({}, {"user_1"}),
          ({"user_1": 12, "user_3": 3}, set()), ({"user_3": 4}, set())], True, 1)
def test_one_pass_rebuild_equals_the_per_file_replay(layout, base, files, snapshot,
                                                     slice_rows):
    """For random chains of upserts and deletes (starting from a full snapshot or empty),
    the store rebuilt in one pass holds what the per-file replay (``replay_chains``) and a
    dict hold, for the whole range and for a range across both chains (rescaling); also
    rebuilt in slices of its key groups (``slice_rows``: 1, a slice per key group)."""
    with tempfile.TemporaryDirectory() as tmp, \
            mock.patch.object(_rebuild, "_SLICE_ROWS", slice_rows):
        tmp = Path(tmp)
        job = Job(tmp)
        chains, model = _chains(job, tmp, layout, base, files, snapshot)
        everything = KeyGroupRange(0, layout.max_parallelism - 1)
        across = KeyGroupRange(1, layout.max_parallelism - 2)
        for wanted in (everything, across):
            expected = {k: model[k] for k in _owned(layout, model, wanted)}
            store = rebuild_store(tmp / f"store-{wanted.start}", layout, wanted, chains, "v")
            assert (expected, len(expected), "v") == (
                store_state(store), store.num_rows, store.version)
            assert expected == as_model(replay_chains(chains, layout, wanted))
            store.close()


def test_a_rebuilt_store_is_one_segment(job, tmp_path):
    """A rebuild loads the chain's state as the store's segment (no runs to search on the
    next batch's lookups), even when its changes are few next to the base."""
    base = {f"user_{i}": i for i in range(100)}
    chain = KeyedStateChain(ALL, None, (
        write_change_file(job.factory, LAYOUT, ALL, clicks_table(base), NO_KEYS),
        write_change_file(job.factory, LAYOUT, ALL, clicks_table({"user_1": 5}), NO_KEYS)))

    store = rebuild_store(tmp_path / "store", LAYOUT, ALL, [chain], "v")
    store.close()

    reopened = ArrowKeyedStateStore(tmp_path / "store", LAYOUT, ALL)
    assert (base | {"user_1": 5}, []) == (
        store_state(reopened), [p.name for p in (tmp_path / "store").glob("run-*")])


@pytest.mark.parametrize("check_rows", [1 << 20, 1, 2])
def test_keys_sharing_a_hash_stay_apart(job, tmp_path, monkeypatch, check_rows):
    """Two keys with one hash (forced: a hash of 8 values) are two keys: each keeps its own
    last change, as in the per-file replay; also when the keys are compared a few rows at a
    time (``check_rows``), a collision in any part found."""
    monkeypatch.setattr(_rebuild, "_CHECK_ROWS", check_rows)
    real = _chain.hash_keys
    for module in (_chain, _rebuild):  # the files written and the rebuild: one weak hash
        monkeypatch.setattr(module, "hash_keys", lambda table, key: real(table, key)
                            & np.uint64(LAYOUT.max_parallelism - 1))
    files = [({"a": 1, "b": 2, "c": 3}, set()), ({"a": 4}, {"b"}), ({"b": 5, "d": 6}, {"c"})]
    chain = KeyedStateChain(ALL, None)
    for upserts, doomed in files:
        chain = chain.appended(write_change_file(job.factory, LAYOUT, ALL,
                                                 clicks_table(upserts), deletes(doomed)))

    store = rebuild_store(tmp_path / "store", LAYOUT, ALL, [chain], "v")

    assert {"a": 4, "b": 5, "d": 6} == store_state(store) == as_model(
        replay_chains([chain], LAYOUT, ALL))


@pytest.mark.parametrize("slice_rows", [1 << 20, 1])
def test_a_damaged_change_file_in_the_middle_fails_the_rebuild_naming_it(job, tmp_path,
                                                                          monkeypatch,
                                                                          slice_rows):
    """A change file whose bytes changed on storage, in the middle of a chain, fails the
    rebuild with an error naming it, and the store that was there is left as it was; also
    when the rebuild goes by slices of the key groups (``slice_rows`` 1: one per group)."""
    monkeypatch.setattr(_rebuild, "_SLICE_ROWS", slice_rows)
    chain = KeyedStateChain(ALL, None)
    for number in range(5):
        chain = chain.appended(write_change_file(job.factory, LAYOUT, ALL,
                                                 clicks_table({f"user_{number}": number}),
                                                 NO_KEYS))
    damaged = chain.changes[2]
    data = bytearray(Path(damaged.path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(damaged.path).write_bytes(bytes(data))
    old = ArrowKeyedStateStore(tmp_path / "store", LAYOUT, ALL)
    old.load(clicks_table({"kept": 1}), version="3")
    old.close()

    with pytest.raises(KeyedStateFormatError,
                       match=f"change file {damaged.path} is unreadable.*restore from an "
                             "earlier checkpoint"):
        rebuild_store(tmp_path / "store", LAYOUT, ALL, [chain], "4")

    reopened = ArrowKeyedStateStore(tmp_path / "store", LAYOUT, ALL)
    assert ({"kept": 1}, "3") == (store_state(reopened), reopened.version)


def test_each_row_of_the_chain_is_hashed_once(job, tmp_path, monkeypatch):
    """The rebuild hashes the rows it reads to order them, and gives the store the winners'
    hashes: the store does not hash the state again (a 4M-row range's second hash)."""
    from pipelines.keyed import _store

    hashed = []

    def counting(real):
        def hash_keys(table, key):
            hashed.append(table.num_rows)
            return real(table, key)
        return hash_keys

    base = {f"user_{i}": i for i in range(200)}
    chain = KeyedStateChain(ALL, None, (
        write_change_file(job.factory, LAYOUT, ALL, clicks_table(base), NO_KEYS),
        write_change_file(job.factory, LAYOUT, ALL, clicks_table({"user_1": 5}),
                          deletes({"user_2"}))))
    monkeypatch.setattr(_rebuild, "hash_keys", counting(_rebuild.hash_keys))
    monkeypatch.setattr(_store, "hash_keys", counting(_store.hash_keys))

    store = rebuild_store(tmp_path / "store", LAYOUT, ALL, [chain], "v")

    assert [202] == hashed
    expected = {k: v for k, v in base.items() if k != "user_2"} | {"user_1": 5}
    assert (expected, "v") == (store_state(store), store.version)
    store.close()
    assert expected == store_state(ArrowKeyedStateStore(tmp_path / "store", LAYOUT, ALL))


def test_a_load_refuses_key_hashes_that_are_not_its_rows(tmp_path):
    """Hashes handed to ``load`` with rows must be one per row: a store is never written
    with hashes of other rows."""
    store = ArrowKeyedStateStore(tmp_path / "store", LAYOUT, ALL)
    rows = clicks_table({"a": 1, "b": 2})

    with pytest.raises(ValueError, match="1 key hashes for 2 rows"):
        store.load(rows, key_hashes=np.zeros(1, np.uint64))


def test_a_base_of_many_row_groups_read_in_part_with_deletes(job, tmp_path, monkeypatch):
    """A full snapshot of many row groups (a key group split over two of them), read for a
    narrower range by its row groups' statistics, then changes with deletes: the winners
    taken from the files' chunks are the per-file replay's."""
    monkeypatch.setattr(_chain, "_ROW_GROUP_ROWS", 7)
    base = {f"user_{i}": i for i in range(120)}
    store = ArrowKeyedStateStore(tmp_path / "base", LAYOUT, ALL)
    store.load(clicks_table(base))
    chain = KeyedStateChain(ALL, write_full_snapshot(job.factory, LAYOUT, ALL,
                                                     store.sorted_batches(max_rows=5)))
    store.close()
    for number in range(3):
        chain = chain.appended(write_change_file(
            job.factory, LAYOUT, ALL,
            clicks_table({f"user_{i}": 1000 * number + i for i in range(number, 120, 7)}),
            deletes({f"user_{i}" for i in range(number + 3, 120, 11)})))
    narrower = KeyGroupRange(1, LAYOUT.max_parallelism - 2)

    rebuilt = rebuild_store(tmp_path / "store", LAYOUT, narrower, [chain], "v")

    expected = as_model(replay_chains([chain], LAYOUT, narrower))
    assert 0 < len(expected) < len(base)
    assert expected == store_state(rebuilt)
    rebuilt.close()


def _chain_of_many_files(job: Job, keys: int, files: int) -> KeyedStateChain:
    """A first change file of ``keys`` users, then ``files`` change files, each upserting a
    tenth of them and deleting a thousandth."""
    chain = KeyedStateChain(ALL, None, (write_change_file(
        job.factory, LAYOUT, ALL, clicks_table({f"user_{i}": i for i in range(keys)}),
        NO_KEYS),))
    return _with_change_files(job, LAYOUT, chain, keys, files, deleted_from=5)


def _with_change_files(job: Job, layout: KeyedStateLayout, chain: KeyedStateChain, keys: int,
                       files: int, deleted_from: int) -> KeyedStateChain:
    """``chain`` and ``files`` change files, the n-th upserting every tenth user from user n
    and deleting every thousandth from user n + ``deleted_from``."""
    for number in range(files):
        chain = chain.appended(write_change_file(
            job.factory, layout, chain.key_groups,
            clicks_table({f"user_{i}": number for i in range(number, keys, 10)}),
            deletes({f"user_{i}" for i in range(number + deleted_from, keys, 1000)})))
    return chain


def test_the_collision_check_takes_keys_from_one_chunk(job, tmp_path, monkeypatch):
    """The key columns of a chain's rows are concatenated once before the collision check:
    a take from a column of one chunk per file concatenated it at every part of the check
    (8 times the 8M keys of a 4M-row range at the worst point)."""
    monkeypatch.setattr(_rebuild, "_CHECK_ROWS", 100)  # several parts
    chunks = []
    real = _rebuild._same_keys

    def same_keys(rows, key, these, those):
        chunks.append(rows.column("user").num_chunks)
        return real(rows, key, these, those)

    monkeypatch.setattr(_rebuild, "_same_keys", same_keys)
    chain = _chain_of_many_files(job, 2_000, 5)

    store = rebuild_store(tmp_path / "store", LAYOUT, ALL, [chain], "v")

    assert len(chunks) > 1 and set(chunks) == {1}
    assert as_model(replay_chains([chain], LAYOUT, ALL)) == store_state(store)
    store.close()


def test_the_rebuild_never_holds_the_chain_and_all_winners_at_once(job, tmp_path):
    """The winners are taken column by column, each of the chain's columns freed once taken:
    Arrow's peak during a rebuild stays below the chain's decoded rows plus the winners (it
    held both, and a copy of a key column: 0.2-0.3 GB more at a 4M-row range's worst point)."""
    chain = _chain_of_many_files(job, 50_000, 10)
    decoded = sum(_chain._read(h, LAYOUT, _chain._CHANGE, ALL, None).nbytes
                  for h in chain.changes)
    store, peak = _rebuilt_counting(tmp_path, LAYOUT, ALL, chain)
    winners = store._segment.table.nbytes
    assert peak < decoded + winners, (peak, decoded, winners)
    assert as_model(replay_chains([chain], LAYOUT, ALL)) == store_state(store)
    store.close()


def _snapshot_and_changes(job: Job, tmp_path: Path, layout: KeyedStateLayout,
                          key_groups: KeyGroupRange, keys: int, files: int,
                          monkeypatch) -> KeyedStateChain:
    """A full snapshot of ``keys`` users in row groups of 500 rows, then ``files`` change
    files, each upserting a tenth of the users and deleting a thousandth."""
    with monkeypatch.context() as patch:
        patch.setattr(_chain, "_ROW_GROUP_ROWS", 500)
        store = ArrowKeyedStateStore(tmp_path / "base", layout, key_groups)
        store.load(clicks_table({f"user_{i}": i for i in range(keys)}))
        chain = KeyedStateChain(key_groups, write_full_snapshot(
            job.factory, layout, key_groups, store.sorted_batches(max_rows=500)))
        store.destroy()
    return _with_change_files(job, layout, chain, keys, files, deleted_from=3)


WIDE = KeyedStateLayout(("user",), SCHEMA, 64)  # 64 key groups: room for many slices


def test_the_rebuild_holds_a_slice_of_the_chain_not_the_chain(job, tmp_path, monkeypatch):
    """In slices of the key groups, a rebuild never holds the chain's files decoded at once
    (Arrow's peak stays below the base's and the changes' decoded bytes), nor numpy's work
    over all their rows (hashes, the sort, the collision check: ~70 bytes a row when the
    range was replayed at once); the store is the same."""
    key_groups = KeyGroupRange(0, WIDE.max_parallelism - 1)
    chain = _snapshot_and_changes(job, tmp_path, WIDE, key_groups, 40_000, 10, monkeypatch)
    decoded = sum(_chain._read(h, WIDE, kind, key_groups, None).nbytes for h, kind in zip(
        chain.handles, [_chain._FULL_SNAPSHOT] + [_chain._CHANGE] * len(chain.changes),
        strict=True))
    chain_rows = 40_000 + 10 * 4_000
    monkeypatch.setattr(_rebuild, "_SLICE_ROWS", 5_000)
    with counting_pool() as pool:
        tracemalloc.start()
        try:
            store = rebuild_store(tmp_path / "store", WIDE, key_groups, [chain], "v")
            numpy_peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert pool.max_memory() < decoded, (pool.max_memory(), decoded)
    assert numpy_peak < 32 * chain_rows, (numpy_peak, chain_rows)
    assert as_model(replay_chains([chain], WIDE, key_groups)) == store_state(store)
    store.close()


@pytest.mark.parametrize("narrower", [False, True])
def test_a_store_rebuilt_in_slices_is_the_store_rebuilt_whole(job, tmp_path, monkeypatch,
                                                              narrower):
    """Slices of the key groups (a base row group across two of them, a range narrower than
    the chain's) make the very segment one slice makes: the same rows in the same order,
    one record batch, the same key group offsets and the same file bytes."""
    key_groups = KeyGroupRange(0, WIDE.max_parallelism - 1)
    chain = _snapshot_and_changes(job, tmp_path, WIDE, key_groups, 6_000, 4, monkeypatch)
    wanted = KeyGroupRange(3, 50) if narrower else key_groups
    stores = []
    for slice_rows in (1 << 20, 700):
        monkeypatch.setattr(_rebuild, "_SLICE_ROWS", slice_rows)
        stores.append(rebuild_store(tmp_path / f"store-{slice_rows}", WIDE, wanted, [chain],
                                    "v"))
    whole, sliced = stores
    segment_bytes = [(s.directory / s._segment_file).read_bytes() for s in stores]
    assert sliced._segment.table.equals(whole._segment.table)
    assert sliced._segment.offsets.tolist() == whole._segment.offsets.tolist()
    assert [1] * len(whole._segment.table.columns) == [
        c.num_chunks for c in sliced._segment.table.columns]
    assert segment_bytes[0] == segment_bytes[1]
    assert as_model(replay_chains([chain], WIDE, wanted)) == store_state(sliced)


def test_files_out_of_key_group_order_are_sorted_before_they_are_sliced(job, tmp_path,
                                                                       monkeypatch):
    """Change files written before files were sorted by key group (a first change file of
    several row groups, and later ones, in key order) rebuild to the per-file replay's state
    in slices too."""
    key_groups = KeyGroupRange(0, WIDE.max_parallelism - 1)
    schema = _chain._file_schema(WIDE, _chain._CHANGE, key_groups)

    def unsorted_change_file(model: dict[str, int], doomed: set[str]):
        rows = clicks_table(model)
        keys = pa.concat_tables([rows.select(["user"]), deletes(doomed)])
        groups = WIDE.key_groups_of(keys).astype(np.int16)
        table = pa.table({
            "user": keys.column("user"),
            "clicks": pa.concat_arrays([rows.column("clicks").combine_chunks(),
                                        pa.nulls(len(doomed), pa.int64())]),
            "seen": pa.concat_arrays([rows.column("seen").combine_chunks(),
                                      pa.nulls(len(doomed), SCHEMA.field("seen").type)]),
            _chain.KEY_GROUP: pa.array(groups, pa.int16()),
            _chain.DELETED: pa.array([False] * rows.num_rows + [True] * len(doomed)),
        }, schema=schema)
        assert (np.diff(groups) < 0).any()  # not in key group order
        return _chain._write(job.factory, schema, [table], "")

    monkeypatch.setattr(_chain, "_ROW_GROUP_ROWS", 300)  # the first file: several row groups
    chain = KeyedStateChain(key_groups, None, (
        unsorted_change_file({f"user_{i}": i for i in range(2_000)}, set()),))
    for number in range(3):
        chain = chain.appended(unsorted_change_file(
            {f"user_{i}": 100 + number for i in range(number, 2_000, 7)},
            {f"user_{i}" for i in range(number + 1, 2_000, 13)}))
    monkeypatch.setattr(_rebuild, "_SLICE_ROWS", 400)

    store = rebuild_store(tmp_path / "store", WIDE, key_groups, [chain], "v")

    assert as_model(replay_chains([chain], WIDE, key_groups)) == store_state(store)
    store.close()


def test_a_rebuilt_segment_is_the_file_a_load_of_its_rows_writes(job, tmp_path, monkeypatch):
    """The segment a rebuild writes a column at a time from its slices' winners (kept on disk)
    is, byte for byte, the file ``load`` writes for the same rows (made one chunk a column,
    written by Arrow: what the rebuild did before), with the same key group offsets."""
    key_groups = KeyGroupRange(0, WIDE.max_parallelism - 1)
    chain = _snapshot_and_changes(job, tmp_path, WIDE, key_groups, 6_000, 4, monkeypatch)
    monkeypatch.setattr(_rebuild, "_SLICE_ROWS", 700)
    before = set(tmp_path.iterdir())
    rebuilt = rebuild_store(tmp_path / "rebuilt", WIDE, key_groups, [chain], "v")
    # the slices' files on disk were unnamed: nothing is left beside the store
    assert set(tmp_path.iterdir()) - before == {tmp_path / "rebuilt"}
    loaded = ArrowKeyedStateStore(tmp_path / "loaded", WIDE, key_groups)
    rows = replay_chains([chain], WIDE, key_groups)  # as the rebuild replays them: its schema
    loaded.load(pa.Table.from_arrays(rows.columns, schema=_rebuild._replay_schema(WIDE)),
                version="v")
    assert [(s.directory / s._segment_file).read_bytes() for s in (rebuilt, loaded)] == [
        (loaded.directory / loaded._segment_file).read_bytes()] * 2
    assert rebuilt._segment.offsets.tolist() == loaded._segment.offsets.tolist()
    assert rebuilt.num_rows == loaded.num_rows > 0
    rebuilt.close()
    loaded.close()


def test_the_rebuild_never_holds_all_its_winners(job, tmp_path, monkeypatch):
    """The slices' winners are kept on disk until the segment's write, which makes one column
    one chunk at a time (beside the key hashes): Arrow's peak during a rebuild of many
    slices stays well below the state it rebuilds (it held all the winners, and a column
    made one chunk: more than the state)."""
    key_groups = KeyGroupRange(0, WIDE.max_parallelism - 1)
    chain = _snapshot_and_changes(job, tmp_path, WIDE, key_groups, 40_000, 2, monkeypatch)
    monkeypatch.setattr(_rebuild, "_SLICE_ROWS", 5_000)
    store, peak = _rebuilt_counting(tmp_path, WIDE, key_groups, chain)
    state = store._segment.table.nbytes
    assert peak < state * 3 // 4, (peak, state)
    assert as_model(replay_chains([chain], WIDE, key_groups)) == store_state(store)
    store.close()


def test_the_rebuild_never_holds_the_change_files_later_slices(job, tmp_path, monkeypatch):
    """The change files are decoded once, one at a time, and each slice's part of them waits
    on disk for its slice: Arrow's peak stays well below the change files' decoded rows (it
    held their parts of every later slice at once: at the worst point of a 4M-row range,
    3.9M rows, about its state, from the first slice on)."""
    key_groups = KeyGroupRange(0, WIDE.max_parallelism - 1)
    chain = _snapshot_and_changes(job, tmp_path, WIDE, key_groups, 20_000, 20, monkeypatch)
    changes = sum(_chain._read(h, WIDE, _chain._CHANGE, key_groups, None).nbytes
                  for h in chain.changes)
    monkeypatch.setattr(_rebuild, "_SLICE_ROWS", 2_500)
    store, peak = _rebuilt_counting(tmp_path, WIDE, key_groups, chain)
    assert peak < changes // 2, (peak, changes)
    assert as_model(replay_chains([chain], WIDE, key_groups)) == store_state(store)
    store.close()


def _rebuilt_counting(tmp_path, layout, key_groups, chain):
    """``chain`` rebuilt into a store at ``tmp_path``, and the peak of what the rebuild alone
    allocated in Arrow."""
    with counting_pool() as pool:
        store = rebuild_store(tmp_path / "store", layout, key_groups, [chain], "v")
    return store, pool.max_memory()


def test_the_rebuild_holds_no_copy_of_its_base_file(job, tmp_path, monkeypatch):
    """The base's bytes, verified whole before the first slice, go to an unnamed temporary
    file, mapped, and the pages a slice read are handed back after it: the rebuild no longer
    holds them in memory through its slices (a 4M-row range's base: 59 MiB). Python's and
    numpy's memory (tracemalloc) at each slice's start held them whole."""
    key_groups = KeyGroupRange(0, WIDE.max_parallelism - 1)
    chain = _snapshot_and_changes(job, tmp_path, WIDE, key_groups, 40_000, 2, monkeypatch)
    monkeypatch.setattr(_rebuild, "_SLICE_ROWS", 5_000)
    held = []
    real = _rebuild._slice_winners

    def slice_winners(files, deleted, layout):
        held.append(tracemalloc.get_traced_memory()[0])
        return real(files, deleted, layout)

    monkeypatch.setattr(_rebuild, "_slice_winners", slice_winners)
    tracemalloc.start()
    try:
        store = rebuild_store(tmp_path / "store", WIDE, key_groups, [chain], "v")
    finally:
        tracemalloc.stop()
    base_bytes = chain.full_snapshot.state_size
    assert len(held) > 1 and max(held) < base_bytes // 2, (held, base_bytes)
    assert as_model(replay_chains([chain], WIDE, key_groups)) == store_state(store)
    store.close()


def test_a_damaged_base_fails_the_rebuild_naming_it(job, tmp_path, monkeypatch):
    """A full snapshot whose bytes changed on storage fails the rebuild naming it (its bytes
    are verified as they go to the temporary file), the store left as it was."""
    key_groups = KeyGroupRange(0, WIDE.max_parallelism - 1)
    chain = _snapshot_and_changes(job, tmp_path, WIDE, key_groups, 2_000, 2, monkeypatch)
    data = bytearray(Path(chain.full_snapshot.path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(chain.full_snapshot.path).write_bytes(bytes(data))
    old = ArrowKeyedStateStore(tmp_path / "store", WIDE, key_groups)
    old.load(clicks_table({"kept": 1}), version="3")
    old.close()

    with pytest.raises(KeyedStateFormatError,
                       match=f"file {chain.full_snapshot.path} is unreadable"):
        rebuild_store(tmp_path / "store", WIDE, key_groups, [chain], "4")

    reopened = ArrowKeyedStateStore(tmp_path / "store", WIDE, key_groups)
    assert ({"kept": 1}, "3") == (store_state(reopened), reopened.version)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tmp")]  # nothing left
