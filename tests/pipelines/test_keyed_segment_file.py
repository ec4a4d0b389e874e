"""A segment file written a column at a time (``write_one_batch``): byte for byte the Arrow
IPC file Arrow writes for the table of one chunk a column, its CRC-32 that of its bytes, and
a store's ``load_sorted`` the file ``load`` writes. No Spark: files on local disk."""

import io
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from pipelines.keyed import ArrowKeyedStateStore, KeyedStateLayout, KeyGroupRange
from pipelines.keyed._key_groups import hash_keys
from pipelines.keyed._segment_file import _crc32_combine, fixed_buffer_counts, write_one_batch
from tests.pipelines.support import SCHEMA, clicks_table, store_state


def _table(rows: int) -> pa.Table:
    """Columns of many kinds, with nulls, of ``rows`` rows."""
    numbers = np.arange(rows)
    table = pa.table({
        "user": pa.array([f"user_{i}" if i % 7 else None for i in range(rows)]),
        "count": pa.array(numbers * 3),
        "amount": pa.array([None if i < 3 else i for i in range(rows)], pa.decimal128(22, 2)),
        "seen": pa.array(numbers << 20, pa.timestamp("us", tz="UTC")),
        "tags": pa.array([[i, 1] if i % 3 else None for i in range(rows)], pa.list_(pa.int32())),
        "pair": pa.array([{"x": i, "y": str(i)} for i in range(rows)]),
        "flag": pa.array(numbers % 3 == 0),
        "_hash": pa.array(numbers.astype(np.uint64) * 2654435761),
    })
    return pa.Table.from_arrays(table.columns, schema=pa.schema(
        [f.with_nullable(True) for f in table.schema]))


@pytest.mark.parametrize("cuts", [[], [1], [5, 13, 999, 1000]])
def test_a_batch_written_a_column_at_a_time_is_arrows_file(cuts):
    """From chunks cut anywhere (bitmaps and offsets not on byte boundaries), the file is
    Arrow's own for the columns made one chunk, and the CRC-32 returned is its bytes'."""
    table = _table(1001)
    chunked = pa.concat_tables([table.slice(a, b - a) for a, b in
                                zip([0, *cuts], [*cuts, table.num_rows], strict=True)])
    expected = io.BytesIO()
    with ipc.new_file(expected, table.schema) as writer:
        writer.write_table(chunked.combine_chunks(), max_chunksize=1 << 26)
    asked = []

    def column(i):
        asked.append(i)
        return chunked.column(i).combine_chunks()

    written = io.BytesIO()
    checksum = write_one_batch(written, table.schema, table.num_rows, column)
    assert written.getvalue() == expected.getvalue()
    assert checksum == zlib.crc32(expected.getvalue())
    assert asked == list(range(len(table.schema)))  # each once, in order
    assert ipc.open_file(pa.BufferReader(written.getvalue())).read_all().equals(table)


def test_a_column_of_other_rows_or_type_is_refused():
    table = _table(10)
    with pytest.raises(ValueError, match="9 rows"):
        write_one_batch(io.BytesIO(), table.schema, 10,
                        lambda i: table.column(i).combine_chunks().slice(1))
    with pytest.raises(ValueError, match="column user: 10 rows of int64"):
        write_one_batch(io.BytesIO(), table.schema, 10, lambda i: pa.array(range(10)))


def test_crc32_of_two_parts_combined():
    for first, second in [(b"abc", b"defgh"), (b"", b"x" * 1000), (b"q" * 77, b"z" * 70_001)]:
        assert _crc32_combine(zlib.crc32(first), zlib.crc32(second), len(second)) == \
            zlib.crc32(first + second)


def test_view_types_have_no_fixed_buffer_counts():
    assert fixed_buffer_counts(_table(1).schema)
    assert not fixed_buffer_counts(pa.schema([("s", pa.string_view())]))
    assert not fixed_buffer_counts(pa.schema([("l", pa.list_(pa.binary_view()))]))


@pytest.mark.parametrize("rows", [0, 1, 500])
def test_load_sorted_writes_the_file_load_writes(tmp_path, rows):
    """A store loaded from rows in order, a column at a time, holds the file ``load`` writes
    for them (the same bytes), and their state."""
    layout = KeyedStateLayout(("user",), SCHEMA, 8)
    everything = KeyGroupRange(0, 7)
    state = {f"user_{i}": i for i in range(rows)}
    reference = ArrowKeyedStateStore(tmp_path / "load", layout, everything)
    reference.load(clicks_table(state), version="v")
    ordered = reference._segment.table.select(layout.stored_schema.names)
    store = ArrowKeyedStateStore(tmp_path / "sorted", layout, everything)
    store.load_sorted(clicks_table(state).schema, ordered.num_rows,
                      lambda i: ordered.column(i).combine_chunks(),
                      hash_keys(ordered, layout.key), version="v")
    assert [(s.directory / s._segment_file).read_bytes() for s in (store, reference)] == [
        (reference.directory / reference._segment_file).read_bytes()] * 2
    assert (store_state(store), store.num_rows, store.version) == (state, rows, "v")
    reopened = ArrowKeyedStateStore(tmp_path / "sorted", layout, everything)
    assert store_state(reopened) == state


def test_load_sorted_refuses_rows_out_of_order(tmp_path):
    layout = KeyedStateLayout(("user",), SCHEMA, 8)
    rows = clicks_table({f"user_{i}": i for i in range(20)})
    store = ArrowKeyedStateStore(tmp_path / "store", layout, KeyGroupRange(0, 7))
    hashes = hash_keys(rows, layout.key)
    order = np.argsort(hashes)[::-1]  # by hash, backwards: not the segment's order
    rows = rows.take(pa.array(order))
    with pytest.raises(ValueError, match="not in"):
        store.load_sorted(rows.schema, rows.num_rows, lambda i: rows.column(i).combine_chunks(),
                          hashes[order], version="v")
