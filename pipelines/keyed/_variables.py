"""State variables of a keyed stage (Spark 4's ``ValueState``/``ListState``/``MapState``,
Flink's state descriptors): several named variables per key, each with its own schema and
TTL, that COMPILE into the one-row-per-key state of a plain ``KeyedStage``, so checkpoints,
change files, full snapshots, rescaling, local stores and restores are those of any keyed
stage.

The physical row is the key columns and one column per variable:

- ``ValueState``: a struct of the value's fields; null when the key has no value;
- ``ListState``: a list of structs (the elements, in order); empty when the list is;
- ``MapState``: a list of structs of the user key's and the value's fields, sorted by user
  key (not an Arrow map: map types round-trip badly through Parquet and Spark, and a sorted
  list of entries reads as a table row per entry);

plus, under event-time TTL, ``variables_ttl_time`` (``TTL_TIME``): the row's expiry column.
Each entry (value, list element, map entry) carries its own time: the variable's event-time
``timestamp_column`` (one of its fields), or under processing-time TTL a hidden
``_written_at`` field stamped when the entry is written. Expired entries are invisible to the
stage and are dropped when the key's row is next written; the whole row expires when all its
entries have (``TTL_TIME`` is each entry's time shifted by its variable's TTL less the longest
TTL, the latest of them; null, never expiring, while a variable without TTL holds something).

Everything here is vectorised Arrow over the batch's keys (no Python loop per key) and needs
no Spark. The declaration is recorded in the physical schema's metadata
(``VARIABLES_METADATA``), so readers recover each variable from a checkpoint alone.
"""

import base64
import dataclasses
import datetime as dt
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.keyed._key_groups import hash_keys
from pipelines.keyed._stage import (
    RESERVED_PREFIX,
    WRITTEN_AT,
    KeyedResult,
    KeyedStage,
    StateTtl,
    TtlTimeCharacteristic,
    conform_table,
    key_type_fits,
)

__all__ = [
    "TTL_TIME",
    "VARIABLES_METADATA",
    "ListState",
    "MapState",
    "StateChanges",
    "StateVariables",
    "StateView",
    "ValueState",
]

VARIABLES_METADATA = b"pipelines.keyed.variables"
"""The physical state schema's metadata key that records the variables (JSON)."""
TTL_TIME = "variables_ttl_time"
"""The physical row's expiry column under event-time TTL (no variable may take this name)."""
_FORMAT = 1
_UTC_US = pa.timestamp("us", "UTC")
_ROW = "_var_row"
_RANK = "_var_rank"
_POSITION = "_var_position"
_INDEX = "_var_index"
_PARENT = "_var_parent"  # an entry's row in the physical table it was read from
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,62}")


def _check_fields(schema: object, where: str, what: str) -> pa.Schema:
    if not isinstance(schema, pa.Schema) or not len(schema):
        raise TypeError(f"{where}: {what} must be a non-empty pyarrow Schema, got {schema!r}")
    names = schema.names
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: {what} has duplicate field names {names}")
    reserved = [n for n in names if not n or n.startswith(RESERVED_PREFIX)]
    if reserved:
        raise ValueError(f"{where}: {what} fields {reserved} start with {RESERVED_PREFIX!r}, "
                         "which the state formats reserve; rename them")
    return schema


def _sortable(kind: pa.DataType) -> bool:
    types = pa.types
    return (types.is_string(kind) or types.is_large_string(kind) or types.is_binary(kind)
            or types.is_large_binary(kind) or types.is_integer(kind) or types.is_boolean(kind)
            or types.is_timestamp(kind) or types.is_date(kind))


