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
source reads one per task).

Keyed stages (``CHAIN_FORMAT``, ``keyed-v1``) have one part per key group range: the range's
chain (its full snapshot, then its change files) replayed, every file verified as a
DataFrame stage's are. They return the state schema's columns only (and a stage with timers'
``_timers``: each key's registered timers, a list of UTC timestamps), and under a TTL never
the rows that had expired when the snapshot was taken (event time: against the stage's clock
recorded in the snapshot; processing time: against the snapshot's timestamp).

A keyed stage of state variables (``KeyedStage.with_variables``) records them in its state
schema: ``variable=NAME`` reads one variable's rows (key columns + the value's fields, one row
per list element or map entry), its expired entries left out as above; without it the
physical rows (key columns + one nested column per variable) are read.

This module needs pyarrow, checkpoint_storage and the Spark-free core of
``pipelines.keyed`` only, never a SparkSession.
"""

import datetime as dt
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from checkpoint_storage import CheckpointMetadata, InvalidCheckpointError
from checkpoint_storage.exceptions import StateIntegrityError
from checkpoint_storage.spi import (
    JOB_NAME_STATE,
    STATE_FORMAT_PREFIX,
    STATE_SCHEMA_PREFIX,
    OperatorState,
    OperatorSubtaskState,
    StreamStateHandle,
    resolve_checkpoint_pointer,
)
from pipelines._handles import StateHandleRef
from pipelines._parquet_state import read_parquet
from pipelines.keyed import (
    CHAIN_FORMAT,
    KEYED_STATE_PREFIX,
    TIMERS,
    KeyedStateChain,
    KeyedStateFormatError,
    KeyedStateLayout,
    StateVariables,
    TtlTimeCharacteristic,
    chains_from_operator_state,
    decode_keyed_master_state,
    replay_chains,
)

__all__ = [
    "DATAFRAME_STATE",
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
    "read_variable_part",
    "state_stages",
    "stored_row_count",
]

# STATE_FORMAT_PREFIX, ``state-format/<stage>``: how the stage's state is stored (a key of
# STATE_FORMATS), as text.
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
    DataFrame stage has one part per state handle (per Spark task that wrote it), a keyed
    stage one per key group range (its chain's handles, in order)."""

    stage: str
    format: str
    subtask: int
    handles: tuple[StateHandleRef, ...]
    properties: tuple[tuple[str, str], ...] = ()
    """What else the format needs to read the part, as text (a keyed part: its chain's
    subtask properties, the stage's ``keyed-state/<stage>`` description and the snapshot's
    time)."""


@dataclass(frozen=True)
class StateFormat:
    """How state of one format is read: ``parts(stage, operator_state, metadata)`` splits it
    into parts (``metadata``: the snapshot's, for its master states and time),
    ``read(part, schema, storage_options)`` reads one part into a table of ``schema``."""

    parts: Callable[[str, OperatorState, CheckpointMetadata], list[StatePart]]
    read: Callable[[StatePart, pa.Schema, Mapping], pa.Table]


def _dataframe_parts(
    stage: str, operator: OperatorState, metadata: CheckpointMetadata
) -> list[StatePart]:
    return [
        StatePart(stage, DATAFRAME_STATE, subtask, (StateHandleRef.of(handle),))
        for subtask, state in sorted(operator.subtask_states.items())
        for handle in state.handles
    ]


def _read_dataframe_part(part: StatePart, schema: pa.Schema, options: Mapping) -> pa.Table:
    tables = [_read_parquet(part.stage, ref, schema, options) for ref in part.handles]
    return pa.concat_tables(tables) if tables else schema.empty_table()


# The keyed part's properties the reader adds to its chain's subtask properties.
_KEYED_STATE = "reader.keyed_state"  # the stage's ``keyed-state/<stage>`` master state
_SNAPSHOT_TIME = "reader.timestamp_ms"  # the snapshot's time: "now" for processing-time TTL


def _keyed_parts(
    stage: str, operator: OperatorState, metadata: CheckpointMetadata
) -> list[StatePart]:
    described = metadata.master_states.get(KEYED_STATE_PREFIX + stage)
    if described is None:
        raise InvalidCheckpointError(
            f"stage {stage!r} has keyed state ({CHAIN_FORMAT}) but no "
            f"{KEYED_STATE_PREFIX + stage!r} master state describing its key and expiry: "
            "the snapshot is incomplete; read another checkpoint or savepoint"
        )
    try:
        chains = chains_from_operator_state(operator)
    except KeyedStateFormatError as exc:
        raise InvalidCheckpointError(f"stage {stage!r}: {exc}") from exc
    added = [(_KEYED_STATE, described.decode(errors="replace"))]
    if metadata.timestamp_ms is not None:
        added.append((_SNAPSHOT_TIME, str(metadata.timestamp_ms)))
    return [
        StatePart(
            stage, CHAIN_FORMAT, index, tuple(StateHandleRef.of(h) for h in chain.handles),
            (*sorted(operator.subtask_states[index].properties.items()), *added),
        )
        for index, chain in enumerate(chains)
    ]


def _read_keyed_part(part: StatePart, schema: pa.Schema, options: Mapping) -> pa.Table:
    """The live rows of one key group range: its chain replayed, every file verified as it is
    read; the state schema's columns only (no ``_written_at``), rows expired at the
    snapshot's time left out."""
    stored, layout, clock, snapshot_time, key_groups = _replay_keyed_part(part, schema, options)
    live = _unexpired(stored, layout, clock, snapshot_time)
    return _as_schema(part.stage, live, schema, f"key group range {key_groups}")


def _replay_keyed_part(part: StatePart, schema: pa.Schema, options: Mapping) -> tuple:
    """One key group range's chain replayed, every file verified as it is read: the stored
    rows (expired ones not dropped yet included), the layout, the recorded clock, the
    snapshot's time and the range."""
    properties = dict(part.properties)
    described = properties.pop(_KEYED_STATE, "").encode()
    snapshot_time = properties.pop(_SNAPSHOT_TIME, None)
    where = f"stage {part.stage!r} subtask {part.subtask}"
    handles = []
    for ref in part.handles:
        with _named_state_errors(part.stage, ref.describe()):
            handles.append(ref.handle(options))
    state_schema = schema  # without the timers the reader shows (the layout adds them)
    if TIMERS in schema.names:
        state_schema = schema.remove(schema.get_field_index(TIMERS))
    try:
        layout, clock = decode_keyed_master_state(described, state_schema, where)
        chain = KeyedStateChain.from_subtask_state(OperatorSubtaskState(handles, properties),
                                                   where)
        stored = replay_chains(
            [chain], layout, chain.key_groups,
            read_bytes=lambda handle: _read_handle_bytes(part.stage, handle, options),
        )
    except InvalidCheckpointError:
        raise  # a corrupt or missing file, already named
    except ValueError as exc:  # KeyedStateFormatError and the like: a foreign file
        raise InvalidCheckpointError(f"stage {part.stage!r}: {exc}") from exc
    return stored, layout, clock, snapshot_time, chain.key_groups


def _snapshot_now(
    layout: KeyedStateLayout, clock: dt.datetime | None, snapshot_time: str | None
) -> dt.datetime | None:
    """"Now" for expiry at the snapshot: event time the stage's recorded clock, processing
    time the snapshot's timestamp (None: no TTL, or nothing the reader could tell)."""
    ttl = layout.ttl
    if ttl is None:
        return None
    if ttl.time_characteristic is TtlTimeCharacteristic.EVENT_TIME:
        return clock
    return None if snapshot_time is None else _EPOCH + dt.timedelta(
        milliseconds=int(snapshot_time))


def _unexpired(
    stored: pa.Table, layout: KeyedStateLayout, clock: dt.datetime | None,
    snapshot_time: str | None,
) -> pa.Table:
    """``stored`` without the rows expired at the snapshot (``_snapshot_now``)."""
    now = _snapshot_now(layout, clock, snapshot_time)
    if now is None:
        return stored
    return layout.ttl.live(stored, layout.ttl.cutoff(now))


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def _as_schema(stage: str, table: pa.Table, schema: pa.Schema, what: str) -> pa.Table:
    """``table`` as ``schema``: its columns selected (the formats' own columns dropped)."""
    if table.schema == schema:
        return table
    try:
        return table.select(schema.names).cast(schema)
    except (KeyError, pa.ArrowInvalid, ValueError) as exc:
        raise InvalidCheckpointError(
            f"stage {stage!r}: {what} has columns {table.schema.names}, which do not "
            f"fit the stage's recorded schema {schema.names} ({exc})"
        ) from exc


STATE_FORMATS: dict[str, StateFormat] = {
    DATAFRAME_STATE: StateFormat(_dataframe_parts, _read_dataframe_part),
    CHAIN_FORMAT: StateFormat(_keyed_parts, _read_keyed_part),
}


def _read_bytes(stage: str, ref: StateHandleRef, options: Mapping) -> bytes:
    """The whole state of ``ref``, its size and checksum verified; errors name the file."""
    with _named_state_errors(stage, ref.describe()), ref.handle(options).open() as f:
        return f.read()


def _read_handle_bytes(stage: str, handle: StreamStateHandle, options: Mapping) -> bytes:
    return _read_bytes(stage, StateHandleRef.of(handle), options)


@contextmanager
def _named_state_errors(stage: str, what: str) -> Iterator[None]:
    """Reading state file ``what``: a corrupt file is a StateIntegrityError, a missing one an
    InvalidCheckpointError, any other I/O failure a StateReadError, each naming the stage and
    the file."""
    try:
        yield
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
        table = read_parquet(pa.BufferReader(data))
    except (pa.ArrowInvalid, OSError) as exc:
        raise InvalidCheckpointError(
            f"stage {stage!r}: {ref.describe()} is not a valid Parquet file ({exc}): the state "
            "is corrupt; read another checkpoint or savepoint"
        ) from exc
    return _as_schema(stage, table, schema, ref.describe())


def read_state_part(
    part: StatePart, schema: pa.Schema, storage_options: Mapping | None = None
) -> pa.Table:
    """The rows of one part (with ``schema``), verified as they are read. This is what runs
    on a Spark executor: ``storage_options`` come from that process (its environment)."""
    return _state_format(part.format, part.stage).read(part, schema, storage_options or {})


def stored_row_count(
    part: StatePart, schema: pa.Schema, storage_options: Mapping | None = None
) -> int:
    """How many rows one part stores, every file verified as it is read (a keyed part: its
    chain replayed), a keyed stage's rows expired under its TTL but not dropped yet included:
    what its checkpoint records as the part's ``rows`` (readers leave those rows out)."""
    if part.format == CHAIN_FORMAT:
        return _replay_keyed_part(part, schema, storage_options or {})[0].num_rows
    return read_state_part(part, schema, storage_options).num_rows


def _variables(stage: str, schema: pa.Schema, variable: str) -> tuple[StateVariables, pa.Schema]:
    """The variables ``schema`` records and ``variable``'s rows' schema; a clear error when
    the stage has none or not that one."""
    where = f"stage {stage!r}"
    try:
        found = StateVariables.from_schema(schema, where)
    except ValueError as exc:
        raise InvalidCheckpointError(str(exc)) from exc
    if found is None:
        raise ValueError(f"{where} declares no state variables (it is not a "
                         "KeyedStage.with_variables stage); read it without a variable")
    return found, found.logical_schema(variable)


def read_variable_part(
    part: StatePart, schema: pa.Schema, variable: str, storage_options: Mapping | None = None
) -> pa.Table:
    """Variable ``variable``'s rows in one part of a variables stage (``schema``: its
    recorded physical schema): key columns + the entry's fields, entries expired at the
    snapshot left out. What the Spark source runs per part with option ``variable``."""
    variables, logical = _variables(part.stage, schema, variable)
    physical = read_state_part(part, schema, storage_options)
    properties = dict(part.properties)
    described = properties.get(_KEYED_STATE)
    now = None
    if described is not None:
        layout, clock = decode_keyed_master_state(
            described.encode(), schema, f"stage {part.stage!r} subtask {part.subtask}")
        now = _snapshot_now(layout, clock, properties.get(_SNAPSHOT_TIME))
    return variables.read(physical, variable, now).cast(logical)


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
        if stored is None and self.state_format(stage) != DATAFRAME_STATE:
            raise InvalidCheckpointError(
                f"{self.pointer}: stage {stage!r} records no schema "
                f"({STATE_SCHEMA_PREFIX + stage!r}); its state cannot be decoded without it"
            )
        if stored is not None:
            try:
                schema = pa.ipc.read_schema(pa.py_buffer(stored))
            except (pa.ArrowInvalid, OSError) as exc:
                raise InvalidCheckpointError(
                    f"{self.pointer}: the recorded schema of stage {stage!r} is corrupt ({exc})"
                ) from exc
            return self._with_timers(stage, schema)
        for part in self.parts(stage):
            for ref in part.handles:
                data = _read_bytes(stage, ref, self.storage_options)
                return pq.read_schema(pa.BufferReader(data))
        raise InvalidCheckpointError(
            f"{self.pointer}: stage {stage!r} records neither a schema nor state "
            f"(parallelism {operator.parallelism}, no handles)"
        )

    def variables(self, stage: str) -> list[str]:
        """The state variables the stage declares (``KeyedStage.with_variables``; none: a
        plain stage)."""
        try:
            found = StateVariables.from_schema(self.schema(stage), f"stage {stage!r}")
        except ValueError as exc:
            raise InvalidCheckpointError(str(exc)) from exc
        return [] if found is None else list(found.by_name)

    def variable_schema(self, stage: str, variable: str) -> pa.Schema:
        """The schema of variable ``variable``'s rows: key columns + the entry's fields."""
        return _variables(stage, self.schema(stage), variable)[1]

    def _with_timers(self, stage: str, schema: pa.Schema) -> pa.Schema:
        """A keyed stage with timers: ``schema`` and its stored ``_timers`` column (readers show
        the timers with the key's row)."""
        described = self.metadata.master_states.get(KEYED_STATE_PREFIX + stage)
        if self.state_format(stage) != CHAIN_FORMAT or described is None:
            return schema
        try:
            layout, _ = decode_keyed_master_state(described, schema, f"stage {stage!r}")
        except KeyedStateFormatError as exc:
            raise InvalidCheckpointError(f"{self.pointer}: {exc}") from exc
        if not layout.timers:
            return schema
        return schema.append(layout.stored_schema.field(TIMERS))

    def parts(self, stage: str) -> list[StatePart]:
        """The stage's state as independently readable parts (``read_state_part``)."""
        operator = self._operator(stage)
        return _state_format(self.state_format(stage), stage).parts(
            stage, operator, self.metadata
        )

    def read(
        self,
        stage: str,
        *,
        where: Mapping[str, object] | None = None,
        limit: int | None = None,
        variable: str | None = None,
    ) -> pa.Table:
        """The stage's rows, every part verified as it is read. ``variable``: a variables
        stage's variable, read as its rows (``read_variable_part``; None: the physical rows,
        one per key). ``where`` keeps the rows
        whose columns equal the given values (converted to each column's type; ``None``
        matches nulls); ``limit`` stops after that many rows. A keyed stage's rows are
        its live state: rows expired under its TTL when the snapshot was taken are left
        out (event time: the clock the snapshot records; processing time: the snapshot's
        timestamp as now)."""
        schema = physical = self.schema(stage)
        if variable is not None:
            schema = _variables(stage, physical, variable)[1]
        condition = _equality_filter(schema, where or {})
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be 0 or more, got {limit}")
        tables, rows = [], 0
        for part in self.parts(stage):
            if limit is not None and rows >= limit:
                break
            if variable is None:
                table = read_state_part(part, schema, self.storage_options)
            else:
                table = read_variable_part(part, physical, variable, self.storage_options)
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
    variable: str | None = None,
) -> pa.Table:
    """The rows of ``stage``'s state in the snapshot at ``pointer``, as an Arrow table with
    the stage's schema (see ``PipelineSnapshot.read``; a keyed stage without the rows that
    had expired under its TTL at the snapshot's time; ``variable``: one state variable's
    rows)."""
    snapshot = open_snapshot(pointer, storage_options=storage_options)
    return snapshot.read(stage, where=where, limit=limit, variable=variable)
