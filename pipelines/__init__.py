"""Stateful PySpark pipelines with Flink-style checkpoints.

Describe a pipeline with ``StatefulPipeline`` (stages, a source, partitions, sinks), run it
with ``StatefulRunner`` (or through Dagster: ``sensors.pipeline_definitions``); read the
state of a checkpoint or savepoint with ``read_state`` (or Spark's ``checkpoint`` format).
Everything a pipeline needs is exported here; examples live in ``pipelines.examples``. A stage
is a DataFrame stage (``Stage``: small state, snapshot whole) or a keyed stage (``KeyedStage``:
large state in key groups, checkpointed incrementally); keyed state's machinery (key groups,
the local store, change files and chains) is ``pipelines.keyed``.
"""

from pipelines._sinks import ParquetSink, Sink, SparkWriterSink
from pipelines._sources import FileSource, Source, SparkReadSource, arrow_schema
from pipelines._spec import SOURCE, PartitionOrder, Stage, StatefulPipeline
from pipelines.keyed import (
    DEFAULT_MAX_PARALLELISM,
    KeyedResult,
    KeyedStage,
    MaterialisationPolicy,
    StateTtl,
    TtlTimeCharacteristic,
    agg,
)
from pipelines.runner import (
    PIPELINE_NAME_STATE,
    POSITION_STATE,
    SCHEDULED_SAVEPOINTS,
    BatchListChangedError,
    CheckpointSummary,
    ClaimRefusedError,
    CorruptStateError,
    DamagedState,
    MissingStateError,
    PartitionResult,
    SourcePosition,
    StageError,
    StatefulRunner,
    batches_digest,
    check_restore_from,
    damaged_state,
    empty_state,
    head_of,
    job_id_for,
    partition_ends,
    position_retention,
)
from pipelines.state_reader import (
    STATE_FORMATS,
    PipelineSnapshot,
    StateFormat,
    StateHandleRef,
    StatePart,
    StateReadError,
    UnknownStageError,
    open_snapshot,
    read_state,
    read_state_part,
    state_stages,
)
from pipelines.state_source import CheckpointDataSource, register_checkpoint_source

__all__ = [
    "DEFAULT_MAX_PARALLELISM",
    "PIPELINE_NAME_STATE",
    "POSITION_STATE",
    "SCHEDULED_SAVEPOINTS",
    "SOURCE",
    "STATE_FORMATS",
    "BatchListChangedError",
    "CheckpointDataSource",
    "CheckpointSummary",
    "ClaimRefusedError",
    "CorruptStateError",
    "DamagedState",
    "FileSource",
    "KeyedResult",
    "KeyedStage",
    "MaterialisationPolicy",
    "MissingStateError",
    "ParquetSink",
    "PartitionOrder",
    "PartitionResult",
    "PipelineSnapshot",
    "Sink",
    "Source",
    "SourcePosition",
    "SparkReadSource",
    "SparkWriterSink",
    "Stage",
    "StageError",
    "StateFormat",
    "StateHandleRef",
    "StatePart",
    "StateReadError",
    "StatefulPipeline",
    "StateTtl",
    "StatefulRunner",
    "TtlTimeCharacteristic",
    "UnknownStageError",
    "agg",
    "arrow_schema",
    "batches_digest",
    "check_claim",
    "check_restore_from",
    "damaged_state",
    "empty_state",
    "head_of",
    "job_id_for",
    "partition_ends",
    "position_retention",
    "open_snapshot",
    "read_state",
    "read_state_part",
    "register_checkpoint_source",
    "state_stages",
]