class _Variable:
    """What the three kinds share: a name, entry fields, a TTL and the physical column."""

    kind: ClassVar[str]
    name: str
    ttl: StateTtl | None

    @property
    def fields(self) -> pa.Schema:
        """The fields of one entry as the stage sees them (a map: user key, then value)."""
        raise NotImplementedError

    def _check(self) -> None:
        where = f"{type(self).__name__} {self.name!r}"
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"{where}: a variable's name is a column name: letters, digits "
                             "and '_', starting with a letter")
        if self.ttl is None:
            return
        if not isinstance(self.ttl, StateTtl):
            raise TypeError(f"{where}: ttl must be a StateTtl or None, got {self.ttl!r}")
        column = self.ttl.timestamp_column
        if column is not None:
            if column not in self.fields.names:
                raise ValueError(f"{where}: ttl timestamp_column {column!r} is not a field of "
                                 f"the variable {self.fields.names}")
            kind = self.fields.field(column).type
            if not pa.types.is_timestamp(kind) or kind.tz is None:
                raise ValueError(f"{where}: ttl timestamp_column {column!r} must be a "
                                 f"timestamp with a time zone, got {kind}")

    @property
    def processing_time(self) -> bool:
        return (self.ttl is not None
                and self.ttl.time_characteristic is TtlTimeCharacteristic.PROCESSING_TIME)

    @property
    def stored_fields(self) -> pa.Schema:
        """An entry as stored: ``fields``, plus ``_written_at`` under processing-time TTL."""
        if self.processing_time:
            return self.fields.append(pa.field(WRITTEN_AT, _UTC_US))
        return self.fields

    @property
    def physical_type(self) -> pa.DataType:
        entry = pa.struct(list(self.stored_fields))
        return entry if self.kind == "value" else pa.list_(entry)

    def describe(self) -> dict:
        schemas = ([self.key_schema, self.value_schema] if self.kind == "map"
                   else [self.schema])
        ttl = None if self.ttl is None else {
            "microseconds": self.ttl.ttl // dt.timedelta(microseconds=1),
            "time_characteristic": self.ttl.time_characteristic.value,
            "timestamp_column": self.ttl.timestamp_column}
        return {"name": self.name, "kind": self.kind, "ttl": ttl,
                "schemas": [base64.b64encode(s.serialize().to_pybytes()).decode()
                            for s in schemas]}


@dataclass(frozen=True)
class ValueState(_Variable):
    """One value per key (Spark's ``ValueState``): a row of ``schema``'s fields, or none.
    ``ttl``: the value's expiry (event time: ``timestamp_column`` names one of its fields,
    a zoned timestamp; processing time: when the value was last written)."""

    name: str
    schema: pa.Schema
    ttl: StateTtl | None = None
    kind: ClassVar[str] = "value"

    def __post_init__(self) -> None:
        _check_fields(self.schema, f"ValueState {self.name!r}", "schema")
        self._check()

    @property
    def fields(self) -> pa.Schema:
        return self.schema


@dataclass(frozen=True)
class ListState(_Variable):
    """A list per key (Spark's ``ListState``): elements of ``schema``'s fields, in order.
    Appending touches only the keys appended to (their rows are rewritten with their whole
    list). ``ttl``: per element (event time: ``timestamp_column`` names one of its fields;
    processing time: when the element was appended)."""

    name: str
    schema: pa.Schema
    ttl: StateTtl | None = None
    kind: ClassVar[str] = "list"

    def __post_init__(self) -> None:
        _check_fields(self.schema, f"ListState {self.name!r}", "schema")
        self._check()

    @property
    def fields(self) -> pa.Schema:
        return self.schema


@dataclass(frozen=True)
class MapState(_Variable):
    """A map per key (Spark's ``MapState``): entries of ``key_schema``'s fields (the user key:
    strings, binaries, integers, booleans, dates or timestamps) and ``value_schema``'s, one
    per user key, kept sorted by user key. ``ttl``: per entry (event time:
    ``timestamp_column`` names a field of the value; processing time: when it was put)."""

    name: str
    key_schema: pa.Schema
    value_schema: pa.Schema
    ttl: StateTtl | None = None
    kind: ClassVar[str] = "map"

    def __post_init__(self) -> None:
        where = f"MapState {self.name!r}"
        _check_fields(self.key_schema, where, "key_schema")
        _check_fields(self.value_schema, where, "value_schema")
        twice = sorted(set(self.key_schema.names) & set(self.value_schema.names))
        if twice:
            raise ValueError(f"{where}: fields {twice} are in both key_schema and "
                             "value_schema; an entry is one row of both")
        for f in self.key_schema:
            if not _sortable(f.type):
                raise ValueError(f"{where}: user key field {f.name!r} has type {f.type}; user "
                                 "keys must be strings, binaries, integers, booleans, dates "
                                 "or timestamps (entries are kept sorted by them)")
        self._check()

    @property
    def fields(self) -> pa.Schema:
        return pa.schema(list(self.key_schema) + list(self.value_schema))


Variable = ValueState | ListState | MapState
_KINDS = {"value": ValueState, "list": ListState, "map": MapState}


