"""Keyed stages run by the StatefulRunner on real Spark (local[2]): per-customer totals as a
keyed stage, checked against a dict recomputation across checkpoints, restarts, rescaling,
savepoints, NO_CLAIM restores and retention."""

import datetime as dt
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark import cloudpickle

from checkpoint_storage import RestoreMode, is_appended_segment
from pipelines import (
    ClaimRefusedError,
    FullSnapshotPolicy,
    KeyedResult,
    KeyedStage,
    Source,
    StatefulPipeline,
    StatefulRunner,
    StateTtl,
    read_state,
)
from pipelines.keyed import compute_key_group_range_for_operator_index
from tests.pipelines.support import (
    PARTITIONS,
    SOURCE,
    InjectedFault,
    expected,
    referenced_files,
    run_cli,
    shared_files,
    state_of,
    storage_of,
    totals_pipeline,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def runner_of(spark, tmp_path: Path, pipeline=None, **options) -> StatefulRunner:
    return StatefulRunner(spark, storage_of(tmp_path), pipeline or totals_pipeline(tmp_path),
                          keyed_local_dir=str(tmp_path / "local"), **options)


def test_partitions_equal_a_recomputation_and_the_state_sink_writes_it(spark, tmp_path):
    """Two partitions of a keyed stage: the checkpointed state and the state sink equal a
    dict recomputation, the recorded row count is the state's, and every source row is
    counted in (the keyed stage reads the source without it being pinned first)."""
    runner = runner_of(spark, tmp_path)

    results = runner.run(["p1", "p2"])

    assert expected(["p1", "p2"]) == state_of(runner)
    assert len(expected(["p1", "p2"])) == results[-1].checkpoint.state_rows["totals"]
    assert [sum(len(SOURCE.rows(b)) for b in SOURCE.batches(None, p)) for p in ("p1", "p2")] \
        == [r.rows["source"] for r in results]
    sink = pd.read_parquet(tmp_path / "sink" / "partition=p2")
    assert expected(["p1", "p2"]) == {r.customer: (r.orders, r.total)
                                      for r in sink.itertuples()}


def test_a_run_killed_mid_partition_resumes_exactly_once(spark, tmp_path):
    """A failure after batch 3 of p2 (a checkpoint after batch 2) and a new runner: every
    order is counted once."""
    def fail(point, **info):
        if point == "batch_applied" and info["partition"] == "p2" and info["batch"] == 2:
            raise InjectedFault("killed")

    with pytest.raises(InjectedFault):
        runner_of(spark, tmp_path, fault_hook=fail).run(["p1", "p2"])
    resumed = runner_of(spark, tmp_path)

    results = resumed.run(["p2"])

    assert 2 == results[0].batches_applied
    assert expected(["p1", "p2"]) == state_of(resumed)


def test_rescaling_2_3_2_equals_a_recomputation(spark, tmp_path):
    """p1 on 2 ranges, p2 on 3, p3 on 2: the state equals a recomputation after each, the
    checkpoints record the new parallelism, and the executors keep local stores of the
    current ranges only."""
    for partition, parallelism in (("p1", 2), ("p2", 3), ("p3", 2)):
        runner = runner_of(spark, tmp_path, totals_pipeline(tmp_path,
                                                            keyed_parallelism=parallelism))
        runner.run([partition])
        operator = runner.store.latest().metadata.operator_states[0]
        assert (parallelism, 16) == (operator.parallelism, operator.max_parallelism)
        done = ["p1", "p2", "p3"][: ["p1", "p2", "p3"].index(partition) + 1]
        assert expected(done) == state_of(runner)
        stores = tmp_path / "local" / "pipelines-keyed" / str(runner.job_id) / "totals"
        ranges = [compute_key_group_range_for_operator_index(16, parallelism, i)
                  for i in range(parallelism)]
        assert {f"m16-kg{r.start}-{r.end}" for r in ranges} == {
            p.name for p in stores.iterdir() if p.is_dir()}


def test_another_max_parallelism_is_refused(spark, tmp_path):
    """State written with 16 key groups is not restored by a pipeline with 32."""
    runner_of(spark, tmp_path).run(["p1"])
    other = runner_of(spark, tmp_path, totals_pipeline(tmp_path, max_parallelism=32))

    with pytest.raises(Exception, match="max_parallelism 16, the pipeline has 32"):
        other.run(["p2"])


def test_a_savepoint_is_self_contained_parquet_and_restores(spark, tmp_path):
    """A savepoint holds one Parquet snapshot per range inside its directory (pandas reads
    it); a new job restored from it continues exactly, and its checkpoints reference none of
    the savepoint's files."""
    runner = runner_of(spark, tmp_path)
    runner.run(["p1"])
    summary = runner.take_savepoint()

    files = sorted(p for p in Path(summary.pointer).rglob("*") if p.is_file()
                   and p.name != "_metadata")
    snapshot = pd.concat([pd.read_parquet(p) for p in files])
    assert expected(["p1"]) == {r.customer: (r.orders, r.total)
                                for r in snapshot.itertuples()}
    assert 2 == len(files)

    other = tmp_path / "other"
    restored = runner_of(spark, other)
    restored.run(["p2"], restore_from=summary.pointer, restore_mode=RestoreMode.NO_CLAIM)
    assert expected(["p1", "p2"]) == state_of(restored)
    referenced = {Path(h.path).name for c in restored.store.all() if not c.is_savepoint()
                  for h in c.metadata.all_handles() if hasattr(h, "path")}
    assert set() == referenced & {p.name for p in files}


def test_claim_of_another_pipelines_checkpoint_is_refused_before_any_batch(spark, tmp_path):
    """CLAIM of a checkpoint in another pipeline's job directory fails before any batch runs
    (no batch applied, no checkpoint, no sink output, the checkpoint kept), saying to use
    NO_CLAIM; NO_CLAIM of it works, and a savepoint may be claimed from anywhere."""
    owner = runner_of(spark, tmp_path)
    owner.run(["p1"])
    pointer = owner.store.latest().external_pointer
    savepoint = owner.take_savepoint()
    applied = []

    def other(name):
        pipeline = replace(totals_pipeline(tmp_path / name, max_retained_checkpoints=1),
                           name=name)
        return runner_of(spark, tmp_path, pipeline,
                         fault_hook=lambda point, **info: applied.append((name, point)))

    claiming = other("claiming_totals")
    with pytest.raises(ClaimRefusedError, match="use NO_CLAIM") as refused:
        claiming.run(["p2"], restore_from=pointer, restore_mode=RestoreMode.CLAIM)
    assert ([], None, False, True) == (
        applied, claiming.access.latest_completed_checkpoint(),
        (tmp_path / "claiming_totals").exists(), os.path.exists(f"{pointer}/_metadata"))
    assert pointer in str(refused.value)

    copying = other("copying_totals")
    copying.run(["p2"], restore_from=pointer, restore_mode=RestoreMode.NO_CLAIM)
    claiming.run(["p2"], restore_from=savepoint.pointer, restore_mode=RestoreMode.CLAIM)
    assert (expected(["p1", "p2"]), expected(["p1", "p2"]), True, False) == (
        state_of(copying), state_of(claiming), os.path.exists(f"{pointer}/_metadata"),
        os.path.exists(savepoint.pointer))


def test_a_no_claim_restore_shares_no_file_with_the_restored_checkpoint(spark, tmp_path):
    """After a NO_CLAIM restore of a checkpoint, the first checkpoint references none of the
    restored checkpoint's files (its ranges are snapshotted first)."""
    runner = runner_of(spark, tmp_path)
    runner.run(["p1"])
    restored_from = runner.store.latest()
    restored_files = {h.path for h in restored_from.metadata.all_handles() if hasattr(h, "path")}

    again = runner_of(spark, tmp_path)
    again.run(["p2"], restore_from=restored_from.external_pointer,
              restore_mode=RestoreMode.NO_CLAIM)

    first = [c for c in again.store.all() if c.checkpoint_id > restored_from.checkpoint_id][0]
    assert set() == restored_files & {h.path for h in first.metadata.all_handles()
                                      if hasattr(h, "path")}
    assert expected(["p1", "p2"]) == state_of(again)


def test_the_job_directory_holds_only_what_retained_checkpoints_reference(spark, tmp_path):
    """Three partitions, a checkpoint every batch, full snapshot every 3 change files,
    retention 2: the shared directory holds exactly the files of the retained checkpoints."""
    pipeline = totals_pipeline(tmp_path, checkpoint_interval=1, max_retained_checkpoints=2)
    runner = runner_of(spark, tmp_path, pipeline)

    runner.run(["p1", "p2", "p3"])
    runner.store.shared_state_registry.wait_for_pending_deletions()

    assert referenced_files(runner) == shared_files(tmp_path, runner)
    assert expected(["p1", "p2", "p3"]) == state_of(runner)
    chains = runner.store.latest().metadata.operator_states[0].subtask_states.values()
    assert all(len(c.handles) <= 3 for c in chains)


T0 = dt.datetime(2026, 3, 10, tzinfo=dt.UTC)
SEEN = pa.schema([pa.field("customer", pa.string(), nullable=False), ("orders", pa.int64()),
                  ("last", pa.timestamp("us", "UTC"))])


@dataclass(frozen=True)
class TimedOrders(Source):
    """Batch 0: customers c0..c39 order at T0; batch 1: c0..c19 again at T0 + 2 h."""

    def batches(self, spark, partition):
        return [f"{partition}-0", f"{partition}-1"]

    def read(self, spark, partition, batch):
        first = batch.endswith("-0")
        at = T0 if first else T0 + dt.timedelta(hours=2)
        return spark.createDataFrame([(f"c{i}", at) for i in range(40 if first else 20)],
                                     "customer string, ts timestamp")


def last_seen(input: pa.Table, state: pa.Table) -> KeyedResult:
    batch = input.group_by("customer").aggregate([([], "count_all"), ("ts", "max")])
    joined = batch.join(state, "customer", join_type="left outer")
    upserts = pa.table({
        "customer": joined.column("customer"),
        "orders": pc.add(joined.column("count_all"), pc.fill_null(joined.column("orders"), 0)),
        "last": joined.column("ts_max"),
    }, schema=SEEN)
    return KeyedResult(upserts, pa.table({"customer": pa.array([], pa.string())}), upserts)


def test_live_and_expired_rows_are_reported_apart(spark, tmp_path):
    """A one-hour event-time TTL, the clock at T0 + 2 h: the 20 customers last seen at T0
    expired but stay in the state (no full snapshot drops them). The checkpoint summary,
    the Dagster materialization (state_rows_/expired_rows_) and `checkpoints inspect` (table
    and --json) report 20 live and 20 expired rows, as counted from the batches."""
    from sensors._assets import _materializations

    stage = KeyedStage("seen", "customer", SEEN, last_seen, event_time="ts",
                       ttl=StateTtl(dt.timedelta(hours=1), timestamp_column="last"))
    pipeline = StatefulPipeline(
        name="timed_totals", stages=[stage], source=TimedOrders(), partitions=PARTITIONS,
        checkpoint_interval=10, max_parallelism=16, keyed_parallelism=2,
        full_snapshot=FullSnapshotPolicy(every=100, min_bytes=0))
    (result,) = runner_of(spark, tmp_path, pipeline).run(["p1"])
    cutoff = T0 + dt.timedelta(hours=2) - dt.timedelta(hours=1)
    last = {f"c{i}": T0 + dt.timedelta(hours=2 if i < 20 else 0) for i in range(40)}
    live = sum(t >= cutoff for t in last.values())
    expired = len(last) - live

    (state_event,) = [e for e in _materializations(pipeline, result, {})
                      if e.asset_key.path == ["timed_totals"]]
    pointer = result.checkpoint.pointer
    table = run_cli("inspect", pointer).stdout
    (operator,) = json.loads(run_cli("inspect", pointer, "--json").stdout)["operators"]
    row = next(line.split() for line in table.splitlines() if line.strip().startswith("seen "))
    assert ((20, 20), (live, expired), (live, expired), (live, expired), (live, expired)) == (
        (live, expired),
        (result.checkpoint.state_rows["seen"], result.checkpoint.expired_rows["seen"]),
        (state_event.metadata["state_rows_seen"].value,
         state_event.metadata["expired_rows_seen"].value),
        (operator["live_rows"], operator["expired_rows"]),
        (int(row[-2]), int(row[-1])))
    assert "LIVE ROWS" in table and "EXPIRED ROWS" in table


def test_inline_change_files_restore(spark, tmp_path):
    """Under a large inline threshold every change file lives in `_metadata`; the state
    still equals a recomputation after a restart."""
    storage = storage_of(tmp_path, file_state_size_threshold=100_000)
    StatefulRunner(spark, storage, totals_pipeline(tmp_path),
                   keyed_local_dir=str(tmp_path / "local")).run(["p1"])
    runner = StatefulRunner(spark, storage, totals_pipeline(tmp_path),
                            keyed_local_dir=str(tmp_path / "local2"))
    runner.run(["p2"])

    assert expected(["p1", "p2"]) == state_of(runner)
    assert not shared_files(tmp_path, runner)


def test_a_small_states_checkpoints_stay_a_few_files_per_range(spark, tmp_path):
    """Under the default policy a small state's range is snapshotted after 4 change files
    (``small_every``), so its checkpoints hold a bounded number of states per range
    (snapshot, at most 4 change files and the rest of an interval) across 8 batches, where
    ``min_bytes`` alone let every batch add one. With states inline below the threshold and
    change files merged across checkpoints, a new runner on other local stores restores them
    and the state equals a recomputation; shared/ holds exactly what the retained
    checkpoints reference (at most 2 files a range: its snapshot and one appended file)."""
    storage = storage_of(tmp_path, file_state_size_threshold=2048, file_merging_enabled=True,
                         file_merging_across_checkpoint_boundary=True)
    pipeline = totals_pipeline(tmp_path, keyed_parallelism=2,
                               full_snapshot=FullSnapshotPolicy())
    states, files = [], []
    for partition, local in (("p1", "local"), ("p2", "elsewhere")):
        runner = StatefulRunner(spark, storage, pipeline, keyed_local_dir=str(tmp_path / local))
        runner.run([partition])
        runner.store.shared_state_registry.wait_for_pending_deletions()
        for state in (s for c in runner.store.all() for op in c.metadata.operator_states
                      for s in op.subtask_states.values()):
            states.append(len(state.handles))
            files.append(len({h.path for h in state.handles if hasattr(h, "path")}))
    latest = runner.store.latest().metadata.operator_states[0].subtask_states.values()
    assert (True, True, [3, 3], expected(["p1", "p2"]), referenced_files(runner)) == (
        max(states) <= 1 + 4 + pipeline.checkpoint_interval - 1, max(files) <= 2,
        [len(state.handles) for state in latest], state_of(runner),
        shared_files(tmp_path, runner))


def test_local_stores_lost_between_runs_are_rebuilt(spark, tmp_path):
    """A second runner on other executors' local directories (nothing local) rebuilds both
    ranges from the chains in its first batch only, says so, and continues exactly."""
    pipeline = totals_pipeline(tmp_path, full_snapshot=FullSnapshotPolicy(every=100))
    runner_of(spark, tmp_path, pipeline).run(["p1"])
    runner = StatefulRunner(spark, storage_of(tmp_path), pipeline,
                            keyed_local_dir=str(tmp_path / "elsewhere"))
    lines = []

    runner.run(["p2"], on_progress=lines.append)

    rebuilt = [line for line in lines if "rebuilt" in line]
    assert ["p2: batch 1 of 4"] == [line.split(" (")[0] for line in rebuilt]
    assert "totals: rebuilt 2 local store(s) from the checkpoint" in rebuilt[0]
    assert expected(["p1", "p2"]) == state_of(runner)



def test_file_merging_within_checkpoints_is_reported_not_ignored(spark, tmp_path, caplog):
    """A storage that merges files within checkpoints only gets a warning naming the pipeline
    that its change files are not merged (one per range and checkpoint); the run still
    equals a recomputation."""
    storage = storage_of(tmp_path, file_merging_enabled=True)
    with caplog.at_level("WARNING", logger="pipelines.runner"):
        runner = StatefulRunner(spark, storage, totals_pipeline(tmp_path),
                                keyed_local_dir=str(tmp_path / "local"))
    runner.run(["p1"])
    warned = [r.getMessage() for r in caplog.records if "file merging" in r.getMessage()]
    assert (1, True, True, expected(["p1"])) == (
        len(warned), "keyed_totals" in "".join(warned),
        "file_merging_across_checkpoint_boundary=True" in "".join(warned), state_of(runner))


def test_file_merging_across_checkpoints_packs_each_ranges_change_files(spark, tmp_path,
                                                                          caplog):
    """With file merging across checkpoints, each range's change files are segments of one
    physical file per chain; runs resumed by new runners and read by read_state equal a
    recomputation, and the shared directory holds exactly what retained checkpoints
    reference (a file leaves with the last checkpoint that uses a segment in it)."""
    storage = storage_of(tmp_path, file_merging_enabled=True,
                         file_merging_across_checkpoint_boundary=True)
    pipeline = totals_pipeline(tmp_path, full_snapshot=FullSnapshotPolicy(
        every=4, ratio=100.0, min_bytes=0))
    states, files = [], []
    with caplog.at_level("WARNING", logger="pipelines.runner"):
        for partition in ("p1", "p2", "p3"):
            runner = StatefulRunner(spark, storage, pipeline,
                                    keyed_local_dir=str(tmp_path / "local"))
            runner.run([partition])
            runner.store.shared_state_registry.wait_for_pending_deletions()
            latest = runner.store.latest()
            handles = latest.metadata.all_handles()
            states.append(state_of(runner) == read_state_of(latest) ==
                          expected(["p1", "p2", "p3"][:len(states) + 1]))
            files.append((len({h.path for h in handles if is_appended_segment(h)}),
                          sum(map(is_appended_segment, handles))))
    warned = [r.getMessage() for r in caplog.records if "file merging" in r.getMessage()]
    assert ([True] * 3, [], referenced_files(runner)) == (states, warned,
                                                          shared_files(tmp_path, runner))
    # (physical files, segments): per range, one file holds the partition's 4 change files
    # (a partition's first batch snapshots the range, starting a new chain and file)
    assert [(2, 8), (2, 8), (2, 8)] == files


def read_state_of(checkpoint) -> dict[str, tuple[int, int]]:
    table = read_state(checkpoint.external_pointer, "totals")
    return {c: (o, t) for c, o, t in zip(*(table.column(n).to_pylist()
                                          for n in ("customer", "orders", "total")),
                                        strict=True)}


def test_a_batch_sweeps_idle_local_stores_of_other_jobs(spark, tmp_path):
    """A run's batches remove another job's local store left idle for longer than the
    maximum age on the executor, and keep their own; the state equals a recomputation."""
    idle = tmp_path / "local" / "pipelines-keyed" / "finished-job" / "totals" / "m16-kg0-15"
    idle.mkdir(parents=True)
    for name in ("MANIFEST.json", "segment.arrow"):
        (idle / name).write_text("{}")
    month_ago = time.time() - 30 * 86_400
    for path in (idle / "MANIFEST.json", idle / "segment.arrow", idle):
        os.utime(path, (month_ago, month_ago))
    runner = runner_of(spark, tmp_path)
    runner.run(["p1"])
    own = tmp_path / "local" / "pipelines-keyed" / str(runner.job_id)
    assert (False, True, expected(["p1"])) == (
        idle.parent.parent.exists(), any(own.rglob("MANIFEST.json")), state_of(runner))
