"""The Python workers of a fresh local session, started before the run's first batch needs
them (issue 28: the first keyed batch in a fresh process paid the Python daemon's start, its
workers' fork and each worker's first-task setup while the run waited; docs/benchmarks.md,
"cold_run: the workers' imports done once" and "state_growth: the first batch's workers
warmed up by the runner").

``warm_up_workers`` runs one small job in the background, one task per core, so that the
daemon starts (importing what the workers import, ``resources._daemon``) and forks the workers
the first batch reuses (``spark.python.worker.reuse``), and each worker's first task sets up
its paths (pyspark's ``setup_spark_files``, which re-reads every zip on ``sys.path``), while
the driver restores and plans. The job is an RDD's, not a query's: a query's first planning
waits for the JVM's first Catalyst and code generation, which the batch's own query needs
too, so a warm-up query reached its tasks no earlier than the batch did (docs/benchmarks.md);
an RDD job reaches them at once. Spark keeps one daemon per worker environment, and an RDD's
workers differ from a query's only by the traceback settings that the query's runner adds
to theirs: the warm-up's function is given them (``_QUERY_WORKER_ENV``), so its workers are
the ones the batch's ``mapInArrow`` reuse (``tests/pipelines/test_warm_up.py`` checks it).

``StatefulRunner.run`` starts it (a session of the runner's user, e.g. a benchmark's, gets it
too), and so does ``SparkResource.start`` as soon as its SparkContext exists, before the
session is built on it (``build_spark_session(on_context=...)``): the daemon's start then
overlaps the session's, where it had waited for it and delayed a restart's first job
(docs/benchmarks.md, "state_growth: the Python workers started with the SparkContext"); one
per SparkContext, whoever asks first. Nothing waits for it; a failure is logged and ignored (the
batch starts the workers itself, as before). Local masters only: a cluster's executors are
long-lived and keep their workers between runs. Imports no Dagster: its tasks import this
module in the workers.

A warm-up not submitted yet waits while a local store prefetch of this process runs
(``hold_until``; ``pipelines.local_recovery`` holds it): each forked worker holds the daemon's
pages again, and the two workers forked beside the driver's rebuild of a 4M-row range made an
8M-key restart's peak (1206-1302 MiB); with the warm-up after the prefetch, 1079-1291 (medians
1233 -> 1149) and no slower: the restart's first job needs the prefetched stores anyway
(docs/benchmarks.md, "state_growth: the warm-up after the prefetch"). ``StatefulRunner.run``
also waits for the holds before its first job (``wait_for_holds``): that job's tasks need the
prefetched stores, and the daemon and workers it started beside the driver's rebuild made
the peak of 4 in 9 such restarts (1067-1099 MiB, 945-983 with the wait; docs/benchmarks.md,
"state_growth: the local driver JVM's heap at a restart").
"""

import logging
import threading
import weakref

__all__ = ["WARM_UP_GROUP", "hold_until", "wait_for_holds", "warm_up_workers"]

logger = logging.getLogger(__name__)

WARM_UP_GROUP = "warm-up"
"""The Spark job group of the warm-up's job."""

# Set in a worker by the warm-up's tasks: the worker a later task finds it in was started early.
warmed = False

# The warm-up of each SparkContext (a stopped and rebuilt session has a new one), so that a
# session gets one however many runners and resources ask, each run without a py4j call.
_STARTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_STARTED_LOCK = threading.Lock()

# What a warm-up waits for before it submits its job (``hold_until``).
_HOLDS: list[threading.Event] = []

# What a query's Python runner adds to its workers' environment (when its SQL setting is on),
# and an RDD's does not: given to the warm-up's function, so that Spark hands its workers to
# the batch's queries (Spark 4: BasePythonRunner.compute).
_QUERY_WORKER_ENV = {
    "SPARK_SIMPLIFIED_TRACEBACK": ("spark.sql.execution.pyspark.udf.simplifiedTraceback.enabled",
                                   "true"),
    "SPARK_HIDE_TRACEBACK": ("spark.sql.execution.pyspark.udf.hideTraceback.enabled", "false"),
}


def _start_worker(rows):
    """A warm-up task's function: marks its worker."""
    global warmed
    warmed = True
    yield from rows


def hold_until(done: threading.Event) -> None:
    """Make the warm-ups of this process that have not submitted their job yet wait, in their
    own threads, until ``done`` is set (the module doc says why); nothing else waits."""
    with _STARTED_LOCK:
        _HOLDS[:] = [*(held for held in _HOLDS if not held.is_set()), done]


def wait_for_holds() -> None:
    """Wait until every hold of this process (``hold_until``) set now is released."""
    with _STARTED_LOCK:
        holds = list(_HOLDS)
    for held in holds:
        held.wait()


def warm_up_workers(context) -> threading.Thread | None:
    """Start the warm-up job of the SparkContext ``context`` in a background thread, unless
    one was started already (then that thread); None: not on this master, or stopped. It
    never raises, and the caller never waits for it. It needs no SparkSession: a session
    still being built on the context goes on beside it."""
    from pyspark import SparkContext

    if context is not SparkContext._active_spark_context or not context.master.startswith(
            "local"):
        return None  # stopped: nothing to warm up
    with _STARTED_LOCK:
        thread = _STARTED.get(context)
        if thread is None:
            thread = threading.Thread(target=_run, args=(context,), name="spark-warm-up",
                                      daemon=True)
            _STARTED[context] = thread
            thread.start()
    return thread


def _run(context) -> None:
    wait_for_holds()
    try:
        # This thread's jobs only (a job group is the thread's local property).
        context.setJobGroup(WARM_UP_GROUP, "Python workers started before the first batch",
                            interruptOnCancel=True)
        # The SQL settings as the context's conf holds them (a session's builder options
        # and spark-defaults are there): a session's ``conf`` would build its SessionState
        # first, and the session may not exist yet. One py4j call each: ``getConf()``
        # copies every entry, ~70 calls (0.05-0.4 s at load 14) before the job is
        # submitted. A setting changed later on a session only makes its queries' workers
        # another daemon's: the warm-up is then wasted, never wrong.
        env = {name: "1" for name, (setting, default) in _QUERY_WORKER_ENV.items()
               if context._conf.get(setting, default).lower() == "true"}
        cores = context.defaultParallelism
        rows = context.parallelize(range(cores), cores).mapPartitions(_start_worker)
        # The function takes the context's environment when its JVM side is made: the
        # query's settings for this one only (a query's function made in that instant gets
        # what its runner adds anyway; an RDD's, the query's traceback settings).
        # A new dict in its place, never the shared one changed: another thread may be
        # iterating it (PySpark reads it whole when it wraps any Python function).
        original = context.environment
        context.environment = {**env, **original}
        try:
            rows._jrdd  # noqa: B018 (made here, with that environment)
        finally:
            context.environment = original
        rows.collect()
    except Exception as error:  # noqa: BLE001
        # e.g. the session stopped, or the run's Ctrl-C cancelled every job: the batch
        # starts its workers itself
        logger.debug("the Python workers' warm-up did not run: %s", error)
