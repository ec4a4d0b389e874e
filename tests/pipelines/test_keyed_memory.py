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

from checkpoint_storage import FileSystemCheckpointStorage
from pipelines.keyed import (
    KeyedResult,
    KeyedStage,
    apply_keyed_batch,
    snapshot_keyed_state,
)
from pipelines.keyed._routing import OPERATOR_INDEX
from pipelines.keyed._task import KeyedStageTask
from tests.pipelines.support import (
    CLICK_COUNT_STATE,
    count_clicks,
    counting_pool,
    keyed_batch_task,
)

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
    return keyed_batch_task(tmp_path, stage, OUTPUT, MAX_PARALLELISM, 2, storage=storage,
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


def _vm_option(spark, name: str) -> str:
    """The value of the session's JVM's HotSpot flag ``name``, as the JVM runs with it."""
    jvm = spark.sparkContext._jvm
    flags = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean"))
    return flags.getVMOption(name).getValue()


def test_the_sessions_jvm_hands_back_idle_heap(spark):
    """A session of ``build_spark_session`` starts its JVM with G1 options that return idle
    heap (the driver JVM was most of a run's RSS: G1 kept what the busiest batch needed)."""
    from resources.spark import DEFAULT_SPARK_CONF

    jvm = spark.sparkContext._jvm
    arguments = list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
                     .getInputArguments())
    wanted = DEFAULT_SPARK_CONF["spark.driver.extraJavaOptions"].split()
    assert wanted and all(option in arguments for option in wanted), arguments
    assert _vm_option(spark, "G1PeriodicGCInterval") == "2000"


def test_a_local_sessions_jvm_starts_small_and_grows_its_heap_reluctantly(spark):
    """A local session's JVM (also its executor) starts with a 64 MB heap and G1 grows it
    only when its collections take over 20% of the time: with HotSpot's defaults (1/64 of
    the machine's memory, G1's 8%) the JVM of an 8M-key restart had grown its heap to 1.1 GB
    for ~0.1 GB live, ~0.1 GB more of it resident at the batch."""
    assert _vm_option(spark, "InitialHeapSize") == str(64 << 20)
    assert _vm_option(spark, "GCTimeRatio") == "4"


@pytest.mark.timeout(120)
def test_a_range_task_holds_its_input_rows_once(tmp_path):
    """A range's task (``_run_partition``, in this process) copies its input rows once
    without the routing's summary rows and lets the rows it was handed go: Arrow's peak over
    the task is 2.2x the input (the copy, the store's and the stage's rows), 3.1x when the
    handed rows were kept to the task's end."""
    from pipelines.keyed._executor import _run_partition
    from pipelines.keyed._routing import _operator_indices, _routes

    task = _one_range_task(tmp_path, KeyedStage("clicks", "user", CLICK_COUNT_STATE,
                                                 count_clicks))
    with counting_pool() as proxy:
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
    assert rows > 0 and not routed
    # 2.2x the input: its copy, the store's rows and the stage's (3.1x before)
    assert peak < 2.6 * input_bytes, (peak, input_bytes)






def _one_range_task(tmp_path: Path, stage: KeyedStage) -> KeyedStageTask:
    """A batch task of one range holding every key group, on a new checkpoint storage."""
    return keyed_batch_task(tmp_path, stage, OUTPUT, MAX_PARALLELISM, 1)


def _routed_users(task: KeyedStageTask, users: int, padding: int = 0) -> list[pa.RecordBatch]:
    """``users`` keys routed, each with ``padding`` bytes of a column the stage ignores."""
    from pipelines.keyed._routing import _operator_indices, _routes

    table = pa.table({"user": [f"user_{i:07d}-{'x' * 40}" for i in range(users)]})
    if padding:
        table = table.append_column("padding", pa.repeat("p" * padding, users))
    return list(_operator_indices(task, _routes(1), table.schema, iter(
        table.to_batches(max_chunksize=50_000))))


def _run_handed_over(task: KeyedStageTask, routed: list[pa.RecordBatch]) -> pa.Table:
    """``_run_partition`` over ``routed``, handed over batch by batch as Spark's worker does
    (none kept); its result rows."""
    from pipelines.keyed._executor import _run_partition

    def handed_over():
        while routed:
            yield routed.pop(0)

    return pa.Table.from_batches(list(_run_partition(task, handed_over())))


