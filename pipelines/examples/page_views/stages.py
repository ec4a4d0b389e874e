"""The page views' stages: sessions that close ``SESSION_GAP`` after their last view (a keyed
stage with an event-time timer) and a running view count per page. Apart from ``pipeline.py``
(the Dagster side) because Spark's Python workers import this module to run the stages'
functions, and need no Dagster."""

import datetime as dt

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from pipelines import (
    SOURCE,
    KeyedResult,
    KeyedStage,
    Stage,
)
from pipelines.keyed import TimeMode, Watermark

__all__ = [
    "CLOSED_SESSION_SCHEMA",
    "NAME",
    "PAGE_COUNT_SCHEMA",
    "PAGE_VIEW_SCHEMA",
    "SESSIONS_KEYED",
    "SESSION_GAP",
    "SESSION_KEYED_STATE_SCHEMA",
    "STAGES",
    "VIEW_LATENESS",
    "close_sessions",
    "page_counts",
    "session_views",
]

NAME = "page_views"
SESSION_GAP = dt.timedelta(minutes=30)
VIEW_LATENESS = dt.timedelta(hours=1)
"""The sessions' allowed lateness: an hour is landed as one or more batches in time order,
so a view is at most an hour behind the newest one seen (a batch's own views are on time)."""
PAGE_VIEW_SCHEMA = pa.schema(
    [
        pa.field("page_id", pa.string()),
        pa.field("user_id", pa.string()),
        pa.field("viewed_at", pa.timestamp("us", tz="UTC")),
    ]
)
_TS = pa.timestamp("us", tz="UTC")
SESSION_KEYED_STATE_SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.string(), nullable=False),
        pa.field("session_start", _TS),
        pa.field("last_view", _TS),
        pa.field("views", pa.int64()),
    ]
)
SESSION_NAMES = SESSION_KEYED_STATE_SCHEMA.names
CLOSED_SESSION_SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.string(), nullable=False),
        pa.field("session_start", _TS),
        pa.field("session_end", _TS),
        pa.field("views", pa.int64()),
    ]
)
PAGE_COUNT_SCHEMA = T.StructType(
    [T.StructField("page_id", T.StringType()), T.StructField("views", T.LongType())]
)


def _sorted_fragments(state: pa.Table, views: pa.Table) -> pa.Table:
    """The open sessions and the batch's views as one table of session fragments (a view is
    a session of one view), sorted by user and start."""
    ts = SESSION_KEYED_STATE_SCHEMA.field("session_start").type
    single = pa.table({
        "user_id": views.column("user_id").cast(pa.string()),
        "session_start": views.column("viewed_at").cast(ts),
        "last_view": views.column("viewed_at").cast(ts),
        "views": pa.array(np.ones(views.num_rows, np.int64)),
    })  # fmt: skip
    fragments = pa.concat_tables([state.select(SESSION_NAMES).cast(single.schema), single])
    return fragments.sort_by([("user_id", "ascending"), ("session_start", "ascending")])


