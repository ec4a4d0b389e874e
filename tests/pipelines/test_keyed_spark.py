"""A keyed stage on real Spark (local[2]): per-range tasks, change files, local stores rebuilt
from the chains, retried attempts, rescaling and full snapshot, each checked against a
plain dict recomputation of a per-user count."""

import datetime as dt
import os
import shutil
import sys
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark import cloudpickle

from checkpoint_storage import ByteStreamStateHandle, FileSystemCheckpointStorage, JobID
from pipelines.keyed import (
    FullSnapshotPolicy,
    KeyedResult,
    KeyedStage,
    KeyedStageDriver,
    KeyedStageTask,
    KeyedStateChain,
    KeyedStateLayout,
    KeyGroupRange,
    StateTtl,
    TtlTimeCharacteristic,
    apply_keyed_batch,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
    extend_chains,
    local_store_directory,
    ranges_to_snapshot,
    replay_chains,
    snapshot_keyed_state,
    sweep_idle_stores,
)
from pipelines.keyed._batch import _operator_index_frame
from pipelines.keyed._local_stores import _Locked, sweep_other_ranges
from pipelines.keyed._routing import OPERATOR_INDEX
from tests.pipelines.support import CLICK_COUNT_STATE, count_clicks

MAX_PARALLELISM = 8
STATE = CLICK_COUNT_STATE
OUTPUT = pa.schema([("user", pa.string()), ("clicks", pa.int64())])
ALL = KeyGroupRange(0, MAX_PARALLELISM - 1)
BATCHES = [
    ["ann", "bob", "ann", "cid", "dee"],
    ["bob", "eve", "ann", "fay", "gus", "gus"],
    ["cid", "hal", "ann", "eve"],
    ["ivy", "bob", "jon", "dee", "dee"],
]




# Spark's workers cannot import this test module: ship its functions by value, as a user's
# stage defined in a notebook or script is shipped.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
STAGE = KeyedStage("clicks", "user", STATE, count_clicks)
LAYOUT = KeyedStateLayout.of(STAGE, MAX_PARALLELISM)


class Job:
    """One pipeline's checkpoint storage (local disk), its chains, and its executors' local
    store directory; ``run`` applies one batch as the runner will."""

    def __init__(self, root: Path, parallelism: int) -> None:
        self.storage = FileSystemCheckpointStorage(str(root / "checkpoints"),
                                                   file_state_size_threshold=0)
        self.job_id = JobID.generate()
        self.access = self.storage.create_checkpoint_storage(self.job_id)
        self.access.initialize_base_locations()
        self.local_dir = root / "local"
        self.shared = root / "checkpoints" / str(self.job_id) / "shared"
        self.checkpoint_id = 0
        self.parallelism = parallelism
        self.chains = [KeyedStateChain(compute_key_group_range_for_operator_index(
            MAX_PARALLELISM, parallelism, i), None) for i in range(parallelism)]

    def task(self, batch: int, parallelism: int | None = None) -> KeyedStageTask:
        self.checkpoint_id += 1
        location = self.access.initialize_location_for_checkpoint(self.checkpoint_id)
        return KeyedStageTask(
            self.storage, str(self.job_id), self.checkpoint_id, location.location_reference,
            STAGE, OUTPUT, MAX_PARALLELISM, parallelism or self.parallelism, tuple(self.chains),
            batch, local_dir=str(self.local_dir))

    def run(self, spark, batch: int, task: KeyedStageTask | None = None):
        """Apply batch ``batch``; returns (output rows as (user, clicks) pairs, results)."""
        task = task or self.task(batch)
        frame = spark.createDataFrame([(u,) for u in BATCHES[batch]], "user string")
        result = apply_keyed_batch(frame, task)
        try:
            output = sorted((r["user"], r["clicks"]) for r in result.output.collect())
        finally:
            result.release()
        self.chains = extend_chains(self.chains, result.ranges)
        return output, result.ranges

    def state(self) -> dict[str, int]:
        table = replay_chains(self.chains, LAYOUT, ALL)
        users = table.column("user").to_pylist()
        assert len(set(users)) == len(users), "a key is in the state twice"
        return dict(zip(users, table.column("clicks").to_pylist(), strict=True))


