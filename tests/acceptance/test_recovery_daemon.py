"""Every failure recovered, whatever started the run (issue 25, item 1), on a real daemon:
``dagster dev`` (webserver + daemon) against a temporary DAGSTER_HOME configured as the
project writes it (``pipelines.instance``: run monitoring, one run per pool), with the
click-events pipeline on local directories and ``RECOVERY_INTERVAL_SECONDS=5``.

1. While the daemon is down, an ``execute_in_process`` run of day 1 (in a subprocess, as
   ``scripts/run`` makes them: no code location origin) fails after batch 2. Once the daemon
   starts, its first ticks recover it (no cursor that starts after the failure).
2. Day 2 runs plainly (a failure with the daemon up is decided as in 1: the unit tests of
   the sensor cover each way a run can start).
3. A launched run of day 3 stops after batch 2 (test seam ``test/hang_after_batch``) and its
   run worker is SIGKILLed: Dagster marks it failed, and it is recovered.
4. A launched run of day 4 stops likewise, a second run of day 4 waits in the queue (the
   pipeline's pool), the first one's worker is SIGKILLed: it fails, its pool slot is freed and
   the queued run starts and completes; the failure is not recovered (the later run covers
   it), and the sensor says so.
5. Reports and state equal an uninterrupted recomputation of days 1-4.

Every wait polls with a deadline; nothing depends on timing luck.
"""

import datetime as dt
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pandas.testing import assert_frame_equal

from pipelines.examples.click_events import FIRST_PARTITION, click_events_pipeline
from pipelines.instance import DAGSTER_YAML
from sensors import FAULT_TAG
from tests.acceptance.dagster_process import (
    ROOT,
    DagsterDev,
    start_dagster_dev,
    stop_process_group,
    wait_for,
)
from tests.acceptance.support import read_report, state_frames, tags_of, user_activity_config

HANG_TAG = "test/hang_after_batch"
SENSOR = "user_activity_recovery_sensor"
DAYS = [
    (dt.date.fromisoformat(FIRST_PARTITION) + dt.timedelta(days=n)).isoformat() for n in range(4)
]
RUN_TIMEOUT = 300
# Run monitoring frees a dead run's pool slot 15 s after it ended, checked every 15 s.
POOL_FREED_TIMEOUT = 120 + RUN_TIMEOUT
EXECUTE_IN_PROCESS = """
import json, sys
import dagster as dg
from pipelines.definitions import defs

job = defs.resolve_job_def("user_activity_job")
with dg.DagsterInstance.get() as instance:
    result = job.execute_in_process(
        instance=instance, partition_key=sys.argv[1], run_config=json.loads(sys.argv[2]),
        tags=json.loads(sys.argv[3]), raise_on_error=False,
    )
print(result.run_id)
"""


