"""The stateful runner on local disk with DataFrame stages (the click-events example's
``STAGES``; keyed stages: test_keyed_runner.py): checkpoint and restore of stage state,
exactly-once recovery, savepoints and restore modes.

One uninterrupted run over three days (``baseline``) is the reference. Tests that need a
directory where the first days were already processed copy the baseline's checkpoints and
report up to that day (checkpoint state files are recorded relative to their checkpoint, so a
copied checkpoint directory restores) instead of processing those days again.
"""

import datetime as dt
import os
import re
import shutil
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import pytest

from checkpoint_storage import (
    ByteStreamStateHandle,
    FileSystemCheckpointStorage,
    RelativeFileStateHandle,
    RestoreMode,
)
from pipelines import (
    ClaimRefusedError,
    MissingStateError,
    PartitionResult,
    SourcePosition,
    StatefulRunner,
    empty_state,
    job_id_for,
)
from pipelines.examples.click_events import (
    NAME,
    STAGES,
    click_events_pipeline,
    generate_day,
)
from pipelines.examples.click_events.events import batch_urls
from pipelines.examples.click_events.stages import (
    DEDUPE_STATE_SCHEMA,
    EVENT_SCHEMA,
    USER_ACTIVITY_STATE_SCHEMA,
)
from tests.pipelines.support import InjectedFault, NoSpark, apply_batch_by_batch, rows, state_rows

D1, D2, D3, D4 = "2026-10-01", "2026-10-02", "2026-10-03", "2026-10-04"  # D4 landed empty
DAYS = (D1, D2, D3)
BATCHES = 3
INTERVAL = 2  # a mid-partition checkpoint after batch 2 of 3
INLINE = 1024 * 1024  # the largest threshold: every state here is inline
FILES = 0  # every state goes to a file
JOB = job_id_for(NAME).hex


def end_of(day: str) -> SourcePosition:
    return SourcePosition(day, BATCHES, True)


def mid_of(day: str) -> SourcePosition:
    return SourcePosition(day, INTERVAL, False)


def make_runner(
    spark,
    base: Path,
    landing: str,
    *,
    threshold: int = FILES,
    savepoints: Path | None = None,
    max_retained: int = 10,
    **kwargs,
) -> StatefulRunner:
    storage = FileSystemCheckpointStorage(
        str(base / "chk"),
        str(savepoints or base / "sp"),
        file_state_size_threshold=threshold,
    )
    pipeline = click_events_pipeline(
        landing,
        str(base / "report"),
        checkpoint_interval=INTERVAL,
        max_retained_checkpoints=max_retained,
        stages=STAGES,
    )
    return StatefulRunner(spark, storage, pipeline, **kwargs)


def restored_rows(runner: StatefulRunner, pointer: str, parallelism=None) -> dict:
    states = runner.restore_states(
        runner.storage.resolve_checkpoint(pointer).load_metadata(), parallelism
    )
    try:
        return state_rows(states)
    finally:
        for state in states.values():
            state.unpersist()


def report_rows(spark, base: Path) -> list[tuple]:
    return rows(spark.read.parquet(str(base / "report")))


def load(runner: StatefulRunner, pointer: str):
    return runner.storage.resolve_checkpoint(pointer).load_metadata()


# --- shared inputs -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def landing(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("landing"))
    for day in DAYS:
        generate_day(directory, day, batches=BATCHES, events_per_batch=200, users=20)
    generate_day(directory, D4, batches=0)
    return directory


@dataclass
class Baseline:
    base: Path
    results: list[PartitionResult]
    positions: list[SourcePosition]  # of the checkpoints on disk, oldest first
    pointers: dict[SourcePosition, str]
    parallelism: list[dict[str, int]]  # of the checkpoints on disk, per stage
    states: dict[str, dict]  # day -> stage -> rows at the end of that day
    report: list[tuple]

    def report_through(self, day: str) -> list[tuple]:
        return [r for r in self.report if r[-1] <= dt.date.fromisoformat(day)]

    def copy_through(self, dest: Path, day: str) -> Path:
        """``dest`` as a directory where the days up to ``day`` were processed: the
        baseline's checkpoints and report partitions up to the end of ``day``."""
        (dest / "chk" / JOB).mkdir(parents=True)
        for position, pointer in self.pointers.items():
            if position.partition <= day:
                shutil.copytree(pointer, dest / "chk" / JOB / Path(pointer).name)
        (dest / "report").mkdir()
        for partition in DAYS:
            if partition <= day:
                name = f"report_date={partition}"
                shutil.copytree(self.base / "report" / name, dest / "report" / name)
        return dest