@pytest.mark.timeout(120)
def test_a_range_first_batch_runs_the_stage_in_slices_of_its_keys(tmp_path):
    """A range's first batch (every key new, as batch 0 of a run is) of 200,000 keys: Arrow's
    peak over the task, beside the input rows it was handed, stays under 1.4x them. The stage
    runs on slices of the keys (``_SLICE_ROWS``) and the input goes with the last slice, so
    the stage's working memory (grouping, join, results) is one slice's; at once it was 2.2x
    the input, on top of it (the workers' peak in a first batch of 500,000 keys a range)."""
    task = _one_range_task(tmp_path, KeyedStage("clicks", "user", CLICK_COUNT_STATE,
                                                 count_clicks))
    with counting_pool() as proxy:
        routed = _routed_users(task, 200_000)
        held = proxy.bytes_allocated()
        input_bytes = sum(batch.nbytes for batch in routed)
        results = _run_handed_over(task, routed)
        peak = proxy.max_memory() - held
    assert pa.compute.sum(results.column("output_rows")).as_py() == 200_000
    assert peak < 1.4 * input_bytes, (peak, input_bytes)


@pytest.mark.timeout(120)
def test_a_range_task_whose_output_nothing_reads_holds_and_ships_none(tmp_path):
    """``output_read=False`` (``apply_keyed_batch(..., output=False)``): the range's task
    counts the stage's output rows and yields none of them (they went to the JVM to be
    filtered out there), and it does not hold them through the store's write: Arrow's peak
    over a first batch of 200,000 keys is lower than with the output read, and the same
    change file rows are written."""
    from dataclasses import replace

    from pipelines.keyed._task import _OUTPUT

    seen = {}
    for read in (True, False):
        task = replace(_one_range_task(tmp_path / str(read), KeyedStage(
            "clicks", "user", CLICK_COUNT_STATE, count_clicks)), output_read=read)
        with counting_pool() as proxy:
            routed = _routed_users(task, 200_000)
            held = proxy.bytes_allocated()
            results = _run_handed_over(task, routed)
            peak = proxy.max_memory() - held
        kinds = results.column("row_kind").to_pylist()
        handles = results.filter(pa.compute.is_valid(results.column("output_rows")))
        seen[read] = (kinds.count(_OUTPUT) > 0, handles.column("output_rows").to_pylist(),
                      handles.column("rows").to_pylist(), peak)
    assert seen[True][:3] == (True, [200_000], [200_000])
    assert seen[False][:3] == (False, [200_000], [200_000])
    assert seen[False][3] < 0.9 * seen[True][3], (seen[False][3], seen[True][3])


@pytest.mark.timeout(120)
def test_an_unread_output_that_does_not_fit_its_schema_still_fails_the_task(tmp_path):
    """An output nothing reads is still checked against the output schema: the stage's
    error shows before a sink is added, not after."""
    from dataclasses import replace

    def no_clicks_column(input: pa.Table, state: pa.Table) -> KeyedResult:
        result = count_clicks(input, state)
        return KeyedResult(result.upserts, result.deletes,
                           result.output.drop_columns(["clicks"]))

    task = replace(_one_range_task(tmp_path, KeyedStage("clicks", "user", CLICK_COUNT_STATE,
                                                         no_clicks_column)), output_read=False)
    with pytest.raises(ValueError,
                       match=r"keyed stage clicks: output lacks column\(s\) \['clicks'\]"):
        _run_handed_over(task, _routed_users(task, 100))


@pytest.mark.timeout(120)
def test_slices_of_a_large_batch_give_what_the_whole_batch_gives(tmp_path, monkeypatch):
    """The same first batch of 60,000 keys, run in slices of 10,000 rows and at once: the same
    output rows, the same change file rows and the same local store."""
    from pipelines.keyed import _executor
    from pipelines.keyed._executor import _decode_output, _spark_arrow_schema
    from pipelines.keyed._store import ArrowKeyedStateStore
    from pipelines.keyed._task import _HANDLE_KIND, _OUTPUT

    seen = {}
    for slice_rows in (10_000, 1 << 30):
        monkeypatch.setattr(_executor, "_SLICE_ROWS", slice_rows)
        calls = []

        def counted(input, state, calls=calls):
            calls.append(input.num_rows)
            return count_clicks(input, state)

        stage = KeyedStage("clicks", "user", CLICK_COUNT_STATE, counted)
        task = _one_range_task(tmp_path / str(slice_rows), stage)
        results = _run_handed_over(task, _routed_users(task, 60_000) + _routed_users(task, 20))
        payloads = results.filter(pa.compute.equal(results.column("row_kind"), _OUTPUT))
        output = pa.Table.from_batches(list(_decode_output(
            _spark_arrow_schema(OUTPUT), iter(payloads.select(["payload"]).to_batches()))))
        handle = results.filter(pa.compute.is_valid(results.column(_HANDLE_KIND)))
        assert handle.num_rows == 1 and handle.column("rows")[0].as_py() == 60_000
        store = ArrowKeyedStateStore(
            next((tmp_path / str(slice_rows) / "local").rglob("MANIFEST*")).parent,
            task.layout, task.key_groups(0))
        state = pa.Table.from_batches(list(store.sorted_batches()))
        store.close()
        seen[slice_rows] = (len(calls), output.sort_by("user"), state)
    (sliced, output, state), (whole, output_at_once, state_at_once) = seen.values()
    assert (sliced, whole) == (7, 1)  # 60,020 rows
    assert output.equals(output_at_once) and output.num_rows == 60_000
    assert output.column("clicks").to_pylist().count(2) == 20  # the keys sent twice
    assert state.equals(state_at_once)


