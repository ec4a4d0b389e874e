"""``format("checkpoint")`` in a session of a ``SparkResource``: found by Spark's own lookup of
installed data sources when a read first names it, not registered at the session's start
(issue 28: the registration made the start wait for the Python process of Spark's lookup).

The session is a subprocess's (a fresh JVM: Spark looks data sources up once per JVM)."""

import subprocess
import sys
import textwrap

import pytest

from tests.pipelines.support import small_click_events_checkpoint

DAY = "2026-10-01"
READ = textwrap.dedent("""
    import sys
    import threading

    import pipelines.state_source  # what importing pipelines' definitions brings in
    from resources import SparkResource

    resource = SparkResource(master="local[2]", conf={"spark.ui.enabled": "false"})
    spark = resource.session
    spark.sparkContext.setLogLevel("ERROR")
    jvm = spark.sparkContext._jvm
    manager = jvm.java.lang.Class.forName(
        "org.apache.spark.sql.execution.datasources.DataSourceManager$"
    ).getField("MODULE$").get(None)
    # Spark's lookup of installed data sources, once per JVM: not run by the session's start
    print("looked up at the start:", manager.dataSourceBuilders().isDefined(), flush=True)
    counts, errors = [], []
    start = threading.Barrier(2)

    def read():
        start.wait()
        try:
            frame = spark.read.format("checkpoint").option("stage", "user_activity")
            counts.append(frame.load(sys.argv[1]).count())
        except Exception as exc:
            errors.append(str(exc).splitlines()[0])

    threads = [threading.Thread(target=read) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print("rows:", sorted(counts), errors, flush=True)
    print("looked up after:", manager.dataSourceBuilders().isDefined(), flush=True)
    resource.teardown_after_execution(None)
""")


@pytest.fixture(scope="module")
def pointer(spark, tmp_path_factory) -> str:
    return small_click_events_checkpoint(spark, tmp_path_factory.mktemp("state-source-lookup"), DAY)


@pytest.mark.timeout(600)
def test_a_resource_session_finds_the_source_at_its_first_read_from_two_threads(pointer):
    done = subprocess.run([sys.executable, "-c", READ, pointer], capture_output=True,
                          text=True, timeout=540)  # fmt: skip
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(("looked", "rows"))]
    assert [
        "looked up at the start: False",
        "rows: [5, 5] []",
        "looked up after: True",
    ] == lines, done.stdout[-2000:] + done.stderr[-3000:]