@pytest.fixture(scope="module")
def baseline(spark, landing, tmp_path_factory) -> Baseline:
    """One uninterrupted run over the three days, every checkpoint retained."""
    base = tmp_path_factory.mktemp("baseline")
    runner = make_runner(spark, base, landing)
    results = runner.run(list(DAYS))
    checkpoints = runner.store.all()
    metadata = [load(runner, c.external_pointer) for c in checkpoints]
    positions = [SourcePosition.of(m) for m in metadata]
    pointers = dict(zip(positions, (c.external_pointer for c in checkpoints), strict=True))
    parallelism = [{op.operator_id: op.parallelism for op in m.operator_states} for m in metadata]
    states = {day: restored_rows(runner, pointers[end_of(day)]) for day in DAYS}
    report = report_rows(spark, base)
    return Baseline(base, results, positions, pointers, parallelism, states, report)


@pytest.fixture(scope="module")
def sample_states(spark, landing) -> dict:
    """The stages' state after the first day, computed without the runner, in 3 partitions."""
    events = spark.read.schema(EVENT_SCHEMA).parquet(*batch_urls(landing, D1))
    states = {}
    data = events
    for stage in STAGES:
        state, data = stage.apply(data, empty_state(spark, stage))
        states[stage.name] = state.repartition(3).localCheckpoint(eager=True)
    return states


# --- checkpoint and restore --------------------------------------------------------------


@pytest.mark.parametrize(
    ("threshold", "parallelism", "kind"),
    [
        (INLINE, None, ByteStreamStateHandle),
        (FILES, None, RelativeFileStateHandle),
        (FILES, 1, RelativeFileStateHandle),
        (FILES, 3, RelativeFileStateHandle),
    ],
)
def test_checkpoint_restore_round_trip(
    spark, landing, sample_states, tmp_path, threshold, parallelism, kind
):
    """A checkpoint restores to the same rows per stage, with inline or file handles, at the
    written or any other parallelism."""
    runner = make_runner(spark, tmp_path, landing, threshold=threshold)
    summary = runner.checkpoint(sample_states, end_of(D1))
    handles = load(runner, summary.pointer).all_handles()
    states = runner.restore_states(load(runner, summary.pointer), parallelism)
    partitions = {name: df.rdd.getNumPartitions() for name, df in states.items()}
    expected_partitions = {s.name: parallelism or 3 for s in STAGES}
    assert (
        state_rows(sample_states),
        {kind},
        expected_partitions,
    ) == (state_rows(states), {type(h) for h in handles}, partitions)


def test_checkpoint_summary_counts_rows_and_handles(spark, landing, sample_states, tmp_path):
    """The checkpoint summary reports each stage's rows and the files written."""
    runner = make_runner(spark, tmp_path, landing, threshold=FILES)
    summary = runner.checkpoint(sample_states, end_of(D1))
    assert (
        {name: df.count() for name, df in sample_states.items()},
        6,
        0,
        False,
    ) == (summary.state_rows, summary.files_written, summary.inline_states, summary.savepoint)


def test_empty_partitions_write_valid_empty_state(spark, landing, tmp_path):
    """Partitions without rows write a valid (empty) state file each: `_metadata` has one
    subtask state per partition, and the state restores to the same rows."""
    t = dt.datetime(2026, 3, 1, tzinfo=dt.UTC)
    states = {
        "dedupe": spark.createDataFrame([("e1", t), ("e2", t)], DEDUPE_STATE_SCHEMA)
        .repartition(5)
        .localCheckpoint(eager=True),
        "user_activity": spark.createDataFrame(
            [("u1", 1, Decimal("1.00"), t, t)], USER_ACTIVITY_STATE_SCHEMA
        )
        .repartition(4)
        .localCheckpoint(eager=True),
    }
    runner = make_runner(spark, tmp_path, landing, threshold=FILES)
    summary = runner.checkpoint(states, end_of(D1))
    metadata = load(runner, summary.pointer)
    layout = {
        op.operator_id: (
            op.parallelism,
            sorted(op.subtask_states),
            [len(s.handles) for s in op.subtask_states.values()],
        )
        for op in metadata.operator_states
    }
    assert (
        {"dedupe": (5, [0, 1, 2, 3, 4], [1] * 5), "user_activity": (4, [0, 1, 2, 3], [1] * 4)},
        state_rows(states),
    ) == (layout, restored_rows(runner, summary.pointer))


