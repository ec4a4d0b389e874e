"""Keyed state on checkpoint storage: change files, full snapshots and the chain that
ties them to a checkpoint.

- A **change file** holds one batch's changes to one key group range: a Parquet file with
  the stored columns, ``_key_group`` (int16) and ``_deleted`` (bool). An upsert is a full row
  with ``_deleted`` false; a delete carries the key columns, ``_deleted`` true and nulls
  elsewhere (value columns are nullable in the file for that reason). A key appears at most
  once per file.
- A **full snapshot** is the whole state of a key group range: a Parquet file with the
  stored columns and ``_key_group``, sorted by key group (so a reader of a narrower range
  skips row groups by their statistics), readable by DuckDB and pandas as it is.
- A **chain** (``KeyedStateChain``) is, per key group range, the latest full snapshot (or
  none: empty state) and the change files written since, oldest first. Its state is the
  full snapshot with the changes replayed in order: a later row for a key wins, a delete
  removes it. In `_metadata` a chain is one ``OperatorSubtaskState``: its handles are the
  full snapshot (if any) then the change files, its properties say which is which and the
  key group range, so it is stored without pickle by the storage layer's own encoding.

Both files are written as SHARED-scope state streams through the worker view
(``CheckpointStreamFactory.create_checkpoint_state_output_stream``): later checkpoints
reference them until the next full snapshot, and the shared-state registry keeps them
exactly as long as a retained checkpoint does. Each file's Parquet key-value metadata names
its kind, format version, key columns, key hash, max parallelism and key group range; a
reader checks them, so a file of another stage or range is refused instead of misread.
"""

import datetime as dt
import json
import mmap
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from checkpoint_storage.spi import (
    ByteStreamStateHandle,
    CheckpointedStateScope,
    CheckpointStreamFactory,
    FileStateHandle,
    OperatorState,
    OperatorSubtaskState,
    SegmentFileStateHandle,
    StreamStateHandle,
)
from pipelines._parquet_state import read_parquet, write_parquet_state
from pipelines.keyed._evolution import evolve_table
from pipelines.keyed._key_groups import (
    KeyGroupRange,
    compute_key_group_range_for_operator_index,
    group_hash_order,
    hash_keys,
    in_group_hash_order,
    last_per_key,
)
from pipelines.keyed._layout import KEY_GROUP, KeyedStateLayout, concat_as
from pipelines.keyed._stage import StateTtl, TtlTimeCharacteristic

__all__ = [
    "CHAIN_FORMAT",
    "DELETED",
    "KEYED_STATE_PREFIX",
    "KeyedStateChain",
    "KeyedStateFormatError",
    "decode_keyed_master_state",
    "encode_keyed_master_state",
    "chains_from_operator_state",
    "chains_to_operator_state",
    "read_change_file",
    "read_full_snapshot",
    "iter_replay_chains",
    "replay_chains",
    "write_change_file",
    "write_full_snapshot",
]

CHAIN_FORMAT = "keyed-v1"
"""The ``state-format/<stage>`` master state of a keyed stage: its state is chains of
change files and full snapshots."""
DELETED = "_deleted"
_META_KEY = b"keyed_state"
_CHANGE = "change"
_FULL_SNAPSHOT = "materialisation"  # the persisted file kind: its name stays, files keep reading
# zstd, not the stage state files' snappy (pipelines/state_io.py): a keyed stage writes every
# batch, so bytes per batch are its checkpoint cost; zstd halves them (and the bytes a rebuild
# reads) for ~25 ms more per 500k rows written (benchmarks/state_growth.py). No dictionaries:
# keys are unique per file. Statistics stay on: files are sorted by key group, so readers of
# part of a range skip row groups.
_PARQUET_OPTIONS = {"compression": "zstd", "use_dictionary": False}
_ROW_GROUP_ROWS = 1 << 16

_P_FORMAT = "keyed.format"
_P_KEY_GROUPS = "keyed.key_groups"
_P_FULL_SNAPSHOT = "keyed.materialised"  # persisted: its name stays
_P_ROWS = "rows"  # the same property a DataFrame stage's subtask records
_P_EXPIRED_ROWS = "expired_rows"  # of those, expired by the TTL and not dropped yet


