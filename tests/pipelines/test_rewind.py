"""Rewinds that lose nothing and partition ends kept for time travel (issue 25, items 2 and 3),
on real Spark (local[2]) with a small keyed stage over hourly partitions, one or two batches
each, checked against a dict recomputation."""

from pathlib import Path

import pytest

from pipelines import (
    SourcePosition,
)
from sensors import retained_snapshots, retained_table
from tests.pipelines.hourly import (
    collect,
    expected,
    hour,
    hours,
    on_disk,
    pipeline,
    read_as_of,
    referenced,
    run_list_cli,
    runner_of,
    state_at,
)
from tests.pipelines.support import run_read_cli


@pytest.mark.timeout(300)
def test_a_rewind_keeps_the_head_and_says_so(spark, tmp_path):
    """Run 8 hourly partitions, backfill 3-5 from a savepoint at the end of 2 (retention 2,
    no partition ends kept: the newest ids are then the backfill's, at earlier positions),
    then continue with 9: the head at the end of 8 survives retention and garbage collection,
    restores and equals the recomputation, the run says it rewound and where the head is
    kept, and 9 continues from it without recomputing 6-8."""
    spec = pipeline(max_retained_checkpoints=2)
    runner = runner_of(spark, tmp_path, spec)
    runner.run(hours(1, 2))
    savepoint = runner.take_savepoint().pointer
    first = runner.run(hours(3, 8))
    head = first[-1].checkpoint.pointer

    lines: list[str] = []
    backfill = runner_of(spark, tmp_path, spec)
    rewind = backfill.run(hours(3, 5), restore_from=savepoint, on_progress=lines.append)
    retained = [c.external_pointer for c in backfill.store.all()]
    assert head in retained and retained[-1] == rewind[-1].checkpoint.pointer
    note = (f"rewound from end of {hour(8)} to end of {hour(2)}; the head is kept at {head} "
            f"(a run of {hour(9)} continues from it)")
    assert note in lines
    assert rewind[0].rewound == note and rewind[1].rewound is None
    collect(backfill)
    assert on_disk(Path(backfill.access.checkpoints_directory)) == referenced(backfill)
    assert state_at(backfill, head) == expected(hours(1, 8))
    assert state_at(backfill, rewind[-1].checkpoint.pointer) == expected(hours(1, 5))

    lines.clear()
    later = runner_of(spark, tmp_path, spec).run([hour(9)], on_progress=lines.append)
    assert later[0].restored_from == head and later[0].rewound is None
    assert not any("rewound" in line for line in lines)
    assert state_at(backfill, later[-1].checkpoint.pointer) == expected(hours(1, 9))


@pytest.mark.timeout(300)
def test_retention_keeps_the_last_partition_ends_and_gc_exactly_their_files(spark, tmp_path):
    """Two batches per partition, a checkpoint after each: with 2 retained and the ends of
    the last 4 partitions, exactly the newest two and those ends stay (listed by id), and
    the job directory holds exactly the files they reference (keyed chains snapshot every
    3 change files, so files go while others are shared)."""
    spec = pipeline(batches=2, max_retained_checkpoints=2, retain_partition_ends=4)
    runner = runner_of(spark, tmp_path, spec)
    results = runner.run(hours(1, 8))
    ids = {p.partition: [c.checkpoint_id for c in p.checkpoints_taken] for p in results}
    assert ids[hour(1)] == [1, 2] and ids[hour(8)] == [15, 16]
    # newest two: 15, 16; ends of hours 5-8: 10, 12, 14, 16
    assert [c.checkpoint_id for c in runner.store.all()] == [10, 12, 14, 15, 16]
    reopened = runner_of(spark, tmp_path, spec)
    assert [c.checkpoint_id for c in reopened.store.all()] == [10, 12, 14, 15, 16]
    job_dir = Path(runner.access.checkpoints_directory)
    assert sorted(p.name for p in job_dir.glob("chk-*")) == [
        "chk-10", "chk-12", "chk-14", "chk-15", "chk-16"]
    collect(runner)
    assert on_disk(job_dir) == referenced(runner)
    for n in range(5, 9):
        assert read_as_of(job_dir, hour(n)) == expected(hours(1, n), batches=2)
    # The retained table (Dagster) and `checkpoints list` mark the boundaries.
    snapshots = retained_snapshots(runner.storage, spec.name)
    assert [(s.checkpoint_id, s.partition_end) for s in snapshots] == [
        (10, True), (12, True), (14, True), (15, False), (16, True)]
    marks = [r.data["position"].endswith(" end") for r in retained_table(snapshots).records]
    assert marks == [True] * 3 + [False, True]
    listed = run_list_cli(str(job_dir))
    assert listed.count("partition end (2 batches)") == 4, listed


@pytest.mark.timeout(300)
def test_time_travel_over_48_hourly_partition_ends(spark, tmp_path):
    """50 hourly partitions with the ends of the last 48 kept: every retained end reads
    (``--as-of``) and restores equal to the recomputation, a backfill from the oldest one
    works without a savepoint (and keeps the head), the job directory holds exactly the files
    the retained checkpoints reference, and ``--as-of`` an hour no longer kept names the
    retained ends."""
    spec = pipeline(max_retained_checkpoints=1, retain_partition_ends=48)
    runner = runner_of(spark, tmp_path, spec)
    results = runner.run(hours(1, 50))
    ends = {SourcePosition.of(c.metadata).partition: c.external_pointer
            for c in runner.store.all()}
    assert sorted(ends) == hours(3, 50)
    assert [c.checkpoint_id for c in runner.store.all()] == list(range(3, 51))
    job_dir = Path(runner.access.checkpoints_directory)
    collect(runner)
    assert on_disk(job_dir) == referenced(runner)
    for n in range(3, 51):
        want = expected(hours(1, n))
        assert read_as_of(job_dir, hour(n)) == want, hour(n)
        assert state_at(runner, ends[hour(n)]) == want, hour(n)

    missing = run_read_cli(str(job_dir), "--stage", "counts", "--as-of", hour(2))
    assert missing.exit_code == 3
    message = " ".join(missing.output.split())
    assert f"end of {hour(2)}" in message and f"{hour(3)}, {hour(4)}" in message

    lines: list[str] = []
    backfill = runner_of(spark, tmp_path, spec).run(hours(4, 5), on_progress=lines.append)
    assert backfill[0].restored_from == ends[hour(3)]
    assert backfill[0].rewound == (
        f"rewound from end of {hour(50)} to end of {hour(3)}; the head is kept at "
        f"{results[-1].checkpoint.pointer} (a run of {hour(51)} continues from it)")
    after = runner_of(spark, tmp_path, spec)
    assert results[-1].checkpoint.pointer in [c.external_pointer for c in after.store.all()]
    assert state_at(after, backfill[-1].checkpoint.pointer) == expected(hours(1, 5))
