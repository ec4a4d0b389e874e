"""What the driver JVM holds of a keyed batch (issue 28, peak RSS): the batch's persisted pass
(every output row of the batch) is kept on local disk, not in the JVM's heap, and built one
result row at a time."""

import sys
from functools import partial
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark import StorageLevel, cloudpickle

from pipelines.keyed import KeyedStage, apply_keyed_batch
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
CACHED_BATCH_ROWS = "spark.sql.inMemoryColumnarStorage.batchSize"


def record_pass_batch_rows(directory: str, operator_index: int, attempt: int) -> None:
    """``after_write``: the cached batch size the range's job runs with (SQL settings reach
    the tasks as local properties of the job)."""
    from pyspark import TaskContext

    Path(directory, str(operator_index)).write_text(
        str(TaskContext.get().getLocalProperty(CACHED_BATCH_ROWS)))


def _task(tmp_path: Path, **kwargs) -> KeyedStageTask:
    return keyed_batch_task(tmp_path, KeyedStage("clicks", "user", CLICK_COUNT_STATE,
                                                 count_clicks),
                            OUTPUT, MAX_PARALLELISM, 2, **kwargs)


@pytest.mark.timeout(120)
def test_a_keyed_batchs_pass_is_kept_on_disk_one_result_row_at_a_time(spark, tmp_path):
    """The pass a batch's output is read from is persisted on disk (before: in the JVM's heap,
    every output row of the batch until the runner released it, ~0.5 GB at a first batch of
    8M keys) and built one result row (one output payload) per cached batch (before:
    Spark's 10,000, a range's whole output in one column buffer); the session's own batch
    size is left as it was, and the output is read back whole."""
    settings = tmp_path / "settings"
    settings.mkdir()
    task = _task(tmp_path, after_write=partial(record_pass_batch_rows, str(settings)))
    session_rows = spark.conf.get(CACHED_BATCH_ROWS)
    users = [(f"user_{i:04d}",) for i in range(1000)]
    result = apply_keyed_batch(spark.createDataFrame(users, "user string"), task)
    try:
        assert result.cached.storageLevel == StorageLevel.DISK_ONLY
        pass_rdd = result.cached._jdf.queryExecution().withCachedData().cacheBuilder() \
            .cachedColumnBuffers().id()
        stored = {info.id(): (info.memSize(), info.diskSize())
                  for info in spark.sparkContext._jsc.sc().getRDDStorageInfo()}
        memory, disk = stored[pass_rdd]
        assert memory == 0 and disk > 0, stored[pass_rdd]
        assert sorted(r["user"] for r in result.output.collect()) == [u for u, in users]
    finally:
        result.release()
    assert {p.name: p.read_text() for p in settings.iterdir()} == {"0": "1", "1": "1"}
    assert spark.conf.get(CACHED_BATCH_ROWS) == session_rows


def test_the_sessions_serialization_streams_keep_no_object_they_wrote(spark):
    """A session of ``build_spark_session`` resets Java serialization streams after each
    object: the pass above goes to disk through one, which kept every payload it wrote (up
    to Spark's default of 100) reachable in the JVM's heap."""
    assert spark.sparkContext.getConf().get("spark.serializer.objectStreamReset") == "1"


def test_a_file_read_hands_the_jvm_batches_of_bounded_rows(tmp_path):
    """A file source's read yields Arrow batches of at most 65,536 rows (``READ_BATCH_ROWS``;
    before: a Parquet row group each, up to 1M rows and ~60 MB of the JVM's direct memory
    apiece), all of the file's rows, in order."""
    import pyarrow.parquet as pq

    from pipelines import FileSource
    from pipelines._sources import _URL, _read_files

    rows = 200_005
    pq.write_table(pa.table({"user": [f"u{i}" for i in range(rows)]}), tmp_path / "b.parquet",
                   row_group_size=rows)
    source = FileSource(url=f"{tmp_path}/{{partition}}", schema="user string")
    batches = list(_read_files(source, iter([pa.record_batch(
        {"id": [0], _URL: [str(tmp_path / "b.parquet")]})])))
    assert max(b.num_rows for b in batches) <= 1 << 16
    assert pa.Table.from_batches(batches).column("user").to_pylist() == [
        f"u{i}" for i in range(rows)]


def test_a_parquet_read_holds_one_row_group_at_a_time(tmp_path):
    """A file source's read of a Parquet file of 8 row groups: every row, in order, and
    Arrow's memory while its batches are handed over (each let go before the next is asked
    for, as Spark's worker does) stays under 40% of the whole file's rows (a row group and
    the batch in flight from the one before): read whole, a first batch's 8M rows were held
    at once in the reading worker."""
    import pyarrow.parquet as pq

    from pipelines import FileSource
    from pipelines._sources import _URL, _read_files

    rows = 8 * 25_000
    table = pa.table({"user": [f"user-{i:09d}" for i in range(rows)],
                      "n": pa.array(range(rows), pa.int64())})
    pq.write_table(table, tmp_path / "b.parquet", row_group_size=rows // 8)
    whole = table.nbytes
    del table
    source = FileSource(url=f"{tmp_path}/{{partition}}", schema="user string, n bigint")
    with counting_pool() as proxy:
        held, peak, users = proxy.bytes_allocated(), 0, []
        for batch in _read_files(source, iter([pa.record_batch(
                {"id": [0], _URL: [str(tmp_path / "b.parquet")]})])):
            peak = max(peak, proxy.bytes_allocated() - held)
            users.extend(batch.column("n").to_pylist())
            del batch
    assert users == list(range(rows))
    assert peak < 0.4 * whole, (peak, whole)