@dataclass(frozen=True)
class StateChanges:
    """What a variables stage's function returns for one batch (or fired timers). Each mapping
    is variable name -> a table of key columns plus:

    - ``values``: the value's fields (at most one row per key): the key's new value;
    - ``cleared_values``: nothing more (the keys whose value goes);
    - ``appends``: the element's fields, appended in the table's order;
    - ``replaced_lists``: the element's fields: the key's whole new list, in order;
    - ``cleared_lists``: the keys whose list becomes empty;
    - ``map_puts``: the user key's and value's fields (one row per key and user key);
    - ``map_removes``: the user key's fields: the entries that go;
    - ``cleared_maps``: the keys whose map becomes empty.

    ``delete_keys``: key columns of keys whose every variable goes. Order within a batch:
    deletes and clears first, then replacements, then appends and puts; removes before puts.
    ``output``: rows for the stage's consumers. ``timers``/``deleted_timers``: passed on to
    the ``KeyedResult`` as they are (keyed timers, when the stage kind has them)."""

    output: pa.Table
    values: Mapping[str, pa.Table] = field(default_factory=dict)
    cleared_values: Mapping[str, pa.Table] = field(default_factory=dict)
    appends: Mapping[str, pa.Table] = field(default_factory=dict)
    replaced_lists: Mapping[str, pa.Table] = field(default_factory=dict)
    cleared_lists: Mapping[str, pa.Table] = field(default_factory=dict)
    map_puts: Mapping[str, pa.Table] = field(default_factory=dict)
    map_removes: Mapping[str, pa.Table] = field(default_factory=dict)
    cleared_maps: Mapping[str, pa.Table] = field(default_factory=dict)
    delete_keys: pa.Table | None = None
    timers: pa.Table | None = None
    deleted_timers: pa.Table | None = None


# change field -> (the variable kind it is for, what its rows carry: "entry", "key" or
# "user key", its rank in a list's order)
_CHANGES = {
    "values": ("value", "entry"),
    "cleared_values": ("value", "key"),
    "appends": ("list", "entry"),
    "replaced_lists": ("list", "entry"),
    "cleared_lists": ("list", "key"),
    "map_puts": ("map", "entry"),
    "map_removes": ("map", "user key"),
    "cleared_maps": ("map", "key"),
}
_TIMER_FIELDS = ("timers", "deleted_timers")


class StateView:
    """The stage's read-only view of its variables for one batch: ``value(name)``,
    ``list(name)`` and ``map(name)`` are tables of key columns plus the entry's fields, one
    row per key that has a value, per list element (in order), per map entry (sorted by user
    key). Expired entries are not in them."""

    def __init__(self, variables: "StateVariables", entries: Mapping[str, pa.Table]) -> None:
        self._variables = variables
        self._entries = dict(entries)

    @property
    def names(self) -> list[str]:
        """The stage's variables."""
        return list(self._variables.by_name)

    def _get(self, name: str, kind: str) -> pa.Table:
        variable = self._variables.variable(name)
        if variable.kind != kind:
            raise ValueError(f"{self._variables.where}: variable {name!r} is a "
                             f"{variable.kind} variable; read it with state.{variable.kind}"
                             f"({name!r})")
        return self._variables.visible(self._entries[name], variable)

    def value(self, name: str) -> pa.Table:
        """Key columns + the value's fields, one row per key that has a value."""
        return self._get(name, "value")

    def list(self, name: str) -> pa.Table:
        """Key columns + the element's fields, one row per element, each key's in order."""
        return self._get(name, "list")

    def map(self, name: str) -> pa.Table:
        """Key columns + user key + value fields, one row per entry, sorted by user key."""
        return self._get(name, "map")