def test_state_without_rows_restores_empty(spark, landing, tmp_path):
    """A state with no rows at all (no partitions) checkpoints and restores as empty, with the
    stage's columns."""
    states = {stage.name: empty_state(spark, stage) for stage in STAGES}
    runner = make_runner(spark, tmp_path, landing, threshold=FILES)
    summary = runner.checkpoint(states, end_of(D1))
    restored = runner.restore_states(load(runner, summary.pointer))
    assert (
        {"dedupe": [], "user_activity": []},
        {
            "dedupe": DEDUPE_STATE_SCHEMA.fieldNames(),
            "user_activity": USER_ACTIVITY_STATE_SCHEMA.fieldNames(),
        },
    ) == (state_rows(restored), {name: df.columns for name, df in restored.items()})


def test_state_file_names_carry_stage_partition_and_attempt(
    spark, landing, sample_states, tmp_path
):
    """Each state file is ``<stage>-<partition:05d>-a<attempt>-<hex>`` in the checkpoint's
    directory, for the partition that wrote it."""
    runner = make_runner(spark, tmp_path, landing, threshold=FILES)
    summary = runner.checkpoint(sample_states, end_of(D1))
    metadata = load(runner, summary.pointer)
    pattern = re.compile(r"(?P<stage>[a-z_]+)-(?P<part>\d{5})-a(?P<attempt>\d+)-[0-9a-f]{32}")
    found, expected = [], []
    for op in metadata.operator_states:
        for subtask, state in op.subtask_states.items():
            for handle in state.handles:
                directory, _, name = handle.path.rpartition("/")
                match = pattern.fullmatch(name)
                found.append(
                    (directory, match and (match["stage"], int(match["part"]), match["attempt"]))
                )
                expected.append((summary.pointer, (op.operator_id, subtask, "0")))
    assert sorted(expected) == sorted(found)


def test_task_failing_after_its_write_fails_and_disposes_the_checkpoint(
    spark, landing, sample_states, tmp_path
):
    """When a partition task fails after writing its state, the checkpoint fails: its
    directory is disposed, nothing is added to the store, and the next checkpoint works."""

    def crash(subtask, attempt):
        if subtask == 1:
            raise RuntimeError("task lost after writing its state")

    failing = make_runner(spark, tmp_path, landing, task_after_write=crash)
    with pytest.raises(Exception, match="task lost after writing its state"):
        failing.checkpoint(sample_states, end_of(D1))
    job_dir = tmp_path / "chk" / JOB
    left = sorted(p.name for p in job_dir.iterdir())
    runner = make_runner(spark, tmp_path, landing)
    summary = runner.checkpoint(sample_states, end_of(D1))
    assert (["shared", "taskowned"], [], state_rows(sample_states)) == (
        left,
        failing.store.all(),
        restored_rows(runner, summary.pointer),
    )


def test_checkpoints_hold_the_source_position(baseline):
    """Each checkpoint's master state holds the source position it was taken at: mid-partition
    every checkpoint_interval batches, and at each partition's end."""
    assert [p for day in DAYS for p in (mid_of(day), end_of(day))] == baseline.positions


def test_state_files_per_checkpoint_stay_bounded(spark, baseline):
    """However many batches the state has seen, a checkpoint writes at most
    spark.sql.shuffle.partitions state files per stage."""
    limit = int(spark.conf.get("spark.sql.shuffle.partitions"))
    assert [] == [p for p in baseline.parallelism if max(p.values()) > limit]


