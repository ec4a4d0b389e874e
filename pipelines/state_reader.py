"""Reading the state of a pipeline's checkpoint or savepoint without Spark (what Flink's State
Processor API does): the stages a snapshot holds, their schemas, and their rows as Arrow.

A snapshot's `_metadata` names each stage's state handles (operator state ``<stage>``) and
records the pipeline's name and each stage's Arrow schema as master states (the well-known
``checkpoint_storage.JOB_NAME_STATE`` and ``STATE_SCHEMA_PREFIX``). Every handle is read
whole through its ``open()``, which checks a file's size and CRC-32 as it reads, before any
byte is decoded.

How a stage's state is stored decides how it is read: ``STATE_FORMATS`` maps the format a
snapshot records for a stage (master state ``state-format/<stage>``; absent: a DataFrame
stage, one Parquet file per Spark task) to how it splits into ``StatePart``\\ s and how a part
is read. A part is plain data, so a part can be read on another machine (the Spark data
source reads one per task). Keyed state (a Parquet snapshot per key-group range plus change
files) adds a format here.

This module needs pyarrow and checkpoint_storage only, never a SparkSession.
"""

import datetime as dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from checkpoint_storage import (
    JOB_NAME_STATE,
    STATE_SCHEMA_PREFIX,
    CheckpointMetadata,
    InvalidCheckpointError,
    OperatorState,
    StateIntegrityError,
    resolve_checkpoint_pointer,
)
from pipelines._handles import StateHandleRef

__all__ = [
    "DATAFRAME_STATE",
    "STATE_FORMAT_PREFIX",
    "STATE_FORMATS",
    "PipelineSnapshot",
    "StateFormat",
    "StateHandleRef",
    "StatePart",
    "StateReadError",
    "UnknownStageError",
    "open_snapshot",
    "read_state",
    "read_state_part",
    "state_stages",
]

# ``state-format/<stage>``: how the stage's state is stored (a key of STATE_FORMATS), as text.
STATE_FORMAT_PREFIX = "state-format/"
# The format of a stage without a ``state-format/<stage>`` master state: a DataFrame stage's
# state, one Parquet file per Spark task (inline when small).
DATAFRAME_STATE = "dataframe"


class UnknownStageError(ValueError):
    """The snapshot holds no state for the stage asked for (the message lists those it has)."""


class StateReadError(OSError):
    """A state file exists but could not be read (permissions, network, storage options)."""


@dataclass(frozen=True)
class StatePart:
    """One unit of reading a stage's state: plain data, picklable, free of credentials. A
    DataFrame stage has one part per state handle (per Spark task that wrote it)."""

    stage: str
    format: str
    subtask: int
    handles: tuple[StateHandleRef, ...]


@dataclass(frozen=True)
class StateFormat:
    """How state of one format is read: ``parts(stage, operator_state)`` splits it into parts,
    ``read(part, schema, storage_options)`` reads one part into a table of ``schema``."""

    parts: Callable[[str, OperatorState], list[StatePart]]
    read: Callable[[StatePart, pa.Schema, Mapping], pa.Table]


def _dataframe_parts(stage: str, operator: OperatorState) -> list[StatePart]:
    return [
        StatePart(stage, DATAFRAME_STATE, subtask, (StateHandleRef.of(handle),))
        for subtask, state in sorted(operator.subtask_states.items())
        for handle in state.handles
    ]


def _read_dataframe_part(part: StatePart, schema: pa.Schema, options: Mapping) -> pa.Table:
    tables = [_read_parquet(part.stage, ref, schema, options) for ref in part.handles]
    return pa.concat_tables(tables) if tables else schema.empty_table()


STATE_FORMATS: dict[str, StateFormat] = {
    DATAFRAME_STATE: StateFormat(_dataframe_parts, _read_dataframe_part),
}


def _read_bytes(stage: str, ref: StateHandleRef, options: Mapping) -> bytes:
    """The whole state of ``ref``, its size and checksum verified; errors name the file."""
    what = ref.describe()
    try:
        with ref.handle(options).open() as f:
            return f.read()
    except StateIntegrityError as exc:
        raise StateIntegrityError(
            f"stage {stage!r}: {exc} (read another checkpoint or savepoint; `checkpoints "
            "verify POINTER` checks every state file)"
        ) from exc
    except FileNotFoundError as exc:
        raise InvalidCheckpointError(
            f"stage {stage!r}: {what} is missing: the snapshot is incomplete (its files were "
            "deleted or moved); read another checkpoint or savepoint"
        ) from exc
    except OSError as exc:
        raise StateReadError(
            f"stage {stage!r}: cannot read {what}: {exc}: check the storage options "
            "(endpoint, credentials in the environment) and permissions"
        ) from exc