def expected(batches: int) -> tuple[dict[str, int], list[list[tuple[str, int]]]]:
    """The counts after ``batches`` batches and each batch's output, recomputed with a dict."""
    counts: Counter = Counter()
    outputs = []
    for users in BATCHES[:batches]:
        counts.update(users)
        outputs.append(sorted((u, counts[u]) for u in set(users)))
    return dict(counts), outputs


def operator_indices(users: list[str], parallelism: int) -> list[int]:
    """The range (operator index) owning each user, by Flink's formulas."""
    groups = LAYOUT.key_groups_of(pa.table({"user": users}))
    return [compute_operator_index_for_key_group(MAX_PARALLELISM, parallelism, int(g))
            for g in groups]


@pytest.fixture
def job(tmp_path) -> Job:
    return Job(tmp_path, 2)


def test_batches_equal_a_recomputation_and_reuse_the_local_stores(spark, job):
    """Over three batches the outputs and the replayed chains equal a dict count, a range
    builds its local store only the first time it has rows, then reuses it, and each range
    with rows writes one change file per batch (the stage ran once: no recomputation)."""
    outputs, rebuilds, first_rows, seen, files = [], [], [], set(), []
    for batch in range(3):
        owners = set(operator_indices(BATCHES[batch], 2))
        first_rows.append(sorted(owners - seen))
        seen |= owners
        files += [f"clicks-kg{'0-3' if i == 0 else '4-7'}-b{batch}-a0" for i in owners]
        output, ranges = job.run(spark, batch)
        outputs.append(output)
        rebuilds.append(sorted(r.operator_index for r in ranges if r.rebuilt))
    written = sorted(p.name.rsplit("-", 1)[0] for p in job.shared.iterdir())
    counts, batch_outputs = expected(3)
    assert (counts, batch_outputs, first_rows, sorted(files)) == (
        job.state(), outputs, rebuilds, written)


def test_every_range_runs_in_a_spark_task_of_its_own(spark, tmp_path):
    """At parallelism 8 (a key group per range) a batch touching every range runs: rows of two
    ranges never reach one Spark task (the task would refuse them), and each range reports
    once."""
    job = Job(tmp_path, 8)
    users = [f"user-{i}" for i in range(200)]
    frame = spark.createDataFrame([(u,) for u in users], "user string")
    result = apply_keyed_batch(frame, job.task(0))
    try:
        output = sorted(r["user"] for r in result.output.collect())
    finally:
        result.release()
    assert (sorted(users), list(range(8))) == (
        output, sorted(r.operator_index for r in result.ranges))


def test_a_chains_inline_change_files_share_one_inline_threshold(spark, job):
    """Inline change files are repeated in every later ``_metadata`` of their chain, so a
    chain's inline changes add up to at most the storage's inline threshold; the rest are
    files. The state is the same either way."""
    threshold = 4096
    job.storage = FileSystemCheckpointStorage(job.storage.checkpoint_directory,
                                              file_state_size_threshold=threshold)
    for batch in range(len(BATCHES)):
        job.run(spark, batch)
    inline = [sum(h.state_size for h in chain.changes if isinstance(h, ByteStreamStateHandle))
              for chain in job.chains]
    kinds = {type(h).__name__ for chain in job.chains for h in chain.changes}

    assert (expected(len(BATCHES))[0], True, {"ByteStreamStateHandle", "FileStateHandle"}) == (
        job.state(), max(inline) <= threshold, kinds)


def test_lost_local_stores_are_rebuilt_from_the_chains(spark, job):
    """With the local stores deleted before every batch (another executor), the result is the
    same and every range reports a rebuild with the rows it had."""
    outputs, rebuilt_rows = [], []
    for batch in range(3):
        shutil.rmtree(job.local_dir, ignore_errors=True)
        before = job.state()
        output, ranges = job.run(spark, batch)
        outputs.append(output)
        assert all(r.rebuilt for r in ranges)
        rebuilt_rows.append(sum(r.rebuild_rows for r in ranges))
        assert len(before) == rebuilt_rows[-1]
    counts, batch_outputs = expected(3)
    assert (counts, batch_outputs) == (job.state(), outputs)


