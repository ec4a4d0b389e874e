"""Every failure recovered, whatever started the run (issue 25, item 1), on ONE real daemon for
every way a run starts that test_recovery_daemon.py does not cover: ``dagster dev`` against a
DAGSTER_HOME configured as the project writes it (run monitoring, one run per pool), with the
code location ``tests/acceptance/recovery_location.py``: one copy of the page-views pipeline
per start mode (``pv_<mode>``, own pool, own recovery sensor), so the failing runs all start
together and their recoveries run side by side.

- schedule: ``pv_schedule_fails`` (every minute) starts a run that fails after batch 2;
- sensor: ``pv_sensor_fails`` does the same;
- ui: a run launched as the UI launches it (GraphQL ``launchRun`` on the webserver), failing;
- job_backfill: a backfill of the job's partition set over two hours (the assets' single-run
  backfill policy: one run of ``pv_job_backfill_job`` over the range), failing;
- asset_backfill: an asset backfill over the two hours (one run of ``__ASSET_JOB``), failing.

Not here: a run whose worker AND code server were killed. Under ``dagster dev`` the code
server that launched the run is the code location's only one and is not started again, so the
location stays unreachable: no sensor ticks, the backfill daemon cancels the asset backfill's
run, and runs launched by that server are interrupted. The lease rule needs a deployment whose
code server comes back (tested without a daemon in tests/sensors).

Each failure gets exactly one recovery run, which succeeds; then each pipeline's state and
sinks equal an uninterrupted recomputation of the same landed input. Every wait polls with a
deadline; nothing depends on timing luck.
"""

import dagster as dg
import pandas as pd
import pyarrow.dataset as ds
import pytest
from pandas.testing import assert_frame_equal

from pipelines.examples.page_views import land_hour
from pipelines.instance import DAGSTER_YAML, limit_pools
from sensors import FAULT_TAG
from tests.acceptance.dagster_process import (
    BACKFILL,
    LAUNCH_BACKFILL,
    LOCATION,
    REPOSITORY,
    ROOT,
    DagsterDev,
    start_dagster_dev,
    stop_process_group,
    wait_for,
)
from tests.acceptance.support import state_frames, tags_of

LAUNCH_FAILED = "Caught an unrecoverable error while dequeuing the run"
RUN_TIMEOUT = 900  # generous: the six pipelines share two cores, and the machine may be shared
LAND = {"batches": 3, "views_per_batch": 60, "users": 10, "pages": 5, "seed": 7}
WORKSPACE = f"""load_from:
  - python_file:
      relative_path: {ROOT}/tests/acceptance/recovery_location.py
      location_name: {LOCATION}
      working_directory: {ROOT}
"""


def failed_run(dev: DagsterDev, what: str, find) -> dict:
    """The one run ``find()`` returns, once it failed with the injected fault."""
    (run,) = wait_for(f"the run started by {what}", find, RUN_TIMEOUT, 2)
    ended = dev.wait_for_run(run["runId"], RUN_TIMEOUT)
    errors = dev.run_errors(run["runId"])
    assert "FAILURE" == ended["status"], (what, errors)
    return ended


def recovered(dev: DagsterDev, failed_id: str) -> dict:
    """The one recovery run of ``failed_id``, once it succeeded."""
    (recovery,) = wait_for(
        f"a recovery run of {failed_id}",
        lambda: dev.runs_tagged("recovery/of_run_id", failed_id),
        RUN_TIMEOUT,
        2,
    )
    run = dev.wait_for_run(recovery["runId"], RUN_TIMEOUT)
    assert "SUCCESS" == run["status"], dev.run_errors(recovery["runId"])
    assert 1 == len(dev.runs_tagged("recovery/of_run_id", failed_id))
    return run


def backfill(dev: DagsterDev, params: dict) -> str:
    launched = dev.graphql(LAUNCH_BACKFILL, {"params": params})["launchPartitionBackfill"]
    assert "LaunchBackfillSuccess" == launched["__typename"], launched
    return launched["backfillId"]


def backfill_runs(dev: DagsterDev, backfill_id: str) -> list[dict]:
    found = dev.graphql(BACKFILL, {"id": backfill_id})["partitionBackfillOrError"]
    return found.get("runs") or []


def sink_frame(url: str) -> pd.DataFrame:
    frame = ds.dataset(url, format="parquet", partitioning="hive").to_table().to_pandas()
    frame = frame.astype({c: str for c in frame.columns if frame[c].dtype.name == "category"})
    return frame.sort_values(list(frame.columns)).reset_index(drop=True)


