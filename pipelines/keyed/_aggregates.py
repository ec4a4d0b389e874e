"""Declarative aggregates: count, sum, min, max and first/last by an ordering column, per key,
as a keyed stage whose ``apply`` is vectorised Arrow (one group-by over the batch, one join
with the state of the batch's keys; first/last add a sort, a group-by and a join per ``by``
column; no Python loop per key).

The functions mirror Spark's ``pyspark.sql.functions`` (``agg.count()``, ``agg.sum("x")``;
``agg.first``/``agg.last`` with ``by=`` are Spark's ``min_by``/``max_by``) and are combined
with the state as Flink's ``AggregateFunction.merge`` would: counts and sums add, bounds keep
the smaller or larger value, first/last keep the value of the smaller or larger ``by``.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.keyed._stage import RESERVED_PREFIX, KeyedResult, KeyedStage, StateTtl

__all__ = ["Aggregate", "Aggregates", "agg"]

_KINDS = ("count", "sum", "min", "max", "first", "last")
_ROW = "_agg_row"
_POSITION = "_agg_position"
_STATE = "_agg_state_"
"""Prefixes of working columns: a user's column cannot start with '_' (``RESERVED_PREFIX``)."""


@dataclass(frozen=True)
class Aggregate:
    """One aggregate of a column (or of rows, for ``count()``), made by ``agg.<kind>(...)``:
    ``kind`` one of count, sum, min, max, first, last; ``column`` the input column (None for
    ``count()``); ``by`` the ordering column of first/last; ``type`` a sum's result type
    (None: Spark's rule, see ``agg.sum``)."""

    kind: str
    column: str | None = None
    by: str | None = None
    type: pa.DataType | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"aggregate kind {self.kind!r}: use one of {list(_KINDS)}")
        if self.column is not None and (not isinstance(self.column, str) or not self.column):
            raise ValueError(f"agg.{self.kind}: column must be a column name, got "
                             f"{self.column!r}")
        if self.kind != "count" and self.column is None:
            raise ValueError(f"agg.{self.kind} needs the input column it aggregates")
        if (self.kind in ("first", "last")) != (self.by is not None):
            raise ValueError(f"agg.{self.kind}: by= is the ordering column of first/last "
                             "(and of them only)")
        if self.by is not None and (not isinstance(self.by, str) or not self.by):
            raise ValueError(f"agg.{self.kind}: by must be a column name, got {self.by!r}")
        if self.type is not None and (self.kind != "sum"
                                      or not isinstance(self.type, pa.DataType)):
            raise ValueError(f"agg.{self.kind}: type= is a sum's result type, a pyarrow "
                             f"DataType; got {self.type!r}")

    @property
    def columns(self) -> tuple[str, ...]:
        """The input columns this aggregate reads."""
        return tuple(c for c in (self.column, self.by) if c is not None)

    def __repr__(self) -> str:
        args = [repr(c) for c in (self.column,) if c is not None]
        args += [f"by={self.by!r}"] if self.by else []
        args += [f"type={self.type}"] if self.type is not None else []
        return f"agg.{self.kind}({', '.join(args)})"


Emit = Literal["updated", "batch"]