def test_a_retried_batch_is_applied_once(spark, job):
    """Running a batch's task twice (a retried attempt, whose store already applied it)
    rebuilds the store from the checkpointed chain and applies the batch once."""
    job.run(spark, 0)
    task, checkpointed = job.task(1), job.chains
    first, _ = job.run(spark, 1, task)
    job.chains = checkpointed  # the driver keeps the second attempt's handles
    second, ranges = job.run(spark, 1, task)
    counts, batch_outputs = expected(2)
    assert (counts, batch_outputs[1], batch_outputs[1], True) == (
        job.state(), first, second, all(r.rebuilt for r in ranges))


def test_rescaling_two_to_three_equals_a_recomputation(spark, job):
    """Snapshotting the ranges of parallelism 3 from the chains of parallelism 2, then running
    batches at 3, equals the recomputation."""
    job.run(spark, 0)
    job.run(spark, 1)
    task = job.task(2, parallelism=3)
    results = snapshot_keyed_state(spark, task)
    job.parallelism = 3
    job.chains = extend_chains([KeyedStateChain(task.key_groups(i), None) for i in range(3)],
                               results)
    outputs = [job.run(spark, 2)[0], job.run(spark, 3)[0]]
    counts, batch_outputs = expected(4)
    assert (counts, batch_outputs[2:], [0, 1, 2]) == (
        job.state(), outputs, [r.operator_index for r in results])


def test_full_snapshot_resets_the_chains_and_keeps_the_state(spark, job):
    """After three batches a policy of every 2 change files snapshots every range: the
    chains are one snapshot each, their replay equals the recomputation, and the next batch
    reuses the local stores (no rebuild) and still equals it."""
    for batch in range(3):
        job.run(spark, batch)
    due = ranges_to_snapshot(job.chains, FullSnapshotPolicy(every=2, min_bytes=1 << 30))
    results = snapshot_keyed_state(spark, job.task(2), due)
    job.chains = extend_chains(job.chains, results)
    shapes = [(c.full_snapshot is not None, len(c.changes)) for c in job.chains]
    after_three = job.state()
    _, ranges = job.run(spark, 3)
    assert ([0, 1], [(True, 0), (True, 0)], expected(3)[0], expected(4)[0], False) == (
        due, shapes, after_three, job.state(), any(r.rebuilt for r in ranges))


def test_the_snapshot_of_ranges_runs_one_task_per_range_without_python_rows(spark, job):
    """The ranges' snapshot job starts from one row per range, one Spark partition each, built
    by ``range``: an RDD of Python rows started a second Python daemon (and its workers, with
    their imports) in a fresh process's first snapshot."""
    frame = _operator_index_frame(spark, job.task(0, parallelism=3), [2, 0])
    from pyspark.sql import functions as F

    rows = frame.select(F.spark_partition_id().alias("part"), OPERATOR_INDEX).collect()
    plan = frame._jdf.queryExecution().executedPlan().toString()
    assert ([(0, 2), (1, 0)], "int", False) == (
        sorted(tuple(r) for r in rows), frame.schema[OPERATOR_INDEX].dataType.simpleString(),
        "RDD" in plan)


def test_full_snapshot_policy_counts_changes_and_bytes():
    """The policy is due after ``every`` change files, or when the changes since the base (the
    snapshot, or a chain's first change file) outgrow ``ratio`` of it (at least ``min_bytes``),
    and never for a chain without changes."""
    from checkpoint_storage import ByteStreamStateHandle

    def chain(snapshot: int | None, changes: list[int]) -> KeyedStateChain:
        return KeyedStateChain(ALL, None if snapshot is None
                               else ByteStreamStateHandle("m", b"x" * snapshot),
                               tuple(ByteStreamStateHandle(f"c{i}", b"x" * n)
                                     for i, n in enumerate(changes)))

    policy = FullSnapshotPolicy(every=3, ratio=0.5, min_bytes=10)
    chains = [chain(100, []), chain(100, [10, 10]), chain(100, [30, 30]), chain(100, [1, 1, 1]),
              chain(None, [2, 2]), chain(None, [4, 8])]
    assert [2, 3, 5] == ranges_to_snapshot(chains, policy)


