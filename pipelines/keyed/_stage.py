"""The keyed stage spec: key columns, a state schema, an optional state expiry and a
vectorised Arrow function. Nothing here needs Spark: a keyed stage's function is tested with
plain Arrow tables."""

import datetime as dt
import enum
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field

import pyarrow as pa
import pyarrow.compute as pc

from pipelines.keyed._evolution import check_evolution_spec, integer_range

__all__ = [
    "KeyedResult",
    "KeyedStage",
    "StateTtl",
    "TimeMode",
    "TtlTimeCharacteristic",
    "Watermark",
    "key_type_fits",
]

_STAGE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,62}")


def check_stage_name(name: object) -> None:
    """A stage's name (of either kind) names state files and metadata: letters, digits and
    '_', starting with a letter."""
    if not isinstance(name, str) or not _STAGE_NAME.fullmatch(name):
        raise ValueError(
            f"stage name {name!r}: use letters, digits and '_' (it names state files "
            "and metadata), starting with a letter"
        )

RESERVED_PREFIX = "_"
"""State and key columns must not start with this: the formats add ``_key_group``,
``_deleted``, ``_written_at`` and ``_timers``."""
WRITTEN_AT = "_written_at"
"""The column a store adds for processing-time expiry: when each row was last written."""
TIMERS = "_timers"
"""The column a store adds for a stage with a ``time_mode``: the key's registered timers (a
list of timestamps, UTC), so that timers are checkpointed, rescaled and restored with the
key's state row."""
TIMER = "timer"
"""The column of a timer's time in ``KeyedResult.timers``, ``deleted_timers`` and the
``fired`` table ``on_timer`` gets."""
TIMER_TYPE = pa.timestamp("us", "UTC")


class TimeMode(enum.Enum):
    """Which clock a stage's timers follow (Spark's ``transformWithState`` ``timeMode``): one
    domain per stage."""

    EVENT_TIME = "event_time"
    """A timer fires once the stage's watermark (without a ``Watermark``: its event-time
    clock, the newest event time seen) reaches it: ``timer <= watermark``."""
    PROCESSING_TIME = "processing_time"
    """A timer fires in the first batch whose wall-clock time (taken once per batch on the
    driver) reaches it: ``timer <= now``."""


@dataclass(frozen=True)
class Watermark:
    """A keyed stage's event-time watermark: the newest event time seen (the batch's rows
    included) minus ``allowed_lateness``. A row with ``event_time < watermark`` is late:
    dropped before ``apply`` and counted (the batch's ``late_rows``); a row exactly at the
    watermark is on time. Event-time timers fire when ``timer <= watermark``.

    ``late_rows``: None drops the late rows (counted); a name (letters, digits and '_',
    starting with a letter; not a stage's name) sends them, still counted, to a second
    output of the stage under that name, in the stage's input schema, which a ``Sink``
    with ``stage=<name>`` writes per partition and batch like any output.
    """

    allowed_lateness: dt.timedelta = dt.timedelta(0)
    late_rows: str | None = None

    def __post_init__(self) -> None:
        if (not isinstance(self.allowed_lateness, dt.timedelta)
                or self.allowed_lateness < dt.timedelta(0)):
            raise ValueError("Watermark: allowed_lateness must be a datetime.timedelta >= 0, "
                             f"got {self.allowed_lateness!r}")
        if self.late_rows is not None and (not isinstance(self.late_rows, str)
                                           or not _STAGE_NAME.fullmatch(self.late_rows)):
            raise ValueError("Watermark: late_rows names the late rows' output (a sink's "
                             "stage=): use letters, digits and '_', starting with a letter; "
                             f"or None to drop them; got {self.late_rows!r}")

    def of(self, clock: dt.datetime) -> dt.datetime:
        """The watermark when the newest event time seen is ``clock``."""
        return clock - self.allowed_lateness


