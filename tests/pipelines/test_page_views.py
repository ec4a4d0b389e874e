"""The page-views example end to end on S3 (moto's server on 127.0.0.1): hourly landing
directories, checkpoints and both sinks all at ``s3://`` URLs, read and written on the
executors through fsspec and pyarrow; and its keyed ``sessions`` stage (an event-time timer
per open session) against a recomputation."""

import datetime as dt
import random

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from checkpoint_storage import FileSystemCheckpointStorage, url_to_fs
from pipelines import SourcePosition, StatefulRunner, empty_state
from pipelines.examples.page_views import (
    PAGE_VIEW_SCHEMA,
    SESSION_GAP,
    SESSION_KEYED_STATE_SCHEMA,
    STAGES,
    VIEW_LATENESS,
    close_sessions,
    land_hour,
    page_views_pipeline,
    session_views,
)
from tests.pipelines.support import rows
from tests.pipelines.timer_model import TimerModel, sorted_rows

pytestmark = pytest.mark.timeout(900)

H1, H2, H3 = "2026-10-01-00:00", "2026-10-01-01:00", "2026-10-01-02:00"
T0 = dt.datetime(2026, 10, 1, 0, 50, tzinfo=dt.UTC)
MINUTE = dt.timedelta(minutes=1)


@pytest.fixture
def s3_pipeline(s3_server):
    bucket = s3_server.new_bucket()
    options = s3_server.storage_options
    base = f"s3://{bucket}/page_views"
    for hour in (H1, H2, H3):
        land_hour(base, hour, batches=3, views_per_batch=120, users=12, pages=5,
                  storage_options=options)
    storage = FileSystemCheckpointStorage(
        f"s3://{bucket}/checkpoints", f"s3://{bucket}/savepoints", storage_options=options
    )
    pipeline = page_views_pipeline(base, storage_options=options, checkpoint_interval=2)
    return pipeline, storage, base, options


def sink_rows(base: str, sink: str, hour: str, options: dict) -> list[tuple]:
    fs, path = url_to_fs(f"{base}/{sink}", options)
    partition = ds.dataset(path, filesystem=fs, format="parquet", partitioning="hive")
    table = partition.to_table(filter=ds.field("hour") == hour).drop_columns(["hour"])
    return sorted(tuple(map(_naive_utc, r.values())) for r in table.to_pylist())


def _naive_utc(value):
    """Spark collects timestamps as naive datetimes (the machine runs in UTC); pyarrow reads
    them zone-aware."""
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        return value.astimezone(dt.UTC).replace(tzinfo=None)
    return value


def landed_views(base: str, hour: str, options: dict) -> list[list[tuple]]:
    """The hour's batches in landing order, each as (user_id, viewed_at) rows."""
    fs, path = url_to_fs(f"{base}/landing/hour={hour}", options)
    names = sorted(n for n in fs.ls(path, detail=False) if n.endswith(".parquet"))
    batches = []
    for name in names:
        with fs.open(name, "rb") as f:
            table = pq.read_table(f)
        batches.append(list(zip(table.column("user_id").to_pylist(),
                                table.column("viewed_at").to_pylist(), strict=True)))
    return batches


def recomputed_sessions(batches: list[list[tuple]], lateness: dt.timedelta = VIEW_LATENESS
                        ) -> tuple[list[tuple], list[list[tuple]]]:
    """The open sessions after the last batch and the sessions closed in each batch,
    recomputed from the views alone: a user's views, in time order, split into sessions
    where one comes ``SESSION_GAP`` or more after the one before; a session closes when a
    later one of its user has started or when the watermark (newest view minus
    ``lateness``) is at or past its last view + the gap. No view here is late."""
    seen: list[tuple] = []
    closed_before: set[tuple] = set()
    closed_per_batch = []
    for batch in batches:
        seen += batch
        watermark = max(t for _, t in seen) - lateness
        sessions = []
        for user in sorted({u for u, _ in seen}):
            times = sorted(t for u, t in seen if u == user)
            start = last = times[0]
            count = 0
            mine = []
            for t in times:
                if t - last >= SESSION_GAP:
                    mine.append((user, start, last, count))
                    start, count = t, 0
                last, count = t, count + 1
            mine.append((user, start, last, count))
            sessions += [(s, i < len(mine) - 1) for i, s in enumerate(mine)]
        closed = {s for s, followed in sessions if followed or s[2] + SESSION_GAP <= watermark}
        closed_per_batch.append(sorted(closed - closed_before))
        closed_before |= closed
        still_open = sorted(s for s, _ in sessions if s not in closed)
    return still_open, closed_per_batch


def page_counts_reference(spark, pipeline, hours) -> list[tuple]:
    """The page_counts stage applied batch by batch without the runner: its final rows."""
    stage = next(s for s in STAGES if s.name == "page_counts")
    state = empty_state(spark, stage)
    for hour in hours:
        for batch in pipeline.source.batches(spark, hour):
            views = pipeline.source.read(spark, hour, batch).localCheckpoint(eager=True)
            state = stage.apply(views, state)[0].localCheckpoint(eager=True)
    return rows(state)


