"""Sources: where a pipeline's input batches come from.

A source lists, for a partition key, its batches (stable, serialisable ids, in order) and
reads one batch as a DataFrame. The runner applies a partition's batches in that order and
records how many it applied (and a digest of their ids) in each checkpoint's position, so a
restarted run continues with the next batch.

- ``FileSource``: files under a directory per partition on any fsspec URL, read on the
  executors with fsspec and pyarrow (``s3://`` needs no Hadoop jars).
- ``SparkReadSource``: Spark's own readers, for Hadoop filesystems and tables.

Subclass ``Source`` and implement ``batches`` and ``read`` for anything else.
"""

import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

from pipelines._fsspec import FileSystemLocation
from pipelines._map_in_arrow import map_in_arrow, with_literal
from pipelines._parquet_state import read_parquet

__all__ = ["FileSource", "Source", "SparkReadSource", "arrow_schema"]


class Source(ABC):
    """Where input batches come from. Implement ``batches`` and ``read``; instances travel
    to executors when ``read`` uses them there, so keep them plain values (no sessions, no
    open files, no credentials)."""

    @abstractmethod
    def batches(self, spark: SparkSession, partition: str) -> list[str]:
        """The ids of ``partition``'s batches, in the order they are to be applied: stable
        across calls (a restarted run must see the same prefix) and short strings. New
        batches may only be appended. ``FileNotFoundError`` when the partition has no input
        yet (an empty partition is an empty list)."""

    @abstractmethod
    def read(self, spark: SparkSession, partition: str, batch: str) -> DataFrame:
        """One batch as a DataFrame."""

    def describe(self, partition: str) -> str:
        """Where ``partition``'s input is, for messages."""
        return f"{type(self).__name__} partition {partition}"


_DDL_TYPES = {
    "string": pa.string(), "str": pa.string(), "varchar": pa.string(),
    "bigint": pa.int64(), "long": pa.int64(), "int64": pa.int64(),
    "int": pa.int32(), "integer": pa.int32(), "int32": pa.int32(),
    "smallint": pa.int16(), "short": pa.int16(), "tinyint": pa.int8(), "byte": pa.int8(),
    "double": pa.float64(), "float": pa.float32(), "real": pa.float32(),
    "boolean": pa.bool_(), "bool": pa.bool_(), "binary": pa.binary(), "date": pa.date32(),
    "timestamp": pa.timestamp("us", tz="UTC"),
}  # fmt: skip
_DDL_FIELD = re.compile(
    r"\s*`?([A-Za-z_][A-Za-z0-9_]*)`?\s+([A-Za-z0-9]+)\s*"
    r"(?:\(\s*(\d+)\s*(?:,\s*(\d+)\s*)?\))?\s*"
)


def arrow_schema(schema: "pa.Schema | T.StructType | str") -> pa.Schema:
    """An Arrow schema from an Arrow schema, a Spark ``StructType`` or a DDL string such as
    ``"page_id string, viewed_at timestamp, amount decimal(12,2)"`` (timestamps are UTC)."""
    if isinstance(schema, pa.Schema):
        return schema
    if isinstance(schema, T.StructType):
        return to_arrow_schema(schema, timezone="UTC")
    if not isinstance(schema, str) or not schema.strip():
        raise TypeError(f"a schema is an Arrow schema, a StructType or a DDL string: {schema!r}")
    fields = []
    for part in re.split(r",(?![^()]*\))", schema):  # not the comma inside decimal(p, s)
        match = _DDL_FIELD.fullmatch(part)
        if match is None:
            raise ValueError(f"cannot read the schema field {part.strip()!r} in {schema!r}")
        name, kind, precision, scale = match.groups()
        kind = kind.lower()
        if kind == "decimal":
            fields.append(pa.field(name, pa.decimal128(int(precision or 10), int(scale or 0))))
        elif kind in _DDL_TYPES and precision is None:
            fields.append(pa.field(name, _DDL_TYPES[kind]))
        else:
            raise ValueError(f"unknown type {kind!r} of field {name!r} in {schema!r}")
    return pa.schema(fields)


def spark_schema(schema: pa.Schema) -> T.StructType:
    return from_arrow_schema(schema, prefer_timestamp_ntz=False)


@dataclass(frozen=True)
class FileSource(Source):
    """Files under ``url.format(partition=key)``, one batch per file, in name order (land them
    with names that sort in delivery order, e.g. ``batch-00001.parquet``). Read on the
    executors through fsspec and pyarrow, so any fsspec URL works (``s3://``, ``gs://``,
    local paths). ``schema`` is an Arrow schema, a Spark StructType or a DDL string; columns
    are selected and cast to it. ``format``: ``parquet``, ``csv`` or ``json`` (JSON lines).
    Names starting with ``_`` or ``.`` are not batches (``_SUCCESS``, temp files)."""

    url: str
    schema: "pa.Schema | T.StructType | str"
    format: str = "parquet"
    suffix: str = ""
    storage_options: dict = field(default_factory=dict)
    storage_options_from_env: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "{partition}" not in self.url:
            raise ValueError(
                f"FileSource url {self.url!r} needs a '{{partition}}' placeholder, e.g. "
                "'s3://bucket/landing/date={partition}'"
            )
        if self.format not in ("parquet", "csv", "json"):
            raise ValueError(f"FileSource format must be parquet, csv or json: {self.format!r}")
        object.__setattr__(self, "schema", arrow_schema(self.schema))
        FileSystemLocation(self.url, self.storage_options, self.storage_options_from_env)

    @property
    def _location(self) -> FileSystemLocation:
        return FileSystemLocation(self.url, self.storage_options, self.storage_options_from_env)

    def directory(self, partition: str) -> str:
        return self.url.format(partition=partition).rstrip("/")

    def describe(self, partition: str) -> str:
        return self.directory(partition)

    def batches(self, spark: SparkSession, partition: str) -> list[str]:
        directory = self.directory(partition)
        fs, path = self._location.filesystem(directory)
        try:
            entries = fs.ls(path, detail=True)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no input landed for partition {partition} in {directory}: land it first"
            ) from None
        names = []
        for entry in entries:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if entry.get("type") == "directory" or name.startswith(("_", ".")):
                continue
            if name.endswith(self.suffix):
                names.append(name)
        return sorted(names)

    def read(self, spark: SparkSession, partition: str, batch: str) -> DataFrame:
        url = f"{self.directory(partition)}/{batch}"
        # A one-row range, not createDataFrame of a Python list: that scans a Python RDD, one
        # more Python worker in the read's task (1-2 s of a fresh session's first batch). The
        # read's UDF is made once per source: each batch's plan is a few py4j round trips.
        files = with_literal(spark.range(1, numPartitions=1), _URL, url)
        return map_in_arrow(files, partial(_read_files, self), spark_schema(self.schema),
                            ("FileSource.read", id(self)), ["id", _URL])