class KeyedStateFormatError(ValueError):
    """A keyed-state file that cannot be read as what the chain says it is."""


def _describe(handle: StreamStateHandle) -> str:
    if isinstance(handle, FileStateHandle):
        return handle.path
    if isinstance(handle, SegmentFileStateHandle):
        return f"segment [{handle.start_position}, {handle.end_position}) of {handle.path}"
    if isinstance(handle, ByteStreamStateHandle):
        return f"inline state {handle.handle_name}"
    return repr(handle)


@dataclass(frozen=True)
class KeyedStateChain:
    """One key group range's state in a checkpoint: the latest full snapshot (None: the
    range had no state when the chain started) and the change files since, oldest first."""

    key_groups: KeyGroupRange
    full_snapshot: StreamStateHandle | None
    changes: tuple[StreamStateHandle, ...] = ()
    rows: int | None = None
    """The range's state rows at the end of the chain (expired rows not yet dropped count),
    recorded as the subtask property ``rows`` like a DataFrame stage's; None when unknown."""
    expired_rows: int | None = None
    """Of ``rows``, those the stage's TTL had expired when the range's last task ran (they
    stay until a full snapshot drops them), subtask property ``expired_rows``; None when
    unknown (checkpoints written before it was recorded)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "changes", tuple(self.changes))

    def appended(self, change: StreamStateHandle, rows: int | None = None,
                 expired_rows: int | None = None) -> "KeyedStateChain":
        return KeyedStateChain(self.key_groups, self.full_snapshot, (*self.changes, change),
                               rows, expired_rows)

    @property
    def handles(self) -> tuple[StreamStateHandle, ...]:
        first = () if self.full_snapshot is None else (self.full_snapshot,)
        return (*first, *self.changes)

    def to_subtask_state(self) -> OperatorSubtaskState:
        properties = {
            _P_FORMAT: CHAIN_FORMAT,
            _P_KEY_GROUPS: str(self.key_groups),
            _P_FULL_SNAPSHOT: "true" if self.full_snapshot is not None else "false",
        }
        if self.rows is not None:
            properties[_P_ROWS] = str(self.rows)
        if self.expired_rows is not None:
            properties[_P_EXPIRED_ROWS] = str(self.expired_rows)
        return OperatorSubtaskState(self.handles, properties)

    @classmethod
    def from_subtask_state(cls, state: OperatorSubtaskState, where: str) -> "KeyedStateChain":
        properties = state.properties
        if properties.get(_P_FORMAT) != CHAIN_FORMAT:
            raise KeyedStateFormatError(
                f"{where}: not keyed state of format {CHAIN_FORMAT} (properties {properties})")
        snapshotted = properties.get(_P_FULL_SNAPSHOT)
        if snapshotted not in ("true", "false") or (snapshotted == "true"
                                                      and not state.handles):
            raise KeyedStateFormatError(f"{where}: invalid {_P_FULL_SNAPSHOT}={snapshotted!r}")
        try:
            key_groups = KeyGroupRange.parse(properties.get(_P_KEY_GROUPS, ""))
        except ValueError as exc:
            raise KeyedStateFormatError(f"{where}: {exc}") from exc
        rows, expired = (_count_property(properties, name, where)
                         for name in (_P_ROWS, _P_EXPIRED_ROWS))
        if snapshotted == "true":
            return cls(key_groups, state.handles[0], state.handles[1:], rows, expired)
        return cls(key_groups, None, state.handles, rows, expired)


def _count_property(properties: dict, name: str, where: str) -> int | None:
    """A row count recorded as a subtask property; None when it was not recorded."""
    if name not in properties:
        return None
    try:
        return int(properties[name])
    except ValueError as exc:
        raise KeyedStateFormatError(f"{where}: invalid {name}={properties[name]!r}") from exc


def chains_to_operator_state(operator_id: str, max_parallelism: int,
                             chains: Sequence[KeyedStateChain]) -> OperatorState:
    """The `_metadata` entry of a keyed stage: subtask ``i`` holds chain ``i``, whose range must
    be Flink's range for operator index ``i`` at parallelism ``len(chains)``."""
    parallelism = len(chains)
    for index, chain in enumerate(chains):
        expected = compute_key_group_range_for_operator_index(max_parallelism, parallelism, index)
        if chain.key_groups != expected:
            raise ValueError(f"keyed stage {operator_id}: chain {index} covers key groups "
                             f"{chain.key_groups}, but subtask {index} of {parallelism} owns "
                             f"{expected}")
    return OperatorState(operator_id, parallelism, max_parallelism,
                         {i: chain.to_subtask_state() for i, chain in enumerate(chains)})