@pytest.mark.timeout(60)
def test_a_store_merge_copies_the_rows_once(tmp_path):
    """An empty store's apply of 200,000 upserts (a range's first batch merges into the
    segment at once): Arrow's peak beside the upserts stays under 2.25x them (2.0x). The
    merge takes its rows column by column: it made the whole table one chunk first and then
    took from it, holding both copies (2.5x)."""
    from pipelines.keyed._store import ArrowKeyedStateStore

    task = _one_range_task(tmp_path, KeyedStage("clicks", "user", CLICK_COUNT_STATE,
                                                count_clicks))
    store = ArrowKeyedStateStore(tmp_path / "store", task.layout, task.key_groups(0))
    with counting_pool() as proxy:
        upserts = pa.table({"user": [f"user_{i:07d}-{'x' * 40}" for i in range(200_000)],
                            "clicks": np.arange(200_000)}, schema=CLICK_COUNT_STATE)
        held = proxy.bytes_allocated()
        store.apply(upserts, pa.table({"user": pa.array([], pa.string())}), version="v1")
        peak = proxy.max_memory() - held
    try:
        assert store.num_rows == 200_000
        assert peak < 2.25 * upserts.nbytes, (peak, upserts.nbytes)
    finally:
        store.close()


def test_output_payloads_are_made_one_at_a_time_without_copies():
    """A range's output in payloads of ``_OUTPUT_ROWS_PER_PAYLOAD`` rows: a record batch
    each, made as it is asked for, whose payload is the Arrow stream's buffer itself (no
    Python bytes, no table of them), and decoded back to the rows."""
    from pipelines.keyed._executor import _decode_output, _payload_batches
    from pipelines.keyed._task import _OUTPUT, _OUTPUT_ROWS_PER_PAYLOAD, _RESULT_SCHEMA

    rows = pa.table({"user": [f"u{i}" for i in range(3 * _OUTPUT_ROWS_PER_PAYLOAD + 5)],
                     "clicks": np.arange(3 * _OUTPUT_ROWS_PER_PAYLOAD + 5)}, schema=OUTPUT)
    with counting_pool() as proxy:
        held = proxy.bytes_allocated()
        decoded, peak = [], 0
        for batch in _payload_batches(_OUTPUT, 1, 0, rows):
            peak = max(peak, proxy.bytes_allocated() - held)
            assert batch.schema == _RESULT_SCHEMA and batch.num_rows == 1
            decoded.append(batch.column("payload")[0].as_py())  # out of the measured pool
            del batch
    assert len(decoded) == 4
    # one payload in flight, less than the rows once (before: every payload, their Python
    # bytes and a table of them at once, over 2x the rows)
    assert peak < rows.nbytes, (peak, rows.nbytes)
    payloads = iter([pa.RecordBatch.from_pydict({"payload": [p]}) for p in decoded])
    assert pa.Table.from_batches(list(_decode_output(OUTPUT, payloads))).equals(rows)