class TtlTimeCharacteristic(enum.Enum):
    """Which clock expires state (Flink's ``StateTtlConfig.TtlTimeCharacteristic``)."""

    EVENT_TIME = "event_time"
    """A timestamp column of the state row (written by the stage) against the newest event
    time seen: replaying the same batches expires the same keys."""
    PROCESSING_TIME = "processing_time"
    """When the row was last written, by the wall clock of the task that wrote it."""


@dataclass(frozen=True)
class StateTtl:
    """State expiry (Flink's ``StateTtlConfig``): a key whose state was last updated more than
    ``ttl`` ago is dropped from state and from checkpoints, and is never handed to ``apply``
    again (Flink's ``NeverReturnExpired``).

    With ``EVENT_TIME``, ``timestamp_column`` names a timestamp column of the state schema and
    "now" is the newest event time the stage has seen; with ``PROCESSING_TIME`` the store
    records each row's write time itself and ``timestamp_column`` must be None.
    """

    ttl: dt.timedelta
    time_characteristic: TtlTimeCharacteristic = TtlTimeCharacteristic.EVENT_TIME
    timestamp_column: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.ttl, dt.timedelta) or self.ttl <= dt.timedelta(0):
            raise ValueError(f"StateTtl: ttl must be a positive datetime.timedelta, got "
                             f"{self.ttl!r}")
        if not isinstance(self.time_characteristic, TtlTimeCharacteristic):
            raise TypeError("StateTtl: time_characteristic must be a TtlTimeCharacteristic, got "
                            f"{self.time_characteristic!r}")
        event_time = self.time_characteristic is TtlTimeCharacteristic.EVENT_TIME
        if event_time and not self.timestamp_column:
            raise ValueError("StateTtl: event-time expiry needs timestamp_column, the state "
                             "column that holds each key's last event time")
        if not event_time and self.timestamp_column is not None:
            raise ValueError("StateTtl: processing-time expiry uses the write time the store "
                             "records; leave timestamp_column None")

    @property
    def column(self) -> str:
        """The state column expiry reads: the stage's timestamp, or ``WRITTEN_AT``."""
        return self.timestamp_column or WRITTEN_AT

    def cutoff(self, now: dt.datetime) -> dt.datetime:
        """Rows whose ``column`` is older than this have expired at ``now``."""
        if not isinstance(now, dt.datetime) or now.tzinfo is None:
            raise ValueError(f"StateTtl: now must be a timezone-aware datetime, got {now!r}")
        return now - self.ttl

    def live(self, state: pa.Table | pa.RecordBatch, cutoff: dt.datetime
             ) -> pa.Table | pa.RecordBatch:
        """The rows of ``state`` that have not expired at ``cutoff``."""
        return state.filter(pc.invert(self.expired(state, cutoff)))

    def expired(self, state: pa.Table, cutoff: dt.datetime) -> pa.ChunkedArray:
        """Which rows of ``state`` have expired at ``cutoff`` (a boolean column)."""
        column = state.column(self.column)
        return pc.fill_null(pc.less(column, pa.scalar(cutoff, column.type)), False)


@dataclass(frozen=True)
class KeyedResult:
    """What a keyed stage's ``apply`` (or ``on_timer``) returns for one batch: ``upserts``
    (full state rows, at most one per key), ``deletes`` (the key columns of keys whose state
    goes) and ``output`` (rows for the stage's consumers). A key is either upserted or
    deleted, not both.

    A stage with a ``time_mode`` may also return ``timers`` (key columns and a ``timer``
    timestamp column: timers to register; registering a timer twice is a no-op) and
    ``deleted_timers`` (the same columns: timers to delete; deleting a missing one is a
    no-op). Deletions apply first: a result that deletes and registers the same timer keeps
    it. Timers live with the key's state: the key must have state after the batch."""

    upserts: pa.Table
    deletes: pa.Table
    output: pa.Table
    timers: pa.Table | None = None
    deleted_timers: pa.Table | None = None

    def __post_init__(self) -> None:
        for name in ("upserts", "deletes", "output"):
            if not isinstance(getattr(self, name), pa.Table):
                raise TypeError(f"KeyedResult.{name} must be a pyarrow Table, got "
                                f"{type(getattr(self, name)).__name__}")
        for name in ("timers", "deleted_timers"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), pa.Table):
                raise TypeError(f"KeyedResult.{name} must be a pyarrow Table or None, got "
                                f"{type(getattr(self, name)).__name__}")


