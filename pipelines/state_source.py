"""The Spark data source ``checkpoint``: a stage's state in a pipeline checkpoint or savepoint
as a DataFrame, read in parallel on the executors (one input partition per state part)::

    spark.read.format("checkpoint").option("stage", "user_activity").load(pointer)

Options: ``stage`` (required), ``storage_options`` (a JSON object of fsspec options such as
an ``endpoint_url``: shipped to the executors, so no secrets) and ``storage_options_from_env``
(a JSON object mapping fsspec options to environment variables, read by the driver and by
each executor from its own environment: how credentials reach the executors). The schema is
the stage's recorded one (master state ``state-schema/<stage>``).
"""

import json
from collections.abc import Iterator, Mapping

import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.types import StructType

from checkpoint_storage.spi import options_with_environment
from pipelines.state_reader import StatePart, open_snapshot, read_state_part
from resources import on_session_created

__all__ = ["CHECKPOINT_SOURCE", "CheckpointDataSource", "register_checkpoint_source"]

CHECKPOINT_SOURCE = "checkpoint"


def _json_object(options: Mapping, name: str) -> dict:
    raw = options.get(name)
    if raw is None or not str(raw).strip():
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f'option "{name}" of format "{CHECKPOINT_SOURCE}" must be a JSON object')
    return value


class CheckpointDataSource(DataSource):
    """``spark.read.format("checkpoint")``: see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return CHECKPOINT_SOURCE

    def _settings(self) -> tuple[str, str, dict, dict]:
        pointer = self.options.get("path")
        stage = self.options.get("stage")
        if not pointer:
            raise ValueError(
                f'format "{CHECKPOINT_SOURCE}" reads a checkpoint or savepoint: pass its '
                "pointer to load(POINTER)"
            )
        static = _json_object(self.options, "storage_options")
        from_env = _json_object(self.options, "storage_options_from_env")
        if not stage:
            snapshot = open_snapshot(pointer, storage_options=_options(static, from_env))
            raise ValueError(
                f'format "{CHECKPOINT_SOURCE}" needs option "stage": the stages of {pointer} '
                f"are: {', '.join(snapshot.stages) or 'none'}"
            )
        return pointer, stage, static, from_env

    def schema(self) -> StructType:
        pointer, stage, static, from_env = self._settings()
        snapshot = open_snapshot(pointer, storage_options=_options(static, from_env))
        return from_arrow_schema(snapshot.schema(stage))

    def reader(self, schema: StructType) -> DataSourceReader:
        pointer, stage, static, from_env = self._settings()
        snapshot = open_snapshot(pointer, storage_options=_options(static, from_env))
        return _StateReader(snapshot.parts(stage), snapshot.schema(stage), static, from_env)


def _options(static: dict, from_env: dict) -> dict:
    return options_with_environment(static, from_env, "checkpoint state")


class _StateReader(DataSourceReader):
    """Travels to the executors: plain parts, the Arrow schema and option names only."""

    def __init__(
        self, parts: list[StatePart], schema: pa.Schema, static: dict, from_env: dict
    ) -> None:
        self.parts = parts
        self.schema = schema
        self.static = static
        self.from_env = from_env

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(part) for part in self.parts] or [InputPartition(None)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if partition.value is None:
            return
        options = _options(self.static, self.from_env)
        yield from read_state_part(partition.value, self.schema, options).to_batches()


def register_checkpoint_source(spark: SparkSession) -> None:
    """Make ``spark.read.format("checkpoint")`` available in ``spark``."""
    spark.dataSource.register(CheckpointDataSource)


# Sessions of the Dagster SparkResource come with the data source.
on_session_created(register_checkpoint_source)
