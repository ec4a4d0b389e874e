"""Timers, watermark and allowed lateness of keyed stages (issue 27 items 1 and 2).

The property tests run a batch as Spark runs it, range by range, through the executors' own
functions (routing, ``_run_partition``, full snapshots) on a real checkpoint storage and real
local stores, against a dict model: many examples in seconds. A few examples then run on
real Spark (local[2]) through ``apply_keyed_batch``.
"""

import datetime as dt
import io
import json
import shutil
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark import cloudpickle

from checkpoint_storage import FileSystemCheckpointStorage, JobID
from pipelines import (
    ParquetSink,
    Source,
    StatefulPipeline,
    StatefulRunner,
    read_state,
)
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
    decode_keyed_master_state,
    extend_chains,
    replay_chains,
)
from pipelines.keyed._batch import _results, _summary
from pipelines.keyed._chain import encode_keyed_master_state
from pipelines.keyed._executor import _decode_output, _run_partition, _snapshot_ranges
from pipelines.keyed._routing import _ROUTE, OPERATOR_INDEX, _operator_indices, _routes
from pipelines.keyed._task import _newer
from tests.pipelines.support import InjectedFault, run_read_cli, storage_of

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
    registered: Counter = field(default_factory=Counter)  # registrations per (key, timer)

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
        for k, _, op, at in on_time:  # deletions first, then registrations (one result)
            if k not in dropped and op == "del":
                self.timers[k].discard(t(at))
        for k, _, op, at in on_time:
            if k not in dropped and op == "reg":
                self.timers[k].add(t(at))
                self.registered[k, t(at)] += 1
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
                        self.registered[k, x + FOLLOW_UP] += 1
        return output, late, fired


def _sorted(rows: list[dict]) -> list[tuple]:
    return sorted((r["k"], r["timer"], r["n"]) for r in rows)


OPS = st.sampled_from(["touch", "reg", "reg", "del", "drop"])
# times on a coarse grid, so that timers and rows often fall exactly on the watermark
TIMES = st.integers(0, 10).map(lambda i: i * 30)
ROW = st.tuples(st.integers(0, 5), TIMES, OPS, TIMES)
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
    # at most once per registration (a timer registered again after it fired fires again)
    fired_count = Counter((k, x) for k, x, _ in all_fired)
    assert all(n <= model.registered[timer] for timer, n in fired_count.items())
    assert all(x <= limit for _, x, limit in all_fired)  # never early


