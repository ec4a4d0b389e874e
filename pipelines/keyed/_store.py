"""The local store of a task's keyed state: one key group range of one keyed stage, on the
executor's disk. It is a cache of the checkpoint chain: a task that finds none (or a stale
one) rebuilds it from the chain, so losing it never loses state.

``ArrowKeyedStateStore`` is the store the benchmark chose (benchmarks/keyed_store.py,
docs/design.md "Keyed state"): a *segment*, an Arrow IPC file memory-mapped (the operating
system pages it, so state may exceed memory), plus *runs*: one small Arrow file per batch of
changes (upserts and deletes, each key once, sorted by key hash), memory-mapped too.

The segment is in the order of a full snapshot, by key group then key hash, with each key
group's first row in the manifest; so a rebuild loads a full snapshot as it is read, and a
full snapshot of a store without runs writes the segment as it is. A lookup searches the runs,
newest first, then the segment (``_store_segment``): a batch costs what its keys cost, whatever
the size of the state. Past ``max_runs`` runs, they compact into one; when the runs outgrow
``merge_ratio`` of the segment, both merge into a new segment (``_store_merge``), a range
later than the ranges before it (``MERGE_STAGGER``).
``MANIFEST.json`` names the live files; it is replaced atomically, so a crash leaves either the
old or the new store, and files it does not name are leftovers.

The store verifies what it opens (``_store_files``): the manifest records each file's size and
CRC-32 and carries a CRC-32 of its own body; opening checks the manifest, then each file's size
and checksum before Arrow parses it: a flipped bit, a truncated, missing or stale file raises
``LocalStoreError`` naming it, and the caller rebuilds from the chain. Nothing is fsynced: a
power loss may leave a torn, zero-filled or missing file, or an older or empty manifest, and
each of these fails that check (or opens as an older ``version``, which the caller rebuilds);
the checkpoint, not the store, is what is durable.
"""

import base64
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from pipelines.keyed._key_groups import KeyGroupRange, group_hash_order, hash_keys
from pipelines.keyed._layout import KeyedStateLayout, concat_as
from pipelines.keyed._segment_file import fixed_buffer_counts, write_one_batch
from pipelines.keyed._store_base import KeyedStateStore
from pipelines.keyed._store_directory import (
    _MANIFEST,
    _PREFIXES,
    LocalStoreError,
    only_store_files,
    remove_store,
)
from pipelines.keyed._store_files import StoreFiles
from pipelines.keyed._store_merge import latest_changes, merged, sorted_batches, take_columns
from pipelines.keyed._store_segment import (
    DELETED,
    HASH,
    PART_ROWS,
    Run,
    Segment,
    in_store_order,
    matching,
    to_numpy,
)
from pipelines.keyed._store_verification import _siblings_claims

__all__ = ["ArrowKeyedStateStore"]

# v3: the manifest records each file's size and CRC-32 and its own checksum; a v2 store
# cannot be verified, so it is rebuilt
_STORE_FORMAT = "arrow-keyed-store-v3"
_IN_SEGMENT, _ABSENT = -1, -2


MERGE_STAGGER = 0.5
"""How much later, at most, a range's runs merge than the first range's: its ``merge_ratio``
times 1 + this times its first key group over ``max_parallelism``. The ranges of a stage get
about as many changes per batch each, so their runs outgrew the same ratio in the same batch
and every worker of a machine merged at once: at 4M keys two merges of 2M-row segments side by
side were the run's peak (docs/benchmarks.md, "state_growth: the ranges' merges staggered").
Staggered, they merge in different batches, as Flink staggers its tasks' changelog
materialisations (a random initial delay each)."""


