"""Where a stage's initial state comes from: a DataFrame, a table or a function of the Spark
session (``StatefulPipeline.initial_state``, ``write_savepoint``)."""

from collections.abc import Callable

from pyspark.sql import DataFrame, SparkSession

__all__ = ["StateRows", "rows_of"]

StateRows = DataFrame | str | Callable[[SparkSession], DataFrame]
"""State rows: a DataFrame, a table name (``spark.table``) or a function spark -> DataFrame."""


def rows_of(spark: SparkSession, source: StateRows, where: str) -> DataFrame:
    """The DataFrame ``source`` names; a TypeError naming ``where`` for anything else."""
    if isinstance(source, DataFrame):
        return source
    if isinstance(source, str):
        return spark.table(source)
    if callable(source):
        rows = source(spark)
        if isinstance(rows, DataFrame):
            return rows
        raise TypeError(f"{where}: the function returned {type(rows).__name__}, not a "
                        "DataFrame")
    raise TypeError(f"{where}: expected a DataFrame, a table name or a function spark -> "
                    f"DataFrame, got {type(source).__name__}")
