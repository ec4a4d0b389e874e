"""``SparkResource``: a lazily created SparkSession for Dagster assets."""

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from dagster import ConfigurableResource, InitResourceContext
from pydantic import PrivateAttr
from pyspark import SparkConf, SparkContext
from pyspark.sql import SparkSession

from pipelines import class_archive
from pipelines.warm_up import warm_up_workers
from resources._session import SESSION_PYTHON_PATHS, SESSION_SETUPS

__all__ = ["DEFAULT_SPARK_CONF", "SparkResource", "build_spark_session"]

DEFAULT_SPARK_CONF: dict[str, str] = {
    # Arrow batches between the JVM and the Python workers that write and read state:
    # benchmarks/stage_checkpoint.py sweeps 10k-200k; 50k-200k are alike, and 10,000 (Spark's
    # default) costs 3-10% more checkpoint CPU and writes 10x the Parquet row groups.
    "spark.sql.execution.arrow.maxRecordsPerBatch": "100000",
    # Days are UTC days: report dates and event times must not depend on the machine.
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.shuffle.partitions": "8",
    "spark.ui.showConsoleProgress": "false",
    "spark.log.level": "WARN",
    # The driver JVM (on a local master also the executor) hands back heap it no longer
    # needs: a collection when none ran for 2 s, then at most 30% of the heap left free.
    # Without it G1 keeps what it committed at the busiest batch: 0.6-1.7 GB for ~0.1 GB
    # live at 1M keys, 0.4-0.6 GB with it (docs/benchmarks.md, "state_growth: where the
    # memory goes"). A ``conf`` with its own extraJavaOptions replaces these.
    "spark.driver.extraJavaOptions": "-XX:G1PeriodicGCInterval=2000 -XX:MinHeapFreeRatio=10 "
                                     "-XX:MaxHeapFreeRatio=30",
    # Java serialization streams forget each object once written (Spark's default: after
    # 100): a keyed batch's pass, persisted on disk one output payload (up to 65,536 rows)
    # at a time, went through such a stream, which kept every payload it wrote reachable
    # until its 100th: ~190 MB of the JVM's heap at a first batch of 4M keys
    # (docs/benchmarks.md, "state_growth: the batch's pass on disk").
    "spark.serializer.objectStreamReset": "1",
}
"""Settings this project's pipelines rely on; a ``SparkResource``'s ``conf`` overrides them."""

LOCAL_SPARK_CONF: dict[str, str] = {
    # Spark's Python worker daemon, without the BrokenPipeError traceback that a worker of a
    # cancelled task (Ctrl-C in scripts/run) printed on the console (resources/_daemon.py).
    # Local masters only: a cluster's daemon starts before the project's shipped files are on
    # its path, and would import this project as installed on the executor, if at all.
    "spark.python.daemon.module": "resources._daemon",
    # The driver JVM (here also the executor) compiles with C1 only: a local session lives
    # for one Dagster run or one restart, and C2 spent its CPU compiling code such a JVM
    # hardly runs again (a 1M-key restart: 6.7-8.4 s of C2 CPU, ~40% of the JVM's, on 2
    # cores; with C1 only the restart took 9.2 s where it took 15.3, and steady batches kept
    # their time: docs/benchmarks.md, "state_growth: the local driver JVM without C2"). A
    # long local job that spends its time in Spark SQL may want C2 back: a ``conf`` with its
    # own extraJavaOptions replaces these.
    # Its heap starts at 64 MB (not 1/64 of the machine's memory) and G1 grows it only when
    # its collections take over 20% of the time (``GCTimeRatio=4``; G1's own 12, ~8%): in a
    # JVM's first seconds short collections come often, and G1 grew the heap to 0.5-1.1 GB
    # for 60-130 MB live, the touched part of it the JVM's RSS (an 8M-key restart's JVM at
    # its batch: 520-570 -> 400-460 MiB, no slower: docs/benchmarks.md, "state_growth: the
    # local driver JVM's heap at a restart").
    "spark.driver.extraJavaOptions": (
        f"{DEFAULT_SPARK_CONF['spark.driver.extraJavaOptions']} -XX:TieredStopAtLevel=1 "
        "-Xms64m -XX:GCTimeRatio=4"),
}
"""Added to ``DEFAULT_SPARK_CONF`` on a ``local`` master, where the workers run the driver's
Python environment (its driver JVM options extend the default ones)."""


