"""The local store of a task's keyed state: one key group range of one keyed stage, on the
executor's disk. It is a cache of the checkpoint chain: a task that finds none (or a stale
one) rebuilds it from the chain, so losing it never loses state.

``ArrowKeyedStateStore`` is the store the benchmark chose (benchmarks/keyed_store.py,
docs/design.md "Keyed state"): a *segment*, an Arrow IPC file memory-mapped (the operating
system pages it, so state may exceed memory), plus *runs*: one small Arrow file per batch of
changes (upserts and deletes, each key once, sorted by key hash), memory-mapped too.

The segment is in the order of a full snapshot, by key group then key hash, with each key
group's first row in the manifest; so a rebuild loads a full snapshot as it is read, and a
full snapshot of a store without runs writes the segment as it is. A lookup hashes the
batch's keys and binary-searches the runs, newest first, then the segment inside each key's
key group, with numpy: a batch costs what its keys cost, whatever the size of the state. Past
``max_runs`` runs, they compact into one; when the runs outgrow ``merge_ratio`` of the
segment, both merge into a new segment. ``MANIFEST.json`` names the live files; it is
replaced atomically, so a crash leaves either the old or the new store, and files it does not
name are leftovers.

The store verifies what it opens: the manifest records each file's size and CRC-32 and carries
a CRC-32 of its own body. Opening checks the manifest, then each file's size and checksum
before Arrow parses it: a flipped bit, a truncated, missing or stale file raises
``LocalStoreError`` naming it, and the caller rebuilds from the chain. Nothing is fsynced: a
power loss may leave a torn, zero-filled or missing file, or an older or empty manifest, and
each of these fails that check (or opens as an older ``version``, which the caller rebuilds);
the checkpoint, not the store, is what is durable. A file is hashed once per executor, not
at every open: ``_store_verification`` (its docstring says how and what it saves).
"""

import base64
import ctypes
import json
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from pipelines.keyed._key_groups import (
    KeyGroupRange,
    group_hash_order,
    hash_keys,
    in_group_hash_order,
    last_per_key,
)
from pipelines.keyed._layout import KEY_GROUP, KeyedStateLayout, concat_as
from pipelines.keyed._segment_file import fixed_buffer_counts, write_one_batch
from pipelines.keyed._store_base import KeyedStateStore
from pipelines.keyed._store_directory import (
    _FILE_NAME,
    _MANIFEST,
    _PREFIXES,
    LocalStoreError,
    only_store_files,
    remove_store,
    stored_version,
)
from pipelines.keyed._store_verification import (
    _VERIFIED,
    _body_checksum,
    _ChecksummedFile,
    _executor_identity,
    _file_checksum,
    _siblings_claims,
    _signature,
    _stat_signature,
    forget_verified_files,
)

__all__ = ["ArrowKeyedStateStore", "KeyedStateStore", "LocalStoreError", "forget_verified_files",
           "group_hash_order", "remove_store", "stored_version"]

_HASH = "_hash"
_DELETED = "_deleted"
# v3: the manifest records each file's size and CRC-32 and its own checksum; a v2 store
# cannot be verified, so it is rebuilt
_STORE_FORMAT = "arrow-keyed-store-v3"
_IN_SEGMENT, _ABSENT = -1, -2


def _madvise() -> "ctypes._CFuncPtr | None":
    """The C library's ``madvise`` (None where there is none to call: nothing is dropped)."""
    try:
        function = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return function


