"""``SparkResource.start``: the session built in the background while the caller goes on
(issue 28: a cold ``scripts/run`` overlaps the JVM's start with Dagster's run setup)."""

import os
import subprocess
import sys
import textwrap
import threading

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



@pytest.mark.timeout(300)
def test_a_resource_in_another_thread_leaves_running_a_session_it_did_not_start(spark):
    """A session that existed before the resource (a test's, a notebook's) is left running
    at its teardown, also when the resource runs in another thread than the one that built
    the session (Dagster's run workers, ``SparkResource.start``): PySpark's
    ``getActiveSession`` is the calling thread's and said none there."""
    resource = SparkResource(master="local[2]", app_name="tests")
    seen = []

    def use_and_tear_down():
        seen.append(resource.session.range(3).count())
        resource.teardown_after_execution(None)

    thread = threading.Thread(target=use_and_tear_down)
    thread.start()
    thread.join(timeout=240)
    assert seen == [3]
    assert not spark.sparkContext._jsc.sc().isStopped()
    assert spark.range(2).count() == 2

_DAEMON_CHILD = textwrap.dedent("""
    import os
    import socket

    os.environ["PYTHON_DAEMON_KILL_WORKER_ON_FLUSH_FAILURE"] = "true"  # Spark's default
    import pyspark.daemon

    original = pyspark.daemon.worker
    import resources._daemon as daemon

    def closed():
        worker_end, jvm_end = socket.socketpair()
        jvm_end.close()  # the JVM closed the socket of a cancelled task
        return worker_end

    try:
        print("pyspark", original(closed(), True), flush=True)
    except BrokenPipeError:
        print("pyspark raises BrokenPipeError", flush=True)
    print("ours", daemon.worker(closed(), True), pyspark.daemon.worker is daemon.worker,
          flush=True)
""")


@pytest.mark.timeout(120)
def test_the_daemon_ends_a_worker_whose_socket_the_jvm_closed_without_a_traceback():
    """Ctrl-C in scripts/run cancels tasks while their Python workers run: pyspark's daemon
    raised the worker's failed last flush (printed as a BrokenPipeError traceback on the
    console); the sessions' daemon module ends that worker as failed (1), quietly."""
    from resources.spark import session_settings

    assert "resources._daemon" == session_settings("local[2]")["spark.python.daemon.module"]
    done = subprocess.run([sys.executable, "-c", _DAEMON_CHILD], capture_output=True, text=True,
                          timeout=100)
    assert ["pyspark raises BrokenPipeError", "ours 1 True"] == done.stdout.splitlines(), (
        done.stdout[-2000:] + done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_the_daemon_module_is_set_on_local_masters_only():
    """A cluster's Python daemon starts before the files a job ships (``pyFiles``) are on its
    path: a daemon module of this project would import it as installed on the executor (or
    fail where it is not), so a cluster master keeps pyspark's daemon."""
    from resources.spark import session_settings

    daemon = "spark.python.daemon.module"
    assert "resources._daemon" == session_settings("local[*]")[daemon]
    assert daemon not in session_settings("spark://127.0.0.1:7077")
    assert "mine" == session_settings("local[2]", {daemon: "mine"})[daemon]


def test_the_driver_jvm_compiles_with_c1_only_on_local_masters_unless_the_conf_says():
    """A local master's driver JVM (also its executor, living one run) compiles with C1 only,
    beside the G1 options every driver gets; a cluster's driver keeps HotSpot's tiers; a
    ``conf`` with its own JVM options replaces both (the way back to C2)."""
    from resources.spark import DEFAULT_SPARK_CONF, session_settings

    option, c1 = "spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1"
    local = session_settings("local[*]")[option].split()
    assert c1 in local and set(DEFAULT_SPARK_CONF[option].split()) <= set(local)
    cluster = session_settings("spark://127.0.0.1:7077")[option].split()
    assert c1 not in cluster and set(DEFAULT_SPARK_CONF[option].split()) <= set(cluster)
    mine = session_settings("local[2]", {option: "-Xss4m"})[option].split()
    assert c1 not in mine and "-Xss4m" in mine


_PRELOAD_CHILD = textwrap.dedent("""
    import os
    import threading

    import resources._daemon as daemon

    failed = daemon.preload()
    print("failed", failed, flush=True)
    print("threads", len(os.listdir("/proc/self/task")), threading.active_count(), flush=True)
""")


@pytest.mark.timeout(120)
def test_the_daemon_preloads_the_workers_imports_and_stays_single_threaded():
    """The daemon imports what every worker imports before it forks them; pyarrow and numpy
    start threads at import (a thread in a process that forks can leave a child a lock
    nobody releases), so the daemon must still be the one thread it was."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "JE_ARROW_MALLOC_CONF")}
    done = subprocess.run([sys.executable, "-c", _PRELOAD_CHILD], capture_output=True,
                          text=True, timeout=100, env=env)
    assert ["failed []", "threads 1 1"] == done.stdout.splitlines(), (
        done.stdout[-2000:] + done.stderr[-2000:])


_DROPPED_CHILD = textwrap.dedent("""
    import os

    import resources._daemon as daemon

    def file_pages() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("RssFile"))

    daemon.preload()
    before = file_pages()
    dropped = daemon.drop_library_pages()
    after = file_pages()

    def arrow_work() -> bool:  # a worker's: the libraries' code and constants read again
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        table = pa.table({"k": np.arange(100_000) % 1000, "v": np.ones(100_000, np.int64)})
        sums = table.group_by("k").aggregate([("v", "sum")])
        return sums.num_rows == 1000 and pc.sum(sums["v_sum"]).as_py() == 100_000

    child = os.fork()
    if child == 0:
        os._exit(0 if arrow_work() else 3)
    forked = os.waitpid(child, 0)[1]
    print(before, after, dropped // 1024, forked, arrow_work(), flush=True)
""")


@pytest.mark.timeout(120)
def test_the_daemon_hands_back_the_library_pages_its_imports_read():
    """After its imports the daemon holds almost none of the libraries' pages they touched,
    and both it and a worker forked from it then run Arrow's code and read its constants
    (faulted in again, the same bytes)."""
    done = subprocess.run([sys.executable, "-c", _DROPPED_CHILD], capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after, dropped, forked, works = done.stdout.split()
    assert int(after) < 0.3 * int(before) and int(dropped) > 0.5 * int(before), done.stdout
    assert (forked, works) == ("0", "True")


_FREED_CHILD = textwrap.dedent("""
    import sys

    if sys.argv[1] == "preloaded":
        import resources._daemon as daemon

        daemon.preload()
    import numpy as np
    import pyarrow as pa

    def anonymous() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("RssAnon"))

    rng = np.random.default_rng(1)
    table = pa.table({"k": rng.integers(0, 200_000, 400_000),
                      "v": rng.integers(0, 100, 400_000)})
    before = anonymous()
    for _ in range(3):  # a range's task: group-bys and joins, their results let go
        sums = table.group_by("k").aggregate([("v", "sum"), ("v", "count")])
        joined = table.join(sums, "k")
        del sums, joined
    print(anonymous() - before, flush=True)
