"""Timers, watermark and allowed lateness of keyed stages (issue 27 items 1 and 2).

The property tests run a batch as Spark runs it, range by range, through the executors' own
functions (routing, ``_run_partition``, full snapshots) on a real checkpoint storage and real
local stores, against a dict model: many examples in seconds. A few examples then run on
real Spark (local[2]) through ``apply_keyed_batch``.
"""

import datetime as dt
import shutil
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark import cloudpickle

from checkpoint_storage import FileSystemCheckpointStorage, JobID
from pipelines.keyed import (
    KeyedResult,
    KeyedStage,
    KeyedStageTask,
    KeyedStateChain,
    KeyedStateLayout,
    KeyGroupRange,
    TimeMode,
    Watermark,
    compute_key_group_range_for_operator_index,
    extend_chains,
    replay_chains,
)
from pipelines.keyed._batch import _results, _summary
from pipelines.keyed._executor import _decode_output, _run_partition, _snapshot_ranges
from pipelines.keyed._routing import _ROUTE, OPERATOR_INDEX, _operator_indices, _routes
from pipelines.keyed._task import _newer

MAX_PARALLELISM = 8
ALL = KeyGroupRange(0, MAX_PARALLELISM - 1)
T0 = dt.datetime(2026, 3, 10, tzinfo=dt.UTC)
UTC_US = pa.timestamp("us", "UTC")
STATE = pa.schema([pa.field("k", pa.int64(), nullable=False), ("n", pa.int64())])
OUTPUT = pa.schema([("k", pa.int64()), ("timer", UTC_US), ("n", pa.int64())])
NO_KEYS = pa.table({"k": pa.array([], pa.int64())})
FOLLOW_UP = dt.timedelta(hours=1, seconds=1)


