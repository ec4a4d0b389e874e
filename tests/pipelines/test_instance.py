"""The project's Dagster instance: one run at a time per pipeline's concurrency pool."""

import dagster as dg
import pytest

from pipelines.definitions import defs
from pipelines.instance import (
    CONCURRENCY_YAML,
    DAGSTER_YAML,
    RUN_MONITORING_YAML,
    ensure_dagster_home,
    limit_pools,
)

PIPELINES = ("user_activity", "page_views")


@pytest.mark.parametrize("name", PIPELINES)
def test_every_step_that_writes_checkpoints_is_in_the_pipeline_pool(name):
    """The stateful asset, the savepoint op and the integrity check (a part of the stateful
    step, so it waits for a run that is writing) of a pipeline share its pool."""
    pool = f"checkpoints_{name}"

    pools = {
        job: defs.resolve_job_def(f"{name}_{job}").graph.pools
        for job in ("job", "savepoint_job", "integrity_job")
    }

    assert {"job": {pool}, "savepoint_job": {pool}, "integrity_job": {pool}} == pools


def test_pools_are_per_pipeline():
    """Two pipelines never share a pool, so their runs do not wait for each other."""
    assert len(PIPELINES) == len({f"checkpoints_{name}" for name in PIPELINES})
    names = {pool for job in defs.jobs for pool in defs.resolve_job_def(job.name).graph.pools}
    assert {f"checkpoints_{name}" for name in PIPELINES} == names


def test_instance_limits_each_pool_to_one_run(tmp_path, monkeypatch):
    """The instance scripts/run and scripts/ui prepare queues runs per pool: run granularity,
    a limit of 1 by default and stored for every pool of the code location."""
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    home = ensure_dagster_home()

    with dg.DagsterInstance.get() as instance:
        config = instance.get_concurrency_config().pool_config
        pools = limit_pools(instance, defs)
        limits = {p.name: p.limit for p in instance.event_log_storage.get_pool_limits()}

    assert DAGSTER_YAML == (home / "dagster.yaml").read_text()
    assert ("run", 1) == (config.pool_granularity.value, config.default_pool_limit)
    assert {pool: 1 for pool in pools} == limits


def test_an_existing_instance_gets_the_concurrency_and_run_monitoring_sections(
    tmp_path, monkeypatch
):
    """A dagster.yaml from before gains the concurrency and run monitoring sections, keeping
    what it had."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    monkeypatch.setenv("DAGSTER_HOME", str(home))

    ensure_dagster_home()
    ensure_dagster_home()

    expected = "telemetry:\n  enabled: false\n\n" + CONCURRENCY_YAML + "\n" + RUN_MONITORING_YAML
    assert expected == (home / "dagster.yaml").read_text()


def test_instance_monitors_runs(tmp_path, monkeypatch):
    """Run monitoring is on: a run stuck starting fails, a dead run is never resumed as it
    was (the recovery sensor continues it), and an ended run frees its pool slots."""
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    ensure_dagster_home()

    with dg.DagsterInstance.get() as instance:
        settings = instance.run_monitoring_settings
        assert instance.run_monitoring_enabled
        assert 0 == instance.run_monitoring_max_resume_run_attempts
    assert 180 == settings["start_timeout_seconds"]
    assert 15 == settings["free_slots_after_run_end_seconds"]
    assert 15 == settings["poll_interval_seconds"]