def session_settings(master: str, conf: dict | None = None) -> dict[str, str]:
    """What ``build_spark_session`` sets: the defaults (and, on a local master, the local
    ones), the driver's interpreter for the Python workers, then ``conf``."""
    local = LOCAL_SPARK_CONF if master.startswith("local") else {}
    settings = (DEFAULT_SPARK_CONF | local | {"spark.pyspark.python": sys.executable}
                | {k: str(v) for k, v in (conf or {}).items()})
    # The driver JVM's classes from this installation's archive, when it has one (whatever
    # its other options are): a faster start, nothing else changed (pipelines.class_archive).
    archive = class_archive.java_options()
    if archive and "SharedArchiveFile" not in settings["spark.driver.extraJavaOptions"]:
        settings["spark.driver.extraJavaOptions"] = (
            f"{settings['spark.driver.extraJavaOptions']} {archive}".strip())
    return settings


def session_exists() -> bool:
    """Whether ``getOrCreate`` would hand out a session that exists: the active or the
    default one. ``getActiveSession`` alone is the calling thread's (PySpark pins each Python
    thread to its own JVM thread), None in any other thread than the one that built it."""
    try:
        SparkSession.active()
    except Exception:  # noqa: BLE001 (PySparkRuntimeError: no active or default session)
        return False
    return True


def build_spark_session(
    master: str = "local[*]", app_name: str = "checkpointed-pipelines", conf: dict | None = None,
    *, on_context: Callable[[SparkContext], object] | None = None,
) -> SparkSession:
    """The one way this project builds a session (Dagster resource, tests, benchmarks).

    Python workers run this interpreter unless ``spark.pyspark.python`` says otherwise, so
    that executors have the project's packages (pyarrow, fsspec, checkpoint_storage).
    On a local master, ``on_context(context)`` is called once the session's SparkContext
    exists, before the session is built on it (``SparkResource.start``: the Python workers'
    warm-up, whose daemon then starts beside the session's build instead of after it).
    """
    settings = session_settings(master, conf)
    # Local-mode workers are forked from this process and read the environment variable.
    os.environ.setdefault("PYSPARK_PYTHON", settings["spark.pyspark.python"])
    # The JVM takes this process's environment when it starts (the first session's build).
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    missing = [p for p in SESSION_PYTHON_PATHS if p not in paths]
    if missing:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *missing])
    options = {"spark.master": master, "spark.app.name": app_name} | {
        key: str(value) for key, value in settings.items()}
    if on_context is not None and master.startswith("local"):
        # What the builder's getOrCreate does first (a SparkConf of its options, then the
        # context), done here so that the caller gets the context before the session exists;
        # the builder then takes this context, as it takes any running one.
        on_context(SparkContext.getOrCreate(SparkConf().setAll(list(options.items()))))
    builder = SparkSession.builder
    for key, value in options.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


