"""State schema evolution without Spark (docs/pipelines.md, "Upgrading a pipeline"): which
type changes widen, how rows written under an older schema convert, what is refused, and a
keyed change file written under v1 read back under v2."""

import pyarrow as pa
import pytest

from checkpoint_storage import FileSystemCheckpointStorage, JobID
from pipelines.keyed import (
    KeyedStateLayout,
    KeyGroupRange,
    check_evolution,
    evolve_table,
    read_change_file,
    widens,
    write_change_file,
)

V1 = pa.schema([pa.field("user", pa.string(), nullable=False), ("clicks", pa.int32()),
                ("score", pa.float32()), ("seen", pa.string())])
V2 = pa.schema([pa.field("user", pa.string(), nullable=False), ("clicks", pa.int64()),
                ("score", pa.float64()), ("last_seen", pa.large_string()),
                ("country", pa.string()), ("level", pa.int16())])
RENAMED = {"seen": "last_seen"}
DEFAULTS = {"level": 1}


@pytest.mark.parametrize(("old", "new", "fits"), [
    (pa.int32(), pa.int64(), True), (pa.uint16(), pa.int32(), True),
    (pa.int64(), pa.int32(), False), (pa.int64(), pa.uint64(), False),
    (pa.float32(), pa.float64(), True), (pa.float64(), pa.float32(), False),
    (pa.decimal128(10, 2), pa.decimal128(12, 2), True),
    (pa.decimal128(10, 2), pa.decimal128(12, 4), True),
    (pa.decimal128(10, 2), pa.decimal128(10, 3), False),
    (pa.decimal128(10, 2), pa.decimal128(9, 2), False),
    (pa.string(), pa.large_string(), True), (pa.large_string(), pa.string(), True),
    (pa.binary(), pa.large_binary(), True),
    (pa.int32(), pa.float64(), False), (pa.int64(), pa.string(), False),
    (pa.timestamp("us", "UTC"), pa.timestamp("ns", "UTC"), False),
])
def test_widening_is_lossless_and_nothing_else_is(old, new, fits):
    assert fits is widens(old, new)


def test_rows_written_under_v1_read_as_v2():
    """Widened columns cast, a renamed one under its new name, added ones null or their
    default, a dropped one gone."""
    v1 = pa.table({"user": ["a", "b"], "clicks": [1, 2], "score": [0.5, 1.5],
                   "seen": ["mon", None]}, schema=V1)

    v2 = evolve_table(v1, V2, RENAMED, DEFAULTS, "test")

    assert V2 == v2.schema
    assert [{"user": "a", "clicks": 1, "score": 0.5, "last_seen": "mon", "country": None,
             "level": 1},
            {"user": "b", "clicks": 2, "score": 1.5, "last_seen": None, "country": None,
             "level": 1}] == v2.to_pylist()
    assert v2 is evolve_table(v2, V2, RENAMED, DEFAULTS, "test")  # already v2: untouched


def test_the_changes_are_listed_and_refusals_name_column_and_both_types():
    assert ["widened 'clicks' from int32 to int64", "widened 'score' from float to double",
            "renamed 'seen' to 'last_seen'", "widened 'last_seen' from string to large_string",
            "added 'country' (null)", "added 'level' (default 1)"] == check_evolution(
        V1, V2, RENAMED, DEFAULTS, "stage s")
    narrowed = V1.set(1, pa.field("clicks", pa.int16()))
    with pytest.raises(ValueError, match=r"stage s: .*column 'clicks' was int32, is now int16: "
                                         r"not a widening.*write_savepoint"):
        check_evolution(V1, narrowed, {}, {}, "stage s")
    required = V1.append(pa.field("region", pa.string(), nullable=False))
    with pytest.raises(ValueError, match=r"column 'region' is new and NOT NULL, without a "
                                         r"default: declare it nullable or give defaults="):
        check_evolution(V1, required, {}, {}, "stage s")
    assert ["dropped 'seen'"] == check_evolution(V1, V1.remove(3), {}, {}, "stage s")


def test_a_renaming_or_default_that_does_not_fit_the_schema_is_refused():
    from pipelines import KeyedStage

    def apply(input, state):
        raise AssertionError("not called")

    with pytest.raises(ValueError, match=r"renamed 'x' -> 'nope', but 'nope' is not a state "
                                         "column"):
        KeyedStage("s", "user", V2, apply, renamed={"x": "nope"})
    with pytest.raises(ValueError, match=r"renamed 'clicks' -> 'last_seen', but 'clicks' is "
                                         "still a state column"):
        KeyedStage("s", "user", V2, apply, renamed={"clicks": "last_seen"})
    with pytest.raises(ValueError, match=r"a key column: a changed key is not restored"):
        KeyedStage("s", "user", V2, apply, renamed={"name": "user"})
    with pytest.raises(ValueError, match=r"default 'high' of 'level' is not a int16"):
        KeyedStage("s", "user", V2, apply, defaults={"level": "high"})


def test_a_change_file_written_under_v1_reads_under_v2(tmp_path):
    """The keyed files of a restored chain convert as they are read: a change file written
    with v1's layout, read with v2's (its renamed and defaulted columns)."""
    storage = FileSystemCheckpointStorage(str(tmp_path), file_state_size_threshold=0)
    access = storage.create_checkpoint_storage(JobID.generate())
    access.initialize_base_locations()
    location = access.initialize_location_for_checkpoint(1)
    factory = access.resolve_checkpoint_storage_location(1, location.location_reference)
    everything = KeyGroupRange(0, 7)
    v1 = KeyedStateLayout(("user",), V1, 8)
    v2 = KeyedStateLayout(("user",), V2, 8, renamed=RENAMED, defaults=DEFAULTS)
    rows = pa.table({"user": ["a"], "clicks": [3], "score": [2.0], "seen": ["tue"]},
                    schema=V1)
    handle = write_change_file(factory, v1, everything, rows,
                               pa.table({"user": pa.array(["b"], pa.string())}))

    upserts, deletes = read_change_file(handle, v2, everything)

    assert [{"user": "a", "clicks": 3, "score": 2.0, "last_seen": "tue", "country": None,
             "level": 1}] == upserts.to_pylist()
    assert [{"user": "b"}] == deletes.to_pylist()