def test_a_small_ranges_chain_is_bounded_by_small_every():
    """A range whose base and change files together are at most ``min_bytes`` is due after
    ``small_every`` change files since its base (it would otherwise collect change files up
    to ``min_bytes``); a range above ``min_bytes`` is not, nor is one with fewer changes, nor
    any with ``small_every=None``."""
    from checkpoint_storage import ByteStreamStateHandle

    def chain(snapshot: int | None, changes: list[int]) -> KeyedStateChain:
        return KeyedStateChain(ALL, None if snapshot is None
                               else ByteStreamStateHandle("m", b"x" * snapshot),
                               tuple(ByteStreamStateHandle(f"c{i}", b"x" * n)
                                     for i, n in enumerate(changes)))

    policy = FullSnapshotPolicy(min_bytes=1000, small_every=4)
    chains = [chain(100, [10] * 3), chain(100, [10] * 4), chain(None, [100, *[10] * 3]),
              chain(None, [100, *[10] * 4]), chain(990, [10] * 4), chain(700, [100] * 4)]
    assert ([1, 3], []) == (ranges_to_snapshot(chains, policy), ranges_to_snapshot(
        chains, FullSnapshotPolicy(min_bytes=1000, small_every=None)))


def test_a_chains_inline_snapshot_counts_against_its_inline_threshold(tmp_path):
    """A chain's inline states share one inline threshold, its snapshot's included: each
    ``_metadata`` repeats at most the threshold per range, so a change file goes to a file
    once the inline snapshot and change files fill it."""
    from pipelines.keyed._executor import _change_file_storage

    storage = FileSystemCheckpointStorage(str(tmp_path), file_state_size_threshold=1000)
    snapshot = ByteStreamStateHandle("m", b"x" * 600)
    change = ByteStreamStateHandle("c", b"x" * 300)
    thresholds = [_change_file_storage(storage, chain).file_state_size_threshold for chain in (
        KeyedStateChain(ALL, None), KeyedStateChain(ALL, snapshot),
        KeyedStateChain(ALL, snapshot, (change,)), KeyedStateChain(ALL, None, (change,) * 4))]
    assert [1000, 400, 100, 0] == thresholds


def test_a_batch_on_chains_of_another_parallelism_is_refused(spark, job):
    """A batch whose chains are not the ranges of its parallelism (rescaled without
    snapshotting first) is refused before any task runs, saying what to do."""
    frame = spark.createDataFrame([("ann",)], "user string")

    with pytest.raises(ValueError, match="snapshot the new ranges") as refused:
        apply_keyed_batch(frame, job.task(0, parallelism=3))

    assert "keyed stage clicks" in str(refused.value)


def test_expired_state_is_not_handed_to_the_stage(spark, job):
    """Under a processing-time TTL of one hour, a batch two hours later counts from zero: the
    expired rows are never handed to the stage, and the stored write times are the batches'."""
    ttl = StateTtl(dt.timedelta(hours=1), TtlTimeCharacteristic.PROCESSING_TIME)
    stage = replace(STAGE, ttl=ttl)
    t0 = dt.datetime(2026, 3, 10, tzinfo=dt.UTC)
    job.run(spark, 0, replace(job.task(0), stage=stage, now=t0))
    output, _ = job.run(spark, 1, replace(job.task(1), stage=stage, now=t0 + dt.timedelta(
        hours=2)))
    state = replay_chains(job.chains, KeyedStateLayout.of(stage, MAX_PARALLELISM), ALL)
    written = dict(zip(state.column("user").to_pylist(),
                       state.column("_written_at").to_pylist(), strict=True))
    assert (sorted((u, n) for u, n in Counter(BATCHES[1]).items()),
            t0 + dt.timedelta(hours=2), t0) == (output, written["bob"], written["dee"])


