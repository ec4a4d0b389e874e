"""The local store of a task's keyed state: one key group range of one keyed stage, on the
executor's disk. It is a cache of the checkpoint chain: a task that finds none (or a stale
one) rebuilds it from the chain, so losing it never loses state.

``ArrowKeyedStateStore`` is the store the benchmark chose (benchmarks/keyed_store.py,
docs/design.md "Keyed state"): a *segment*, an Arrow IPC file sorted by key hash and
memory-mapped (the operating system pages it, so state may exceed memory), plus a *delta*:
the latest upsert or delete per key since the segment, persisted as one small Arrow file per
batch and held in memory. A lookup hashes the batch's keys and binary-searches the segment's
hash column with numpy; when the delta outgrows ``merge_ratio`` of the segment, both merge
into a new segment. ``MANIFEST.json`` names the live files; it is replaced atomically, so a
crash leaves either the old or the new store, and files it does not name are leftovers.
"""

import base64
import json
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from pipelines.keyed._key_groups import KeyGroupRange, hash_keys
from pipelines.keyed._layout import KEY_GROUP, KeyedStateLayout, concat_as

__all__ = ["ArrowKeyedStateStore", "KeyedStateStore", "LocalStoreError", "remove_store"]

_HASH = "_hash"
_DELETED = "_deleted"
_MANIFEST = "MANIFEST.json"
_STORE_FORMAT = "arrow-keyed-store-v1"


class LocalStoreError(ValueError):
    """A local store directory that cannot be used: its caller rebuilds it from the chain."""


