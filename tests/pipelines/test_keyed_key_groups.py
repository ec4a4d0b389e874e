"""Key groups as in Flink's KeyGroupRangeAssignment, and the stable key hash."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.keyed import (
    UPPER_BOUND_MAX_PARALLELISM,
    KeyGroupRange,
    assign_key_groups,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
    hash_keys,
    last_per_key,
)

ROOT = Path(__file__).resolve().parents[2]


@st.composite
def parallelisms(draw, max_max_parallelism: int = 512):
    """(max_parallelism, parallelism) with 1 <= parallelism <= max_parallelism."""
    max_parallelism = draw(st.integers(1, max_max_parallelism))
    return max_parallelism, draw(st.integers(1, max_parallelism))


def ranges(max_parallelism: int, parallelism: int) -> list[KeyGroupRange]:
    return [compute_key_group_range_for_operator_index(max_parallelism, parallelism, i)
            for i in range(parallelism)]


@settings(deadline=None)
@given(parallelisms())
def test_every_key_group_belongs_to_exactly_one_range(mp):
    """For any parallelism up to the max, each key group is in exactly one task's range, the
    task Flink's operator-index formula names."""
    max_parallelism, parallelism = mp
    owners = [[] for _ in range(max_parallelism)]
    for index, owned in enumerate(ranges(max_parallelism, parallelism)):
        for key_group in owned:
            owners[key_group].append(index)

    assert [[compute_operator_index_for_key_group(max_parallelism, parallelism, g)]
            for g in range(max_parallelism)] == owners


@settings(deadline=None)
@given(parallelisms())
def test_ranges_are_contiguous_non_empty_and_in_order(mp):
    """Task i's range starts where task i-1's ends, none is empty, and together they span
    0..max_parallelism-1."""
    max_parallelism, parallelism = mp
    found = ranges(max_parallelism, parallelism)

    assert 0 == found[0].start
    assert max_parallelism - 1 == found[-1].end
    assert [r.end + 1 for r in found[:-1]] == [r.start for r in found[1:]]
    assert all(len(r) >= 1 for r in found)


@settings(deadline=None, max_examples=50)
@given(parallelisms(max_max_parallelism=128), st.integers(1, 128))
def test_intersections_of_old_and_new_ranges_cover_each_new_range_exactly(mp, new):
    """Rescaling: a new task's range is exactly the union of its intersections with the old
    ranges, and those intersections are disjoint."""
    max_parallelism, old = mp
    new = min(new, max_parallelism)
    for target in ranges(max_parallelism, new):
        pieces = [target.intersection(source) for source in ranges(max_parallelism, old)]
        covered = [g for piece in pieces for g in piece]

        assert list(target) == covered


def test_flink_ranges_for_a_known_case():
    """max parallelism 128 over 3 tasks gives Flink's ranges 0-42, 43-85, 86-127."""
    assert ["0-42", "43-85", "86-127"] == [str(r) for r in ranges(128, 3)]


@pytest.mark.parametrize(
    ("parallelism", "max_parallelism", "match"),
    [
        (0, 128, "parallelism must be in"),
        (129, 128, "parallelism must be in"),
        (1, 0, "max_parallelism must be in"),
        (1, UPPER_BOUND_MAX_PARALLELISM + 1, "max_parallelism must be in"),
    ],
)
def test_parallelism_outside_flinks_bounds_is_refused(parallelism, max_parallelism, match):
    """0 < parallelism <= max_parallelism <= 2^15, as in Flink, else a ValueError naming it."""
    with pytest.raises(ValueError, match=match):
        compute_key_group_range_for_operator_index(max_parallelism, parallelism, 0)


def test_key_group_range_parses_what_it_prints():
    """``str`` and ``parse`` round-trip; a malformed range is refused naming the text."""
    assert KeyGroupRange(3, 17) == KeyGroupRange.parse(str(KeyGroupRange(3, 17)))
    with pytest.raises(ValueError, match="'3:17'"):
        KeyGroupRange.parse("3:17")


KEYS = st.lists(st.text(max_size=20), min_size=1, max_size=50)


@settings(deadline=None)
@given(KEYS)
def test_hash_of_a_string_depends_only_on_its_bytes(keys):
    """A key hashes the same alone, in any batch, sliced, or as large_string."""
    table = pa.table({"k": keys})
    alone = [int(hash_keys(pa.table({"k": [k]}), ("k",))[0]) for k in keys]

    assert alone == hash_keys(table, ("k",)).tolist()
    assert alone[1:] == hash_keys(table.slice(1), ("k",)).tolist()
    assert alone == hash_keys(table.cast(pa.schema([("k", pa.large_string())])),
                              ("k",)).tolist()


