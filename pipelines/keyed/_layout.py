"""The shape of one keyed stage's state: key columns, row schema, key groups and expiry."""

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from pipelines.keyed._key_groups import (
    DEFAULT_MAX_PARALLELISM,
    KEY_HASH,
    check_parallelism,
    hash_keys,
)
from pipelines.keyed._stage import (
    TIMER_TYPE,
    TIMERS,
    WRITTEN_AT,
    KeyedStage,
    StateTtl,
    TtlTimeCharacteristic,
)

__all__ = ["KEY_GROUP", "KeyedStateLayout", "concat_as"]

KEY_GROUP = "_key_group"
"""The column the state files add: each row's key group (int16)."""


@dataclass(frozen=True)
class KeyedStateLayout:
    """What the store and the state files need to know about a keyed stage's state: its key
    columns, its row schema, ``max_parallelism`` (the number of key groups; fixed for the
    life of the pipeline) and its expiry.

    ``stored_schema`` is the state schema, plus ``_written_at`` (timestamp, UTC) under
    processing-time expiry: the write time is state too, so that a restore expires exactly
    what the store would have; and ``_timers`` (list of timestamps, UTC) with ``timers`` (a
    stage with a ``time_mode``): timers are checkpointed, rescaled and restored with their
    key's row."""

    key: tuple[str, ...]
    state_schema: pa.Schema
    max_parallelism: int = DEFAULT_MAX_PARALLELISM
    ttl: StateTtl | None = None
    timers: bool = False
    time_mode: str | None = field(default=None, compare=False, hash=False)
    """Which clock the timers follow (``TimeMode.value``); None: no timers, or a snapshot
    written before it was recorded."""
    renamed: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)
    """Old column name -> new, for state files written under an older schema."""
    defaults: Mapping[str, object] = field(default_factory=dict, compare=False, hash=False)
    """Values of columns added since state files were written (else null)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", tuple(self.key))
        check_parallelism(1, self.max_parallelism)
        missing = [k for k in self.key if k not in self.state_schema.names]
        if not self.key or missing:
            raise ValueError(f"key {list(self.key)}: columns {missing} missing from the state "
                             f"schema {self.state_schema.names}")

    @classmethod
    def of(cls, stage: KeyedStage, max_parallelism: int = DEFAULT_MAX_PARALLELISM):
        return cls(stage.key, stage.state_schema, max_parallelism, stage.ttl, stage.has_timers,
                   None if stage.time_mode is None else stage.time_mode.value,
                   stage.renamed, stage.defaults)

    @property
    def key_hash(self) -> str:
        return KEY_HASH

    @property
    def processing_time_ttl(self) -> bool:
        return (self.ttl is not None
                and self.ttl.time_characteristic is TtlTimeCharacteristic.PROCESSING_TIME)

    @property
    def stored_schema(self) -> pa.Schema:
        schema = self.state_schema
        if self.processing_time_ttl:
            schema = schema.append(pa.field(WRITTEN_AT, pa.timestamp("us", "UTC")))
        if self.timers:
            schema = schema.append(pa.field(TIMERS, pa.list_(TIMER_TYPE)))
        return schema

    @property
    def key_schema(self) -> pa.Schema:
        return pa.schema([self.state_schema.field(k) for k in self.key])

    def stamp(self, upserts: pa.Table, now: dt.datetime) -> pa.Table:
        """``upserts`` with their write time, under processing-time expiry (else unchanged)."""
        if not self.processing_time_ttl:
            return upserts
        stamp = pa.repeat(pa.scalar(now, pa.timestamp("us", "UTC")), upserts.num_rows)
        if WRITTEN_AT in upserts.column_names:
            upserts = upserts.drop_columns([WRITTEN_AT])
        return upserts.append_column(WRITTEN_AT, stamp)

    def key_groups_of(self, table: pa.Table) -> np.ndarray:
        """Each row's key group (int16 numpy array)."""
        hashes = hash_keys(table, self.key)
        return (hashes % np.uint64(self.max_parallelism)).astype(np.int16)

    def conform(self, table: pa.Table, what: str) -> pa.Table:
        """``table`` with exactly the stored schema's columns, cast where needed."""
        return _conform(table, self.stored_schema, what, "columns", "the state schema")

    def conform_keys(self, table: pa.Table, what: str) -> pa.Table:
        """``table`` with exactly the key columns, cast where needed."""
        return _conform(table, self.key_schema, what, "key columns", "the key columns")


def _conform(
    table: pa.Table, schema: pa.Schema, what: str, columns: str, target: str
) -> pa.Table:
    """``table`` as ``schema`` (its columns selected and cast); errors name ``what``."""
    missing = [n for n in schema.names if n not in table.column_names]
    if missing:
        raise ValueError(f"{what}: {columns} {missing} missing; expected {schema.names}")
    table = table.select(schema.names)
    if table.schema.remove_metadata() == schema.remove_metadata():
        return table
    try:
        return table.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
        raise ValueError(f"{what}: does not fit {target} {schema}: {exc}") from exc


def concat_as(schema: pa.Schema, tables: list[pa.Table]) -> pa.Table:
    """``tables`` (the columns of ``schema``, in any order) as one table of ``schema``. Arrow's
    joins drop the not-null flag of fields, so parts are cast before they are joined up."""
    return pa.concat_tables([
        t.select(schema.names) if t.select(schema.names).schema == schema
        else t.select(schema.names).cast(schema) for t in tables
    ])