def chains_from_operator_state(state: OperatorState) -> list[KeyedStateChain]:
    """The chains of a keyed stage's `_metadata` entry, by subtask."""
    if state.max_parallelism is None:
        raise KeyedStateFormatError(f"operator {state.operator_id}: keyed state needs its "
                                    "max_parallelism recorded in _metadata")
    chains = []
    for index in range(state.parallelism):
        subtask = state.subtask_states.get(index)
        where = f"operator {state.operator_id} subtask {index}"
        if subtask is None:
            raise KeyedStateFormatError(f"{where}: no keyed state chain")
        chains.append(KeyedStateChain.from_subtask_state(subtask, where))
    return chains


KEYED_STATE_PREFIX = "keyed-state/"
"""Master state ``keyed-state/<stage>``: a keyed stage's layout (key, key hash, max
parallelism, expiry) and its event-time clock, as JSON. With ``state-schema/<stage>`` (the
state schema, Arrow IPC) and ``state-format/<stage>`` (``CHAIN_FORMAT``) a reader needs
nothing but the snapshot to decode the stage's state."""


def encode_keyed_master_state(layout: KeyedStateLayout, clock: dt.datetime | None) -> bytes:
    """``keyed-state/<stage>``: the layout, and ``clock``: the newest event time the stage
    has seen (event-time expiry; None otherwise)."""
    ttl = None if layout.ttl is None else {
        "seconds": layout.ttl.ttl.total_seconds(),
        "time_characteristic": layout.ttl.time_characteristic.value,
        "timestamp_column": layout.ttl.timestamp_column,
    }
    return json.dumps({
        "format": CHAIN_FORMAT, "key": list(layout.key), "key_hash": layout.key_hash,
        "max_parallelism": layout.max_parallelism, "ttl": ttl,
        "clock": None if clock is None else clock.astimezone(dt.UTC).isoformat(),
        # written only with timers: the description of a stage without stays as it was
        **({"timers": True} if layout.timers else {}),
        **({"time_mode": layout.time_mode} if layout.timers and layout.time_mode else {}),
    }, sort_keys=True).encode()


def decode_keyed_master_state(data: bytes, state_schema: pa.Schema, where: str
                              ) -> tuple[KeyedStateLayout, dt.datetime | None]:
    """The layout and clock ``encode_keyed_master_state`` recorded; ``KeyedStateFormatError``
    naming ``where`` when they are malformed, of another format or another key hash."""
    try:
        raw = json.loads(data)
        if raw["format"] != CHAIN_FORMAT:
            raise KeyedStateFormatError(f"{where}: keyed state of format {raw['format']!r}, "
                                        f"this version reads {CHAIN_FORMAT}")
        ttl = None if raw["ttl"] is None else StateTtl(
            dt.timedelta(seconds=float(raw["ttl"]["seconds"])),
            TtlTimeCharacteristic(raw["ttl"]["time_characteristic"]),
            raw["ttl"]["timestamp_column"])
        layout = KeyedStateLayout(tuple(raw["key"]), state_schema, int(raw["max_parallelism"]),
                                  ttl, bool(raw.get("timers", False)), raw.get("time_mode"))
        clock = None if raw["clock"] is None else dt.datetime.fromisoformat(raw["clock"])
    except KeyedStateFormatError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise KeyedStateFormatError(f"{where}: malformed keyed state description "
                                    f"{data[:200]!r}: {exc}") from exc
    if raw["key_hash"] != layout.key_hash:
        raise KeyedStateFormatError(f"{where}: keys were hashed with {raw['key_hash']!r}, this "
                                    f"version hashes with {layout.key_hash!r}")
    return layout, clock


