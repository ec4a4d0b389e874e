"""End to end with the real processes (issue 6): ``dagster dev`` (webserver + daemon) with a
temporary DAGSTER_HOME, checkpoints and savepoints on moto's S3 server, driven through
GraphQL only. The code location holds two pipelines side by side: ``user_activity`` (click
events, daily) and ``page_views`` (hourly).

1. A run of ``user_activity_job`` for the first partition fails after its third batch (the
   test seam in sensors/_assets.py: tag ``test/fail_after_batch``), after the checkpoint the
   runner took inside the partition. Then ``page_views_job`` processes two hours of page
   views (landed by the test into the location's ``PAGE_VIEWS_DIR``) in one run.
2. The daemon's ``user_activity_recovery_sensor`` launches exactly one recovery run, which
   restores that checkpoint, replays only the last batch and succeeds. The page_views job
   directory's files (paths, sizes, ETags, modification times) are recorded.
3. ``user_activity_savepoint_job`` takes a savepoint; its pointer is read from the asset
   observation.
4. ``launchPartitionBackfill`` with ``runConfigData`` (``restore_from`` the savepoint) over the
   next two partitions completes in one run, restores from the savepoint and checkpoints on.
   The page_views job directory is exactly as recorded: the savepoint and the backfill of
   one pipeline left the other's checkpoints untouched.
5. The reports and the final state equal those of an uninterrupted in-process run of the
   same landed input (StatefulRunner on a separate local checkpoint directory).
"""

import datetime as dt

import pytest
from pandas.testing import assert_frame_equal

from checkpoint_storage import url_to_fs
from pipelines import job_id_for
from pipelines.examples.click_events import FIRST_PARTITION, click_events_pipeline
from pipelines.examples.page_views import land_hour
from sensors import FAULT_TAG
from tests.acceptance.dagster_process import (
    BACKFILL,
    LAUNCH_BACKFILL,
    DagsterDev,
    metadata,
    wait_for,
)
from tests.acceptance.support import (
    SMALL_HOUR,
    PipelineEnv,
    read_report,
    state_frames,
    tags_of,
    user_activity_config,
)

RECOVERY_SENSOR = "user_activity_recovery_sensor"
PAGE_VIEWS_RETENTION_SENSOR = "page_views_retention_sensor"
DAY1 = FIRST_PARTITION
DAY2, DAY3 = (
    (dt.date.fromisoformat(DAY1) + dt.timedelta(days=n)).isoformat() for n in (1, 2)
)
HOUR1, HOUR2 = "2026-10-01-00:00", "2026-10-01-01:00"  # page_views' first two hours
RUN_TIMEOUT = 240
SHARED_RUN_TIMEOUT = 2 * RUN_TIMEOUT  # the recovery and the page views run side by side


def materialization(
    dev: DagsterDev, partition: str, run_id: str, asset: str = "user_activity"
) -> dict[str, object]:
    found = [
        e
        for e in dev.materializations(asset)
        if e["partition"] == partition and e["runId"] == run_id
    ]
    assert found, f"no {asset} materialization of {partition} by run {run_id}"
    return metadata(found[0])


def job_directory_files(env: PipelineEnv, pipeline: str) -> dict[str, tuple]:
    """Every file below ``pipeline``'s job directory on S3: relative path -> (size, ETag,
    last modified)."""
    fs, root = url_to_fs(f"{env.checkpoint_dir}/{job_id_for(pipeline).hex}", env.storage_options)
    fs.invalidate_cache()
    return {
        path[len(root) :].lstrip("/"): (info["size"], info.get("ETag"), info.get("LastModified"))
        for path, info in fs.find(root, detail=True).items()
    }


def checkpoint_id(pointer: str) -> int:
    return int(pointer.rstrip("/").rsplit("chk-", 1)[1])


