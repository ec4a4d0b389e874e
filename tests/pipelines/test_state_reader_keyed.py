"""Reading a keyed stage's state (format ``keyed-v1``) from a snapshot: ``read_state``, the
Spark data source ``checkpoint`` and ``checkpoints read`` return the live rows of the chains
(full snapshot, then change files), verify every file, and hide rows expired under a TTL.

Snapshots are built by hand, as the runner will write them: change files and
full snapshots through the worker view, the chains as the stage's operator state, and the
master states ``pipeline-name``, ``state-format/<stage>``, ``state-schema/<stage>`` and
``keyed-state/<stage>``.
"""

import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest

from checkpoint_storage import (
    JOB_NAME_STATE,
    STATE_SCHEMA_PREFIX,
    ByteStreamStateHandle,
    CheckpointMetadata,
    FileStateHandle,
    FileSystemCheckpointStorage,
    InvalidCheckpointError,
    JobID,
    StateIntegrityError,
    store_checkpoint_metadata,
)
from checkpoint_storage.spi import STATE_FORMAT_PREFIX
from pipelines import open_snapshot, read_state, register_checkpoint_source
from pipelines.keyed import (
    CHAIN_FORMAT,
    KEY_GROUP,
    KEYED_STATE_PREFIX,
    KeyedStateChain,
    KeyedStateLayout,
    StateTtl,
    TtlTimeCharacteristic,
    chains_to_operator_state,
    compute_key_group_range_for_operator_index,
    encode_keyed_master_state,
    write_change_file,
    write_full_snapshot,
)
from tests.pipelines.support import run_read_cli as run_cli

pytestmark = pytest.mark.timeout(600)

STAGE = "clicks"
SCHEMA = pa.schema([("user", pa.string()), ("clicks", pa.int64()),
                    ("seen", pa.timestamp("us", "UTC"))])
MAX_PARALLELISM = 8
LAYOUT = KeyedStateLayout(("user",), SCHEMA, MAX_PARALLELISM)
T0 = dt.datetime(2026, 3, 10, tzinfo=dt.UTC)
USERS = [f"user_{i}" for i in range(30)]


@dataclass(frozen=True)
class Change:
    """One batch's changes: upserted keys with their clicks, deleted keys."""

    upserts: dict[str, int]
    deletes: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Written:
    """A built snapshot: its pointer and the state files of its chains, by range."""

    pointer: str
    chains: list[KeyedStateChain]


def rows(model: dict[str, int], layout: KeyedStateLayout = LAYOUT,
         written_at: dt.datetime | None = None) -> pa.Table:
    """State rows of ``model`` (user -> clicks), each seen at T0 + clicks seconds."""
    keys = sorted(model)
    table = pa.table({"user": pa.array(keys, pa.string()),
                      "clicks": pa.array([model[k] for k in keys], pa.int64()),
                      "seen": pa.array([T0 + dt.timedelta(seconds=model[k]) for k in keys],
                                       pa.timestamp("us", "UTC"))})
    return table if written_at is None else layout.stamp(table, written_at)


def as_model(table: pa.Table) -> dict[str, int]:
    users, clicks = table.column("user").to_pylist(), table.column("clicks").to_pylist()
    assert len(set(users)) == len(users), "a key is in the state twice"
    return dict(zip(users, clicks, strict=True))


def table_rows(table: pa.Table) -> list[tuple]:
    return sorted((tuple(row.values()) for row in table.to_pylist()), key=repr)


def in_range(layout: KeyedStateLayout, model: dict[str, int], index: int,
             parallelism: int) -> dict[str, int]:
    """The part of ``model`` whose keys belong to range ``index`` of ``parallelism``."""
    key_groups = compute_key_group_range_for_operator_index(MAX_PARALLELISM, parallelism, index)
    groups = layout.key_groups_of(pa.table({"user": pa.array(list(model), pa.string())}))
    return {key: model[key] for key, group in zip(model, groups, strict=True)
            if key_groups.start <= group <= key_groups.end}