# --- files -----------------------------------------------------------------------------------

def _file_schema(layout: KeyedStateLayout, kind: str, key_groups: KeyGroupRange) -> pa.Schema:
    fields = [field if field.name in layout.key else field.with_nullable(True)
              for field in layout.stored_schema]
    fields.append(pa.field(KEY_GROUP, pa.int16(), nullable=False))
    if kind == _CHANGE:
        fields.append(pa.field(DELETED, pa.bool_(), nullable=False))
    return pa.schema(fields, metadata={_META_KEY: json.dumps(_identity(layout, kind,
                                                                          key_groups))})


def _identity(layout: KeyedStateLayout, kind: str, key_groups: KeyGroupRange) -> dict:
    return {"kind": kind, "format": CHAIN_FORMAT, "key": list(layout.key),
            "key_hash": layout.key_hash, "max_parallelism": layout.max_parallelism,
            "key_groups": str(key_groups)}


def _write(factory: CheckpointStreamFactory, schema: pa.Schema,
           batches: Iterable[pa.RecordBatch | pa.Table], name_prefix: str) -> StreamStateHandle:
    stream = factory.create_checkpoint_state_output_stream(CheckpointedStateScope.SHARED,
                                                           name_prefix)
    return write_parquet_state(stream, schema, batches, _PARQUET_OPTIONS, _ROW_GROUP_ROWS)[0]


def write_change_file(factory: CheckpointStreamFactory, layout: KeyedStateLayout,
                      key_groups: KeyGroupRange, upserts: pa.Table, deletes: pa.Table,
                      name_prefix: str = "", *,
                      upsert_hashes: np.ndarray | None = None) -> StreamStateHandle:
    """Write one batch's ``upserts`` (stored rows) and ``deletes`` (key columns) of one key
    group range as a SHARED-scope change file; returns its handle (inline when small).
    ``upsert_hashes``: the upserts' key hashes (``hash_keys``) when the caller has them (a
    batch's task: not computed again)."""
    upserts = layout.conform(upserts, "change file upserts")
    deletes = layout.conform_keys(deletes, "change file deletes")
    schema = _file_schema(layout, _CHANGE, key_groups)
    parts, hashes, key_groups_of_rows = [], [], []
    for rows, deleted, known in ((upserts, False, upsert_hashes), (deletes, True, None)):
        if known is None:
            known = hash_keys(rows, layout.key)
        elif len(known) != rows.num_rows:
            raise ValueError(f"change file of key groups {key_groups}: {len(known)} key hashes "
                             f"for {rows.num_rows} upserts")
        hashes.append(known)
        groups = (hashes[-1] % np.uint64(layout.max_parallelism)).astype(np.int16)
        key_groups_of_rows.append(groups)
        outside = (groups < key_groups.start) | (groups > key_groups.end)
        if outside.any():
            raise ValueError(f"change file of key groups {key_groups}: {int(outside.sum())} "
                             f"row(s) belong to other key groups, e.g. {int(groups[outside][0])}")
        columns = {f.name: rows.column(f.name) if f.name in rows.column_names
                   else pa.nulls(rows.num_rows, f.type) for f in schema
                   if f.name not in (KEY_GROUP, DELETED)}
        columns[KEY_GROUP] = pa.array(groups, pa.int16())
        columns[DELETED] = pa.repeat(deleted, rows.num_rows)
        parts.append(pa.table(columns, schema=schema))
    del upserts, deletes
    # sorted by key group (readers of part of the range skip row groups, and the key group
    # column compresses to almost nothing), then by key hash: a full snapshot's order, so
    # a first load is a store's segment as it is read
    return _write(factory, schema, _row_groups_in_order(
        parts, np.concatenate(key_groups_of_rows), np.concatenate(hashes)), name_prefix)