def test_partition_results_chain_the_checkpoints(baseline):
    """Each partition result starts from the previous one's final checkpoint and applies all
    of its batches; the first starts from nothing."""
    results = baseline.results
    assert (
        [None, results[0].checkpoint.pointer, results[1].checkpoint.pointer],
        [BATCHES] * 3,
        [[mid_of(d), end_of(d)] for d in DAYS],
    ) == (
        [r.restored_from for r in results],
        [r.batches_applied for r in results],
        [[c.position for c in r.checkpoints_taken] for r in results],
    )


def test_uninterrupted_run_equals_applying_each_batch_once(spark, landing, baseline):
    """The runner's state and report equal those of applying the stages to each batch once,
    in order."""
    expected_states, expected_report = apply_batch_by_batch(spark, landing, (D1, D2))
    assert (expected_states, expected_report) == (
        baseline.states[D2],
        baseline.report_through(D2),
    )


# --- exactly once ------------------------------------------------------------------------


def fail_after_batch(partition: str, batch: int):
    def hook(point, **info):
        if point == "batch_applied" and info == {"partition": partition, "batch": batch}:
            raise InjectedFault(f"after batch {batch} of {partition}")

    return hook


def fail_checkpoint(partition: str, nth: int):
    """Fails the ``nth`` checkpoint taken while processing ``partition`` between its state
    writes and its `_metadata`; the exception carries the checkpoint id."""
    seen = {"partition": None, "count": 0}

    def hook(point, **info):
        if point == "batch_applied":
            seen["partition"] = info["partition"]
        elif point == "before_metadata" and seen["partition"] == partition:
            seen["count"] += 1
            if seen["count"] == nth:
                raise InjectedFault(info["checkpoint_id"])

    return hook


def test_recovery_after_a_fault_mid_partition_is_exactly_once(spark, landing, baseline, tmp_path):
    """After a crash past a mid-partition checkpoint, a fresh runner resumes from that
    checkpoint, applies only the remaining batches, and ends with the same state and report
    as the uninterrupted run."""
    base = baseline.copy_through(tmp_path, D1)
    crashed = make_runner(spark, base, landing, fault_hook=fail_after_batch(D2, BATCHES - 1))
    with pytest.raises(InjectedFault):
        crashed.run([D2])
    mid = crashed.store.latest()
    recovery = make_runner(spark, base, landing)
    (result,) = recovery.run([D2])
    assert (
        mid_of(D2),
        (mid.external_pointer, BATCHES - INTERVAL),
        baseline.states[D2],
        baseline.report_through(D2),
    ) == (
        SourcePosition.of(load(recovery, mid.external_pointer)),
        (result.restored_from, result.batches_applied),
        restored_rows(recovery, result.checkpoint.pointer),
        report_rows(spark, base),
    )


@pytest.mark.parametrize(
    ("nth", "restored", "applied"),
    [(1, end_of(D1), BATCHES), (2, mid_of(D2), BATCHES - INTERVAL)],
    ids=["mid-partition-checkpoint", "final-checkpoint"],
)
def test_recovery_after_a_fault_before_metadata_is_exactly_once(
    spark, landing, baseline, tmp_path, nth, restored, applied
):
    """A checkpoint that fails between its state writes and `_metadata` is invisible (its
    directory is disposed) and recovery resumes from the checkpoint before it, ending with
    the same state and report as the uninterrupted run."""
    base = baseline.copy_through(tmp_path, D1)
    crashed = make_runner(spark, base, landing, fault_hook=fail_checkpoint(D2, nth))
    with pytest.raises(InjectedFault) as failure:
        crashed.run([D2])
    failed_dir = base / "chk" / JOB / f"chk-{failure.value.args[0]}"
    failed_dir_left = failed_dir.exists()  # before recovery, which may reuse its id
    recovery = make_runner(spark, base, landing)
    visible = {SourcePosition.of(c.metadata): c.external_pointer for c in recovery.store.all()}
    (result,) = recovery.run([D2])
    assert (
        False,
        [mid_of(D1), end_of(D1), mid_of(D2)][: 2 + nth - 1],
        (visible.get(restored), applied),
        baseline.states[D2],
        baseline.report_through(D2),
    ) == (
        failed_dir_left,
        list(visible),
        (result.restored_from, result.batches_applied),
        restored_rows(recovery, result.checkpoint.pointer),
        report_rows(spark, base),
    )


