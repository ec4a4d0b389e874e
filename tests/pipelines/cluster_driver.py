"""The driver of tests/pipelines/test_cluster.py: one checkpoint and one restore of the stateful
runner on a standalone Spark cluster (a master and a worker the test started).

Runs in its own process, since the pytest process may already hold a local SparkContext and
a JVM holds only one. It ships the project code (and this module, whose functions run on the
executors) as a zip with ``addPyFile``, so executors never depend on the working directory,
PYTHONPATH or an installed copy of the project. It prints one line ``RESULT <json>``.

    python tests/pipelines/cluster_driver.py --master spark://127.0.0.1:7077 --work-dir DIR

``CLUSTER_DRIVER_LOG_LEVEL=INFO`` shows Spark's job log (default ERROR).
"""

import argparse
import hashlib
import json
import os
import sys
import time
import zipfile
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# The executors import ``pipelines`` (its sources, sinks and state I/O run there), which
# imports ``resources`` (``on_session_created``, which needs no Dagster).
SHIPPED_PACKAGES = ("checkpoint_storage", "pipelines", "resources")
ZIP_NAME = "cluster_project.zip"
PARTITION = "2026-10-01"
RESULT_PREFIX = "RESULT "
EXECUTOR_BACKEND = "org.apache.spark.executor.CoarseGrainedExecutorBackend"


# --- run on the executors (shipped in the zip, pickled by reference) ----------------------


def fail_first_attempt(subtask: int, attempt: int) -> None:
    """``task_after_write`` hook: the first attempt of partition 0 fails after its state file
    was written, leaving that file behind as an orphan; the retry (attempt 1) succeeds."""
    if subtask == 0 and attempt == 0:
        raise RuntimeError("injected failure of attempt 0 of partition 0 after its write")