def _row_groups_in_order(parts: list[pa.Table], groups: np.ndarray,
                         hashes: np.ndarray) -> Iterator[pa.Table]:
    """The rows of ``parts`` (their key ``groups`` and ``hashes``, concatenated) in (key group,
    hash) order, a row group at a time: the file a sorted copy of them wrote, without that
    copy (a range's first batch of 2M keys at 4M: +110 MiB a worker, beside the upserts).
    Rows already in order (a batch's task sorts its upserts once: ``_executor``) are sliced
    as they are; others are taken a row group at a time from each part."""
    if in_group_hash_order(groups, hashes):
        table = pa.concat_tables(parts)
        for start in range(0, table.num_rows, _ROW_GROUP_ROWS):
            yield table.slice(start, _ROW_GROUP_ROWS)
        return
    order = group_hash_order(groups, hashes)
    del groups, hashes
    # a take of one chunk: no concatenation of the chunks at every row group
    parts = [part.combine_chunks() for part in parts if part.num_rows]
    bounds = np.cumsum([0, *(part.num_rows for part in parts)])
    for start in range(0, len(order), _ROW_GROUP_ROWS):
        window = order[start:start + _ROW_GROUP_ROWS]
        if len(parts) == 1:
            yield parts[0].take(pa.array(window))
            continue
        source = np.searchsorted(bounds, window, side="right") - 1
        # each part's rows of the window, then the window's order over them
        places = np.argsort(source, kind="stable")
        pieces = [part.take(pa.array(window[places[source[places] == i]] - bounds[i]))
                  for i, part in enumerate(parts)]
        rank = np.empty(len(window), np.int64)
        rank[places] = np.arange(len(window))
        yield pa.concat_tables(pieces).take(pa.array(rank))


def write_full_snapshot(factory: CheckpointStreamFactory, layout: KeyedStateLayout,
                          key_groups: KeyGroupRange, batches: Iterable[pa.RecordBatch],
                          name_prefix: str = "") -> StreamStateHandle:
    """Write the whole state of a key group range as a SHARED-scope full snapshot:
    ``batches`` of stored rows with ``_key_group``, sorted by key group, as
    ``KeyedStateStore.sorted_batches`` yields them (checked as they stream)."""
    schema = _file_schema(layout, _FULL_SNAPSHOT, key_groups)
    return _write(factory, schema, _checked_sorted(batches, key_groups), name_prefix)


def _checked_sorted(batches: Iterable[pa.RecordBatch], key_groups: KeyGroupRange):
    previous = key_groups.start
    for batch in batches:
        if not batch.num_rows:
            continue
        if KEY_GROUP not in batch.schema.names:
            raise ValueError(f"full snapshot of key groups {key_groups}: rows need a "
                             f"{KEY_GROUP} column (use KeyedStateStore.sorted_batches)")
        groups = batch.column(KEY_GROUP).to_numpy()
        if groups[0] < previous or (np.diff(groups) < 0).any() or groups[-1] > key_groups.end:
            raise ValueError(f"full snapshot of key groups {key_groups}: rows must be sorted "
                             "by key group and inside the range (use "
                             "KeyedStateStore.sorted_batches)")
        previous = int(groups[-1])
        yield batch


ReadBytes = Callable[[StreamStateHandle], bytes]
"""Reads a handle's bytes whole, verified; raises the caller's own errors (the state reader
maps a missing or corrupt file to its exceptions, naming the stage)."""


_SPILL_CHUNK = 8 << 20


def _verified_bytes(handle: StreamStateHandle, what: str,
                    spill_directory: Path | None = None) -> "bytes | mmap.mmap":
    """The handle's bytes, read whole and verified (its size and CRC-32); with
    ``spill_directory``, written as they are read to an unnamed temporary file there (a crash
    leaves nothing) and memory-mapped, so that they are resident only as far as they are read
    (``_OpenedFile.drop_read_pages``), not held whole in memory."""
    try:
        with handle.open() as f:
            if spill_directory is None:
                return f.read()  # verifies the handle's size and CRC-32
            with tempfile.TemporaryFile(dir=spill_directory) as file:
                while chunk := f.read(_SPILL_CHUNK):  # verified at the last one
                    file.write(chunk)
                file.flush()
                # (the map keeps the unnamed file's pages once it is closed)
                return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if file.tell() \
                    else b""
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{what} is missing: {exc}") from exc
    except (OSError, ValueError) as exc:
        raise KeyedStateFormatError(f"{what} is unreadable ({type(exc).__name__}: {exc}); "
                                    "restore from an earlier checkpoint or a savepoint") from exc