def _read_parquet(stage: str, ref: StateHandleRef, schema: pa.Schema, options) -> pa.Table:
    data = _read_bytes(stage, ref, options)
    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowInvalid, OSError) as exc:
        raise InvalidCheckpointError(
            f"stage {stage!r}: {ref.describe()} is not a valid Parquet file ({exc}): the state "
            "is corrupt; read another checkpoint or savepoint"
        ) from exc
    if table.schema == schema:
        return table
    try:
        return table.select(schema.names).cast(schema)
    except (KeyError, pa.ArrowInvalid, ValueError) as exc:
        raise InvalidCheckpointError(
            f"stage {stage!r}: {ref.describe()} has columns {table.schema.names}, which do not "
            f"fit the stage's recorded schema {schema.names} ({exc})"
        ) from exc


def read_state_part(
    part: StatePart, schema: pa.Schema, storage_options: Mapping | None = None
) -> pa.Table:
    """The rows of one part (with ``schema``), verified as they are read. This is what runs
    on a Spark executor: ``storage_options`` come from that process (its environment)."""
    return _state_format(part.format, part.stage).read(part, schema, storage_options or {})


def _state_format(name: str, stage: str) -> StateFormat:
    found = STATE_FORMATS.get(name)
    if found is None:
        raise InvalidCheckpointError(
            f"stage {stage!r} stores its state as {name!r}, which this version cannot read "
            f"(it reads {sorted(STATE_FORMATS)}): upgrade the pipelines package"
        )
    return found


class PipelineSnapshot:
    """A pipeline's checkpoint or savepoint, opened for reading: ``stages``, each stage's
    ``schema`` and ``parts``, and ``read(stage)``. Open one with ``open_snapshot``."""

    def __init__(
        self, pointer: str, metadata: CheckpointMetadata, storage_options: Mapping | None = None
    ) -> None:
        name = metadata.master_states.get(JOB_NAME_STATE)
        if name is None:
            raise InvalidCheckpointError(
                f"{pointer} is a checkpoint, but not one a pipeline wrote (its `_metadata` has "
                f"no {JOB_NAME_STATE!r} master state): point at a pipeline's checkpoint "
                "or savepoint"
            )
        self.pointer = pointer
        self.metadata = metadata
        self.pipeline_name = name.decode(errors="replace")
        self.storage_options = dict(storage_options or {})
        self._operators = {op.operator_id: op for op in metadata.operator_states}

    @property
    def checkpoint_id(self) -> int:
        return self.metadata.checkpoint_id

    @property
    def is_savepoint(self) -> bool:
        return self.metadata.properties.is_savepoint()

    @property
    def stages(self) -> list[str]:
        """The stages whose state the snapshot holds, in pipeline order."""
        return list(self._operators)

    def _operator(self, stage: str) -> OperatorState:
        operator = self._operators.get(stage)
        if operator is None:
            raise UnknownStageError(
                f"{self.pointer} (pipeline {self.pipeline_name}) holds no state for stage "
                f"{stage!r}; its stages are: {', '.join(self.stages) or 'none'}"
            )
        return operator

    def state_format(self, stage: str) -> str:
        """How the stage's state is stored (a key of ``STATE_FORMATS``)."""
        self._operator(stage)
        recorded = self.metadata.master_states.get(STATE_FORMAT_PREFIX + stage)
        return DATAFRAME_STATE if recorded is None else recorded.decode(errors="replace")

    def schema(self, stage: str) -> pa.Schema:
        """The stage's state schema as recorded in the snapshot (master state
        ``state-schema/<stage>``); snapshots from before it was recorded: the first part's."""
        operator = self._operator(stage)
        stored = self.metadata.master_states.get(STATE_SCHEMA_PREFIX + stage)
        if stored is not None:
            try:
                return pa.ipc.read_schema(pa.py_buffer(stored))
            except (pa.ArrowInvalid, OSError) as exc:
                raise InvalidCheckpointError(
                    f"{self.pointer}: the recorded schema of stage {stage!r} is corrupt ({exc})"
                ) from exc
        for part in self.parts(stage):
            for ref in part.handles:
                data = _read_bytes(stage, ref, self.storage_options)
                return pq.read_schema(pa.BufferReader(data))
        raise InvalidCheckpointError(
            f"{self.pointer}: stage {stage!r} records neither a schema nor state "
            f"(parallelism {operator.parallelism}, no handles)"
        )

    def parts(self, stage: str) -> list[StatePart]:
        """The stage's state as independently readable parts (``read_state_part``)."""
        operator = self._operator(stage)
        return _state_format(self.state_format(stage), stage).parts(stage, operator)

    def read(
        self,
        stage: str,
        *,
        where: Mapping[str, object] | None = None,
        limit: int | None = None,
    ) -> pa.Table:
        """The stage's rows, every part verified as it is read. ``where`` keeps the rows
        whose columns equal the given values (converted to each column's type; ``None``
        matches nulls); ``limit`` stops after that many rows."""
        schema = self.schema(stage)
        condition = _equality_filter(schema, where or {})
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be 0 or more, got {limit}")
        tables, rows = [], 0
        for part in self.parts(stage):
            if limit is not None and rows >= limit:
                break
            table = read_state_part(part, schema, self.storage_options)
            if condition is not None:
                table = table.filter(condition)
            tables.append(table)
            rows += table.num_rows
        result = pa.concat_tables(tables) if tables else schema.empty_table()
        return result if limit is None else result.slice(0, limit)

    def __repr__(self) -> str:
        kind = "savepoint" if self.is_savepoint else "checkpoint"
        return f"PipelineSnapshot({self.pointer!r}, {kind} of {self.pipeline_name})"