@dataclass(frozen=True)
class StateVariables:
    """A keyed stage's variables over its key columns ``key`` (a schema): the physical
    ``state_schema`` and ``ttl`` they compile into, the stage's view of a batch's physical
    rows (``view``), its changes compiled back (``compile``), and each variable's rows for
    readers (``read``). ``where`` names the stage in errors."""

    key: pa.Schema
    variables: tuple[Variable, ...]
    where: str = "variables"
    state_schema: pa.Schema = field(init=False)
    ttl: StateTtl | None = field(init=False)

    def __post_init__(self) -> None:
        where = self.where
        if not isinstance(self.key, pa.Schema) or not len(self.key):
            raise TypeError(f"{where}: key must be a pyarrow Schema of the key columns, got "
                            f"{self.key!r}")
        variables = tuple(self.variables)
        if not variables:
            raise ValueError(f"{where}: declare at least one variable (ValueState, ListState, "
                             "MapState)")
        for variable in variables:
            if not isinstance(variable, (ValueState, ListState, MapState)):
                raise TypeError(f"{where}: {variable!r} is not a ValueState, ListState or "
                                "MapState")
        object.__setattr__(self, "variables", variables)
        names = [v.name for v in variables]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"{where}: variables {twice} are declared twice")
        key_names = self.key.names
        clash = [n for n in names if n in key_names or n == TTL_TIME]
        if clash:
            raise ValueError(f"{where}: variable name(s) {clash} collide with the key columns "
                             f"{key_names} (or {TTL_TIME!r}, the row's expiry column); "
                             "rename the variables")
        for variable in variables:
            clash = [n for n in variable.fields.names if n in key_names]
            if clash:
                raise ValueError(f"{where}: variable {variable.name!r} has field(s) {clash} "
                                 "named as key columns; its rows carry the key beside its "
                                 "fields: rename them")
        kinds = {v.ttl.time_characteristic for v in variables if v.ttl is not None}
        if len(kinds) > 1:
            raise ValueError(f"{where}: the variables' TTLs mix event time and processing "
                             "time; a stage has one clock for expiry: use one of them")
        fields = list(self.key) + [pa.field(v.name, v.physical_type) for v in variables]
        ttls = [v.ttl.ttl for v in variables if v.ttl is not None]
        ttl = None
        if kinds == {TtlTimeCharacteristic.EVENT_TIME}:
            fields.append(pa.field(TTL_TIME, _UTC_US))
            ttl = StateTtl(max(ttls), TtlTimeCharacteristic.EVENT_TIME, TTL_TIME)
        elif kinds:
            if len(ttls) != len(variables):
                raise ValueError(
                    f"{where}: under processing-time TTL every variable needs a ttl: a row "
                    "expires by its last write, which would expire a variable without one")
            # No entry outlives the longest TTL after the row's last write.
            ttl = StateTtl(max(ttls), TtlTimeCharacteristic.PROCESSING_TIME)
        declared = json.dumps({"format": _FORMAT,
                               "variables": [v.describe() for v in variables]})
        object.__setattr__(self, "state_schema", pa.schema(
            fields, metadata={VARIABLES_METADATA: declared.encode()}))
        object.__setattr__(self, "ttl", ttl)

    # --- the declaration, recorded ---------------------------------------------------------

    @classmethod
    def from_schema(cls, schema: pa.Schema, where: str = "variables"
                    ) -> "StateVariables | None":
        """The variables a physical state schema records (None: a plain keyed stage's); its
        other columns, but ``TTL_TIME``, are the key."""
        recorded = (schema.metadata or {}).get(VARIABLES_METADATA)
        if recorded is None:
            return None
        try:
            declared = json.loads(recorded)
            if declared.get("format") != _FORMAT:
                raise ValueError(f"format {declared.get('format')!r}, this version reads "
                                 f"{_FORMAT}")
            variables = []
            for item in declared["variables"]:
                schemas = [pa.ipc.read_schema(pa.py_buffer(base64.b64decode(s)))
                           for s in item["schemas"]]
                ttl = item["ttl"]
                if ttl is not None:
                    ttl = StateTtl(dt.timedelta(microseconds=ttl["microseconds"]),
                                   TtlTimeCharacteristic(ttl["time_characteristic"]),
                                   ttl["timestamp_column"])
                variables.append(_KINDS[item["kind"]](item["name"], *schemas, ttl=ttl))
            taken = {v.name for v in variables} | {TTL_TIME}
            # (a reader may add the store's own columns, e.g. the timers': not the key)
            key = pa.schema([f for f in schema if f.name not in taken
                             and not f.name.startswith(RESERVED_PREFIX)])
            found = cls(key, tuple(variables), where)
        except (ValueError, KeyError, TypeError, pa.ArrowInvalid) as exc:
            raise ValueError(f"{where}: the recorded state variables cannot be read ({exc}); "
                             "upgrade the pipelines package or read the physical rows") from exc
        return found

    @property
    def by_name(self) -> dict[str, Variable]:
        return {v.name: v for v in self.variables}

    def variable(self, name: str) -> Variable:
        found = self.by_name.get(name)
        if found is None:
            raise ValueError(f"{self.where}: no state variable {name!r}; the variables are: "
                             f"{', '.join(self.by_name)}")
        return found

    def logical_schema(self, name: str) -> pa.Schema:
        """The rows of variable ``name`` for readers: key columns + the entry's fields."""
        return pa.schema(list(self.key) + list(self.variable(name).fields))

    # --- physical rows -> entries ----------------------------------------------------------

    def entries(self, physical: pa.Table, now: dt.datetime | None) -> dict[str, pa.Table]:
        """Each variable's live entries in ``physical`` (rows of ``state_schema``), as key
        columns + stored fields + their physical row: expired ones (at ``now``; None: none
        expire) left out."""
        keys = physical.select(self.key.names).cast(self.key)
        found = {}
        for variable in self.variables:
            column = physical.column(variable.name)
            column = (column.combine_chunks() if column.num_chunks
                      else pa.array([], variable.physical_type))
            if variable.kind == "value":
                present = np.flatnonzero(pc.is_valid(column).to_numpy(zero_copy_only=False))
                values = column.take(pa.array(present))
            else:
                present = pc.list_parent_indices(column)
                values = pc.list_flatten(column)
            table = keys.take(present)
            for stored, values_of in zip(variable.stored_fields, values.flatten(),
                                         strict=True):
                table = table.append_column(stored, values_of)
            table = table.append_column(_PARENT, pa.array(present, pa.int64()))
            found[variable.name] = self._live(table, variable, now)
        return found

    def _live(self, entries: pa.Table, variable: Variable, now: dt.datetime | None) -> pa.Table:
        if variable.ttl is None or now is None or not entries.num_rows:
            return entries
        expired = variable.ttl.expired(entries, variable.ttl.cutoff(now))
        # A filter copies every row: only when something expired.
        return entries.filter(pc.invert(expired)) if pc.any(expired).as_py() else entries

    def visible(self, entries: pa.Table, variable: Variable) -> pa.Table:
        """``entries`` as the stage and readers see them: no ``_written_at``."""
        return entries.select(self.key.names + variable.fields.names)

    def view(self, physical: pa.Table, now: dt.datetime | None) -> StateView:
        return StateView(self, self.entries(physical, now))

    def read(self, physical: pa.Table, name: str, now: dt.datetime | None) -> pa.Table:
        """Variable ``name``'s live rows in ``physical`` (``logical_schema(name)``)."""
        variable = self.variable(name)
        return self.visible(self.entries(physical, now)[name], variable)

    # --- changes -> physical rows ----------------------------------------------------------

    def _changes(self, changes: StateChanges, now: dt.datetime | None
                 ) -> dict[str, dict[str, pa.Table]]:
        """The change tables by change field and variable, checked and conformed: an entry
        as stored (processing time: stamped ``now``), a user key as its fields, a key as the
        key columns."""
        found: dict[str, dict[str, pa.Table]] = {}
        for change, (kind, carries) in _CHANGES.items():
            given = getattr(changes, change)
            if not isinstance(given, Mapping):
                raise TypeError(f"{self.where}: StateChanges.{change} must be a dict of "
                                f"variable name -> table, got {type(given).__name__}")
            for name, table in given.items():
                what = f"{self.where}: StateChanges.{change}[{name!r}]"
                if name not in self.by_name:
                    raise ValueError(f"{what}: the stage declares no variable {name!r}; its "
                                     f"variables are: {', '.join(self.by_name)}")
                variable = self.by_name[name]
                if variable.kind != kind:
                    raise ValueError(f"{what}: {name!r} is a {variable.kind} variable; "
                                     f"StateChanges.{change} is for {kind} variables")
                if not isinstance(table, pa.Table):
                    raise TypeError(f"{what} must be a pyarrow Table, got "
                                    f"{type(table).__name__}")
                fields = {"entry": list(variable.fields),
                          "user key": list(getattr(variable, "key_schema", [])),
                          "key": []}[carries]
                table = self._conform(table, pa.schema(list(self.key) + fields), what)
                if carries == "entry" and variable.processing_time:
                    table = table.append_column(
                        WRITTEN_AT, pa.repeat(pa.scalar(now, _UTC_US), table.num_rows))
                found.setdefault(change, {})[name] = table
        return found

    def _conform(self, table: pa.Table, schema: pa.Schema, what: str) -> pa.Table:
        for name in self.key.names:
            if name not in table.column_names:
                continue  # conform_table names the missing columns
            given, declared = table.schema.field(name).type, self.key.field(name).type
            if not key_type_fits(given, declared):
                raise ValueError(f"{what}: key column {name!r} has type {given}, the key is "
                                 f"{declared}; cast it (keys are not cast silently)")
        return conform_table(table, schema, what)

    def compile(self, physical: pa.Table, entries: Mapping[str, pa.Table],
                changes: StateChanges, now: dt.datetime | None) -> tuple[pa.Table, pa.Table]:
        """The physical upserts and deletes of ``changes`` applied to ``entries`` (the live
        entries of the batch's keys, from ``entries(physical, now)``; ``physical``: their
        rows): the changed keys' whole rows, and the keys (with state) whose every variable
        is empty after the changes."""
        key = self.key.names
        given = self._changes(changes, now)
        deleted = None
        if changes.delete_keys is not None:
            if not isinstance(changes.delete_keys, pa.Table):
                raise TypeError(f"{self.where}: StateChanges.delete_keys must be a pyarrow "
                                f"Table, got {type(changes.delete_keys).__name__}")
            deleted = self._conform(changes.delete_keys, self.key,
                                    f"{self.where}: StateChanges.delete_keys")
        touched = [t.select(key) for tables in given.values() for t in tables.values()]
        touched += [] if deleted is None else [deleted]
        changed = _distinct(pa.concat_tables(touched or [self.key.empty_table()]), key)
        count = changed.num_rows
        if not count:
            return self.state_schema.empty_table(), self.key.empty_table()
        # Each physical row's changed key (-1: untouched): entries find theirs by parent row.
        physical_row = _positions(physical.select(key).cast(self.key), changed, key)
        columns, filled = [], np.zeros(count, bool)
        expiry = _Expiry(count)
        for variable in self.variables:
            name = variable.name
            current = entries[name]
            row = physical_row[current.column(_PARENT).to_numpy()]
            gone = np.zeros(count, bool)
            for change in ("cleared_values", "values", "cleared_lists", "replaced_lists",
                           "cleared_maps"):
                if name in given.get(change, {}):
                    gone[_positions(given[change][name], changed, key)] = True
            if deleted is not None:
                gone[_positions(deleted, changed, key)] = True
            keep = (row >= 0) & ~gone[np.maximum(row, 0)]
            if variable.kind == "map":
                user = key + variable.key_schema.names
                for change in ("map_removes", "map_puts"):
                    if name in given.get(change, {}):
                        keep &= _positions(current, given[change][name], user) < 0
            added = {"value": ["values"], "list": ["replaced_lists", "appends"],
                     "map": ["map_puts"]}[variable.kind]
            parts = [(current if keep.all() else current.filter(pa.array(keep)), row[keep])]
            parts += [(given[c][name], _positions(given[c][name], changed, key))
                      for c in added if name in given.get(c, {})]
            # The key columns stay out: an entry's key is its row of ``changed`` (taking
            # strings per entry costs more than all the rest).
            stored = variable.stored_fields
            rows = pa.concat_tables([
                _with_rank(t.select(stored.names).cast(stored), rank, rows_of)
                for rank, (t, rows_of) in enumerate(parts)])
            rows = self._live(rows, variable, now)  # an entry written expired is dropped
            if variable.kind == "value":
                _check_once(rows, changed, f"{self.where}: variable {name!r}")
            elif name in given.get("map_puts", {}):
                _check_unique(given["map_puts"][name], key + variable.key_schema.names,
                              f"{self.where}: variable {name!r}")
            if variable.kind == "map":
                order = pc.sort_indices(rows, [(_ROW, "ascending")] + [
                    (n, "ascending") for n in variable.key_schema.names])
            else:
                # The parts are concatenated in rank order, each in its own order: a stable
                # sort by key row alone keeps both (and costs a fraction of a 3-column sort).
                order = np.argsort(rows.column(_ROW).to_numpy(), kind="stable")
            rows = rows.take(order)
            row_of = rows.column(_ROW).to_numpy()
            entry = pa.StructArray.from_arrays(
                [rows.column(f.name).combine_chunks() if rows.num_rows
                 else pa.array([], f.type) for f in variable.stored_fields],
                fields=list(variable.stored_fields))
            counts = np.bincount(row_of, minlength=count)
            filled |= counts > 0
            if variable.kind == "value":
                index = np.full(count, -1, np.int64)
                index[row_of] = np.arange(len(row_of))
                column = entry.take(pa.array(index, mask=index < 0))
            else:
                offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
                column = pa.ListArray.from_arrays(pa.array(offsets), entry)
            columns.append(column.cast(variable.physical_type))
            expiry.add(variable, rows, row_of)
        table = changed
        for variable, column in zip(self.variables, columns, strict=True):
            table = table.append_column(variable.name, column)
        if TTL_TIME in self.state_schema.names:
            table = table.append_column(TTL_TIME, expiry.column(self.ttl.ttl))
        table = table.cast(self.state_schema)
        upserts = table.filter(pa.array(filled))
        had_state = np.zeros(count, bool)
        had_state[physical_row[physical_row >= 0]] = True
        deletes = changed.filter(pa.array(~filled & had_state))
        return upserts, deletes