@pytest.mark.timeout(120)
def test_a_range_task_does_not_copy_its_input_to_drop_the_routing_summaries(tmp_path):
    """A range's batch of 100,000 keys (one slice): Arrow's peak from the input's hand-over
    to the stage's call stays under 0.25x the input rows. The routing summaries are taken out
    of the batches that hold them only: a filter of the whole input copied it beside itself
    (+1.0x the input, the workers' peak in a first batch of 2M keys a range at 4M keys)."""
    seen = []

    def count_and_measure(input: pa.Table, state: pa.Table) -> KeyedResult:
        seen.append(proxy.max_memory())
        return count_clicks(input, state)

    task = _one_range_task(tmp_path, KeyedStage("clicks", "user", CLICK_COUNT_STATE,
                                                 count_and_measure))
    with counting_pool() as proxy:
        routed = _routed_users(task, 100_000)
        held = proxy.bytes_allocated()
        input_bytes = sum(batch.nbytes for batch in routed)
        results = _run_handed_over(task, routed)
    assert pa.compute.sum(results.column("output_rows")).as_py() == 100_000
    assert len(seen) == 1
    assert seen[0] - held < 0.25 * input_bytes, (seen[0] - held, input_bytes)


_HEAP_AFTER_SLICES = """
import ctypes, io, sys
import pyarrow as pa
libc = ctypes.CDLL("libc.so.6")
# glibc as a long-lived worker has it: a freed chunk stays in the heap (no automatic trim,
# no mmap of its own), so only an explicit trim gives it back
libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
from pathlib import Path
from pipelines.keyed import KeyedStage, _executor
from tests.pipelines import test_keyed_memory as t
from tests.pipelines.support import CLICK_COUNT_STATE, count_clicks

task = t._one_range_task(Path(sys.argv[1]), KeyedStage("clicks", "user", CLICK_COUNT_STATE,
                                                       count_clicks))
routed = t._routed_users(task, 300_000, padding=400)
sink = io.BytesIO()
with pa.ipc.new_stream(sink, routed[0].schema) as writer:
    for batch in routed:
        writer.write_batch(batch)
stream, input_bytes = sink.getvalue(), sum(batch.nbytes for batch in routed)
del routed, sink, writer
# read as Spark's worker reads a task's input: Arrow buffers over Python bytes (the C heap)
with pa.ipc.open_stream(io.BytesIO(stream)) as reader:
    batches = list(reader)
del stream, reader
_executor.release_arrow_memory()
before = t._anon_bytes()  # with the input
at_write = []
write_change_file = _executor.write_change_file

def measured(*args, **kwargs):
    at_write.append(t._anon_bytes())
    return write_change_file(*args, **kwargs)

_executor.write_change_file = measured
t._run_handed_over(task, batches)
print((at_write[0] - before) / input_bytes)
"""


@pytest.mark.timeout(120)
def test_a_large_range_task_gives_back_its_input_before_the_change_file(tmp_path):
    """A range's first batch of 300,000 keys (three slices), read as Spark's worker reads its
    input (Arrow buffers over Python bytes: the C heap), in a process whose glibc keeps what
    is freed (as a long-lived worker's does): when the change file is written, the task's
    resident anonymous memory is below where it was with the input. The task hands back the
    freed heap once the slices are done (the input goes with the last one) and after each:
    the change file and the store's merge stood on them (a first batch of 2M keys a range at
    4M keys: +400 MiB a worker)."""
    process = subprocess.run([sys.executable, "-c", _HEAP_AFTER_SLICES, str(tmp_path)],
                             capture_output=True, text=True, timeout=100,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert process.returncode == 0, process.stderr[-2000:]
    # the task's anonymous memory above the input's at its hand-over, in input sizes: -0.6
    # (the input handed back), 2.3 before (the input and each slice's work kept)
    assert float(process.stdout.split()[-1]) < 0, process.stdout


@pytest.mark.timeout(60)
def test_a_store_merge_lets_its_index_temporaries_go_before_the_take(tmp_path):
    """An empty store's apply of 200,000 upserts (a range's first batch): numpy's peak
    (``tracemalloc``) stays under 70 bytes a row (57). The merge's index arrays (hashes,
    groups, order, bounds, slots, the kept and added masks) go once used, and the lookup's
    (the rows' source and place) before the merge: all were held through it (92 bytes a
    row)."""
    import tracemalloc

    from pipelines.keyed._store import ArrowKeyedStateStore

    task = _one_range_task(tmp_path, KeyedStage("clicks", "user", CLICK_COUNT_STATE,
                                                count_clicks))
    store = ArrowKeyedStateStore(tmp_path / "store", task.layout, task.key_groups(0))
    rows = 200_000
    upserts = pa.table({"user": [f"user_{i:07d}" for i in range(rows)],
                        "clicks": np.arange(rows)}, schema=CLICK_COUNT_STATE)
    tracemalloc.start()
    try:
        store.apply(upserts, pa.table({"user": pa.array([], pa.string())}), version="v1")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    try:
        assert store.num_rows == rows
        assert peak < 70 * rows, peak / rows
    finally:
        store.close()
