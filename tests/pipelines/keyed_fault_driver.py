"""The driver of tests/pipelines/test_keyed_faults.py: the keyed totals pipeline of
test_keyed_runner.py (with an output sink too) run in its own process, so that it can be
SIGKILLed at a chosen point, or run with Spark task attempts killed after their writes (the
pytest process holds a local[2] SparkContext already, without task retries).

    python tests/pipelines/keyed_fault_driver.py --work-dir DIR --partitions p1,p2
        [--parallelism N] [--batches N] [--kill POINT] [--stop POINT] [--task-kills]
        [--master URL] [--straggle] [--merging] [--state]

``--kill`` SIGKILLs the driver's process group (the driver, its JVM and, in local mode, the
executors) and the Python worker that triggers it, once it reaches POINT:

- ``write:<checkpoint id>:<marker>:mid`` on an executor, right after the first bytes of a
  state file of checkpoint ``<id>`` whose name holds ``<marker>`` reached the file (a torn
  file): ``-b<batch>-`` for a change file, ``-m0-`` for a full snapshot;
- ``write:<checkpoint id>:<marker>:after`` the same, once that file is complete (before its
  handle reaches the driver and before the local store applies it);
- ``hook:<point>:<name>=<value>`` on the driver, at the runner's ``fault_hook(point)`` with
  ``info[name] == value`` (``batch_applied`` / ``partition``, ``batch``; ``before_metadata``
  / ``checkpoint_id``).

Before the kill it writes the point to ``<work dir>/killed``. ``--stop write:...`` SIGSTOPs
instead, inside the write (the task holds its range's local store lock): the driver's process
group (its lease is no longer renewed), then the Python workers' (``stall``). A run that
completes prints ``RESULT <json>``: the checkpoints taken, when the lease was taken and the
run ended (``time.time()``), its progress lines and, with ``--state``, the final state.
``--task-kills`` (use a master with retries, e.g. ``local[2,3]``): attempt
0 of range 1 exits (its Python worker dies) and attempt 1 of range 0 raises after each state
file they write and their local store's update. ``--straggle`` (a two-host cluster with
speculation): attempt 0 of range 1 stalls after its writes, so a speculative copy overtakes it.
``--merging``: the storage merges files across checkpoints (each range's change files are
segments appended to one physical file) and ranges snapshot after 4 change files only, so
the second interval's change files append to the file the first checkpoint references.
"""

import argparse
import datetime as dt
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
if str(PROJECT_ROOT) not in sys.path:
    sys.path.insert(0, str(PROJECT_ROOT))

from checkpoint_storage import FileSystemCheckpointStorage  # noqa: E402
from pipelines import (  # noqa: E402
    FullSnapshotPolicy,
    KeyedStage,
    ParquetSink,
    StatefulPipeline,
    StatefulRunner,
)
from tests.pipelines.support import (  # noqa: E402
    PARTITIONS,
    TOTALS,
    GeneratedOrders,
    customer_totals,
)

PGID_ENV = "KEYED_FAULT_PGID"
WRITE_ENV = "KEYED_FAULT_WRITE"
KILLED_ENV = "KEYED_FAULT_MARKER"
STOP_ENV = "KEYED_FAULT_STOP"  # set: the write point SIGSTOPs (``stall``) instead of killing
STOPPING, STOPPED = "stopping", "stopped"  # stall's markers in the work directory
LEASE_TTL = dt.timedelta(seconds=3)  # a killed driver's lease expires soon after
STRAGGLER_SLEEP = 30.0


@dataclass(frozen=True)
class Orders(GeneratedOrders):
    """test_keyed_runner's orders, ``per_partition`` batches per partition."""

    per_partition: int = 4

    def batches(self, spark, partition):
        return [f"{partition}-{i:03d}" for i in range(self.per_partition)]


def faults_pipeline(work: Path, batches: int = 4, parallelism: int | None = None,
                    merging: bool = False) -> StatefulPipeline:
    """test_keyed_runner's totals over ``batches`` batches per partition: a checkpoint every 2
    batches, full snapshot every 2 change files (so at the start of a partition's second
    interval; every 4 with ``merging``), a state sink and an output sink."""
    return StatefulPipeline(
        name="keyed_totals",
        stages=[KeyedStage("totals", "customer", TOTALS, customer_totals)],
        source=Orders(per_partition=batches),
        partitions=PARTITIONS,
        sinks=[
            ParquetSink(name="totals_state", stage="totals", of="state",
                        url=str(work / "sink" / "state")),
            ParquetSink(name="totals_output", stage="totals", of="output",
                        url=str(work / "sink" / "output")),
        ],
        checkpoint_interval=2,
        max_parallelism=16,
        full_snapshot=(FullSnapshotPolicy(every=4, ratio=100.0, min_bytes=0) if merging
                         else FullSnapshotPolicy(every=2, min_bytes=0)),
        keyed_parallelism=parallelism,
    )


