"""The whole code location loads, and its assets and check work on a real Dagster instance."""

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import dagster as dg
import pytest
import yaml

from checkpoint_storage import (
    FileSystemCheckpointStorage,
    StorageConfigurationError,
    resolve_checkpoint_pointer,
)
from pipelines import SourcePosition, job_id_for
from pipelines.definitions import defs
from pipelines.examples import page_views
from pipelines.examples.click_events import NAME
from pipelines.main import next_partitions
from resources import CheckpointStorageResource, SparkResource
from tests.pipelines.support import click_defs, click_pipeline, materialize_range, resources_for

ROOT = Path(__file__).resolve().parents[2]
RANGE_START = "dagster/asset_partition_range_start"


def test_code_location_loads():
    """Definitions.validate_loadable accepts the code location with every asset and job."""
    dg.Definitions.validate_loadable(defs)
    keys = {key.to_user_string() for key in defs.resolve_all_asset_keys()}
    views = page_views.NAME
    assert {
        "click_events",
        "user_activity",
        "user_activity_daily_report",
        views,
        f"{views}_sessions",
        f"{views}_page_counts",
    } == keys
    assert defs.resolve_job_def(f"{NAME}_job").partitions_def is not None


def test_workspace_and_pyproject_name_the_same_location():
    """workspace.yaml and [tool.dagster] load the same module under the same name."""
    workspace = yaml.safe_load((ROOT / "workspace.yaml").read_text())
    module = workspace["load_from"][0]["python_module"]
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["dagster"]
    assert (tool["module_name"], tool["code_location_name"]) == (
        module["module_name"],
        module["location_name"],
    )


def run_check(instance, resources, tmp_path):
    job = click_defs(tmp_path, resources=resources).resolve_job_def(f"{NAME}_integrity_job")
    result = job.execute_in_process(instance=instance, raise_on_error=False)
    (evaluation,) = result.get_asset_check_evaluations()
    return evaluation


def user_activity_metadata(instance) -> dict[str, dict]:
    records = instance.fetch_materializations(dg.AssetKey(NAME), limit=100).records
    return {
        r.asset_materialization.partition: {
            k: v.value for k, v in r.asset_materialization.metadata.items()
        }
        for r in records
    }


@pytest.fixture(scope="module")
def materialized(spark, tmp_path_factory):
    """Two days materialized in one run (a single-run backfill), on a real instance."""
    tmp_path = tmp_path_factory.mktemp("defs")
    resources = resources_for(tmp_path, file_state_size_threshold=1024)
    with dg.instance_for_test() as instance:
        result = materialize_range(
            instance, resources, "2026-10-01", "2026-10-02", pipeline=click_pipeline(tmp_path)
        )
        yield instance, resources, result, tmp_path


def test_materialization_records_checkpoint_metadata(materialized):
    """Each partition's materialization records its own checkpoint, and the second day's
    state was carried over from the first day's checkpoint."""
    instance, _, result, tmp_path = materialized
    assert result.success
    meta = user_activity_metadata(instance)
    assert ["2026-10-01", "2026-10-02"] == sorted(meta)
    first, second = meta["2026-10-01"], meta["2026-10-02"]
    assert "none: started from empty state" == first["restored_from"]
    assert first["checkpoint_pointer"] == second["restored_from"]
    assert first["checkpoint_id"] < second["checkpoint_id"]
    assert (tmp_path / "checkpoints").as_posix() in second["checkpoint_pointer"]
    assert "end of 2026-10-02" == second["source_position"]
    assert 3 * 300 == second["rows_source"]
    assert 3 == second["batches_applied"]
    assert second["state_bytes"] > 0
    assert second["files_written"] + second["inline_states"] >= 2
    assert 30 == second["state_rows_user_activity"]


def test_a_backfill_yields_the_check_for_the_last_checkpoint_it_wrote(materialized):
    """A two-day single-run backfill with the integrity check selected (as the UI selects
    it) evaluates the check once, for the checkpoint of the last day, and skips no step."""
    instance, _, result, _ = materialized
    (evaluation,) = result.get_asset_check_evaluations()
    last = user_activity_metadata(instance)["2026-10-02"]["checkpoint_pointer"]
    assert (True, "checkpoint_integrity") == (evaluation.passed, evaluation.check_name)
    assert last == evaluation.metadata["checkpoint_pointer"].value
    assert [] == [e for e in result.all_events if e.event_type_value == "STEP_SKIPPED"]


