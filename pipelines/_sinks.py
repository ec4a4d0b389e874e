"""Sinks: where a stage's results go, per partition, idempotently.

A sink writes either a stage's ``output`` (each batch's output as the batch is applied) or
its ``state`` (once, at the end of each partition). Writes are idempotent: what a sink
writes for a partition (and batch) replaces what an earlier attempt wrote for it, so a
re-run or a recovery never duplicates rows. When a partition is processed from its first
batch, the runner first clears what output sinks hold for it.

- ``ParquetSink``: Parquet files under ``<url>/<partition_column>=<key>/`` on any fsspec URL,
  written on the executors through fsspec and pyarrow.
- ``SparkWriterSink``: Spark's writer with dynamic partition overwrite (Hadoop filesystems).

Subclass ``Sink`` and implement ``write`` and ``clear`` for anything else.
"""

import contextlib
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark import TaskContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import to_arrow_schema

from pipelines._fsspec import FileSystemLocation, partition_directory

__all__ = ["ParquetSink", "Sink", "SparkWriterSink"]

Transform = Callable[[DataFrame, str], DataFrame]


@dataclass(frozen=True, kw_only=True)
class Sink(ABC):
    """Writes stage ``stage``'s ``of`` (``"output"`` or ``"state"``) per partition.

    ``name`` names the sink's Dagster asset (``<pipeline>_<name>``). ``transform(frame,
    partition)`` shapes the rows before they are written (e.g. a report's columns).
    Implement ``write`` and ``clear``; ``location`` says where a partition's rows are.
    """

    name: str
    stage: str
    of: Literal["output", "state"] = "output"
    transform: Transform | None = None

    def __post_init__(self) -> None:
        if self.of not in ("output", "state"):
            raise ValueError(f"sink {self.name}: of must be 'output' or 'state', got {self.of!r}")

    def prepare(self, data: DataFrame, partition: str) -> DataFrame:
        return data if self.transform is None else self.transform(data, partition)

    @abstractmethod
    def write(self, spark: SparkSession, data: DataFrame, partition: str, batch: int | None):
        """Write ``data`` for ``partition``: for an output sink the output of batch number
        ``batch`` (0-based), replacing what an earlier attempt wrote for that batch; for a
        state sink (``batch`` None) the state at the end of the partition, replacing what the
        partition held."""

    @abstractmethod
    def clear(self, spark: SparkSession, partition: str) -> None:
        """Remove everything written for ``partition`` (it is about to be processed anew)."""

    @abstractmethod
    def location(self, partition: str) -> str:
        """Where ``partition``'s rows are (shown in the Dagster UI)."""


@dataclass(frozen=True, kw_only=True)
class ParquetSink(Sink):
    """Parquet files under ``<url>/<partition_column>=<key>/`` on any fsspec URL (the key
    escaped as Spark escapes partition values), one file per Spark task: ``batch-<n>-<task>``
    for outputs, ``state-<task>`` for state. Readable by Spark, pyarrow, pandas and DuckDB
    with hive partitioning. Each file is written under a hidden name and then moved into
    place; files of an earlier attempt that this one did not write are deleted after it."""

    url: str
    partition_column: str = "partition"
    storage_options: dict = field(default_factory=dict)
    storage_options_from_env: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        FileSystemLocation(self.url, self.storage_options, self.storage_options_from_env)

    @property
    def _location(self) -> FileSystemLocation:
        return FileSystemLocation(self.url, self.storage_options, self.storage_options_from_env)

    def location(self, partition: str) -> str:
        return partition_directory(self.url, self.partition_column, partition)

    def write(self, spark: SparkSession, data: DataFrame, partition: str, batch: int | None):
        prefix = "state" if batch is None else f"batch-{batch:05d}"
        directory = self.location(partition)
        frame = self.prepare(data, partition)
        schema = to_arrow_schema(frame.schema, timezone="UTC")
        task = _ParquetWrite(self._location, directory, prefix, schema)
        written = {row["file"] for row in frame.mapInArrow(
            partial(_write_parquet_part, task), "file string").collect()}
        fs, path = self._location.filesystem(directory)
        if not written:  # an empty result still replaces what the partition held
            name = f"{prefix}-empty.parquet"
            _put_parquet(fs, f"{path}/{name}", schema.empty_table())
            written.add(name)
        for entry in fs.ls(path, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith(f"{prefix}-") and name not in written:
                fs.rm(entry)

    def clear(self, spark: SparkSession, partition: str) -> None:
        fs, path = self._location.filesystem(self.location(partition))
        with contextlib.suppress(FileNotFoundError):
            fs.rm(path, recursive=True)


@dataclass(frozen=True)
class _ParquetWrite:
    location: FileSystemLocation
    directory: str
    prefix: str
    schema: pa.Schema


def _put_parquet(fs, path: str, table: pa.Table) -> None:
    """Write ``table`` to ``path`` through a hidden temporary name, so that a reader never
    sees a partial file (and a failed write leaves nothing a reader would take)."""
    directory, name = path.rsplit("/", 1)
    temporary = f"{directory}/.{name}.{uuid.uuid4().hex}.tmp"
    fs.makedirs(directory, exist_ok=True)
    try:
        with fs.open(temporary, "wb") as f:
            pq.write_table(table, f)
        fs.mv(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            fs.rm(temporary)
        raise


def _write_parquet_part(
    task: _ParquetWrite, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: this task's rows as one Parquet file (none when it has no rows)."""
    context = TaskContext.get()
    part = context.partitionId() if context else 0
    table = pa.Table.from_batches(list(batches), schema=task.schema)
    if table.num_rows:
        name = f"{task.prefix}-{part:05d}.parquet"
        fs, path = task.location.filesystem(task.directory)
        _put_parquet(fs, f"{path}/{name}", table)
        yield pa.RecordBatch.from_pylist([{"file": name}])


@dataclass(frozen=True, kw_only=True)
class SparkWriterSink(Sink):
    """Spark's writer (``format``, default Parquet) at ``path``, partitioned by
    ``partition_column`` (and ``batch`` for outputs), with dynamic partition overwrite: a
    re-run replaces exactly the partitions (and batches) it writes. For Spark's filesystems:
    local paths, ``hdfs://``, ``s3a://`` with hadoop-aws."""

    path: str
    format: str = "parquet"
    partition_column: str = "partition"
    options: dict = field(default_factory=dict)

    def location(self, partition: str) -> str:
        return partition_directory(self.path, self.partition_column, partition)

    def write(self, spark: SparkSession, data: DataFrame, partition: str, batch: int | None):
        frame = self.prepare(data, partition).withColumn(self.partition_column, F.lit(partition))
        columns = [self.partition_column]
        if batch is not None:
            frame = frame.withColumn("batch", F.lit(batch))
            columns.append("batch")
        (
            frame.write.format(self.format)
            .options(**self.options)
            .mode("overwrite")
            .option("partitionOverwriteMode", "dynamic")
            .partitionBy(*columns)
            .save(self.path)
        )

    def clear(self, spark: SparkSession, partition: str) -> None:
        jvm = spark.sparkContext._jvm
        escaped = jvm.org.apache.spark.sql.catalyst.catalog.ExternalCatalogUtils.escapePathName(
            partition
        )
        directory = jvm.org.apache.hadoop.fs.Path(
            f"{self.path.rstrip('/')}/{self.partition_column}={escaped}"
        )
        fs = directory.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
        fs.delete(directory, True)