def session_views(input: pa.Table, state: pa.Table, gap: dt.timedelta = SESSION_GAP
                  ) -> KeyedResult:
    """Keyed ``sessions`` for one batch: the views join their user's open session, or start a
    new one when they come ``gap`` or more after its last view (the earlier session closes
    and is the output). Each open session has one event-time timer, at its last view +
    ``gap``: moved (deleted and registered) when the last view moves."""
    views = input.filter(pc.is_valid(input.column("viewed_at")))
    fragments = _sorted_fragments(state, views)
    users = fragments.column("user_id").combine_chunks()
    codes = users.dictionary_encode().indices.to_numpy(zero_copy_only=False).astype(np.int64)
    start = fragments.column("session_start").cast(pa.int64()).to_numpy()
    last = fragments.column("last_view").cast(pa.int64()).to_numpy()
    count = fragments.column("views").to_numpy()
    first_of_user = np.r_[True, codes[1:] != codes[:-1]] if len(codes) else np.zeros(0, bool)
    # The newest last view before each fragment, within its user: a running maximum per
    # user, computed in one pass by lifting each user's times above the previous user's.
    base = int(last.min()) if len(last) else 0
    span = int(last.max()) - base + 1 if len(last) else 1
    if len(codes) and int(codes.max()) + 1 > np.iinfo(np.int64).max // span:
        raise ValueError("keyed stage sessions: the batch spans too long a time for its "
                         "number of users; land it in smaller batches")
    lifted = np.maximum.accumulate(last - base + codes * span) - codes * span + base
    before = np.r_[0, lifted[:-1]] if len(last) else last  # a user's first: no before
    new = first_of_user | (start - before >= int(gap / dt.timedelta(microseconds=1)))
    heads = np.flatnonzero(new)
    session_last = np.maximum.reduceat(last, heads) if len(heads) else last
    session_views_ = np.add.reduceat(count, heads) if len(heads) else count
    is_open = np.r_[first_of_user[heads[1:]], True] if len(heads) else np.zeros(0, bool)
    ts = SESSION_KEYED_STATE_SCHEMA.field("session_start").type

    def sessions_where(mask: np.ndarray, end_name: str) -> pa.Table:
        return pa.table({
            "user_id": users.take(pa.array(heads[mask])),
            "session_start": pa.array(start[heads[mask]], pa.int64()).cast(ts),
            end_name: pa.array(session_last[mask], pa.int64()).cast(ts),
            "views": pa.array(session_views_[mask], pa.int64()),
        })  # fmt: skip

    upserts = sessions_where(is_open, "last_view").cast(SESSION_KEYED_STATE_SCHEMA)
    closed = sessions_where(~is_open, "session_end").cast(CLOSED_SESSION_SCHEMA)
    timers = pa.table({"user_id": upserts.column("user_id"),
                       "timer": pc.add(upserts.column("last_view"), pa.scalar(gap))})
    # The old timer goes unless the open session still ends where it did.
    old = pa.table({"user_id": state.column("user_id"),
                    "timer": pc.add(state.column("last_view"), pa.scalar(gap))})
    moved = old.join(timers, ["user_id", "timer"], join_type="left anti")
    return KeyedResult(upserts, upserts.select(["user_id"]).slice(0, 0), closed,
                       timers=timers, deleted_timers=moved.select(["user_id", "timer"]))


def close_sessions(fired: pa.Table, state: pa.Table, gap: dt.timedelta = SESSION_GAP
                   ) -> KeyedResult:
    """A session's timer fired (the watermark reached its last view + ``gap``): the session
    is the output and its state goes, its timer with it."""
    newest = fired.group_by("user_id", use_threads=False).aggregate([("timer", "max")])
    due = state.join(newest, "user_id", join_type="inner")
    due = due.filter(pc.less_equal(pc.add(due.column("last_view"), pa.scalar(gap)),
                                   due.column("timer_max")))
    closed = due.select(SESSION_NAMES).rename_columns(CLOSED_SESSION_SCHEMA.names)
    closed = closed.cast(CLOSED_SESSION_SCHEMA)
    return KeyedResult(SESSION_KEYED_STATE_SCHEMA.empty_table(), closed.select(["user_id"]),
                       closed)


SESSIONS_KEYED = KeyedStage(
    "sessions",
    key="user_id",
    state_schema=SESSION_KEYED_STATE_SCHEMA,
    apply=session_views,
    on_timer=close_sessions,
    time_mode=TimeMode.EVENT_TIME,
    watermark=Watermark(allowed_lateness=VIEW_LATENESS),
    event_time="viewed_at",
    input=SOURCE,
    output_schema=CLOSED_SESSION_SCHEMA,
)
"""The open session per user (keyed state); output: the sessions that closed, each once."""


def page_counts(views: DataFrame, state: DataFrame) -> tuple[DataFrame, DataFrame]:
    """The running view count per page; output: this batch's counts."""
    batch = views.groupBy("page_id").agg(F.count(F.lit(1)).cast("long").alias("views"))
    new_state = (
        state.unionByName(batch).groupBy("page_id").agg(F.sum("views").cast("long").alias("views"))
    )
    return new_state, batch


STAGES = (
    SESSIONS_KEYED,
    Stage("page_counts", PAGE_COUNT_SCHEMA, page_counts, input=SOURCE),
)