class KeyedStateStore(ABC):
    """The state of one key group range of one keyed stage, on local disk.

    ``get`` returns the state rows of some keys; ``apply`` upserts and deletes rows and
    records which change it was (``version``: the caller's name for the state it now holds,
    e.g. the checkpoint chain position); ``sorted_batches`` iterates the whole state sorted by
    key group then key hash (a materialisation); ``drop_expired`` removes rows expired by the
    stage's TTL. ``close`` keeps the directory for the next task; ``destroy`` removes it.
    """

    layout: KeyedStateLayout
    key_groups: KeyGroupRange
    directory: Path

    @abstractmethod
    def get(self, keys: pa.Table, *, cutoff=None) -> pa.Table:
        """The stored rows (``layout.stored_schema``) of the keys in ``keys`` (key columns;
        duplicates allowed) that have state, in no particular order. With a ``cutoff``, rows
        that expired by it are left out (the stage never sees expired state)."""

    @abstractmethod
    def apply(self, upserts: pa.Table, deletes: pa.Table, *, version: str | None = None) -> None:
        """Upsert full rows (one per key) and delete keys (key columns); upserts and deletes
        have distinct keys. Every key must belong to this store's key groups."""

    @abstractmethod
    def load(self, rows: pa.Table, *, version: str | None = None) -> None:
        """Replace the whole state with ``rows`` (stored rows, one per key): a rebuild from
        the checkpoint chain, without the bookkeeping of ``apply``."""

    @property
    @abstractmethod
    def version(self) -> str | None:
        """The ``version`` of the last ``apply`` (None: never applied)."""

    @property
    @abstractmethod
    def num_rows(self) -> int: ...

    @abstractmethod
    def sorted_batches(self, max_rows: int = 1 << 16) -> Iterator[pa.RecordBatch]:
        """All rows, ``stored_schema`` plus ``_key_group`` (int16), sorted by key group."""

    @abstractmethod
    def drop_expired(self, cutoff, *, version: str | None = None) -> pa.Table:
        """Delete the rows the stage's TTL expired by ``cutoff``; returns their keys (for the
        change file, so that a replay drops them too)."""

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def destroy(self) -> None:
        """Close and delete the store's directory."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ArrowKeyedStateStore(KeyedStateStore):
    """An Arrow segment (sorted by key hash, memory-mapped) plus a delta; see the module."""

    def __init__(self, directory: str | os.PathLike, layout: KeyedStateLayout,
                 key_groups: KeyGroupRange, *, merge_ratio: float = 0.05,
                 min_merge_rows: int = 10_000) -> None:
        """Open the store in ``directory`` or create an empty one. A directory holding another
        stage's or range's store, or an unreadable one, raises ``LocalStoreError``."""
        self.directory = Path(directory)
        self.layout = layout
        self.key_groups = key_groups
        self.merge_ratio = merge_ratio
        self.min_merge_rows = min_merge_rows
        # value columns nullable inside the store: deletes are rows of nulls in the delta
        schema = pa.schema([f.with_nullable(True) for f in layout.stored_schema])
        self._segment_schema = schema.append(pa.field(_HASH, pa.uint64()))
        self._delta_schema = self._segment_schema.append(pa.field(_DELETED, pa.bool_()))
        self._segment_file: str | None = None
        self._delta_files: list[str] = []
        self._version: str | None = None
        self._rows = 0  # live rows, kept by every write: counting them costs a delta's lookups
        self._segment = self._segment_schema.empty_table()
        self._hashes = np.zeros(0, np.uint64)
        self._delta = self._delta_schema.empty_table()
        manifest = self.directory / _MANIFEST
        if manifest.exists():
            self._load(manifest)
        else:
            if self.directory.exists() and any(self.directory.iterdir()):
                raise LocalStoreError(f"{self.directory} is not empty and holds no local store "
                                      f"({_MANIFEST}); give the store a directory of its own")
            self.directory.mkdir(parents=True, exist_ok=True)
            self._write_manifest()

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
        body = self._identity() | {"segment": self._segment_file, "deltas": self._delta_files,
                                   "version": self._version, "rows": self._rows}
        temporary = self.directory / f".{_MANIFEST}.{uuid.uuid4().hex}"
        temporary.write_text(json.dumps(body))
        os.replace(temporary, self.directory / _MANIFEST)

    def _load(self, manifest: Path) -> None:
        try:
            body = json.loads(manifest.read_text())
            identity = {k: body[k] for k in self._identity()}
            self._rows = int(body["rows"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LocalStoreError(f"local store {self.directory}: unreadable {_MANIFEST} "
                                  f"({exc}); rebuild it from the checkpoint chain") from exc
        if identity != self._identity():
            differs = sorted(k for k in identity if identity[k] != self._identity()[k])
            raise LocalStoreError(f"local store {self.directory} holds other state (its "
                                  f"{', '.join(differs)} differ); rebuild it")
        self._segment_file, self._delta_files = body["segment"], list(body["deltas"])
        self._version = body["version"]
        try:
            if self._segment_file is not None:
                self._map_segment(self._segment_file)
            deltas = []
            for name in self._delta_files:
                with pa.OSFile(str(self.directory / name)) as f:
                    deltas.append(ipc.open_file(f).read_all())
            if deltas:
                self._delta = self._last_per_key(deltas)
        except (OSError, pa.ArrowInvalid) as exc:
            raise LocalStoreError(f"local store {self.directory}: {exc}; rebuild it from the "
                                  "checkpoint chain") from exc
        live = {_MANIFEST, self._segment_file, *self._delta_files}
        for leftover in self.directory.iterdir():  # a crash between a file and the manifest
            if leftover.name not in live and leftover.name.startswith(("segment-", "delta-",
                                                                       f".{_MANIFEST}")):
                leftover.unlink()

    def _write_arrow(self, prefix: str, table: pa.Table) -> str:
        name = f"{prefix}-{uuid.uuid4().hex}.arrow"
        with ipc.new_file(str(self.directory / name), table.schema) as writer:
            # As few record batches as the table has chunks: a segment of one batch maps to
            # contiguous columns, so its hash column needs no copy and takes need no
            # concatenation (a 4-chunk segment of 4M rows took 14 ms per take, 1 chunk 0.4 ms)
            writer.write_table(table, max_chunksize=1 << 26)
        return name

    def _map_segment(self, name: str) -> None:
        source = pa.memory_map(str(self.directory / name))
        self._segment = ipc.open_file(source).read_all()
        self._hashes = _numpy(self._segment.column(_HASH))

    # --- reads ------------------------------------------------------------------------------

    @property
    def version(self) -> str | None:
        return self._version

    @property
    def num_rows(self) -> int:
        return self._rows

    def _live(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        """Which rows of ``table`` (key columns and ``_hash``, each key once) have a live row
        in the store (the delta decides for its keys, the segment for the rest), and the
        delta's rows of those keys."""
        key = list(self.layout.key)
        live = np.zeros(table.num_rows, bool)
        in_delta = np.zeros(table.num_rows, bool)
        delta_rows = np.zeros(0, np.int64)
        if self._delta.num_rows:
            probe = table.select(key).append_column("_row", pa.array(np.arange(table.num_rows)))
            stored = self._delta.select([*key, _DELETED]).append_column(
                "_delta_row", pa.array(np.arange(self._delta.num_rows)))
            matched = probe.join(stored, key, join_type="inner")
            rows = matched.column("_row").to_numpy()
            in_delta[rows] = True
            live[rows] = ~matched.column(_DELETED).to_numpy(zero_copy_only=False)
            delta_rows = matched.column("_delta_row").to_numpy()
        rest = np.flatnonzero(~in_delta)
        if len(rest) and self._segment.num_rows:
            asked = table.take(pa.array(rest))
            _, found = self._find_in_segment(asked.select(key), _numpy(asked.column(_HASH)))
            live[rest[found]] = True
        return live, delta_rows

    def _find_in_segment(self, keys: pa.Table, hashes: np.ndarray):
        """(segment row indices, query row indices) of the queried keys found in the segment.
        Keys with equal hashes form runs; every candidate of a run is compared by key."""
        left = np.searchsorted(self._hashes, hashes, side="left")
        right = np.searchsorted(self._hashes, hashes, side="right")
        counts = right - left
        total = int(counts.sum())
        if not total:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        query = np.repeat(np.arange(len(hashes)), counts)
        firsts = np.repeat(np.cumsum(counts) - counts, counts)
        rows = np.repeat(left, counts) + (np.arange(total) - firsts)
        same = None
        for name in self.layout.key:
            stored = self._segment.column(name).take(pa.array(rows))
            asked = keys.column(name).take(pa.array(query))
            equal = pc.equal(stored, asked)
            same = equal if same is None else pc.and_(same, equal)
        same = same.to_numpy(zero_copy_only=False)
        return rows[same], query[same]

    def get(self, keys: pa.Table, *, cutoff=None) -> pa.Table:
        keys = self.layout.conform_keys(keys, f"local store {self.directory}: keys")
        key = list(self.layout.key)
        keys = keys.group_by(key).aggregate([])  # each key once
        schema = self.layout.stored_schema
        if self._delta.num_rows:
            matched = self._delta.join(keys, key, join_type="left semi")
            from_delta = matched.filter(pc.invert(matched.column(_DELETED)))
            rest = keys.join(matched.select(key), key, join_type="left anti")
        else:
            from_delta, rest = self._delta, keys
        rows, _ = self._find_in_segment(rest, hash_keys(rest, self.layout.key))
        found = self._segment.take(pa.array(rows)).select(schema.names)
        result = concat_as(schema, [found, from_delta])
        if cutoff is not None and self.layout.ttl is not None:
            result = self.layout.ttl.live(result, cutoff)
        return result

    def _materialised(self) -> pa.Table:
        """The whole state as one table (segment schema), in no particular order."""
        if not self._delta.num_rows:
            return self._segment
        rows, _ = self._find_in_segment(self._delta.select(list(self.layout.key)),
                                        self._delta.column(_HASH).to_numpy())
        keep = np.ones(self._segment.num_rows, bool)
        keep[rows] = False
        live = self._delta.filter(pc.invert(self._delta.column(_DELETED)))
        return concat_as(self._segment_schema, [self._segment.filter(pa.array(keep)), live])

    def sorted_batches(self, max_rows: int = 1 << 16) -> Iterator[pa.RecordBatch]:
        table = self._materialised()
        hashes = _numpy(table.column(_HASH))
        groups = (hashes % np.uint64(self.layout.max_parallelism)).astype(np.int16)
        # by hash, then stably by key group (a radix sort for int16): numpy's sorts are
        # about 3x faster than Arrow's sort_by here
        order = np.argsort(hashes)
        order = order[np.argsort(groups[order], kind="stable")]
        table = table.append_column(KEY_GROUP, pa.array(groups)).take(pa.array(order))
        table = table.select([*self.layout.stored_schema.names, KEY_GROUP])
        yield from table.to_batches(max_chunksize=max_rows)

    # --- writes -----------------------------------------------------------------------------

    def _with_hashes(self, table: pa.Table, what: str) -> pa.Table:
        hashes = hash_keys(table, self.layout.key)
        groups = hashes % np.uint64(self.layout.max_parallelism)
        outside = (groups < self.key_groups.start) | (groups > self.key_groups.end)
        if outside.any():
            raise ValueError(f"local store {self.directory} ({self.key_groups}): {what} hold "
                             f"{int(outside.sum())} key(s) of other key groups, e.g. key group "
                             f"{int(groups[outside][0])}; route rows by key group first")
        return table.append_column(_HASH, pa.array(hashes, pa.uint64()))

    def _last_per_key(self, changes: list[pa.Table]) -> pa.Table:
        """The delta of ``changes`` applied in order: each key's last row. One pass, where
        merging them one by one costs a join per file (quadratic in the files)."""
        table = concat_as(self._delta_schema, changes)
        order = table.select(list(self.layout.key)).append_column(
            "_row", pa.array(np.arange(table.num_rows)))
        last = order.group_by(list(self.layout.key), use_threads=False).aggregate(
            [("_row", "max")])
        if last.num_rows == table.num_rows:
            return table.combine_chunks()
        return table.take(pa.array(np.sort(last.column("_row_max").to_numpy()))
                          ).combine_chunks()

    def apply(self, upserts: pa.Table, deletes: pa.Table, *, version: str | None = None) -> None:
        upserts = self.layout.conform(upserts, f"local store {self.directory}: upserts")
        deletes = self.layout.conform_keys(deletes, f"local store {self.directory}: deletes")
        if not upserts.num_rows and not deletes.num_rows:
            self._version = version
            self._write_manifest()
            return
        upserts = self._with_hashes(upserts, "upserts")
        deleted = self._with_hashes(deletes, "deletes")
        tombstones = pa.table(
            {name: deleted.column(name) if name in deleted.column_names
             else pa.nulls(deleted.num_rows, field.type)
             for name, field in zip(self._segment_schema.names, self._segment_schema,
                                    strict=True)}, schema=self._segment_schema)
        change = concat_as(self._delta_schema, [
            upserts.append_column(_DELETED, pa.repeat(False, upserts.num_rows)),
            tombstones.append_column(_DELETED, pa.repeat(True, tombstones.num_rows)),
        ])
        threshold = max(self.min_merge_rows, self.merge_ratio * self._segment.num_rows)
        was_live, replaced = self._live(change)
        upserted = ~change.column(_DELETED).to_numpy(zero_copy_only=False)
        self._rows += int((upserted & ~was_live).sum()) - int((~upserted & was_live).sum())
        kept = np.ones(self._delta.num_rows, bool)
        kept[replaced] = False
        self._delta = concat_as(self._delta_schema,
                                [self._delta.filter(pa.array(kept)), change]).combine_chunks()
        if self._delta.num_rows > threshold:
            self._write_segment(self._materialised(), version)
        else:
            self._delta_files.append(self._write_arrow("delta", change))
            self._version = version
            self._write_manifest()

    def load(self, rows: pa.Table, *, version: str | None = None) -> None:
        rows = self.layout.conform(rows, f"local store {self.directory}: rows")
        rows = self._with_hashes(rows, "rows")
        self._write_segment(rows, version)

    def _write_segment(self, table: pa.Table, version: str | None) -> None:
        table = table.select(self._segment_schema.names)
        table = table.take(pa.array(np.argsort(_numpy(table.column(_HASH)))))
        old = [self._segment_file, *self._delta_files]
        self._segment_file = self._write_arrow("segment", table)
        self._delta_files = []
        self._version = version
        self._rows = table.num_rows
        self._write_manifest()
        self._map_segment(self._segment_file)
        self._delta = self._delta_schema.empty_table()
        for name in old:
            if name is not None:
                (self.directory / name).unlink(missing_ok=True)

    def drop_expired(self, cutoff, *, version: str | None = None) -> pa.Table:
        if self.layout.ttl is None:
            return self.layout.key_schema.empty_table()
        table = self._materialised()
        expired = table.filter(self.layout.ttl.expired(table, cutoff))
        keys = expired.select(list(self.layout.key))
        if keys.num_rows:
            self._write_segment(self.layout.ttl.live(table, cutoff),
                                version)
        return keys

    def close(self) -> None:
        self._segment = self._segment_schema.empty_table()  # releases the memory map
        self._hashes = np.zeros(0, np.uint64)
        self._delta = self._delta_schema.empty_table()

    def destroy(self) -> None:
        self.close()
        remove_store(self.directory)


def _numpy(column: pa.ChunkedArray) -> np.ndarray:
    return (column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()).to_numpy()


def remove_store(directory: str | os.PathLike) -> None:
    """Delete a local store's directory, whatever state it holds. A directory that is not a
    store (no manifest, not empty) is refused: a misconfigured path must not lose files."""
    directory = Path(directory)
    if not directory.exists():
        return
    if not (directory / _MANIFEST).exists() and any(directory.iterdir()):
        raise LocalStoreError(f"{directory} is not a local keyed-state store (no {_MANIFEST}) "
                              "and is not empty; refusing to delete it: point the store "
                              "directory elsewhere")
    shutil.rmtree(directory)