def _read(handle: StreamStateHandle, layout: KeyedStateLayout, kind: str,
          key_groups: KeyGroupRange, wanted: KeyGroupRange | None,
          read_bytes: ReadBytes | None = None, *, use_threads: bool = True) -> pa.Table:
    parts = list(_read_row_groups(handle, layout, kind, key_groups, wanted, read_bytes,
                                  whole=True, use_threads=use_threads))
    return parts[0] if len(parts) == 1 else concat_as(
        _file_schema(layout, kind, key_groups), parts)


def _read_row_groups(handle: StreamStateHandle, layout: KeyedStateLayout, kind: str,
                     key_groups: KeyGroupRange, wanted: KeyGroupRange | None,
                     read_bytes: ReadBytes | None = None, *, whole: bool = False,
                     use_threads: bool = True) -> Iterator[pa.Table]:
    """The rows of a keyed state file (of ``wanted`` key groups only, if given), one Parquet
    row group (``_ROW_GROUP_ROWS`` rows) at a time; ``whole``: in one table (``use_threads``:
    see ``read_parquet``). The file's bytes
    are read and verified whole first (they are compressed: a fraction of the rows'
    size), its identity checked before any row is yielded."""
    yield from _open(handle, layout, kind, key_groups, wanted, read_bytes).tables(
        whole=whole, use_threads=use_threads)


@dataclass(frozen=True)
class _OpenedFile:
    """A keyed state file whose bytes are verified and whose identity is checked, not decoded
    yet: its ``rows`` (of the row groups ``wanted`` needs) are known from its metadata."""

    parquet: pq.ParquetFile
    layout: KeyedStateLayout
    schema: pa.Schema
    columns: list[str]
    row_groups: list[int]
    wanted: KeyGroupRange | None  # None: the file's whole range
    what: str
    mapped: mmap.mmap | None = None  # its bytes, when read into a mapped temporary file

    def drop_read_pages(self) -> None:
        """Hand back the mapped pages of its bytes that reading touched (``MADV_DONTNEED``:
        a later read maps them again from the page cache); nothing when not mapped."""
        if self.mapped is not None:
            self.mapped.madvise(mmap.MADV_DONTNEED)

    @property
    def rows(self) -> int:
        return sum(self.parquet.metadata.row_group(i).num_rows for i in self.row_groups)

    def row_groups_in_order(self) -> bool:
        """Whether each row group read holds no key group below the one before's (their
        statistics say so): the file's rows are in key group order between row groups."""
        if len(self.row_groups) < 2:
            return True
        column = next(i for i in range(self.parquet.metadata.num_columns)
                      if self.parquet.schema.column(i).path == KEY_GROUP)
        previous = None
        for index in self.row_groups:
            statistics = self.parquet.metadata.row_group(index).column(column).statistics
            if statistics is None or not statistics.has_min_max:
                return False
            if previous is not None and statistics.min < previous:
                return False
            previous = statistics.max
        return True

    def tables(self, *, whole: bool = False, use_threads: bool = True) -> Iterator[pa.Table]:
        """Its rows (of ``wanted`` key groups), a row group at a time or ``whole``."""
        groups_of_parts = [self.row_groups] if whole or not self.row_groups else [
            [g] for g in self.row_groups]
        for part in groups_of_parts:
            try:
                table = read_parquet(self.parquet, self.columns, part, use_threads=use_threads)
                table = evolve_table(table, self.schema, self.layout.renamed,
                                     self.layout.defaults, self.what)
            except (pa.ArrowException, ValueError) as exc:
                raise KeyedStateFormatError(f"{self.what} is unreadable ({exc}); restore from "
                                            "an earlier checkpoint or a savepoint") from exc
            if self.wanted is not None:
                groups = table.column(KEY_GROUP)
                table = table.filter(pc.and_(pc.greater_equal(groups, self.wanted.start),
                                             pc.less_equal(groups, self.wanted.end)))
            yield table