class _Expiry:
    """Per changed key, the latest entry time shifted by its variable's TTL less the
    longest; null when an entry never expires (no TTL, or no time)."""

    def __init__(self, rows: int) -> None:
        self.latest = np.full(rows, np.iinfo(np.int64).min, np.int64)
        self.never = np.zeros(rows, bool)

    def add(self, variable: Variable, rows: pa.Table, row_of: np.ndarray) -> None:
        if not len(row_of):
            return
        if variable.ttl is None or variable.ttl.timestamp_column is None:
            self.never[row_of] = True
            return
        times = pc.cast(rows.column(variable.ttl.timestamp_column).cast(_UTC_US), pa.int64())
        valid = pc.is_valid(times).to_numpy(zero_copy_only=False)
        self.never[row_of[~valid]] = True
        micros = pc.fill_null(times, 0).to_numpy() + variable.ttl.ttl // dt.timedelta(
            microseconds=1)
        np.maximum.at(self.latest, row_of[valid], micros[valid])

    def column(self, longest: dt.timedelta) -> pa.Array:
        shifted = self.latest - longest // dt.timedelta(microseconds=1)
        return pa.array(shifted, pa.int64(), mask=self.never).cast(_UTC_US)


def _with_rank(table: pa.Table, rank: int, rows_of: np.ndarray) -> pa.Table:
    """``table`` with its changed key's row, its part's rank and its position in the part."""
    table = table.append_column(_ROW, pa.array(rows_of, pa.int64()))
    table = table.append_column(_RANK, pa.repeat(pa.scalar(rank, pa.int8()), table.num_rows))
    return table.append_column(_POSITION, pa.array(np.arange(table.num_rows)))


