"""What the benchmark scripts share: moto's S3 server on loopback, the storage backends they
run on, and the closing line."""

import logging
import os
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass, field


def start_moto(on_request=None) -> tuple[str, object]:
    """moto's threaded S3 server on 127.0.0.1 (free port); ``on_request(environ)`` sees each
    request. Returns the endpoint URL and the server (call ``.stop()``)."""
    # Test credentials for the local moto server only; never real ones.
    os.environ["AWS_ACCESS_KEY_ID"] = "testing"
    os.environ["AWS_SECRET_ACCESS_KEY"] = "testing"
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    os.environ.pop("AWS_SESSION_TOKEN", None)
    os.environ.pop("AWS_PROFILE", None)
    from moto.server import DomainDispatcherApplication, ThreadedMotoServer, create_backend_app
    from werkzeug.serving import make_server

    class ObservedMotoServer(ThreadedMotoServer):
        def _server_entry(self) -> None:
            app = DomainDispatcherApplication(create_backend_app)

            def observed(environ, start_response):
                if on_request is not None:
                    on_request(environ)
                return app(environ, start_response)

            self._server = make_server(self._ip_address, self._port, observed, True)
            self._server_ready_event.set()
            self._server.serve_forever()

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ObservedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return f"http://{host}:{port}", server


@dataclass
class Backend:
    """Where a storage benchmark writes: a base URL and its fsspec options; ``log`` (S3 only,
    when asked for) sees each request the server receives."""

    name: str
    base_url: str
    storage_options: dict
    description: str
    log: object | None = None
    cleanup: list = field(default_factory=list)

    def close(self) -> None:
        for action in reversed(self.cleanup):
            try:
                action()
            except Exception as exc:  # noqa: BLE001 - cleanup of a benchmark
                print(f"  (cleanup of {self.name} failed: {exc})", file=sys.stderr)


def open_backend(name: str, local_dir: str | None, prefix: str, request_log=None) -> Backend:
    """A fresh ``local`` directory (under ``local_dir``), ``memory`` URL or ``s3`` bucket (on
    moto's server, started here; ``request_log.record(environ)`` sees its requests)."""
    if name == "local":
        base = tempfile.mkdtemp(prefix=f"{prefix}-", dir=local_dir)
        backend = Backend(name, base, {}, f"local disk, {base}")
        backend.cleanup.append(lambda: shutil.rmtree(base, ignore_errors=True))
        return backend
    if name == "memory":
        import fsspec

        base = f"memory://{prefix}-{uuid.uuid4().hex[:8]}"
        backend = Backend(name, base, {}, f"fsspec memory://, {base}")
        backend.cleanup.append(lambda: fsspec.filesystem("memory").rm(base, recursive=True))
        return backend
    if name == "s3":
        import boto3

        endpoint, server = start_moto(request_log.record if request_log is not None else None)
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        backend = Backend(
            name,
            f"s3://{bucket}/bench",
            {"endpoint_url": endpoint},
            f"s3fs against moto's ThreadedMotoServer in this process, {endpoint}",
            request_log,
        )
        backend.cleanup.append(server.stop)
        return backend
    raise ValueError(f"unknown backend {name!r}")


def targets_line(rows) -> str:
    """'targets: N/M met' (the one form every benchmark prints), naming the missed ones; rows
    whose ``ok`` is None have no target."""
    checked = [r for r in rows if r.ok is not None]
    missed = [r for r in checked if not r.ok]
    line = f"\ntargets: {len(checked) - len(missed)}/{len(checked)} met"
    if missed:
        line += "; missed: " + ", ".join(f"{r.backend} {r.workload}" for r in missed)
    return line


def _proc_stats() -> dict[int, list[str]] | None:
    """Every process's ``/proc/<pid>/stat`` fields after its command name (field 3 on, so
    ``[1]`` is the parent's pid); None where /proc is not available."""
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    stats = {}
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                data = f.read()
        except OSError:
            continue
        stats[int(entry)] = data[data.rindex(")") + 2 :].split()
    return stats


def _tree_of(root: int, stats: dict[int, list[str]]) -> list[int]:
    """``root`` and its descendants among ``stats``."""
    children: dict[int, list[int]] = {}
    for pid, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def tree_cpu_seconds() -> float | None:
    """CPU seconds of this process and all its descendants (the JVM, the Python workers),
    including reaped children; None where /proc is not available."""
    stats = _proc_stats()
    if stats is None:
        return None
    ticks = sum(sum(int(v) for v in stats[pid][11:15])  # utime stime cutime cstime
                for pid in _tree_of(os.getpid(), stats) if pid in stats)
    return ticks / os.sysconf("SC_CLK_TCK")