def build_snapshot(
    root: Path,
    layout: KeyedStateLayout,
    ranges: list[tuple[dict[str, int] | None, list[Change], dt.datetime | None]],
    *,
    threshold: int = 0,
    clock: dt.datetime | None = None,
    timestamp: dt.datetime = T0,
    written_at: list[dt.datetime] | None = None,
) -> Written:
    """A completed checkpoint of the keyed stage ``clicks``: per range a full snapshot of
    its rows (None: no full snapshot) and change files in order. Under processing-time TTL
    ``written_at`` gives the write time of the full snapshot then of each change."""
    storage = FileSystemCheckpointStorage(str(root / "chk"), file_state_size_threshold=threshold)
    access = storage.create_checkpoint_storage(JobID.generate())
    access.initialize_base_locations()
    location = access.initialize_location_for_checkpoint(1)
    factory = access.resolve_checkpoint_storage_location(1, location.location_reference)
    chains = []
    for index, (snapshotted, changes, _) in enumerate(ranges):
        key_groups = compute_key_group_range_for_operator_index(
            MAX_PARALLELISM, len(ranges), index)
        times = iter(written_at or [])
        handle = None
        if snapshotted is not None:
            state = rows(snapshotted, layout, next(times, None))
            state = state.append_column(KEY_GROUP, pa.array(layout.key_groups_of(state),
                                                            pa.int16()))
            handle = write_full_snapshot(factory, layout, key_groups,
                                           state.sort_by(KEY_GROUP).to_batches())
        chain = KeyedStateChain(key_groups, handle)
        for change in changes:
            deletes = pa.table({"user": pa.array(sorted(change.deletes), pa.string())})
            chain = chain.appended(write_change_file(
                factory, layout, key_groups, rows(change.upserts, layout, next(times, None)),
                deletes))
        chains.append(chain)
    master = {
        JOB_NAME_STATE: b"clicks-pipeline",
        STATE_FORMAT_PREFIX + STAGE: CHAIN_FORMAT.encode(),
        STATE_SCHEMA_PREFIX + STAGE: SCHEMA.serialize().to_pybytes(),
        KEYED_STATE_PREFIX + STAGE: encode_keyed_master_state(layout, clock),
    }
    metadata = CheckpointMetadata(
        1, (chains_to_operator_state(STAGE, MAX_PARALLELISM, chains),), master,
        job_id=access.job_id,
        timestamp_ms=int(timestamp.timestamp() * 1000),
    )
    out = location.create_metadata_output_stream()
    store_checkpoint_metadata(metadata, out)
    return Written(out.close_and_finalize_checkpoint().external_pointer, chains)


# Two ranges, each a full snapshot then two change files: upserts of new and existing
# keys, deletes, and a key updated in both changes.
INITIAL = {user: i for i, user in enumerate(USERS[:20])}
FIRST = {"user_1": 101, "user_2": 102, "user_20": 120, "user_21": 121, "user_22": 122}
FIRST_DELETED = {"user_3", "user_4", "user_5"}
SECOND = {"user_1": 201, "user_21": 221, "user_3": 203, "user_23": 223}
SECOND_DELETED = {"user_6", "user_22"}


def two_range_history(layout: KeyedStateLayout = LAYOUT) -> tuple[list, dict[str, int]]:
    """The ranges' histories for ``build_snapshot`` and the dict model of the end state."""
    model = dict(INITIAL)
    model.update(FIRST)
    for key in FIRST_DELETED:
        model.pop(key)
    model.update(SECOND)
    for key in SECOND_DELETED:
        model.pop(key)
    ranges = []
    for index in range(2):
        part = [in_range(layout, batch, index, 2) for batch in (INITIAL, FIRST, SECOND)]
        doomed = [set(in_range(layout, dict.fromkeys(keys, 0), index, 2))
                  for keys in (FIRST_DELETED, SECOND_DELETED)]
        ranges.append((part[0], [Change(part[1], frozenset(doomed[0])),
                                 Change(part[2], frozenset(doomed[1]))], None))
    return ranges, model


@pytest.fixture
def two_ranges(tmp_path) -> tuple[Written, dict[str, int]]:
    ranges, model = two_range_history()
    return build_snapshot(tmp_path, LAYOUT, ranges), model




def flip_a_byte(path: str) -> None:
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(path).write_bytes(bytes(data))


# --- read_state ------------------------------------------------------------------------------


def test_two_ranges_of_full_snapshots_and_changes_read_as_the_dict_model(two_ranges):
    """Two ranges of full snapshot plus changes read as the dict model, one part each."""
    written, model = two_ranges
    snapshot = open_snapshot(written.pointer)
    table = read_state(written.pointer, STAGE)

    assert (model, SCHEMA, [CHAIN_FORMAT, CHAIN_FORMAT], [3, 3]) == (
        as_model(table), table.schema, [p.format for p in snapshot.parts(STAGE)],
        [len(p.handles) for p in snapshot.parts(STAGE)])