def _open(handle: StreamStateHandle, layout: KeyedStateLayout, kind: str,
          key_groups: KeyGroupRange, wanted: KeyGroupRange | None,
          read_bytes: ReadBytes | None = None, *,
          spill_directory: Path | None = None) -> _OpenedFile:
    """A keyed state file of ``kind`` and ``key_groups``, its bytes read and verified whole
    (``read_bytes``, default the handle's ``open()``; ``spill_directory``: into a mapped
    temporary file there, ``_verified_bytes``) and its identity checked."""
    what = f"keyed state {kind} file {_describe(handle)}"
    data = _verified_bytes(handle, what, spill_directory) if read_bytes is None else \
        read_bytes(handle)
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
        metadata = parquet.schema_arrow.metadata or {}
        identity = json.loads(metadata[_META_KEY]) if _META_KEY in metadata else None
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise KeyedStateFormatError(f"{what} is unreadable ({type(exc).__name__}: {exc}); "
                                    "restore from an earlier checkpoint or a savepoint") from exc
    expected = _identity(layout, kind, key_groups)
    if identity != expected:
        raise KeyedStateFormatError(f"{what} is not the {kind} of this stage's key groups "
                                    f"{key_groups}: it says {identity}, expected {expected}")
    schema = _file_schema(layout, kind, key_groups)
    narrower = wanted is not None and wanted != key_groups
    # A file written under an older state schema is converted as it is read (renamed,
    # added, dropped, widened columns: docs/pipelines.md, "Upgrading a pipeline").
    present = parquet.schema_arrow.names
    columns = [n for n in present if n in schema.names or n in layout.renamed]
    try:
        row_groups = (_row_groups_of(parquet, wanted) if narrower
                      else list(range(parquet.metadata.num_row_groups)))
    except (pa.ArrowException, ValueError) as exc:
        raise KeyedStateFormatError(f"{what} is unreadable ({exc}); restore from an earlier "
                                    "checkpoint or a savepoint") from exc
    return _OpenedFile(parquet, layout, schema, columns, row_groups,
                       wanted if narrower else None, what,
                       data if isinstance(data, mmap.mmap) else None)


def _row_groups_of(parquet: pq.ParquetFile, wanted: KeyGroupRange) -> list[int]:
    """The row groups that may hold rows of ``wanted`` key groups, by their statistics (the
    files are sorted by key group, so a narrower range reads only its part)."""
    # A Parquet column index counts leaf columns (a struct's fields, a list's items), not
    # Arrow fields: found by path, so a state of nested columns reads the right statistics.
    column = next(i for i in range(parquet.metadata.num_columns)
                  if parquet.schema.column(i).path == KEY_GROUP)
    chosen = []
    for index in range(parquet.metadata.num_row_groups):
        statistics = parquet.metadata.row_group(index).column(column).statistics
        if statistics is None or not statistics.has_min_max or (
                statistics.min <= wanted.end and statistics.max >= wanted.start):
            chosen.append(index)
    return chosen


def read_change_file(handle: StreamStateHandle, layout: KeyedStateLayout,
                     key_groups: KeyGroupRange, wanted: KeyGroupRange | None = None,
                     *, read_bytes: ReadBytes | None = None):
    """``(upserts, deletes)`` of a change file (the rows of ``wanted`` key groups only, if
    given): upserts as stored rows, deletes as key columns. ``read_bytes``: how to read the
    handle (default: its ``open()``, which verifies it)."""
    table = _read(handle, layout, _CHANGE, key_groups, wanted, read_bytes)
    deleted = table.column(DELETED)
    if not pc.any(deleted).as_py():  # a filter copies every row: 0.5 s for a 4M-row base
        return layout.conform(table, _describe(handle)), layout.key_schema.empty_table()
    upserts = layout.conform(table.filter(pc.invert(deleted)), _describe(handle))
    deletes = table.filter(deleted).select(list(layout.key))
    return upserts, deletes


def read_full_snapshot(handle: StreamStateHandle, layout: KeyedStateLayout,
                         key_groups: KeyGroupRange, wanted: KeyGroupRange | None = None,
                         *, read_bytes: ReadBytes | None = None) -> pa.Table:
    """The stored rows of a full snapshot (of ``wanted`` key groups only, if given).
    ``read_bytes``: how to read the handle (default: its ``open()``, which verifies it)."""
    return layout.conform(
        _read(handle, layout, _FULL_SNAPSHOT, key_groups, wanted, read_bytes),
        _describe(handle))