def execute_in_process(env: dict[str, str], day: str, tags: dict[str, str]) -> str:
    """An ``execute_in_process`` run of ``day`` in a new process; its run id."""
    done = subprocess.run(
        [sys.executable, "-c", EXECUTE_IN_PROCESS, day, json.dumps(user_activity_config()),
         json.dumps(tags)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT, check=True,
    )  # fmt: skip
    return done.stdout.strip().splitlines()[-1]


def recovered(dev: DagsterDev, failed_id: str) -> dict:
    """The one recovery run of ``failed_id``, once it succeeded."""
    (recovery,) = wait_for(
        f"a recovery run of {failed_id}",
        lambda: dev.runs_tagged("recovery/of_run_id", failed_id),
        RUN_TIMEOUT,
        2,
    )
    run = dev.wait_for_run(recovery["runId"], 2 * RUN_TIMEOUT)
    assert "SUCCESS" == run["status"], dev.run_errors(recovery["runId"])
    assert 1 == len(dev.runs_tagged("recovery/of_run_id", failed_id))
    return run


def kill_when_hanging(dev: DagsterDev, markers: Path, day: str, run_id: str) -> None:
    """SIGKILL the run worker of ``run_id`` once it hangs in ``day``; wait for its failure."""
    marker = markers / f"{day}.pid"
    pid = int(
        wait_for(
            f"run {run_id} to hang in {day}",
            lambda: marker.is_file() and marker.read_text(),
            RUN_TIMEOUT,
            1,
        )
    )
    marker.unlink()
    os.kill(pid, signal.SIGKILL)
    assert "FAILURE" == dev.wait_for_run(run_id, 120)["status"]


@pytest.mark.timeout(2400)
def test_every_failure_is_recovered_whatever_started_the_run(tmp_path):
    data, markers = tmp_path / "data", tmp_path / "markers"
    env = {
        "SPARK_MASTER": "local[2]",
        "CHECKPOINT_DIR": str(data / "checkpoints"),
        "SAVEPOINT_DIR": str(data / "savepoints"),
        "LANDING_DIR": str(data / "landing"),
        "REPORT_DIR": str(data / "reports"),
        "PAGE_VIEWS_DIR": str(data / "page_views"),
        "PIPELINE_DATA_DIR": str(data),
        "PIPELINE_FAULT_INJECTION": "1",
        "PIPELINE_FAULT_MARKER_DIR": str(markers),
        "RECOVERY_INTERVAL_SECONDS": "5",
    }
    home = tmp_path / "dagster_home"
    full_env = os.environ | env | {"DAGSTER_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    subprocess.run(
        [sys.executable, "-m", "pipelines.instance"], cwd=ROOT, env=full_env, check=True,
        capture_output=True, timeout=240,
    )  # fmt: skip
    assert DAGSTER_YAML == (home / "dagster.yaml").read_text()

    # 1. A failure while the daemon is down.
    down = execute_in_process(full_env, DAYS[0], {FAULT_TAG: "2"})
    dev = start_dagster_dev(home, env, tmp_path / "dagster-dev.log", dagster_yaml=None)
    try:
        assert "SUCCESS" != dev.run(down)["status"]
        assert DAYS[0] == tags_of(recovered(dev, down))["dagster/partition"]

        # 2. Day 2 as a plain run (an execute_in_process failure with the daemon up is the
        # same decision as 1: the unit tests cover each way a run starts).
        plain = dev.launch_run(
            "user_activity_job", user_activity_config(), {"dagster/partition": DAYS[1]}
        )
        assert "SUCCESS" == dev.wait_for_run(plain, RUN_TIMEOUT)["status"], dev.run_errors(plain)

        # 3. A SIGKILLed run worker.
        killed = dev.launch_run(
            "user_activity_job",
            user_activity_config(),
            {"dagster/partition": DAYS[2], HANG_TAG: "2"},
        )
        kill_when_hanging(dev, markers, DAYS[2], killed)
        assert DAYS[2] == tags_of(recovered(dev, killed))["dagster/partition"]

        # 4. A SIGKILLed run with a run queued behind it.
        first = dev.launch_run(
            "user_activity_job",
            user_activity_config(),
            {"dagster/partition": DAYS[3], HANG_TAG: "2"},
        )
        wait_for(f"run {first} to hang", (markers / f"{DAYS[3]}.pid").is_file, RUN_TIMEOUT, 1)
        queued = dev.launch_run(
            "user_activity_job", user_activity_config(), {"dagster/partition": DAYS[3]}
        )
        wait_for(f"run {queued} to be queued", lambda: dev.run(queued)["status"] == "QUEUED", 60, 1)
        assert "QUEUED" == dev.run(queued)["status"]  # held by the pool while the first runs
        kill_when_hanging(dev, markers, DAYS[3], first)
        assert "SUCCESS" == dev.wait_for_run(queued, POOL_FREED_TIMEOUT)["status"], dev.run_errors(
            queued
        )
        covered = f"run {first} failed at {DAYS[3]}, but the later run {queued} (SUCCESS)"
        wait_for(
            f"a tick of {SENSOR} saying the queued run covers the killed one",
            lambda: any(covered in (t["skipReason"] or "") for t in dev.sensor_ticks(SENSOR)),
            120,
            2,
        )
        assert [] == dev.runs_tagged("recovery/of_run_id", first)
    finally:
        stop_process_group(dev.proc)

    # 5. Equal to an uninterrupted recomputation.
    from pyspark.sql import SparkSession

    from pipelines import StatefulRunner
    from resources import CheckpointStorageResource, build_spark_session

    # a session this process already has (the suite's fixture) is not this function's to stop
    shared = SparkSession.getActiveSession()
    spark = build_spark_session(
        "local[1]", "recovery-reference",
        {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"},
    )  # fmt: skip
    try:
        spark.sparkContext.setLogLevel("ERROR")
        reports = str(tmp_path / "reference-reports")
        reference = StatefulRunner(
            spark,
            CheckpointStorageResource(
                checkpoint_dir=str(tmp_path / "reference")
            ).checkpoint_storage(),
            click_events_pipeline(env["LANDING_DIR"], reports),
        )
        reference.run(DAYS)
        for day in DAYS:
            assert_frame_equal(
                read_report(reports, day), read_report(env["REPORT_DIR"], day),
                check_exact=False, rtol=1e-9,
            )  # fmt: skip
        daemon = StatefulRunner(
            spark,
            CheckpointStorageResource(checkpoint_dir=env["CHECKPOINT_DIR"]).checkpoint_storage(),
            click_events_pipeline(env["LANDING_DIR"], str(tmp_path / "unused-reports")),
        )
        expected, actual = state_frames(reference), state_frames(daemon)
        assert expected.keys() == actual.keys()
        for name in expected:
            assert_frame_equal(expected[name], actual[name], check_exact=False, rtol=1e-9)
    finally:
        if shared is None:
            spark.stop()
