"""A local store's (``_store``) segment and runs as read: their rows, key hashes and key group
offsets, and where keys are among them.

The segment is in the order of a full snapshot, by key group then key hash, with each key
group's first row in its offsets; a run is one batch's changes (or several compacted), each key
once, sorted by key hash. A lookup hashes the keys and binary-searches a run, or the segment
inside each key's key group, with numpy, then compares the candidates' keys: a batch costs
what its keys cost, whatever the size of the state.

The segment is memory-mapped: what a lookup reads stays resident (and counts in the worker's
memory) until the store hands the pages back. A batch's keys are spread over the whole range
(40,000 keys of a 4M-row range touch every page of its hash and key columns, ~100 MiB a
worker), so a lookup reads the segment a part at a time (``PART_ROWS``), handing back each
part's pages before the next.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.keyed._key_groups import KeyGroupRange

HASH = "_hash"
DELETED = "_deleted"

PART_ROWS = 1 << 18
"""The segment rows a lookup reads between two hand-backs of their mapped pages (2 MiB of
hashes, and of each column its width times this)."""


@dataclass(frozen=True)
class Run:
    """One batch's changes (or several compacted): each key once, sorted by hash."""

    name: str
    table: pa.Table
    hashes: np.ndarray
    deleted: np.ndarray


class Segment:
    """A segment's rows (segment schema, (key group, hash) order), their key hashes and the
    key group offsets of ``key_groups`` (``offsets[g]``: the first row of the range's ``g``-th
    key group). ``release``: hands back the mapped pages read so far (the store's files')."""

    def __init__(self, table: pa.Table, hashes: np.ndarray, offsets: np.ndarray,
                 key_groups: KeyGroupRange, max_parallelism: int, key: tuple[str, ...],
                 release: Callable[[], None]) -> None:
        self.table = table
        self.hashes = hashes
        self.offsets = offsets
        self.key_groups = key_groups
        self.max_parallelism = max_parallelism
        self.key = key
        self.release = release

    @property
    def num_rows(self) -> int:
        return self.table.num_rows

    def groups_of(self, hashes: np.ndarray) -> np.ndarray:
        """Key groups of ``hashes``, relative to the range's first."""
        return ((hashes % np.uint64(self.max_parallelism)).astype(np.int64)
                - self.key_groups.start)

    def bounds(self, hashes: np.ndarray, side: str) -> np.ndarray:
        """For each hash, its insertion point in the segment's (key group, hash) order:
        a binary search inside its key group's rows."""
        groups = self.groups_of(hashes)
        found = np.zeros(len(hashes), np.int64)
        if not len(hashes) or not self.num_rows:
            return found
        order = np.argsort(groups, kind="stable")
        present, starts = np.unique(groups[order], return_index=True)
        ends = np.append(starts[1:], len(order))
        for group, start, end in zip(present.tolist(), starts.tolist(), ends.tolist(),
                                     strict=True):
            first, last = self.offsets[group], self.offsets[group + 1]
            asked = order[start:end]
            found[asked] = first + np.searchsorted(self.hashes[first:last], hashes[asked],
                                                   side=side)
        return found

    def find(self, keys: pa.Table, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(segment row, query row) of the queried keys found in the segment. Searched a part
        at a time: key groups of at most ``PART_ROWS`` rows together (at least one), the pages
        each part read handed back before the next."""
        if not self.num_rows or not len(hashes):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        groups = self.groups_of(hashes)
        order = np.argsort(groups, kind="stable")
        present, starts = np.unique(groups[order], return_index=True)
        ends = np.append(starts[1:], len(order))
        sizes = (self.offsets[present + 1] - self.offsets[present]).tolist()
        found_rows, found_queries = [], []
        first = 0
        while first < len(present):
            last, span = first + 1, sizes[first]
            while last < len(present) and span + sizes[last] <= PART_ROWS:
                span, last = span + sizes[last], last + 1
            asked = order[starts[first]:ends[last - 1]]
            wanted = hashes[asked]
            rows, query = matching(self.table, self.bounds(wanted, "left"),
                                   self.bounds(wanted, "right"), keys.take(pa.array(asked)),
                                   self.key)
            found_rows.append(rows)
            found_queries.append(asked[query])
            self.release()
            first = last
        return np.concatenate(found_rows), np.concatenate(found_queries)


def matching(stored: pa.Table, left: np.ndarray, right: np.ndarray, keys: pa.Table,
             key: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(stored row, query row) of the queries whose ``key`` is among the stored rows
    ``left[i]:right[i]`` (the rows with the query's hash: every candidate of a run of equal
    hashes is compared by key)."""
    counts = right - left
    total = int(counts.sum())
    if not total:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    query = np.repeat(np.arange(len(left)), counts)
    firsts = np.repeat(np.cumsum(counts) - counts, counts)
    rows = np.repeat(left, counts) + (np.arange(total) - firsts)
    same = None
    for name in key:
        equal = pc.equal(stored.column(name).take(pa.array(rows)),
                         keys.column(name).take(pa.array(query)))
        same = equal if same is None else pc.and_(same, equal)
    same = same.to_numpy(zero_copy_only=False)
    return rows[same], query[same]


def in_store_order(groups: np.ndarray, hashes: np.ndarray) -> bool:
    """Whether rows of key ``groups`` and ``hashes`` are in a segment's (key group, hash)
    order."""
    return bool(np.all((groups[1:] > groups[:-1])
                       | ((groups[1:] == groups[:-1]) & (hashes[1:] >= hashes[:-1]))))


def to_numpy(column: pa.ChunkedArray) -> np.ndarray:
    """``column`` as one numpy array (a view of its one chunk where it can be)."""
    return (column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
            ).to_numpy(zero_copy_only=False)
