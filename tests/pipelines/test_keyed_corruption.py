"""A corrupt checkpoint file always has a way out (issue 24): the integrity check names it,
a warm run writes a new full snapshot of its range from the local store, a cold run fails naming the
newest retained checkpoint that verifies, and restoring that equals a recomputation. Real
Spark (local[2]), real StatefulRunner, the check on a real Dagster instance."""

import dataclasses
import random
import re
import shutil
import sys
import tempfile
import uuid
from collections import Counter
from pathlib import Path

import dagster as dg
import pytest
from pyspark import cloudpickle
from pyspark.sql import functions as F
from pyspark.sql import types as T

from pipelines import (
    CorruptStateError,
    FullSnapshotPolicy,
    KeyedStage,
    Stage,
    StatefulPipeline,
    StatefulRunner,
    check_restore_from,
    job_id_for,
)
from sensors import pipeline_definitions
from tests.pipelines.support import (
    SOURCE,
    TOTALS,
    customer_totals,
    expected,
    materialize_range,
    resources_for,
    state_of,
    storage_of,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

PARTITIONS = [f"p{i}" for i in range(1, 4)]


def totals(tmp_path: Path, **options) -> StatefulPipeline:
    """The keyed totals without sinks, change files kept in chains (no full snapshot
    unless asked), a name of its own: its local stores (below the temp directory when Dagster
    runs it) are nobody else's."""
    options = {"checkpoint_interval": 2, "max_parallelism": 16, "max_retained_checkpoints": 4,
               "full_snapshot": FullSnapshotPolicy(every=100, small_every=None)} | options
    return StatefulPipeline(
        name=f"corrupt_{uuid.uuid4().hex[:8]}",
        stages=[KeyedStage("totals", "customer", TOTALS, customer_totals)],
        source=SOURCE, partitions=dg.StaticPartitionsDefinition(PARTITIONS), **options)


def runner(spark, tmp_path: Path, pipeline: StatefulPipeline, local: str) -> StatefulRunner:
    return StatefulRunner(spark, storage_of(tmp_path), pipeline,
                          keyed_local_dir=str(tmp_path / local))


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def files_of(checkpoint) -> set[str]:
    return {h.path for h in checkpoint.metadata.all_handles() if hasattr(h, "path")}


def last_change_file(checkpoint, subtask: int = 0) -> Path:
    (operator,) = checkpoint.metadata.operator_states
    return Path(operator.subtask_states[subtask].handles[-1].path)


@pytest.mark.timeout(300)
def test_warm_store_repairs_a_corrupt_change_file_the_check_names(spark, tmp_path):
    """A flipped bit in a change file of the newest checkpoint: the check fails naming the
    file, the stage, its key groups and what the next run does; the next run (warm local
    stores) writes a new full snapshot of that range first, its checkpoints reference no corrupt
    file, its check passes, and its state equals a recomputation."""
    pipeline = totals(tmp_path)
    resources = resources_for(tmp_path, file_state_size_threshold=0)
    defs = dg.Definitions.merge(pipeline_definitions(pipeline), dg.Definitions(
        resources=resources))
    local = Path(tempfile.gettempdir()) / "pipelines-keyed" / str(job_id_for(pipeline.name))
    try:
        with dg.instance_for_test() as instance:
            first = materialize_range(instance, resources, "p1", "p1", pipeline=pipeline,
                                      landing=None)
            assert first.success
            probe = runner(spark, tmp_path, pipeline, "unused")
            victim = last_change_file(probe.store.latest())
            flip_a_bit(victim)

            check = defs.resolve_job_def(f"{pipeline.name}_integrity_job").execute_in_process(
                instance=instance, raise_on_error=False)
            (evaluation,) = check.get_asset_check_evaluations()
            meta = {k: v.value for k, v in evaluation.metadata.items()}
            assert (False, dg.AssetCheckSeverity.ERROR) == (evaluation.passed,
                                                           evaluation.severity)
            assert str(victim) in meta["bad_files"]
            assert "stage totals key groups 0-7" in meta["damaged"]
            assert "writes new full snapshots of totals key groups 0-7" in meta["next_run"]

            second = materialize_range(instance, resources, "p2", "p2", pipeline=pipeline,
                                       landing=None)
            assert second.success
            (evaluation,) = second.get_asset_check_evaluations()
            after = runner(spark, tmp_path, pipeline, "unused")
            written = [c for c in after.store.all() if c.checkpoint_id > 2]
            assert (True, 2, set()) == (
                evaluation.passed, len(written),
                {str(victim)} & set().union(*map(files_of, written)))
            assert expected(["p1", "p2"]) == state_of(after)
    finally:
        shutil.rmtree(local, ignore_errors=True)


@pytest.mark.timeout(300)
def test_cold_run_names_the_intact_older_checkpoint_and_restoring_it_works(spark, tmp_path):
    """A change file only the newest checkpoint references is corrupt and no local store
    holds its range: the run fails before any batch naming the newest retained checkpoint
    that verifies (inside p2) and the partitions to run; that restore_from is accepted by
    the Dagster run config's check and by the runner, and equals a recomputation."""
    pipeline = totals(tmp_path)
    runner(spark, tmp_path, pipeline, "warm").run(["p1", "p2"])
    done = runner(spark, tmp_path, pipeline, "warm").store
    newest, intact = done.all()[-1], done.all()[-2]
    flip_a_bit(last_change_file(newest))
    cold = runner(spark, tmp_path, pipeline, "cold")
    lines = []

    with pytest.raises(CorruptStateError) as failed:
        cold.run(["p3"], on_progress=lines.append)

    message = str(failed.value)
    assert str(last_change_file(newest)) in message
    assert "stage totals key groups 0-7" in message
    assert f"from p2 through p3 with restore_from={intact.external_pointer}" in message
    assert not [line for line in lines if "batch" in line]  # failed before any batch
    assert "p2 after batch 2" == str(check_restore_from(
        storage_of(tmp_path), intact.external_pointer, "p2", pipeline))
    restored = runner(spark, tmp_path, pipeline, "cold")
    restored.run(["p2", "p3"], restore_from=intact.external_pointer)
    assert expected(PARTITIONS) == state_of(restored)


def count_rows(input, state):
    return state.union(input.agg(F.count("*").alias("n"))).agg(
        F.sum("n").cast("long").alias("n")), input


def test_a_corrupt_dataframe_stage_snapshot_names_the_intact_checkpoint(spark, tmp_path):
    """A DataFrame stage's snapshot file flipped: its snapshot is its only copy, so even a
    warm run fails before any batch, naming the newest retained checkpoint that verifies."""
    base = totals(tmp_path)
    pipeline = dataclasses.replace(base, stages=[*base.stages, Stage(
        "seen", T.StructType([T.StructField("n", T.LongType())]), count_rows, input="source")])
    runner(spark, tmp_path, pipeline, "warm").run(["p1"])
    intact, newest = runner(spark, tmp_path, pipeline, "warm").store.all()[-2:]
    seen = next(op for op in newest.metadata.operator_states if op.operator_id == "seen")
    victim = Path(seen.subtask_states[0].handles[0].path)
    flip_a_bit(victim)

    with pytest.raises(CorruptStateError) as failed:
        runner(spark, tmp_path, pipeline, "warm").run(["p2"])

    assert str(victim) in str(failed.value) and "stage seen subtask 0" in str(failed.value)
    assert f"from p1 through p2 with restore_from={intact.external_pointer}" in str(
        failed.value)


# --- reliability: random damage between runs ------------------------------------------------

ROUNDS = 10
DAYS = [f"d{i:02d}" for i in range(1, ROUNDS + 2)]
BATCHES = 1


@dataclasses.dataclass(frozen=True)
class TwoBatches(type(SOURCE)):
    def batches(self, spark, partition):
        return [f"{partition}-{i:03d}" for i in range(BATCHES)]


def recomputed(days: list[str]) -> dict[str, tuple[int, int]]:
    source, orders, total = TwoBatches(), Counter(), Counter()
    for day in days:
        for batch in source.batches(None, day):
            for customer, amount in source.rows(batch):
                orders[customer] += 1
                total[customer] += amount
    return {c: (orders[c], total[c]) for c in orders}


def damage(rng: random.Random, checkpoint) -> str:
    """Flip a bit in, truncate or delete one state file of ``checkpoint``."""
    path = Path(rng.choice(sorted(files_of(checkpoint))))
    how = rng.choice(["flip", "truncate", "delete"])
    if not path.exists():
        return f"{how} {path.name} (gone already)"
    if how == "flip":
        data = bytearray(path.read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[: rng.randrange(len(path.read_bytes()))])
    else:
        path.unlink()
    return f"{how} {path.name}"


@pytest.mark.timeout(600)
def test_random_damage_between_runs_never_commits_wrong_state(spark, tmp_path):
    """Seeded, after a savepoint of the first day: before each of 10 runs (one day each, on
    the previous run's local stores or on none, at random) one file of the newest checkpoint
    is damaged (a bit flipped, truncated or deleted). Each run either commits the recomputed
    state, or fails naming a restore_from whose run then commits it: wrong values committed
    0."""
    rng = random.Random(24)
    pipeline = totals(tmp_path, checkpoint_interval=1, max_retained_checkpoints=4,
                      full_snapshot=FullSnapshotPolicy(every=3, min_bytes=0))
    pipeline = dataclasses.replace(pipeline, source=TwoBatches(),
                                   partitions=dg.StaticPartitionsDefinition(DAYS))
    local = "local-0"
    first = runner(spark, tmp_path, pipeline, local)
    first.run(DAYS[:1])
    first.take_savepoint()  # a way out when every retained checkpoint shares a damaged file
    outcomes, wrong = Counter(), 0
    for number, day in enumerate(DAYS[1:], start=1):
        newest = runner(spark, tmp_path, pipeline, "probe").store.latest()
        what = damage(rng, newest)
        # warm: the local stores of the previous run; cold: none
        warm = rng.random() < 0.6
        local = local if warm else f"local-{number}"
        attempt = runner(spark, tmp_path, pipeline, local)
        try:
            attempt.run([day])
            outcome = "committed"
        except CorruptStateError as exc:
            match = re.search(r"from (\S+) through \S+ with restore_from=(\S+)|run \S+ with "
                              r"restore_from=(\S+)", str(exc))
            assert match, f"round {number} ({what}): no way out in {exc}"
            start = match.group(1) or day
            pointer = match.group(2) or match.group(3)
            attempt = runner(spark, tmp_path, pipeline, local)
            attempt.run(DAYS[DAYS.index(start):number + 1], restore_from=pointer)
            outcome = "failed naming restore_from, which committed"
        outcomes[f"{'warm' if warm else 'cold'}: {outcome}"] += 1
        wrong += state_of(attempt) != recomputed(DAYS[:number + 1])
    print(f"random damage, {ROUNDS} rounds: {dict(outcomes)}; wrong values committed: {wrong}")
    assert (ROUNDS, 0) == (sum(outcomes.values()), wrong)