Apply = Callable[[pa.Table, pa.Table], KeyedResult]
OnTimer = Callable[[pa.Table, pa.Table], KeyedResult]


@dataclass(frozen=True)
class KeyedStage:
    """A stage with keyed state, large and touched only where a batch has keys (Flink's keyed
    state): ``apply(input, state) -> KeyedResult`` gets a batch of input rows and the current
    state rows (``state_schema``) of the keys in it, and returns state upserts, deletes and
    output rows. Keys the batch has that have no state are absent from ``state``.

    ``key``: the key column name(s), present in both the input and ``state_schema``.
    ``ttl``: optional state expiry. ``input``: as for ``Stage``: ``SOURCE``, an earlier
    stage's name, or None for the previous stage's output (the source for the first stage).
    ``output_schema``: the schema of the output rows (None: the state schema).

    ``event_time``: the input's event-time column (a Spark ``TIMESTAMP``; cast a date or a
    ``TIMESTAMP_NTZ`` column first), the stage's clock: its newest value seen
    so far, this batch included, is "now" for event-time expiry, and input rows older than
    that clock minus the ``ttl`` are dropped before ``apply`` as too late (their keys' state
    may already have expired, as Spark drops rows behind a watermark). Event-time expiry
    needs it.

    ``renamed`` (old column name -> new) and ``defaults`` (added column -> value): how state
    restored from a snapshot written under an older ``state_schema`` evolves into this one
    (docs/pipelines.md, "Upgrading a pipeline").

    ``watermark``: a ``Watermark`` decides lateness instead of the ttl (rows with
    ``event_time < newest event time - allowed_lateness`` are late, dropped and counted).
    ``time_mode`` (a ``TimeMode``) and ``on_timer``: timers. ``apply`` and ``on_timer``
    register and delete timers in their ``KeyedResult``; each batch, after ``apply``, the
    due timers fire: ``on_timer(fired, state)`` gets them (key columns and ``timer``, one
    row per timer) and the state rows of their keys, and returns a ``KeyedResult`` for
    those keys. A fired timer is removed in the same change file as ``on_timer``'s changes.
    """

    name: str
    key: str | Sequence[str]
    state_schema: pa.Schema
    apply: Apply
    ttl: StateTtl | None = None
    input: str | None = None
    output_schema: pa.Schema | None = None
    event_time: str | None = None
    time_mode: TimeMode | None = None
    on_timer: OnTimer | None = None
    watermark: Watermark | None = None
    renamed: Mapping[str, str] = dataclass_field(default_factory=dict, hash=False)
    defaults: Mapping[str, object] = dataclass_field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        check_stage_name(self.name)
        where = f"keyed stage {self.name}"
        key = (self.key,) if isinstance(self.key, str) else self.key
        if not isinstance(key, Sequence) or not key or not all(
                isinstance(k, str) and k for k in key):
            raise ValueError(f"{where}: key must be a column name or a non-empty list of them, "
                             f"got {self.key!r}")
        key = tuple(key)
        if len(set(key)) != len(key):
            raise ValueError(f"{where}: key {list(key)} names a column twice")
        object.__setattr__(self, "key", key)
        if not isinstance(self.state_schema, pa.Schema):
            raise TypeError(f"{where}: state_schema must be a pyarrow Schema (the state rows, "
                            f"key columns included), got {type(self.state_schema).__name__}")
        names = self.state_schema.names
        if len(set(names)) != len(names):
            raise ValueError(f"{where}: state_schema has duplicate column names {names}")
        reserved = [n for n in names if n.startswith(RESERVED_PREFIX)]
        if reserved:
            raise ValueError(f"{where}: state columns {reserved} start with "
                             f"{RESERVED_PREFIX!r}, which the state formats reserve; rename them")
        missing = [k for k in key if k not in names]
        if missing:
            raise ValueError(f"{where}: key column(s) {missing} are not in state_schema "
                             f"{names}; the state rows carry their key")
        for k in key:
            kind = self.state_schema.field(k).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                    or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
                    or pa.types.is_integer(kind) or pa.types.is_boolean(kind)
                    or pa.types.is_timestamp(kind) or pa.types.is_date(kind)):
                raise ValueError(f"{where}: key column {k!r} has type {kind}; keys must be "
                                 "strings, binaries, integers, booleans, dates or timestamps")
        if not callable(self.apply):
            raise TypeError(f"{where}: apply must be callable (input, state) -> KeyedResult")
        if self.ttl is not None:
            if not isinstance(self.ttl, StateTtl):
                raise TypeError(f"{where}: ttl must be a StateTtl, got {self.ttl!r}")
            column = self.ttl.timestamp_column
            if column is not None:
                if column not in names:
                    raise ValueError(f"{where}: ttl timestamp_column {column!r} is not in "
                                     f"state_schema {names}")
                if not pa.types.is_timestamp(self.state_schema.field(column).type):
                    raise ValueError(f"{where}: ttl timestamp_column {column!r} must be a "
                                     "timestamp column, got "
                                     f"{self.state_schema.field(column).type}")

        if self.output_schema is None:
            object.__setattr__(self, "output_schema", self.state_schema)
        elif not isinstance(self.output_schema, pa.Schema):
            raise TypeError(f"{where}: output_schema must be a pyarrow Schema or None, got "
                            f"{type(self.output_schema).__name__}")
        if self.event_time is not None and (not isinstance(self.event_time, str)
                                            or not self.event_time):
            raise ValueError(f"{where}: event_time must be an input column name, got "
                             f"{self.event_time!r}")
        if (self.ttl is not None
                and self.ttl.time_characteristic is TtlTimeCharacteristic.EVENT_TIME
                and self.event_time is None):
            raise ValueError(f"{where}: event-time expiry needs event_time, the input column "
                             "whose newest value is the stage's clock")
        check_evolution_spec(self.renamed, self.defaults, self.state_schema, key, where)
        self._check_timers_and_watermark(where)

    def _check_timers_and_watermark(self, where: str) -> None:
        if self.time_mode is not None and not isinstance(self.time_mode, TimeMode):
            raise TypeError(f"{where}: time_mode must be a TimeMode (EVENT_TIME or "
                            f"PROCESSING_TIME) or None, got {self.time_mode!r}")
        if self.on_timer is not None and not callable(self.on_timer):
            raise TypeError(f"{where}: on_timer must be callable (fired, state) -> KeyedResult")
        if (self.on_timer is None) != (self.time_mode is None):
            raise ValueError(f"{where}: on_timer and time_mode go together: a stage with "
                             "timers needs both (time_mode says which clock fires them, "
                             "on_timer handles them); set both or neither")
        if self.time_mode is not None and TIMER in self.key:
            raise ValueError(f"{where}: a stage with timers cannot have a key column named "
                             f"{TIMER!r} (the timers' time column); rename it")
        if self.time_mode is TimeMode.EVENT_TIME and self.event_time is None:
            raise ValueError(f"{where}: event-time timers need event_time, the input column "
                             "whose newest value drives the watermark")
        if self.watermark is not None:
            if not isinstance(self.watermark, Watermark):
                raise TypeError(f"{where}: watermark must be a Watermark, got "
                                f"{self.watermark!r}")
            if self.event_time is None:
                raise ValueError(f"{where}: a watermark needs event_time, the input column "
                                 "whose newest value it follows")

    @property
    def has_timers(self) -> bool:
        """Whether the stage's state rows carry timers (``TIMERS``)."""
        return self.time_mode is not None

    def late_cutoff(self, clock: dt.datetime | None) -> dt.datetime | None:
        """Input rows with ``event_time`` older than this are late (None: none are): with a
        ``watermark``, the watermark; else, as before watermarks, the clock minus the ttl."""
        if clock is None:
            return None
        if self.watermark is not None:
            return self.watermark.of(clock)
        if self.ttl is not None:
            return self.ttl.cutoff(clock)
        return None

    def timer_limit(self, clock: dt.datetime | None,
                    processing_time: dt.datetime | None) -> dt.datetime | None:
        """Timers at or before this fire (None: none fire): event time, the watermark (or the
        clock without one); processing time, the batch's wall-clock time."""
        if self.time_mode is TimeMode.PROCESSING_TIME:
            return processing_time
        if self.time_mode is TimeMode.EVENT_TIME and clock is not None:
            return self.watermark.of(clock) if self.watermark is not None else clock
        return None

    @classmethod
    def with_variables(cls, name: str, key: pa.Schema, variables: Sequence,
                       apply: Callable, *, output_schema: pa.Schema, **options) -> "KeyedStage":
        """A keyed stage of named state variables (``pipelines.keyed.ValueState``,
        ``ListState``, ``MapState``), each with its own schema and TTL::

            KeyedStage.with_variables("sessions", pa.schema([("user", pa.string())]), [
                ValueState("totals", TOTALS), ListState("clicks", CLICK, ttl=day)],
                apply=step, output_schema=OUT, event_time="ts")

        ``key``: the key columns' schema. ``apply(input, state) -> StateChanges`` gets a
        ``StateView`` (``state.value(name)``, ``state.list(name)``, ``state.map(name)``) and
        returns the changes (``pipelines.keyed.StateChanges``). The variables compile into
        one physical row per key (``state_schema``, with the declaration in its metadata) and
        the stage's ``ttl``; other ``options`` (``input``, ``event_time``, ...) are
        ``KeyedStage``'s. See docs/pipelines.md, "State variables"."""
        from pipelines.keyed._variables import variables_stage  # it builds on this module

        return variables_stage(name, key, variables, apply, output_schema=output_schema,
                               **options)

    def empty_state(self) -> pa.Table:
        """A state table with no rows."""
        return self.state_schema.empty_table()

    @property
    def key_schema(self) -> pa.Schema:
        """The key columns as ``state_schema`` declares them."""
        return pa.schema([self.state_schema.field(k) for k in self.key])

    def check_key_types(self, schema: pa.Schema, what: str) -> None:
        """Refuse key columns of ``schema`` (the ``what`` of a batch: its input, upserts or
        deletes) whose type is not the state schema's key type or a lossless widening of it
        (``key_type_fits``): a cast would change the keys' values, and so their hash and key
        group, silently. The error names the stage, the column, both types and what to do."""
        for name in self.key:
            if name not in schema.names:
                continue  # a missing column is refused where the columns are selected
            given, declared = schema.field(name).type, self.state_schema.field(name).type
            if not key_type_fits(given, declared):
                raise ValueError(
                    f"keyed stage {self.name}: {what} key column {name!r} has type {given}, "
                    f"the state schema's key type is {declared}: keys are not cast, a cast "
                    f"value is another key. Cast {name!r} to {declared} in the stage before "
                    "(or in apply), or declare the key as the type the data has in "
                    "state_schema")

    def cast_keys(self, table: pa.Table) -> pa.Table:
        """The key columns of ``table`` as ``state_schema`` types them (after
        ``check_key_types``: a lossless cast), so that equal keys hash and compare equal."""
        keys = table.select(list(self.key))
        for i, field in enumerate(self.key_schema):
            if keys.schema.field(i).type != field.type:
                keys = keys.set_column(i, field.name, keys.column(i).cast(field.type))
        return keys

    def run(self, input: pa.Table, state: pa.Table, *,
            extra_keys: pa.Table | None = None, now: dt.datetime | None = None) -> KeyedResult:
        """Call ``apply`` and check what it returned: upserts conform to ``state_schema`` (cast
        where Arrow can; key columns only from the same key type, ``check_key_types``),
        deletes carry the key columns, no key is upserted twice or both upserted and deleted,
        and only keys of ``input`` are upserted or deleted: the stage was given the state of
        those keys only, and a key of another key group belongs to another range's task.
        ``extra_keys``: key columns of further keys the stage may change in this batch (e.g.
        keys a timer fired for; None: none). Timers it returns are checked likewise (a stage
        without ``time_mode`` may not return any). ``now``: the batch's time for expiry (the
        task's), passed to an ``apply`` that takes it (a variables stage's). Errors name the
        stage and what to fix."""
        self.check_key_types(input.schema, "the input's")
        return self._checked("apply", _call(self.apply, input, state, now), input, extra_keys)

    def run_on_timer(self, fired: pa.Table, state: pa.Table, *,
                     now: dt.datetime | None = None) -> KeyedResult:
        """Call ``on_timer(fired, state)`` and check what it returned as ``run`` does: it may
        change the keys of ``fired`` only. ``now``: as for ``run``."""
        if self.on_timer is None:
            raise ValueError(f"keyed stage {self.name}: timers fired but the stage has no "
                             "on_timer")
        return self._checked("on_timer", _call(self.on_timer, fired, state, now), fired, None)

    def _checked(self, function: str, result: object, input: pa.Table,
                 extra_keys: pa.Table | None) -> KeyedResult:
        where = f"keyed stage {self.name}"
        if not isinstance(result, KeyedResult):
            raise TypeError(f"{where}: {function} returned {type(result).__name__}, expected a "
                            "KeyedResult(upserts, deletes, output)")
        self.check_key_types(result.upserts.schema, "the upserts'")
        self.check_key_types(result.deletes.schema, "the deletes'")
        upserts = conform_table(result.upserts, self.state_schema, f"{where}: upserts")
        deletes = conform_table(result.deletes.select(
            [k for k in self.key if k in result.deletes.column_names]), self.key_schema,
            f"{where}: deletes")
        _check_unique(upserts, self.key, f"{where}: upserts")
        _check_unique(deletes, self.key, f"{where}: deletes")
        if upserts.num_rows and deletes.num_rows:
            both = upserts.select(list(self.key)).join(deletes, list(self.key), join_type="inner")
            if both.num_rows:
                raise ValueError(f"{where}: {both.num_rows} key(s) are both upserted and deleted "
                                 f"in one batch, e.g. {both.slice(0, 1).to_pylist()[0]}")
        allowed = [self.cast_keys(input)]
        if extra_keys is not None:
            self.check_key_types(extra_keys.schema, "the extra keys'")
            allowed.append(self.cast_keys(extra_keys))
        self._check_keys_allowed(upserts, "upserts", allowed)
        self._check_keys_allowed(deletes, "deletes", allowed)
        timers = self._conform_timers(result.timers, "timers", function)
        deleted_timers = self._conform_timers(result.deleted_timers, "deleted_timers", function)
        for name, table in (("timers", timers), ("deleted_timers", deleted_timers)):
            if table is not None:
                self._check_keys_allowed(table, name, allowed)
        return KeyedResult(upserts, deletes, result.output, timers, deleted_timers)

    @property
    def timer_schema(self) -> pa.Schema:
        """The columns of timers: the key columns and ``timer`` (timestamp, UTC)."""
        return self.key_schema.append(pa.field(TIMER, TIMER_TYPE, nullable=False))

    def _conform_timers(self, table: pa.Table | None, name: str,
                        function: str) -> pa.Table | None:
        """``table`` as ``timer_schema`` (None or no rows: None); a stage without
        ``time_mode`` returning timers is refused."""
        if table is None or not table.num_rows:
            return None
        where = f"keyed stage {self.name}"
        if self.time_mode is None:
            raise ValueError(f"{where}: {function} returned {name} but the stage has no "
                             "time_mode; set time_mode=TimeMode.EVENT_TIME or PROCESSING_TIME "
                             "(and on_timer) to use timers")
        self.check_key_types(table.schema, f"the {name}'")
        if TIMER in table.column_names and not pa.types.is_timestamp(
                table.schema.field(TIMER).type):
            raise ValueError(f"{where}: {name} column {TIMER!r} must be a timestamp, got "
                             f"{table.schema.field(TIMER).type}")
        if TIMER in table.column_names and table.schema.field(TIMER).type.tz is None:
            raise ValueError(f"{where}: {name} column {TIMER!r} must be a timezone-aware "
                             "timestamp (e.g. pa.timestamp('us', 'UTC')): a naive time is "
                             "ambiguous")
        table = conform_table(table, self.timer_schema.remove_metadata().set(
            len(self.key), pa.field(TIMER, TIMER_TYPE)), f"{where}: {name}")
        if table.column(TIMER).null_count:
            raise ValueError(f"{where}: {name} has {table.column(TIMER).null_count} null "
                             f"{TIMER!r} value(s); every timer needs a time")
        return table

    def _check_keys_allowed(self, changes: pa.Table, what: str,
                            allowed: list[pa.Table]) -> None:
        """Refuse ``changes`` of keys in none of ``allowed`` (key columns, state key types)."""
        if not changes.num_rows:
            return
        key = list(self.key)
        others = changes.select(key)
        for keys in allowed:
            if not others.num_rows:
                return
            others = others.join(keys, key, join_type="left anti")
        if others.num_rows:
            raise ValueError(
                f"keyed stage {self.name}: {what} change {others.num_rows} key(s) that are not "
                f"among the batch's input keys, e.g. {others.slice(0, 1).to_pylist()[0]}. A "
                "keyed stage may change only the state of the keys in its input (the state it "
                "was given; another key may belong to another task's key groups): return "
                f"{what} for the input's keys only")