class AggregateFunctions:
    """The aggregate functions, used as ``agg.count()``, ``agg.sum("amount")`` (as Spark's
    ``F.count``, ``F.sum``), and ``agg.stage(...)``, a keyed stage of them. Nulls are skipped
    as SQL skips them: a sum, min or max of no non-null value is null, ``count()`` counts rows
    and ``count(column)`` non-null values."""

    @staticmethod
    def count(column: str | None = None) -> Aggregate:
        """Rows (``count()``), or non-null values of ``column``: an int64, never null."""
        return Aggregate("count", column)

    @staticmethod
    def sum(column: str, type: pa.DataType | None = None) -> Aggregate:
        """The sum of the non-null values. Result type (Spark's): integers give int64
        (unsigned ones uint64), floats float64, ``decimal(p, s)`` gives ``decimal(p + 10,
        s)`` (precision at most 38; 76 for decimal256), or ``type``. A sum that does not fit
        its type fails the batch, naming the stage and aggregate, and changes nothing."""
        return Aggregate("sum", column, type=type)

    @staticmethod
    def min(column: str) -> Aggregate:
        """The smallest non-null value, of the column's type."""
        return Aggregate("min", column)

    @staticmethod
    def max(column: str) -> Aggregate:
        """The largest non-null value, of the column's type."""
        return Aggregate("max", column)

    @staticmethod
    def first(column: str, by: str) -> Aggregate:
        """The value of ``column`` (null included) in the row with the smallest non-null
        ``by`` (Spark's ``min_by``); among equal ``by``, the earliest row (state first)."""
        return Aggregate("first", column, by=by)

    @staticmethod
    def last(column: str, by: str) -> Aggregate:
        """The value of ``column`` (null included) in the row with the largest non-null
        ``by`` (Spark's ``max_by``); among equal ``by``, the latest row of the latest batch."""
        return Aggregate("last", column, by=by)


    @staticmethod
    def stage(name: str, key: str | Sequence[str], aggregates: Mapping[str, Aggregate],
              input_schema: pa.Schema, *, ttl: StateTtl | None = None,
              event_time: str | None = None, input: str | None = None,
              emit: Emit = "updated") -> KeyedStage:
        """A keyed stage of declarative aggregates per ``key`` (Spark's ``groupBy(key).agg(...)``
        kept as state across batches)::

            agg.stage("activity", key="user_id", input_schema=EVENTS, aggregates={
                "clicks": agg.count(), "amount": agg.sum("amount"), "first_seen": agg.min("ts"),
                "last_seen": agg.max("ts"), "last_url": agg.last("url", by="ts")},
                event_time="ts", ttl=StateTtl(dt.timedelta(days=30), timestamp_column="last_seen"))

        ``input_schema``: the input's key and aggregated columns (their types give the state's);
        ``ttl``, ``event_time``, ``input``: as for ``KeyedStage`` (an event-time TTL's
        ``timestamp_column`` names an aggregate, e.g. a max of the event time); ``emit``: see
        ``Aggregates``. The stage's ``apply`` is ``Aggregates.apply``."""
        where = f"aggregate stage {name}"
        spec = Aggregates(key, aggregates, input_schema, emit=emit, where=where)
        return KeyedStage(name, key=spec.key, state_schema=spec.state_schema, apply=spec.apply,
                          ttl=ttl, input=input, output_schema=spec.output_schema,
                          event_time=event_time)


agg = AggregateFunctions()
"""Declarative aggregates: ``agg.count()``, ``agg.sum(c)``, ``agg.min(c)``, ``agg.max(c)``,
``agg.first(c, by=t)``, ``agg.last(c, by=t)``, and ``agg.stage(...)`` to make a keyed stage of
them."""