def test_inline_and_file_handles_read_alike(tmp_path):
    """Inline change files and file full snapshots read as the dict model."""
    ranges, model = two_range_history()
    big = {f"big_{i:04d}": i for i in range(600)}
    ranges = [(snapshotted | in_range(LAYOUT, big, index, 2), changes, None)
              for index, (snapshotted, changes, _) in enumerate(ranges)]
    written = build_snapshot(tmp_path, LAYOUT, ranges, threshold=4000)
    kinds = {type(h).__name__ for chain in written.chains for h in chain.handles}

    assert ({ByteStreamStateHandle.__name__, FileStateHandle.__name__}, model | big) == (
        kinds, as_model(read_state(written.pointer, STAGE)))


def test_event_time_ttl_hides_rows_expired_at_the_recorded_clock(tmp_path):
    """Event-time TTL: rows older than the recorded clock minus the TTL are not returned."""
    layout = KeyedStateLayout(("user",), SCHEMA, MAX_PARALLELISM,
                              StateTtl(dt.timedelta(seconds=10), timestamp_column="seen"))
    ranges, model = two_range_history(layout)
    clock = T0 + dt.timedelta(seconds=110)  # cutoff: seen at T0 + 100 s, i.e. clicks >= 100
    written = build_snapshot(tmp_path, layout, ranges, clock=clock)

    assert {k: v for k, v in model.items() if v >= 100} == as_model(
        read_state(written.pointer, STAGE))


def test_processing_time_ttl_hides_rows_expired_at_the_snapshot_time(tmp_path):
    """Processing-time TTL: rows expired at the snapshot's time and `_written_at` are gone."""
    layout = KeyedStateLayout(("user",), SCHEMA, MAX_PARALLELISM,
                              StateTtl(dt.timedelta(minutes=1),
                                       TtlTimeCharacteristic.PROCESSING_TIME))
    ranges, _ = two_range_history(layout)
    # full snapshot at T0, first change at T0 + 1 min, second at T0 + 2 min; snapshot at
    # T0 + 2.5 min: only what the second change wrote is younger than a minute
    times = [T0, T0 + dt.timedelta(minutes=1), T0 + dt.timedelta(minutes=2)]
    written = build_snapshot(tmp_path, layout, ranges, written_at=times,
                             timestamp=T0 + dt.timedelta(minutes=2, seconds=30))
    table = read_state(written.pointer, STAGE)

    assert (SECOND, SCHEMA.names) == (as_model(table), table.column_names)


def test_where_and_limit_select_rows(two_ranges):
    """``where`` keeps equal rows (values typed by column) and ``limit`` caps the rows."""
    written, model = two_ranges
    read = [
        as_model(read_state(written.pointer, STAGE, where=where))
        for where in ({"user": "user_1"}, {"clicks": "221"}, {"user": "user_3"},
                      {"user": "user_5"})
    ]
    limited = [read_state(written.pointer, STAGE, limit=n).num_rows for n in (0, 3, 100)]

    assert ([{"user_1": 201}, {"user_21": 221}, {"user_3": 203}, {}],
            [0, 3, len(model)]) == (read, limited)


def test_a_corrupt_change_file_is_named(two_ranges):
    """A flipped byte in a change file is a StateIntegrityError naming it (CLI: exit 4)."""
    written, _ = two_ranges
    path = written.chains[1].changes[0].path
    flip_a_byte(path)

    with pytest.raises(StateIntegrityError,
                       match=f"stage '{STAGE}': state file {path} does not match"):
        read_state(written.pointer, STAGE)
    result = run_cli(written.pointer, "--stage", STAGE, "--json")
    assert (4, 1, True) == (result.exit_code, len(result.stderr.splitlines()),
                            path in result.stderr)


def test_a_missing_full_snapshot_is_named(two_ranges):
    """A deleted full snapshot is an InvalidCheckpointError naming the file."""
    written, _ = two_ranges
    path = written.chains[0].full_snapshot.path
    Path(path).unlink()

    with pytest.raises(InvalidCheckpointError, match=f"state file {path} is missing"):
        read_state(written.pointer, STAGE)


