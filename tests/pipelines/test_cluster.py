"""One checkpoint and restore of the stateful runner on a real multi-process Spark: a standalone
master and worker started here from the pyspark package, and a driver in a subprocess
(cluster_driver.py), since this pytest process may already hold a local SparkContext.

The executors get the project code only from the zip the driver ships (``addPyFile``): the
cluster runs outside the project directory, without PYTHONPATH.
"""

import json

import pytest

from tests.pipelines.standalone_cluster import PYTHON, SPARK_CLASS, Cluster

# A standalone master and worker and a driver, each a JVM in a subprocess.
pytestmark = [pytest.mark.spark, pytest.mark.slow]
STAGES = ("dedupe", "user_activity")


@pytest.fixture
def cluster(tmp_path):
    if not SPARK_CLASS.exists():
        pytest.fail(f"no spark-class in the pyspark package: {SPARK_CLASS}")
    cluster = Cluster(tmp_path / "cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        survivors = cluster.stop()
    assert [] == survivors, "processes of the Spark cluster survived SIGKILL"


@pytest.mark.timeout(300, method="signal")  # signal: the teardown still runs
def test_checkpoint_and_restore_on_a_standalone_cluster(cluster, tmp_path):
    work = tmp_path / "driver"
    work.mkdir()
    completed = cluster.run_driver(work)
    assert 0 == completed.returncode, f"{completed.stderr[-8000:]}\n{cluster.logs()}"
    (line,) = [x for x in completed.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    print("driver timings (s since start):", result["timings"])
    print(json.dumps(result, sort_keys=True))

    # The work ran on the cluster: executor JVMs the worker started, other processes than
    # the driver's, importing the project from the shipped zip.
    assert cluster.url == result["master"]
    assert PYTHON == result["python"]
    executors = result["executors"]
    assert 4 == len(executors)
    expected_modules = {
        "checkpoint_storage": "checkpoint_storage/__init__.py",
        "pipelines.state_io": "pipelines/state_io.py",
        "cluster_driver": "cluster_driver.py",
    }
    for probe in executors:
        assert "org.apache.spark.executor.CoarseGrainedExecutorBackend" == probe["jvm_main_class"]
        assert cluster.worker.pid == probe["jvm_parent_pid"]
        assert result["driver_jvm_pid"] != probe["jvm_pid"]
        assert result["driver_python_pid"] != probe["python_pid"]
        assert PYTHON == probe["python"]
        assert {
            name: f"/{result['zip_name']}/{suffix}" for name, suffix in expected_modules.items()
        } == {
            name: path[path.index(f"/{result['zip_name']}/") :]
            for name, path in probe["modules"].items()
        }
    assert list(cluster.work_dir.glob("app-*/*/stderr")), "the worker launched no executor"
    assert [("cluster-checkpoint-test", "FINISHED")] == cluster.completed_apps()

    # One checkpoint, at the end of the day, every state in files.
    checkpoint = result["checkpoint"]
    assert {
        "id": 1,
        "position": "end of 2026-10-01",
        "taken": 1,
        "inline_states": 0,
    } == {k: checkpoint[k] for k in ("id", "position", "taken", "inline_states")}

    # Task retries: attempt 0 of partition 0 failed after writing its file, attempt 1 won.
    subtasks = result["subtasks"]
    assert set(STAGES) == set(subtasks)
    referenced = set()
    for stage in STAGES:
        attempts = {s: v["attempt"] for s, v in subtasks[stage].items()}
        assert {s: ("1" if s == "0" else "0") for s in attempts} == attempts
        for subtask, v in subtasks[stage].items():
            (name,) = v["files"]
            prefix = f"{stage}-{int(subtask):05d}-a{attempts[subtask]}-"
            assert name.startswith(prefix), (prefix, name)
            referenced.add(name)
    assert len(referenced) == checkpoint["files_written"]
    orphans = sorted(
        n for n in result["files_before_gc"] if any(n.startswith(f"{s}-00000-a0-") for s in STAGES)
    )
    assert len(STAGES) == len(orphans)
    assert sorted(referenced | {"_metadata"} | set(orphans)) == result["files_before_gc"]

    # Garbage collection removes exactly the orphans, and the restore still works afterwards.
    assert orphans == result["gc_deleted"]
    assert [result["chk_dir_name"]] == result["gc_deleted_dirs"]
    assert sorted(referenced | {"_metadata"}) == result["gc_kept_in_chk"]
    assert sorted(referenced | {"_metadata"}) == result["files_after_gc"]

    # The restored state is the state the runner checkpointed, and what the stages compute.
    assert 1 == result["restored_checkpoint_id"]
    assert result["expected"] == result["restored"]
    assert checkpoint["state_rows"] == {k: v["rows"] for k, v in result["restored"].items()}
    assert all(v["rows"] > 0 for v in result["restored"].values())
