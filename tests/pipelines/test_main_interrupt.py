"""Ctrl-C in the main job (``scripts/run``, issue 25 item 5): it stops within seconds with one
line that says where the run was and where the state is, exit code 130, no Python, py4j or
Java traces, and the next run continues from that state."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import dagster as dg
import pytest

from pipelines.examples.click_events import NAME
from sensors import INTERRUPTED_TAG

ROOT = Path(__file__).resolve().parents[2]
STOP_WITHIN = 30.0  # seconds from Ctrl-C to exit (a loaded machine: it takes ~3 s)
TRACES = re.compile(r"Traceback|py4j|Py4J|at org\.apache|Exception|ERROR")


def _main(env: dict, days: int) -> subprocess.Popen:
    # Its own process group: Ctrl-C in a terminal signals the whole foreground group
    # (the Python driver, Spark's JVM and its Python workers), and so does the test.
    return subprocess.Popen(
        [sys.executable, "-m", "pipelines.main", "--days", str(days)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


@pytest.mark.timeout(900)
def test_ctrl_c_stops_with_one_line_and_the_next_run_continues(tmp_path, monkeypatch):
    """Two days to process; Ctrl-C (SIGINT to the process group) once the second day's first
    batch is applied: exit 130 within STOP_WITHIN seconds, one "interrupted:" line naming the
    partition, the batch and the last completed checkpoint, no traces; the run is tagged as
    stopped by its user (the recovery sensor leaves it alone); the next run starts from exactly
    that checkpoint."""
    env = os.environ | {
        "DAGSTER_HOME": str(tmp_path / "home"),
        "PIPELINE_DATA_DIR": str(tmp_path / "data"),
        "SPARK_MASTER": "local[2]",
        "PYTHONPATH": str(ROOT),
    }
    run = _main(env, 2)
    lines, interrupted_at = [], []

    def read() -> None:
        for line in run.stdout:
            lines.append(line.rstrip("\n"))
            if not interrupted_at and "2026-10-02: batch 1 of 4" in line:
                interrupted_at.append(time.monotonic())
                os.killpg(run.pid, signal.SIGINT)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        run.wait(timeout=600)
        reader.join(timeout=30)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    output = "\n".join(lines)
    assert interrupted_at, output[-3000:]
    stopped_after = time.monotonic() - interrupted_at[0]
    assert 130 == run.returncode, output[-3000:]
    assert stopped_after < STOP_WITHIN, output[-3000:]
    after = lines[next(i for i, line in enumerate(lines) if "2026-10-02: batch 1" in line) + 1:]
    assert [] == [line for line in lines if TRACES.search(line)], output[-3000:]
    (line,) = [line for line in after if line.startswith("interrupted:")]
    match = re.fullmatch(
        rf"interrupted: {NAME} 2026-10-02 at batch (\d); the state is at (\S+/chk-\d+) "
        r"\((.+)\); run scripts/run again to continue",
        line,
    )
    assert match, line
    # Before it, at most the progress of what finished while the jobs were being cancelled.
    assert all(re.match(r"\d\d:\d\d:\d\d  2026-10-02: ", x) for x in after[:-1]), after
    assert line == after[-1]
    pointer, position = match[2], match[3]
    assert int(match[1]) >= 2

    monkeypatch.setenv("DAGSTER_HOME", env["DAGSTER_HOME"])
    with dg.DagsterInstance.get() as instance:
        (stopped,) = instance.get_runs()
    assert "Ctrl-C" == stopped.tags.get(INTERRUPTED_TAG)
    assert dg.DagsterRunStatus.FAILURE == stopped.status

    again = subprocess.run(
        [sys.executable, "-m", "pipelines.main", "--days", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert 0 == again.returncode, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"Latest completed checkpoint: {position}; next: 2026-10-02" in again.stdout
    assert re.search(rf"^\S+  restored {re.escape(pointer)} \({re.escape(position)}\)$",
                     again.stdout, re.M), again.stdout[-3000:]  # fmt: skip
    assert "Asset check checkpoint_integrity: passed" in again.stdout