""")


def _held_after_work(how: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIMALLOC_")}
    done = subprocess.run([sys.executable, "-c", _FREED_CHILD, how], capture_output=True,
                          text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout)


@pytest.mark.timeout(240)
def test_the_daemons_workers_hand_back_the_memory_arrow_freed():
    """A worker forked from the daemon keeps less of what its Arrow work freed than a process
    on mimalloc's defaults (arenas committed eagerly, purged later), which kept it resident."""
    default, preloaded = _held_after_work("default"), _held_after_work("preloaded")
    assert preloaded < 0.7 * default, (preloaded, default)


@pytest.mark.timeout(300)
def test_the_first_tasks_run_in_workers_forked_with_the_imports_done(spark):
    """A session of ``build_spark_session`` on a local master: each task's Python worker is
    forked from a daemon that already imported pyarrow, pandas and ``pipelines.keyed``, their
    objects frozen out of the collector's reach (``gc.freeze``: the worker's collections do
    not copy the daemon's pages into it), and that read the zip archives on the workers'
    path once: the worker's start (which invalidates the import caches) read none again."""

    def started_preloaded(batches):  # local: pickled by value, this module is not importable
        import gc
        import sys
        import zipimport

        import pyarrow as pa

        # [] in a worker forked from a daemon that preloaded everything; None: not preloaded
        failed = vars(sys.modules["__main__"]).get("preload_failed")
        # an importer whose directory is not zipimport's shared one read its archive again
        reread = sum(finder._files is not zipimport._zip_directory_cache.get(finder.archive)
                     for finder in sys.path_importer_cache.values()
                     if isinstance(finder, zipimport.zipimporter))
        for _ in batches:
            pass
        yield pa.record_batch({"failed": [None if failed is None else ",".join(failed)],
                               "frozen": [gc.get_freeze_count()], "reread": [reread]})

    rows = spark.range(0, 4, 1, 2).mapInArrow(
        started_preloaded, "failed string, frozen bigint, reread bigint").collect()
    assert ["", ""] == [r.failed for r in rows]
    # the preloaded modules' objects: tens of thousands (0 without the freeze)
    assert all(r.frozen > 10_000 for r in rows), [r.frozen for r in rows]
    # pyspark.zip's packages' importers: 15 read again without ``forget_zip_importers``
    assert [0, 0] == [r.reread for r in rows]


