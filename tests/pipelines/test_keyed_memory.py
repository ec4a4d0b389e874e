"""What the Python workers of a keyed stage hold between tasks (issue 28, peak RSS): a worker
gives back the C heap a range's task freed, and a keyed job starts no Python workers besides
the session's one daemon and its workers."""

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from pyspark import cloudpickle
from pyspark.sql.functions import spark_partition_id

from checkpoint_storage import FileSystemCheckpointStorage, JobID
from pipelines.keyed import (
    KeyedResult,
    KeyedStage,
    KeyedStateChain,
    apply_keyed_batch,
    snapshot_keyed_state,
)
from pipelines.keyed._key_groups import compute_key_group_range_for_operator_index
from pipelines.keyed._routing import OPERATOR_INDEX
from pipelines.keyed._task import KeyedStageTask
from tests.pipelines.support import CLICK_COUNT_STATE, count_clicks

# Spark's workers cannot import this test module: its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
MAX_PARALLELISM = 8
OUTPUT = pa.schema([("user", pa.string()), ("clicks", pa.int64())])
FREED = 96 << 20  # the C heap a range's stage frees, below an allocation it keeps


def _anon_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) << 10 for line in status
                    if line.startswith("RssAnon:"))


def count_and_free_heap(input: pa.Table, state: pa.Table) -> KeyedResult:
    """Counts clicks per user as a stage does, and leaves what a large task leaves in the
    C heap: ``FREED`` bytes of numpy arrays freed below one the worker keeps (as a kept local
    store keeps its offsets), which glibc's ``free`` does not hand back by itself."""
    import ctypes

    # Whatever this (reused) worker ran before: glibc serves these arrays from its heap and
    # never trims the heap by itself, so only an explicit trim hands them back.
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: 4 MiB arrays from the heap
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: no trim of the heap's top on free
    freed = [np.ones(4 << 17) for _ in range(FREED >> 22)]
    sys.keyed_memory_test_kept = np.ones(1 << 10)  # above them in the heap, kept
    del freed
    counts = input.group_by("user").aggregate([([], "count_all")])
    joined = counts.join(state, "user", join_type="left outer")
    clicks = pa.compute.add(joined.column("count_all"),
                            pa.compute.fill_null(joined.column("clicks"), 0))
    upserts = pa.table({"user": joined.column("user"), "clicks": clicks})
    return KeyedResult(upserts, pa.table({"user": pa.array([], pa.string())}), upserts)


def record_worker(directory: str, operator_index: int, attempt: int) -> None:
    """``after_write``: the worker's pid and resident anonymous memory, once the range's
    change file is written (its task's memory freed, not yet given back)."""
    Path(directory, f"{os.getpid()}-{operator_index}").write_text(str(_anon_bytes()))


def _task(tmp_path: Path, stage: KeyedStage, **kwargs) -> KeyedStageTask:
    storage = FileSystemCheckpointStorage(str(tmp_path / "checkpoints"),
                                          file_state_size_threshold=0)
    job_id = JobID.generate()
    access = storage.create_checkpoint_storage(job_id)
    access.initialize_base_locations()
    location = access.initialize_location_for_checkpoint(1)
    chains = tuple(KeyedStateChain(compute_key_group_range_for_operator_index(
        MAX_PARALLELISM, 2, i), None) for i in range(2))
    return KeyedStageTask(storage, str(job_id), 1, location.location_reference, stage, OUTPUT,
                          MAX_PARALLELISM, 2, chains, 0, local_dir=str(tmp_path / "local"),
                          **kwargs)


@pytest.mark.timeout(120)
def test_a_worker_gives_back_the_heap_a_range_task_freed(spark, tmp_path):
    """Each range's worker, idle after the batch, holds at least 3/4 of ``FREED`` less than
    when its change file was written: the task handed the freed C heap back (before: the
    worker kept it for every later batch)."""
    written = tmp_path / "written"
    written.mkdir()
    stage = KeyedStage("clicks", "user", CLICK_COUNT_STATE, count_and_free_heap)
    task = _task(tmp_path, stage, after_write=partial(record_worker, str(written)))
    users = [(f"user_{i:04d}",) for i in range(1000)]
    result = apply_keyed_batch(spark.createDataFrame(users, "user string"), task)
    try:
        assert result.output.count() == len(users)
    finally:
        result.release()
    assert sorted(r.operator_index for r in result.ranges) == [0, 1]
    held = {path.name: (int(path.read_text()), _anon_bytes(path.name.split("-")[0]))
            for path in written.iterdir()}
    assert len(held) == 2, held
    assert all(idle < at_write - FREED * 3 // 4 for at_write, idle in held.values()), held


def _python_daemons(jvm: int) -> list[int]:
    """The JVM's child processes that run Spark's Python daemon."""
    children = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(jvm)],
                              capture_output=True, text=True, check=True).stdout
    return [int(line.split()[0]) for line in children.splitlines() if ".daemon" in line]