T0 = dt.datetime(2026, 3, 10, tzinfo=dt.UTC)
TIMED_STATE = pa.schema([pa.field("user", pa.string(), nullable=False), ("clicks", pa.int64()),
                         ("last", pa.timestamp("us", tz="UTC"))])


def count_timed_clicks(input: pa.Table, state: pa.Table) -> KeyedResult:
    counted = count_clicks(input, state).upserts
    last = input.group_by("user").aggregate([("ts", "max")])
    upserts = counted.join(last, "user").rename_columns(["user", "clicks", "last"])
    return KeyedResult(upserts, pa.table({"user": pa.array([], pa.string())}),
                       upserts.select(["user", "clicks"]))


TIMED_STAGE = KeyedStage(
    "timed", "user", TIMED_STATE, count_timed_clicks, output_schema=OUTPUT, event_time="ts",
    ttl=StateTtl(dt.timedelta(hours=1), TtlTimeCharacteristic.EVENT_TIME, "last"))


def timed_frame(spark, rows: list[tuple[str, float | None]]):
    """Clicks as (user, hours after T0 or None)."""
    return spark.createDataFrame(
        [(u, None if h is None else T0 + dt.timedelta(hours=h)) for u, h in rows],
        "user string, ts timestamp")


def run_timed(spark, job: Job, batch: int, rows, clock: dt.datetime | None):
    task = replace(job.task(batch), stage=TIMED_STAGE, now=clock or T0, clock=clock)
    result = apply_keyed_batch(timed_frame(spark, rows), task)
    try:
        output = sorted((r["user"], r["clicks"]) for r in result.output.collect())
    finally:
        result.release()
    job.chains = extend_chains(job.chains, result.ranges)
    return output, result


def test_each_range_advances_the_event_time_clock_over_the_whole_batch(spark, job):
    """The ranges advance the clock by the batch's newest event time, whichever range holds
    it: a row behind the new clock minus the TTL, or without an event time, is dropped, state
    last seen before it is expired, only ranges with rows left write a change file, and the
    batch reports every row it read and its newest event time."""
    run_timed(spark, job, 0, [("ann", 0), ("hal", 0)], None)
    # ann's range is 0, eve's and hal's 1: by range 1's rows alone the clock would be 2.5 h
    # and eve (1.75 h) on time; by the whole batch's it is 3 h and she is late.
    output, result = run_timed(spark, job, 1, [("ann", 3), ("eve", 1.75), ("hal", 2.5),
                                               ("cid", None)], T0)
    assert ([("ann", 1), ("hal", 1)], 4, T0 + dt.timedelta(hours=3), [0, 1]) == (
        output, result.input_rows, result.newest, [r.operator_index for r in result.ranges])


def test_a_batch_with_no_event_time_keeps_the_clock(spark, job):
    """A batch whose rows have no event time reports every row read and no newest event
    time (the clock stays where it was), and its rows, behind any clock, are dropped."""
    run_timed(spark, job, 0, [("ann", 5)], None)
    output, result = run_timed(spark, job, 1, [("ann", None), ("bob", None)], T0 + dt.timedelta(
        hours=5))
    assert ([], None, 2, []) == (output, result.newest, result.input_rows, result.ranges)


