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


def _explode(stage: KeyedStage, rows: pa.Table) -> pa.Table:
    """The timers of stored ``rows``: key columns and ``timer``, one row per timer."""
    timers = rows.column(TIMERS).combine_chunks() if rows.num_rows else pa.array(
        [], pa.list_(TIMER_TYPE))
    parents = pc.list_parent_indices(timers)
    keys = rows.select(list(stage.key)).take(parents)
    return keys.append_column(TIMER, pc.list_flatten(timers).cast(TIMER_TYPE))


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


def _with_timers(stage: KeyedStage, rows: pa.Table, timers: pa.Table) -> pa.Table:
    """``rows`` (stored rows without ``_timers``) with ``_timers`` set from ``timers`` (key
    columns and ``timer``; each row's timers sorted, once each; null for none)."""
    if timers.num_rows:
        timers = timers.group_by([*stage.key, TIMER]).aggregate([])  # each timer once
        timers = timers.sort_by([(k, "ascending") for k in (*stage.key, TIMER)])
        lists = timers.group_by(list(stage.key), use_threads=False).aggregate(
            [(TIMER, "list")])
        positions = _positions(stage, rows, lists)
        values = lists.column(f"{TIMER}_list").combine_chunks().cast(pa.list_(TIMER_TYPE))
        taken = values.take(pa.array(positions, mask=positions < 0))
    else:
        taken = pa.nulls(rows.num_rows, pa.list_(TIMER_TYPE))
    return rows.append_column(TIMERS, taken)


def fold(stage: KeyedStage, layout: KeyedStateLayout, base: pa.Table, result: KeyedResult,
         now: dt.datetime | None, function: str = "apply") -> tuple[pa.Table, pa.Table]:
    """What ``result`` (checked by ``stage.run``) changes in the stored rows: the stored rows
    of every key it upserted or changed timers of (``layout.stored_schema``; upserts stamped
    at ``now`` under processing-time expiry, a row changed only in its timers keeps its
    stamp) and the keys it deleted. ``base``: the stored rows of the keys ``result`` may
    change, before it (a key absent has no state). A key's timers are its old ones (kept
    across an upsert), plus ``result.timers``, less ``result.deleted_timers``; a delete drops
    them. Registering a timer for a key without state after the batch is refused."""
    key = list(stage.key)
    where = f"keyed stage {stage.name}"
    stored = layout.stored_schema
    upserts = result.upserts
    if not layout.timers:
        return (layout.stamp(upserts, now) if now else upserts), result.deletes
    added = result.timers if result.timers is not None else stage.timer_schema.empty_table()
    removed = (result.deleted_timers if result.deleted_timers is not None
               else stage.timer_schema.empty_table())
    # the rows that change: the upserted ones, and those whose timers change
    timer_keys = pa.concat_tables([added.select(key), removed.select(key)]).group_by(
        key).aggregate([])
    changed = stage.cast_keys(timer_keys)
    if upserts.num_rows:
        changed = changed.join(stage.cast_keys(upserts), key, join_type="left anti")
    if result.deletes.num_rows:
        changed = changed.join(stage.cast_keys(result.deletes), key, join_type="left anti")
    at = _positions(stage, changed, base)
    # deleting a missing timer is a no-op: a key without state is just not rewritten
    untouched = base.take(pa.array(at[at >= 0])).drop_columns([TIMERS])
    new = layout.stamp(upserts, now) if now else upserts
    new = concat_as(stored.remove(stored.get_field_index(TIMERS)), [
        new.select([n for n in stored.names if n != TIMERS]), untouched])
    # their timers: the old ones less removed, plus added (a timer deleted and registered
    # by one result stays: replacing a key's timer by the same time keeps it)
    at = _positions(stage, new, base)
    timers = _explode(stage, base.take(pa.array(at[at >= 0])))
    if removed.num_rows and timers.num_rows:
        timers = timers.join(stage.cast_keys(removed.select(key)).append_column(
            TIMER, removed.column(TIMER)), [*key, TIMER], join_type="left anti")
    timers = concat_as(stage.timer_schema, [timers, added])
    if added.num_rows:
        orphans = added.select(key)
        orphans = stage.cast_keys(orphans).join(stage.cast_keys(new), key,
                                                join_type="left anti")
        if orphans.num_rows:
            raise ValueError(
                f"{where}: {function} registered timers for {orphans.num_rows} key(s) that "
                f"have no state after the batch, e.g. {orphans.slice(0, 1).to_pylist()[0]}. "
                "Timers live with the key's state (a key whose state is deleted loses its "
                "timers): upsert the key's state (or a marker row) in the same result first")
    return concat_as(stored, [_with_timers(stage, new, timers)]), result.deletes


def fire(stage: KeyedStage, rows: pa.Table, limit: dt.datetime) -> tuple[pa.Table, pa.Table]:
    """The timers of stored ``rows`` due at ``limit`` (``timer <= limit``): ``fired`` (key
    columns and ``timer``, one row per timer) and ``rows`` without them (their other timers
    kept)."""
    timers = _explode(stage, rows)
    due = pc.less_equal(timers.column(TIMER), pa.scalar(limit, TIMER_TYPE))
    fired, kept = timers.filter(due), timers.filter(pc.invert(due))
    return fired, concat_as(rows.schema, [_with_timers(stage, rows.drop_columns([TIMERS]),
                                                       kept)])


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