def tree_memory(root: int) -> tuple[int, int]:
    """(RSS, PSS) in bytes summed over ``root``'s process tree (the JVM, the Python daemon and
    its forked workers). RSS counts pages the forked workers share once per process; PSS
    splits them, so it is the fairer sum for a tree of forks."""
    parts = tree_memory_parts(root)
    return sum(p[0] for p in parts.values()), sum(p[1] for p in parts.values())


def tree_memory_parts(root: int) -> dict[str, tuple[int, int, int]]:
    """``tree_memory`` by part of the tree: ``driver`` (``root``), ``JVM``, ``daemon`` (a
    Python process whose parent is the JVM: Spark's Python daemon, or a worker it started
    without one) and ``workers`` (the Python processes the daemons forked), each (RSS, PSS,
    processes), so that a peak says which process holds it."""
    parts: dict[str, tuple[int, int, int]] = {}
    stats = _proc_stats() or {}
    for pid in _tree_of(root, stats) if stats else []:
        if _unexeced_spawn(pid, stats):
            continue
        rss = pss = 0
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            continue
        part = _part_of(pid, root, stats)
        had = parts.get(part, (0, 0, 0))
        parts[part] = (had[0] + rss, had[1] + pss, had[2] + 1)
    return parts


def _part_of(pid: int, root: int, stats: dict[int, list[str]]) -> str:
    if pid == root:
        return "driver"
    exe = _exe(pid) or ""
    if exe.endswith("/java"):
        return "JVM"
    parent = int(stats[pid][1]) if pid in stats else 0
    if (_exe(parent) or "").endswith("/java"):
        return "daemon"
    return "workers"


def _exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def _unexeced_spawn(pid: int, stats: dict[int, list[str]]) -> bool:
    """Whether ``pid`` is a JVM's child that has not run its ``exec`` yet: Java starts
    processes (e.g. Hadoop's ``chmod`` on a local file system without its native library) by
    ``posix_spawn``, whose child shares the JVM's memory until it execs, so its RSS and PSS
    are the JVM's again. Summed, one sample in a few hundred read a JVM twice: a 3.8 GB
    "peak" in a 1.9 GB run (issue 28, memory)."""
    parent = int(stats[pid][1]) if pid in stats else 0
    exe = _exe(pid)
    return exe is not None and exe.endswith("/java") and exe == _exe(parent)


class PeakMemory:
    """Samples ``tree_memory_parts(pid)`` every ``interval`` seconds in a thread while
    ``active``; ``rss`` and ``pss`` are the peaks seen, ``phases`` the peak of each phase
    (``phase``, set by the caller as the sampled process moves on) with the split by part of
    the tree in the sample of that peak RSS."""

    def __init__(self, pid: int, interval: float = 0.2, phase: str = "all") -> None:
        import threading

        self.pid, self.interval, self.phase = pid, interval, phase
        self.rss = self.pss = 0
        self.phases: dict[str, PhasePeak] = {}
        self.active = True
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(self.interval):
            if self.active:
                self.record(self.phase, tree_memory_parts(self.pid))

    def record(self, phase: str, parts: dict[str, tuple[int, int, int]]) -> None:
        """One sample of ``phase`` (``tree_memory_parts``' form)."""
        rss, pss = sum(p[0] for p in parts.values()), sum(p[1] for p in parts.values())
        self.rss, self.pss = max(self.rss, rss), max(self.pss, pss)
        peak = self.phases.setdefault(phase, PhasePeak())
        peak.pss = max(peak.pss, pss)
        for part, (part_rss, _, _) in parts.items():
            peak.own[part] = max(peak.own.get(part, 0), part_rss)
        if rss > peak.rss:
            peak.rss, peak.parts = rss, parts

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


class PhasePeak:
    """A phase's peak RSS and PSS (bytes), the split of the peak RSS's sample by part, and
    each part's own peak RSS in the phase (parts peak at different moments)."""

    def __init__(self) -> None:
        self.rss = self.pss = 0
        self.parts: dict[str, tuple[int, int, int]] = {}
        self.own: dict[str, int] = {}

    def describe(self) -> str:
        """'1712 MiB (PSS 1590; JVM 610, driver 190, daemon 45, 2 workers 860; own peaks
        JVM 700, driver 190, daemon 45, workers 900)'."""
        order = ("JVM", "driver", "daemon", "workers")

        def ordered(parts):
            return sorted(parts, key=lambda k: order.index(k) if k in order else 9)

        split = ", ".join(
            (f"{n} {k}" if k == "workers" else k) + f" {r / 2**20:.0f}"
            for k in ordered(self.parts) for r, _, n in [self.parts[k]])
        own = ", ".join(f"{k} {self.own[k] / 2**20:.0f}" for k in ordered(self.own))
        return f"{self.rss / 2**20:.0f} MiB (PSS {self.pss / 2**20:.0f}; {split}; own peaks {own})"


