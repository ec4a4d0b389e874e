"""``KeyedStateStore``: what a keyed stage's local store does, whatever keeps its rows
(``ArrowKeyedStateStore`` in ``_store`` is the one this project implements)."""

from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from pipelines.keyed._key_groups import KeyGroupRange
from pipelines.keyed._layout import KeyedStateLayout

__all__ = ["KeyedStateStore"]


class KeyedStateStore(ABC):
    """The state of one key group range of one keyed stage, on local disk.

    ``get`` returns the state rows of some keys; ``apply`` upserts and deletes rows and
    records which change it was (``version``: the caller's name for the state it now holds,
    e.g. the checkpoint chain position); ``sorted_batches`` iterates the whole state sorted by
    key group then key hash (a full snapshot); ``drop_expired`` removes rows expired by the
    stage's TTL. ``close`` keeps the directory for the next task; ``destroy`` removes it.
    """

    layout: KeyedStateLayout
    key_groups: KeyGroupRange
    directory: Path

    @abstractmethod
    def get(self, keys: pa.Table, *, cutoff=None) -> pa.Table:
        """The stored rows (``layout.stored_schema``) of the keys in ``keys`` (key columns;
        duplicates allowed) that have state, in no particular order. With a ``cutoff``, rows
        that expired by it are left out (the stage never sees expired state)."""

    @abstractmethod
    def apply(self, upserts: pa.Table, deletes: pa.Table, *, version: str | None = None) -> None:
        """Upsert full rows (one per key) and delete keys (key columns); upserts and deletes
        have distinct keys. Every key must belong to this store's key groups."""

    @abstractmethod
    def load(self, rows: pa.Table, *, upserts: pa.Table | None = None,
             deletes: pa.Table | None = None, version: str | None = None) -> None:
        """Replace the whole state with ``rows`` (stored rows, one per key), then apply
        ``upserts`` and ``deletes`` as ``apply`` does: a rebuild from the checkpoint chain
        (its snapshot, and the last change per key since), in as few writes as it takes."""

    @property
    @abstractmethod
    def version(self) -> str | None:
        """The ``version`` of the last ``apply`` (None: never applied)."""

    @property
    @abstractmethod
    def num_rows(self) -> int: ...

    @abstractmethod
    def sorted_batches(self, max_rows: int = 1 << 16) -> Iterator[pa.RecordBatch]:
        """All rows, ``stored_schema`` plus ``_key_group`` (int16), sorted by key group."""

    @abstractmethod
    def drop_expired(self, cutoff, *, version: str | None = None) -> pa.Table:
        """Delete the rows the stage's TTL expired by ``cutoff``; returns their keys (for the
        change file, so that a replay drops them too)."""

    @abstractmethod
    def expired_rows(self, cutoff) -> int:
        """How many of the ``num_rows`` rows the stage's TTL expired by ``cutoff`` (kept until
        a full snapshot drops them); 0 without a TTL."""

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def destroy(self) -> None:
        """Close and delete the store's directory."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