def replay_chains(chains: Iterable[KeyedStateChain], layout: KeyedStateLayout,
                  wanted: KeyGroupRange, *, read_bytes: ReadBytes | None = None) -> pa.Table:
    """The state of the ``wanted`` key groups from the chains that overlap them: each chain's
    full snapshot, then its change files in order (a later row for a key wins, a delete
    removes it). Rescaling is this with the new task's range: chains are disjoint, so each
    key comes from exactly one chain. ``read_bytes``: how to read a handle (default: its
    ``open()``, which verifies its size and CRC-32; a missing file is a FileNotFoundError,
    any other failure a KeyedStateFormatError, both naming the file). One table:
    ``iter_replay_chains`` yields the same rows in bounded parts."""
    parts = list(iter_replay_chains(chains, layout, wanted, read_bytes=read_bytes))
    return concat_as(layout.stored_schema, parts) if parts else \
        layout.stored_schema.empty_table()


def iter_replay_chains(chains: Iterable[KeyedStateChain], layout: KeyedStateLayout,
                       wanted: KeyGroupRange, *, read_bytes: ReadBytes | None = None
                       ) -> Iterator[pa.Table]:
    """``replay_chains``' rows (stored schema, in its order) in parts of at most one Parquet
    row group (``_ROW_GROUP_ROWS``): the base, a full snapshot or a chain's first change
    file, is read one row group at a time, its rows that later changes replaced left out;
    then the last change per key since. What it holds at once is the chain's changes (read
    whole: a key's last change may be in any file) plus one row group of the base, not the
    range's state: a replay of millions of rows (``read_keyed_state``, ``read_state``)
    stays within a worker's memory."""
    key = list(layout.key)
    for chain in chains:
        overlap = chain.key_groups.intersection(wanted)
        if not len(overlap):
            continue
        if chain.full_snapshot is not None:
            base = _read_row_groups(chain.full_snapshot, layout, _FULL_SNAPSHOT,
                                    chain.key_groups, overlap, read_bytes)
            changes_after = chain.changes
        elif chain.changes:
            # A chain that started empty: its first change file's upserts are the base (each
            # key once, its deletes no-ops): typically the bulk of the rows (a first load),
            # kept out of the last-change-per-key pass below
            base = _read_row_groups(chain.changes[0], layout, _CHANGE, chain.key_groups,
                                    overlap, read_bytes)
            changes_after = chain.changes[1:]
        else:
            continue
        latest = None
        if changes_after:
            changes = pa.concat_tables([_read(change, layout, _CHANGE, chain.key_groups,
                                              overlap, read_bytes) for change in changes_after])
            latest = changes.take(pa.array(last_per_key(changes, layout.key)))
            del changes
        for part in base:
            if DELETED in part.column_names:  # a first change file's deletes: no-ops
                part = part.filter(pc.invert(part.column(DELETED)))
            part = layout.conform(part, _describe(chain.full_snapshot or chain.changes[0]))
            if latest is not None and latest.num_rows and part.num_rows:
                # by row index: Arrow's joins carry no list columns (e.g. a stage's timers)
                rows = part.select(key).append_column("__row", pa.array(
                    np.arange(part.num_rows, dtype=np.int64)))
                part = part.take(rows.join(latest.select(key), key, join_type="left anti")
                                 .column("__row").combine_chunks().sort())
            if part.num_rows:
                yield part
        if latest is not None:
            upserts = latest.filter(pc.invert(latest.column(DELETED)))
            for offset in range(0, upserts.num_rows, _ROW_GROUP_ROWS):
                yield layout.conform(upserts.slice(offset, _ROW_GROUP_ROWS), "changes")


def key_group_mask(layout: KeyedStateLayout, table: pa.Table,
                   key_groups: KeyGroupRange) -> np.ndarray:
    """Which rows of ``table`` have keys in ``key_groups``."""
    groups = layout.key_groups_of(table)
    return (groups >= key_groups.start) & (groups <= key_groups.end)