def t(minutes: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


def count_and_time(input: pa.Table, state: pa.Table) -> KeyedResult:
    """Counts each key's events (op "touch", "reg", "del"), registers a timer at ``at`` for
    "reg" rows, deletes the one at ``at`` for "del" rows; a "drop" row deletes the key's state
    (and so its timers; its other rows are ignored)."""
    dropped = input.filter(pc.equal(input.column("op"), "drop")).select(["k"])
    dropped = dropped.group_by("k").aggregate([])
    kept = input.join(dropped, "k", join_type="left anti") if dropped.num_rows else input
    counts = kept.group_by("k").aggregate([([], "count_all")])
    joined = counts.join(state, "k", join_type="left outer")
    n = pc.add(joined.column("count_all"), pc.fill_null(joined.column("n"), 0))
    upserts = pa.table({"k": joined.column("k"), "n": n})
    present = dropped.join(state.select(["k"]), "k", join_type="inner")

    def timers(op: str) -> pa.Table:
        rows = kept.filter(pc.equal(kept.column("op"), op))
        return pa.table({"k": rows.column("k"), "timer": rows.column("at")})

    return KeyedResult(upserts, present, OUTPUT.empty_table(), timers("reg"), timers("del"))


def emit_fired(fired: pa.Table, state: pa.Table) -> KeyedResult:
    """One output row per fired timer (with the key's count); a timer on a whole minute
    registers a follow-up ``FOLLOW_UP`` later (not on a whole minute: no chain)."""
    joined = fired.join(state, "k", join_type="left outer")
    seconds = pc.second(joined.column("timer"))
    again = joined.filter(pc.equal(seconds, 0))
    follow_ups = pa.table({"k": again.column("k"),
                           "timer": pc.add(again.column("timer"), pa.scalar(FOLLOW_UP))})
    return KeyedResult(STATE.empty_table(), NO_KEYS, joined.select(["k", "timer", "n"]),
                       follow_ups)


cloudpickle.register_pickle_by_value(sys.modules[__name__])


def stage(lateness: dt.timedelta | None) -> KeyedStage:
    return KeyedStage("timed", "k", STATE, count_and_time, output_schema=OUTPUT,
                      event_time="ts", time_mode=TimeMode.EVENT_TIME, on_timer=emit_fired,
                      watermark=None if lateness is None else Watermark(lateness))


INPUT = pa.schema([("k", pa.int64()), ("ts", UTC_US), ("op", pa.string()), ("at", UTC_US)])


def input_table(rows: list[tuple]) -> pa.Table:
    """(key, minutes, op, timer minutes or None) rows."""
    return pa.Table.from_pylist([{"k": k, "ts": t(m), "op": op,
                                  "at": None if at is None else t(at)}
                                 for k, m, op, at in rows], schema=INPUT)


class _Row(dict):
    def asDict(self) -> dict:  # noqa: N802 - as Spark's Row
        return dict(self)


@dataclass
class Job:
    """One stage's checkpoint storage, chains and clock; ``run`` applies a batch as Spark
    does (routing tasks, one ``_run_partition`` per range) without Spark."""

    root: Path
    stage: KeyedStage
    parallelism: int
    storage: FileSystemCheckpointStorage = field(init=False)
    chains: list[KeyedStateChain] = field(init=False)
    clock: dt.datetime | None = None
    checkpoint_id: int = 0

    def __post_init__(self) -> None:
        self.storage = FileSystemCheckpointStorage(str(self.root / "checkpoints"),
                                                   file_state_size_threshold=0)
        self.job_id = JobID.generate()
        self.access = self.storage.create_checkpoint_storage(self.job_id)
        self.access.initialize_base_locations()
        self.chains = [KeyedStateChain(compute_key_group_range_for_operator_index(
            MAX_PARALLELISM, self.parallelism, i), None) for i in range(self.parallelism)]

    def task(self, parallelism: int | None = None, **changes) -> KeyedStageTask:
        self.checkpoint_id += 1
        location = self.access.initialize_location_for_checkpoint(self.checkpoint_id)
        task = KeyedStageTask(
            self.storage, str(self.job_id), self.checkpoint_id, location.location_reference,
            self.stage, self.stage.output_schema, MAX_PARALLELISM,
            parallelism or self.parallelism, tuple(self.chains), self.checkpoint_id,
            clock=self.clock, local_dir=str(self.root / "local"))
        return replace(task, **changes)

    def run(self, rows: pa.Table, **changes) -> tuple[list[dict], int, int]:
        """Apply one batch; returns its output rows, late rows and fired timers."""
        task = self.task(**changes)
        routes = _routes(task.parallelism)
        routed = pa.Table.from_batches(list(_operator_indices(
            task, routes, rows.schema, iter(rows.to_batches()))))
        result_rows = []
        for route in routes:
            mine = routed.filter(pc.equal(routed.column(_ROUTE), route))
            result_rows += pa.Table.from_batches(list(_run_partition(
                task, iter(mine.to_batches()))), task_schema()).to_pylist()
        _, newest, late = _summary(task, result_rows)
        ranges = _results(task, [_Row(r) for r in result_rows if r["row_kind"] != "output"])
        payloads = pa.Table.from_pylist([r for r in result_rows if r["row_kind"] == "output"],
                                        task_schema())
        target = OUTPUT.empty_table().schema
        output = pa.Table.from_batches(list(_decode_output(target, iter(
            payloads.to_batches()))), target).to_pylist()
        self.chains = extend_chains(self.chains, ranges)
        self.clock = _newer(self.clock, newest)
        return output, late, sum(r.fired_timers for r in ranges)

    def rescale(self, parallelism: int) -> None:
        """Snapshot the state into the ranges of ``parallelism`` (the runner's rescale)."""
        task = self.task(parallelism)
        indices = pa.record_batch({OPERATOR_INDEX: pa.array(range(parallelism), pa.int32())})
        rows = [_Row(r) for b in _snapshot_ranges(task, True, False, iter([indices]))
                for r in b.to_pylist()]
        self.chains = [KeyedStateChain(r.key_groups, r.handle, (), r.state_rows)
                       for r in _results(task, rows)]
        self.parallelism = parallelism

    def timers(self) -> dict[int, list[dt.datetime]]:
        table = replay_chains(self.chains, KeyedStateLayout.of(self.stage, MAX_PARALLELISM),
                              ALL)
        return {k: sorted(v or []) for k, v in zip(table.column("k").to_pylist(),
                                                 table.column("_timers").to_pylist(),
                                                 strict=True)}


def task_schema() -> pa.Schema:
    from pipelines.keyed._task import _RESULT_SCHEMA
    return _RESULT_SCHEMA


@dataclass
class Model:
    """The reference: keys' counts and timers, the clock; what each batch outputs."""

    lateness: dt.timedelta | None
    counts: dict[int, int] = field(default_factory=dict)
    timers: dict[int, set[dt.datetime]] = field(default_factory=dict)
    clock: dt.datetime | None = None

    def copy(self) -> "Model":
        return Model(self.lateness, dict(self.counts),
                     {k: set(v) for k, v in self.timers.items()}, self.clock)

    def run(self, rows: list[tuple]) -> tuple[list[dict], int, list[tuple]]:
        """One batch: its output, late rows and the fired (key, timer, watermark) triples."""
        times = [t(m) for _, m, _, _ in rows]
        self.clock = max([*times, *([self.clock] if self.clock else [])], default=None)
        limit = None if self.clock is None else self.clock - (self.lateness or dt.timedelta(0))
        on_time = [r for r in rows if self.lateness is None or t(r[1]) >= limit]
        late = len(rows) - len(on_time)
        dropped = {k for k, _, op, _ in on_time if op == "drop"}
        for k in dropped:
            self.counts.pop(k, None)
            self.timers.pop(k, None)
        for k, *_ in on_time:
            if k in dropped:
                continue
            self.counts[k] = self.counts.get(k, 0) + 1
            self.timers.setdefault(k, set())
        for k, _, op, at in on_time:  # registrations, then deletions win (one result)
            if k not in dropped and op == "reg":
                self.timers[k].add(t(at))
        for k, _, op, at in on_time:
            if k not in dropped and op == "del":
                self.timers[k].discard(t(at))
        output, fired = [], []
        if limit is not None:
            for k in sorted(self.timers):
                due = sorted(x for x in self.timers[k] if x <= limit)
                for x in due:
                    self.timers[k].discard(x)
                    output.append({"k": k, "timer": x, "n": self.counts[k]})
                    fired.append((k, x, limit))
                for x in due:
                    if x.second == 0:
                        self.timers[k].add(x + FOLLOW_UP)
        return output, late, fired


def _sorted(rows: list[dict]) -> list[tuple]:
    return sorted((r["k"], r["timer"], r["n"]) for r in rows)


OPS = st.sampled_from(["touch", "reg", "reg", "del", "drop"])
ROW = st.tuples(st.integers(0, 5), st.integers(0, 240), OPS, st.integers(0, 300))
BATCH = st.lists(ROW, max_size=6)


def _rows(batch: list[tuple], registered: list[int]) -> list[tuple]:
    """Deletions aim at timers registered before (else they would rarely hit one)."""
    rows = []
    for k, minute, op, at in batch:
        if op == "del" and registered:
            at = registered[at % len(registered)]
        if op == "reg":
            registered.append(at)
        rows.append((k, minute, op, at if op in ("reg", "del") else None))
    return rows


def check_against_model(root: Path, lateness, batches, restore_at, rescale_to):
    """Run ``batches``; after batch ``restore_at`` fail the next batch (its change files
    never referenced), restore the chains of the last checkpoint and rescale to
    ``rescale_to`` ranges, then go on. Outputs, late counts and timers equal the model's;
    every timer fires once, never before the watermark reaches it."""
    job = Job(root, stage(lateness), 2)
    model = Model(lateness)
    registered: list[int] = []
    all_fired: list[tuple] = []
    for index, batch in enumerate(batches):
        rows = _rows(batch, registered)
        if index == restore_at:
            checkpoint = (list(job.chains), job.clock, job.parallelism)
            job.run(input_table(rows))  # a failed attempt: its changes are thrown away
            job.chains, job.clock, job.parallelism = checkpoint
            if rescale_to != job.parallelism:
                job.rescale(rescale_to)
        output, late, fired_count = job.run(input_table(rows))
        expected, expected_late, fired = model.run(rows)
        all_fired += fired
        assert (_sorted(output), late, fired_count) == (_sorted(expected), expected_late,
                                                       len(fired)), f"batch {index}"
    stored = {k: v for k, v in job.timers().items() if v}
    assert stored == {k: sorted(v) for k, v in model.timers.items() if v}
    assert len({(k, x) for k, x, _ in all_fired}) == len(all_fired)  # at most once
    assert all(x <= limit for _, x, limit in all_fired)  # never early


@pytest.mark.timeout(300)
@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(lateness=st.sampled_from([None, dt.timedelta(0), dt.timedelta(minutes=30),
                                 dt.timedelta(hours=2)]),
       batches=st.lists(BATCH, min_size=1, max_size=6),
       restore_at=st.integers(0, 6), rescale_to=st.sampled_from([1, 2, 3]))
def test_timers_fire_once_never_early_across_restores_and_rescaling(
        tmp_path_factory, lateness, batches, restore_at, rescale_to):
    """Against a dict model (random event times, lateness, registrations and deletions, a
    failed batch and a restore from the last checkpoint, a rescale): every timer fires
    exactly once, at or after its time, never a deleted one; outputs equal the model's."""
    root = tmp_path_factory.mktemp("timers")
    try:
        check_against_model(root, lateness, batches, restore_at, rescale_to)
    finally:
        shutil.rmtree(root, ignore_errors=True)
