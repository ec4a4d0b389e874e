"""Stateful PySpark pipelines with Flink-style checkpoints.

Describe a pipeline with ``StatefulPipeline`` (stages, a source, partitions, sinks), run it
with ``StatefulRunner`` (or through Dagster: ``sensors.pipeline_definitions``); read the
state of a checkpoint or savepoint with ``read_state`` (or Spark's ``checkpoint`` format).
What a pipeline's author needs is exported here; examples live in ``pipelines.examples``. A
stage is a DataFrame stage (``Stage``: small state, snapshot whole) or a keyed stage
(``KeyedStage``: large state in key groups, checkpointed incrementally).

Below this surface: ``pipelines.runner`` (positions, retention and restore checks the
Dagster layer uses), ``pipelines.state_reader`` (snapshots opened for reading, state
formats), ``pipelines.state_source`` (the Spark data source) and ``pipelines.keyed`` (key
groups, change files and chains, local stores). Names of those that this package exported
before stay importable from here, so that existing code keeps working.
"""

from checkpoint_storage.spi import lazy_names
from pipelines import state_source  # noqa: F401  (new sessions get the checkpoint format)
from pipelines._savepoints import write_savepoint
from pipelines._sinks import ParquetSink, Sink, SparkWriterSink
from pipelines._sources import FileSource, Source, SparkReadSource
from pipelines._spec import SOURCE, Stage, StatefulPipeline
from pipelines.keyed import (
    FullSnapshotPolicy,
    KeyedResult,
    KeyedStage,
    StateTtl,
    TtlTimeCharacteristic,
    agg,
)
from pipelines.runner import (
    BatchListChangedError,
    CheckpointSummary,
    ClaimRefusedError,
    CorruptStateError,
    MissingStateError,
    PartitionResult,
    SourcePosition,
    StageError,
    StatefulRunner,
    job_id_for,
)
from pipelines.state_reader import StateReadError, UnknownStageError, read_state, state_stages

__all__ = [
    # the pipeline spec and its stages
    "SOURCE",
    "KeyedResult",
    "KeyedStage",
    "FullSnapshotPolicy",
    "Stage",
    "StatefulPipeline",
    "StateTtl",
    "TtlTimeCharacteristic",
    "agg",
    # sources and sinks
    "FileSource",
    "ParquetSink",
    "Sink",
    "Source",
    "SparkReadSource",
    "SparkWriterSink",
    # running without Dagster
    "CheckpointSummary",
    "PartitionResult",
    "SourcePosition",
    "StatefulRunner",
    "job_id_for",
    "write_savepoint",
    # what a run raises
    "BatchListChangedError",
    "ClaimRefusedError",
    "CorruptStateError",
    "MissingStateError",
    "StageError",
    # reading state
    "StateReadError",
    "UnknownStageError",
    "read_state",
    "state_stages",
]

# Names outside __all__ that this package exported before: where each one lives.
_ELSEWHERE = {
    "DEFAULT_MAX_PARALLELISM": "pipelines.keyed",
    "PartitionOrder": "pipelines._spec",
    "arrow_schema": "pipelines._sources",
    "SCHEDULED_SAVEPOINTS": "pipelines.runner",
    "DamagedState": "pipelines.runner",
    "batches_digest": "pipelines.runner",
    "check_restore_from": "pipelines.runner",
    "damaged_state": "pipelines.runner",
    "empty_state": "pipelines.runner",
    "head_of": "pipelines.runner",
    "partition_ends": "pipelines.runner",
    "position_retention": "pipelines.runner",
    "STATE_FORMATS": "pipelines.state_reader",
    "PipelineSnapshot": "pipelines.state_reader",
    "StateFormat": "pipelines.state_reader",
    "StateHandleRef": "pipelines.state_reader",
    "StatePart": "pipelines.state_reader",
    "open_snapshot": "pipelines.state_reader",
    "read_state_part": "pipelines.state_reader",
    "CheckpointDataSource": "pipelines.state_source",
    "register_checkpoint_source": "pipelines.state_source",
    "NonRestoredStateError": "pipelines.runner",
    "LocalStorePrefetch": "pipelines.local_recovery",
    "prefetch_local_stores": "pipelines.local_recovery",
}


__getattr__, __dir__ = lazy_names(__name__, globals(), _ELSEWHERE)

# Errors name themselves by the path users import them from (as httpx does): a failed run's
# message says `pipelines.MissingStateError`, not the private module that defines it.
for _name in __all__:
    _value = globals()[_name]
    if isinstance(_value, type) and issubclass(_value, Exception):
        _value.__module__ = "pipelines"
del _name, _value