def test_rerunning_a_completed_partition_replaces_it(spark, landing, baseline, tmp_path):
    """Running a completed partition again resumes from its retained mid-partition
    checkpoint and replaces its report: no duplicate rows, the same final state."""
    base = baseline.copy_through(tmp_path, D3)
    (result,) = make_runner(spark, base, landing).run([D3])
    assert (
        BATCHES - INTERVAL,
        baseline.report,
        baseline.states[D3],
    ) == (
        result.batches_applied,
        report_rows(spark, base),
        restored_rows(make_runner(spark, base, landing), result.checkpoint.pointer),
    )


def test_an_empty_day_completes_without_changing_state(spark, landing, baseline, tmp_path):
    """A day that landed without batches ends at its end position with the state unchanged,
    and reports every user as inactive on it."""
    base = baseline.copy_through(tmp_path, D3)
    (result,) = make_runner(spark, base, landing).run([D4])
    day = dt.date.fromisoformat(D4)
    expected_report = [(*r, False, day) for r in baseline.states[D3]["user_activity"]]
    assert (
        (0, SourcePosition(D4, 0, True)),
        baseline.states[D3],
        sorted(baseline.report + expected_report),
    ) == (
        (result.batches_applied, result.checkpoint.position),
        restored_rows(make_runner(spark, base, landing), result.checkpoint.pointer),
        report_rows(spark, base),
    )


# --- missing state -----------------------------------------------------------------------


def test_missing_previous_partition_fails_naming_it(landing, tmp_path):
    """A partition whose previous partition's state exists nowhere fails before any Spark
    work, naming the previous partition."""
    runner = make_runner(NoSpark(), tmp_path, landing)
    with pytest.raises(MissingStateError) as failure:
        runner.run([D3])
    assert f"processing {D3} of pipeline {NAME} needs the state after {D2}" in str(failure.value)
    assert f"materialize {D2} first" in str(failure.value)


# --- savepoints --------------------------------------------------------------------------


@dataclass
class Savepoint:
    base: Path  # where the savepoint's source checkpoints live
    directory: Path  # the savepoint directory
    summary: object


@pytest.fixture(scope="module")
def savepoint(spark, landing, baseline, tmp_path_factory) -> Savepoint:
    """A savepoint of the state at the end of D2, in its own savepoint directory."""
    base = baseline.copy_through(tmp_path_factory.mktemp("savepoint"), D2)
    runner = make_runner(spark, base, landing)
    return Savepoint(base, base / "sp", runner.take_savepoint())


def test_take_savepoint_is_self_contained(spark, landing, baseline, savepoint, tmp_path):
    """take_savepoint writes every state file into the savepoint's own directory, recorded
    relative to it, so that a copy of that directory elsewhere restores the same state."""
    summary = savepoint.summary
    runner = make_runner(spark, savepoint.base, landing)
    handles = load(runner, summary.pointer).all_handles()
    files = [h for h in handles if not isinstance(h, ByteStreamStateHandle)]
    placement = {
        (type(h).__name__, h.path == f"{summary.pointer}/{h.relative_path}") for h in files
    }
    moved = tmp_path / "moved"
    shutil.copytree(summary.pointer, moved)
    assert (
        (True, end_of(D2), str(savepoint.directory)),
        (len(handles), {("RelativeFileStateHandle", True)}),
        baseline.states[D2],
    ) == (
        (summary.savepoint, summary.position, str(Path(summary.pointer).parent)),
        (len(files), placement),
        restored_rows(runner, str(moved)),
    )


def test_missing_state_names_a_fitting_savepoint(landing, savepoint, tmp_path):
    """Without a checkpoint to start from, the error names the savepoint in the savepoint
    directory that fits the partition."""
    runner = make_runner(NoSpark(), tmp_path, landing, savepoints=savepoint.directory)
    with pytest.raises(MissingStateError) as failure:
        runner.run([D3])
    assert f"restore_from: {savepoint.summary.pointer}" in str(failure.value)


