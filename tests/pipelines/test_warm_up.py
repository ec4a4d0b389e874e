"""The Python workers' warm-up (``pipelines.warm_up``) on real Spark (``local[2]``), in a fresh
process each: a runner's first batch runs in the workers the warm-up started; a session gets
one warm-up however many ask; a failing warm-up fails no run; a stopped session gets none."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent("""
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

    def first_batch(spark, name, **options):
        runner = StatefulRunner(spark, storage_of(tmp / name), totals_pipeline(tmp / name),
                                task_after_write=mark, **options)
        runner.run(["p1"])
        return expected(["p1"]) == state_of(runner)

    def warm_up_jobs(spark):
        tracker = spark.sparkContext.statusTracker()
        return [tracker.getJobInfo(j).status
                for j in tracker.getJobIdsForGroup(warm_up.WARM_UP_GROUP)]

    conf = {"spark.ui.enabled": "false"}
    spark = build_spark_session("local[2]", conf=conf)
    thread = warm_up.warm_up_workers(spark)
    thread.join()
    print("exact", first_batch(spark, "a"), flush=True)
    print("in warmed workers", sorted({m.read_text() for m in marks.iterdir()}), flush=True)
    print("the runner's is the session's", warm_up.warm_up_workers(spark) is thread,
          warm_up_jobs(spark), flush=True)

    # a new session (a new SparkContext): a new warm-up, started by the runner; it fails
    spark.stop()
    spark = build_spark_session("local[2]", conf=conf)

    def failing(rows):
        raise RuntimeError("the warm-up fails")
        yield

    warm_up._start_worker = failing
    print("exact after a failed warm-up", first_batch(spark, "b"), flush=True)
    started = warm_up._STARTED.get(spark.sparkContext)  # by the runner
    started.join()
    print("the runner's failed", warm_up_jobs(spark), flush=True)

    spark.stop()
    print("stopped", warm_up.warm_up_workers(spark), SparkContext._active_spark_context,
          flush=True)
""")


@pytest.mark.timeout(300)
def test_the_first_batch_runs_in_warmed_workers_and_a_failed_warm_up_fails_nothing(tmp_path):
    """A warm-up started on a fresh session and joined: the runner's first batch runs its
    ranges' tasks in workers the warm-up started (its RDD job's workers are the queries'),
    exactly, and the runner starts no second one (one job in the warm-up's group). On a new
    session the runner starts the warm-up itself; when its tasks fail, the run's state is
    exact all the same. On a stopped session there is none, and no SparkContext is made."""
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    lines = [ln for ln in done.stdout.splitlines()
             if ln.startswith(("exact", "in warmed", "the runner", "stopped"))]
    assert ["exact True",
            "in warmed workers ['True']",
            "the runner's is the session's True ['SUCCEEDED']",
            "exact after a failed warm-up True",
            "the runner's failed ['FAILED']",
            "stopped None None"] == lines, done.stdout[-2000:] + done.stderr[-3000:]