def test_the_event_time_clock_costs_no_spark_job_of_its_own(spark, tmp_path):
    """A batch of a stage with an event-time clock runs as many Spark jobs as the same batch
    of a stage without one, through the driver the runner uses: the clock travels with the
    routed rows, and the driver's state holds the batch's newest event time."""
    jobs, clocks = [], []
    for name, stage in (("plain", replace(TIMED_STAGE, ttl=None, event_time=None)),
                        ("timed", TIMED_STAGE)):
        job = Job(tmp_path / name, 2)
        driver = KeyedStageDriver(spark, job.storage, str(job.job_id), MAX_PARALLELISM, 2,
                                  FullSnapshotPolicy(), str(job.local_dir))
        location = job.access.initialize_location_for_checkpoint(1)
        frame = timed_frame(spark, [("ann", 0), ("bob", 1)])
        spark.sparkContext.setJobGroup(name, name)
        try:
            state, result = driver.apply(driver.empty(stage), frame, 1,
                                         location.location_reference, 0)
            result.release()
        finally:
            spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
        jobs.append(len(spark.sparkContext.statusTracker().getJobIdsForGroup(name)))
        clocks.append(state.clock)
    assert (jobs[0], [None, T0 + dt.timedelta(hours=1)]) == (jobs[1], clocks)
    assert jobs[0] > 0


def fail_in_the_task(input: pa.Table, state: pa.Table) -> KeyedResult:
    raise RuntimeError("the stage fails")


def test_a_keyed_batch_is_one_spark_job_and_leaves_the_session_as_it_was(spark, job):
    """A batch's pass (route, shuffle, run the ranges, persist, collect the handles) is one
    Spark job, not one per stage of adaptive execution (a small batch pays each job's round
    trip); the output is read from it without another pass of the ranges; the session's
    adaptive setting is back as it was, also after a failed batch."""
    before = spark.conf.get("spark.sql.adaptive.enabled")
    frame = spark.createDataFrame([(u,) for u in BATCHES[0]], "user string")
    spark.sparkContext.setJobGroup("one-pass", "one-pass")
    try:
        result = apply_keyed_batch(frame, job.task(0))
        passes = len(spark.sparkContext.statusTracker().getJobIdsForGroup("one-pass"))
        output = sorted((r["user"], r["clicks"]) for r in result.output.collect())
        result.release()
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    assert (1, expected(1)[1][0]) == (passes, output)
    assert before == spark.conf.get("spark.sql.adaptive.enabled")
    failing = replace(job.task(1), stage=replace(STAGE, apply=fail_in_the_task))
    with pytest.raises(Exception, match="the stage fails"):
        apply_keyed_batch(frame, failing)
    assert before == spark.conf.get("spark.sql.adaptive.enabled")


def test_an_event_time_column_that_is_not_a_timestamp_is_refused(spark, job):
    """An event-time column of another type is refused, naming the stage and the column."""
    frame = spark.createDataFrame([("ann", "2026-03-10")], "user string, ts string")
    with pytest.raises(ValueError) as refused:
        apply_keyed_batch(frame, replace(job.task(0), stage=TIMED_STAGE, now=T0))
    assert ("keyed stage timed", "'ts'", "TIMESTAMP") == tuple(
        s for s in ("keyed stage timed", "'ts'", "TIMESTAMP") if s in str(refused.value))


def test_a_late_row_without_a_key_is_dropped_and_an_on_time_one_refused(spark, job):
    """A row without a key that the clock makes late is dropped like any late row; one on
    time fails the batch, saying keys must not be null."""
    run_timed(spark, job, 0, [("ann", 3)], None)
    output, _ = run_timed(spark, job, 1, [(None, 0), ("ann", 3.5)], T0 + dt.timedelta(hours=3))
    with pytest.raises(Exception) as refused:
        run_timed(spark, job, 2, [(None, 3.5)], T0 + dt.timedelta(hours=3.5))
    assert ([("ann", 2)], True) == (output, "must not be null" in str(refused.value))


def test_input_columns_that_route_rows_are_refused(spark, job):
    """An input column named like a routing column is refused, naming it."""
    frame = spark.createDataFrame([("ann", 1)], "user string, _rows long")
    with pytest.raises(ValueError) as refused:
        apply_keyed_batch(frame, job.task(0))
    assert "'_rows'" in str(refused.value)


def make_store(path: Path, written: float) -> Path:
    """A local store directory (a manifest and a segment) last written at ``written``."""
    path.mkdir(parents=True)
    for name in ("MANIFEST.json", "segment.arrow"):
        (path / name).write_text("x")
        os.utime(path / name, (written, written))
    os.utime(path, (written, written))
    return path


