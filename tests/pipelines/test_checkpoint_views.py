"""What an operator sees of a real run's checkpoints (issue 29): ``checkpoints list`` and
``inspect`` with statistics, ``checkpoints history`` (and the Dagster event log's older
checkpoints), ``checkpoints stages`` and ``format("checkpoint").option("view", "stages")``."""

import json
import sys
from pathlib import Path

import dagster as dg
import pytest
from pyspark import cloudpickle
from typer.testing import CliRunner

from checkpoint_storage import list_checkpoints
from checkpoint_storage.cli import build_app
from pipelines import StatefulRunner, register_checkpoint_source
from pipelines.cli import register
from tests.pipelines.mixed_stages import mixed_pipeline
from tests.pipelines.support import storage_of

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def checkpoints(*args: str, env: dict | None = None):
    """``checkpoints ARGS`` in-process, with the pipelines plugin registered."""
    app = build_app(plugins=False)
    register(app)
    result = CliRunner().invoke(app, [str(a) for a in args], env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@pytest.fixture(scope="module")
def job(spark, tmp_path_factory) -> Path:
    """The job directory of a run of two partitions of a keyed and a plain stage (the
    keyed stage with a TTL), one checkpoint each."""
    import datetime as dt

    from pipelines import StateTtl, TtlTimeCharacteristic

    tmp_path = tmp_path_factory.mktemp("views")
    pipeline = mixed_pipeline(StateTtl(dt.timedelta(days=30),
                                       TtlTimeCharacteristic.PROCESSING_TIME))
    runner = StatefulRunner(spark, storage_of(tmp_path, file_state_size_threshold=512),
                            pipeline, keyed_local_dir=str(tmp_path / "local"))
    runner.run(["p1", "p2"])
    return tmp_path / "checkpoints" / str(runner.job_id)


def completed(job: Path):
    return [i for i in list_checkpoints(str(job)) if i.completed]


@pytest.mark.timeout(240)
def test_list_and_inspect_show_the_statistics(job):
    """``list``: the bytes each checkpoint wrote and its new files, beside its full size;
    ``inspect``: the totals, the durations and a row per stage; both in JSON too."""
    infos = completed(job)
    listed = checkpoints("list", job)
    header = listed.stdout.splitlines()[1].split()
    assert header[:7] == ["ID", "KIND", "STATUS", "POSITION", "SIZE", "WRITTEN", "FILES"]
    for info in infos:
        [line] = [line for line in listed.stdout.splitlines() if line.endswith(info.pointer)]
        assert f"{info.file_count} ({info.statistics['files_new']} new)" in line
    rows = json.loads(checkpoints("list", job, "--json").stdout)
    assert [r["statistics"]["written_size"] for r in rows] == [
        i.statistics["written_size"] for i in infos]

    newest = infos[-1]
    shown = checkpoints("inspect", newest.pointer)
    assert 0 == shown.exit_code, shown.output
    assert "statistics:" in shown.stdout and "recorded" in shown.stdout
    assert "durations: batch " in shown.stdout and "state write" in shown.stdout
    assert "keyed state: full snapshots " in shown.stdout  # the plain stage has none
    assert f"(of chk-{infos[-2].checkpoint_id}: " in shown.stdout  # its publication
    stage_lines = [line.split() for line in shown.stdout.splitlines()
                   if line.strip().startswith(("totals ", "customers "))]
    assert ["totals", "keyed"] == stage_lines[0][:2]
    assert ["customers", "plain"] == stage_lines[1][:2]
    doc = json.loads(checkpoints("inspect", newest.pointer, "--json").stdout)
    assert doc["statistics"] == newest.statistics


@pytest.mark.timeout(240)
def test_history_prints_the_trend_and_what_dagster_recorded_before(job, tmp_path):
    """``history JOB``: a row per retained checkpoint, oldest first, with written and full
    bytes, files, rows and durations (a checkpoint's _metadata publication from the next
    one's record); with --dagster-asset, the materializations of checkpoints no longer
    retained come first, from the instance's event log."""
    infos = completed(job)
    rows = json.loads(checkpoints("history", job, "--json").stdout)
    assert [r["checkpoint_id"] for r in rows] == [i.checkpoint_id for i in infos]
    assert all(r["source"] == "checkpoint" and r["recorded"] for r in rows)
    assert [r["written_size"] for r in rows] == [i.statistics["written_size"] for i in infos]
    assert [r["full_size"] for r in rows] == [i.state_size for i in infos]
    assert rows[0]["durations_ms"]["metadata_publication"] > 0  # recorded by the next one
    assert rows[-1]["durations_ms"]["metadata_publication"] is None  # nothing after it yet
    assert all(r["durations_ms"]["batch"] > 0 and r["live_rows"] > 0 for r in rows)
    table = checkpoints("history", job)
    assert 0 == table.exit_code, table.output
    header = table.stdout.splitlines()[0].split()
    assert header == ["ID", "TIME", "POSITION", "WRITTEN", "SIZE", "FILES", "ROWS", "BATCH",
                      "WRITE", "PUBLISH", "FROM"]
    assert len(table.stdout.splitlines()) == 1 + len(infos)

    home = tmp_path / "dagster_home"
    home.mkdir()
    with dg.instance_for_test(temp_dir=str(home)) as instance:
        instance.report_runless_asset_event(dg.AssetMaterialization(
            "statistics", metadata={"checkpoint_id": 0, "bytes_written": 1234,
                                    "bytes_full": 5678, "files_new": 3, "files_reused": 1,
                                    "batch_ms": 42.0, "checkpoint_pointer": "gone/chk-0"}))
        instance.report_runless_asset_event(dg.AssetMaterialization(
            "statistics", metadata={"checkpoint_id": infos[0].checkpoint_id,
                                    "bytes_written": 1}))  # retained: the checkpoint's wins
        merged = checkpoints("history", job, "--dagster-asset", "statistics", "--json",
                             env={"DAGSTER_HOME": str(home)})
    assert 0 == merged.exit_code, merged.output
    first, *rest = json.loads(merged.stdout)
    assert rest == rows
    assert (first["source"], first["checkpoint_id"], first["written_size"], first["full_size"],
            first["files_new"], first["durations_ms"]["batch"]) == (
        "dagster event log", 0, 1234, 5678, 3, 42.0)
    unset = checkpoints("history", job, "--dagster-asset", "statistics", env={
        "DAGSTER_HOME": ""})
    assert 2 == unset.exit_code and "DAGSTER_HOME" in unset.stderr


@pytest.mark.timeout(240)
def test_stages_shows_kind_key_ttl_rows_key_groups_and_files(job):
    """``stages POINTER``: the keyed stage with its key, TTL, max parallelism, rows and a part
    per key group range whose files are its change files in shared/; the plain stage with
    its state files in chk-<id>/; JSON and table; a job directory means its latest."""
    newest = completed(job)[-1]
    stages = {s["stage"]: s for s in json.loads(checkpoints("stages", job, "--json").stdout)}
    assert stages.keys() == {"totals", "customers"}
    keyed, plain = stages["totals"], stages["customers"]
    assert (keyed["kind"], keyed["key"], keyed["max_parallelism"]) == ("keyed", ["customer"], 16)
    assert keyed["ttl"] == {"seconds": 30 * 86400.0, "time_characteristic": "processing_time",
                            "timestamp_column": None}
    assert keyed["timers"] is None  # no _timers column
    assert [f["name"] for f in keyed["schema"]] == ["customer", "orders", "total"]
    assert keyed["live_rows"] == 40 and keyed["expired_rows"] == 0
    groups = [p["key_groups"] for p in keyed["parts"]]
    assert groups[0][0] == 0 and groups[-1][1] == 15
    assert all(a[1] + 1 == b[0] for a, b in zip(groups, groups[1:], strict=False))
    roles = {f["role"] for p in keyed["parts"] for f in p["files"]}
    assert roles == {"change file"}
    assert all(f["path"].startswith("shared/") for p in keyed["parts"] for f in p["files"]
               if f["path"])
    assert (plain["kind"], plain["key"], plain["ttl"]) == ("plain", None, None)
    assert plain["live_rows"] == 40
    chk = newest.pointer.rstrip("/").rsplit("/", 1)[-1]
    assert all(f["path"] is None or f["path"].startswith(f"{chk}/")
               for p in plain["parts"] for f in p["files"])
    assert keyed["state_size"] + plain["state_size"] == newest.state_size

    table = checkpoints("stages", newest.pointer)
    assert 0 == table.exit_code, table.output
    lines = table.stdout.splitlines()
    assert lines[0] == f"stages of {newest.pointer}"
    assert lines[1].split()[:6] == ["STAGE", "KIND", "KEY", "TTL", "TIMERS", "MAX"]
    assert lines[2].split()[:3] == ["totals", "keyed", "customer"]
    assert "30d (processing_time)" in lines[2]
    assert any(line.split()[:2] == ["customers", "plain"] for line in lines[2:4])
    assert sum("change file" in line for line in lines) == sum(
        len(p["files"]) for p in keyed["parts"])
    missing = checkpoints("stages", job / "chk-999")
    assert 3 == missing.exit_code


@pytest.mark.timeout(240)
def test_the_spark_reader_gives_the_stages_view_as_rows(spark, job):
    """``format("checkpoint").option("view", "stages")``: one row per stage part, the same
    figures as ``checkpoints stages``; an unknown view is a clear error."""
    register_checkpoint_source(spark)
    newest = completed(job)[-1]
    expected = json.loads(checkpoints("stages", newest.pointer, "--json").stdout)
    frame = spark.read.format("checkpoint").option("view", "stages").load(newest.pointer)
    rows = [r.asDict() for r in frame.collect()]
    assert len(rows) == sum(len(s["parts"]) for s in expected)
    for stage in expected:
        mine = [r for r in rows if r["stage"] == stage["stage"]]
        assert {r["kind"] for r in mine} == {stage["kind"]}
        assert sum(r["live_rows"] for r in mine) == stage["live_rows"]
        assert sum(r["bytes"] for r in mine) == stage["state_size"]
    keyed = [r for r in rows if r["kind"] == "keyed"]
    assert {(r["key_group_first"], r["key_group_last"]) for r in keyed} == {
        tuple(p["key_groups"]) for p in expected[0]["parts"]}
    assert {r["ttl_seconds"] for r in keyed} == {30 * 86400.0}
    with pytest.raises(Exception, match='option "view"'):
        spark.read.format("checkpoint").option("view", "nope").load(newest.pointer).collect()