def test_materialization_shows_what_is_retained(materialized):
    """Each day's materialization carries the retained table as it was right after that
    day's checkpoint: the second day's lists every retained checkpoint, ending with its own,
    with decoded positions."""
    instance, _, _, _ = materialized
    records = instance.fetch_materializations(dg.AssetKey(NAME), limit=10).records
    by_day = {r.asset_materialization.partition: r.asset_materialization for r in records}
    second = by_day["2026-10-02"]
    rows = [(r.data["kind"], r.data["position"]) for r in second.metadata["retained"].value.records]
    # checkpoint_interval 2, 3 batches a day, max 3 retained: 10-01 end, 10-02 at 2, 10-02 end.
    expected = [
        ("checkpoint", "2026-10-01 end"),
        ("checkpoint", "2026-10-02 batch 2"),
        ("checkpoint", "2026-10-02 end"),
    ]
    assert expected == rows
    last = second.metadata["retained"].value.records[-1].data
    assert f"chk-{last['id']}" == last["pointer"]
    assert second.metadata["checkpoint_pointer"].value.endswith(f"/{last['pointer']}")
    assert second.metadata["checkpoint_id"].value == last["id"]
    assert "materialization" == second.metadata["event"].value
    assert second.description.startswith("Materialization of partition 2026-10-02: ")


def test_daily_report_materialized_per_partition(materialized):
    """The daily report gets one materialization per processed day, pointing at its
    directory."""
    instance, _, _, tmp_path = materialized
    key = dg.AssetKey(f"{NAME}_daily_report")
    records = instance.fetch_materializations(key, limit=10).records
    paths = sorted(r.asset_materialization.metadata["path"].value for r in records)
    expected = [f"{tmp_path / 'reports'}/report_date=2026-10-0{d}" for d in (1, 2)]
    assert expected == paths
    assert all(Path(p).is_dir() for p in paths)


_SESSIONS_ASKED: list[str] = []


class _SessionAskedSpark(SparkResource):
    """A real ``SparkResource`` that notes each time its session is asked for."""

    @property
    def session(self):
        _SESSIONS_ASKED.append(self.master)
        return super().session


def test_the_check_alone_of_a_small_state_asks_for_no_spark_session(materialized):
    """``<name>_integrity_job`` on a small state (replayed in the driver) never asks the
    resource for a session, so that its run starts no JVM; the verdict and the restored rows
    are those of the check with Spark's session in hand."""
    instance, resources, _, tmp_path = materialized
    with_session = run_check(instance, resources, tmp_path)
    _SESSIONS_ASKED.clear()
    evaluation = run_check(
        instance, resources | {"spark": _SessionAskedSpark(master="local[2]")}, tmp_path)
    assert [] == _SESSIONS_ASKED
    assert evaluation.passed and with_session.passed
    meta = {k: v.value for k, v in evaluation.metadata.items()}
    assert meta == {k: v.value for k, v in with_session.metadata.items()}
    assert meta["verified"] == "the whole checkpoint (the check runs alone)"
    assert {"restored_rows_user_activity", "restored_rows_dedupe"} <= set(meta)


def test_checkpoint_integrity_passes_then_fails_on_corruption(materialized):
    """The check passes on the latest checkpoint, and fails once one of its state files has
    a flipped byte."""
    instance, resources, _, tmp_path = materialized
    assert run_check(instance, resources, tmp_path).passed
    pointer = user_activity_metadata(instance)["2026-10-02"]["checkpoint_pointer"]
    metadata = resolve_checkpoint_pointer(pointer, None).load_metadata()
    state_files = sorted(Path(h.path) for h in metadata.all_handles() if hasattr(h, "path"))
    assert state_files, "the check needs at least one state file to corrupt"
    victim = state_files[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    try:
        evaluation = run_check(instance, resources, tmp_path)
        assert not evaluation.passed
        assert "corrupt" in (evaluation.description or "")
    finally:
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))