def _distinct(keys: pa.Table, key: list[str]) -> pa.Table:
    return keys.group_by(key, use_threads=False).aggregate([]).select(key)


def _positions(rows: pa.Table, keys: pa.Table, on: list[str]) -> np.ndarray:
    """For each of ``rows``, the index of the row of ``keys`` (distinct on ``on``) with
    equal ``on`` columns, or -1. By key hash (``hash_keys``: a join on strings costs several
    times more), each match's columns compared; two keys sharing a hash: by a join on the
    columns and a row index (no nested field enters a join)."""
    found = np.full(rows.num_rows, -1, np.int64)
    if not rows.num_rows or not keys.num_rows:
        return found
    wanted, given = hash_keys(keys, tuple(on)), hash_keys(rows, tuple(on))
    order = np.argsort(wanted, kind="stable")
    ordered = wanted[order]
    if not (ordered[1:] == ordered[:-1]).any():
        at = np.minimum(np.searchsorted(ordered, given), len(ordered) - 1)
        hit = ordered[at] == given
        found[hit] = order[at[hit]]
        matched = np.flatnonzero(hit)
        same = all(pc.all(pc.equal(rows.column(c).take(matched),
                                   keys.column(c).take(found[matched]))).as_py() is not False
                   for c in on)
        if same:
            return found
        found[:] = -1
    left = rows.select(on).append_column(_INDEX, pa.array(np.arange(rows.num_rows)))
    right = keys.select(on).append_column(_ROW, pa.array(np.arange(keys.num_rows)))
    joined = left.join(right, on, join_type="inner")
    found[joined.column(_INDEX).to_numpy()] = joined.column(_ROW).to_numpy()
    return found