def test_a_foreign_file_in_a_chain_is_refused_naming_it(tmp_path):
    """A file of the wrong kind in a chain is an InvalidCheckpointError naming it."""
    written = build_snapshot(tmp_path, LAYOUT, [({"user_1": 1}, [], None)])
    full_snapshot = written.chains[0].full_snapshot
    mislabelled = KeyedStateChain(written.chains[0].key_groups, None, (full_snapshot,))
    snapshot = open_snapshot(written.pointer)
    metadata = snapshot.metadata
    forged = CheckpointMetadata(
        2, (chains_to_operator_state(STAGE, MAX_PARALLELISM, [mislabelled]),),
        metadata.master_states, timestamp_ms=metadata.timestamp_ms)
    storage = FileSystemCheckpointStorage(str(tmp_path / "chk"))
    access = storage.create_checkpoint_storage(metadata.job_id or JobID.generate())
    out = access.initialize_location_for_checkpoint(2).create_metadata_output_stream()
    store_checkpoint_metadata(forged, out)
    pointer = out.close_and_finalize_checkpoint().external_pointer

    with pytest.raises(InvalidCheckpointError,
                       match=f"stage '{STAGE}': keyed state change file "
                             f"{full_snapshot.path} is not the change"):
        read_state(pointer, STAGE)


# --- the Spark data source and the CLI -------------------------------------------------------


def test_spark_source_reads_one_partition_per_range(spark, tmp_path):
    """The data source returns ``read_state``'s rows, one input partition per range."""
    ranges, model = two_range_history()
    three = [(in_range(LAYOUT, model, i, 3), [], None) for i in range(3)]
    written = build_snapshot(tmp_path, LAYOUT, three)
    register_checkpoint_source(spark)
    frame = spark.read.format("checkpoint").option("stage", STAGE).load(written.pointer)

    assert (table_rows(read_state(written.pointer, STAGE)), 3) == (
        table_rows(frame.toArrow()), frame.rdd.getNumPartitions())


def test_spark_source_reads_changes_on_the_executors(spark, two_ranges):
    """Chains of full snapshots and changes read on the executors equal the dict model."""
    written, model = two_ranges
    register_checkpoint_source(spark)
    frame = spark.read.format("checkpoint").option("stage", STAGE).load(written.pointer)

    assert (model, 2) == (as_model(frame.toArrow()), frame.rdd.getNumPartitions())


def test_cli_reads_keyed_state(two_ranges):
    """``checkpoints read`` prints the live rows as JSON, counts them, and filters them."""
    written, model = two_ranges
    as_json = run_cli(written.pointer, "--stage", STAGE, "--json")
    as_table = run_cli(written.pointer, "--stage", STAGE, "--limit", "2")
    where = run_cli(written.pointer, "--stage", STAGE, "--where", "user=user_21", "--json")
    json_rows = pa.Table.from_pylist([json.loads(line) for line in as_json.stdout.splitlines()])

    assert ((0, model), (0, f"2 of {len(model)} rows"), (0, [["user_21", 221]])) == (
        (as_json.exit_code, as_model(json_rows)),
        (as_table.exit_code, as_table.stdout.strip().splitlines()[-1].strip()),
        (where.exit_code, [[row["user"], row["clicks"]]
                           for row in map(json.loads, where.stdout.splitlines())]),
    )


def test_without_a_ttl_no_row_is_hidden(tmp_path):
    """Without a TTL every live row is returned, whatever clock the snapshot records."""
    ranges, model = two_range_history()
    written = build_snapshot(tmp_path, LAYOUT, ranges, clock=T0 + dt.timedelta(days=1))

    assert model == as_model(read_state(written.pointer, STAGE))



def test_csv_export_writes_nested_columns_as_json_text():
    """``checkpoints read --csv``: list, struct and map columns (timers, variables) become
    the JSON text ``--json`` writes for them, nulls stay empty; other columns are kept."""
    import io

    import pyarrow.csv as pacsv

    from pipelines.cli import nested_as_json

    when = dt.datetime(2026, 11, 1, 8, 30, tzinfo=dt.UTC)
    table = pa.table({
        "k": pa.array([1, 2], pa.int64()),
        "_timers": pa.array([[when], None], pa.list_(pa.timestamp("us", "UTC"))),
        "totals": pa.array([{"orders": 2, "total": 3.5}, None],
                           pa.struct([("orders", pa.int64()), ("total", pa.float64())])),
        "buckets": pa.array([[("a", 1)], []], pa.map_(pa.string(), pa.int64())),
    })
    out = io.BytesIO()
    pacsv.write_csv(nested_as_json(table), out)
    assert [
        {"k": 1, "_timers": '["2026-11-01T08:30:00+00:00"]',
         "totals": '{"orders": 2, "total": 3.5}', "buckets": '[["a", 1]]'},
        {"k": 2, "_timers": None, "totals": None, "buckets": "[]"},
    ] == pacsv.read_csv(io.BytesIO(out.getvalue()), convert_options=pacsv.ConvertOptions(
        strings_can_be_null=True)).to_pylist()
