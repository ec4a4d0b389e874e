"""What a tiny keyed batch no longer pays (issue 28, the cold run's batches), and the state and
files it keeps: a batch whose output nothing reads keeps no pass."""

import sys

import pytest
from pyspark import cloudpickle

from pipelines import StatefulRunner
from pipelines.keyed import (
    KeyedStage,
    KeyedStateChain,
    KeyedStateLayout,
    apply_keyed_batch,
    extend_chains,
    replay_chains,
)
from pipelines.keyed import _driver as keyed_driver
from tests.pipelines.support import (
    ALL,
    CLICK_COUNT_STATE,
    count_clicks,
    keyed_batch_task,
    storage_of,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])
STAGE = KeyedStage("clicks", "user", CLICK_COUNT_STATE, count_clicks)
USERS = ["ann", "bob", "ann", "cid", "eve", "fay", "gus", "gus"]


def _persisted(spark) -> int:
    return spark.sparkContext._jsc.getPersistentRDDs().size()


def _state(task, ranges) -> dict[str, int]:
    empty = [KeyedStateChain(task.key_groups(i), None) for i in range(task.parallelism)]
    chains = extend_chains(empty, ranges)
    table = replay_chains(chains, KeyedStateLayout.of(STAGE, task.max_parallelism), ALL)
    return dict(zip(table.column("user").to_pylist(), table.column("clicks").to_pylist(),
                    strict=True))


@pytest.mark.timeout(300)
def test_a_batch_whose_output_nothing_reads_keeps_no_pass(spark, tmp_path):
    """``output=False``: the pass is not persisted (with its output it is), in one Spark job,
    and the batch writes the same change files and state as with its output; asking for
    its output names the stage and what to do."""
    frame = spark.createDataFrame([(u,) for u in USERS], "user string")
    seen = {}
    for output in (True, False):
        root = tmp_path / str(output)
        task = keyed_batch_task(root, STAGE, CLICK_COUNT_STATE, 8, 2, storage=storage_of(root))
        before = _persisted(spark)
        group = f"unread-{output}"
        spark.sparkContext.setJobGroup(group, group)
        try:
            result = apply_keyed_batch(frame, task, output=output)
        finally:
            spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
        try:
            kept = _persisted(spark) - before
            jobs = len(spark.sparkContext.statusTracker().getJobIdsForGroup(group))
        finally:
            result.release()
        files = sorted((r.operator_index, r.kind, r.rows, r.handle.path.rsplit("/", 1)[-1]
                        .split("-a0-")[0]) for r in result.ranges)
        seen[output] = (kept, jobs, files, _state(task, result.ranges), result.output_rows,
                        result.input_rows)
        assert _persisted(spark) == before
    assert seen[True][0] == 1  # the check can fail: a kept pass is seen
    assert seen[False] == (0, *seen[True][1:])
    assert seen[False][3] == {"ann": 2, "bob": 1, "cid": 1, "eve": 1, "fay": 1, "gus": 2}
    with pytest.raises(RuntimeError, match="keyed stage clicks: this batch was applied without"):
        _ = result.output


@pytest.mark.timeout(300)
def test_the_runner_keeps_only_the_passes_a_later_stage_or_sink_reads(spark, tmp_path,
                                                                     monkeypatch):
    """The click events' two keyed stages: dedupe's output is user_activity's input, kept;
    user_activity's output nothing reads (its sink reads the state), not kept."""
    from pipelines.examples.click_events import generate_day
    from tests.pipelines.support import click_pipeline

    calls = []
    original = keyed_driver.apply_keyed_batch

    def recording(input, task, *, output=True):
        calls.append((task.stage.name, output))
        return original(input, task, output=output)

    monkeypatch.setattr(keyed_driver, "apply_keyed_batch", recording)
    pipeline = click_pipeline(tmp_path, checkpoint_interval=2)
    generate_day(str(tmp_path / "landing"), "2026-10-01", batches=2, events_per_batch=40,
                 users=5, seed=1)
    runner = StatefulRunner(spark, storage_of(tmp_path), pipeline,
                            keyed_local_dir=str(tmp_path / "local"))
    before = _persisted(spark)
    runner.run(["2026-10-01"])
    assert calls == [("dedupe", True), ("user_activity", False)] * 2
    assert _persisted(spark) == before
