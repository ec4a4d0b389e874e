"""A keyed stage's timers within one range and batch, on Arrow tables (docs/design.md, "Keyed
state", 7.8). Nothing here needs Spark.

Timers live in the key's stored state row, column ``_timers`` (a list of timestamps, null for
none): they are checkpointed in the same change files and snapshots, rescaled by key group and
restored with the row. ``fold`` turns what ``apply`` or ``on_timer`` returned into stored rows
(their timers updated); ``fire`` takes the due timers out of stored rows.
"""

import datetime as dt

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.keyed._layout import KeyedStateLayout, concat_as
from pipelines.keyed._stage import TIMER, TIMER_TYPE, TIMERS, KeyedResult, KeyedStage

__all__ = ["due_mask", "fire", "fold", "merge_changes"]

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_ROW = "__row"
_LEFT = "__left"


def due_mask(stored: pa.Table | pa.RecordBatch, limit: dt.datetime) -> np.ndarray:
    """Which rows of ``stored`` (with ``_timers``) hold a timer at or before ``limit``: one
    vectorised pass over the flattened timers."""
    timers = stored.column(TIMERS)
    if isinstance(timers, pa.ChunkedArray):
        timers = timers.combine_chunks()
    mask = np.zeros(len(stored), bool)
    values = pc.list_flatten(timers)
    if not len(values):
        return mask
    due = pc.less_equal(values, pa.scalar(limit, TIMER_TYPE)).to_numpy(zero_copy_only=False)
    parents = pc.list_parent_indices(timers).to_numpy(zero_copy_only=False)
    mask[parents[due]] = True
    return mask


def _positions(stage: KeyedStage, keys: pa.Table, rows: pa.Table) -> np.ndarray:
    """For each row of ``keys``, the index of its key's row in ``rows`` (-1: none)."""
    key = list(stage.key)
    if not keys.num_rows:
        return np.zeros(0, np.int64)
    if not rows.num_rows:
        return np.full(keys.num_rows, -1, np.int64)
    left = stage.cast_keys(keys).append_column(_LEFT, pa.array(np.arange(keys.num_rows)))
    right = stage.cast_keys(rows).append_column(_ROW, pa.array(np.arange(rows.num_rows)))
    joined = left.join(right, key, join_type="left outer")
    positions = np.full(keys.num_rows, -1, np.int64)
    found = joined.filter(pc.is_valid(joined.column(_ROW)))
    positions[found.column(_LEFT).to_numpy()] = found.column(_ROW).to_numpy()
    return positions


def _lists(parents: np.ndarray, values: np.ndarray, rows: int) -> pa.Array:
    """The ``_timers`` column of ``rows`` rows from timers as (row, microseconds) pairs: each
    row's timers sorted, once each, null for none. numpy sorts, no Arrow group-by."""
    order = np.lexsort((values, parents))
    parents, values = parents[order], values[order]
    keep = np.ones(len(parents), bool)
    keep[1:] = (parents[1:] != parents[:-1]) | (values[1:] != values[:-1])
    parents, values = parents[keep], values[keep]
    counts = np.bincount(parents, minlength=rows)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()),
                                    pa.array(values, pa.int64()).view(TIMER_TYPE),
                                    mask=pa.array(counts == 0))