def test_missing_state_does_not_name_a_savepoint_that_does_not_fit(landing, savepoint, tmp_path):
    """A savepoint that does not fit the partition is not offered as a backfill source."""
    runner = make_runner(NoSpark(), tmp_path, landing, savepoints=savepoint.directory)
    with pytest.raises(MissingStateError) as failure:
        runner.run([D2])
    message = str(failure.value)
    assert (False, True) == (savepoint.summary.pointer in message, f"materialize {D1}" in message)


def test_restore_from_a_snapshot_that_does_not_fit_fails_before_spark_work(
    landing, savepoint, tmp_path
):
    """restore_from a snapshot whose position does not fit the partition raises
    MissingStateError naming it and its position, before any Spark work."""
    runner = make_runner(NoSpark(), tmp_path, landing, savepoints=savepoint.directory)
    with pytest.raises(MissingStateError) as failure:
        runner.run([D2], restore_from=savepoint.summary.pointer)
    assert f"{savepoint.summary.pointer} holds the state at end of {D2}" in str(failure.value)


def test_run_continues_from_a_savepoint_in_a_fresh_checkpoint_directory(
    spark, landing, baseline, savepoint, tmp_path
):
    """run(restore_from=savepoint) processes the next partition from the savepoint's state in
    a fresh checkpoint directory and ends as the uninterrupted run did; NO_CLAIM keeps the
    savepoint even once retention dropped it from the store."""
    runner = make_runner(spark, tmp_path, landing, savepoints=savepoint.directory, max_retained=1)
    (result,) = runner.run([D3], restore_from=savepoint.summary.pointer)
    assert (
        (savepoint.summary.pointer, BATCHES),
        str(tmp_path / "chk" / JOB),
        baseline.states[D3],
        True,
    ) == (
        (result.restored_from, result.batches_applied),
        str(Path(result.checkpoint.pointer).parent),
        restored_rows(runner, result.checkpoint.pointer),
        os.path.exists(f"{savepoint.summary.pointer}/_metadata"),
    )


def test_no_claim_never_deletes_the_restored_checkpoint_and_claim_of_it_is_refused(
    spark, landing, baseline, tmp_path
):
    """Restoring from a checkpoint in another checkpoint directory: NO_CLAIM never deletes it,
    even once retention dropped it from the store; CLAIM of it (it is not in this pipeline's
    job directory, so another job owns it) is refused before anything runs."""
    source = baseline.copy_through(tmp_path / "source", D3)
    pointer = str(source / "chk" / JOB / Path(baseline.pointers[mid_of(D3)]).name)
    runner = make_runner(spark, tmp_path / "new", landing, max_retained=1)
    with pytest.raises(ClaimRefusedError, match="use NO_CLAIM"):
        runner.run([D3], restore_from=pointer, restore_mode=RestoreMode.CLAIM)
    (result,) = runner.run([D3], restore_from=pointer, restore_mode=RestoreMode.NO_CLAIM)
    assert ((pointer, BATCHES - INTERVAL), True, [end_of(D3)]) == (
        (result.restored_from, result.batches_applied),
        os.path.exists(pointer),
        [SourcePosition.of(c.metadata) for c in runner.store.all()],
    )


# --- one writer per pipeline: the job lease ------------------------------------------------


@pytest.mark.timeout(600)
def test_a_run_holds_the_job_lease_and_records_its_epoch(spark, landing, tmp_path):
    """While another coordinator holds the pipeline's lease a run fails at once naming the
    holder and writes nothing; once it is released, the run's `_metadata` records the epoch
    of the lease it held, and the lease is released when the run ends."""
    from checkpoint_storage import JobLeaseHeldError, read_job_lease, url_to_fs

    runner = make_runner(spark, tmp_path, landing, lease_owner="run-b", lease_wait=0)
    other = runner.storage.create_checkpoint_storage(runner.job_id)
    other.initialize_base_locations()
    with other.acquire_job_lease("run-a"), pytest.raises(JobLeaseHeldError, match="run-a"):
        runner.run([D1])
    assert runner.access.latest_completed_checkpoint() is None

    (result,) = runner.run([D1])

    epochs = {load(runner, c.pointer).lease_epoch for c in result.checkpoints_taken}
    record = read_job_lease(*url_to_fs(runner.access.checkpoints_directory))
    assert ({record.epoch}, "run-b", True) == (epochs, record.owner, record.released)