def _proc_stat(pid: int) -> tuple[str, int]:
    """(command name, parent pid) of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    return name, int(stat[stat.rindex(")") + 2 :].split()[1])


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]


def probe_executor(_rows):
    """Where this task runs: the Python worker's pid, the JVM that started it (its pid,
    parent pid and main class) and where the project modules were imported from."""
    import checkpoint_storage
    import pipelines.state_io

    pid = os.getpid()
    jvm = jvm_parent = None
    main_class = None
    current = pid
    for _ in range(10):
        name, parent = _proc_stat(current)
        if name == "java":
            jvm, jvm_parent = current, parent
            args = _cmdline(current)
            main_class = next((a for a in args if a.startswith("org.apache.spark.")), None)
            break
        if parent <= 1:
            break
        current = parent
    yield {
        "python_pid": pid,
        "python": sys.executable,
        "jvm_pid": jvm,
        "jvm_parent_pid": jvm_parent,
        "jvm_main_class": main_class,
        "modules": {
            "checkpoint_storage": checkpoint_storage.__file__,
            "pipelines.state_io": pipelines.state_io.__file__,
            "cluster_driver": __file__,
        },
    }


# --- the driver ---------------------------------------------------------------------------


def build_zip(target: Path) -> Path:
    """The project packages and this module, as a zip for ``addPyFile``."""
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zf:
        for package in SHIPPED_PACKAGES:
            for path in sorted((PROJECT_ROOT / package).rglob("*.py")):
                zf.write(path, path.relative_to(PROJECT_ROOT).as_posix())
        zf.write(Path(__file__).resolve(), "cluster_driver.py")
    return target


def _canonical(rows) -> dict:
    """Order-independent digest of collected rows."""
    lines = sorted(repr(tuple(row)) for row in rows)
    return {"rows": len(lines), "sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest()}


def _recompute(spark, landing: str) -> dict:
    """The stages' state after the day, computed directly without any checkpoint."""
    from pipelines import empty_state
    from pipelines.examples.click_events import STAGES
    from pipelines.examples.click_events.events import batch_urls
    from pipelines.examples.click_events.stages import EVENT_SCHEMA

    states = {stage.name: empty_state(spark, stage) for stage in STAGES}
    for url in batch_urls(landing, PARTITION):
        data = spark.read.schema(EVENT_SCHEMA).parquet(url)
        for stage in STAGES:
            states[stage.name], data = stage.apply(data, states[stage.name])
    return {name: _canonical(df.collect()) for name, df in states.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", required=True)
    parser.add_argument("--work-dir", required=True, type=Path)
    args = parser.parse_args(argv)

    # The driver imports the project from its checkout (as pytest does); executors do not.
    if str(PROJECT_ROOT) not in sys.path:
        sys.path.insert(0, str(PROJECT_ROOT))
    # Imported here so that `fail_first_attempt` and `probe_executor` are pickled by reference
    # as `cluster_driver.*` (resolved on the executors from the shipped zip), not by value.
    import cluster_driver

    from checkpoint_storage import FileSystemCheckpointStorage, collect_garbage
    from pipelines import StatefulRunner
    from pipelines.examples.click_events import (
        FIRST_PARTITION,
        STAGES,
        click_events_pipeline,
        generate_day,
    )
    from resources import build_spark_session

    started = time.monotonic()
    timings: dict[str, float] = {}

    def lap(name: str) -> None:
        timings[name] = round(time.monotonic() - started, 1)

    work: Path = args.work_dir
    landing = str(work / "landing")
    reports = str(work / "reports")
    checkpoints = work / "checkpoints"
    generate_day(landing, PARTITION, batches=1, events_per_batch=500, users=50, seed=7)
    project_zip = build_zip(work / ZIP_NAME)

    python = os.path.abspath(sys.executable)
    spark = build_spark_session(
        args.master,
        "cluster-checkpoint-test",
        {
            "spark.pyspark.python": python,
            "spark.pyspark.driver.python": python,
            "spark.task.maxFailures": "2",
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.driver.memory": "512m",
            "spark.executor.memory": "512m",
            "spark.executor.cores": "2",
            "spark.cores.max": "2",
            "spark.sql.shuffle.partitions": "4",
            "spark.ui.enabled": "false",
        },
    )
    lap("session")
    sc = spark.sparkContext
    sc.setLogLevel(os.environ.get("CLUSTER_DRIVER_LOG_LEVEL", "ERROR"))
    sc.addPyFile(str(project_zip))
    result: dict = {
        "master": sc.master,
        "driver_python_pid": os.getpid(),
        "driver_jvm_pid": int(sc._jvm.java.lang.ProcessHandle.current().pid()),
        "zip_name": ZIP_NAME,
        "python": python,
    }
    try:
        result["executors"] = (
            sc.parallelize(range(4), 4).mapPartitions(cluster_driver.probe_executor).collect()
        )
        lap("probe")
        storage = FileSystemCheckpointStorage(str(checkpoints), file_state_size_threshold=0)
        assert PARTITION == FIRST_PARTITION  # it starts from empty state
        # DataFrame stages: this checks their state files' task attempts on a cluster
        pipeline = click_events_pipeline(landing, reports, checkpoint_interval=10, stages=STAGES)
        runner = StatefulRunner(
            spark, storage, pipeline, task_after_write=cluster_driver.fail_first_attempt
        )
        (outcome,) = runner.run([PARTITION])
        lap("run")
        summary = outcome.checkpoint
        result["checkpoint"] = {
            "id": summary.checkpoint_id,
            "position": str(summary.position),
            "taken": len(outcome.checkpoints_taken),
            "inline_states": summary.inline_states,
            "files_written": summary.files_written,
            "state_rows": summary.state_rows,
        }
        metadata = runner.store.latest().metadata
        result["subtasks"] = {
            op.operator_id: {
                str(subtask): {
                    "attempt": state.properties["attempt"],
                    "files": [Path(h.path).name for h in state.handles],
                }
                for subtask, state in sorted(op.subtask_states.items())
            }
            for op in metadata.operator_states
        }
        chk_dir = Path(summary.pointer.removeprefix("file://"))
        result["chk_dir_name"] = chk_dir.name
        result["files_before_gc"] = sorted(p.name for p in chk_dir.iterdir())

        lap("inspect")
        gc = collect_garbage(runner.access, grace_period=0)
        result["gc_deleted"] = sorted(url.rsplit("/", 1)[-1] for url in gc.deleted)
        result["gc_deleted_dirs"] = sorted({url.rsplit("/", 2)[-2] for url in gc.deleted})
        result["gc_kept_in_chk"] = sorted(
            url.rsplit("/", 1)[-1] for url in gc.kept if f"/{chk_dir.name}/" in url
        )
        result["files_after_gc"] = sorted(p.name for p in chk_dir.iterdir())

        # Restore in a fresh runner (as a new run would), after the collection.
        fresh = StatefulRunner(spark, storage,
                               click_events_pipeline(landing, reports, stages=STAGES))
        restored_metadata = fresh.store.latest().metadata
        result["restored_checkpoint_id"] = restored_metadata.checkpoint_id
        restored = fresh.restore_states(restored_metadata)
        result["restored"] = {name: _canonical(df.collect()) for name, df in restored.items()}
        lap("restore")
        result["expected"] = _recompute(spark, landing)
        lap("recompute")
    finally:
        spark.stop()
    lap("stop")
    result["timings"] = timings
    print(RESULT_PREFIX + json.dumps(result, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