@dataclass(frozen=True)
class Aggregates:
    """Named aggregates per key over an input of ``input_schema`` (it must hold the key and
    the aggregated columns; other columns are ignored). ``apply(input, state)`` is a keyed
    stage's function: call it from a hand-written stage to reuse it.

    State: the key (not null), one column per aggregate and, per first/last, the ``by`` value
    of the row it holds (``<name>_<by>``). Output (``emit``): ``"updated"``, the batch's keys'
    aggregates after the batch (Spark's update output mode); ``"batch"``, the aggregates of
    the batch's rows alone (a ``groupBy().agg()`` of the batch). ``where``: what errors name
    (``agg.stage`` passes the stage)."""

    key: tuple[str, ...]
    aggregates: Mapping[str, Aggregate]
    input_schema: pa.Schema
    emit: Emit = "updated"
    where: str = "aggregates"
    state_schema: pa.Schema = field(init=False)
    output_schema: pa.Schema = field(init=False)

    def __post_init__(self) -> None:
        where = self.where
        key = (self.key,) if isinstance(self.key, str) else tuple(self.key)
        object.__setattr__(self, "key", key)
        if not isinstance(self.input_schema, pa.Schema):
            raise TypeError(f"{where}: input_schema must be a pyarrow Schema (the input's key "
                            f"and aggregated columns), got {type(self.input_schema).__name__}")
        if not isinstance(self.aggregates, Mapping) or not self.aggregates:
            raise ValueError(f"{where}: aggregates must be a non-empty dict of output column "
                             "name to agg.<function>(...)")
        if self.emit not in ("updated", "batch"):
            raise ValueError(f"{where}: emit must be 'updated' or 'batch', got {self.emit!r}")
        object.__setattr__(self, "aggregates", dict(self.aggregates))
        known = self.input_schema.names
        missing = [k for k in key if k not in known]
        if missing:
            raise ValueError(f"{where}: key column(s) {missing} are not in input_schema {known}")
        state_fields = [self.input_schema.field(k).with_nullable(False) for k in key]
        output_fields = [self.input_schema.field(k) for k in key]
        by_fields = []
        for name, aggregate in self.aggregates.items():
            if not isinstance(aggregate, Aggregate):
                raise TypeError(f"{where}: aggregate {name!r} must be agg.<function>(...), got "
                                f"{aggregate!r}")
            if not isinstance(name, str) or not name or name.startswith(RESERVED_PREFIX):
                raise ValueError(f"{where}: aggregate name {name!r}: use a column name not "
                                 f"starting with {RESERVED_PREFIX!r}")
            missing = [c for c in aggregate.columns if c not in known]
            if missing:
                raise ValueError(f"{where}: {name} = {aggregate!r} reads {missing}, not in "
                                 f"input_schema {known}")
            kind = _result_type(aggregate, self.input_schema, f"{where}: {name}")
            output_fields.append(pa.field(name, kind, nullable=aggregate.kind != "count"))
            if aggregate.by is not None:
                by_fields.append(pa.field(f"{name}_{aggregate.by}",
                                          self.input_schema.field(aggregate.by).type))
        state_fields += output_fields[len(key):] + by_fields
        names = [f.name for f in state_fields]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"{where}: column name(s) {twice} are used twice (by the key, an "
                             "aggregate, or the <name>_<by> column first/last keep); rename "
                             "the aggregate")
        object.__setattr__(self, "state_schema", pa.schema(state_fields))
        object.__setattr__(self, "output_schema", pa.schema(output_fields))

    def batch_aggregates(self, input: pa.Table) -> pa.Table:
        """The aggregates of ``input``'s rows per key (``state_schema``'s columns)."""
        key = list(self.key)
        columns = list(dict.fromkeys(key + [c for a in self.aggregates.values()
                                            for c in a.columns]))
        try:
            rows = input.select(columns).cast(
                pa.schema([self.input_schema.field(c) for c in columns]))
        except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
            raise ValueError(f"{self.where}: the input's columns {columns} do not fit "
                             f"input_schema: {exc}") from exc
        wanted, plain = [], {}
        for name, aggregate in self.aggregates.items():
            if aggregate.kind == "count":
                wanted.append(([], "count_all") if aggregate.column is None else
                              (aggregate.column, "count", pc.CountOptions("only_valid")))
            elif aggregate.kind == "sum":
                rows, source = _summable(rows, aggregate, name)
                wanted.append((source, "sum"))
            elif aggregate.kind in ("min", "max"):
                wanted.append((aggregate.column, aggregate.kind))
            else:
                continue
            plain[name] = len(key) + len(wanted) - 1
        grouped = rows.group_by(key, use_threads=False).aggregate(wanted)
        # Arrow names an aggregate's column "<column>_<function>"; take them by position.
        table = grouped.select(key).cast(pa.schema([self.input_schema.field(k) for k in key]))
        for name, index in plain.items():
            table = table.append_column(name, self._fit(grouped.column(index), name))
        by_columns = {a.by for a in self.aggregates.values() if a.by is not None}
        for by in sorted(by_columns):
            table = self._join_ordered(table, rows, by)
        return table.select(self.state_schema.names).cast(self.state_schema)

    def _join_ordered(self, table: pa.Table, rows: pa.Table, by: str) -> pa.Table:
        """``table`` with the first/last aggregates ordered by ``by``: the rows sorted by
        ``by`` then arrival, each key's first or last position, its values taken."""
        key = list(self.key)
        named = {n: a for n, a in self.aggregates.items() if a.by == by}
        ordered = rows.filter(pc.is_valid(rows.column(by)))
        ordered = ordered.append_column(_ROW, pa.array(np.arange(ordered.num_rows)))
        ordered = ordered.take(pc.sort_indices(ordered, [(by, "ascending"),
                                                         (_ROW, "ascending")]))
        ordered = ordered.append_column(_POSITION, pa.array(np.arange(ordered.num_rows)))
        kinds = sorted({a.kind for a in named.values()})
        ends = ordered.group_by(key, use_threads=False).aggregate(
            [(_POSITION, "min" if kind == "first" else "max") for kind in kinds])
        picked = ends.select(key)
        for name, aggregate in named.items():
            position = ends.column(len(key) + kinds.index(aggregate.kind))
            picked = picked.append_column(name, ordered.column(aggregate.column).take(position))
            picked = picked.append_column(f"{name}_{by}", ordered.column(by).take(position))
        picked = picked.cast(pa.schema([self.input_schema.field(k) for k in key]
                                       + list(picked.schema)[len(key):]))
        return table.join(picked, key, join_type="left outer")

    def merge(self, batch: pa.Table, state: pa.Table) -> pa.Table:
        """``batch`` (``batch_aggregates``) merged with ``state`` (rows of ``state_schema``,
        at most one per key; keys without state absent): the new state of the batch's keys."""
        key = list(self.key)
        known = state.select(self.state_schema.names).cast(self.state_schema)
        known = known.rename_columns(key + [_STATE + n for n in known.column_names[len(key):]])
        both = batch.join(known, key, join_type="left outer")
        merged = {k: both.column(k) for k in key}
        for name, aggregate in self.aggregates.items():
            new, old = both.column(name), both.column(_STATE + name)
            if aggregate.kind == "count":
                merged[name] = pc.add_checked(new, pc.fill_null(old, 0))
            elif aggregate.kind == "sum":
                merged[name] = self._add(new, old, name)
            elif aggregate.kind in ("min", "max"):
                wins = pc.less if aggregate.kind == "min" else pc.greater
                merged[name] = pc.coalesce(pc.if_else(wins(new, old), new, old), new, old)
            else:
                by = f"{name}_{aggregate.by}"
                new_by, old_by = both.column(by), both.column(_STATE + by)
                # The batch wins ties for last (it came later), the state for first.
                beats = pc.less if aggregate.kind == "first" else pc.greater_equal
                take_new = pc.and_(pc.is_valid(new_by),
                                   pc.fill_null(beats(new_by, old_by), pc.is_null(old_by)))
                merged[name] = pc.if_else(take_new, new, old)
                merged[by] = pc.if_else(take_new, new_by, old_by)
        return pa.table(merged).select(self.state_schema.names).cast(self.state_schema)

    def apply(self, input: pa.Table, state: pa.Table) -> KeyedResult:
        """A keyed stage's function: the batch's aggregates merged into its keys' state are
        the upserts; the output is ``emit``'s; nothing is deleted (expiry is the TTL's)."""
        batch = self.batch_aggregates(input)
        upserts = self.merge(batch, state)
        emitted = upserts if self.emit == "updated" else batch
        deletes = self.state_schema.empty_table().select(list(self.key))
        return KeyedResult(upserts, deletes, emitted.select(self.output_schema.names)
                           .cast(self.output_schema))

    def _fit(self, values: pa.ChunkedArray, name: str) -> pa.ChunkedArray:
        """A batch's aggregate as its state type; a sum that does not fit is refused."""
        kind = self.state_schema.field(name).type
        if values.type == kind:
            return values
        try:
            return values.cast(kind)
        except (pa.ArrowInvalid, OverflowError) as exc:
            raise self._overflow(name, exc) from exc

    def _add(self, new: pa.ChunkedArray, old: pa.ChunkedArray, name: str) -> pa.ChunkedArray:
        """Null-skipping ``new + old`` in the sum's type, refused if it does not fit."""
        kind = self.state_schema.field(name).type
        try:
            if pa.types.is_decimal(kind):
                # decimal(p, s) + decimal(p, s) is decimal(p + 1, s): add in the widest
                # decimal, then fit the sum back (a checked cast).
                wide = pa.decimal256(75, kind.scale)
                total = pc.add(new.cast(wide), old.cast(wide)).cast(kind)
            elif pa.types.is_floating(kind):
                total = pc.add(new, old)
            else:
                total = pc.add_checked(new, old)
        except (pa.ArrowInvalid, OverflowError) as exc:
            raise self._overflow(name, exc) from exc
        return pc.coalesce(total, new, old)

    def _overflow(self, name: str, exc: Exception) -> ValueError:
        return ValueError(
            f"{self.where}: {name} = {self.aggregates[name]!r} does not fit "
            f"{self.state_schema.field(name).type} ({exc}); nothing of this batch was "
            "applied. Give the sum a wider type=, e.g. agg.sum(..., type=pa.decimal128(38, "
            "2)); the state schema changes with it")