def test_page_views_on_s3_equal_a_recomputation(spark, s3_pipeline):
    """Three hours through the runner on S3: the restored open sessions and the closed
    sessions in the sink, hour by hour, equal a recomputation from the landed views; the
    page counts equal the stage applied batch by batch."""
    pipeline, storage, base, options = s3_pipeline
    runner = StatefulRunner(spark, storage, pipeline)

    results = runner.run([H1, H2, H3])

    batches = {h: landed_views(base, h, options) for h in (H1, H2, H3)}
    still_open, closed = recomputed_sessions([b for h in (H1, H2, H3) for b in batches[h]])
    latest = runner.store.latest()
    assert latest.external_pointer.startswith("s3://")
    assert [r.checkpoint.pointer for r in results][-1] == latest.external_pointer
    restored = runner.restore_states(latest.metadata)
    assert [tuple(map(_naive_utc, s)) for s in still_open] == rows(
        restored["sessions"].select(*SESSION_KEYED_STATE_SCHEMA.names))
    for i, hour in enumerate((H1, H2, H3)):
        expected = sorted(tuple(map(_naive_utc, s)) for s in closed[3 * i] + closed[3 * i + 1]
                          + closed[3 * i + 2])
        assert expected == sink_rows(base, "sessions", hour, options)
    assert sum(len(c) for c in closed) > 0
    counts = page_counts_reference(spark, pipeline, [H1, H2, H3])
    assert counts == rows(restored["page_counts"])
    assert counts == sink_rows(base, "page_counts", H3, options)


def test_rerunning_an_hour_replaces_its_sink_output(spark, s3_pipeline):
    """Processing an hour again (from the end of the hour before) leaves each sink holding the
    same rows for it: replaced, never duplicated."""
    pipeline, storage, base, options = s3_pipeline
    runner = StatefulRunner(spark, storage, pipeline)
    runner.run([H1, H2])
    before = {s: sink_rows(base, s, H2, options) for s in ("sessions", "page_counts")}
    h1_end = next(
        c.external_pointer
        for c in runner.store.all()
        if SourcePosition.of(c.metadata) == SourcePosition(H1, 3, True)
    )

    StatefulRunner(spark, storage, pipeline).run([H2], restore_from=h1_end)

    assert before == {s: sink_rows(base, s, H2, options) for s in ("sessions", "page_counts")}


def test_hour_keys_order():
    """Hourly partitions follow each other in time."""
    pipeline = page_views_pipeline("memory://unused")
    assert H1 == pipeline.order.previous(H2)
    assert pipeline.order.previous(H1) is None


def views_table(views: list[tuple]) -> pa.Table:
    return pa.Table.from_pylist([{"page_id": "p", "user_id": u, "viewed_at": t}
                                 for u, t in views], schema=PAGE_VIEW_SCHEMA)


def state_table(sessions: list[tuple]) -> pa.Table:
    return pa.Table.from_pylist([dict(zip(SESSION_KEYED_STATE_SCHEMA.names, s, strict=True))
                                 for s in sessions], schema=SESSION_KEYED_STATE_SCHEMA)


def test_a_view_a_gap_later_closes_the_session_and_moves_its_timer():
    """u1's view 45 minutes after its last one closes its session (the output) and opens a
    new one whose timer replaces the old; u2's view 10 minutes later extends its session
    and moves its timer; u3 is new: a session and a timer, nothing to delete."""
    state = state_table([("u1", T0, T0, 2), ("u2", T0 - 5 * MINUTE, T0, 1)])
    views = views_table([("u1", T0 + 45 * MINUTE), ("u2", T0 + 10 * MINUTE),
                         ("u3", T0 + 1 * MINUTE)])

    result = session_views(views, state)

    assert [("u1", T0 + 45 * MINUTE, T0 + 45 * MINUTE, 1),
            ("u2", T0 - 5 * MINUTE, T0 + 10 * MINUTE, 2),
            ("u3", T0 + MINUTE, T0 + MINUTE, 1)] == sorted_rows(result.upserts)
    assert [("u1", T0, T0, 2)] == sorted_rows(result.output)
    assert [("u1", T0 + 75 * MINUTE), ("u2", T0 + 40 * MINUTE),
            ("u3", T0 + 31 * MINUTE)] == sorted_rows(result.timers)
    assert [("u1", T0 + 30 * MINUTE),
            ("u2", T0 + 30 * MINUTE)] == sorted_rows(result.deleted_timers)
    assert 0 == result.deletes.num_rows


def test_a_fired_timer_emits_the_session_and_deletes_its_state():
    state = state_table([("u1", T0 - 5 * MINUTE, T0, 3)])
    fired = pa.table({"user_id": ["u1"], "timer": pa.array([T0 + 30 * MINUTE],
                                                            pa.timestamp("us", "UTC"))})

    result = close_sessions(fired, state)

    assert [("u1", T0 - 5 * MINUTE, T0, 3)] == sorted_rows(result.output)
    assert [("u1",)] == sorted_rows(result.deletes)
    assert 0 == result.upserts.num_rows


def test_sessions_through_the_timer_contract_equal_the_recomputation():
    """Random views in batches of 10 minutes (users coming and going), run through the
    timers contract: each batch's closed sessions and the open ones at the end equal the
    recomputation."""
    rng = random.Random(3)
    batches = []
    for b in range(24):
        start = T0 + b * 10 * MINUTE
        batches.append([(f"u{rng.randrange(8)}",
                         start + dt.timedelta(seconds=rng.randrange(600))) for _ in range(6)])
    model = TimerModel(session_views, close_sessions, SESSION_KEYED_STATE_SCHEMA, "user_id",
                       "viewed_at", lateness=10 * MINUTE)

    closed = [model.batch(views_table(views)) for views in batches]

    expected_open, expected_closed = recomputed_sessions(batches, lateness=10 * MINUTE)
    assert expected_closed == closed
    assert expected_open == sorted(tuple(r.values()) for r in model.state.values())
    assert sum(len(c) for c in closed) > 5