class _Start(threading.Thread):
    """A session built (and set up as a ``SparkResource`` sets it up) in the background."""

    def __init__(self, master: str, app_name: str, conf: dict) -> None:
        super().__init__(name="spark-session-start", daemon=True)
        self.args = (master, app_name, dict(conf))
        self.session: SparkSession | None = None
        self.existed = False
        self.setups: list = []  # those run on the session; the resource runs later ones
        self.warm_up: threading.Thread | None = None

    def _warm_up(self, context: SparkContext) -> None:
        self.warm_up = warm_up_workers(context)

    def run(self) -> None:
        # Ctrl-C is the main thread's (pipelines.main takes it with sigtimedwait, blocked in
        # every other thread): never delivered to this one.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.existed = session_exists()
            # The workers of the run's first batch, started while Dagster sets the run up and
            # the session is built (a restart's first job waited for the daemon's start), and
            # before the setups: registering the ``checkpoint`` data source waits for a Python
            # process of Spark's own (its data source lookup) while a core is idle.
            session = build_spark_session(*self.args, on_context=self._warm_up)
            for setup in list(SESSION_SETUPS):
                setup(session)
                self.setups.append(setup)
            self.session = session
        except Exception:  # noqa: BLE001
            # Raised where the session is asked for: the resource builds it again there, in
            # the caller's thread, and that attempt fails with the same error.
            self.session = None


_STARTS: list[_Start] = []
_STARTS_LOCK = threading.Lock()


def _take_start(master: str, app_name: str, conf: dict) -> _Start | None:
    """The background start of a session of these settings, waited for (None: none)."""
    with _STARTS_LOCK:
        start = next((s for s in _STARTS if s.args == (master, app_name, dict(conf))), None)
        if start is not None:
            _STARTS.remove(start)
    if start is not None:
        start.join()
    return start


class SparkResource(ConfigurableResource):
    """A SparkSession, created on first use and stopped at teardown (only if this resource
    started it: a session that already existed, e.g. a test's, is left running).

    ``master`` may be any Spark master URL: ``local[*]``, ``spark://host:7077``, ``yarn``,
    ``k8s://...``. The resource itself never travels to executors. The session comes with
    what ``on_session_created`` added (importing ``pipelines`` adds the ``checkpoint`` data
    source: ``session.read.format("checkpoint")``).
    """

    master: str = "local[*]"
    app_name: str = "checkpointed-pipelines"
    conf: dict[str, Any] = {}

    _session: SparkSession | None = PrivateAttr(default=None)
    _started_here: bool = PrivateAttr(default=False)

    def start(self) -> None:
        """Start creating the session in a background thread and return at once, so that
        the JVM starts while the caller goes on (a ``scripts/run`` process: Dagster's
        instance, run setup and the landing step). A resource
        of the same settings hands that session out when first asked (waiting for it if
        needed), and stops it at teardown as it would its own. A failure is raised there,
        not here."""
        start = _Start(self.master, self.app_name, self.conf)
        with _STARTS_LOCK:
            _STARTS.append(start)
        start.start()

    @property
    def session(self) -> SparkSession:
        if self._session is None:
            start = _take_start(self.master, self.app_name, self.conf)
            if start is not None and start.session is not None:
                session, existed, done = start.session, start.existed, start.setups
            else:
                existed = session_exists()
                session = build_spark_session(self.master, self.app_name, self.conf)
                done = []
            for setup in SESSION_SETUPS:  # with a started session: those added meanwhile
                if setup not in done:
                    setup(session)
            self._session = session
            self._started_here = not existed
        return self._session

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        if self._session is not None and self._started_here:
            stop_session(self._session)
        self._session = None


def stop_session(session: SparkSession) -> None:
    """``session.stop()``, without waiting for pyspark's accumulator server to notice its
    shutdown: its handler of the JVM's connection looks at the shutdown flag once a second,
    so ``SparkContext.stop`` waited 0.87 s of every stop for it (the JVM's own stop: 0.07 s;
    issue 28, docs/benchmarks.md "cold_run: the session's stop"). The server is told to shut
    down in a thread of its own, which ends within that second; nothing is left to do by
    then (the context and its JVM are stopped), so a process that exits first loses
    nothing. A pyspark without that server (``_accumulatorServer``) stops as it would."""
    context = session.sparkContext
    server = getattr(context, "_accumulatorServer", None)
    if server is not None and hasattr(server, "shutdown"):
        context._accumulatorServer = None  # SparkContext.stop skips what is None
        threading.Thread(target=server.shutdown, name="accumulator-server-stop",
                         daemon=True).start()
    session.stop()