SERIALIZER_RESETS = {"spark.serializer.objectStreamReset": "1"}
"""The session setting under which a Java serialization stream keeps no object it wrote
(``resources.spark.DEFAULT_SPARK_CONF``'s, checked there by tests/test_benchmark_measures.py):
what our keyed batches persist on disk goes through one. Given to both systems: it changes
nothing a Structured Streaming query keeps."""


LOCAL_SESSION_CONF = {
    "spark.python.daemon.module": "resources._daemon",
    "spark.driver.extraJavaOptions": "-XX:G1PeriodicGCInterval=2000 -XX:MinHeapFreeRatio=10 "
                                     "-XX:MaxHeapFreeRatio=30 -XX:TieredStopAtLevel=1 "
                                     "-Xms64m -XX:GCTimeRatio=4",
}
"""What a session of ``resources.build_spark_session`` sets on a local master
(``resources.spark.LOCAL_SPARK_CONF``, checked equal by tests/test_benchmark_measures.py;
copied so that a benchmark's processes do not import Dagster): Spark's Python daemon with the
workers' imports done before it forks them (Structured Streaming's queries here run no Python
workers: nothing changes for them), and the driver JVM's options: G1 hands back heap it
committed but no longer needs (a collection when none ran for 2 s, then at most 30% of the
heap free), so that the JVM's RSS follows its live data instead of the most it ever allocated
between collections (it varied by 0.9 GB between identical 1M-key runs: docs/benchmarks.md,
"state_growth: where the memory goes"), it starts with a 64 MB heap that G1 grows only when
its collections take over 20% of the time (docs/benchmarks.md, "state_growth: the local driver
JVM's heap at a restart"), and it compiles with C1 only (docs/benchmarks.md,
"state_growth: the local driver JVM without C2"). Given to both systems' JVMs, so that
neither system's result is the other's JVM setting."""


def class_archive_options() -> str:
    """The driver JVM options that map the project's class archive (``""`` without one), read
    from ``pipelines/class_archive.py`` without importing the ``pipelines`` package, whose
    imports a baseline's process would otherwise pay."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_class_archive",
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pipelines",
                     "class_archive.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.java_options()


def rocksdb_session(app: str, ss_min_deltas: int, *, shuffle_partitions: int = 4,
                    maintenance_interval: str = "2s", no_data_batches: bool = True,
                    driver_java_options: str | None = None, conf: dict | None = None,
                    on_context=None):
    """A ``local[2]`` SparkSession for the Structured Streaming baselines: RocksDB state store
    with changelog checkpointing, a snapshot every ``ss_min_deltas`` versions. The
    benchmarks compare with this, so they build it one way (``conf``, e.g.
    ``LOCAL_SESSION_CONF``, and ``driver_java_options``, the driver JVM's in place of
    ``conf``'s, e.g. those with the class archive's, for both systems alike).
    ``on_context(context)``: called once the SparkContext exists, before the session is built
    on it, as ``resources.build_spark_session`` does (ours' workers' warm-up); the session's
    settings are the same either way."""
    import sys

    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors: this interpreter
    options = (conf or {}) | ({"spark.driver.extraJavaOptions": driver_java_options}
                              if driver_java_options else {}) | {
        "spark.master": "local[2]",
        "spark.app.name": app,
        "spark.sql.shuffle.partitions": str(shuffle_partitions),
        "spark.ui.enabled": "false",
        "spark.driver.memory": "6g",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.streaming.stateStore.providerClass":
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
        "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
        "spark.sql.streaming.stateStore.minDeltasForSnapshot": str(ss_min_deltas),
        "spark.sql.streaming.stateStore.maintenanceInterval": maintenance_interval,
        "spark.sql.streaming.noDataMicroBatches.enabled": str(no_data_batches).lower(),
    }  # fmt: skip
    if on_context is not None:
        # what the builder's getOrCreate does first: the context from a SparkConf of its options
        on_context(SparkContext.getOrCreate(SparkConf().setAll(list(options.items()))))
    builder = SparkSession.builder
    for key, value in options.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()
