"""Savepoints written from tables (Flink's State Processor API bootstrap)."""

from collections.abc import Mapping

from pyspark.sql import SparkSession

from checkpoint_storage import CheckpointStorage
from pipelines._bootstrap import StateRows, rows_of
from pipelines._positions import SourcePosition, batches_digest
from pipelines._spec import StatefulPipeline
from pipelines.runner import StatefulRunner

__all__ = ["write_savepoint"]


def write_savepoint(pipeline: StatefulPipeline, states: Mapping[str, StateRows], *,
                    storage: CheckpointStorage, spark: SparkSession | None = None,
                    after: str | None = None, target_directory: str | None = None) -> str:
    """Write a self-contained savepoint of ``pipeline`` whose state is ``states``: per stage
    name, a DataFrame, a table name or a function spark -> DataFrame of the stage's state
    schema (a keyed stage's: one row per key, else an error naming a key). A stage not given
    holds no state (as in Flink, a savepoint holds what was written; restored, that stage
    starts empty, or from its initial state). ``after``: the partition at whose end the
    state is (a run restoring the savepoint starts with the partition after it); None:
    before the pipeline's first partition. Into ``target_directory`` (default: the storage's
    savepoint directory). Returns the savepoint's pointer, for ``restore_from``."""
    if not isinstance(pipeline, StatefulPipeline):
        raise TypeError(f"write_savepoint: pipeline must be a StatefulPipeline, got "
                        f"{type(pipeline).__name__}")
    spark = spark or SparkSession.active()
    rows = {name: rows_of(spark, source, f"write_savepoint of pipeline {pipeline.name}, "
                                         f"stage {name}")
            for name, source in states.items()}
    if after is None:
        position = SourcePosition(pipeline.order.first, 0, False, batches_digest([]))
    else:
        position = SourcePosition(pipeline.order.check(after), 0, True)
    runner = StatefulRunner(spark, storage, pipeline)
    return runner.write_savepoint(rows, position, target_directory).pointer
