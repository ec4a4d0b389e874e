"""``SparkResource.start``: the session built in the background while the caller goes on
(issue 28: a cold ``scripts/run`` overlaps the JVM's start with Dagster's run setup)."""

import subprocess
import sys
import textwrap

import pytest

from resources import SparkResource

_CHILD = textwrap.dedent("""
    import threading
    from pyspark import SparkContext
    from resources import SparkResource

    conf = {"spark.ui.enabled": "false"}
    resource = SparkResource(master="local[1]", app_name="started", conf=conf)
    resource.start()  # returns at once; the session is built in a thread
    # a setup added meanwhile (pipelines.main's Ctrl-C watcher) still runs on the session
    from resources import on_session_created
    seen = []
    on_session_created(seen.append)
    # another resource of the same settings (Dagster's copy in a run) takes that session
    taken = SparkResource(master="local[1]", app_name="started", conf=conf)
    session = taken.session
    print("taken", [t.name for t in threading.enumerate() if t.name == "spark-session-start"],
          session.range(3).count(), seen == [session], flush=True)
    taken.teardown_after_execution(None)  # stopped as the resource's own
    print("stopped", SparkContext._active_spark_context is None, flush=True)

    failing = SparkResource(master="nonsense-master", conf=conf)
    failing.start()  # raises nothing here
    try:
        failing.session
    except Exception as exc:
        print("raised", "nonsense-master" in str(exc), flush=True)
""")


@pytest.mark.timeout(300)
def test_a_session_started_in_the_background_is_handed_out_and_stopped_as_its_own():
    assert hasattr(SparkResource, "start")
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          timeout=280)
    lines = [ln for ln in done.stdout.splitlines()
             if ln.startswith(("taken", "stopped", "raised"))]
    assert ["taken [] 3 True", "stopped True", "raised True"] == lines, (
        done.stdout[-2000:] + done.stderr[-2000:])