def _equality_filter(schema: pa.Schema, where: Mapping[str, object]) -> pc.Expression | None:
    """The Arrow filter of ``where`` ({column: value}, all must hold), each value converted
    to its column's type; a clear ``ValueError`` for an unknown column or a value that does
    not convert."""
    condition = None
    for column, value in where.items():
        if column not in schema.names:
            raise ValueError(
                f"where: unknown column {column!r}; the columns are: {', '.join(schema.names)}"
            )
        field = pc.field(column)
        if value is None:
            term = field.is_null()
        else:
            term = field == _typed(column, value, schema.field(column).type)
        condition = term if condition is None else condition & term
    return condition


def _typed(column: str, value: object, type_: pa.DataType) -> pa.Scalar:
    try:
        if isinstance(value, str) and not pa.types.is_string(type_):
            if pa.types.is_timestamp(type_) and type_.tz is not None:
                return _timestamp_from_text(value, type_)
            return pa.scalar(value).cast(type_)
        return pa.scalar(value, type=type_)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError,
            ValueError, OverflowError) as exc:
        raise ValueError(
            f"where: {value!r} is no value of column {column!r} (type {type_}): {exc}"
        ) from None


def _timestamp_from_text(text: str, type_: pa.TimestampType) -> pa.Scalar:
    """An ISO time; without an offset it is taken in the column's time zone."""
    moment = dt.datetime.fromisoformat(text)
    naive = pa.array([moment.replace(tzinfo=None)], pa.timestamp(type_.unit))
    if moment.tzinfo is not None:
        return pa.scalar(moment, type=type_)
    return pc.assume_timezone(naive, type_.tz)[0].cast(type_)


def open_snapshot(pointer: str, *, storage_options: Mapping | None = None) -> PipelineSnapshot:
    """The pipeline checkpoint or savepoint at ``pointer`` (its directory or `_metadata`; a
    local path or fsspec URL), its `_metadata` read and validated. ``CheckpointNotFoundError``
    when there is none, ``InvalidCheckpointError`` when it is not a pipeline's."""
    options = dict(storage_options or {})
    location = resolve_checkpoint_pointer(pointer, options)
    return PipelineSnapshot(location.external_pointer, location.load_metadata(), options)


def state_stages(pointer: str, *, storage_options: Mapping | None = None) -> list[str]:
    """The stages whose state the snapshot at ``pointer`` holds."""
    return open_snapshot(pointer, storage_options=storage_options).stages


def read_state(
    pointer: str,
    stage: str,
    *,
    storage_options: Mapping | None = None,
    where: Mapping[str, object] | None = None,
    limit: int | None = None,
) -> pa.Table:
    """The rows of ``stage``'s state in the snapshot at ``pointer``, as an Arrow table with
    the stage's schema (see ``PipelineSnapshot.read``)."""
    snapshot = open_snapshot(pointer, storage_options=storage_options)
    return snapshot.read(stage, where=where, limit=limit)