_URL = "url"  # the column of the files to read, beside the one-row range's id
# Rows per Arrow batch a read hands to the JVM: a Parquet row group (up to 1M rows) in one
# batch held ~60 MB of the JVM's direct memory per batch in flight, 236 MB of it at a first
# batch of 4M keys (docs/benchmarks.md, "state_growth: the batch's pass on disk").
READ_BATCH_ROWS = 1 << 16


def _read_files(source: FileSource, rows: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body on an executor: each row names a file; yield its rows with the
    source's schema."""
    target = to_arrow_schema(spark_schema(source.schema), timezone="UTC")
    for batch in rows:
        for url in batch.column(_URL).to_pylist():
            fs, path = source._location.filesystem(url)
            with fs.open(path, "rb") as f:
                for table in _read_tables(f, source, url):
                    # each batch let go once handed over, the table before the next is read
                    batches = table.select(target.names).cast(target).to_batches(
                        max_chunksize=READ_BATCH_ROWS)
                    del table
                    batches.reverse()
                    while batches:
                        yield batches.pop()


def _read_tables(f, source: FileSource, url: str) -> Iterator[pa.Table]:
    """A file's rows, a Parquet file a row group at a time: read whole, a first batch's file
    of 8M rows held 0.7 GB in the reading worker, which it kept (freed, for reuse) into the
    range's task it ran next (docs/benchmarks.md, "state_growth: a first batch's memory")."""
    if source.format == "parquet":
        parquet = pq.ParquetFile(f)
        missing = [n for n in source.schema.names if n not in parquet.schema_arrow.names]
        if missing:
            raise ValueError(f"{url} lacks the column(s) {missing} (the source's schema has "
                             f"{source.schema.names}); fix the file or the schema")
        for group in range(parquet.metadata.num_row_groups):
            yield read_parquet(parquet, source.schema.names, [group])
        return
    if source.format == "csv":
        from pyarrow import csv

        options = csv.ConvertOptions(column_types=source.schema)
        yield csv.read_csv(f, convert_options=options)
        return
    from pyarrow import json

    # JSON has no date type: read dates as text, the cast to the schema converts them.
    as_read = pa.schema(
        [f.with_type(pa.string()) if pa.types.is_date(f.type) else f for f in source.schema]
    )
    yield json.read_json(f, parse_options=json.ParseOptions(explicit_schema=as_read))


@dataclass(frozen=True)
class SparkReadSource(Source):
    """Spark's readers, for Hadoop filesystems (``hdfs://``, ``s3a://`` with hadoop-aws) and
    tables.

    - ``path``: a directory per partition (``{partition}`` placeholder); each file in it is a
      batch, in name order, listed through Hadoop's FileSystem API and read with
      ``spark.read.format(format)``.
    - ``table``: the whole partition is one batch, ``spark.read.table(table)`` filtered by
      ``where`` (``{partition}`` placeholder), e.g. ``"event_date = '{partition}'"``.
    """

    path: str | None = None
    table: str | None = None
    where: str | None = None
    format: str = "parquet"
    schema: str | None = None
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.path is None) == (self.table is None):
            raise ValueError("SparkReadSource needs exactly one of path and table")
        if self.path is not None and "{partition}" not in self.path:
            raise ValueError(f"SparkReadSource path {self.path!r} needs a '{{partition}}'")

    def describe(self, partition: str) -> str:
        if self.path is not None:
            return self.path.format(partition=partition)
        return f"table {self.table} where {self.where.format(partition=partition)}"

    def batches(self, spark: SparkSession, partition: str) -> list[str]:
        if self.table is not None:
            return ["table"]
        directory = self.path.format(partition=partition)
        jvm = spark.sparkContext._jvm
        hadoop_path = jvm.org.apache.hadoop.fs.Path(directory)
        fs = hadoop_path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
        if not fs.exists(hadoop_path):
            raise FileNotFoundError(
                f"no input landed for partition {partition} in {directory}: land it first"
            )
        names = []
        for status in fs.listStatus(hadoop_path):
            name = status.getPath().getName()
            if status.isFile() and not name.startswith(("_", ".")):
                names.append(name)
        return sorted(names)

    def read(self, spark: SparkSession, partition: str, batch: str) -> DataFrame:
        if self.table is not None:
            frame = spark.read.table(self.table)
            return frame.where(self.where.format(partition=partition)) if self.where else frame
        reader = spark.read.format(self.format).options(**self.options)
        if self.schema is not None:
            reader = reader.schema(self.schema)
        return reader.load(f"{self.path.format(partition=partition).rstrip('/')}/{batch}")