def _check_once(rows: pa.Table, changed: pa.Table, where: str) -> None:
    """Refuse a value written twice for a key (rows: a value's, with ``_ROW`` into the
    ``changed`` keys)."""
    rows_of = rows.column(_ROW).to_numpy()
    twice = np.flatnonzero(np.bincount(rows_of, minlength=changed.num_rows) > 1)
    if len(twice):
        example = changed.slice(int(twice[0]), 1).to_pylist()[0]
        raise ValueError(f"{where}: {example} is written twice in one batch; give one row "
                         "per key (per user key for a map)")


def _check_unique(rows: pa.Table, on: list[str], where: str) -> None:
    if rows.num_rows < 2:
        return
    counts = rows.select(on).group_by(on, use_threads=False).aggregate([([], "count_all")])
    if counts.num_rows != rows.num_rows:
        twice = counts.filter(pc.greater(counts.column("count_all"), 1)).slice(0, 1)
        example = twice.drop_columns(["count_all"]).to_pylist()[0]
        raise ValueError(f"{where}: {example} is written twice in one batch; give one row "
                         "per key (per user key for a map)")


@dataclass(frozen=True)
class VariablesApply:
    """A variables stage's ``apply`` (and ``on_timer``): the batch's physical rows as a
    ``StateView``, the user's ``function(input, view) -> StateChanges`` called, the changes
    compiled into a ``KeyedResult``. ``takes_now``: ``KeyedStage.run`` passes the batch's
    time, which expires entries and stamps them under processing-time TTL."""

    variables: StateVariables
    function: Callable[[pa.Table, StateView], StateChanges]
    takes_now: ClassVar[bool] = True

    def __call__(self, input: pa.Table, state: pa.Table,
                 now: dt.datetime | None = None) -> KeyedResult:
        variables = self.variables
        if any(v.ttl is not None for v in variables.variables) and now is None:
            raise ValueError(f"{variables.where}: variables with a TTL need the batch's time; "
                             "run the stage through KeyedStage.run(..., now=...)")
        entries = variables.entries(state, now)
        changes = self.function(input, StateView(variables, entries))
        if not isinstance(changes, StateChanges):
            raise TypeError(f"{variables.where}: the function returned "
                            f"{type(changes).__name__}, expected a StateChanges(output=..., "
                            "values=..., appends=..., map_puts=..., ...)")
        if not isinstance(changes.output, pa.Table):
            raise TypeError(f"{variables.where}: StateChanges.output must be a pyarrow Table, "
                            f"got {type(changes.output).__name__}")
        upserts, deletes = variables.compile(state, entries, changes, now)
        return KeyedResult(upserts, deletes, changes.output, **_timer_fields(changes,
                                                                             variables.where))