def _pairs(lists: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """The timers of a ``_timers`` column as (row, microseconds) pairs."""
    if isinstance(lists, pa.ChunkedArray):
        lists = lists.combine_chunks() if lists.num_chunks else pa.array(
            [], pa.list_(TIMER_TYPE))
    parents = pc.list_parent_indices(lists).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(lists).cast(TIMER_TYPE).view(pa.int64()).to_numpy(
        zero_copy_only=False)
    return parents, values


def _micros(column: pa.ChunkedArray) -> np.ndarray:
    return column.combine_chunks().cast(TIMER_TYPE).view(pa.int64()).to_numpy(
        zero_copy_only=False) if len(column) else np.zeros(0, np.int64)


def fold(stage: KeyedStage, layout: KeyedStateLayout, base: pa.Table, result: KeyedResult,
         now: dt.datetime | None, function: str = "apply") -> tuple[pa.Table, pa.Table]:
    """What ``result`` (checked by ``stage.run``) changes in the stored rows: the stored rows
    of every key it upserted or changed timers of (``layout.stored_schema``; upserts stamped
    at ``now`` under processing-time expiry, a row changed only in its timers keeps its
    stamp) and the keys it deleted. ``base``: the stored rows of the keys ``result`` may
    change, before it (a key absent has no state). A key's timers are its old ones (kept
    across an upsert), less ``result.deleted_timers``, plus ``result.timers``; a delete drops
    them. Registering a timer for a key without state after the batch is refused."""
    key = list(stage.key)
    where = f"keyed stage {stage.name}"
    stored = layout.stored_schema
    upserts = layout.stamp(result.upserts, now) if now else result.upserts
    if not layout.timers:
        return upserts, result.deletes
    added = result.timers if result.timers is not None else stage.timer_schema.empty_table()
    removed = (result.deleted_timers if result.deleted_timers is not None
               else stage.timer_schema.empty_table())
    # the rows that change: the upserted ones, and those whose timers change (their base row)
    added_at, removed_at = _positions(stage, added, upserts), _positions(stage, removed, upserts)
    others = pa.concat_tables([stage.cast_keys(added.filter(pa.array(added_at < 0))),
                               stage.cast_keys(removed.filter(pa.array(removed_at < 0)))])
    untouched = base.slice(0, 0)
    if others.num_rows:
        others = others.group_by(key).aggregate([])
        if result.deletes.num_rows:
            others = others.filter(pa.array(_positions(stage, others, result.deletes) < 0))
        at = _positions(stage, others, base)
        # deleting a missing timer is a no-op: a key without state is just not rewritten
        untouched = base.take(pa.array(at[at >= 0]))
    untouched = untouched.drop_columns([TIMERS])
    new = concat_as(stored.remove(stored.get_field_index(TIMERS)), [
        upserts.select([n for n in stored.names if n != TIMERS]), untouched])

    def rows_in_new(table: pa.Table, in_upserts: np.ndarray) -> np.ndarray:
        rows = in_upserts.copy()
        rest = rows < 0
        if rest.any() and untouched.num_rows:
            at = _positions(stage, table.filter(pa.array(rest)), untouched)
            rows[rest] = np.where(at >= 0, at + upserts.num_rows, -1)
        return rows

    added_rows = rows_in_new(added, added_at)
    if (added_rows < 0).any():
        orphans = stage.cast_keys(added.filter(pa.array(added_rows < 0))).group_by(
            key).aggregate([])
        raise ValueError(
            f"{where}: {function} registered timers for {orphans.num_rows} key(s) that "
            f"have no state after the batch, e.g. {orphans.slice(0, 1).to_pylist()[0]}. "
            "Timers live with the key's state (a key whose state is deleted loses its "
            "timers): upsert the key's state (or a marker row) in the same result first")
    # their timers: the old ones less removed, plus added (a timer deleted and registered
    # by one result stays: replacing a key's timer by the same time keeps it)
    at = _positions(stage, new, base)
    with_base = np.flatnonzero(at >= 0)
    parents, values = _pairs(base.column(TIMERS).take(pa.array(at[with_base])))
    parents = with_base[parents]
    if removed.num_rows and len(parents):
        removed_rows = rows_in_new(removed, removed_at)
        old = pa.table({"r": parents, "v": values, "i": np.arange(len(parents))})
        gone = old.join(pa.table({"r": removed_rows, "v": _micros(removed.column(TIMER))}),
                        ["r", "v"], join_type="inner").column("i").to_numpy()
        kept = np.ones(len(parents), bool)
        kept[gone] = False
        parents, values = parents[kept], values[kept]
    parents = np.concatenate([parents, added_rows])
    values = np.concatenate([values, _micros(added.column(TIMER))])
    return (concat_as(stored, [new.append_column(TIMERS, _lists(parents, values,
                                                                new.num_rows))]),
            result.deletes)


def fire(stage: KeyedStage, rows: pa.Table, limit: dt.datetime) -> tuple[pa.Table, pa.Table]:
    """The timers of stored ``rows`` due at ``limit`` (``timer <= limit``): ``fired`` (key
    columns and ``timer``, one row per timer) and ``rows`` without them (their other timers
    kept)."""
    parents, values = _pairs(rows.column(TIMERS))
    due = values <= (limit - _EPOCH) // dt.timedelta(microseconds=1)
    fired = rows.select(list(stage.key)).take(pa.array(parents[due])).append_column(
        TIMER, pa.array(values[due], pa.int64()).view(TIMER_TYPE))
    kept = _lists(parents[~due], values[~due], rows.num_rows)
    return fired, rows.set_column(rows.schema.get_field_index(TIMERS), TIMERS, kept)


def merge_changes(stage: KeyedStage, first: tuple[pa.Table, pa.Table],
                  then: tuple[pa.Table, pa.Table]) -> tuple[pa.Table, pa.Table]:
    """Two sets of changes (stored upserts, deleted keys) as one: ``then``'s win per key."""
    upserts, deletes = first
    later_upserts, later_deletes = then
    later = pa.concat_tables([stage.cast_keys(later_upserts), stage.cast_keys(later_deletes)])
    if later.num_rows and upserts.num_rows:
        keep = _positions(stage, upserts, later) < 0
        upserts = upserts.filter(pa.array(keep))
    if later.num_rows and deletes.num_rows:
        keep = _positions(stage, deletes, later) < 0
        deletes = deletes.filter(pa.array(keep))
    return (concat_as(upserts.schema, [upserts, later_upserts]),
            concat_as(stage.key_schema, [stage.cast_keys(deletes),
                                         stage.cast_keys(later_deletes)]))
