"""What runs on the executors: each partition task writes its slice of a stage's state
through the worker view, or reads it back from its state handle.

Only plain, picklable values travel to executors (a ``CheckpointStorage`` config object,
ids, a location reference, an Arrow schema): never a Dagster resource, never an open
filesystem, never a credential (those come from each executor's environment).
"""

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.pandas.types import from_arrow_schema

from checkpoint_storage import CheckpointStorage
from checkpoint_storage.spi import (
    CheckpointedStateScope,
    CheckpointStorageLocationReference,
    StreamStateHandle,
)
from pipelines._handles import StateHandleRef
from pipelines._parquet_state import read_parquet, write_parquet_state

__all__ = [
    "HANDLE_ROW_SCHEMA",
    "HANDLE_ROW_TYPE",
    "StateReadTask",
    "StateWriteTask",
    "handle_from_row",
    "handle_to_row",
    "read_state_partition",
    "write_state_partition",
]

# One row per written state handle: executors -> driver after a checkpoint, and
# driver -> executors for a restore. The handle's fields are StateHandleRef's (inline state
# travels in `data`); `rows` is -1 where unknown.
_REF_TYPES = {
    "kind": pa.string(), "path": pa.string(), "size": pa.int64(), "checksum": pa.int64(),
    "data": pa.binary(), "relative_path": pa.string(), "start": pa.int64(),
    "scope": pa.string(), "logical_file_id": pa.string(),
}  # fmt: skip
HANDLE_ROW_SCHEMA = pa.schema(
    [("subtask", pa.int32()), ("attempt", pa.int32()), ("rows", pa.int64())]
    + [(f.name, _REF_TYPES[f.name]) for f in fields(StateHandleRef)]
)
HANDLE_ROW_TYPE = from_arrow_schema(HANDLE_ROW_SCHEMA)

# Measured in benchmarks/stage_checkpoint.py (breakdown section): snappy writes fastest of
# snappy/zstd/lz4 at about Spark's own file size. Dictionary encoding is off: state rows are
# keyed by unique ids, so per-batch dictionaries never pay off and cost ~60% of the encode.
# No column statistics either (~15% of the encode): a restore reads whole files, never skips.
PARQUET_COMPRESSION = "snappy"
PARQUET_OPTIONS = {
    "compression": PARQUET_COMPRESSION,
    "use_dictionary": False,
    "write_statistics": False,
}


def handle_to_row(handle: StreamStateHandle, subtask: int, attempt: int, rows: int) -> dict:
    return {"subtask": subtask, "attempt": attempt, "rows": rows} | asdict(
        StateHandleRef.of(handle)
    )


def handle_from_row(row: dict, storage_options: dict) -> StreamStateHandle:
    return StateHandleRef(**{f.name: row[f.name] for f in fields(StateHandleRef)}).handle(
        storage_options
    )


@dataclass(frozen=True)
class StateWriteTask:
    """Everything a partition task needs to write one stage's state for one checkpoint
    (or savepoint: its reference carries the savepoint directory)."""

    storage: CheckpointStorage
    job_id: str
    checkpoint_id: int
    reference: CheckpointStorageLocationReference
    operator_id: str
    schema: pa.Schema
    # Test seam for retries and crashes: called after the state is written, before the
    # handle is returned, with (subtask, attempt).
    after_write: Callable[[int, int], None] | None = None


def write_state_partition(
    task: StateWriteTask, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: stream this partition's batches as one Parquet file into a
    state stream and yield its handle (inline when small). An empty partition writes a
    valid empty Parquet file. Names carry the partition and attempt."""
    context = TaskContext.get()
    subtask = context.partitionId() if context else 0
    attempt = context.attemptNumber() if context else 0
    access = task.storage.create_checkpoint_storage(task.job_id)
    factory = access.resolve_checkpoint_storage_location(task.checkpoint_id, task.reference)
    stream = factory.create_checkpoint_state_output_stream(
        CheckpointedStateScope.EXCLUSIVE, f"{task.operator_id}-{subtask:05d}-a{attempt}-"
    )
    handle, rows = write_parquet_state(stream, task.schema, batches, PARQUET_OPTIONS)
    if task.after_write is not None:
        task.after_write(subtask, attempt)
    row = handle_to_row(handle, subtask, attempt, rows)
    yield pa.RecordBatch.from_pylist([row], schema=HANDLE_ROW_SCHEMA)


@dataclass(frozen=True)
class StateReadTask:
    """Reads state handles back (restore). ``storage`` supplies the fsspec options."""

    storage: CheckpointStorage
    schema: pa.Schema


def read_state_partition(
    task: StateReadTask, handle_rows: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: for each handle row, read and verify the whole state file (size
    and CRC-32), then yield its rows with the stage's schema."""
    options = task.storage.storage_options
    for rows in handle_rows:
        for row in rows.to_pylist():
            handle = handle_from_row(row, options)
            with handle.open() as f:
                data = f.read()
            table = read_parquet(pa.BufferReader(data))
            if table.schema != task.schema:
                table = table.cast(task.schema)
            yield from table.to_batches()
