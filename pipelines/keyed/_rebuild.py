"""The rebuild of a local store from its chains (``rebuild_store``): what a task does when it
finds no store for its key group range, a stale one or one it cannot read, and what the
prefetch does while a restart's JVM starts.

Every file of a chain is already in a store segment's (key group, key hash) order, so a
chain's files replay in one pass (one stable sort over sorted runs: a key's last row wins, a
delete removes it) into rows in the segment's order, loaded as the segment: no lookup of the
changes in the base, no merge, one write. The chain is replayed in slices of its key groups
(``_SLICE_ROWS``), the change files' parts of later slices and the slices' winners kept on
disk until they are needed, and the segment is written a column at a time
(``ArrowKeyedStateStore.load_sorted``), so that what a rebuild holds at once is a slice's
rows and work, not the chain's, nor its state.
"""

import mmap
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from pipelines.keyed._chain import (
    _CHANGE,
    _FULL_SNAPSHOT,
    DELETED,
    KeyedStateChain,
    KeyedStateFormatError,
    _open,
)
from pipelines.keyed._key_groups import KeyGroupRange, group_hash_order, hash_keys, last_per_key
from pipelines.keyed._layout import KEY_GROUP, KeyedStateLayout, concat_as
from pipelines.keyed._store import ArrowKeyedStateStore
from pipelines.keyed._store_directory import remove_store

__all__ = ["rebuild_store"]

_KEY_HASH = "__key_hash"  # the winners' key hashes, beside their stored columns until loaded


def rebuild_store(directory, layout: KeyedStateLayout, key_groups: KeyGroupRange,
                  chains: Iterable[KeyedStateChain], version: str) -> ArrowKeyedStateStore:
    """A fresh local store at ``directory`` (whatever was there is removed: it is a cache)
    holding the ``key_groups`` of ``chains``, marked ``version``: what a task does when it
    finds no store for its range, a stale one, or one it cannot read. Each chain is replayed
    in slices of its key groups (``_SLICE_ROWS`` rows of its files each): a slice's rows of
    the base and of the change files, oldest first, in one pass (``_last_rows_in_store_order``)
    into rows in the segment's order; the slices' winners, in key group order, are loaded as
    the segment: no lookup of the changes in the base, no merge, one write. What a rebuild
    holds at once is a slice's rows and work (the change files' later slices and the winners
    so far wait on disk, in unnamed temporary files beside the store), then one column of
    the segment as it is written, not the chain's rows, nor the state. Every file is read
    (verified and checked as ``replay_chains`` does) before the store is touched: a file
    that cannot be read fails the rebuild, naming it, and leaves the store as it was."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    stored = _replay_schema(layout)
    # the winners with their key hashes (the store does not hash them again)
    with _WinnersSpill(stored.append(pa.field(_KEY_HASH, pa.uint64())),
                       directory.parent) as spill:
        for chain in sorted(chains, key=lambda c: c.key_groups.start):
            overlap = chain.key_groups.intersection(key_groups)
            if len(overlap) and chain.handles:
                for files, deleted in _chain_slices(chain, overlap, layout,
                                                    directory.parent):
                    taken, taken_hashes = _slice_winners(files, deleted, layout)
                    del files, deleted
                    if taken.num_rows:
                        spill.append(taken.append_column(
                            _KEY_HASH, pa.array(taken_hashes, pa.uint64())))
                    del taken, taken_hashes
                    pa.default_memory_pool().release_unused()
        remove_store(directory)
        store = ArrowKeyedStateStore(directory, layout, key_groups)
        hashes = spill.column(len(stored)).to_numpy() if spill.num_rows else \
            np.zeros(0, np.uint64)
        store.load_sorted(stored, spill.num_rows, spill.column, hashes, version=version)
    return store


class _WinnersSpill:
    """The winners of a rebuild's slices until the segment is written: a first slice's in
    memory (a chain of one slice: written as it is); from a second slice on, on disk, each
    column's chunks in a file of its own (an Arrow IPC stream in an unnamed temporary file
    beside the store: a crash leaves nothing), read back whole, mapped, one column at a time
    (``column``). The rebuild holds one slice's winners, not all of them (a 4M-row range:
    its state, ~240 MiB, beside its last slices and the segment's write)."""

    def __init__(self, schema: pa.Schema, directory: Path) -> None:
        self.schema, self.num_rows = schema, 0
        self._directory = directory
        self._first: pa.Table | None = None
        self._files: list = []
        self._writers: list = []

    def __enter__(self) -> "_WinnersSpill":
        return self

    def __exit__(self, *exc) -> None:
        for file in self._files:
            file.close()

    def append(self, table: pa.Table) -> None:
        """The winners of a slice (of ``schema``), after the slices before."""
        self.num_rows += table.num_rows
        if self._first is None and not self._files:
            self._first = table
            return
        if not self._files:
            # closed once read (``column``), or on leaving
            self._files = [tempfile.TemporaryFile(dir=self._directory)  # noqa: SIM115
                           for _ in self.schema]
            self._writers = [ipc.new_stream(file, pa.schema([field]))
                             for file, field in zip(self._files, self.schema, strict=True)]
            table, self._first = pa.concat_tables([self._first, table]), None
        for i, writer in enumerate(self._writers):
            writer.write_table(table.select([i]))

    def column(self, i: int) -> pa.Array:
        """The ``i``-th column of all the winners, in one chunk (its file then closed). A
        column too large for one chunk (offset overflow) fails, naming it."""
        if self._first is not None:
            chunks = self._first.column(i).chunks
            return chunks[0] if len(chunks) == 1 else self._concatenated(i, chunks)
        self._writers[i].close()
        file = self._files[i]
        file.flush()
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            buffer = pa.py_buffer(mapped)
            chunks = ipc.open_stream(buffer).read_all().column(0).chunks
            try:
                column = self._concatenated(i, chunks)  # a copy: the map closes below
            finally:
                del chunks, buffer
        file.close()
        return column

    def _concatenated(self, i: int, chunks: list[pa.Array]) -> pa.Array:
        try:
            return pa.concat_arrays(chunks)
        except (pa.ArrowInvalid, pa.ArrowCapacityError) as exc:
            raise KeyedStateFormatError(
                f"column {self.schema.field(i).name} of a rebuilt range is too large for one "
                f"record batch ({exc})") from exc


