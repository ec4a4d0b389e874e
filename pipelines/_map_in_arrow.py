"""``DataFrame.mapInArrow`` with its Python UDF made once per Spark context and key, and other
plan pieces a batch would otherwise build anew (issue 28, the steady batch's wall).

PySpark's ``mapInArrow`` pickles the function, sends it to the JVM and wraps it as a UDF,
then resolves each input column: about 30-45 py4j round trips, each a wait on the JVM (a
time slice on a loaded machine), for every batch. A function that does not change between
batches (what varies travels in the rows or, for a keyed stage's task, in a local property)
is wrapped once, and applied to its input's columns by name once per set of names: the batch
then costs one round trip.

A frame made here remembers how (``arrow_mapped``), so that a consumer can run its own function
in the same Python worker, after this one (``chained``), in place of a second ``mapInArrow``
over it: a keyed batch's routing does so over a file source's read.
"""

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import pyarrow as pa
from pyspark import SparkContext
from pyspark.sql import DataFrame
from pyspark.sql import types as T

__all__ = ["ArrowMapped", "arrow_mapped", "chained", "jvm_object", "map_in_arrow",
           "repartition_by", "with_literal"]

_MAX_CACHED = 64  # per Spark context: a run's stages and sources, with room to spare
_COLUMNS: "weakref.WeakKeyDictionary[SparkContext, OrderedDict]" = weakref.WeakKeyDictionary()

ArrowMap = Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]


def _quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _udf_column(frame: DataFrame, key: Hashable, function: ArrowMap, schema: T.StructType,
                columns: tuple[str, ...]):
    """The JVM column of ``function``'s map UDF over ``columns`` (by name, resolved against
    the frame it maps), made on first use of ``key`` and ``columns``."""
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.functions import pandas_udf
    from pyspark.util import PythonEvalType

    cached = _COLUMNS.setdefault(frame.sparkSession.sparkContext, OrderedDict())
    if key in cached:
        cached.move_to_end(key)
    else:
        udf = pandas_udf(function, returnType=schema,
                         functionType=PythonEvalType.SQL_MAP_ARROW_ITER_UDF)
        # the function is kept with its UDF: the key may name its parts by id()
        cached[key] = ({}, udf, function)
        while len(cached) > _MAX_CACHED:
            cached.popitem(last=False)
    applied, udf, _ = cached[key]
    if columns not in applied:
        if len(applied) >= _MAX_CACHED:
            applied.clear()
        # Every column of the frame as an argument, as PySpark's mapInArrow passes them: the
        # optimizer takes a UDF's arguments for what it reads of its child, and prunes the
        # child of a UDF without any below a projection of its output.
        applied[columns] = udf(*[F.col(_quoted(name)) for name in columns])._jc
    return applied[columns]


@dataclass(frozen=True)
class ArrowMapped:
    """How ``map_in_arrow`` made a frame: ``function`` (standing for ``key``) over ``frame``'s
    ``columns``."""

    frame: DataFrame
    function: ArrowMap
    key: Hashable
    columns: tuple[str, ...]


_MAPPED = "_pipelines_arrow_mapped"  # the attribute of a frame made by map_in_arrow


def arrow_mapped(frame: DataFrame) -> ArrowMapped | None:
    """How ``map_in_arrow`` made ``frame`` (None: it did not; a frame derived from one, e.g.
    filtered or cached, is another frame)."""
    return getattr(frame, "__dict__", {}).get(_MAPPED)


def chained(first: ArrowMap, schema: pa.Schema, then: ArrowMap,
            batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: ``then`` over ``first``'s batches, in one Python worker. Each of
    ``first``'s batches is cast to ``schema`` (the Arrow schema Spark would have handed to
    ``then``, e.g. its session's time zone) unless it has it already."""
    return then(batch if batch.schema == schema else batch.cast(schema)
                for batch in first(batches))


def map_in_arrow(frame: DataFrame, function: ArrowMap, schema: T.StructType,
                 key: Hashable, columns: list[str] | None = None) -> DataFrame:
    """``frame.mapInArrow(function, schema)``, the UDF made once per Spark context and ``key``:
    ``key`` must stand for ``function`` and ``schema`` exactly (a later call with the same key
    runs the first call's function). ``columns``: the frame's column names, if the caller
    knows them (else asked of the JVM). Without the classic API (Spark Connect) this is plain
    ``mapInArrow``."""
    jdf = getattr(frame, "_jdf", None)
    if jdf is None:
        return frame.mapInArrow(function, schema)
    names = tuple(frame.columns if columns is None else columns)
    column = _udf_column(frame, key, function, schema, names)
    mapped = DataFrame(jdf.mapInArrow(column, False, None), frame.sparkSession)
    mapped.__dict__[_MAPPED] = ArrowMapped(frame, function, key, names)
    return mapped


def jvm_object(frame: DataFrame, key: Hashable, make: Callable[[], object]):
    """A JVM object of ``frame``'s Spark context, made by ``make`` on first use of ``key``."""
    cached = _COLUMNS.setdefault(frame.sparkSession.sparkContext, OrderedDict())
    if key not in cached:
        cached[key] = (make(), None)
    return cached[key][0]


def with_literal(frame: DataFrame, name: str, value: int | str) -> DataFrame:
    """``frame`` with a column ``name`` of the literal ``value``: two round trips (the
    literal, the projection), where ``withColumn(name, lit(value))`` looks its functions up
    in the JVM each time."""
    jdf = getattr(frame, "_jdf", None)
    if jdf is None:
        from pyspark.sql import functions as F

        return frame.withColumn(name, F.lit(value))
    lit = jvm_object(frame, ("functions.lit",), lambda: getattr(
        frame.sparkSession.sparkContext._jvm, "org.apache.spark.sql.functions").lit)
    return DataFrame(jdf.withColumn(name, lit(value)), frame.sparkSession)


def repartition_by(frame: DataFrame, partitions: int, column: str) -> DataFrame:
    """``frame.repartition(partitions, column)`` in one round trip: the column's JVM list is
    made once."""
    jdf = getattr(frame, "_jdf", None)
    if jdf is None:
        return frame.repartition(partitions, column)

    def columns():
        from pyspark.sql import functions as F
        from pyspark.sql.classic.column import _to_java_column, _to_seq

        return _to_seq(frame.sparkSession.sparkContext, [F.col(column)], _to_java_column)

    seq = jvm_object(frame, ("repartition", column), columns)
    return DataFrame(jdf.repartition(partitions, seq), frame.sparkSession)


def forget_udfs() -> None:
    """Drop the cached UDFs (tests: a function changed under the same key)."""
    _COLUMNS.clear()