def test_idle_local_stores_of_any_job_are_swept_at_most_hourly(tmp_path):
    """Stores not written for the maximum age go, whichever job's; fresh ones, the caller's
    own, ones another task holds and non-stores stay, emptied job directories go; a second
    sweep within the hour does nothing."""
    now, day = 1_800_000_000.0, 86_400
    root = tmp_path / "pipelines-keyed"
    old = make_store(root / "job-a" / "clicks" / "m8-kg0-3", now - 8 * day)
    fresh = make_store(root / "job-b" / "clicks" / "m8-kg0-3", now - 1 * day)
    own = make_store(root / "job-b" / "clicks" / "m8-kg4-7", now - 9 * day)
    held = make_store(root / "job-c" / "dedupe" / "m8-kg0-7", now - 9 * day)
    stranger = make_store(root / "job-d" / "clicks" / "notes", now - 30 * day)
    with _Locked(held):
        first = sweep_idle_stores(root, dt.timedelta(days=7), keep=own, now=now)
    later = make_store(root / "job-e" / "clicks" / "m8-kg0-7", now - 8 * day)
    second = sweep_idle_stores(root, dt.timedelta(days=7), now=now + 1800)
    remaining = [p for p in (fresh, own, held, stranger, later) if p.exists()]
    third = sweep_idle_stores(root, dt.timedelta(days=7), now=now + 3700)
    assert ([old], [], [fresh, own, held, stranger, later], False, [own, held, later]) == (
        first, second, remaining, (root / "job-a").exists(), third)


def _wait_for_blocked_flock(path: Path, timeout: float = 30) -> None:
    """Until a process waits for a flock of ``path``: /proc/locks lists a blocked request as
    ``-> FLOCK ... <major>:<minor>:<inode> ...``."""
    inode = os.stat(path).st_ino
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if "->" in fields and fields[fields.index("->") + 1] == "FLOCK" \
                    and any(f.endswith(f":{inode}") for f in fields):
                return
        time.sleep(0.01)
    raise TimeoutError(f"nobody waited for the lock of {path} within {timeout} s")


@pytest.mark.timeout(60)
def test_a_lock_taken_on_a_swept_lock_file_is_taken_again(tmp_path):
    """A task that waited for a store's lock while a sweep removed the store and unlinked its
    lock file ends up holding the lock at the path: a third task cannot take it."""
    store = make_store(tmp_path / "job" / "clicks" / "m8-kg0-7", time.time())
    sweeper = _Locked(store).__enter__()
    got, release = threading.Event(), threading.Event()

    def waiter() -> None:
        with _Locked(store):
            got.set()
            release.wait(30)

    thread = threading.Thread(target=waiter)
    thread.start()
    # The waiter opened the old lock file and waits in flock (not a sleep: a slow start
    # would open the new file instead, and the test would not test the swept one).
    lock_file = store.with_name(store.name + ".lock")
    _wait_for_blocked_flock(lock_file)
    shutil.rmtree(store)
    store.with_name(store.name + ".lock").unlink()
    sweeper.__exit__(None, None, None)
    got.wait(30)
    with _Locked(store, blocking=False) as third:
        taken = third.held
    release.set()
    thread.join(30)
    assert (True, False) == (got.is_set(), taken)