def _summable(rows: pa.Table, aggregate: Aggregate, name: str) -> tuple[pa.Table, str]:
    """The column a sum adds up: integers as exact decimals (Arrow's integer sums wrap
    silently; the cast to the sum's type then refuses an overflow)."""
    values = rows.column(aggregate.column)
    if not pa.types.is_integer(values.type):
        return rows, aggregate.column
    column = f"_agg_sum_{name}"
    return rows.append_column(column, values.cast(pa.decimal128(38, 0))), column


def _result_type(aggregate: Aggregate, schema: pa.Schema, where: str) -> pa.DataType:
    if aggregate.kind == "count":
        return pa.int64()
    kind = schema.field(aggregate.column).type
    if aggregate.kind == "sum":
        if aggregate.type is not None:
            return aggregate.type
        if pa.types.is_unsigned_integer(kind):
            return pa.uint64()
        if pa.types.is_integer(kind):
            return pa.int64()
        if pa.types.is_floating(kind):
            return pa.float64()
        if pa.types.is_decimal128(kind):
            return pa.decimal128(min(38, kind.precision + 10), kind.scale)
        if pa.types.is_decimal256(kind):
            return pa.decimal256(min(76, kind.precision + 10), kind.scale)
        raise ValueError(f"{where}: {aggregate!r} adds up {aggregate.column!r} of type {kind}; "
                         "sums take integers, floats or decimals")
    if not _orderable(kind):
        raise ValueError(f"{where}: {aggregate!r} orders {aggregate.column!r} of type {kind}; "
                         "min and max take numbers, strings, binaries, dates, times, "
                         "timestamps and booleans")
    if aggregate.by is not None and not _orderable(schema.field(aggregate.by).type):
        raise ValueError(f"{where}: {aggregate!r} orders by {aggregate.by!r} of type "
                         f"{schema.field(aggregate.by).type}, which has no order")
    return kind


def _orderable(kind: pa.DataType) -> bool:
    types = pa.types
    return (types.is_integer(kind) or types.is_floating(kind) or types.is_decimal(kind)
            or types.is_string(kind) or types.is_large_string(kind) or types.is_binary(kind)
            or types.is_large_binary(kind) or types.is_temporal(kind) or types.is_boolean(kind))