@settings(deadline=None)
@given(st.lists(st.binary(min_size=3, max_size=3), min_size=1, max_size=50))
def test_keys_of_one_width_hash_as_among_keys_of_other_widths(keys):
    """A batch of keys of one width (hashed down the columns) hashes each key as a batch of
    mixed widths (hashed row by row) does."""
    alone = hash_keys(pa.table({"k": pa.array(keys, pa.binary())}), ("k",)).tolist()
    mixed = hash_keys(pa.table({"k": pa.array([*keys, b"wider key"], pa.binary())}),
                      ("k",)).tolist()

    assert mixed[:-1] == alone


def test_keys_of_one_width_hash_alike_across_the_blocks_they_are_hashed_in():
    """Keys of one width are hashed a block of rows at a time; a batch spanning several
    blocks (and a partial last one) hashes each key as a batch of mixed widths does."""
    keys = [f"u{i:09d}".encode() for i in range(150_001)]
    alone = hash_keys(pa.table({"k": pa.array(keys, pa.binary())}), ("k",))
    mixed = hash_keys(pa.table({"k": pa.array([*keys, b"wider key"], pa.binary())}), ("k",))

    assert mixed[:-1].tolist() == alone.tolist()


@settings(deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c", "dd", "eee"]), max_size=30),
       st.booleans())
def test_last_per_key_finds_each_keys_last_row(keys, colliding):
    """The rows ``last_per_key`` picks are each key's last, also when keys share a hash
    (every hash forced equal)."""
    table = pa.table({"k": pa.array(keys, pa.string())})
    hashes = np.zeros(len(keys), np.uint64) if colliding else None
    expected = sorted({k: i for i, k in enumerate(keys)}.values())

    assert expected == last_per_key(table, ("k",), hashes).tolist()


def test_hash_is_stable_across_processes():
    """A fresh interpreter (another hash seed for ``hash()``) computes the same key groups,
    and known keys keep their recorded hashes (a change would misplace stored state)."""
    probe = ("import pyarrow as pa; from pipelines.keyed import hash_keys; "
             "print(hash_keys(pa.table({'k': ['a', 'user_1', '']}), ('k',)).tolist())")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True, env={"PYTHONHASHSEED": "123", "PYTHONPATH": str(ROOT)},
                            cwd=ROOT, timeout=120)

    assert "[12447961245826247199, 4988025882318501645, 0]" == result.stdout.strip()


def test_multi_column_and_integer_keys_hash_per_row():
    """Compound keys hash row by row: equal rows hash equally, different rows differently;
    integer and timestamp keys hash their 64-bit values."""
    table = pa.table({"a": ["x", "x", "y"], "b": [1, 1, 1],
                      "t": pa.array([5, 5, 6], pa.timestamp("us"))})
    hashed = hash_keys(table, ("a", "b", "t")).tolist()

    assert hashed[0] == hashed[1] != hashed[2]
    assert (hash_keys(table, ("b",)).tolist()
            == hash_keys(table.cast(pa.schema([("a", pa.string()), ("b", pa.int32()),
                                               ("t", pa.timestamp("us"))])), ("b",)).tolist())


def test_key_groups_spread_user_ids_evenly():
    """100,000 user ids over 128 key groups: every group within 15% of the mean."""
    keys = pa.table({"k": [f"user_{i:09d}" for i in range(100_000)]})
    counts = np.bincount(assign_key_groups(keys, ("k",), 128).to_numpy(), minlength=128)

    assert 0.85 * 100_000 / 128 < counts.min()
    assert counts.max() < 1.15 * 100_000 / 128


@pytest.mark.parametrize(
    ("column", "match"),
    [
        (pa.array(["a", None]), "null value"),
        (pa.array([1.5, 2.5]), "floats and nested types"),
    ],
)
def test_null_and_float_keys_are_refused(column, match):
    """Null keys and keys without a stable identity are refused, naming the column."""
    with pytest.raises((ValueError, TypeError), match=match):
        hash_keys(pa.table({"k": column}), ("k",))


@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(0, 127), st.integers(0, 2**64 - 1)), max_size=200))
def test_group_hash_order_sorts_rows_by_key_group_then_key_hash(rows):
    """A full snapshot's row order (``group_hash_order``, with the key groups)."""
    from pipelines.keyed._key_groups import group_hash_order

    groups = np.array([g for g, _ in rows], np.int64)
    hashes = np.array([h for _, h in rows], np.uint64)

    order = group_hash_order(groups, hashes)

    assert sorted(order.tolist()) == list(range(len(rows)))
    assert [(int(groups[i]), int(hashes[i])) for i in order] == sorted(rows)