def test_checkpoint_integrity_fails_on_truncated_metadata(spark, tmp_path):
    """A truncated `_metadata` in the newest checkpoint fails the check and says so."""
    resources = resources_for(tmp_path)
    pipeline = click_pipeline(tmp_path)
    with dg.instance_for_test() as instance:
        assert materialize_range(
            instance, resources, "2026-10-01", "2026-10-01", pipeline=pipeline
        ).success
        pointer = user_activity_metadata(instance)["2026-10-01"]["checkpoint_pointer"]
        metadata_file = Path(pointer) / "_metadata"
        metadata_file.write_bytes(metadata_file.read_bytes()[:20])
        evaluation = run_check(instance, resources, tmp_path)
    assert not evaluation.passed
    assert "invalid" in evaluation.description


def test_restore_from_a_snapshot_that_does_not_fit_fails_the_run(spark, tmp_path):
    """restore_from naming a snapshot whose position does not fit the range fails the run
    with a message naming the snapshot and the state the range needs."""
    resources = resources_for(tmp_path)
    pipeline = click_pipeline(tmp_path)
    with dg.instance_for_test() as instance:
        assert materialize_range(
            instance, resources, "2026-10-01", "2026-10-01", pipeline=pipeline
        ).success
        pointer = user_activity_metadata(instance)["2026-10-01"]["checkpoint_pointer"]
        result = materialize_range(
            instance,
            resources,
            "2026-10-05",
            "2026-10-05",
            pipeline=pipeline,
            restore_from=pointer,
        )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    message = failure.event_specific_data.error.cause.message
    assert pointer in message
    assert "end of 2026-10-04" in message


def test_credentials_are_refused_in_plain_storage_options():
    """A credential in storage_options is refused with a pointer to storage_options_from_env."""
    with pytest.raises(Exception, match="storage_options_from_env"):
        CheckpointStorageResource(checkpoint_dir="/tmp/x", storage_options={"secret": "s3cr3t"})


def test_file_merging_options_reach_the_storage(tmp_path):
    """The resource's file merging options configure the storage it hands out: on local
    disk, merging across checkpoints makes writers resume their physical files."""
    resource = CheckpointStorageResource(
        checkpoint_dir=str(tmp_path), file_merging_enabled=True,
        file_merging_across_checkpoint_boundary=True, file_merging_max_file_size=1 << 20)
    storage = resource.checkpoint_storage()
    plain = CheckpointStorageResource(checkpoint_dir=str(tmp_path)).checkpoint_storage()
    assert (True, 1 << 20, False) == (storage.resumes_physical_files,
                                      storage.file_merging_max_file_size,
                                      plain.resumes_physical_files)


def test_credentials_from_env_stay_out_of_the_shipped_object(tmp_path, monkeypatch):
    """Options named in storage_options_from_env are read from the environment when used and
    are absent from the pickled storage object; an unset variable is a clear error."""
    import pickle

    monkeypatch.setenv("TEST_CANARY_SECRET", "canary-7f3a9d")
    resource = CheckpointStorageResource(
        checkpoint_dir=str(tmp_path), storage_options_from_env={"auto_mkdir": "TEST_CANARY_SECRET"}
    )
    storage = resource.checkpoint_storage()
    assert "canary-7f3a9d" == storage.storage_options["auto_mkdir"]
    assert b"canary-7f3a9d" not in pickle.dumps(storage)
    assert "canary-7f3a9d" not in repr(storage)
    monkeypatch.delenv("TEST_CANARY_SECRET")
    with pytest.raises(StorageConfigurationError, match="TEST_CANARY_SECRET"):
        FileSystemCheckpointStorage(
            str(tmp_path), storage_options_from_env={"auto_mkdir": "TEST_CANARY_SECRET"}
        )


@pytest.mark.parametrize(
    ("latest", "expected"),
    [
        (None, ["2026-10-01", "2026-10-02"]),
        (SourcePosition("2026-10-01", 4, True), ["2026-10-02", "2026-10-03"]),
        (SourcePosition("2026-10-02", 1, False), ["2026-10-02", "2026-10-03"]),
        (SourcePosition("2026-10-09", 4, True), ["2026-10-10"]),
        (SourcePosition("2026-10-10", 4, True), []),
    ],
)
def test_next_partitions_continue_from_the_latest_checkpoint(latest, expected):
    """The main job continues after the latest position, never past yesterday."""
    import datetime as dt

    assert expected == next_partitions(latest, 2, dt.date(2026, 10, 11))


