"""What state variables cost: compiling and decompiling them, and the change file of an append.

Usage::

    .venv/bin/python benchmarks/state_variables.py [--keys N]

A stage of a value (a count) and a list (elements of an int64 and a timestamp, event-time
TTL) per key, ``--keys`` keys (default 1M) holding lists of 10 elements:

- **decompile**: the physical rows (one per key) into the stage's view of each variable
  (``StateVariables.entries``), in keys per second;
- **compile**: every key's changes (the count set, one element appended) back into physical
  rows (``StateVariables.compile``), in keys per second;
- **change file of an append**: 1% of the keys append one element to their list of 10; the
  change file (written by ``write_change_file``, as a batch writes it) against a plain keyed
  stage's of the same keys, whose row is the count and the last element (what a stage
  without list state would rewrite).

Targets: compile and decompile at least 200 000 keys per CPU second each (wall time is
printed too: on a loaded machine it says more about the load); the append's change file at most
12x the plain row's (a key's row is rewritten with its whole list of 11 elements: the cost
docs/pipelines.md states). Figures depend on the load, printed with them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
from _common import targets_line

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from checkpoint_storage import FileSystemCheckpointStorage, JobID  # noqa: E402
from pipelines import KeyedStage, StateTtl  # noqa: E402
from pipelines.keyed import (  # noqa: E402
    KeyedStateLayout,
    KeyGroupRange,
    ListState,
    StateChanges,
    ValueState,
    write_change_file,
)

UTC = pa.timestamp("us", "UTC")
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
KEY = pa.schema([pa.field("user", pa.string(), nullable=False)])
COUNT = pa.schema([("count", pa.int64())])
EVENT = pa.schema([("n", pa.int64()), ("at", UTC)])
LIST_LENGTH = 10
MIN_KEYS_PER_SECOND = 200_000
MAX_APPEND_RATIO = 12.0
MAX_PARALLELISM = 128


@dataclass
class Row:
    backend: str
    workload: str
    figure: str
    ok: bool | None


def stage() -> KeyedStage:
    return KeyedStage.with_variables(
        "variables", KEY, [ValueState("count", COUNT),
                           ListState("events", EVENT, ttl=StateTtl(dt.timedelta(days=1),
                                                                   timestamp_column="at"))],
        lambda i, s: None, output_schema=KEY, event_time="at")


def physical_rows(keys: int) -> tuple[pa.Table, pa.Table]:
    """``keys`` keys' physical rows with lists of 10 (built through ``compile``), and their
    keys."""
    variables = stage().apply.variables
    users = pa.array([f"user-{i:08d}" for i in range(keys)], pa.string())
    times = pa.array(np.repeat(np.datetime64(NOW.replace(tzinfo=None), "us"), keys), UTC)
    elements = pa.table({"user": pa.concat_arrays([users] * LIST_LENGTH),
                         "n": pa.array(np.arange(keys * LIST_LENGTH), pa.int64()),
                         "at": pa.concat_arrays([times] * LIST_LENGTH)})
    empty = variables.state_schema.empty_table()
    entries = variables.entries(empty, NOW)
    changes = StateChanges(output=KEY.empty_table(), appends={"events": elements},
                           values={"count": pa.table({"user": users, "count": pa.array(
                               np.full(keys, LIST_LENGTH), pa.int64())})})
    upserts, _ = variables.compile(empty, entries, changes, NOW)
    return upserts, pa.table({"user": users})


def appends_of(keys: pa.Table) -> StateChanges:
    count = keys.num_rows
    times = pa.array(np.repeat(np.datetime64(NOW.replace(tzinfo=None), "us"), count), UTC)
    return StateChanges(
        output=KEY.empty_table(),
        values={"count": keys.append_column("count", pa.array(np.full(count, 11), pa.int64()))},
        appends={"events": keys.append_column("n", pa.array(np.arange(count), pa.int64()))
                 .append_column("at", times)})


def change_file_bytes(layout: KeyedStateLayout, upserts: pa.Table, root: str) -> int:
    storage = FileSystemCheckpointStorage(os.path.join(root, "checkpoints"),
                                          file_state_size_threshold=0)
    access = storage.create_checkpoint_storage(JobID.generate())
    access.initialize_base_locations()
    location = access.initialize_location_for_checkpoint(1)
    factory = access.resolve_checkpoint_storage_location(1, location.location_reference)
    handle = write_change_file(factory, layout, KeyGroupRange(0, MAX_PARALLELISM - 1),
                               upserts, layout.key_schema.empty_table())
    return handle.state_size


def rate_row(what: str, workload: str, keys: int, wall: float, cpu: float) -> Row:
    """Keys per CPU second (the target: it depends less on the load) and per wall second."""
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return Row(what, workload, f"{keys / cpu:,.0f} keys/s of CPU ({cpu:.2f} s CPU), "
               f"{keys / wall:,.0f} keys/s of wall time", keys / cpu >= MIN_KEYS_PER_SECOND)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    keys = parser.parse_args().keys
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {keys} keys, "
          f"lists of {LIST_LENGTH}")
    variables = stage().apply.variables
    physical, users = physical_rows(keys)
    rows = []

    wall, cpu = time.perf_counter(), time.process_time()
    entries = variables.entries(physical, NOW)
    rows.append(rate_row("decompile", f"{keys} keys", keys, wall, cpu))

    changes = appends_of(users)
    wall, cpu = time.perf_counter(), time.process_time()
    upserts, _ = variables.compile(physical, entries, changes, NOW)
    rows.append(rate_row("compile", f"{keys} keys append 1", keys, wall, cpu))
    assert upserts.num_rows == keys

    touched = users.slice(0, max(1, keys // 100))
    small = physical.slice(0, touched.num_rows)
    appended, _ = variables.compile(small, variables.entries(small, NOW), appends_of(touched),
                                    NOW)
    plain_schema = pa.schema([KEY.field(0), ("count", pa.int64()), ("n", pa.int64()),
                              ("at", UTC)])
    plain = pa.table({"user": touched.column("user"),
                      "count": pa.array(np.full(touched.num_rows, 11), pa.int64()),
                      "n": pa.array(np.arange(touched.num_rows), pa.int64()),
                      "at": pa.array(np.repeat(np.datetime64(NOW.replace(tzinfo=None), "us"),
                                               touched.num_rows), UTC)}, schema=plain_schema)
    with tempfile.TemporaryDirectory() as root:
        with_lists = change_file_bytes(KeyedStateLayout.of(stage(), MAX_PARALLELISM), appended,
                                       os.path.join(root, "variables"))
        plain_bytes = change_file_bytes(KeyedStateLayout(("user",), plain_schema,
                                                         MAX_PARALLELISM), plain,
                                        os.path.join(root, "plain"))
    ratio = with_lists / plain_bytes
    rows.append(Row("change file", f"{touched.num_rows} keys append 1 to 10",
                    f"{with_lists} B against {plain_bytes} B for a plain row: {ratio:.2f}x",
                    ratio <= MAX_APPEND_RATIO))

    for row in rows:
        print(f"{row.backend:12} {row.workload:28} {row.figure}  "
              f"{'ok' if row.ok else 'MISSED'}")
    print(targets_line(rows))


if __name__ == "__main__":
    main()