def _timer_fields(changes: StateChanges, where: str) -> dict:
    """The timers of ``changes`` as ``KeyedResult`` keywords (``KeyedStage.run`` checks them:
    a stage without ``time_mode`` refuses them)."""
    known = {f.name for f in dataclasses.fields(KeyedResult)}
    extra = {}
    for name in _TIMER_FIELDS:
        value = getattr(changes, name)
        if value is None:
            continue
        if name not in known:
            raise ValueError(f"{where}: StateChanges.{name} is given, but this version's "
                             "keyed stages have no timers; leave it None")
        extra[name] = value
    return extra


def variables_stage(name: str, key: pa.Schema, variables: Sequence[Variable],
                    apply: Callable[[pa.Table, StateView], StateChanges], *,
                    output_schema: pa.Schema, on_timer: Callable | None = None,
                    **options) -> KeyedStage:
    """``KeyedStage.with_variables``: see there."""
    where = f"keyed stage {name}"
    if isinstance(key, pa.Field):
        key = pa.schema([key])
    compiled = StateVariables(key, tuple(variables), where)
    if not callable(apply):
        raise TypeError(f"{where}: apply must be callable (input, state view) -> "
                        "StateChanges")
    if not isinstance(output_schema, pa.Schema):
        raise TypeError(f"{where}: a variables stage needs output_schema, a pyarrow Schema "
                        "(its state schema is the physical one, no output's)")
    if "ttl" in options or "state_schema" in options:
        raise ValueError(f"{where}: a variables stage derives state_schema and ttl from its "
                         "variables; give each variable its ttl instead")
    if on_timer is not None:
        if "on_timer" not in {f.name for f in dataclasses.fields(KeyedStage)}:
            raise ValueError(f"{where}: on_timer is given, but this version's keyed stages "
                             "have no timers")
        options["on_timer"] = VariablesApply(compiled, on_timer)
    return KeyedStage(name, key=tuple(key.names), state_schema=compiled.state_schema,
                      apply=VariablesApply(compiled, apply), ttl=compiled.ttl,
                      output_schema=output_schema, **options)