@pytest.mark.timeout(180)
def test_a_store_locked_elsewhere_is_waited_for_at_most_the_lock_timeout(spark, job):
    """With range 0's store lock held by another process (as a stalled task holds it), a
    batch waits at most the task's ``local_lock_timeout``, then runs range 0 on a private copy
    rebuilt from the chain, leaving the locked store untouched; the next batch runs on that
    copy at once; once the lock is free the (stale) store is rebuilt and the copy swept.
    Outputs and state equal a recomputation."""
    timeout = dt.timedelta(seconds=1)

    def run(batch):
        return job.run(spark, batch, replace(job.task(batch), local_lock_timeout=timeout))

    outputs = [run(0)[0]]
    store = local_store_directory(job.task(0), KeyGroupRange(0, 3))
    manifest = (store / "MANIFEST.json").read_bytes()
    stalled = _Locked(store).__enter__()
    # On code that waits without bound, the batch would hang: release the lock after a
    # minute so that the test fails by its assertions instead.
    watchdog = threading.Timer(60, stalled.__exit__, (None, None, None))
    watchdog.start()
    try:
        seen = []
        for batch in (1, 2):
            output, ranges = run(batch)
            outputs.append(output)
            (first,) = [r for r in ranges if r.operator_index == 0]
            seen.append((first.private, first.rebuilt, first.lock_wait_seconds >= 1.0))
        untouched = manifest == (store / "MANIFEST.json").read_bytes()
    finally:
        watchdog.cancel()
        stalled.__exit__(None, None, None)
    output, ranges = run(3)
    outputs.append(output)
    (after,) = [r for r in ranges if r.operator_index == 0]
    copies = [p.name for p in store.parent.iterdir() if ".private-" in p.name]
    counts, batch_outputs = expected(4)
    assert ([(True, True, True), (True, False, False)], True, (False, True), []) == (
        seen, untouched, (after.private, after.rebuilt), copies)
    assert (counts, batch_outputs) == (job.state(), outputs)


def private_copy(store: Path, tag: str, written: float) -> Path:
    """A private copy of ``store`` (a store directory beside it), last written at ``written``."""
    return make_store(store.with_name(f"{store.name}.private-{tag * 32}"), written)


def test_private_copies_are_swept_once_no_task_needs_them_never_a_non_store(job):
    """``sweep_other_ranges`` removes the private copies of local stores that no task holds
    (one of another parallelism's range, the lock file a killed task left before making its
    copy), keeps a current range's copy while that range's store is held (it is the range's
    state for its next task) and removes it once the store is free; a copy in use and a
    directory named like a copy that is not a store stay."""
    now = time.time()
    task = job.task(0)
    store = make_store(local_store_directory(task, KeyGroupRange(0, 3)), now)
    other_store = local_store_directory(task, KeyGroupRange(4, 7))
    needed = private_copy(store, "a", now)
    busy = private_copy(other_store, "b", now)
    rescaled = private_copy(store.with_name("m8-kg0-1"), "c", now)
    orphan_lock = other_store.with_name(f"{other_store.name}.private-{'d' * 32}.lock")
    orphan_lock.touch()
    stranger = other_store.with_name(f"{other_store.name}.private-{'e' * 32}")
    stranger.mkdir()
    (stranger / "notes.txt").write_text("not a store")
    with _Locked(store), _Locked(busy):
        first = sorted(sweep_other_ranges(task))
    second = sweep_other_ranges(task)
    assert ([rescaled, orphan_lock.with_suffix("")], [needed, busy], False, True) == (
        first, sorted(second), orphan_lock.exists(), (stranger / "notes.txt").exists())


def test_idle_sweep_removes_private_copies_no_task_needs(tmp_path):
    """``sweep_idle_stores`` removes a private copy nobody holds whose store is free (a killed
    task's) however fresh, and an idle one even while its store is held; a fresh copy of a
    held store and a copy in use stay."""
    now, day = 1_800_000_000.0, 86_400
    root = tmp_path / "pipelines-keyed"
    free = private_copy(root / "job-a" / "clicks" / "m8-kg0-7", "a", now)
    held_store = make_store(root / "job-b" / "clicks" / "m8-kg0-7", now)
    needed = private_copy(held_store, "b", now)
    idle = private_copy(held_store, "c", now - 8 * day)
    busy = private_copy(root / "job-c" / "clicks" / "m8-kg0-7", "d", now)
    with _Locked(held_store), _Locked(busy):
        removed = sweep_idle_stores(root, dt.timedelta(days=7), now=now)
    assert ([free, idle], True, True) == (sorted(removed), needed.exists(), busy.exists())