class ArrowKeyedStateStore(KeyedStateStore):
    """An Arrow segment (sorted by key group then key hash, memory-mapped) plus runs of
    changes; see the module."""

    def __init__(self, directory: str | os.PathLike, layout: KeyedStateLayout,
                 key_groups: KeyGroupRange, *, merge_ratio: float = 0.25,
                 min_merge_rows: int = 10_000, max_runs: int = 16,
                 verify: bool = True) -> None:
        """Open the store in ``directory`` or create an empty one. A directory holding another
        stage's or range's store, or an unreadable or damaged one (a file whose size or
        checksum differs from the manifest's, a missing file), raises ``LocalStoreError``.
        ``merge_ratio``, ``min_merge_rows``: the runs merge into a new segment once they hold
        more rows than both (the ratio staggered by the range: ``MERGE_STAGGER``); ``max_runs``:
        past this many runs, they compact into one.
        ``verify=False`` checks sizes but not checksums (to measure what verifying costs)."""
        self.directory = Path(directory)
        self.layout = layout
        self.key_groups = key_groups
        self.merge_ratio = merge_ratio
        self.min_merge_rows = min_merge_rows
        self.max_runs = max_runs
        self.verify = verify
        # value columns nullable inside the store: deletes are rows of nulls in a run
        schema = pa.schema([f.with_nullable(True) for f in layout.stored_schema])
        self._segment_schema = schema.append(pa.field(HASH, pa.uint64()))
        self._run_schema = self._segment_schema.append(pa.field(DELETED, pa.bool_()))
        self._files = StoreFiles(self.directory, verify=verify)
        self._segment_file: str | None = None
        self._version: str | None = None
        self._rows = 0  # live rows, kept by every write: counting them costs the runs' lookups
        self._segment = self._empty_segment()
        self._runs: list[Run] = []
        # the last ``get``'s keys and where it found them, until the next write (``_recalled``)
        self._looked_up: tuple[pa.Table, np.ndarray, np.ndarray, np.ndarray] | None = None
        manifest = self.directory / _MANIFEST
        if manifest.exists():
            self._load(manifest)
        else:
            if only_store_files(self.directory):
                raise LocalStoreError(f"local store {self.directory}: {manifest} is missing "
                                      "(the store's files are there); rebuild it from the "
                                      "checkpoint chain")
            if self.directory.exists() and any(self.directory.iterdir()):
                raise LocalStoreError(f"{self.directory} is not empty and holds no local store "
                                      f"({_MANIFEST}); give the store a directory of its own")
            self.directory.mkdir(parents=True, exist_ok=True)
            self._write_manifest()

    def _new_segment(self, table: pa.Table, hashes: np.ndarray,
                     offsets: np.ndarray) -> Segment:
        return Segment(table, hashes, offsets, self.key_groups, self.layout.max_parallelism,
                       self.layout.key, self._files.drop_mapped_pages)

    def _empty_segment(self) -> Segment:
        return self._new_segment(self._segment_schema.empty_table(), np.zeros(0, np.uint64),
                                 np.zeros(len(self.key_groups) + 1, np.int64))

    # --- on disk ----------------------------------------------------------------------------

    def _identity(self) -> dict:
        return {
            "format": _STORE_FORMAT,
            "key": list(self.layout.key),
            "key_hash": self.layout.key_hash,
            "max_parallelism": self.layout.max_parallelism,
            "key_groups": str(self.key_groups),
            "schema": base64.b64encode(self.layout.stored_schema.serialize()).decode(),
        }

    def _write_manifest(self) -> None:
        live = [n for n in (self._segment_file, *(run.name for run in self._runs)) if n]
        self._files.write_manifest(
            self._identity() | {"segment": self._segment_file,
                                "offsets": self._segment.offsets.tolist(),
                                "runs": [run.name for run in self._runs],
                                "version": self._version, "rows": self._rows}, live)

    def _load(self, manifest: Path) -> None:
        body = self._files.read_manifest(manifest)
        try:
            identity = {k: body[k] for k in self._identity()}
            self._rows = int(body["rows"])
            segment_file, run_files = body["segment"], [str(n) for n in body["runs"]]
            offsets = np.asarray(body["offsets"], np.int64)
            checksums = {str(name): (int(size), int(crc))
                         for name, (size, crc) in body["files"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise LocalStoreError(f"local store {self.directory}: unreadable {manifest} "
                                  f"({exc!r}); rebuild it from the checkpoint chain") from exc
        if identity != self._identity():
            differs = sorted(k for k in identity if identity[k] != self._identity()[k])
            raise LocalStoreError(f"local store {self.directory} holds other state (its "
                                  f"{', '.join(differs)} differ); rebuild it")
        self._version = body["version"]
        claimed = _siblings_claims(body.get("verified"))
        try:
            # checked before Arrow parses them: a damaged file is never read as state
            for name in [segment_file] * (segment_file is not None) + run_files:
                self._files.verify_file(name, checksums, claimed)
            self._files.checksums = checksums
            if segment_file is not None:
                self._map_segment(segment_file, offsets)
            self._runs = [self._read_run(name) for name in run_files]
        except (OSError, pa.ArrowInvalid, LocalStoreError) as exc:
            raise LocalStoreError(f"local store {self.directory}: {exc}; rebuild it from the "
                                  "checkpoint chain") from exc
        live = {_MANIFEST, segment_file, *run_files}
        for leftover in self.directory.iterdir():  # a crash between a file and the manifest
            if leftover.name not in live and leftover.name.startswith(_PREFIXES):
                leftover.unlink()

    def _map_segment(self, name: str, offsets: np.ndarray) -> None:
        segment = ipc.open_file(self._files.mapped(name)).read_all()
        if len(offsets) != len(self.key_groups) + 1 or offsets[-1] != segment.num_rows:
            raise LocalStoreError(f"segment {name} does not match the manifest's key group "
                                  "offsets")
        self._segment_file = name
        self._segment = self._new_segment(segment, to_numpy(segment.column(HASH)), offsets)

    def _read_run(self, name: str) -> Run:
        # mapped like the segment: opening the store reads no run, a lookup pages in what
        # it touches
        table = ipc.open_file(self._files.mapped(name)).read_all()
        return Run(name, table, to_numpy(table.column(HASH)),
                   to_numpy(table.column(DELETED)) if table.num_rows else np.zeros(0, bool))

    def unchanged(self) -> bool:
        """Whether the manifest and every file it names are still the ones this store read or
        wrote (device, inode, size, mtime, ctime): a store kept open across tasks
        (``_local_stores``) may serve the next one only then. Another process's write replaces
        the manifest (a new inode); a file rewritten in place, even with its mtime restored,
        has a new ctime. A few stat calls, no read."""
        return self._files.unchanged()

    @property
    def file_bytes(self) -> int:
        """The bytes of the store's live files (what it maps while open)."""
        return sum(size for size, _ in self._files.checksums.values())

    # --- lookups ----------------------------------------------------------------------------

    @property
    def version(self) -> str | None:
        return self._version

    @property
    def num_rows(self) -> int:
        return self._rows

    def _resolve(self, keys: pa.Table, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where each queried key's current row is: ``(source, row)``, source the index of
        the newest run holding the key, ``_IN_SEGMENT``, or ``_ABSENT``."""
        source = np.full(len(hashes), _ABSENT, np.int64)
        row = np.zeros(len(hashes), np.int64)
        pending = np.arange(len(hashes))

        def asked() -> pa.Table:
            return keys if len(pending) == len(hashes) else keys.take(pa.array(pending))

        for index in range(len(self._runs) - 1, -1, -1):
            if not len(pending):
                break
            run = self._runs[index]
            rows, query = matching(
                run.table, np.searchsorted(run.hashes, hashes[pending], side="left"),
                np.searchsorted(run.hashes, hashes[pending], side="right"), asked(),
                self.layout.key)
            source[pending[query]], row[pending[query]] = index, rows
            pending = np.delete(pending, query)
        if len(pending) and self._segment.num_rows:  # (an empty store: no copy of the keys)
            rows, query = self._segment.find(asked(), hashes[pending])
            source[pending[query]], row[pending[query]] = _IN_SEGMENT, rows
        return source, row

    def _recalled(self, keys: pa.Table, hashes: np.ndarray, looked_up: tuple | None
                  ) -> tuple[np.ndarray, np.ndarray]:
        """``_resolve``, taking what the last ``get`` found (``looked_up``; nothing was written
        since) for the keys it looked up: a batch's changes are of the keys it read, so
        ``apply`` searches the runs and the segment once per batch, not twice. A key is
        recalled only if exactly one looked-up key has its hash and that key is equal; the
        others are resolved."""
        if not self._runs and not self._segment.num_rows:
            # an empty store (a range's first batch): every key absent, without the index
            # arrays of a recall over all of them (85 bytes a row at a worker's peak)
            return np.full(len(hashes), _ABSENT, np.int64), np.zeros(len(hashes), np.int64)
        if looked_up is None or not len(hashes):
            return self._resolve(keys, hashes)
        known, known_hashes, known_source, known_row = looked_up
        order = np.argsort(known_hashes, kind="stable")
        ordered = known_hashes[order]
        left = np.searchsorted(ordered, hashes, side="left")
        once = np.flatnonzero(np.searchsorted(ordered, hashes, side="right") - left == 1)
        at = order[left[once]]
        same = np.ones(len(once), bool)
        for name in self.layout.key:
            equal = pc.equal(known.column(name).take(pa.array(at)),
                             keys.column(name).take(pa.array(once)))
            same &= pc.fill_null(equal, False).to_numpy(zero_copy_only=False)
        recalled, at = once[same], at[same]
        if not len(recalled):
            return self._resolve(keys, hashes)  # no index arrays beside the lookup's own
        source = np.full(len(hashes), _ABSENT, np.int64)
        row = np.zeros(len(hashes), np.int64)
        source[recalled], row[recalled] = known_source[at], known_row[at]
        if len(recalled) == len(hashes):
            return source, row
        rest = np.setdiff1d(np.arange(len(hashes)), recalled, assume_unique=True)
        # the rest's key columns only: ``keys`` may be a batch's whole changes (a first
        # batch's 2M rows a range at 4M: a copy of them all, +270 MiB a worker at its peak)
        source[rest], row[rest] = self._resolve(
            keys.select(list(self.layout.key)).take(pa.array(rest)), hashes[rest])
        return source, row

    def _live(self, source: np.ndarray, row: np.ndarray) -> np.ndarray:
        live = source == _IN_SEGMENT
        for index in np.unique(source[source >= 0]).tolist():
            at = source == index
            live[at] = ~self._runs[index].deleted[row[at]]
        return live

    def get(self, keys: pa.Table, *, cutoff=None) -> pa.Table:
        keys = self.layout.conform_keys(keys, f"local store {self.directory}: keys")
        keys = keys.group_by(list(self.layout.key)).aggregate([])  # each key once
        hashes = hash_keys(keys, self.layout.key)
        source, row = self._resolve(keys, hashes)
        self._files.drop_mapped_pages()  # the search's (hashes, key columns): read no more
        self._looked_up = (keys, hashes, source, row)
        live = self._live(source, row)
        names = self.layout.stored_schema.names
        parts = [self._segment_rows(row[live & (source == _IN_SEGMENT)])]
        for index in np.unique(source[live & (source >= 0)]).tolist():
            parts.append(self._runs[index].table.select(names).take(
                pa.array(row[live & (source == index)])))
        result = concat_as(self.layout.stored_schema, parts)
        if cutoff is not None and self.layout.ttl is not None:
            result = self.layout.ttl.live(result, cutoff)
        del parts
        self._files.drop_mapped_pages()  # the result is a copy (takes): it holds no mapped page
        return result

    def _segment_rows(self, rows: np.ndarray) -> pa.Table:
        """The segment's ``rows`` (the stored columns), in the segment's order, a column and a
        part of it (``PART_ROWS``) at a time with their pages handed back: a steady batch's
        keys touch pages of every column (40,000 keys of a 4M-row range: the whole segment
        resident, +290 MiB a worker beside the batch; a whole column at a time, the widest's
        64 MiB)."""
        return take_columns(self._segment.table.select(self.layout.stored_schema.names),
                            np.sort(rows), self._files.drop_mapped_pages, PART_ROWS)

    # --- whole state ------------------------------------------------------------------------

    def _latest_changes(self) -> pa.Table:
        return latest_changes(self._runs, self._run_schema, self.layout.key)

    def _as_full_snapshot(self) -> tuple[pa.Table, np.ndarray]:
        """The whole state (segment schema) in (key group, hash) order, and its key group
        offsets: the segment without the keys the runs changed, the runs' live rows merged
        in at their places."""
        if not self._runs:
            return self._segment.table, self._segment.offsets
        return self._merged(*self._changes_and_replaced())

    def _merged(self, changes: pa.Table, replaced: np.ndarray) -> tuple[pa.Table, np.ndarray]:
        return merged(self._segment, self._segment_schema, changes, replaced,
                      self._files.drop_mapped_pages)

    def _changes_and_replaced(self) -> tuple[pa.Table, np.ndarray]:
        """The runs' latest changes (``latest_changes``) and the segment rows of their keys,
        the search's mapped pages handed back (what follows reads the segment in parts)."""
        changes = self._latest_changes()
        hashes = to_numpy(changes.column(HASH)) if changes.num_rows else np.zeros(0, np.uint64)
        replaced, _ = self._segment.find(changes.select(list(self.layout.key)), hashes)
        self._files.drop_mapped_pages()
        return changes, replaced

    def sorted_batches(self, max_rows: int = 1 << 16) -> Iterator[pa.RecordBatch]:
        """The whole state, ``max_rows`` rows at a time, made as each is asked for
        (``_store_merge.sorted_batches``: the runs' changes merged into each batch, not into
        a copy of the whole state first)."""
        changes, replaced = self._changes_and_replaced() if self._runs else (None, None)
        yield from sorted_batches(self._segment, [*self.layout.stored_schema.names], changes,
                                  replaced, max_rows, self._files.drop_mapped_pages)

    # --- writes -----------------------------------------------------------------------------

    def _with_hashes(self, table: pa.Table, what: str,
                     hashes: np.ndarray | None = None) -> pa.Table:
        if hashes is None:
            hashes = hash_keys(table, self.layout.key)
        self._check_hashes(hashes, table.num_rows, what)
        return table.append_column(HASH, pa.array(hashes, pa.uint64()))

    def _check_hashes(self, hashes: np.ndarray, num_rows: int, what: str) -> None:
        """Refuse ``hashes`` that are not ``num_rows`` rows' of this store's key groups."""
        if len(hashes) != num_rows:
            raise ValueError(f"local store {self.directory}: {len(hashes)} key hashes for "
                             f"{num_rows} {what}")
        groups = hashes % np.uint64(self.layout.max_parallelism)
        outside = (groups < self.key_groups.start) | (groups > self.key_groups.end)
        if outside.any():
            raise ValueError(f"local store {self.directory} ({self.key_groups}): {what} hold "
                             f"{int(outside.sum())} key(s) of other key groups, e.g. key group "
                             f"{int(groups[outside][0])}; route rows by key group first")

    def apply(self, upserts: pa.Table, deletes: pa.Table, *, version: str | None = None,
              upsert_hashes: np.ndarray | None = None) -> None:
        """``apply``; ``upsert_hashes``: the upserts' key hashes (``hash_keys``) when the
        caller has them (a batch's task: not computed again)."""
        looked_up, self._looked_up = self._looked_up, None  # what it found changes now
        upserts = self.layout.conform(upserts, f"local store {self.directory}: upserts")
        deletes = self.layout.conform_keys(deletes, f"local store {self.directory}: deletes")
        if not upserts.num_rows and not deletes.num_rows:
            self._version = version
            self._write_manifest()
            return
        upserts = self._with_hashes(upserts, "upserts", upsert_hashes)
        del upsert_hashes
        deleted = self._with_hashes(deletes, "deletes")
        tombstones = pa.table(
            {name: deleted.column(name) if name in deleted.column_names
             else pa.nulls(deleted.num_rows, field.type)
             for name, field in zip(self._segment_schema.names, self._segment_schema,
                                    strict=True)}, schema=self._segment_schema)
        change = concat_as(self._run_schema, [
            upserts.append_column(DELETED, pa.repeat(False, upserts.num_rows)),
            tombstones.append_column(DELETED, pa.repeat(True, tombstones.num_rows)),
        ])
        hashes = to_numpy(change.column(HASH))
        source, row = self._recalled(change, hashes, looked_up)
        del looked_up  # not held through a merge
        was_live = self._live(source, row)
        upserted = ~to_numpy(change.column(DELETED))
        self._rows += int((upserted & ~was_live).sum()) - int((~upserted & was_live).sum())
        if sum(run.table.num_rows for run in self._runs) + change.num_rows > self._threshold():
            # merged at once: never written as a run, nor sorted as one
            if self._runs:
                self._runs.append(Run("", change, hashes, ~upserted))
                merged = self._as_full_snapshot()
            else:  # the lookup above found the segment rows the change replaces
                replaced = row[source == _IN_SEGMENT]
                del source, row, hashes, was_live, upserted  # not held through the merge
                merged = self._merged(change, replaced)
            self._write_segment(*merged, version)
            return
        order = np.argsort(hashes, kind="stable")
        change = change.take(pa.array(order)).combine_chunks()
        self._runs.append(Run(self._files.write_arrow("run", change), change, hashes[order],
                               ~upserted[order]))
        if len(self._runs) > self.max_runs:
            self._compact_runs()
        self._version = version
        self._write_manifest()
        self._remove_unnamed()

    def _threshold(self, segment_rows: int | None = None) -> float:
        """The rows past which the runs merge into the segment (of ``segment_rows``, default
        the current one's): ``merge_ratio`` of it, raised by up to ``MERGE_STAGGER`` by the
        range's place among the key groups."""
        if segment_rows is None:
            segment_rows = self._segment.num_rows
        place = self.key_groups.start / self.layout.max_parallelism
        return max(self.min_merge_rows,
                   self.merge_ratio * (1 + MERGE_STAGGER * place) * segment_rows)

    def _compact_runs(self) -> None:
        """Replace the runs by one (each key's newest row): lookups search fewer runs."""
        changes = self._latest_changes()
        name = self._files.write_arrow("run", changes)
        self._runs = [Run(name, changes, to_numpy(changes.column(HASH)),
                           to_numpy(changes.column(DELETED)))]

    def load(self, rows: pa.Table, *, upserts: pa.Table | None = None,
             deletes: pa.Table | None = None, version: str | None = None,
             key_hashes: np.ndarray | None = None) -> None:
        """``load``; ``key_hashes``: the rows' key hashes (``hash_keys``) when the caller has
        them already (a rebuild hashed every row to order them): not computed again."""
        self._looked_up = None
        rows = self.layout.conform(rows, f"local store {self.directory}: rows")
        rows = self._with_hashes(rows, "rows", key_hashes).select(self._segment_schema.names)
        hashes = to_numpy(rows.column(HASH)) if rows.num_rows else np.zeros(0, np.uint64)
        groups = self._segment.groups_of(hashes)
        # a full snapshot (or a change file) comes in (key group, hash) order already
        if not in_store_order(groups, hashes):
            order = group_hash_order(groups, hashes)
            rows, groups = rows.take(pa.array(order)), groups[order]
        offsets = np.searchsorted(groups, np.arange(len(self.key_groups) + 1))
        changed = sum(t.num_rows for t in (upserts, deletes) if t is not None)
        # the base as the segment, in memory: the changes merge into it before one write
        # when they would merge at once anyway (a rebuild's changes since a snapshot), and
        # the merge copies the base, so it is not made one record batch first
        merges = changed > self._threshold(rows.num_rows)
        if not merges:
            rows = rows.combine_chunks()  # one record batch: see StoreFiles.write_arrow
        if not changed:
            self._write_segment(rows, offsets, version)
            return
        self._segment, self._runs = self._new_segment(rows, hashes, offsets), []
        self._rows = rows.num_rows
        if not merges:
            self._write_segment(rows, offsets, None)
        self.apply(self.layout.stored_schema.empty_table() if upserts is None else upserts,
                   self.layout.key_schema.empty_table() if deletes is None else deletes,
                   version=version)

    def load_sorted(self, schema: pa.Schema, num_rows: int, column: Callable[[int], pa.Array],
                    key_hashes: np.ndarray, *, version: str | None = None) -> None:
        """``load`` of ``num_rows`` rows of ``schema`` (the stored columns) already in the
        segment's (key group, hash) order, their key hashes ``key_hashes``, each column given
        when asked (``column(i)``: the ``i``-th, one array; asked once each, in order): the
        segment is written a column at a time (``write_one_batch``), so that one column is
        whole in memory at once, not the rows (a rebuild's winners, kept on disk as its
        slices are replayed). The same segment file ``load`` writes for these rows."""
        self._looked_up = None
        self._check_hashes(key_hashes, num_rows, "rows")
        groups = self._segment.groups_of(key_hashes)
        if not in_store_order(groups, key_hashes):
            raise ValueError(f"local store {self.directory}: rows to load in order are not in "
                             "(key group, hash) order")
        offsets = np.searchsorted(groups, np.arange(len(self.key_groups) + 1))
        del groups
        if not num_rows or not fixed_buffer_counts(schema):  # (view types: written whole)
            self.load(pa.Table.from_arrays([column(i) for i in range(len(schema))] if num_rows
                                           else schema.empty_table().columns, schema=schema),
                      version=version, key_hashes=key_hashes)
            return
        # the schema ``load`` gives such rows (conformed), and the hashes
        stored = self.layout.conform(schema.empty_table(),
                                     f"local store {self.directory}: rows").schema
        if stored.names != schema.names:
            raise ValueError(f"local store {self.directory}: rows to load in order have the "
                             f"columns {schema.names}, not the stored {stored.names}")

        def segment_column(i: int) -> pa.Array:
            if i == len(stored):
                return pa.array(key_hashes, pa.uint64())
            array = column(i)
            return array if array.type.equals(stored.field(i).type) else \
                array.cast(stored.field(i).type)

        name = self._files.write_file("segment", lambda file: write_one_batch(
            file, stored.append(pa.field(HASH, pa.uint64())), num_rows, segment_column))
        self._install_segment(name, offsets, num_rows, version)

    def _write_segment(self, table: pa.Table, offsets: np.ndarray,
                       version: str | None) -> None:
        """Make ``table`` (segment schema, (key group, hash) order) the segment, no runs."""
        self._install_segment(self._files.write_arrow("segment", table), offsets, table.num_rows,
                              version)

    def _install_segment(self, name: str, offsets: np.ndarray, num_rows: int,
                         version: str | None) -> None:
        """Make the segment file ``name`` (just written) the store's, no runs."""
        self._version = version
        self._rows = num_rows
        self._runs = []
        self._map_segment(name, np.asarray(offsets, np.int64))
        self._write_manifest()
        self._remove_unnamed()

    def _remove_unnamed(self) -> None:
        """Delete the store files the manifest no longer names (replaced segments, runs)."""
        live = {self._segment_file, *(run.name for run in self._runs)}
        self._files.keep_maps_of(live)
        for entry in self.directory.iterdir():
            if entry.name.startswith(("segment-", "run-")) and entry.name not in live:
                entry.unlink(missing_ok=True)

    def drop_expired(self, cutoff, *, version: str | None = None) -> pa.Table:
        self._looked_up = None
        if self.layout.ttl is None:
            return self.layout.key_schema.empty_table()
        table, offsets = self._as_full_snapshot()
        expired = to_numpy(self.layout.ttl.expired(table, cutoff)) if table.num_rows else \
            np.zeros(0, bool)
        keys = table.filter(pa.array(expired)).select(list(self.layout.key))
        if keys.num_rows:
            removed = np.concatenate([[0], np.cumsum(expired)])[offsets]
            self._write_segment(table.filter(pa.array(~expired)), offsets - removed, version)
        return keys

    def expired_rows(self, cutoff) -> int:
        # One vectorised comparison over the memory-mapped segment's TTL column (the rows the
        # runs replaced left out) and over the runs' newest upserts: no merge, no copy.
        if self.layout.ttl is None:
            return 0
        expired = self.layout.ttl.expired
        count = 0
        if self._segment.num_rows:
            in_segment = to_numpy(expired(self._segment.table, cutoff))
            if self._runs:
                changes = self._latest_changes()
                hashes = to_numpy(changes.column(HASH)) if changes.num_rows else \
                    np.zeros(0, np.uint64)
                replaced, _ = self._segment.find(changes.select(list(self.layout.key)),
                                                    hashes)
                in_segment[replaced] = False
            count += int(in_segment.sum())
        elif self._runs:
            changes = self._latest_changes()
        if self._runs and changes.num_rows:
            upserted = ~to_numpy(changes.column(DELETED))
            count += int((to_numpy(expired(changes, cutoff)) & upserted).sum())
        return count

    def keys_where(self, predicate) -> pa.Table:
        """The key columns of the live rows for which ``predicate(rows)`` (a numpy boolean
        mask over a table of stored columns) holds: e.g. the keys with a due timer. One
        vectorised pass over the memory-mapped segment (the rows the runs replaced left out)
        and over the runs' newest rows: no merge, no copy."""
        key = list(self.layout.key)
        parts = []
        changes = self._latest_changes() if self._runs else None
        if self._segment.num_rows:
            mask = np.asarray(predicate(self._segment.table), bool)
            if changes is not None and changes.num_rows:
                replaced, _ = self._segment.find(changes.select(key),
                                                    to_numpy(changes.column(HASH)))
                mask[replaced] = False
            parts.append(self._segment.table.select(key).filter(pa.array(mask)))
        if changes is not None and changes.num_rows:
            mask = np.asarray(predicate(changes), bool) & ~to_numpy(changes.column(DELETED))
            parts.append(changes.select(key).filter(pa.array(mask)))
        return concat_as(self.layout.key_schema, parts) if parts else \
            self.layout.key_schema.empty_table()

    def close(self) -> None:
        self._segment = self._empty_segment()  # releases the memory map
        self._runs = []
        self._files.close()  # and the runs' maps; a closed store is never ``unchanged``
        self._looked_up = None

    def destroy(self) -> None:
        self.close()
        remove_store(self.directory)


