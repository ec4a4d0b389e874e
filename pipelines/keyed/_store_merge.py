"""A local store's (``_store``) runs merged into its segment: the runs' latest changes, the
row index of the merged state (``merge_index``), the merged state as a new segment's rows
(``merged``) or as a full snapshot's sorted batches, made one at a time
(``sorted_batches``).

Reading the segment through its memory map makes its pages resident; each function here hands
them back (``drop_mapped_pages``, given by the store) as soon as what it read is copied, so a
merge or a snapshot holds what it makes, not the segment besides (docs/design.md, 7.29).
"""

from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa

from pipelines.keyed._key_groups import group_hash_order, in_group_hash_order, last_per_key
from pipelines.keyed._layout import KEY_GROUP, concat_as
from pipelines.keyed._store_segment import DELETED, HASH, Run, Segment, to_numpy


def latest_changes(runs: list[Run], run_schema: pa.Schema, key: tuple[str, ...]) -> pa.Table:
    """The runs as one: each key's newest row (run schema), sorted by hash (but for a single
    run about to merge). One pass, where folding the runs one by one costs a lookup per run."""
    if len(runs) == 1:
        return runs[0].table
    table = concat_as(run_schema, [run.table for run in runs])
    hashes = to_numpy(table.column(HASH))
    rows = last_per_key(table, key, hashes)
    hashes = hashes[rows]
    return table.take(pa.array(rows[np.argsort(hashes, kind="stable")])).combine_chunks()


def merge_index(segment: Segment, changes: pa.Table, replaced: np.ndarray
                ) -> tuple[np.ndarray | None, np.ndarray]:
    """For the merged rows, the row each is of the segment followed by ``changes`` (run
    schema, each key once; None: those rows in their own order), and the key group offsets:
    the segment without its ``replaced`` rows (those of the changes' keys), with the changes'
    upserts at their places in (key group, hash) order."""
    hashes = to_numpy(changes.column(HASH)) if changes.num_rows else np.zeros(0, np.uint64)
    added = ~to_numpy(changes.column(DELETED)) if changes.num_rows else np.zeros(0, bool)
    added_hashes = hashes[added]
    del hashes
    # each temporary goes once used: a first batch's merge (every row added) held them
    # all through its take, 65 bytes a row beside the rows' copy
    added_groups = (added_hashes % np.uint64(segment.max_parallelism)).astype(np.int64)
    # a batch's task hands its upserts over sorted (``_executor``): not sorted again
    order = np.arange(len(added_hashes)) if in_group_hash_order(added_groups, added_hashes) \
        else group_hash_order(added_groups, added_hashes)
    # where each added row goes among the kept segment rows (all in (group, hash) order):
    # its place in the segment less the replaced rows before it (no pass over the segment)
    bounds = segment.bounds(added_hashes[order], "left")
    del added_hashes
    removed = np.bincount(segment.groups_of(segment.hashes[replaced]),
                          minlength=len(segment.key_groups))
    inserted = np.bincount(added_groups - segment.key_groups.start,
                           minlength=len(segment.key_groups))
    del added_groups
    offsets = segment.offsets + np.concatenate([[0], np.cumsum(inserted - removed)])
    slots = bounds - np.searchsorted(np.sort(replaced), bounds) + np.arange(len(order))
    del bounds
    kept = np.ones(segment.num_rows, bool)
    kept[replaced] = False
    total = int(kept.sum()) + len(order)
    is_added = np.zeros(total, bool)
    is_added[slots] = True
    index = np.empty(total, np.int64)
    index[~is_added] = np.flatnonzero(kept)
    del kept, is_added
    index[slots] = segment.num_rows + np.flatnonzero(added)[order]
    del slots, order, added
    if total and total == segment.num_rows + changes.num_rows and index[0] == 0 \
            and index[-1] == total - 1 and bool((np.diff(index) > 0).all()):
        return None, offsets
    return index, offsets


def merged(segment: Segment, schema: pa.Schema, changes: pa.Table, replaced: np.ndarray,
           drop_mapped_pages: Callable[[], None]) -> tuple[pa.Table, np.ndarray]:
    """The segment with ``changes`` merged in (``merge_index``), of the segment ``schema``, and
    the key group offsets."""
    index, offsets = merge_index(segment, changes, replaced)
    table = concat_as(schema, [t for t in (segment.table, changes.select(schema.names))
                               if t.num_rows] or [segment.table])
    if index is None:
        # the rows in order as they are (an empty store's first batch, its upserts sorted
        # by the task): no take, no copy beside them (+1x the rows at a worker's peak)
        return pa.Table.from_arrays([_one_chunk(c) for c in table.columns],
                                    schema=schema), offsets
    # column by column: one column's copy is held beside the result, not the whole
    # table's (the merge was a worker's peak in a range's first batch), and the segment's
    # pages go after each (the whole segment resident beside its merged copy: +250 MiB a
    # worker at 8M keys)
    return take_columns(table, index, drop_mapped_pages), offsets


