"""The Python workers' warm-up (``pipelines.warm_up``) on real Spark (``local[2]``), in a fresh
process each: a runner's first batch runs in the workers the warm-up started; a session gets
one warm-up however many ask; the runner starts it, and a failing one fails no run; a stopped
session gets none."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# each test starts its own JVM in a child process (the conftest sees no Spark fixture)
pytestmark = pytest.mark.spark

ROOT = Path(__file__).resolve().parents[2]

_PRELUDE = textwrap.dedent("""
    import sys
    from pathlib import Path

    from pyspark import SparkContext

    import pipelines.warm_up as warm_up
    from pipelines import StatefulRunner
    from resources import build_spark_session
    from tests.pipelines.support import expected, state_of, storage_of, totals_pipeline

    tmp = Path(sys.argv[1])
    marks = tmp / "marks"
    marks.mkdir()

    def mark(subtask, attempt):  # in a range's task: was its worker started by the warm-up?
        import os
        import sys

        module = sys.modules.get("pipelines.warm_up")
        (marks / f"{subtask}-{attempt}-{os.getpid()}").write_text(
            str(bool(module and module.warmed)))

    def first_partition(spark):
        runner = StatefulRunner(spark, storage_of(tmp), totals_pipeline(tmp),
                                task_after_write=mark)
        runner.run(["p1"])
        return expected(["p1"]) == state_of(runner)

    def warm_up_jobs(spark):
        tracker = spark.sparkContext.statusTracker()
        return [tracker.getJobInfo(j).status
                for j in tracker.getJobIdsForGroup(warm_up.WARM_UP_GROUP)]

    spark = build_spark_session("local[2]", conf={"spark.ui.enabled": "false"})
""")

_WARMED = _PRELUDE + textwrap.dedent("""
    class Recording(dict):  # the context's environment, recording every change made to it
        changes = []

        def __setitem__(self, key, value):
            self.changes.append(key)
            super().__setitem__(key, value)

        def __delitem__(self, key):
            self.changes.append(key)
            super().__delitem__(key)

        def update(self, *args, **kwargs):
            self.changes.append("update")
            super().update(*args, **kwargs)

        def pop(self, *args):
            self.changes.append("pop")
            return super().pop(*args)

    shared = spark.sparkContext.environment = Recording(spark.sparkContext.environment)
    thread = warm_up.warm_up_workers(spark.sparkContext)
    thread.join()
    print("the shared environment", Recording.changes, spark.sparkContext.environment is shared,
          flush=True)
    print("exact", first_partition(spark), flush=True)
    print("in warmed workers", sorted({m.read_text() for m in marks.iterdir()}), flush=True)
    print("the runner's is the session's",
          warm_up.warm_up_workers(spark.sparkContext) is thread,
          warm_up_jobs(spark), flush=True)
    spark.stop()
    print("stopped", warm_up.warm_up_workers(spark.sparkContext),
          SparkContext._active_spark_context,
          flush=True)
""")

_FAILING = _PRELUDE + textwrap.dedent("""
    def failing(rows):
        raise RuntimeError("the warm-up fails")
        yield

    warm_up._start_worker = failing
    print("exact", first_partition(spark), flush=True)
    started = warm_up._STARTED.get(spark.sparkContext)  # by the runner, or None
    started.join()
    print("the runner's failed", warm_up_jobs(spark), flush=True)
""")


_AFTER_PREFETCH = _PRELUDE + textwrap.dedent("""
    import threading
    import time

    import pipelines.local_recovery as local_recovery
    from pipelines import prefetch_local_stores

    def ran(rows):  # the warm-up's task, in its worker: when it ran
        import time

        (marks / f"warm-up-{time.time()}").write_text("")
        yield from rows

    print("exact", first_partition(spark), flush=True)  # a checkpoint to prefetch
    spark.stop()
    warm_up._start_worker = ran
    rebuild = local_recovery._Prebuild.__call__

    release = threading.Event()

    def slow_rebuild(self):  # a range rebuilt once the test says so
        release.wait()
        return rebuild(self)

    local_recovery._Prebuild.__call__ = slow_rebuild
    prefetch = prefetch_local_stores(storage_of(tmp), totals_pipeline(tmp))
    spark = build_spark_session("local[2]", conf={"spark.ui.enabled": "false"})
    warm_up.warm_up_workers(spark.sparkContext)
    runner = StatefulRunner(spark, storage_of(tmp), totals_pipeline(tmp))
    run = threading.Thread(target=runner.run, args=(["p2"],))
    run.start()
    time.sleep(4)  # a warm-up or a runner not held would have submitted jobs by now
    tracker = spark.sparkContext.statusTracker()
    held_jobs = [*tracker.getJobIdsForGroup(None), *tracker.getJobIdsForGroup(
        warm_up.WARM_UP_GROUP)]
    released = time.time()
    release.set()
    warm_up.warm_up_workers(spark.sparkContext).join()
    run.join()
    outcomes = sorted({p.outcome for p in prefetch.wait()})
    first = min(float(m.name[len("warm-up-"):]) for m in marks.iterdir()
                if m.name.startswith("warm-up-"))
    print("the warm-up after the prefetch", outcomes, first >= released,
          warm_up_jobs(spark), flush=True)
    print("the runner after the prefetch", held_jobs, len(tracker.getJobIdsForGroup(None)) > 0,
          expected(["p1", "p2"]) == state_of(runner), flush=True)
""")


def _run_child(script: str, tmp_path: Path) -> list[str]:
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    lines = [ln for ln in done.stdout.splitlines()
             if ln.startswith(("exact", "in warmed", "the runner", "the shared", "stopped",
                                   "the warm-up"))]
    return lines + ([] if done.returncode == 0 else [done.stdout[-2000:] + done.stderr[-3000:]])


@pytest.mark.timeout(300)
def test_the_first_batch_runs_in_the_warmed_up_workers(tmp_path):
    """A warm-up started on a fresh session and joined: the runner's first partition runs
    its ranges' tasks in workers the warm-up started (its RDD job's workers are the queries'),
    exactly, and the runner starts no second one (one job in the warm-up's group). On the
    stopped session there is none, and no SparkContext is made. The context's environment,
    which PySpark reads whole in any thread that wraps a Python function, is never changed
    in place (a run failed with "dictionary changed size during iteration")."""
    assert ["the shared environment [] True",
            "exact True",
            "in warmed workers ['True']",
            "the runner's is the session's True ['SUCCEEDED']",
            "stopped None None"] == _run_child(_WARMED, tmp_path)


@pytest.mark.timeout(300)
def test_the_runner_starts_the_warm_up_and_its_failure_fails_nothing(tmp_path):
    """On a fresh session the runner starts the warm-up itself; when the warm-up's tasks
    fail, the run's state is exact all the same."""
    assert ["exact True", "the runner's failed ['FAILED']"] == _run_child(_FAILING, tmp_path)


@pytest.mark.timeout(300)
def test_the_warm_up_forks_the_workers_after_a_running_prefetch(tmp_path):
    """A warm-up asked for while a local store prefetch runs submits its job only once the
    prefetch is done (its workers are not forked beside the driver's rebuilds), and so does a
    runner's run started then (its first job's tasks need the prefetched stores); the
    prefetch finds the stores the first run left (``present``) all the same, and the run's
    state is the partitions' totals."""
    assert ["exact True", "the warm-up after the prefetch ['present'] True ['SUCCEEDED']",
            "the runner after the prefetch [] True True"] == (
        _run_child(_AFTER_PREFETCH, tmp_path))
