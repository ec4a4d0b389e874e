"""The project's Dagster instance (``DAGSTER_HOME``, default ``.dagster_home`` under the
project), as ``scripts/run`` and ``scripts/ui`` set it up:

- telemetry off;
- run-level concurrency pools with a limit of 1: every step that writes a pipeline's
  checkpoints (its stateful asset, its savepoint job) is in the pool ``checkpoints_<name>``
  (``sensors.pool_for``), so a second run of the same pipeline waits in the run queue
  instead of racing the first for the job directory. Runs of different pipelines still run
  side by side.

``python -m pipelines.instance`` prepares the instance and prints its directory.
"""

import os
import sys
from pathlib import Path

import dagster as dg

__all__ = ["DAGSTER_YAML", "CONCURRENCY_YAML", "ensure_dagster_home", "limit_pools"]

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY_YAML = """concurrency:
  pools:
    # One run at a time per pool: a pipeline's runs queue behind each other.
    default_limit: 1
    # Checked when a run leaves the queue, so a blocked run stays QUEUED (visible in the UI).
    granularity: run
"""
DAGSTER_YAML = "telemetry:\n  enabled: false\n" + CONCURRENCY_YAML


def ensure_dagster_home() -> Path:
    """``DAGSTER_HOME`` (default: the project's ``.dagster_home``) with the configuration
    above; an existing ``dagster.yaml`` without a ``concurrency`` section gets one."""
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(PROJECT_ROOT / ".dagster_home")))
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists():
        config.write_text(DAGSTER_YAML)
    elif "concurrency:" not in config.read_text():
        with config.open("a") as f:
            f.write("\n" + CONCURRENCY_YAML)
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