_MADVISE = _madvise()
_MADV_DONTNEED = 4  # Linux's value; elsewhere the call fails and changes nothing


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
        more rows than both; ``max_runs``: past this many runs, they compact into one.
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
        self._segment_schema = schema.append(pa.field(_HASH, pa.uint64()))
        self._run_schema = self._segment_schema.append(pa.field(_DELETED, pa.bool_()))
        self._segment_file: str | None = None
        self._checksums: dict[str, tuple[int, int]] = {}  # file name -> (size, CRC-32)
        # what each live file and the manifest were when verified or written (``unchanged``)
        self._signatures: dict[str, tuple] = {}
        self._version: str | None = None
        self._rows = 0  # live rows, kept by every write: counting them costs the runs' lookups
        self._segment = self._segment_schema.empty_table()
        self._hashes = np.zeros(0, np.uint64)
        self._offsets = np.zeros(len(key_groups) + 1, np.int64)
        self._runs: list[_Run] = []
        # file name -> (its memory map, the map's address and size): the pages a lookup
        # touched are handed back after it (``_drop_mapped_pages``)
        self._maps: dict[str, tuple[pa.MemoryMappedFile, int, int]] = {}
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
        self._checksums = {name: self._checksums[name] for name in live}
        body = self._identity() | {"segment": self._segment_file,
                                   "offsets": self._offsets.tolist(),
                                   "runs": [run.name for run in self._runs],
                                   "files": {n: list(self._checksums[n]) for n in live},
                                   "version": self._version, "rows": self._rows,
                                   "verified": self._claims(live)}
        text = json.dumps({"body": body, "crc32": _body_checksum(body)}).encode()
        temporary = self.directory / f".{_MANIFEST}.{uuid.uuid4().hex}"
        with open(temporary, "wb") as file:
            file.write(text)
        os.replace(temporary, self.directory / _MANIFEST)
        # No fsync here nor of the files: the store is a cache verified when a process first
        # opens it, so a power loss costs a rebuild, never wrong state (docs/design.md, 7.3)
        self._signatures = {n: self._signatures[n] for n in live}
        self._signatures[_MANIFEST] = _stat_signature(os.stat(self.directory / _MANIFEST))

    def _claims(self, live: list[str]) -> dict | None:
        """For the manifest: the live files this process verified or wrote, by their stat
        signature, for the sibling processes of its executor (``_verify``); None outside one."""
        executor = _executor_identity()
        if executor is None:
            return None
        files = {}
        for name in live:
            stat = self._signatures.get(name)
            if stat is not None and _VERIFIED.holds(
                    (str(self.directory / name), *stat, self._checksums[name][1])):
                files[name] = list(stat)
        return {"executor": executor, "pid": os.getpid(), "files": files}

    def _read_manifest(self, manifest: Path) -> dict:
        """The manifest's body, its checksum checked; a v2 manifest (no checksums) refused."""
        try:
            with open(manifest, "rb") as file:
                # the file read, not the name's later target: ``unchanged`` compares with it
                self._signatures[_MANIFEST] = _stat_signature(os.fstat(file.fileno()))
                document = json.loads(file.read())
        except (OSError, ValueError) as exc:
            raise LocalStoreError(f"local store {self.directory}: unreadable {manifest} "
                                  f"({exc}); rebuild it from the checkpoint chain") from exc
        if not isinstance(document, dict) or "crc32" not in document:
            written = document.get("format") if isinstance(document, dict) else None
            raise LocalStoreError(
                f"local store {self.directory}: {manifest} records no checksums (format "
                f"{written!r}, written before stores verified their files), so it cannot be "
                "verified; rebuild it from the checkpoint chain")
        body = document.get("body")
        if not isinstance(body, dict) or _body_checksum(body) != document["crc32"]:
            raise LocalStoreError(f"local store {self.directory}: {manifest} is damaged (its "
                                  "checksum does not match); rebuild it from the checkpoint "
                                  "chain")
        return body

    def _load(self, manifest: Path) -> None:
        body = self._read_manifest(manifest)
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
                self._verify(name, checksums, claimed)
            self._checksums = checksums
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

    def _verify(self, name: str, checksums: dict[str, tuple[int, int]],
                claimed: dict[str, list] | None = None) -> None:
        """Check that the store file ``name`` has the size and CRC-32 the manifest recorded
        (the checksum once per executor while the file's inode and times hold: ``claimed``,
        the stat signatures of the files a sibling process verified or wrote)."""
        path = self.directory / name
        if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or name not in checksums:
            raise LocalStoreError(f"the manifest names {name!r}, not a store file it recorded "
                                  "a checksum for")
        size, checksum = checksums[name]
        try:
            stat = path.stat()
        except FileNotFoundError:
            raise LocalStoreError(f"{path} is missing (the manifest names it)") from None
        if stat.st_size != size:
            raise LocalStoreError(f"{path} has {stat.st_size} bytes, the manifest recorded "
                                  f"{size} (truncated or replaced)")
        signature = _signature(path, stat, checksum)
        self._signatures[name] = _stat_signature(stat)
        if not self.verify or _VERIFIED.holds(signature):
            return
        if claimed and claimed.get(name) == list(self._signatures[name]):
            _VERIFIED.add(signature)  # a sibling hashed or wrote this very file
            return
        actual = _file_checksum(path)
        if actual != checksum:
            raise LocalStoreError(f"{path} is damaged: its CRC-32 is {actual:08x}, the "
                                  f"manifest recorded {checksum:08x}")
        _VERIFIED.add(signature)

    def _write_arrow(self, prefix: str, table: pa.Table) -> str:
        def write(file) -> int:
            sink = _ChecksummedFile(file)
            with ipc.new_file(sink, table.schema) as writer:
                # As few record batches as the table has chunks: a segment of one batch maps
                # to contiguous columns, so its hash column needs no copy and takes need no
                # concatenation (a 4-chunk segment of 4M rows took 14 ms per take, 1 chunk
                # 0.4 ms)
                writer.write_table(table, max_chunksize=1 << 26)
            return sink.checksum

        return self._write_file(prefix, write)

    def _write_file(self, prefix: str, write: Callable[[BinaryIO], int]) -> str:
        """A new store file named for ``prefix``, written by ``write`` (given the open file,
        returns the CRC-32 of what it wrote), its size and checksum recorded."""
        name = f"{prefix}-{uuid.uuid4().hex}.arrow"
        path = self.directory / name
        with open(path, "wb") as file:
            checksum = write(file)
        stat = path.stat()
        self._checksums[name] = (stat.st_size, checksum)
        self._signatures[name] = _stat_signature(stat)
        _VERIFIED.add(_signature(path, stat, checksum))  # known good: just written
        return name

    def _mapped(self, name: str) -> pa.MemoryMappedFile:
        """``name``'s file memory-mapped, the map kept (with its address) while the file is
        live, so that only a live map's pages are ever dropped."""
        source = pa.memory_map(str(self.directory / name))
        if source.size():
            self._maps[name] = (source, source.read_buffer(source.size()).address,
                                source.size())
            source.seek(0)
        return source

    def _drop_mapped_pages(self) -> None:
        """Hand back the pages of the mapped files a lookup touched (``MADV_DONTNEED``: the
        file's pages stay in the page cache; a later access maps them again). A steady
        batch's keys touch pages of the whole segment (its 20,000 keys a range at 4M: +120
        MiB resident a worker, kept to the task's end); the stage, the change file and the
        store's write need none of them."""
        if _MADVISE is None:
            return
        for _, address, size in self._maps.values():
            _MADVISE(ctypes.c_void_p(address), ctypes.c_size_t(size), _MADV_DONTNEED)

    def _map_segment(self, name: str, offsets: np.ndarray) -> None:
        source = self._mapped(name)
        segment = ipc.open_file(source).read_all()
        if len(offsets) != len(self.key_groups) + 1 or offsets[-1] != segment.num_rows:
            raise LocalStoreError(f"segment {name} does not match the manifest's key group "
                                  "offsets")
        self._segment_file, self._segment, self._offsets = name, segment, offsets
        self._hashes = _numpy(segment.column(_HASH))

    def _read_run(self, name: str) -> "_Run":
        # mapped like the segment: opening the store reads no run, a lookup pages in what
        # it touches
        table = ipc.open_file(self._mapped(name)).read_all()
        return _Run(name, table, _numpy(table.column(_HASH)),
                    _numpy(table.column(_DELETED)) if table.num_rows else np.zeros(0, bool))

    def unchanged(self) -> bool:
        """Whether the manifest and every file it names are still the ones this store read or
        wrote (device, inode, size, mtime, ctime): a store kept open across tasks
        (``_local_stores``) may serve the next one only then. Another process's write replaces
        the manifest (a new inode); a file rewritten in place, even with its mtime restored,
        has a new ctime. A few stat calls, no read."""
        if not self._signatures:
            return False  # closed
        try:
            return all(_stat_signature(os.stat(self.directory / name)) == signature
                       for name, signature in self._signatures.items())
        except OSError:
            return False

    @property
    def file_bytes(self) -> int:
        """The bytes of the store's live files (what it maps while open)."""
        return sum(size for size, _ in self._checksums.values())

    # --- lookups ----------------------------------------------------------------------------

    @property
    def version(self) -> str | None:
        return self._version

    @property
    def num_rows(self) -> int:
        return self._rows

    def _matching(self, stored: pa.Table, left: np.ndarray, right: np.ndarray,
                  keys: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        """(stored row, query row) of the queries whose key is among the stored rows
        ``left[i]:right[i]`` (the rows with the query's hash: every candidate of a run of
        equal hashes is compared by key)."""
        counts = right - left
        total = int(counts.sum())
        if not total:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        query = np.repeat(np.arange(len(left)), counts)
        firsts = np.repeat(np.cumsum(counts) - counts, counts)
        rows = np.repeat(left, counts) + (np.arange(total) - firsts)
        same = None
        for name in self.layout.key:
            equal = pc.equal(stored.column(name).take(pa.array(rows)),
                             keys.column(name).take(pa.array(query)))
            same = equal if same is None else pc.and_(same, equal)
        same = same.to_numpy(zero_copy_only=False)
        return rows[same], query[same]

    def _segment_bounds(self, hashes: np.ndarray, side: str) -> np.ndarray:
        """For each hash, its insertion point in the segment's (key group, hash) order:
        a binary search inside its key group's rows."""
        groups = (hashes % np.uint64(self.layout.max_parallelism)).astype(np.int64)
        groups -= self.key_groups.start
        found = np.zeros(len(hashes), np.int64)
        if not len(hashes) or not self._segment.num_rows:
            return found
        order = np.argsort(groups, kind="stable")
        present, starts = np.unique(groups[order], return_index=True)
        ends = np.append(starts[1:], len(order))
        for group, start, end in zip(present.tolist(), starts.tolist(), ends.tolist(),
                                     strict=True):
            first, last = self._offsets[group], self._offsets[group + 1]
            asked = order[start:end]
            found[asked] = first + np.searchsorted(self._hashes[first:last], hashes[asked],
                                                   side=side)
        return found

    def _find_in_segment(self, keys: pa.Table, hashes: np.ndarray):
        """(segment row, query row) of the queried keys found in the segment."""
        if not self._segment.num_rows or not len(hashes):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return self._matching(self._segment, self._segment_bounds(hashes, "left"),
                              self._segment_bounds(hashes, "right"), keys)

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
            rows, query = self._matching(
                run.table, np.searchsorted(run.hashes, hashes[pending], side="left"),
                np.searchsorted(run.hashes, hashes[pending], side="right"), asked())
            source[pending[query]], row[pending[query]] = index, rows
            pending = np.delete(pending, query)
        if len(pending) and self._segment.num_rows:  # (an empty store: no copy of the keys)
            rows, query = self._find_in_segment(asked(), hashes[pending])
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
        self._looked_up = (keys, hashes, source, row)
        live = self._live(source, row)
        parts = [self._segment.take(pa.array(row[live & (source == _IN_SEGMENT)]))]
        for index in np.unique(source[live & (source >= 0)]).tolist():
            parts.append(self._runs[index].table.take(
                pa.array(row[live & (source == index)])))
        result = concat_as(self.layout.stored_schema,
                           [part.select(self.layout.stored_schema.names) for part in parts])
        if cutoff is not None and self.layout.ttl is not None:
            result = self.layout.ttl.live(result, cutoff)
        del parts
        self._drop_mapped_pages()  # the result is a copy (takes): it holds no mapped page
        return result

    # --- whole state ------------------------------------------------------------------------

    def _latest_changes(self) -> pa.Table:
        """The runs as one: each key's newest row (run schema), sorted by hash (but for a
        single run about to merge). One pass, where folding the runs one by one costs a
        lookup per run."""
        if len(self._runs) == 1:
            return self._runs[0].table
        table = concat_as(self._run_schema, [run.table for run in self._runs])
        hashes = _numpy(table.column(_HASH))
        rows = last_per_key(table, self.layout.key, hashes)
        hashes = hashes[rows]
        return table.take(pa.array(rows[np.argsort(hashes, kind="stable")])).combine_chunks()

    def _as_full_snapshot(self) -> tuple[pa.Table, np.ndarray]:
        """The whole state (segment schema) in (key group, hash) order, and its key group
        offsets: the segment without the keys the runs changed, the runs' live rows merged
        in at their places."""
        if not self._runs:
            return self._segment, self._offsets
        return self._merged(*self._changes_and_replaced())

    def _changes_and_replaced(self) -> tuple[pa.Table, np.ndarray]:
        """The runs' latest changes (``_latest_changes``) and the segment rows of their keys,
        the search's mapped pages handed back (what follows reads the segment in parts)."""
        changes = self._latest_changes()
        hashes = _numpy(changes.column(_HASH)) if changes.num_rows else np.zeros(0, np.uint64)
        replaced, _ = self._find_in_segment(changes.select(list(self.layout.key)), hashes)
        self._drop_mapped_pages()
        return changes, replaced

    def _merged(self, changes: pa.Table, replaced: np.ndarray) -> tuple[pa.Table, np.ndarray]:
        """The segment with ``changes`` (run schema, each key once) merged in: without its
        ``replaced`` rows (those of the changes' keys), with the changes' upserts at their
        places in (key group, hash) order; and the key group offsets."""
        index, offsets = self._merge_index(changes, replaced)
        table = concat_as(self._segment_schema,
                          [t for t in (self._segment, changes.select(self._segment_schema.names))
                           if t.num_rows] or [self._segment])
        if index is None:
            # the rows in order as they are (an empty store's first batch, its upserts sorted
            # by the task): no take, no copy beside them (+1x the rows at a worker's peak)
            return pa.Table.from_arrays([_one_chunk(c) for c in table.columns],
                                        schema=self._segment_schema), offsets
        # a take across chunks is 3x slower than of one: each column is made one first,
        # column by column, so that one column's copy is held beside the result, not the
        # whole table's (the merge was a worker's peak in a range's first batch); and the
        # segment's mapped pages each take read are handed back before the next column's
        # (the whole segment resident beside its merged copy: +250 MiB a worker at 8M keys)
        index = pa.array(index)
        columns = []
        for column in table.columns:
            columns.append(column.combine_chunks().take(index))
            self._drop_mapped_pages()
        return pa.Table.from_arrays(columns, schema=table.schema), offsets

    def _merge_index(self, changes: pa.Table, replaced: np.ndarray
                     ) -> tuple[np.ndarray | None, np.ndarray]:
        """For ``_merged``'s rows, the row each is of the segment followed by ``changes``
        (None: those rows in their own order), and the key group offsets."""
        hashes = _numpy(changes.column(_HASH)) if changes.num_rows else np.zeros(0, np.uint64)
        added = ~_numpy(changes.column(_DELETED)) if changes.num_rows else np.zeros(0, bool)
        added_hashes = hashes[added]
        del hashes
        # each temporary goes once used: a first batch's merge (every row added) held them
        # all through its take, 65 bytes a row beside the rows' copy
        added_groups = (added_hashes % np.uint64(self.layout.max_parallelism)).astype(np.int64)
        # a batch's task hands its upserts over sorted (``_executor``): not sorted again
        order = np.arange(len(added_hashes)) if in_group_hash_order(added_groups, added_hashes) \
            else group_hash_order(added_groups, added_hashes)
        # where each added row goes among the kept segment rows (all in (group, hash) order):
        # its place in the segment less the replaced rows before it (no pass over the segment)
        bounds = self._segment_bounds(added_hashes[order], "left")
        del added_hashes
        removed = np.bincount(self._groups_of(self._hashes[replaced]),
                              minlength=len(self.key_groups))
        inserted = np.bincount(added_groups - self.key_groups.start,
                               minlength=len(self.key_groups))
        del added_groups
        offsets = self._offsets + np.concatenate([[0], np.cumsum(inserted - removed)])
        slots = bounds - np.searchsorted(np.sort(replaced), bounds) + np.arange(len(order))
        del bounds
        kept = np.ones(self._segment.num_rows, bool)
        kept[replaced] = False
        total = int(kept.sum()) + len(order)
        is_added = np.zeros(total, bool)
        is_added[slots] = True
        index = np.empty(total, np.int64)
        index[~is_added] = np.flatnonzero(kept)
        del kept, is_added
        index[slots] = self._segment.num_rows + np.flatnonzero(added)[order]
        del slots, order, added
        if total and total == self._segment.num_rows + changes.num_rows and index[0] == 0 \
                and index[-1] == total - 1 and bool((np.diff(index) > 0).all()):
            return None, offsets
        return index, offsets

    def _groups_of(self, hashes: np.ndarray) -> np.ndarray:
        """Key groups of ``hashes``, relative to the range's first."""
        return ((hashes % np.uint64(self.layout.max_parallelism)).astype(np.int64)
                - self.key_groups.start)

    def sorted_batches(self, max_rows: int = 1 << 16) -> Iterator[pa.RecordBatch]:
        """The whole state, ``max_rows`` rows at a time, made as each is asked for: the runs'
        changes are merged into each batch from the segment, not into a copy of the whole
        state first (a full snapshot of a 4M-row range held that copy, +390 MiB a worker),
        and the segment's mapped pages are handed back after each batch (it is read whole:
        +250 MiB a worker resident by the snapshot's end)."""
        names = [*self.layout.stored_schema.names]
        index, offsets, changes = None, self._offsets, None
        if self._runs:
            changes, replaced = self._changes_and_replaced()
            index, offsets = self._merge_index(changes, replaced)
            del replaced
            changes = changes.select(names)
        groups = np.repeat(np.arange(self.key_groups.start, self.key_groups.end + 1,
                                     dtype=np.int16), np.diff(offsets))
        segment = self._segment.select(names)
        if changes is not None and index is None:  # the changes follow the segment's rows
            segment = concat_as(segment.schema, [segment, changes])
        for start in range(0, int(offsets[-1]), max_rows):
            stop = min(start + max_rows, int(offsets[-1]))
            if index is None:
                rows = segment.slice(start, stop - start)
            else:
                rows = self._taken(segment, changes, index[start:stop])
            rows = rows.append_column(KEY_GROUP, pa.array(groups[start:stop]))
            # one batch a chunk: the batches a one-chunk table's ``to_batches`` made before
            yield from rows.to_batches(max_chunksize=max_rows)
            del rows
            self._drop_mapped_pages()

    def _taken(self, segment: pa.Table, changes: pa.Table, index: np.ndarray) -> pa.Table:
        """The rows ``index`` names in the segment's rows (``segment``) followed by the
        ``changes``', in that order: each source taken from apart (a take over a column's
        chunks joins the whole column first)."""
        from_segment = index < self._segment.num_rows
        parts = [segment.take(pa.array(index[from_segment])),
                 changes.take(pa.array(index[~from_segment] - self._segment.num_rows))]
        position = np.empty(len(index), np.int64)
        position[from_segment] = np.arange(len(parts[0]))
        position[~from_segment] = len(parts[0]) + np.arange(len(parts[1]))
        return concat_as(segment.schema, parts).take(pa.array(position)).combine_chunks()

    # --- writes -----------------------------------------------------------------------------

    def _with_hashes(self, table: pa.Table, what: str,
                     hashes: np.ndarray | None = None) -> pa.Table:
        if hashes is None:
            hashes = hash_keys(table, self.layout.key)
        self._check_hashes(hashes, table.num_rows, what)
        return table.append_column(_HASH, pa.array(hashes, pa.uint64()))

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
            upserts.append_column(_DELETED, pa.repeat(False, upserts.num_rows)),
            tombstones.append_column(_DELETED, pa.repeat(True, tombstones.num_rows)),
        ])
        hashes = _numpy(change.column(_HASH))
        source, row = self._recalled(change, hashes, looked_up)
        del looked_up  # not held through a merge
        was_live = self._live(source, row)
        upserted = ~_numpy(change.column(_DELETED))
        self._rows += int((upserted & ~was_live).sum()) - int((~upserted & was_live).sum())
        if sum(run.table.num_rows for run in self._runs) + change.num_rows > self._threshold():
            # merged at once: never written as a run, nor sorted as one
            if self._runs:
                self._runs.append(_Run("", change, hashes, ~upserted))
                merged = self._as_full_snapshot()
            else:  # the lookup above found the segment rows the change replaces
                replaced = row[source == _IN_SEGMENT]
                del source, row, hashes, was_live, upserted  # not held through the merge
                merged = self._merged(change, replaced)
            self._write_segment(*merged, version)
            return
        order = np.argsort(hashes, kind="stable")
        change = change.take(pa.array(order)).combine_chunks()
        self._runs.append(_Run(self._write_arrow("run", change), change, hashes[order],
                               ~upserted[order]))
        if len(self._runs) > self.max_runs:
            self._compact_runs()
        self._version = version
        self._write_manifest()
        self._remove_unnamed()

    def _threshold(self, segment_rows: int | None = None) -> float:
        """The rows past which the runs merge into the segment (of ``segment_rows``, default
        the current one's)."""
        if segment_rows is None:
            segment_rows = self._segment.num_rows
        return max(self.min_merge_rows, self.merge_ratio * segment_rows)

    def _compact_runs(self) -> None:
        """Replace the runs by one (each key's newest row): lookups search fewer runs."""
        changes = self._latest_changes()
        name = self._write_arrow("run", changes)
        self._runs = [_Run(name, changes, _numpy(changes.column(_HASH)),
                           _numpy(changes.column(_DELETED)))]

    def load(self, rows: pa.Table, *, upserts: pa.Table | None = None,
             deletes: pa.Table | None = None, version: str | None = None,
             key_hashes: np.ndarray | None = None) -> None:
        """``load``; ``key_hashes``: the rows' key hashes (``hash_keys``) when the caller has
        them already (a rebuild hashed every row to order them): not computed again."""
        self._looked_up = None
        rows = self.layout.conform(rows, f"local store {self.directory}: rows")
        rows = self._with_hashes(rows, "rows", key_hashes).select(self._segment_schema.names)
        hashes = _numpy(rows.column(_HASH)) if rows.num_rows else np.zeros(0, np.uint64)
        groups = self._groups_of(hashes)
        # a full snapshot (or a change file) comes in (key group, hash) order already
        if not _in_store_order(groups, hashes):
            order = group_hash_order(groups, hashes)
            rows, groups = rows.take(pa.array(order)), groups[order]
        offsets = np.searchsorted(groups, np.arange(len(self.key_groups) + 1))
        changed = sum(t.num_rows for t in (upserts, deletes) if t is not None)
        # the base as the segment, in memory: the changes merge into it before one write
        # when they would merge at once anyway (a rebuild's changes since a snapshot), and
        # the merge copies the base, so it is not made one record batch first
        merges = changed > self._threshold(rows.num_rows)
        if not merges:
            rows = rows.combine_chunks()  # one record batch: see _write_arrow
        if not changed:
            self._write_segment(rows, offsets, version)
            return
        self._segment, self._hashes, self._offsets, self._runs = rows, hashes, offsets, []
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
        groups = self._groups_of(key_hashes)
        if not _in_store_order(groups, key_hashes):
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

        name = self._write_file("segment", lambda file: write_one_batch(
            file, stored.append(pa.field(_HASH, pa.uint64())), num_rows, segment_column))
        self._install_segment(name, offsets, num_rows, version)

    def _write_segment(self, table: pa.Table, offsets: np.ndarray,
                       version: str | None) -> None:
        """Make ``table`` (segment schema, (key group, hash) order) the segment, no runs."""
        self._install_segment(self._write_arrow("segment", table), offsets, table.num_rows,
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
        self._maps = {name: mapped for name, mapped in self._maps.items() if name in live}
        for entry in self.directory.iterdir():
            if entry.name.startswith(("segment-", "run-")) and entry.name not in live:
                entry.unlink(missing_ok=True)

    def drop_expired(self, cutoff, *, version: str | None = None) -> pa.Table:
        self._looked_up = None
        if self.layout.ttl is None:
            return self.layout.key_schema.empty_table()
        table, offsets = self._as_full_snapshot()
        expired = _numpy(self.layout.ttl.expired(table, cutoff)) if table.num_rows else \
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
            in_segment = _numpy(expired(self._segment, cutoff))
            if self._runs:
                changes = self._latest_changes()
                hashes = _numpy(changes.column(_HASH)) if changes.num_rows else \
                    np.zeros(0, np.uint64)
                replaced, _ = self._find_in_segment(changes.select(list(self.layout.key)),
                                                    hashes)
                in_segment[replaced] = False
            count += int(in_segment.sum())
        elif self._runs:
            changes = self._latest_changes()
        if self._runs and changes.num_rows:
            upserted = ~_numpy(changes.column(_DELETED))
            count += int((_numpy(expired(changes, cutoff)) & upserted).sum())
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
            mask = np.asarray(predicate(self._segment), bool)
            if changes is not None and changes.num_rows:
                replaced, _ = self._find_in_segment(changes.select(key),
                                                    _numpy(changes.column(_HASH)))
                mask[replaced] = False
            parts.append(self._segment.select(key).filter(pa.array(mask)))
        if changes is not None and changes.num_rows:
            mask = np.asarray(predicate(changes), bool) & ~_numpy(changes.column(_DELETED))
            parts.append(changes.select(key).filter(pa.array(mask)))
        return concat_as(self.layout.key_schema, parts) if parts else \
            self.layout.key_schema.empty_table()

    def close(self) -> None:
        self._segment = self._segment_schema.empty_table()  # releases the memory map
        self._hashes = np.zeros(0, np.uint64)
        self._runs = []
        self._maps = {}
        self._looked_up = None
        self._signatures = {}  # a closed store is never ``unchanged``

    def destroy(self) -> None:
        self.close()
        remove_store(self.directory)


@dataclass(frozen=True)
class _Run:
    """One batch's changes (or several compacted): each key once, sorted by hash."""

    name: str
    table: pa.Table
    hashes: np.ndarray
    deleted: np.ndarray


def _in_store_order(groups: np.ndarray, hashes: np.ndarray) -> bool:
    """Whether rows of key ``groups`` and ``hashes`` are in a segment's (key group, hash)
    order."""
    return bool(np.all((groups[1:] > groups[:-1])
                       | ((groups[1:] == groups[:-1]) & (hashes[1:] >= hashes[:-1]))))


def _one_chunk(column: pa.ChunkedArray) -> pa.Array:
    """``column`` as one array: its one non-empty chunk as it is, else the chunks joined."""
    chunks = [chunk for chunk in column.chunks if len(chunk)]
    return chunks[0] if len(chunks) == 1 else column.combine_chunks()


def _numpy(column: pa.ChunkedArray) -> np.ndarray:
    return (column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
            ).to_numpy(zero_copy_only=False)
