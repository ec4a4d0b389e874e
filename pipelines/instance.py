"""The project's Dagster instance (``DAGSTER_HOME``, default ``.dagster_home`` under the
project), as ``scripts/run`` and ``scripts/ui`` set it up:

- telemetry off;
- run-level concurrency pools with a limit of 1: every step that writes a pipeline's
  checkpoints (its stateful asset, its savepoint job) is in the pool ``checkpoints_<name>``
  (``sensors.pool_for``), so a second run of the same pipeline waits in the run queue
  instead of racing the first for the job directory. Runs of different pipelines still run
  side by side;
- run monitoring (``RUN_MONITORING_YAML``), so that no run stays in progress, nor keeps its
  pipeline's pool, after its worker is gone: a run stuck starting fails after
  ``start_timeout_seconds`` (180 s), a dead or cancelled run's pool slots are freed
  ``free_slots_after_run_end_seconds`` (15 s) after it ended, checked every
  ``poll_interval_seconds`` (15 s), and a dead run is never resumed as it was
  (``max_resume_run_attempts: 0``): the recovery sensor recovers it from its last checkpoint.
  A run worker killed while its code server lives (SIGKILL, OOM) is failed by that code
  server within a second.

``python -m pipelines.instance`` prepares the instance and prints its directory.
"""

import os
import sys
from pathlib import Path

import dagster as dg

__all__ = [
    "CONCURRENCY_YAML",
    "DAGSTER_YAML",
    "RUN_MONITORING_YAML",
    "ensure_dagster_home",
    "limit_pools",
]

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY_YAML = """concurrency:
  pools:
    # One run at a time per pool: a pipeline's runs queue behind each other.
    default_limit: 1
    # Checked when a run leaves the queue, so a blocked run stays QUEUED (visible in the UI).
    granularity: run
"""
RUN_MONITORING_YAML = """run_monitoring:
  enabled: true
  # A run that does not reach STARTED within this time (its worker never came up) fails.
  start_timeout_seconds: 180
  cancel_timeout_seconds: 180
  # Never resume a dead run as it was: the recovery sensor continues it from its checkpoint.
  max_resume_run_attempts: 0
  poll_interval_seconds: 15
  # A run that ended (failed, killed, cancelled) gives its pool slots back after this time,
  # so the runs queued behind it start.
  free_slots_after_run_end_seconds: 15
"""
DAGSTER_YAML = "telemetry:\n  enabled: false\n" + CONCURRENCY_YAML + RUN_MONITORING_YAML


def ensure_dagster_home() -> Path:
    """``DAGSTER_HOME`` (default: the project's ``.dagster_home``) with the configuration
    above; an existing ``dagster.yaml`` without a ``concurrency`` or ``run_monitoring``
    section gets one."""
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(PROJECT_ROOT / ".dagster_home")))
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists():
        config.write_text(DAGSTER_YAML)
    else:
        text = config.read_text()
        for key, section in (
            ("concurrency:", CONCURRENCY_YAML),
            ("run_monitoring:", RUN_MONITORING_YAML),
        ):
            if key not in text:
                with config.open("a") as f:
                    f.write("\n" + section)
    return home


def limit_pools(instance: dg.DagsterInstance, defs: dg.Definitions, limit: int = 1) -> list[str]:
    """Store ``limit`` for every pool the definitions' jobs use. The default limit alone is
    stored only once the daemon first sees a queued run of a pool, so the very first two runs
    could both start: setting the limits up front closes that window."""
    jobs = [defs.resolve_job_def(job.name) for job in defs.jobs]
    pools = sorted({pool for job in jobs for pool in job.graph.pools})
    for pool in pools:
        instance.event_log_storage.set_concurrency_slots(pool, limit)
    return pools


def main() -> int:
    home = ensure_dagster_home()
    from pipelines.definitions import defs

    with dg.DagsterInstance.get() as instance:
        pools = limit_pools(instance, defs)
    print(f"{home} (pools limited to 1 run: {', '.join(pools)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
