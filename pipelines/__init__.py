"""Stateful PySpark pipelines with Flink-style checkpoints.

Describe a pipeline with ``StatefulPipeline`` (stages, a source, partitions, sinks), run it
with ``StatefulRunner`` (or through Dagster: ``sensors.pipeline_definitions``). Everything a
pipeline needs is exported here; examples live in ``pipelines.examples``. Keyed state's
machinery (key groups, the local store, change files and chains) is ``pipelines.keyed``.
"""

from pipelines._sinks import ParquetSink, Sink, SparkWriterSink
from pipelines._sources import FileSource, Source, SparkReadSource, arrow_schema
from pipelines._spec import SOURCE, PartitionOrder, Stage, StatefulPipeline
from pipelines.keyed import (
    DEFAULT_MAX_PARALLELISM,
    KeyedResult,
    KeyedStage,
    StateTtl,
    TtlTimeCharacteristic,
)
from pipelines.runner import (
    PIPELINE_NAME_STATE,
    POSITION_STATE,
    SCHEDULED_SAVEPOINTS,
    BatchListChangedError,
    CheckpointSummary,
    MissingStateError,
    PartitionResult,
    SourcePosition,
    StatefulRunner,
    batches_digest,
    check_restore_from,
    empty_state,
    job_id_for,
)

__all__ = [
    "DEFAULT_MAX_PARALLELISM",
    "PIPELINE_NAME_STATE",
    "POSITION_STATE",
    "SCHEDULED_SAVEPOINTS",
    "SOURCE",
    "BatchListChangedError",
    "CheckpointSummary",
    "FileSource",
    "KeyedResult",
    "KeyedStage",
    "MissingStateError",
    "ParquetSink",
    "PartitionOrder",
    "PartitionResult",
    "Sink",
    "Source",
    "SourcePosition",
    "SparkReadSource",
    "SparkWriterSink",
    "Stage",
    "StatefulPipeline",
    "StateTtl",
    "StatefulRunner",
    "TtlTimeCharacteristic",
    "arrow_schema",
    "batches_digest",
    "check_restore_from",
    "empty_state",
    "job_id_for",
]