@pytest.mark.timeout(1800)  # generous: the machine running it may be shared
def test_failure_recovery_savepoint_and_backfill(dagster_dev: DagsterDev, pipeline_env, tmp_path):
    """A failed run recovers by itself, a backfill from a savepoint continues the checkpoints
    and ends where an uninterrupted run does, and leaves the other pipeline's untouched."""
    dev = dagster_dev

    # The run failure sensor starts its cursor at its first tick and ignores failures before.
    wait_for(
        f"the first tick of {RECOVERY_SENSOR}", lambda: dev.sensor_ticks(RECOVERY_SENSOR), 180, 2
    )

    # 1. A run that fails midway.
    failed_id = dev.launch_run(
        "user_activity_job",
        user_activity_config(),
        {"dagster/partition": DAY1, FAULT_TAG: "3"},
    )
    failed = dev.wait_for_run(failed_id, RUN_TIMEOUT)
    assert "FAILURE" == failed["status"], dev.run_errors(failed_id)
    assert "injected fault" in dev.run_errors(failed_id)
    assert not [e for e in dev.materializations() if e["runId"] == failed_id]

    # The other pipeline: two hours of page views in one run, while the recovery goes on.
    for hour in (HOUR1, HOUR2):
        land_hour(pipeline_env.page_views_dir, hour, **SMALL_HOUR)
    page_views_run = dev.launch_run(
        "page_views_job",
        {},
        {"dagster/asset_partition_range_start": HOUR1, "dagster/asset_partition_range_end": HOUR2},
    )

    # 2. The sensor recovers it, once.
    recoveries = wait_for(
        f"a recovery run of {failed_id}",
        lambda: dev.runs_tagged("recovery/of_run_id", failed_id),
        240,
        2,
    )
    assert 1 == len(recoveries)
    recovery_id = recoveries[0]["runId"]
    recovery = dev.wait_for_run(recovery_id, SHARED_RUN_TIMEOUT)
    assert "SUCCESS" == recovery["status"], dev.run_errors(recovery_id)
    tags = tags_of(recovery)
    assert (DAY1, failed_id, "1") == (
        tags["dagster/partition"],
        tags["recovery/root_run_id"],
        tags["recovery/attempt"],
    )
    assert FAULT_TAG not in tags
    recovered = materialization(dev, DAY1, recovery_id)
    # It restored the checkpoint the failed run took after batch 2 and replayed batch 3 only.
    assert 1 == recovered["batches_applied"]
    restored_from = str(recovered["restored_from"])
    assert restored_from.startswith(pipeline_env.checkpoint_dir), restored_from
    assert checkpoint_id(restored_from) < checkpoint_id(str(recovered["checkpoint_pointer"]))
    assert f"end of {DAY1}" == recovered["source_position"]
    assert str(recovered["checkpoint_pointer"]).startswith(pipeline_env.checkpoint_dir)

    # The page views are done; their job directory's files, before the click events' steps.
    done = dev.wait_for_run(page_views_run, SHARED_RUN_TIMEOUT)
    assert "SUCCESS" == done["status"], dev.run_errors(page_views_run)
    hour2 = materialization(dev, HOUR2, page_views_run, "page_views")
    assert f"end of {HOUR2}" == hour2["source_position"]
    # Its retention sensor's first tick is behind us (the next is an hour later).
    wait_for(
        f"the first tick of {PAGE_VIEWS_RETENTION_SENSOR}",
        lambda: dev.sensor_ticks(PAGE_VIEWS_RETENTION_SENSOR),
        180,
        2,
    )
    page_views_files = job_directory_files(pipeline_env, "page_views")
    page_views_job_dir = f"{pipeline_env.checkpoint_dir}/{job_id_for('page_views').hex}/"
    latest = str(hour2["checkpoint_pointer"]).rstrip("/")
    assert latest.startswith(page_views_job_dir), latest
    assert f"{latest[len(page_views_job_dir) :]}/_metadata" in page_views_files

    # 3. A savepoint through the savepoint job; its pointer from the asset observation.
    savepoint_run = dev.launch_run("user_activity_savepoint_job", {}, {})
    done = dev.wait_for_run(savepoint_run, RUN_TIMEOUT)
    assert "SUCCESS" == done["status"], dev.run_errors(savepoint_run)
    observed = [metadata(e) for e in dev.observations() if e["runId"] == savepoint_run]
    assert 1 == len(observed)
    savepoint = str(observed[0]["savepoint_pointer"])
    assert savepoint.startswith(f"{pipeline_env.savepoint_dir}/savepoint-")
    assert f"end of {DAY1}" == observed[0]["source_position"]
    assert str(recovered["checkpoint_pointer"]).rstrip("/") == str(
        observed[0]["taken_from"]
    ).rstrip("/")

    # 4. A backfill of the next two days from that savepoint, through GraphQL.
    launched = dev.graphql(LAUNCH_BACKFILL, {"params": {
        "partitionNames": [DAY2, DAY3],
        "assetSelection": [{"path": [k]} for k in ("click_events", "user_activity",
                                                    "user_activity_daily_report")],
        "runConfigData": user_activity_config(restore_from=savepoint),
        "title": "backfill from a savepoint (acceptance test)",
    }})["launchPartitionBackfill"]  # fmt: skip
    assert "LaunchBackfillSuccess" == launched["__typename"], launched
    backfill_id = launched["backfillId"]

    def backfill_done():
        backfill = dev.graphql(BACKFILL, {"id": backfill_id})["partitionBackfillOrError"]
        if backfill["status"] in ("REQUESTED", "CANCELING", "FAILING"):
            return None
        return backfill

    try:
        backfill = wait_for(f"backfill {backfill_id}", backfill_done, 2 * RUN_TIMEOUT, 3)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\n{dev.log_tail()}") from exc
    runs = backfill["runs"]
    assert backfill["status"] in ("COMPLETED", "COMPLETED_SUCCESS"), (backfill, [
        dev.run_errors(r["runId"]) for r in runs
    ])  # fmt: skip
    assert all("SUCCESS" == r["status"] for r in runs), [dev.run_errors(r["runId"]) for r in runs]
    # The stateful asset processed both days in order in one run (single-run backfill policy;
    # the daemon may land click_events in a run of its own before it).
    by_run = {
        r["runId"]: {e["partition"] for e in dev.materializations() if e["runId"] == r["runId"]}
        for r in runs
    }
    backfill_run = next((run for run, days in by_run.items() if {DAY2, DAY3} <= days), None)
    assert backfill_run is not None, by_run
    day2 = materialization(dev, DAY2, backfill_run)
    day3 = materialization(dev, DAY3, backfill_run)
    assert savepoint.rstrip("/") == str(day2["restored_from"]).rstrip("/")
    assert str(day2["checkpoint_pointer"]).rstrip("/") == str(day3["restored_from"]).rstrip("/")
    assert f"end of {DAY3}" == day3["source_position"]
    # The backfill run ends with the integrity check of the last checkpoint it wrote: the
    # check's latest result is that one, passed (not "Skipped").
    latest_check = dev.check_executions("checkpoint_integrity")[0]
    assert (backfill_run, "SUCCEEDED") == (latest_check["runId"], latest_check["status"])
    checked = metadata(latest_check["evaluation"])["checkpoint_pointer"]
    assert str(day3["checkpoint_pointer"]).rstrip("/") == str(checked).rstrip("/")
    # Its checkpoints continue the job's checkpoint ids.
    ids = [checkpoint_id(str(m["checkpoint_pointer"])) for m in (recovered, day2, day3)]
    assert ids == sorted(ids) and len(set(ids)) == 3, ids
    # The savepoint and the backfill of user_activity left page_views' checkpoints untouched.
    assert page_views_files == job_directory_files(pipeline_env, "page_views")
    assert {page_views_run} == {e["runId"] for e in dev.materializations("page_views")}

    # 5. The same as an uninterrupted run of the same landed input.
    from pyspark.sql import SparkSession

    from pipelines import StatefulRunner
    from resources import CheckpointStorageResource, build_spark_session

    # a session this process already has (the suite's fixture) is not this function's to stop
    shared = SparkSession.getActiveSession()
    spark = build_spark_session(
        "local[1]", "acceptance-reference",
        {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"},
    )  # fmt: skip
    try:
        spark.sparkContext.setLogLevel("ERROR")
        reference_reports = str(tmp_path / "reference-reports")
        reference = StatefulRunner(
            spark,
            CheckpointStorageResource(
                checkpoint_dir=str(tmp_path / "reference-checkpoints")
            ).checkpoint_storage(),
            click_events_pipeline(pipeline_env.landing_dir, reference_reports),
        )
        results = reference.run([DAY1, DAY2, DAY3])
        assert [f"end of {d}" for d in (DAY1, DAY2, DAY3)] == [
            str(r.checkpoint.position) for r in results
        ]
        for day in (DAY1, DAY2, DAY3):
            assert_frame_equal(
                read_report(reference_reports, day),
                read_report(pipeline_env.report_dir, day),
                check_exact=False,
                rtol=1e-9,
            )
        on_s3 = StatefulRunner(
            spark,
            CheckpointStorageResource(
                checkpoint_dir=pipeline_env.checkpoint_dir,
                savepoint_dir=pipeline_env.savepoint_dir,
                storage_options=pipeline_env.storage_options,
            ).checkpoint_storage(),
            click_events_pipeline(pipeline_env.landing_dir, str(tmp_path / "unused-reports")),
        )
        expected, actual = state_frames(reference), state_frames(on_s3)
        assert expected.keys() == actual.keys()
        for name in expected:
            assert_frame_equal(expected[name], actual[name], check_exact=False, rtol=1e-9)
    finally:
        if shared is None:
            spark.stop()