@pytest.mark.timeout(300)
@settings(max_examples=50, deadline=None,
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


def key_count(job: Job) -> dict[int, int]:
    table = replay_chains(job.chains, KeyedStateLayout.of(job.stage, MAX_PARALLELISM), ALL)
    return dict(zip(table.column("k").to_pylist(), table.column("n").to_pylist(), strict=True))


def test_a_row_at_the_watermark_is_on_time_and_a_timer_at_it_fires(tmp_path):
    """Watermark = newest event time - allowed lateness: a row exactly at it is on time, one
    1 us older is dropped and counted; a timer exactly at it fires, one 1 us later waits."""
    job = Job(tmp_path, stage(dt.timedelta(minutes=30)), 2)
    us = dt.timedelta(microseconds=1)
    first = pa.Table.from_pylist([
        {"k": 1, "ts": t(100), "op": "reg", "at": t(70)},
        {"k": 1, "ts": t(100), "op": "reg", "at": t(70) + us},
    ], schema=INPUT)
    output, late, fired = job.run(first)
    second = pa.Table.from_pylist([
        {"k": 2, "ts": t(70), "op": "touch", "at": None},
        {"k": 3, "ts": t(70) - us, "op": "touch", "at": None},
    ], schema=INPUT)
    _, second_late, _ = job.run(second)
    assert ([(1, t(70), 2)], 0, 1, 1, {1: 2, 2: 1}, {1: [t(70) + us, t(70) + FOLLOW_UP], 2: []}
            ) == (_sorted(output), late, fired, second_late, key_count(job), job.timers())


def test_without_a_watermark_the_ttl_decides_lateness_and_timers_fire_at_the_clock(tmp_path):
    """A stage without ``watermark`` keeps the rule of before (late: older than the clock
    minus the ttl; without a ttl nothing is late) and its event-time timers fire once the
    clock (the newest event time) reaches them."""
    job = Job(tmp_path, stage(None), 1)
    output, late, _ = job.run(input_table([(1, 100, "reg", 100), (1, 100, "reg", 101)]))
    _, old_late, _ = job.run(input_table([(2, 0, "touch", None)]))
    assert ([(1, t(100), 2)], 0, 0, {1: 2, 2: 1}) == (_sorted(output), late, old_late,
                                                      key_count(job))


def test_timers_fire_in_ranges_without_input_and_leave_with_their_key(tmp_path):
    """A batch with no rows for a key's range still fires its due timers (every range runs
    when the stage has timers); a key whose state is deleted loses its timers; a batch with
    nothing due writes no change file."""
    job = Job(tmp_path, stage(dt.timedelta(0)), 2)
    layout = KeyedStateLayout.of(job.stage, MAX_PARALLELISM)
    groups = layout.key_groups_of(pa.table({"k": pa.array(range(40), pa.int64())}))
    ranges = [int(g) * 2 // MAX_PARALLELISM for g in groups]
    other = next(k for k in range(10, 40) if ranges[k] != ranges[1])  # in the other range
    job.run(input_table([(k, 0, "reg", 60) for k in range(6)] + [(other, 0, "reg", 500)]))
    job.run(input_table([(0, 1, "drop", None)]))
    output, _, fired = job.run(input_table([(other, 61, "touch", None)]))
    before = list(job.chains)
    _, _, nothing = job.run(input_table([]))
    assert ([(k, t(60), 1) for k in range(1, 6)], 5, 0, before) == (
        _sorted(output), fired, nothing, job.chains)


def test_processing_time_timers_fire_by_the_batch_wall_clock(tmp_path):
    """Processing-time timers fire in the first batch whose wall-clock time (the task's
    ``processing_time``, taken once per batch on the driver) reaches them, also in a batch
    without rows; one registered already due fires in the batch that registered it."""
    processing = KeyedStage("timed", "k", STATE, count_and_time, output_schema=OUTPUT,
                            event_time=None, time_mode=TimeMode.PROCESSING_TIME,
                            on_timer=emit_fired)
    job = Job(tmp_path, processing, 2)
    first, _, _ = job.run(input_table([(1, 0, "reg", 10.5), (2, 0, "reg", -1)]),
                          processing_time=t(0))
    early, _, _ = job.run(input_table([]), processing_time=t(10))
    due, _, _ = job.run(input_table([]), processing_time=t(10.5))
    assert ([(2, t(-1), 1)], [], [(1, t(10.5), 1)]) == (_sorted(first), early, _sorted(due))


def only_timers(input: pa.Table, state: pa.Table) -> KeyedResult:
    """Registers a timer for each input key without upserting its state."""
    return KeyedResult(STATE.empty_table(), NO_KEYS, OUTPUT.empty_table(),
                       pa.table({"k": input.column("k"), "timer": input.column("at")}))


def test_a_timer_for_a_key_without_state_is_refused(tmp_path):
    """Timers live with the key's state: registering one for a key that has no state after
    the batch fails the batch, naming the stage and the key and saying what to do; nothing
    is written."""
    job = Job(tmp_path, replace(stage(None), apply=only_timers), 1)
    with pytest.raises(ValueError) as refused:
        job.run(input_table([(7, 0, "reg", 5)]))
    message = str(refused.value)
    assert ("keyed stage timed", "{'k': 7}", "upsert the key's state", [None]) == (
        *(s for s in ("keyed stage timed", "{'k': 7}", "upsert the key's state")
          if s in message), [c.full_snapshot for c in job.chains])
    assert not job.chains[0].changes


def no_op(input: pa.Table, state: pa.Table) -> KeyedResult:
    return KeyedResult(STATE.empty_table(), NO_KEYS, OUTPUT.empty_table())


@pytest.mark.parametrize(("options", "says"), [
    ({"on_timer": emit_fired}, "on_timer and time_mode go together"),
    ({"time_mode": TimeMode.EVENT_TIME, "event_time": "ts"},
     "on_timer and time_mode go together"),
    ({"time_mode": TimeMode.EVENT_TIME, "on_timer": emit_fired},
     "event-time timers need event_time"),
    ({"watermark": Watermark(dt.timedelta(minutes=5))}, "a watermark needs event_time"),
    ({"time_mode": "event_time", "on_timer": emit_fired, "event_time": "ts"},
     "time_mode must be a TimeMode"),
])
def test_stages_with_timers_or_a_watermark_are_checked(options, says):
    """A stage's timers and watermark are checked when it is declared, naming the stage."""
    with pytest.raises((ValueError, TypeError)) as refused:
        KeyedStage("timed", "k", STATE, no_op, **options)
    assert ("keyed stage timed", says) == tuple(
        s for s in ("keyed stage timed", says) if s in str(refused.value))


def test_watermark_arguments_are_checked():
    """A negative lateness is refused; a late-rows output must be named as a stage is."""
    with pytest.raises(ValueError, match="allowed_lateness"):
        Watermark(dt.timedelta(minutes=-1))
    with pytest.raises(ValueError, match="late_rows names"):
        Watermark(late_rows="")
    assert Watermark(late_rows="late").late_rows == "late"


@pytest.mark.parametrize(("timers", "says"), [
    (pa.table({"k": [1], "timer": pa.array([T0], UTC_US)}), "has no time_mode"),
])
def test_timers_from_a_stage_without_time_mode_are_refused(timers, says):
    """A stage without ``time_mode`` that returns timers is refused, saying what to set."""
    def returns_timers(input: pa.Table, state: pa.Table) -> KeyedResult:
        return KeyedResult(pa.table({"k": [1], "n": [1]}), NO_KEYS, OUTPUT.empty_table(),
                           timers)

    plain = KeyedStage("plain", "k", STATE, returns_timers)
    with pytest.raises(ValueError, match=says):
        plain.run(pa.table({"k": [1]}), STATE.empty_table())


def test_naive_or_null_timers_and_other_keys_timers_are_refused():
    """A timer must be a zoned timestamp, never null, and of a key the result may change."""
    timed = stage(None)
    input = pa.table({"k": [1]})

    def result(timers: pa.Table) -> KeyedResult:
        return KeyedResult(pa.table({"k": [1], "n": [1]}), NO_KEYS, OUTPUT.empty_table(),
                           timers)

    cases = [
        (pa.table({"k": [1], "timer": pa.array([dt.datetime(2026, 1, 1)], pa.timestamp(
            "us"))}), "timezone-aware"),
        (pa.table({"k": [1], "timer": pa.array([None], UTC_US)}), "null"),
        (pa.table({"k": [2], "timer": pa.array([T0], UTC_US)}), "not among the batch's"),
    ]
    messages = []
    for timers, _ in cases:
        with pytest.raises(ValueError) as refused:
            replace(timed, apply=lambda i, s, timers=timers: result(timers)).run(
                input, STATE.empty_table())
        messages.append(str(refused.value))
    assert [says for _, says in cases] == [
        says for (_, says), message in zip(cases, messages, strict=True) if says in message]


# --- on Spark, run by the runner -------------------------------------------------------------

EVENTS = {  # per partition, per batch: (key, minutes, op, timer minutes or None)
    "p1": [[(1, 0, "reg", 30), (2, 5, "reg", 50), (3, 5, "reg", 200)],
           [(1, 40, "touch", None), (2, 45, "del", 50), (4, 45, "reg", 60)]],
    "p2": [[(5, 90, "reg", 95), (1, 10, "touch", None)],  # (1, 10) is late
           [(3, 120, "drop", None), (6, 130, "reg", 100)],
           [(6, 200, "touch", None)]],
}


@dataclass(frozen=True)
class TimedEvents(Source):
    """``EVENTS`` as DataFrames: the same batch always has the same rows."""

    def batches(self, spark, partition):
        return [f"{partition}-{i}" for i in range(len(EVENTS[partition]))]

    def read(self, spark, partition, batch):
        part, index = batch.rsplit("-", 1)
        table = input_table(EVENTS[part][int(index)])
        return spark.createDataFrame(table.to_pandas(), "k long, ts timestamp, op string, "
                                     "at timestamp")


def timed_pipeline(tmp_path: Path, parallelism: int) -> StatefulPipeline:
    return StatefulPipeline(
        name="timers", stages=[stage(dt.timedelta(minutes=30))], source=TimedEvents(),
        partitions=dg.StaticPartitionsDefinition(["p1", "p2"]), checkpoint_interval=1,
        max_parallelism=MAX_PARALLELISM, keyed_parallelism=parallelism,
        sinks=[ParquetSink(name="fired", stage="timed", of="output",
                           url=str(tmp_path / "fired"))])


@pytest.mark.timeout(600)
def test_the_runner_fires_timers_once_across_a_failure_restore_and_rescale(spark, tmp_path):
    """On Spark, through the runner: a run killed after a batch of p2 and resumed at another
    parallelism fires every timer once (the sink holds the model's rows), reports late rows
    and fired timers in its progress lines, and the readers show the pending timers."""
    def kill(point, **info):
        if point == "batch_applied" and info["partition"] == "p2" and info["batch"] == 1:
            raise InjectedFault("killed")

    progress: list[str] = []
    with pytest.raises(InjectedFault):
        StatefulRunner(spark, storage_of(tmp_path), timed_pipeline(tmp_path, 2),
                       keyed_local_dir=str(tmp_path / "local"), fault_hook=kill).run(
            ["p1", "p2"], on_progress=progress.append)
    runner = StatefulRunner(spark, storage_of(tmp_path), timed_pipeline(tmp_path, 3),
                            keyed_local_dir=str(tmp_path / "local"))
    runner.run(["p2"], on_progress=progress.append)
    model = Model(dt.timedelta(minutes=30))
    expected = []
    for partition in ("p1", "p2"):
        for batch in EVENTS[partition]:
            expected += model.run(batch)[0]
    fired = pa.concat_tables([pq.read_table(path) for path in sorted(
        (tmp_path / "fired").rglob("*.parquet"))])
    pointer = runner.store.latest().external_pointer
    state = read_state(pointer, "timed")
    as_json = [json.loads(line) for line in run_read_cli(
        pointer, "--stage", "timed", "--json").output.splitlines()]
    as_table = run_read_cli(pointer, "--stage", "timed").output
    as_csv = run_read_cli(pointer, "--stage", "timed", "--csv")
    csv_rows = pacsv.read_csv(io.BytesIO(as_csv.stdout.encode()), convert_options=(
        pacsv.ConvertOptions(column_types={"_timers": pa.string()}, strings_can_be_null=True))
    ).to_pylist()
    timers = {k: sorted(v) for k, v in zip(state.column("k").to_pylist(),
                                           state.column("_timers").to_pylist(), strict=True)
              if v}
    assert (_sorted(expected), {k: sorted(v) for k, v in model.timers.items() if v}) == (
        _sorted(fired.to_pylist()), timers)
    assert ({k: [x.isoformat() for x in v] for k, v in timers.items()}, True) == (
        {r["k"]: r["_timers"] for r in as_json if r["_timers"]}, "_timers" in as_table)
    # CSV has no list type: the pending timers are the --json values, as JSON text
    assert (0, {r["k"]: r["_timers"] for r in as_json}) == (as_csv.exit_code, {
        r["k"]: r["_timers"] and json.loads(r["_timers"]) for r in csv_rows}), as_csv.output
    assert any("1 late row(s) dropped" in line for line in progress)
    assert any("timer(s) fired" in line for line in progress)


@pytest.mark.timeout(300)
def test_a_restore_into_another_time_mode_is_refused_naming_both(spark, tmp_path):
    """Event-time timers restored into a processing-time stage would fire by the wrong clock:
    refused before any batch, naming both modes; nothing committed after p1."""
    StatefulRunner(spark, storage_of(tmp_path), timed_pipeline(tmp_path, 1),
                   keyed_local_dir=str(tmp_path / "local")).run(["p1"])
    committed = sorted((tmp_path / "checkpoints").rglob("_metadata"))
    processing = replace(timed_pipeline(tmp_path, 1), stages=[
        replace(stage(None), time_mode=TimeMode.PROCESSING_TIME, event_time=None)])

    with pytest.raises(Exception, match=r"keyed stage 'timed': the state's timers were "
                                        r"written with time_mode EVENT_TIME, the stage now "
                                        r"has PROCESSING_TIME.*the time_mode it had"):
        StatefulRunner(spark, storage_of(tmp_path), processing,
                       keyed_local_dir=str(tmp_path / "local")).run(["p2"])
    assert committed == sorted((tmp_path / "checkpoints").rglob("_metadata"))


def test_the_stage_description_records_timers_and_reads_back_without_them_as_before():
    """``keyed-state/<stage>`` records that the rows carry timers (readers and restores know
    the column); a description written before timers existed reads as a stage without."""
    with_timers = KeyedStateLayout.of(stage(None), MAX_PARALLELISM)
    plain = KeyedStateLayout(("k",), STATE, MAX_PARALLELISM)
    decoded = [decode_keyed_master_state(encode_keyed_master_state(layout, T0), STATE, "here")
               for layout in (with_timers, plain)]
    assert ([True, False], [T0, T0], b"timers" in encode_keyed_master_state(plain, T0)) == (
        [d[0].timers for d in decoded], [d[1] for d in decoded], False)


def test_the_initial_state_loader_of_a_stage_with_a_watermark_and_timers_is_valid():
    """A stage with a watermark and event-time timers (no event-time TTL) gets an initial
    state through a loader stage: no watermark and no event time (the rows are state, not
    input), still with timers, so the loaded rows carry the ``_timers`` column."""
    from pipelines.keyed._driver import loader_stage

    schema = pa.schema([pa.field("device", pa.string(), nullable=False),
                        ("last_seen", pa.timestamp("us", "UTC"))])
    stage = KeyedStage("silent", "device", schema, lambda input, state: None,
                       event_time="seen_at", time_mode=TimeMode.EVENT_TIME,
                       on_timer=lambda fired, state: None,
                       watermark=Watermark(allowed_lateness=dt.timedelta(minutes=5)))

    loader = loader_stage(stage)

    assert (None, None, TimeMode.PROCESSING_TIME) == (
        loader.watermark, loader.event_time, loader.time_mode)
    assert KeyedStateLayout.of(loader).stored_schema == KeyedStateLayout.of(stage).stored_schema