@pytest.mark.timeout(2400)
def test_every_start_mode_fails_and_is_recovered(tmp_path, monkeypatch):
    data, home = tmp_path / "data", tmp_path / "dagster_home"
    env = {
        "SPARK_MASTER": "local[1]",  # six runs side by side: more threads would only contend
        "CHECKPOINT_DIR": str(data / "checkpoints"),
        "SAVEPOINT_DIR": str(data / "savepoints"),
        "PIPELINE_DATA_DIR": str(data),
        "RECOVERY_TEST_DATA": str(data),
        "PIPELINE_FAULT_INJECTION": "1",
        "RECOVERY_INTERVAL_SECONDS": "5",
    }
    monkeypatch.setenv("RECOVERY_TEST_DATA", str(data))  # the location, imported here too
    from tests.acceptance.recovery_location import FAIL_AFTER, HOURS, MODES, defs, pipeline_of

    for mode in MODES:
        for hour in HOURS:
            land_hour(str(data / mode), hour, **LAND)
    home.mkdir()
    (home / "dagster.yaml").write_text(DAGSTER_YAML)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        limit_pools(instance, defs)
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(WORKSPACE)

    dev = start_dagster_dev(
        home, env, tmp_path / "dagster-dev.log", dagster_yaml=None, workspace=workspace
    )
    try:
        fault = {FAULT_TAG: FAIL_AFTER}
        # Started together (the schedule and the sensor start theirs by themselves).
        ui = dev.launch_run("pv_ui_job", {}, {"dagster/partition": HOURS[0]} | fault)
        tags = [{"key": FAULT_TAG, "value": FAIL_AFTER}]
        job_backfill = backfill(dev, {
            "selector": {
                "partitionSetName": "pv_job_backfill_job_partition_set",
                "repositorySelector": {
                    "repositoryLocationName": LOCATION, "repositoryName": REPOSITORY,
                },
            },
            "partitionNames": list(HOURS),
            "tags": tags,
        })  # fmt: skip
        asset_backfill = backfill(dev, {
            "assetSelection": [{"path": [f"pv_asset_backfill{sink}"]}
                               for sink in ("", "_sessions", "_page_counts")],
            "partitionNames": list(HOURS),
            "tags": tags,
        })  # fmt: skip

        failures = {
            "schedule": failed_run(dev, "the schedule", lambda: dev.runs_tagged(
                "dagster/schedule_name", "pv_schedule_fails")),
            "sensor": failed_run(dev, "the sensor", lambda: dev.runs_tagged(
                "dagster/sensor_name", "pv_sensor_fails")),
            "ui": failed_run(dev, "launchRun", lambda: [dev.run(ui)]),
            "job_backfill": failed_run(dev, "the job backfill", lambda: backfill_runs(
                dev, job_backfill)),
            "asset_backfill": failed_run(dev, "the asset backfill", lambda: backfill_runs(
                dev, asset_backfill)),
        }  # fmt: skip
        for mode, run in failures.items():
            errors = dev.run_errors(run["runId"])
            # Or Dagster could not start it (its code server too slow to answer on a loaded
            # machine): a failure before any batch, recovered all the same.
            assert "injected fault" in errors or LAUNCH_FAILED in errors, (mode, errors)
        assert "pv_job_backfill_job" == failures["job_backfill"]["jobName"]
        assert "__ASSET_JOB" == failures["asset_backfill"]["jobName"]
        for mode in ("job_backfill", "asset_backfill"):  # one run over both hours
            assert (HOURS[0], HOURS[1]) == (
                tags_of(failures[mode])["dagster/asset_partition_range_start"],
                tags_of(failures[mode])["dagster/asset_partition_range_end"],
            ), mode

        recoveries = {mode: recovered(dev, run["runId"]) for mode, run in failures.items()}
        for mode, run in recoveries.items():
            assert f"pv_{mode}_job" == run["jobName"], mode
            assert FAULT_TAG not in tags_of(run), mode
    finally:
        stop_process_group(dev.proc)

    # Equal to an uninterrupted recomputation of the same landed input.
    from pyspark.sql import SparkSession

    from pipelines import StatefulRunner
    from resources import CheckpointStorageResource, build_spark_session

    # a session this process already has (the suite's fixture) is not this function's to stop
    shared = SparkSession.getActiveSession()
    spark = build_spark_session(
        "local[1]", "start-modes-reference",
        {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"},
    )  # fmt: skip
    try:
        spark.sparkContext.setLogLevel("ERROR")
        reference_data = tmp_path / "reference"
        for hour in HOURS:
            land_hour(str(reference_data / "ref"), hour, **LAND)
        reference = StatefulRunner(
            spark,
            CheckpointStorageResource(
                checkpoint_dir=str(reference_data / "ckpt")
            ).checkpoint_storage(),
            pipeline_of("ref", str(reference_data)),
        )
        expected = {}
        for hour in HOURS:
            reference.run([hour])
            expected[hour] = {
                "state": state_frames(reference),
                "sinks": {s: sink_frame(str(reference_data / "ref" / s))
                          for s in ("sessions", "page_counts")},
            }  # fmt: skip
        storage = CheckpointStorageResource(checkpoint_dir=env["CHECKPOINT_DIR"])
        for mode in MODES:
            last = HOURS[1] if mode.endswith("backfill") else HOURS[0]
            runner = StatefulRunner(
                spark, storage.checkpoint_storage(), pipeline_of(mode, str(tmp_path / "unused"))
            )
            actual = state_frames(runner)
            assert expected[last]["state"].keys() == actual.keys(), mode
            for name, frame in expected[last]["state"].items():
                assert_frame_equal(frame, actual[name], check_exact=False, rtol=1e-9)
            for sink, frame in expected[last]["sinks"].items():
                assert_frame_equal(frame, sink_frame(str(data / mode / sink)), check_exact=False)
    finally:
        if shared is None:
            spark.stop()