@pytest.mark.timeout(120)
def test_a_full_snapshot_runs_on_the_sessions_python_workers(spark, tmp_path):
    """A full snapshot's job (one task per range) is Spark SQL only up to the snapshot
    itself: its rows of operator indices come from ``range``, not from a Python RDD, whose
    tasks (another environment for Spark's worker factory) started a second Python daemon
    and two more workers that then lived as long as the session (+200-400 MiB at 1M keys)."""
    from pipelines.keyed._batch import _operator_index_frame

    stage = KeyedStage("clicks", "user", CLICK_COUNT_STATE, count_and_free_heap)
    task = _task(tmp_path, stage)
    frame = _operator_index_frame(spark, task, [1, 0])
    plan = frame._jdf.queryExecution().optimizedPlan().toString()
    assert "Range" in plan and "LogicalRDD" not in plan, plan
    placed = frame.select(OPERATOR_INDEX, spark_partition_id().alias("partition")).collect()
    assert [tuple(row) for row in placed] == [(1, 0), (0, 1)]  # one range a Spark task
    jvm = int(subprocess.run(["pgrep", "-P", str(os.getpid()), "java"], capture_output=True,
                             text=True, check=True).stdout.split()[0])
    result = apply_keyed_batch(spark.createDataFrame([("ann",), ("bob",)], "user string"),
                               task)
    result.release()
    daemons = _python_daemons(jvm)
    snapshots = snapshot_keyed_state(spark, _task(tmp_path / "snapshot", stage))
    assert sorted(r.operator_index for r in snapshots) == [0, 1]
    assert _python_daemons(jvm) == daemons


def test_the_sessions_jvm_hands_back_idle_heap(spark):
    """A session of ``build_spark_session`` starts its JVM with G1 options that return idle
    heap (the driver JVM was most of a run's RSS: G1 kept what the busiest batch needed)."""
    from resources.spark import DEFAULT_SPARK_CONF

    jvm = spark.sparkContext._jvm
    arguments = list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
                     .getInputArguments())
    wanted = DEFAULT_SPARK_CONF["spark.driver.extraJavaOptions"].split()
    assert wanted and all(option in arguments for option in wanted), arguments
    flags = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean"))
    assert flags.getVMOption("G1PeriodicGCInterval").getValue() == "2000"


@pytest.mark.timeout(120)
def test_a_range_task_holds_its_input_rows_once(tmp_path):
    """A range's task (``_run_partition``, in this process) copies its input rows once
    without the routing's summary rows and lets the rows it was handed go: Arrow's peak over
    the task is 2.2x the input (the copy, the store's and the stage's rows), 3.1x when the
    handed rows were kept to the task's end."""
    from pipelines.keyed._executor import _run_partition
    from pipelines.keyed._routing import _operator_indices, _routes

    stage = KeyedStage("clicks", "user", CLICK_COUNT_STATE, count_clicks)
    storage = FileSystemCheckpointStorage(str(tmp_path / "checkpoints"))
    job_id = JobID.generate()
    access = storage.create_checkpoint_storage(job_id)
    access.initialize_base_locations()
    location = access.initialize_location_for_checkpoint(1)
    everything = (KeyedStateChain(compute_key_group_range_for_operator_index(
        MAX_PARALLELISM, 1, 0), None),)
    task = KeyedStageTask(storage, str(job_id), 1, location.location_reference, stage, OUTPUT,
                          MAX_PARALLELISM, 1, everything, 0, local_dir=str(tmp_path / "local"))
    previous = pa.default_memory_pool()
    proxy = pa.proxy_memory_pool(previous)
    pa.set_memory_pool(proxy)
    try:
        users = pa.table({"user": [f"user_{i:07d}-{'x' * 40}" for i in range(200_000)]})
        routed = list(_operator_indices(task, _routes(1), users.schema, iter(
            users.to_batches(max_chunksize=50_000))))
        del users
        held = proxy.bytes_allocated()
        input_bytes = sum(batch.nbytes for batch in routed)

        def handed_over():  # as Spark's worker hands batches over: none kept
            while routed:
                yield routed.pop(0)

        rows = sum(batch.num_rows for batch in _run_partition(task, handed_over()))
        peak = proxy.max_memory() - held
    finally:
        pa.set_memory_pool(previous)
    assert rows > 0 and not routed
    # 2.2x the input: its copy, the store's rows and the stage's (3.1x before)
    assert peak < 2.6 * input_bytes, (peak, input_bytes)