def take_columns(table: pa.Table, rows: np.ndarray, drop_mapped_pages: Callable[[], None],
                 part_rows: int | None = None) -> pa.Table:
    """``table``'s ``rows``, taken a column at a time (each column made one chunk first: a
    take across chunks is 3x slower), the mapped pages each take read handed back before the
    next column's: one column's pages resident at once, not the whole segment's.
    ``part_rows``: ``rows`` are sorted, and each column is taken ``part_rows`` rows of the
    table at a time, the pages handed back after each part (a batch's rows are spread over
    the whole column: 40,000 of a 4M-row range touch all its pages)."""
    if part_rows is None:
        cuts = np.array([0, len(rows)])
    else:
        cuts = np.searchsorted(rows, np.arange(0, table.num_rows + part_rows, part_rows))
        cuts = np.unique(np.concatenate([[0], cuts, [len(rows)]]))
    parts = [pa.array(rows[start:stop])
             for start, stop in zip(cuts[:-1], cuts[1:], strict=True)] or [pa.array(rows)]
    columns = []
    for column in table.columns:
        whole = _one_chunk(column)
        taken = []
        for part in parts:
            taken.append(whole.take(part))
            drop_mapped_pages()
        columns.append(taken[0] if len(taken) == 1 else pa.chunked_array(taken, whole.type))
    return pa.Table.from_arrays(columns, schema=table.schema)


def sorted_batches(segment: Segment, names: list[str], changes: pa.Table | None,
                   replaced: np.ndarray | None, max_rows: int,
                   drop_mapped_pages: Callable[[], None]) -> Iterator[pa.RecordBatch]:
    """The whole state's columns ``names`` and ``KEY_GROUP``, ``max_rows`` rows at a time,
    made as each is asked for: the segment with ``changes`` merged in (None: no runs), each
    batch taken from the segment and the changes apart, not from a copy of the whole state
    (a full snapshot of a 4M-row range held that copy, +390 MiB a worker); the segment's
    mapped pages are handed back after each batch (it is read whole: +250 MiB a worker
    resident by the snapshot's end)."""
    index, offsets = None, segment.offsets
    if changes is not None:
        index, offsets = merge_index(segment, changes, replaced)
        del replaced
        changes = changes.select(names)
    key_groups = segment.key_groups
    groups = np.repeat(np.arange(key_groups.start, key_groups.end + 1, dtype=np.int16),
                       np.diff(offsets))
    rows_of_segment = segment.num_rows
    table = segment.table.select(names)
    if changes is not None and index is None:  # the changes follow the segment's rows
        table = concat_as(table.schema, [table, changes])
    for start in range(0, int(offsets[-1]), max_rows):
        stop = min(start + max_rows, int(offsets[-1]))
        if index is None:
            rows = table.slice(start, stop - start)
        else:
            rows = _taken(table, rows_of_segment, changes, index[start:stop])
        rows = rows.append_column(KEY_GROUP, pa.array(groups[start:stop]))
        # one batch a chunk: the batches a one-chunk table's ``to_batches`` made before
        yield from rows.to_batches(max_chunksize=max_rows)
        del rows
        drop_mapped_pages()


def _taken(segment: pa.Table, rows_of_segment: int, changes: pa.Table,
           index: np.ndarray) -> pa.Table:
    """The rows ``index`` names in the segment's ``rows_of_segment`` rows (``segment``)
    followed by the ``changes``', in that order: each source taken from apart (a take over a
    column's chunks joins the whole column first)."""
    from_segment = index < rows_of_segment
    parts = [segment.take(pa.array(index[from_segment])),
             changes.take(pa.array(index[~from_segment] - rows_of_segment))]
    position = np.empty(len(index), np.int64)
    position[from_segment] = np.arange(len(parts[0]))
    position[~from_segment] = len(parts[0]) + np.arange(len(parts[1]))
    return concat_as(segment.schema, parts).take(pa.array(position)).combine_chunks()


def _one_chunk(column: pa.ChunkedArray) -> pa.Array:
    """``column`` as one array: its one non-empty chunk as it is, else the chunks joined."""
    chunks = [chunk for chunk in column.chunks if len(chunk)]
    return chunks[0] if len(chunks) == 1 else column.combine_chunks()