def _call(function: Callable, table: pa.Table, state: pa.Table,
          now: dt.datetime | None) -> object:
    """``function(table, state)``, with ``now=`` when it takes the batch's time."""
    if getattr(function, "takes_now", False):
        return function(table, state, now=now)
    return function(table, state)


def key_type_fits(given: pa.DataType, declared: pa.DataType) -> bool:
    """Whether key values of type ``given`` are keys of type ``declared`` unchanged: the same
    type, or a lossless widening within one family whose values hash alike (``hash_keys``
    hashes the value, not the type): integers into integers that hold all their values
    (int32 -> int64, uint16 -> int32), strings and large strings either way (the same bytes;
    Spark hands strings as either), binaries likewise, and timestamps of the same unit, both
    zoned (any zone: the same instant) or both naive. Not: another unit (its count differs,
    and so its hash), strings into numbers or the reverse, date32 and date64."""
    if given == declared:
        return True
    if pa.types.is_integer(given) and pa.types.is_integer(declared):
        low, high = integer_range(given)
        declared_low, declared_high = integer_range(declared)
        return declared_low <= low and high <= declared_high
    for family in (_STRINGS, _BINARIES):
        if any(is_(given) for is_ in family) and any(is_(declared) for is_ in family):
            return True
    if pa.types.is_timestamp(given) and pa.types.is_timestamp(declared):
        return given.unit == declared.unit and (given.tz is None) == (declared.tz is None)
    return False


_STRINGS = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)
_BINARIES = (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_binary_view)


def conform_table(table: pa.Table, schema: pa.Schema, where: str) -> pa.Table:
    """``table`` as ``schema``: its columns selected in order, cast where Arrow can; errors
    name ``where`` (the stage and what was returned)."""
    missing = [n for n in schema.names if n not in table.column_names]
    if missing:
        raise ValueError(f"{where}: missing column(s) {missing}; expected {schema.names}")
    table = table.select(schema.names)
    if table.schema == schema:
        return table
    try:
        return table.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
        raise ValueError(f"{where}: does not fit the schema {schema}: {exc}") from exc


def _check_unique(table: pa.Table, key: tuple[str, ...], where: str) -> None:
    if table.num_rows < 2:
        return
    counts = table.group_by(list(key)).aggregate([([], "count_all")])
    if counts.num_rows != table.num_rows:
        twice = counts.filter(pc.greater(counts.column("count_all"), 1)).slice(0, 1)
        example = twice.drop_columns(["count_all"]).to_pylist()[0]
        raise ValueError(f"{where} name {table.num_rows - counts.num_rows} key(s) more than "
                         f"once, e.g. {example}; return one row per key")
