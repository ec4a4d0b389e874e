"""The page-views example end to end on S3 (moto's server on 127.0.0.1): hourly landing
directories, checkpoints and both sinks all at ``s3://`` URLs, read and written on the
executors through fsspec and pyarrow."""

import datetime as dt

import pyarrow.dataset as ds
import pytest

from checkpoint_storage import FileSystemCheckpointStorage, url_to_fs
from pipelines import SourcePosition, StatefulRunner, empty_state
from pipelines.examples.page_views import SESSION_GAP, STAGES, land_hour, page_views_pipeline
from tests.pipelines.support import rows

pytestmark = pytest.mark.timeout(900)

H1, H2, H3 = "2026-10-01-00:00", "2026-10-01-01:00", "2026-10-01-02:00"


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


def reference(spark, pipeline, hours) -> tuple[dict, dict]:
    """The stages applied batch by batch without the runner: final state rows, and the
    closed sessions per hour."""
    states = {stage.name: empty_state(spark, stage) for stage in STAGES}
    closed = {}
    for hour in hours:
        closed[hour] = []
        for batch in pipeline.source.batches(spark, hour):
            views = pipeline.source.read(spark, hour, batch).localCheckpoint(eager=True)
            for stage in STAGES:
                new_state, output = stage.apply(views, states[stage.name])
                states[stage.name] = new_state.localCheckpoint(eager=True)
                if stage.name == "sessions":
                    closed[hour] += rows(output)
        closed[hour].sort()
    return {name: rows(df) for name, df in states.items()}, closed


def test_page_views_on_s3_equal_the_batch_by_batch_reference(spark, s3_pipeline):
    """Three hours through the runner on S3: the restored state and the closed sessions in
    the sink equal the stages applied batch by batch; expired sessions left the state."""
    pipeline, storage, base, options = s3_pipeline
    runner = StatefulRunner(spark, storage, pipeline)

    results = runner.run([H1, H2, H3])

    expected_state, expected_closed = reference(spark, pipeline, [H1, H2, H3])
    latest = runner.store.latest()
    assert latest.external_pointer.startswith("s3://")
    assert [r.checkpoint.pointer for r in results][-1] == latest.external_pointer
    restored = runner.restore_states(latest.metadata)
    assert expected_state == {name: rows(df) for name, df in restored.items()}
    for hour in (H1, H2, H3):
        assert expected_closed[hour] == sink_rows(base, "sessions", hour, options)
    # Per-key expiry: nothing in the state is older than the gap before the newest view.
    open_sessions = expected_state["sessions"]
    newest = max(r[2] for r in open_sessions)
    assert all(newest - r[2] <= SESSION_GAP for r in open_sessions)
    assert sum(len(v) for v in expected_closed.values()) > 0
    assert expected_state["page_counts"] == sink_rows(base, "page_counts", H3, options)


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


def test_hour_keys_order_and_sessions_expire_across_hours(spark):
    """Hourly partitions follow each other in time; a session open at the end of an hour is
    closed once a view more than the gap later arrives."""
    pipeline = page_views_pipeline("memory://unused")
    assert H1 == pipeline.order.previous(H2)
    assert pipeline.order.previous(H1) is None
    t0 = dt.datetime(2026, 10, 1, 0, 50, tzinfo=dt.UTC)
    views = spark.createDataFrame(
        [("p", "u1", t0), ("p", "u2", t0 + dt.timedelta(minutes=45))],
        "page_id string, user_id string, viewed_at timestamp",
    )
    state = empty_state(spark, STAGES[0])

    still_open, closed = STAGES[0].apply(views, state)

    assert ["u2"] == [r[0] for r in rows(still_open)]
    assert [("u1", 1)] == [(r[0], r[3]) for r in rows(closed)]
