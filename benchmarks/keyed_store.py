"""Local stores for keyed state, measured on the work a keyed stage's task does per batch.

Usage::

    .venv/bin/pip install -e ".[bench]"     # rocksdict and duckdb, the candidates
    .venv/bin/python benchmarks/keyed_store.py \
        [--sizes 1000000,4000000] [--rounds 3] [--batches 3]

Candidates: RocksDB (``rocksdict``, raw bytes mode), DuckDB (a table with a primary key),
SQLite (a ``WITHOUT ROWID`` table) and an Arrow store (a memory-mapped Arrow IPC segment
sorted by key hash, searched with numpy, plus an in-memory delta merged into a new segment
when it reaches 5% of the segment). Each runs in one thread, as one Spark task would.

Workload per state size S: load S keys (strings like user ids) with a state row of
(string, long, timestamp); then per batch 1% of the keys change: look up the batch's keys'
current rows as an Arrow table, upsert the changed rows, delete S/10,000 keys and insert as
many new ones. Then export the whole store as a key-sorted Parquet snapshot (full snapshot)
and rebuild a new store from that snapshot plus the batches' change files (recovery).

Printed per S and store, best of ``--rounds`` (stores interleaved in each round, in rotating
order): ms per batch (the mean over the batches, so the Arrow store's merges are amortised),
MB on disk after the batches, snapshot export seconds, rebuild seconds,
and each time's ratio to the fastest store; the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipelines.keyed import hash_keys  # noqa: E402

SCHEMA = pa.schema([("key", pa.string()), ("page", pa.string()), ("count", pa.int64()),
                    ("seen", pa.timestamp("us"))])
VALUE_COLUMNS = SCHEMA.names[1:]


def make_keys(ids: np.ndarray) -> pa.Array:
    return pc.binary_join_element_wise(
        "user_", pc.utf8_lpad(pa.array(ids).cast(pa.string()), 10, "0"), "")


def make_rows(ids: np.ndarray, rng: np.random.Generator, count: np.ndarray | None = None):
    n = len(ids)
    pages = pc.binary_join_element_wise(
        "/p/", pa.array(rng.integers(0, 50_000, n)).cast(pa.string()), "")
    return pa.table([make_keys(ids), pages,
                     pa.array(rng.integers(1, 1000, n) if count is None else count, pa.int64()),
                     pa.array(rng.integers(1_700_000_000_000_000, 1_800_000_000_000_000, n))
                     .cast(pa.timestamp("us"))], schema=SCHEMA)


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# --- RocksDB ---------------------------------------------------------------------------------
# Values: count (8 bytes), seen (8 bytes), then the page's UTF-8 bytes; encoded and decoded
# with numpy over whole batches so that Python touches only the list of bytes objects.

def encode_values(table: pa.Table) -> list[bytes]:
    n = table.num_rows
    fixed = np.empty((n, 2), dtype=np.int64)
    fixed[:, 0] = table.column("count").to_numpy()
    fixed[:, 1] = table.column("seen").cast(pa.int64()).to_numpy()
    page = table.column("page").combine_chunks()
    offsets = np.frombuffer(page.buffers()[1], np.int32)[page.offset:page.offset + n + 1]
    data = np.frombuffer(page.buffers()[2], np.uint8)
    lengths = np.diff(offsets)
    out_offsets = np.zeros(n + 1, np.int32)
    np.cumsum(lengths + 16, out=out_offsets[1:])
    out = np.empty(int(out_offsets[-1]), np.uint8)
    row_starts = out_offsets[:-1]
    out[(row_starts[:, None] + np.arange(16)).ravel()] = fixed.view(np.uint8).ravel()
    positions = np.repeat(row_starts + 16 - offsets[:-1], lengths) + np.arange(
        offsets[0], offsets[-1])
    out[positions] = data[offsets[0]:offsets[-1]]
    binary = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(out_offsets),
                                                    pa.py_buffer(out)])
    return binary.to_pylist()


def decode_values(keys: pa.Array, values: list) -> pa.Table:
    binary = pa.array(values, pa.binary())
    present = pc.is_valid(binary)
    keys, binary = keys.filter(present), binary.filter(present)
    n = len(binary)
    offsets = np.frombuffer(binary.buffers()[1], np.int32)[binary.offset:binary.offset + n + 1]
    data = np.frombuffer(binary.buffers()[2], np.uint8) if n else np.zeros(0, np.uint8)
    fixed = data[(offsets[:-1, None] + np.arange(16)).ravel()].view(np.int64).reshape(n, 2)
    lengths = np.diff(offsets) - 16
    page_offsets = np.zeros(n + 1, np.int32)
    np.cumsum(lengths, out=page_offsets[1:])
    positions = np.repeat(offsets[:-1] + 16 - page_offsets[:-1], lengths) + np.arange(
        int(page_offsets[-1]))
    page = pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(page_offsets),
                                                  pa.py_buffer(data[positions].copy())])
    return pa.table([keys, page, pa.array(fixed[:, 0]),
                     pa.array(fixed[:, 1]).cast(pa.timestamp("us"))], schema=SCHEMA)


class RocksStore:
    name = "rocksdb"

    def __init__(self, path: Path) -> None:
        from rocksdict import Options, Rdict
        options = Options(raw_mode=True)
        options.increase_parallelism(1)
        self.db = Rdict(str(path), options)

    def put(self, table: pa.Table) -> None:
        from rocksdict import WriteBatch
        for chunk in table.to_batches(1 << 17):
            t = pa.Table.from_batches([chunk])
            wb = WriteBatch(raw_mode=True)
            for k, v in zip(t.column("key").cast(pa.binary()).to_pylist(), encode_values(t),
                            strict=True):
                wb.put(k, v)
            self.db.write(wb)

    load = upsert = put

    def lookup(self, keys: pa.Array) -> pa.Table:
        return decode_values(keys, self.db.get(keys.cast(pa.binary()).to_pylist()))

    def delete(self, keys: pa.Array) -> None:
        from rocksdict import WriteBatch
        wb = WriteBatch(raw_mode=True)
        for k in keys.cast(pa.binary()).to_pylist():
            wb.delete(k)
        self.db.write(wb)

    def export(self, path: Path) -> None:
        writer = pq.ParquetWriter(path, SCHEMA)
        keys, values = [], []
        for k, v in self.db.items():
            keys.append(k)
            values.append(v)
            if len(keys) == 1 << 18:
                writer.write_table(decode_values(pa.array(keys, pa.binary()).cast(pa.string()),
                                                 values))
                keys, values = [], []
        if keys:
            writer.write_table(decode_values(pa.array(keys, pa.binary()).cast(pa.string()),
                                             values))
        writer.close()

    def flush(self) -> None:
        self.db.flush()

    def close(self) -> None:
        self.db.close()


# --- DuckDB ----------------------------------------------------------------------------------

class DuckStore:
    name = "duckdb"

    def __init__(self, path: Path) -> None:
        import duckdb
        path.mkdir()
        self.db = duckdb.connect(str(path / "state.duckdb"))
        self.db.execute("SET threads = 1")
        self.db.execute("CREATE TABLE state (key VARCHAR PRIMARY KEY, page VARCHAR, "
                        "count BIGINT, seen TIMESTAMP)")

    def load(self, table: pa.Table) -> None:
        self.db.register("incoming", table)
        self.db.execute("INSERT INTO state SELECT * FROM incoming")
        self.db.unregister("incoming")

    def upsert(self, table: pa.Table) -> None:
        self.db.register("incoming", table)
        self.db.execute("INSERT OR REPLACE INTO state SELECT * FROM incoming")
        self.db.unregister("incoming")

    def lookup(self, keys: pa.Array) -> pa.Table:
        self.db.register("wanted", pa.table({"key": keys}))
        result = self.db.sql(
            "SELECT s.* FROM state s JOIN wanted w ON s.key = w.key").to_arrow_table()
        self.db.unregister("wanted")
        return result

    def delete(self, keys: pa.Array) -> None:
        self.db.register("doomed", pa.table({"key": keys}))
        self.db.execute("DELETE FROM state WHERE key IN (SELECT key FROM doomed)")
        self.db.unregister("doomed")

    def export(self, path: Path) -> None:
        self.db.execute(f"COPY (SELECT * FROM state ORDER BY key) TO '{path}' (FORMAT parquet)")

    def flush(self) -> None:
        self.db.execute("CHECKPOINT")

    def close(self) -> None:
        self.db.close()


# --- SQLite ----------------------------------------------------------------------------------

class SqliteStore:
    name = "sqlite"

    def __init__(self, path: Path) -> None:
        path.mkdir()
        self.db = sqlite3.connect(path / "state.sqlite")
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute("PRAGMA synchronous = NORMAL")
        self.db.execute("CREATE TABLE state (key TEXT PRIMARY KEY, page TEXT, count INTEGER, "
                        "seen INTEGER) WITHOUT ROWID")

    def _rows(self, table: pa.Table):
        return zip(table.column("key").to_pylist(), table.column("page").to_pylist(),
                   table.column("count").to_pylist(),
                   table.column("seen").cast(pa.int64()).to_pylist(), strict=True)

    def upsert(self, table: pa.Table) -> None:
        with self.db:
            self.db.executemany("INSERT OR REPLACE INTO state VALUES (?, ?, ?, ?)",
                                self._rows(table))

    load = upsert

    def lookup(self, keys: pa.Array) -> pa.Table:
        with self.db:
            self.db.execute("CREATE TEMP TABLE IF NOT EXISTS wanted (key TEXT PRIMARY KEY)")
            self.db.execute("DELETE FROM wanted")
            self.db.executemany("INSERT INTO wanted VALUES (?)", ((k,) for k in keys.to_pylist()))
            rows = self.db.execute(
                "SELECT s.* FROM state s JOIN wanted w ON s.key = w.key").fetchall()
        return self._table(rows)

    def _table(self, rows) -> pa.Table:
        columns = list(zip(*rows, strict=True)) if rows else [[], [], [], []]
        return pa.table([pa.array(columns[0], pa.string()), pa.array(columns[1], pa.string()),
                         pa.array(columns[2], pa.int64()),
                         pa.array(columns[3], pa.int64()).cast(pa.timestamp("us"))],
                        schema=SCHEMA)

    def delete(self, keys: pa.Array) -> None:
        with self.db:
            self.db.executemany("DELETE FROM state WHERE key = ?", ((k,) for k in keys.to_pylist()))

    def export(self, path: Path) -> None:
        writer = pq.ParquetWriter(path, SCHEMA)
        cursor = self.db.execute("SELECT * FROM state ORDER BY key")
        while rows := cursor.fetchmany(1 << 18):
            writer.write_table(self._table(rows))
        writer.close()

    def flush(self) -> None:
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        self.db.close()


# --- Arrow -----------------------------------------------------------------------------------

class ArrowStore:
    """A segment (Arrow IPC file, memory-mapped, sorted by key hash) plus a delta table holding
    the latest upsert or delete (``_deleted``) per key since the segment was written."""

    name = "arrow"
    MERGE_RATIO = 0.05

    def __init__(self, path: Path) -> None:
        path.mkdir()
        self.path = path
        self.generation = 0
        self.segment = pa.table({**{n: pa.array([], SCHEMA.field(n).type) for n in SCHEMA.names},
                                 "_hash": pa.array([], pa.uint64())})
        self.hashes = np.zeros(0, np.uint64)
        self.delta = self._empty_delta()

    def _empty_delta(self) -> pa.Table:
        return pa.table({**{n: pa.array([], SCHEMA.field(n).type) for n in SCHEMA.names},
                         "_deleted": pa.array([], pa.bool_())})

    def _write_segment(self, table: pa.Table) -> None:
        table = table.append_column("_hash", pa.array(hash_keys(table, ("key",))))
        table = table.sort_by("_hash")
        self.generation += 1
        target = self.path / f"segment-{self.generation}.arrow"
        with ipc.new_file(target, table.schema) as writer:
            writer.write_table(table, max_chunksize=1 << 20)
        for old in self.path.glob("segment-*.arrow"):
            if old != target:
                old.unlink()
        self.segment = ipc.open_file(pa.memory_map(str(target))).read_all()
        self.hashes = self.segment.column("_hash").to_numpy()  # zero-copy over the mapping

    def load(self, table: pa.Table) -> None:
        self._write_segment(pa.concat_tables([self.snapshotted(), table]))

    def _segment_rows(self, keys: pa.Array) -> pa.Table:
        h = hash_keys(pa.table({"key": keys}), ("key",))
        at = np.searchsorted(self.hashes, h)
        hit = at < len(self.hashes)
        hit[hit] = self.hashes[at[hit]] == h[hit]
        rows = self.segment.take(pa.array(at[hit])).drop_columns(["_hash"])
        same = pc.equal(rows.column("key"), keys.filter(pa.array(hit)))
        # 64-bit hash collisions are (astronomically) rare: found rows with another key drop
        return rows.filter(same)

    def lookup(self, keys: pa.Array) -> pa.Table:
        in_delta = pc.is_in(keys, value_set=self.delta.column("key"))
        from_segment = self._segment_rows(keys.filter(pc.invert(in_delta)))
        delta = self.delta.filter(pc.is_in(self.delta.column("key"), value_set=keys))
        delta = delta.filter(pc.invert(delta.column("_deleted"))).drop_columns(["_deleted"])
        return pa.concat_tables([from_segment, delta])

    def _change(self, table: pa.Table) -> None:
        keep = pc.invert(pc.is_in(self.delta.column("key"), value_set=table.column("key")))
        self.delta = pa.concat_tables([self.delta.filter(keep), table]).combine_chunks()
        if self.delta.num_rows > self.MERGE_RATIO * max(self.segment.num_rows, 1):
            self._write_segment(self.snapshotted())
            self.delta = self._empty_delta()

    def upsert(self, table: pa.Table) -> None:
        self._change(table.append_column("_deleted", pa.repeat(False, table.num_rows)))

    def delete(self, keys: pa.Array) -> None:
        n = len(keys)
        table = pa.table([keys, pa.nulls(n, pa.string()), pa.nulls(n, pa.int64()),
                          pa.nulls(n, pa.timestamp("us"))], schema=SCHEMA)
        self._change(table.append_column("_deleted", pa.repeat(True, n)))

    def snapshotted(self) -> pa.Table:
        changed = pc.is_in(self.segment.column("key"), value_set=self.delta.column("key"))
        kept = self.segment.filter(pc.invert(changed)).drop_columns(["_hash"])
        delta = self.delta.filter(pc.invert(self.delta.column("_deleted")))
        return pa.concat_tables([kept, delta.drop_columns(["_deleted"])])

    def export(self, path: Path) -> None:
        pq.write_table(self.snapshotted().sort_by("key"), path)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.segment = None


class CoreArrowStore:
    """The project's ``pipelines.keyed.ArrowKeyedStateStore`` (the Arrow store above, with
    any key and schema, crash-safe manifest, joins for the delta); its snapshot is sorted by
    key group, then key hash (the full snapshot order)."""

    name = "arrow-core"
    sorts_by_key = False

    def __init__(self, path: Path) -> None:
        from pipelines.keyed import ArrowKeyedStateStore, KeyedStateLayout, KeyGroupRange
        self.store = ArrowKeyedStateStore(path, KeyedStateLayout(("key",), SCHEMA, 128),
                                          KeyGroupRange(0, 127))
        self.no_keys = pa.table({"key": pa.array([], pa.string())})

    def load(self, table: pa.Table) -> None:
        self.store.apply(table, self.no_keys)

    upsert = load

    def lookup(self, keys: pa.Array) -> pa.Table:
        return self.store.get(pa.table({"key": keys}))

    def delete(self, keys: pa.Array) -> None:
        self.store.apply(SCHEMA.empty_table(), pa.table({"key": keys}))

    def export(self, path: Path) -> None:
        batches = self.store.sorted_batches()
        first = next(batches)
        with pq.ParquetWriter(path, first.schema) as writer:
            writer.write_batch(first)
            for batch in batches:
                writer.write_batch(batch)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.store.close()


STORES = (RocksStore, DuckStore, SqliteStore, ArrowStore, CoreArrowStore)


def rebuild(store_class, directory: Path, snapshot: Path, changes: list[tuple[Path, Path]]):
    store = store_class(directory)
    store.load(pq.read_table(snapshot))  # whole: each store loads in its own way
    for upserts, deletes in changes:
        store.upsert(pq.read_table(upserts))
        store.delete(pq.read_table(deletes).column("key").combine_chunks())
    store.flush()
    return store


def run_one(store_class, size: int, batches: int, work: Path, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    ids = rng.permutation(size * 2)[:size]  # live ids; new ones come from the unused half
    spare = list(np.setdiff1d(np.arange(size * 2), ids)[: batches * size])
    initial = make_rows(ids, rng)
    directory = work / store_class.name
    store = store_class(directory)
    started = time.perf_counter()
    store.load(initial)
    store.flush()
    load_s = time.perf_counter() - started
    live = np.array(ids)
    changes, batch_times = [], []
    for b in range(batches):
        changed = rng.choice(live, size // 100, replace=False)
        n_delete = max(size // 10_000, 1)
        doomed_ids, new_ids = changed[:n_delete], np.array(spare[:n_delete])
        spare = spare[n_delete:]
        batch_keys = make_keys(changed)
        started = time.perf_counter()
        current = store.lookup(batch_keys)
        assert current.num_rows == len(changed), (store_class.name, current.num_rows)
        updated = pa.table([current.column("key"), current.column("page"),
                            pc.add(current.column("count"), 1), current.column("seen")],
                           schema=SCHEMA)
        upserts = pa.concat_tables([updated, make_rows(new_ids, rng)])
        doomed = make_keys(doomed_ids)
        store.upsert(upserts)
        store.delete(doomed)
        batch_times.append(time.perf_counter() - started)
        live = np.concatenate([np.setdiff1d(live, doomed_ids), new_ids])
        change = (work / f"upserts-{b}.parquet", work / f"deletes-{b}.parquet")
        pq.write_table(upserts, change[0])
        pq.write_table(pa.table({"key": doomed}), change[1])
        changes.append(change)
    store.flush()
    disk = dir_size(directory)
    snapshot = work / "snapshot.parquet"
    started = time.perf_counter()
    store.export(snapshot)
    export_s = time.perf_counter() - started
    exported = pq.read_table(snapshot)
    assert exported.num_rows == len(live), (store_class.name, exported.num_rows, len(live))
    if getattr(store_class, "sorts_by_key", True):
        keys = exported.column("key")
        assert pc.all(pc.less(keys.slice(0, len(keys) - 1), keys.slice(1))).as_py()
    store.close()
    # recovery from the full snapshot before the batches plus their change files
    base = work / "base.parquet"
    pq.write_table(initial.sort_by("key"), base)
    started = time.perf_counter()
    rebuilt = rebuild(store_class, work / f"{store_class.name}-rebuilt", base, changes)
    rebuild_s = time.perf_counter() - started
    probe = make_keys(rng.choice(live, 1000, replace=False))
    assert rebuilt.lookup(probe).num_rows == 1000
    rebuilt.close()
    return {"load_s": load_s, "batch_ms": 1000 * sum(batch_times) / len(batch_times),
            "disk_mb": disk / 1e6, "export_s": export_s, "rebuild_s": rebuild_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000000,4000000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--stores", default=",".join(s.name for s in STORES))
    args = parser.parse_args()
    stores = [s for s in STORES if s.name in args.stores.split(",")]
    load_before = os.getloadavg()
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}"
          f" ({os.cpu_count()} cores)", flush=True)
    for size in (int(s) for s in args.sizes.split(",")):
        best: dict[str, dict] = {}
        for r in range(args.rounds):
            order = stores[r % len(stores):] + stores[: r % len(stores)]
            for store_class in order:
                work = Path(tempfile.mkdtemp(prefix="keyed-store-"))
                try:
                    result = run_one(store_class, size, args.batches, work, seed=r)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                mine = best.setdefault(store_class.name, result)
                for field, value in result.items():
                    mine[field] = min(mine[field], value)
                print(f"  S={size:,} round {r + 1} {store_class.name}: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in result.items())
                      + f" (load {os.getloadavg()[0]:.2f})", flush=True)
        fastest = {f: min(b[f] for b in best.values()) for f in ("batch_ms", "export_s",
                                                                    "rebuild_s", "load_s")}
        print(f"\nS = {size:,} keys, 1% changed per batch, best of {args.rounds}")
        print("| store | ms/batch | MB on disk | load s | export s | rebuild s | "
              "batch ratio | export ratio | rebuild ratio |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, b in best.items():
            print(f"| {name} | {b['batch_ms']:.0f} | {b['disk_mb']:.0f} | {b['load_s']:.2f} | "
                  f"{b['export_s']:.2f} | {b['rebuild_s']:.2f} | "
                  f"{b['batch_ms'] / fastest['batch_ms']:.1f}x | "
                  f"{b['export_s'] / fastest['export_s']:.1f}x | "
                  f"{b['rebuild_s'] / fastest['rebuild_s']:.1f}x |", flush=True)
        print()
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")


if __name__ == "__main__":
    main()