def storage_of(work: Path, merging: bool = False, kind=FileSystemCheckpointStorage
               ) -> FileSystemCheckpointStorage:
    return kind(str(work / "checkpoints"), savepoint_dir=str(work / "savepoints"),
                file_state_size_threshold=0, file_merging_enabled=merging,
                file_merging_across_checkpoint_boundary=merging)


# --- the kill ----------------------------------------------------------------------------

def crash(point: str) -> None:
    """SIGKILL the driver's process group, then this process's (a Python worker's: the
    PySpark daemon and its workers have their own group, and hold the driver's stdout)."""
    if os.environ.get(STOP_ENV):
        stall()
        return
    write_marker(Path(os.environ[KILLED_ENV]), point)
    os.killpg(int(os.environ[PGID_ENV]), signal.SIGKILL)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def write_marker(marker: Path, point: str) -> None:
    """Publish ``point`` at ``marker`` whole, first writer wins: two tasks can reach the kill
    point at once, and one's kill can land between another's open and write (``write_text``
    truncates first, so the marker read back empty). Written under a name of its own, then
    linked into place (fails if the marker exists), so the marker never holds part of it."""
    own = marker.with_name(f".{marker.name}.{os.getpid()}")
    with open(own, "w") as out:  # this process's own name: nobody else writes it
        out.write(point)
    try:
        os.link(own, marker)
    except FileExistsError:
        pass  # another task got there first with the same point: it is killing us all
    finally:
        own.unlink()


def stall() -> None:
    """SIGSTOP the driver's process group, then this process's (the Python workers'); returns
    once SIGCONTed. The first task to get here writes both group ids to ``<work dir>/stopping``
    (created exclusively: a task that gets here later goes on, stopped with its group or
    after the SIGCONT), stops the driver, then creates ``<work dir>/stopped``: once it
    exists, the driver renews its lease no more."""
    work = Path(os.environ[KILLED_ENV]).parent
    try:
        with open(work / STOPPING, "x") as claim:
            claim.write(f"{os.environ[PGID_ENV]} {os.getpgid(0)}\n")
    except FileExistsError:
        return
    os.killpg(int(os.environ[PGID_ENV]), signal.SIGSTOP)
    open(work / STOPPED, "x").close()  # noqa: SIM115
    os.killpg(os.getpgid(0), signal.SIGSTOP)


class _KillingStream:
    def __init__(self, stream, point: str, when: str) -> None:
        self._stream, self._point, self._when = stream, point, when

    def write(self, data) -> int:
        n = self._stream.write(data)
        if self._when == "mid":
            self._stream.flush()  # the threshold is 0: the file exists and holds these bytes
            crash(self._point)
        return n

    def close_and_get_handle(self):
        handle = self._stream.close_and_get_handle()
        if self._when == "after":
            crash(self._point)
        return handle

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _KillingFactory:
    def __init__(self, factory, checkpoint_id: int) -> None:
        self._factory, self._checkpoint_id = factory, checkpoint_id

    def create_checkpoint_state_output_stream(self, scope, name_prefix: str = ""):
        stream = self._factory.create_checkpoint_state_output_stream(scope, name_prefix)
        point = os.environ.get(WRITE_ENV, "")
        _, checkpoint_id, marker, when = (point.split(":") + ["", "", "", ""])[:4]
        if point and int(checkpoint_id) == self._checkpoint_id and marker in name_prefix:
            return _KillingStream(stream, point, when)
        return stream

    def __getattr__(self, name):
        return getattr(self._factory, name)


class KillingStorage(FileSystemCheckpointStorage):
    """The storage config shipped to executors: its worker view kills at ``WRITE_ENV``'s
    point. Defined in ``__main__``, so Spark ships it by value."""

    def create_checkpoint_storage(self, job_id):
        return _killing(super().create_checkpoint_storage(job_id))


def _killing(access):
    """``access`` whose stream factories, and those of its appending views, kill."""
    resolve, appending = access.resolve_checkpoint_storage_location, access.to_appending_storage

    def resolve_killing(checkpoint_id, reference):
        return _KillingFactory(resolve(checkpoint_id, reference), checkpoint_id)

    def appending_killing(subtask_key, previous):
        view = appending(subtask_key, previous)
        return access if view is access else _killing(view)

    access.resolve_checkpoint_storage_location = resolve_killing
    access.to_appending_storage = appending_killing
    return access


