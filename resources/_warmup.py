"""The Python workers of a fresh local session, started before the run's first batch needs
them (issue 28: the first keyed batch in a fresh process paid the Python daemon's start and
its workers' fork while the run waited; docs/benchmarks.md, "cold_run: the workers' imports
done once").

``SparkResource.start`` builds the session in a background thread while Dagster sets the run
up; that thread then runs ``warm_up_workers``: one small job in the background of the keyed
pass's shape (one task per core, two chained ``mapInArrow``: the routing function and the
range's, each with its own Python worker), so the daemon starts (importing what the workers
import, ``resources._daemon``) and forks the workers the first batch reuses
(``spark.python.worker.reuse``), and the JVM loads its Arrow and Python runner classes, while
the driver is busy elsewhere. Nothing waits for it; a failure is logged and ignored (the
batch starts the workers itself, as before). Local masters only: a cluster's executors are
long-lived and keep their workers between runs. Imports no Dagster: its tasks import this
module in the workers.
"""

import logging
import threading

__all__ = ["WARM_UP_GROUP", "warm_up_workers"]

logger = logging.getLogger(__name__)

WARM_UP_GROUP = "warm-up"
"""The Spark job group of the warm-up's job."""

# Set in a worker by the warm-up's tasks: the worker a later task finds it in was started early.
warmed = False


def _start_worker(batches):
    """A warm-up task's function: marks its worker, passes its (one-row) batches through."""
    global warmed
    warmed = True
    yield from batches


def warm_up_workers(session) -> threading.Thread | None:
    """Start the warm-up job in a background thread (None: not on this master); it never
    raises, and the caller never waits for it."""
    from pyspark import SparkContext

    context = session.sparkContext
    if context is not SparkContext._active_spark_context or not context.master.startswith(
            "local"):
        return None  # stopped: nothing to warm up
    thread = threading.Thread(target=_run, args=(session,), name="spark-warm-up", daemon=True)
    thread.start()
    return thread


def _run(session) -> None:
    try:
        context = session.sparkContext
        # This thread's jobs only (a job group is the thread's local property).
        context.setJobGroup(WARM_UP_GROUP, "Python workers started before the first batch",
                            interruptOnCancel=True)
        cores = context.defaultParallelism
        rows = session.range(0, cores, 1, cores)
        rows.mapInArrow(_start_worker, rows.schema).mapInArrow(
            _start_worker, rows.schema).collect()
    except Exception as error:  # noqa: BLE001
        # e.g. the session stopped, or the run's Ctrl-C cancelled every job: the batch
        # starts its workers itself
        logger.debug("the Python workers' warm-up did not run: %s", error)
