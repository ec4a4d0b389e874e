"""Keyed state without Spark: the local store, change files, full snapshots and chains,
checked against a plain dict model on real checkpoint storage (local disk)."""

import datetime as dt
import json
import tempfile
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoint_storage import (
    CheckpointMetadata,
    FileStateHandle,
    OperatorSubtaskState,
    StandaloneCompletedCheckpointStore,
    load_checkpoint_metadata,
    store_checkpoint_metadata,
)
from pipelines.keyed import (
    ArrowKeyedStateStore,
    KeyedStateChain,
    KeyedStateFormatError,
    KeyedStateLayout,
    KeyGroupRange,
    LocalStoreError,
    StateTtl,
    TtlTimeCharacteristic,
    assign_key_groups,
    chains_from_operator_state,
    chains_to_operator_state,
    compute_key_group_range_for_operator_index,
    read_change_file,
    read_full_snapshot,
    rebuild_store,
    remove_store,
    replay_chains,
    write_change_file,
    write_full_snapshot,
)
from tests.pipelines.support import (
    ALL,
    LAYOUT,
    MAX_PARALLELISM,
    NO_KEYS,
    SCHEMA,
    T0,
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



USERS = [f"user_{i}" for i in range(40)]
BATCH = st.tuples(st.dictionaries(st.sampled_from(USERS), st.integers(0, 10**6), max_size=15),
                  st.sets(st.sampled_from(USERS), max_size=6))
BATCHES = st.lists(BATCH.map(lambda b: (b[0], b[1] - b[0].keys())), min_size=1, max_size=12)


@pytest.mark.slow
@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(BATCHES, st.integers(0, 11))
def test_store_and_replay_equal_a_dict_model(batches, snapshot_after):
    """For any sequence of batches of upserts and deletes: the store (merging and compacting
    its runs often), the store reopened from disk, the replay of a full snapshot plus the
    change files since and a store rebuilt from them, all hold what a dict holds, and the
    stores count its keys."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Job(Path(tmp))
        store = ArrowKeyedStateStore(Path(tmp) / "store", LAYOUT, ALL, merge_ratio=0.5,
                                     min_merge_rows=5, max_runs=2)
        model: dict[str, int] = {}
        chain = KeyedStateChain(ALL, None)
        for number, (upserts, doomed) in enumerate(batches):
            model.update(upserts)
            for key in doomed:
                model.pop(key, None)
            store.apply(clicks_table(upserts), deletes(doomed), version=str(number))
            chain = chain.appended(write_change_file(job.factory, LAYOUT, ALL,
                                                     clicks_table(upserts), deletes(doomed)))
            if number == snapshot_after:
                chain = KeyedStateChain(ALL, write_full_snapshot(
                    job.factory, LAYOUT, ALL, store.sorted_batches()))
            asked = store.get(pa.table({"user": USERS}))
            assert (model, len(model)) == (as_model(asked), store.num_rows)
        store.close()
        reopened = ArrowKeyedStateStore(Path(tmp) / "store", LAYOUT, ALL)

        assert (model, len(model)) == (store_state(reopened), reopened.num_rows)
        assert str(len(batches) - 1) == reopened.version
        assert model == as_model(replay_chains([chain], LAYOUT, ALL))
        rebuilt = rebuild_store(Path(tmp) / "rebuilt", LAYOUT, ALL, [chain], "v")
        assert (model, len(model)) == (store_state(rebuilt), rebuilt.num_rows)


@settings(deadline=None, max_examples=15, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(min_size=1, max_size=8), st.integers(0, 99), max_size=200),
       st.lists(BATCH, max_size=3))
def test_rescaling_2_to_3_to_2_loses_and_duplicates_nothing(initial, batches):
    """State written by 2 tasks (full snapshot + change files), restored by 3 (each reads
    its range from the overlapping chains), checkpointed by those 3, restored by 2 again: the
    union of the tasks' states equals the model, each key in exactly one task."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Job(Path(tmp))
        model = dict(initial)
        everything = clicks_table(model)
        changes = []
        for upserts, doomed in batches:
            doomed = doomed - upserts.keys()
            model.update(upserts)
            for key in doomed:
                model.pop(key, None)
            changes.append((clicks_table(upserts), deletes(doomed)))

        def split(table: pa.Table, parallelism: int) -> list[pa.Table]:
            groups = LAYOUT.key_groups_of(table)
            ranges = [compute_key_group_range_for_operator_index(MAX_PARALLELISM, parallelism,
                                                                 i) for i in range(parallelism)]
            return [table.filter(pa.array((groups >= r.start) & (groups <= r.end)))
                    for r in ranges]

        def write_chains(state: list[pa.Table], with_changes: bool) -> list[KeyedStateChain]:
            chains = []
            for index, part in enumerate(state):
                key_groups = compute_key_group_range_for_operator_index(
                    MAX_PARALLELISM, len(state), index)
                store = ArrowKeyedStateStore(Path(tmp) / f"store-{len(state)}-{index}",
                                             LAYOUT, key_groups)
                store.apply(part, NO_KEYS)
                chain = KeyedStateChain(key_groups, write_full_snapshot(
                    job.factory, LAYOUT, key_groups, store.sorted_batches()))
                for upserts, doomed in changes if with_changes else ():
                    u, d = split(upserts, len(state))[index], split(doomed, len(state))[index]
                    chain = chain.appended(write_change_file(job.factory, LAYOUT, key_groups,
                                                             u, d))
                chains.append(chain)
            return chains

        def restore(chains: list[KeyedStateChain], parallelism: int) -> list[pa.Table]:
            return [replay_chains(chains, LAYOUT, compute_key_group_range_for_operator_index(
                MAX_PARALLELISM, parallelism, i)) for i in range(parallelism)]

        at_two = write_chains(split(everything, 2), with_changes=True)
        at_three = restore(at_two, 3)
        back_at_two = restore(write_chains(at_three, with_changes=False), 2)

        assert model == as_model(pa.concat_tables(at_three))
        assert model == as_model(pa.concat_tables(back_at_two))


def test_change_file_round_trips_upserts_and_deletes(job):
    """What a change file holds reads back as written: full upsert rows, deleted keys."""
    upserts = clicks_table({"a": 1, "b": 2})
    handle = write_change_file(job.factory, LAYOUT, ALL, upserts, deletes({"c"}))

    read_upserts, read_deletes = read_change_file(handle, LAYOUT, ALL)

    assert upserts.to_pylist() == read_upserts.sort_by("user").to_pylist()
    assert [{"user": "c"}] == read_deletes.to_pylist()
    assert job.access.shared_state_directory in handle.path


def test_full_snapshot_is_sorted_by_key_group_and_readable_as_parquet(job, tmp_path):
    """A full snapshot is plain Parquet sorted by key group, and a reader of a narrower
    range gets only that range's rows."""
    store = ArrowKeyedStateStore(tmp_path / "store", LAYOUT, ALL)
    store.apply(clicks_table({f"u{i}": i for i in range(200)}), NO_KEYS)
    handle = write_full_snapshot(job.factory, LAYOUT, ALL, store.sorted_batches())
    import pyarrow.parquet as pq

    table = pq.read_table(handle.path)
    groups = table.column("_key_group").to_pylist()
    half = KeyGroupRange(0, 3)
    expected = {k: v for k, v in as_model(table).items()
                if LAYOUT.key_groups_of(pa.table({"user": [k]}))[0] <= 3}

    assert sorted(groups) == groups
    assert expected == as_model(read_full_snapshot(handle, LAYOUT, ALL, half))


def test_chains_round_trip_through_metadata(job):
    """Chains stored as an operator state in a completed checkpoint's `_metadata` load back
    equal, with the max parallelism recorded."""
    chains = []
    for index in range(2):
        key_groups = compute_key_group_range_for_operator_index(MAX_PARALLELISM, 2, index)
        chain = KeyedStateChain(key_groups, None if index else write_full_snapshot(
            job.factory, LAYOUT, key_groups, []))
        chains.append(chain.appended(write_change_file(job.factory, LAYOUT, key_groups,
                                                       SCHEMA.empty_table(), NO_KEYS)))
    operator = chains_to_operator_state("clicks", MAX_PARALLELISM, chains)
    out = job.location.create_metadata_output_stream()
    store_checkpoint_metadata(CheckpointMetadata(1, (operator,)), out)
    completed = out.close_and_finalize_checkpoint()

    loaded = load_checkpoint_metadata(job.access.resolve_checkpoint(completed.external_pointer))

    assert MAX_PARALLELISM == loaded.operator_states[0].max_parallelism
    assert chains == chains_from_operator_state(loaded.operator_states[0])


def test_expired_rows_round_trip_and_are_unknown_where_not_recorded():
    """A chain's rows and expired rows are subtask properties that load back; a chain of a
    checkpoint written before expired rows were recorded loads with them unknown (None), not
    0, and a malformed count is refused naming the property."""
    recorded = KeyedStateChain(ALL, None, (), 40, 20)
    state = recorded.to_subtask_state()
    older = OperatorSubtaskState(state.handles, {k: v for k, v in state.properties.items()
                                                 if k != "expired_rows"})
    bad = OperatorSubtaskState(state.handles, state.properties | {"expired_rows": "x"})

    loaded = [KeyedStateChain.from_subtask_state(s, "here") for s in (state, older)]

    assert [(40, 20), (40, None)] == [(c.rows, c.expired_rows) for c in loaded]
    with pytest.raises(KeyedStateFormatError, match="here: invalid expired_rows='x'"):
        KeyedStateChain.from_subtask_state(bad, "here")


def test_chains_refuse_ranges_that_are_not_the_subtasks(job):
    """Chain i must cover subtask i's key groups, else the operator state is refused."""
    with pytest.raises(ValueError, match="chain 0 covers key groups 0-7, but subtask 0 of 2"):
        chains_to_operator_state("clicks", MAX_PARALLELISM,
                                 [KeyedStateChain(ALL, None), KeyedStateChain(ALL, None)])


def test_corrupted_change_file_is_refused_naming_the_file(job):
    """A change file whose bytes changed on storage is refused with an error naming it."""
    handle = write_change_file(job.factory, LAYOUT, ALL, clicks_table({"a": 1}), NO_KEYS)
    data = bytearray(Path(handle.path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(handle.path).write_bytes(bytes(data))

    with pytest.raises(KeyedStateFormatError, match=f"change file {handle.path} is unreadable"):
        replay_chains([KeyedStateChain(ALL, None, (handle,))], LAYOUT, ALL)


def test_a_file_of_another_kind_or_range_is_refused(job):
    """A full snapshot read as a change file, or a file of other key groups, is refused
    naming the file and what it says it is."""
    handle = write_full_snapshot(job.factory, LAYOUT, ALL, [])
    other = write_change_file(job.factory, LAYOUT, KeyGroupRange(0, 3), SCHEMA.empty_table(),
                              NO_KEYS)

    with pytest.raises(KeyedStateFormatError, match=f"{handle.path} is not the change"):
        read_change_file(handle, LAYOUT, ALL)
    with pytest.raises(KeyedStateFormatError, match=f"{other.path} is not the change"):
        read_change_file(other, LAYOUT, ALL)


def test_a_missing_change_file_names_it(job):
    """A change file deleted from storage is a FileNotFoundError naming it."""
    handle = write_change_file(job.factory, LAYOUT, ALL, clicks_table({"a": 1}), NO_KEYS)
    Path(handle.path).unlink()

    with pytest.raises(FileNotFoundError, match=handle.path):
        read_change_file(handle, LAYOUT, ALL)


def test_store_refuses_keys_of_other_key_groups(tmp_path):
    """A task's store takes only its range's keys: others mean rows were routed wrongly."""
    store = ArrowKeyedStateStore(tmp_path / "store", LAYOUT, KeyGroupRange(0, 0))
    many = clicks_table({f"u{i}": i for i in range(50)})

    with pytest.raises(ValueError, match="key\\(s\\) of other key groups"):
        store.apply(many, NO_KEYS)


def test_store_of_another_layout_or_range_is_refused(tmp_path):
    """Opening a store directory with another range or schema is a LocalStoreError (the
    caller rebuilds), and the directory is left as it was."""
    ArrowKeyedStateStore(tmp_path / "store", LAYOUT, ALL).apply(clicks_table({"a": 1}), NO_KEYS)
    other = KeyedStateLayout(("user",), SCHEMA.append(pa.field("x", pa.int8())),
                             MAX_PARALLELISM)

    with pytest.raises(LocalStoreError, match="schema differ"):
        ArrowKeyedStateStore(tmp_path / "store", other, ALL)
    with pytest.raises(LocalStoreError, match="key_groups differ"):
        ArrowKeyedStateStore(tmp_path / "store", LAYOUT, KeyGroupRange(0, 3))
    assert {"a": 1} == store_state(ArrowKeyedStateStore(tmp_path / "store", LAYOUT, ALL))


def test_the_ranges_of_a_stage_merge_their_runs_in_different_batches(tmp_path):
    """Two ranges given as many changes per batch merge their runs into their segments in
    different batches (a merge of each at once was a machine's peak): the first range at
    ``merge_ratio`` of its segment, the second (key groups from half of max_parallelism)
    half as late again; and the staggered store holds every change."""
    users = [f"user_{i}" for i in range(4000)]
    groups = assign_key_groups(pa.table({"user": users}), ("user",), MAX_PARALLELISM)
    half = MAX_PARALLELISM // 2
    ranges = [KeyGroupRange(0, half - 1), KeyGroupRange(half, MAX_PARALLELISM - 1)]
    keys = [[u for u, g in zip(users, groups.to_pylist(), strict=True) if g in r][:1000]
            for r in ranges]
    merged_at: list[list[int]] = [[], []]
    for i, key_groups in enumerate(ranges):
        store = ArrowKeyedStateStore(tmp_path / f"store-{i}", LAYOUT, key_groups,
                                     merge_ratio=0.2, min_merge_rows=1, max_runs=100)
        model = {k: 0 for k in keys[i]}
        store.load(clicks_table(model), version="0")
        for batch in range(1, 25):  # 20 changed keys a batch, 2% of the segment
            changed = {k: batch for k in keys[i][batch * 20:(batch + 1) * 20]}
            model |= changed
            store.apply(clicks_table(changed), NO_KEYS, version=str(batch))
            manifest = json.loads((tmp_path / f"store-{i}" / "MANIFEST.json").read_text())
            if not manifest["body"]["runs"]:
                merged_at[i].append(batch)
        assert (model, len(model)) == (store_state(store), store.num_rows)
        store.close()

    # 20% of 1000 rows: past 200 changed rows, the 11th batch; the second range past 250
    assert merged_at == [[11, 22], [13]]


def test_store_ignores_files_its_manifest_does_not_name(tmp_path):
    """A delta file written before a crash but never recorded in the manifest is not state:
    reopening drops it."""
    store = ArrowKeyedStateStore(tmp_path / "store", LAYOUT, ALL)
    store.apply(clicks_table({"a": 1}), NO_KEYS)
    manifest = (tmp_path / "store" / "MANIFEST.json").read_text()
    store.apply(clicks_table({"b": 2}), NO_KEYS)
    (tmp_path / "store" / "MANIFEST.json").write_text(manifest)  # as if the crash came first

    reopened = ArrowKeyedStateStore(tmp_path / "store", LAYOUT, ALL)

    assert {"a": 1} == store_state(reopened)
    assert 2 == len(list((tmp_path / "store").iterdir()))  # the manifest and one delta


def test_event_time_expiry_hides_and_drops_expired_keys(tmp_path):
    """With a TTL, ``get`` never returns expired state, and ``drop_expired`` removes it and
    returns its keys for the change file."""
    layout = KeyedStateLayout(("user",), SCHEMA, MAX_PARALLELISM,
                              StateTtl(dt.timedelta(seconds=10), timestamp_column="seen"))
    store = ArrowKeyedStateStore(tmp_path / "store", layout, ALL)
    store.apply(clicks_table({"old": 1, "new": 100}), NO_KEYS)
    cutoff = layout.ttl.cutoff(T0 + dt.timedelta(seconds=50))

    visible = store.get(pa.table({"user": ["old", "new"]}), cutoff=cutoff)
    dropped = store.drop_expired(cutoff)

    assert {"new": 100} == as_model(visible)
    assert [{"user": "old"}] == dropped.to_pylist()
    assert {"new": 100} == store_state(store)


def test_expired_rows_counts_what_the_ttl_expired_in_the_segment_and_the_runs(tmp_path):
    """``expired_rows`` equals an independent count of the expired keys, the segment's rows
    that runs replaced or deleted left out and the runs' upserts counted, and is 0 once
    ``drop_expired`` dropped them."""
    layout = KeyedStateLayout(("user",), SCHEMA, MAX_PARALLELISM,
                              StateTtl(dt.timedelta(seconds=10), timestamp_column="seen"))
    store = ArrowKeyedStateStore(tmp_path / "store", layout, ALL, min_merge_rows=10**6)
    model = {f"u{i}": i % 100 for i in range(3000)}
    store.load(clicks_table(model))
    changed = {f"u{i}": (i * 7) % 100 for i in range(0, 3000, 3)}  # some expire, some revive
    gone = [f"u{i}" for i in range(1, 3000, 5) if f"u{i}" not in changed]
    store.apply(clicks_table(changed), pa.table({"user": gone}))
    store.apply(clicks_table({"new": 5, "newer": 95}), NO_KEYS)
    model = {k: v for k, v in (model | changed | {"new": 5, "newer": 95}).items()
             if k not in gone}
    cutoff = layout.ttl.cutoff(T0 + dt.timedelta(seconds=50))  # seen before T0 + 40 s

    counted = store.expired_rows(cutoff)
    store.drop_expired(cutoff)

    assert (sum(v < 40 for v in model.values()), len(model), 0) == (
        counted, store.num_rows + counted, store.expired_rows(cutoff))


def test_processing_time_expiry_keeps_the_write_time_as_state(tmp_path, job):
    """Under processing-time expiry the write time is a stored column: it goes into change
    files, so a restore expires exactly what the store would."""
    layout = KeyedStateLayout(("user",), SCHEMA, MAX_PARALLELISM,
                              StateTtl(dt.timedelta(minutes=1),
                                       TtlTimeCharacteristic.PROCESSING_TIME))
    stamped = layout.stamp(clicks_table({"a": 1}), T0)
    handle = write_change_file(job.factory, layout, ALL, stamped, NO_KEYS)
    restored = replay_chains([KeyedStateChain(ALL, None, (handle,))], layout, ALL)

    assert [T0] == restored.column("_written_at").to_pylist()
    assert [True] == layout.ttl.expired(restored, layout.ttl.cutoff(
        T0 + dt.timedelta(minutes=2))).to_pylist()


def test_shared_files_are_file_handles_for_the_registry(job):
    """Change files and full snapshots are file handles in the job's shared/ directory,
    the kind the shared-state registry counts references of."""
    handles = [write_change_file(job.factory, LAYOUT, ALL, clicks_table({"a": 1}), NO_KEYS),
               write_full_snapshot(job.factory, LAYOUT, ALL, [])]

    assert [True, True] == [isinstance(h, FileStateHandle) for h in handles]
    assert [job.access.shared_state_directory] * 2 == [h.path.rsplit("/", 1)[0]
                                                      for h in handles]


def test_many_batches_replay_like_applying_them(job, tmp_path):
    """Fifty batches replayed from their change files equal the store that applied them."""
    store = ArrowKeyedStateStore(tmp_path / "store", LAYOUT, ALL, min_merge_rows=10)
    chain = KeyedStateChain(ALL, None)
    everyone = USERS * 5
    for number, users in enumerate(everyone[i:i + 4] for i in range(0, len(everyone), 4)):
        upserts = clicks_table({u: number for u in users})
        store.apply(upserts, NO_KEYS)
        chain = chain.appended(write_change_file(job.factory, LAYOUT, ALL, upserts, NO_KEYS))

    assert store_state(store) == as_model(replay_chains([chain], LAYOUT, ALL))


def test_not_null_state_columns_keep_their_schema(job, tmp_path):
    """A state schema with not-null columns comes back with that schema from the store, a
    change file and a replay, deletes included."""
    schema = pa.schema([pa.field("k", pa.int64(), nullable=False),
                        pa.field("v", pa.string(), nullable=False)])
    layout = KeyedStateLayout(("k",), schema, MAX_PARALLELISM)
    upserts, doomed = pa.table({"k": [1, 2], "v": ["a", "b"]}, schema=schema), pa.table(
        {"k": [3]})
    store = ArrowKeyedStateStore(tmp_path / "store", layout, ALL)
    store.apply(upserts, doomed)
    handle = write_change_file(job.factory, layout, ALL, upserts, doomed)

    assert [schema] * 3 == [store.get(pa.table({"k": [1, 3]})).schema,
                            read_change_file(handle, layout, ALL)[0].schema,
                            replay_chains([KeyedStateChain(ALL, None, (handle,))], layout,
                                          ALL).schema]


def test_rebuild_replaces_a_stale_store_with_the_chains_state(job, tmp_path):
    """A task with a stale store rebuilds it from the chain: the old rows are gone, the
    chain's are there, and the store says which version it holds."""
    stale = ArrowKeyedStateStore(tmp_path / "store", LAYOUT, ALL)
    stale.apply(clicks_table({"gone": 1}), NO_KEYS, version="3")
    stale.close()
    chain = KeyedStateChain(ALL, None, (write_change_file(job.factory, LAYOUT, ALL,
                                                          clicks_table({"a": 1}), NO_KEYS),))

    store = rebuild_store(tmp_path / "store", LAYOUT, ALL, [chain], version="7")

    assert ({"a": 1}, "7") == (store_state(store), store.version)


def test_a_directory_that_is_not_a_store_is_never_deleted(tmp_path):
    """A store pointed at a directory with other files refuses to open or be removed, and
    the files stay."""
    (tmp_path / "notes.txt").write_text("mine")

    with pytest.raises(LocalStoreError, match="not empty and holds no local store"):
        ArrowKeyedStateStore(tmp_path, LAYOUT, ALL)
    with pytest.raises(LocalStoreError, match="refusing to delete it"):
        remove_store(tmp_path)
    assert "mine" == (tmp_path / "notes.txt").read_text()


def test_shared_files_live_exactly_as_long_as_a_retained_checkpoint_references_them(job):
    """Retaining one checkpoint: change files stay while the latest chain references them,
    and go once a full snapshot starts a new chain and the old checkpoint is subsumed."""
    retained = StandaloneCompletedCheckpointStore(max_retained=1)
    chain = KeyedStateChain(ALL, None)
    written = []
    for checkpoint_id in (1, 2, 3):
        location = (job.location if checkpoint_id == 1
                    else job.access.initialize_location_for_checkpoint(checkpoint_id))
        factory = job.access.resolve_checkpoint_storage_location(
            checkpoint_id, location.location_reference)
        if checkpoint_id < 3:
            handle = write_change_file(factory, LAYOUT, ALL, clicks_table({"a": checkpoint_id}),
                                       NO_KEYS)
            chain = chain.appended(handle)
        else:
            handle = write_full_snapshot(factory, LAYOUT, ALL, [])
            chain = KeyedStateChain(ALL, handle)
        written.append(Path(handle.path))
        out = location.create_metadata_output_stream()
        operator = chains_to_operator_state("clicks", MAX_PARALLELISM, [chain])
        store_checkpoint_metadata(CheckpointMetadata(checkpoint_id, (operator,)), out)
        retained.add_checkpoint(out.close_and_finalize_checkpoint())
        retained.shared_state_registry.wait_for_pending_deletions()
        if checkpoint_id == 2:
            assert [True, True] == [p.exists() for p in written]

    assert [False, False, True] == [p.exists() for p in written]


# --- bounded memory: a range's replay holds a row group, not the range ---------------------

REPLAY_ROWS = 600_000  # ~9 row groups of a full snapshot


def _large_chain(job: Job, tmp_path: Path) -> tuple[KeyedStateChain, dict[str, int]]:
    """A full snapshot of ``REPLAY_ROWS`` keys, then a change file (upserts and deletes)."""
    model = {f"user_{i:07d}": i for i in range(REPLAY_ROWS)}
    store = ArrowKeyedStateStore(tmp_path / "large", LAYOUT, ALL)
    store.load(clicks_table(model))
    snapshot = write_full_snapshot(job.factory, LAYOUT, ALL, store.sorted_batches())
    changed = {f"user_{i:07d}": -i for i in range(0, REPLAY_ROWS, 97)}
    gone = {f"user_{i:07d}" for i in range(1, REPLAY_ROWS, 89)} - changed.keys()
    change = write_change_file(job.factory, LAYOUT, ALL, clicks_table(changed), deletes(gone))
    model.update(changed)
    for key in gone:
        del model[key]
    return KeyedStateChain(ALL, snapshot, (change,)), model


def _arrow_peak(consume) -> int:
    """The most bytes Arrow's default pool held at once while ``consume()`` ran, above what
    it held before (a proxy pool counts them: Parquet reads, takes and joins use it)."""
    with counting_pool() as proxy:
        consume()
    return proxy.max_memory()


def test_replay_holds_a_row_group_at_a_time(job, tmp_path):
    """The replay of a range yields parts of at most a row group, equal together to the
    whole replay, and Arrow holds at most half the range's state at once."""
    from pipelines.keyed._chain import _ROW_GROUP_ROWS, iter_replay_chains

    chain, model = _large_chain(job, tmp_path)
    whole = replay_chains([chain], LAYOUT, ALL)
    assert as_model(whole) == model
    sizes: list[int] = []
    replayed: dict[str, int] = {}

    def consume() -> None:
        for part in iter_replay_chains([chain], LAYOUT, ALL):
            sizes.append(part.num_rows)
            replayed.update(as_model(part))  # Python objects: the parts are not held

    peak = _arrow_peak(consume)
    assert replayed == model and sum(sizes) == len(model)
    assert max(sizes) <= _ROW_GROUP_ROWS
    assert peak < whole.nbytes / 2, (peak, whole.nbytes)


@pytest.mark.timeout(120)
def test_replay_task_streams_a_range(job, tmp_path):
    """The executor's replay of a range (``read_keyed_state``'s task body) streams: Arrow
    holds at most a third of the range's state at once (the whole range before)."""
    from checkpoint_storage import FileSystemCheckpointStorage as Storage
    from pipelines.keyed import KeyedResult, KeyedStage
    from pipelines.keyed._executor import _replay_ranges
    from pipelines.keyed._routing import OPERATOR_INDEX
    from pipelines.keyed._task import KeyedStageTask

    chain, model = _large_chain(job, tmp_path)
    stage = KeyedStage("clicks", "user", SCHEMA,
                       lambda rows, state: KeyedResult(state, NO_KEYS, state))
    task = KeyedStageTask(Storage(str(tmp_path / "checkpoints")), job.access.job_id.hex, 2,
                          job.location.location_reference, stage, SCHEMA, MAX_PARALLELISM, 1,
                          (chain,), 0)
    whole = replay_chains([chain], LAYOUT, ALL)
    rows = [0]

    def consume() -> None:
        for batch in _replay_ranges(task, False, iter([pa.record_batch({
                OPERATOR_INDEX: pa.array([0], pa.int32())})])):
            rows[0] += batch.num_rows

    peak = _arrow_peak(consume)
    assert rows[0] == len(model)
    assert peak < whole.nbytes / 2, (peak, whole.nbytes)


def test_apply_finds_the_keys_get_looked_up_without_searching_again(tmp_path):
    """A batch reads its keys (``get``), then writes their changes (``apply``): ``apply``
    takes where ``get`` found those keys (runs, segment, absent) and searches only for the
    others (here new keys, and stored keys the batch did not read); the state is the one a
    store reaches without the ``get``, and so is its row count."""
    model = {f"u{i}": i % 50 for i in range(2000)}
    earlier = [{f"u{i}": 1 for i in range(0, 2000, 7)}, {f"u{i}": 2 for i in range(0, 2000, 11)}]
    stores = []
    for name in ("read first", "written only"):
        store = ArrowKeyedStateStore(tmp_path / name, LAYOUT, ALL, min_merge_rows=10**6)
        store.load(clicks_table(model))
        for change in earlier:  # runs in front of the segment
            store.apply(clicks_table(change), NO_KEYS)
        stores.append(store)
    read_first, written_only = stores
    model = model | earlier[0] | earlier[1]
    read = [f"u{i}" for i in range(0, 2000, 3)] + ["new-read"]
    upserts = {k: 9 for k in read[:300]} | {"new-read": 9, "new-unread": 9, "u1": 9}
    gone = read[300:400] + ["u2", "u4", "not-there"]
    searched = []
    resolve = read_first._resolve

    def counted(keys, hashes):
        searched.append(len(hashes))
        return resolve(keys, hashes)

    read_first._resolve = counted
    read_first.get(pa.table({"user": read}))
    for store in stores:
        store.apply(clicks_table(upserts), deletes(gone))
    model = {k: v for k, v in (model | upserts).items() if k not in gone}

    assert [len(read), 5] == searched  # apply: u1, u2, u4, new-unread, not-there
    assert model == store_state(read_first) == store_state(written_only)
    assert len(model) == read_first.num_rows == written_only.num_rows