def kill_hook(point: str):
    """``fault_hook`` for ``hook:<point>:<name>=<value>``."""
    _, at, condition = point.split(":", 2)
    name, value = condition.split("=", 1)

    def hook(where, **info):
        if where == at and str(info.get(name)) == value:
            crash(point)

    return hook


def kill_after_writes(subtask: int, attempt: int) -> None:
    """``task_after_write``: after its state file is written and its local store updated,
    attempt 0 of range 1 dies (its Python worker exits) and attempt 1 of range 0 raises; the
    retries succeed. (Ranges can share a Spark task: hash partitioning sends operator indices
    0 and 1 to one shuffle partition of 4, and to one of 2 when snapshotting, so range 0
    fails at attempt 1, after range 1's worker died at attempt 0 of the same task.)"""
    if attempt == 0 and subtask == 1:
        os._exit(17)
    if attempt == 1 and subtask == 0:
        raise RuntimeError("injected failure of attempt 1 after its write")


def straggle(subtask: int, attempt: int) -> None:
    """``task_after_write``: attempt 0 of range 1 stalls after its write, so that a
    speculative copy overtakes it."""
    if subtask == 1 and attempt == 0:
        time.sleep(STRAGGLER_SLEEP)


# --- the run -----------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--partitions", required=True)
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--kill")
    parser.add_argument("--task-kills", action="store_true")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--straggle", action="store_true")
    parser.add_argument("--merging", action="store_true")
    parser.add_argument("--stop")
    parser.add_argument("--state", action="store_true")
    args = parser.parse_args(argv)
    work = Path(args.work_dir)
    os.environ[PGID_ENV] = str(os.getpgid(0))
    os.environ[KILLED_ENV] = str(work / "killed")
    if args.stop:
        args.kill = args.stop
        os.environ[STOP_ENV] = "1"
    if args.kill and args.kill.startswith("write:"):
        os.environ[WRITE_ENV] = args.kill  # before the JVM starts: its workers inherit it

    from resources import build_spark_session

    conf = {"spark.sql.shuffle.partitions": "4", "spark.default.parallelism": "4",
            "spark.ui.enabled": "false", "spark.driver.memory": "512m",
            "spark.task.maxFailures": "3"}
    if args.master.startswith("spark://"):
        python = os.path.abspath(sys.executable)
        conf |= {
            "spark.pyspark.python": python, "spark.pyspark.driver.python": python,
            "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
            "spark.executor.memory": "512m", "spark.executor.cores": "1",
            "spark.cores.max": "2", "spark.locality.wait": "0s",
            "spark.speculation": "true", "spark.speculation.interval": "100ms",
            "spark.speculation.quantile": "0.5", "spark.speculation.multiplier": "1.5",
            "spark.speculation.minTaskRuntime": "100ms",
        }
    spark = build_spark_session(args.master, "keyed-faults", conf)
    spark.sparkContext.setLogLevel("FATAL")
    try:
        if args.master.startswith("spark://"):
            from tests.reliability.crash_writer import _project_zip

            spark.sparkContext.addPyFile(str(_project_zip(work / "project.zip")))
        storage = storage_of(work, args.merging, KillingStorage)
        hook = None
        if args.kill and args.kill.startswith("hook:"):
            hook = kill_hook(args.kill)
        after_write = kill_after_writes if args.task_kills else (
            straggle if args.straggle else None)
        runner = StatefulRunner(
            spark, storage, faults_pipeline(work, args.batches, args.parallelism, args.merging),
            fault_hook=hook, task_after_write=after_write, lease_ttl=LEASE_TTL,
            keyed_local_dir=str(work / "local"))
        progress: list[str] = []
        lease_at: list[float] = []

        def on_progress(line: str) -> None:
            if not lease_at:  # the first line comes once the lease is taken, state restored
                lease_at.append(time.time())
            progress.append(line)

        results = runner.run(args.partitions.split(","), on_progress=on_progress)
        result = {"taken": [c.checkpoint_id for r in results for c in r.checkpoints_taken],
                  "lease_at": lease_at[0], "done_at": time.time(), "progress": progress}
        if args.state:
            rows = runner.restore_states(runner.store.latest().metadata)["totals"].collect()
            result["state"] = sorted([r["customer"], r["orders"], r["total"]] for r in rows)
    finally:
        spark.stop()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