@pytest.mark.timeout(1500)
def test_main_job_twice_continues_from_the_latest_checkpoint(tmp_path):
    """The README's main job, run twice on a fresh DAGSTER_HOME: the second run continues
    from the first run's latest checkpoint, both runs are in the instance, the console shows
    a line per partition start, batch, checkpoint and end without Dagster's warnings, the
    summary lists what is retained with the commands that read it, and the backfill command
    it prints runs."""
    env = os.environ | {
        "DAGSTER_HOME": str(tmp_path / "home"),
        "PIPELINE_DATA_DIR": str(tmp_path / "data"),
        "SPARK_MASTER": "local[2]",
    }

    def run() -> str:
        done = subprocess.run(
            [sys.executable, "-m", "pipelines.main", "--days", "1"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-3000:]
        errors.append(done.stderr)
        return done.stdout

    errors = []
    first, second = run(), run()
    assert "Latest completed checkpoint: none; next: 2026-10-01" in first
    assert "Latest completed checkpoint: end of 2026-10-01; next: 2026-10-02" in second
    assert "Asset check checkpoint_integrity: passed" in second
    assert re.search(r"2026-10-02: checkpoint \d+ .* restored from \S+chk-\d+", second)
    assert "telemetry" in (tmp_path / "home" / "dagster.yaml").read_text()
    with dg.DagsterInstance.from_config(str(tmp_path / "home")) as instance:
        runs = instance.get_runs(dg.RunsFilter(job_name=f"{NAME}_job"))
        assert 2 == len(runs)
        assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs)
    # Progress: a plain line per partition start, batch, checkpoint and end, nothing else.
    progress = [line.split("  ", 1)[1] for line in second.splitlines()
                if re.match(r"\d\d:\d\d:\d\d  ", line)]  # fmt: skip
    assert [
        "landed 2026-10-02: 4 batches, 8000 events",
        f"{NAME}: 1 partition(s), 2026-10-02; Spark master local[2]",
        "2026-10-02: 4 of 4 batches to apply",
        "2026-10-02: batch 1 of 4 (2000 rows in)",
        "2026-10-02: batch 2 of 4 (2000 rows in)",
        "2026-10-02: batch 3 of 4 (2000 rows in)",
        "2026-10-02: batch 4 of 4 (2000 rows in)",
    ] == [line for line in progress if "checkpoint" not in line and "restored" not in line
          and "done" not in line]  # fmt: skip
    assert re.search(r"^restored \S+/chk-2 \(end of 2026-10-01\)$", progress[2], re.M)
    assert re.search(r"2026-10-02: checkpoint 4 at end of 2026-10-02 \(.+ KiB, \d+ files\)",
                     "\n".join(progress))  # fmt: skip
    assert "2026-10-02: done, 4 batches, 8000 rows in" in "\n".join(progress)
    assert " - DEBUG - " not in second
    assert [] == [line for line in errors[1].splitlines() if "Warning" in line]
    # The summary: what is retained, the commands that read it and backfill from it.
    job_dir = f"{tmp_path}/data/checkpoints/{job_id_for(NAME)}"
    for line in (
        "checkpoint             4  end of 2026-10-02",
        f"checkpoints read {job_dir}/chk-4 --stage dedupe",
        f"checkpoints read {job_dir}/chk-4 --stage user_activity",
    ):
        assert line in second
    (backfill,) = [line.strip() for line in second.splitlines() if "asset materialize" in line]
    assert "--partition-range 2026-10-02...2026-10-02" in backfill
    assert f'"restore_from": "{job_dir}/chk-2"' in backfill
    # ... and the backfill command runs as printed (with this venv's dagster).
    dagster = str(Path(sys.executable).with_name("dagster"))
    done = subprocess.run(
        ["bash", "-c", backfill.replace(".venv/bin/dagster", shlex.quote(dagster), 1)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-3000:]
    with dg.DagsterInstance.from_config(str(tmp_path / "home")) as instance:
        (backfill_run,) = instance.get_runs(limit=1)  # the newest
        assert "2026-10-02" == backfill_run.tags[RANGE_START]
        assert dg.DagsterRunStatus.SUCCESS == backfill_run.status
        assert f"{NAME}_job" != backfill_run.job_name