_WARM_UP_CHILD = textwrap.dedent("""
    import threading

    import pyarrow as pa
    from pyspark import SparkContext

    import pipelines.warm_up as warmup
    from resources import SparkResource

    def warmed(batches):  # in a Python worker: did the warm-up's task run in it?
        import sys

        module = sys.modules.get("pipelines.warm_up")
        for batch in batches:
            yield batch.append_column("warmed", pa.array(
                [bool(module and module.warmed)] * batch.num_rows))

    def join_warm_up():
        for thread in threading.enumerate():
            if thread.name == "spark-warm-up":
                thread.join()

    # The warm-up starts before the session's setups (the checkpoint source's registration
    # waits for Spark's data source lookup), so a setup finds it started.
    from resources import on_session_created
    at_setup = []
    on_session_created(lambda s: at_setup.append(s.sparkContext in warmup._STARTED))

    # ... and once the session's SparkContext exists, before the session is built on it (the
    # daemon's start beside the session's build): what a SparkSession finds as it is made.
    from pyspark.sql import SparkSession
    at_session = []
    made = SparkSession.__init__

    def recording(self, context, *args, **kwargs):
        at_session.append(context in warmup._STARTED)
        made(self, context, *args, **kwargs)

    SparkSession.__init__ = recording

    resource = SparkResource(master="local[2]", app_name="warm", conf={"spark.ui.enabled": "false"})
    resource.start()
    session = resource.session
    print("warm-up before the session", at_session[:1], flush=True)
    print("warm-up before the setups", at_setup, flush=True)
    print("settings", session.conf.get("spark.ui.enabled"), session.sparkContext.appName,
          flush=True)
    join_warm_up()
    rows = session.range(0, 2, 1, 2).mapInArrow(warmed, "id long, warmed boolean").collect()
    print("warmed", sorted(tuple(r) for r in rows), flush=True)
    print("once", warmup.warm_up_workers(session.sparkContext)
          is warmup._STARTED.get(session.sparkContext), flush=True)
    resource.teardown_after_execution(None)
    print("stopped", warmup.warm_up_workers(session.sparkContext),
          SparkContext._active_spark_context is None, flush=True)
""")


@pytest.mark.timeout(300)
def test_a_started_session_warms_up_its_python_workers():
    """``SparkResource.start`` runs the warm-up once the session's SparkContext exists,
    before the session is built on it (with the resource's settings) and before its setups
    (the data source's registration): a query's tasks
    then run in workers the warm-up started, and a runner asking again gets that warm-up.
    On a stopped session there is none (and no new SparkContext). The runner's side, and a
    failing warm-up: tests/pipelines/test_warm_up.py."""
    done = subprocess.run([sys.executable, "-c", _WARM_UP_CHILD], capture_output=True,
                          text=True, timeout=280)
    lines = [ln for ln in done.stdout.splitlines()
             if ln.startswith(("warm-up", "settings", "warmed", "once", "stop"))]
    assert ["warm-up before the session [True]",
            "warm-up before the setups [True]",
            "settings false warm",
            "warmed [(0, True), (1, True)]",
            "once True",
            "stopped None True"] == lines, done.stdout[-2000:] + done.stderr[-3000:]


_STOP_CHILD = textwrap.dedent("""
    import threading
    from pyspark import SparkContext
    from resources import SparkResource

    resource = SparkResource(master="local[1]", app_name="stop",
                             conf={"spark.ui.enabled": "false"})
    session = resource.session
    server = session.sparkContext._accumulatorServer
    acc = session.sparkContext.accumulator(0)
    session.sparkContext.parallelize(range(4), 1).foreach(lambda x: acc.add(x))
    callers = []
    real = server.shutdown
    def shutdown():
        callers.append(threading.current_thread().name)
        real()
    server.shutdown = shutdown
    resource.teardown_after_execution(None)
    stopped = SparkContext._active_spark_context is None
    stopper = [t for t in threading.enumerate() if t.name == "accumulator-server-stop"]
    for thread in stopper:
        thread.join(10)
    print("STOP", acc.value, stopped, callers, server.server_shutdown,
          server.socket.fileno() == -1, flush=True)
""")


@pytest.mark.timeout(300)
def test_a_resource_stops_its_session_without_waiting_for_the_accumulator_server():
    """The teardown stops the context and leaves the accumulator server's shutdown (a wait of
    up to a second for its handler's poll) to a thread of its own, which ends it: the
    server's socket is closed, and the accumulator's value is what the job added."""
    done = subprocess.run([sys.executable, "-c", _STOP_CHILD], capture_output=True, text=True,
                          timeout=280)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("STOP")]
    assert ["STOP 6 True ['accumulator-server-stop'] True True"] == lines, (
        done.stdout[-2000:] + done.stderr[-2000:])