_SLICE_ROWS = 1 << 20
"""Rows of a chain's files (its base's and its change files') a rebuild replays at once: the
numpy work over a slice's rows (hashes, the sort, the collision check: ~40 bytes a row) and
its decoded rows are held for one slice, not for the range (at the worst point of a 4M-row
range: its 8M rows)."""


def _chain_slices(chain: KeyedStateChain, overlap: KeyGroupRange, layout: KeyedStateLayout,
                  spill_directory: Path) -> Iterator[tuple[list[pa.Table], list[np.ndarray]]]:
    """The rows of ``chain``'s files in ``overlap``, a slice of its key groups at a time, in
    key group order: each slice's parts of its files, oldest first, and which of their rows
    are deletes. The base (the full snapshot, or the first change file of a chain that
    started empty: the bulk of its rows) is decoded a row group at a time as the slices
    need it (its row groups follow each other by key group); the change files (one row
    group each, typically) are decoded once, whole, one at a time, and each slice's part of
    them is kept on disk until its slice (``_LaterParts``, in ``spill_directory``). Every
    file is opened (read and verified whole) before the first slice is yielded."""
    # the base's bytes mapped from a temporary file, its pages handed back after each slice:
    # held whole, they stood in memory through the rebuild (59 MiB for a 4M-row range)
    if chain.full_snapshot is not None:
        base = _open(chain.full_snapshot, layout, _FULL_SNAPSHOT, chain.key_groups, overlap,
                     spill_directory=spill_directory)
        changes = chain.changes
    else:
        base = _open(chain.changes[0], layout, _CHANGE, chain.key_groups, overlap,
                     spill_directory=spill_directory)
        changes = chain.changes[1:]
    opened = [_open(change, layout, _CHANGE, chain.key_groups, overlap) for change in changes]
    rows = base.rows + sum(file.rows for file in opened)
    count = max(1, min(len(overlap), -(-rows // _SLICE_ROWS)))
    # each slice's last key group: the range in ``count`` slices of about as many key groups
    ends = [overlap.start + (len(overlap) * (i + 1)) // count - 1 for i in range(count)]
    with _LaterParts(count, spill_directory) as later:
        for file in opened:
            # change files are small: decoded in this thread, not in Arrow's thread pool
            table = next(file.tables(whole=True, use_threads=False))
            for index, part in enumerate(_split_by_key_groups(table, ends, file.what)):
                if part.num_rows:
                    later.add(index, part)
            del table
        del opened
        if base.row_groups_in_order():
            base_tables = base.tables(use_threads=False)
        else:  # written before files were sorted by key group: sorted here, whole
            base_tables = iter([next(base.tables(whole=True, use_threads=False))])
        for index, parts in enumerate(_split_stream_by_key_groups(base_tables, ends,
                                                                  base.what)):
            parts.extend(later.take(index))
            if not parts:
                continue
            base.drop_read_pages()  # the slice's rows are decoded
            yield parts, [part.column(DELETED).to_numpy(zero_copy_only=False)
                          if DELETED in part.column_names else np.zeros(part.num_rows, np.bool_)
                          for part in parts]
            del parts


class _LaterParts:
    """The change files' parts of each slice of a chain, oldest first, until their slice:
    with several slices, on disk (a slice's parts an Arrow IPC stream in an unnamed
    temporary file: a crash leaves nothing), read back mapped (``take``), so that the
    rebuild holds one slice's parts, not the change files' (at the worst point of a 4M-row
    range: 3.9M rows, about its state); with one slice, in memory."""

    def __init__(self, count: int, directory: Path) -> None:
        self._directory = directory
        self._parts: list[list[pa.Table]] = [[] for _ in range(count)]
        # (file, writer, schema) once a part came
        self._spills: list[tuple | None] = [None] * count

    def __enter__(self) -> "_LaterParts":
        return self

    def __exit__(self, *exc) -> None:
        for spill in self._spills:
            if spill is not None:
                spill[0].close()

    def add(self, index: int, part: pa.Table) -> None:
        """A part of slice ``index`` (after its parts of older files)."""
        if len(self._parts) == 1:
            self._parts[0].append(part)
            return
        if self._spills[index] is None:
            file = tempfile.TemporaryFile(dir=self._directory)  # noqa: SIM115 (__exit__)
            self._spills[index] = file, ipc.new_stream(file, part.schema), part.schema
        _, writer, schema = self._spills[index]
        writer.write_table(concat_as(schema, [part]))

    def take(self, index: int) -> list[pa.Table]:
        """Slice ``index``'s parts, oldest first (mapped from its file, which is closed: the
        map goes with the last of them)."""
        if self._spills[index] is None:
            parts, self._parts[index] = self._parts[index], []
            return parts
        (file, writer, _), self._spills[index] = self._spills[index], None
        writer.close()
        file.flush()
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        file.close()
        return [ipc.open_stream(pa.py_buffer(mapped)).read_all()]


def _split_by_key_groups(table: pa.Table, ends: list[int], what: str) -> list[pa.Table]:
    """``table``'s rows in parts whose key groups end at each of ``ends`` (views of it when
    it is sorted by key group, as files are written; else of a sorted copy). A row past the
    last of ``ends`` (outside the range its file says it holds) fails: no row is left out."""
    table, groups = _by_key_group(table)
    bounds = np.searchsorted(groups, ends, side="right")
    if len(groups) and bounds[-1] < len(groups):
        raise _outside(what, ends[-1], groups[bounds[-1]])
    starts = np.concatenate([[0], bounds[:-1]])
    return [table.slice(int(a), int(b - a)) for a, b in zip(starts, bounds, strict=True)]


def _split_stream_by_key_groups(tables: Iterator[pa.Table], ends: list[int], what: str
                                ) -> Iterator[list[pa.Table]]:
    """The rows of ``tables`` (one after another in key group order, each sorted here if
    need be) gathered by slice: the tables (or parts of them) whose key groups end at each of
    ``ends``, in turn; a table is decoded only when the slices before took all they need of
    the ones before it. A row past the last of ``ends`` fails, as in
    ``_split_by_key_groups``."""
    pending = None
    for end in ends:
        parts = []
        while True:
            if pending is None:
                pending = next(tables, None)
                if pending is None:
                    break
                pending, groups = _by_key_group(pending)
            cut = int(np.searchsorted(groups, end, side="right"))
            if cut:
                parts.append(pending.slice(0, cut))
            if cut < pending.num_rows:
                pending, groups = pending.slice(cut), groups[cut:]
                break
            pending = None
        yield parts
    for table in [] if pending is None else [pending]:
        raise _outside(what, ends[-1], _groups(table)[0])
    for table in tables:
        if table.num_rows:
            raise _outside(what, ends[-1], _groups(table)[0])


def _by_key_group(table: pa.Table) -> tuple[pa.Table, np.ndarray]:
    """``table`` sorted by key group (as it is, if it is: files are written so), and its key
    groups."""
    groups = _groups(table)
    if len(groups) > 1 and (np.diff(groups) < 0).any():
        order = np.argsort(groups, kind="stable")
        table, groups = table.take(pa.array(order)), groups[order]
    return table, groups


def _outside(what: str, last: int, group) -> KeyedStateFormatError:
    return KeyedStateFormatError(f"{what} holds rows of key group {int(group)}, past the last "
                                 f"one read ({last}); restore from an earlier checkpoint or a "
                                 "savepoint")


def _groups(table: pa.Table) -> np.ndarray:
    column = table.column(KEY_GROUP)
    return (column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
            ).to_numpy(zero_copy_only=False) if column.num_chunks else np.zeros(0, np.int16)


def _slice_winners(files: list[pa.Table], deleted: list[np.ndarray],
                   layout: KeyedStateLayout) -> tuple[pa.Table, np.ndarray]:
    """The state a slice of a chain's files (oldest first; ``deleted``: which of their rows are
    deletes) replays to, in the segment's order, and its key hashes."""
    # the files' columns as the chunks of one table, not copied into one: the take below
    # gathers the winners from them column by column
    rows = concat_as(_replay_schema(layout), files)
    del files[:]
    rows = _with_combined_keys(rows, layout.key)
    hashes = hash_keys(rows, layout.key)
    winners = _last_rows_in_store_order(rows, np.concatenate(deleted) if deleted else
                                        np.zeros(0, np.bool_), hashes, layout)
    del deleted[:]
    schema, columns = rows.schema, rows.columns
    del rows  # the columns list holds them alone: each freed once taken
    return _take_releasing(schema, columns, winners), hashes[winners]


def _with_combined_keys(rows: pa.Table, key: tuple[str, ...]) -> pa.Table:
    """``rows`` with each key column in one chunk. A take from a column of many chunks (one
    per file) concatenates them first: the collision check's takes by parts did so for every
    part, so its cost grew with the square of the rows (at the worst point of a 4M-row range:
    8 concatenations of its 8M keys); concatenated once here, in place of the chunks (freed:
    no more memory at the peak). A column too large for one chunk (offset overflow) stays."""
    for name in key:
        index = rows.schema.get_field_index(name)
        try:
            rows = rows.set_column(index, rows.schema.field(index),
                                   rows.column(index).combine_chunks())
        except (pa.ArrowInvalid, pa.ArrowCapacityError):
            continue
    return rows


def _take_releasing(schema: pa.Schema, columns: list[pa.ChunkedArray],
                    winners: np.ndarray) -> pa.Table:
    """The rows at ``winners`` of a table of ``schema`` and ``columns``, taken column by
    column, each of ``columns`` dropped (set to None) once taken, so that, when the list
    holds them alone, the rebuild's peak holds the chain's rows and one column of winners,
    not the chain's rows and all the winners (at the worst point of a 4M-row range: ~0.2 GB
    less)."""
    indices, taken = pa.array(winners), []
    for i in range(len(columns)):
        column, columns[i] = columns[i], None
        taken.append(column.take(indices))
        del column
    return pa.Table.from_arrays(taken, schema=schema)


def _replay_schema(layout: KeyedStateLayout) -> pa.Schema:
    """The rows of a chain's files as ``rebuild_store`` combines them: the stored columns,
    values nullable, as in the files."""
    return pa.schema([f if f.name in layout.key else f.with_nullable(True)
                      for f in layout.stored_schema])


def _last_rows_in_store_order(rows: pa.Table, deleted: np.ndarray, hashes: np.ndarray,
                              layout: KeyedStateLayout) -> np.ndarray:
    """The indices of each key's last row in ``rows`` (a chain's files, oldest first; their
    key ``hashes``) that is not a delete (``deleted``), in a full snapshot's (key group, key
    hash) order: the state the chain replays to, in the order a store's segment holds it.
    One stable sort by (key group, hash): each file is in that order already, so the sort
    merges sorted runs; a key's rows end up next to each other in file order and the last
    wins. Rows that share a hash are checked to share the key (as ``last_per_key`` does); if
    two keys share one, each key's last row is found by its key columns instead."""
    key = layout.key
    if not rows.num_rows:
        return np.zeros(0, np.int64)
    max_parallelism = layout.max_parallelism
    if max_parallelism & (max_parallelism - 1) == 0:
        # (key group, hash) as one uint64: the key group (the hash's low bits) on top of the
        # hash's other bits, so one sort orders both
        bits = np.uint64(max_parallelism.bit_length() - 1)
        with np.errstate(over="ignore"):
            sort_key = ((hashes & np.uint64(max_parallelism - 1)) << (np.uint64(64) - bits)
                        | (hashes >> bits)) if bits else hashes
        order = np.argsort(sort_key, kind="stable")
        del sort_key
    else:
        order = np.argsort(hashes, kind="stable")
        groups = (hashes[order] % np.uint64(max_parallelism)).astype(np.int16)
        order = order[np.argsort(groups, kind="stable")]
    ordered = hashes[order]
    last = np.append(ordered[1:] != ordered[:-1], True)  # the last row of each equal-hash run
    del ordered
    ends = np.flatnonzero(last)
    winners = order[ends]
    # rows whose hash their run's last row has (the same key, or a collision?), by their
    # sorted place, and that last row: each compared once with it, not the last rows with
    # themselves (a 4M-row range at the worst point holds 8M rows, 3.9M of them replaced).
    # A place's run is the number of runs that ended before it: a count (int32: 10 ms for
    # 8M rows, int64 100 ms, a binary search of the runs' ends 80 ms).
    shared = np.flatnonzero(~last)
    if len(shared):
        runs = np.cumsum(last, dtype=np.int32 if len(last) < 1 << 31 else np.int64)
        if not all(_same_keys(rows, key, order[part], winners[runs[part]])
                   for part in np.split(shared, range(_CHECK_ROWS, len(shared), _CHECK_ROWS))):
            winners = last_per_key(rows, key, hashes)
            winners = winners[group_hash_order(
                (hashes[winners] % np.uint64(max_parallelism)).astype(np.int64),
                hashes[winners])]
    return winners[~deleted[winners]]


_CHECK_ROWS = 1 << 20
"""Rows whose keys are compared at once in the collision check: the key columns' takes of a
4M-row range's 3.9M replaced rows held ~0.1 GB more at the rebuild's peak."""


def _same_keys(rows: pa.Table, key: tuple[str, ...], these: np.ndarray,
               those: np.ndarray) -> bool:
    """Whether the rows at ``these`` have the keys of the rows at ``those``."""
    these, those = pa.array(these), pa.array(those)
    return all(pc.all(pc.equal(rows.column(name).take(these),
                               rows.column(name).take(those))).as_py() for name in key)
