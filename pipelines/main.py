"""The main job (the README's first command, through ``scripts/run``).

Lands the next few days of click events and materializes them through Dagster on the real
instance in ``DAGSTER_HOME`` (so the runs show in the UI later), continuing from the latest
completed checkpoint; then prints what it did and where everything is.

    python -m pipelines.main [--days N]
"""

import argparse
import datetime as dt
import os
import sys
import warnings
from pathlib import Path

import dagster as dg
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
)

from checkpoint_storage import list_checkpoints
from checkpoint_storage._filesystems import format_size
from pipelines.assets import DAILY_PARTITIONS, FIRST_PARTITION, PROJECT_ROOT
from pipelines.runner import SourcePosition, job_id_for

__all__ = ["ensure_dagster_home", "main", "next_partitions"]

DAGSTER_YAML = "telemetry:\n  enabled: false\n"
# The console shows INFO and up; every event is still in the instance (and the UI).
QUIET = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}


def ensure_dagster_home() -> Path:
    """``DAGSTER_HOME`` (default: the project's ``.dagster_home``), created with telemetry
    off. Without it every call would use a throw-away instance."""
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(PROJECT_ROOT / ".dagster_home")))
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists():
        config.write_text(DAGSTER_YAML)
    return home


def next_partitions(latest: SourcePosition | None, days: int, today: dt.date) -> list[str]:
    """The partitions to process next: from the one after the latest checkpoint's position
    (or the one it stopped inside), at most ``days`` of them, never today or later."""
    if latest is None:
        start = dt.date.fromisoformat(FIRST_PARTITION)
    elif latest.complete:
        start = dt.date.fromisoformat(latest.partition) + dt.timedelta(days=1)
    else:
        start = dt.date.fromisoformat(latest.partition)
    last = today - dt.timedelta(days=1)  # a daily partition exists once its day is over
    count = max(0, min(days, (last - start).days + 1))
    return [(start + dt.timedelta(days=i)).isoformat() for i in range(count)]


def _latest_position(checkpoint_storage) -> SourcePosition | None:
    storage = checkpoint_storage.checkpoint_storage()
    access = storage.create_checkpoint_storage(job_id_for("user_activity"))
    latest = access.latest_completed_checkpoint()
    return None if latest is None else SourcePosition.of(latest.load_metadata())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=3, help="days to process (default 3)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=dg.BetaWarning)
    home = ensure_dagster_home()

    from pipelines.definitions import checkpoint_integrity_job, daily_pipeline, defs

    resources = defs.resources
    checkpoint_storage = resources["checkpoint_storage"]
    latest = _latest_position(checkpoint_storage)
    partitions = next_partitions(latest, args.days, dt.datetime.now(dt.UTC).date())
    print(f"Dagster instance: {home}")
    print(
        f"Latest completed checkpoint: {latest or 'none'}; "
        f"next: {', '.join(partitions) or 'nothing (up to date)'}"
    )
    if partitions:
        assert DAILY_PARTITIONS.has_partition_key(partitions[-1])
        job = defs.resolve_job_def(daily_pipeline.name)
        with dg.DagsterInstance.get() as instance:
            result = job.execute_in_process(
                instance=instance,
                run_config=QUIET,
                tags={
                    ASSET_PARTITION_RANGE_START_TAG: partitions[0],
                    ASSET_PARTITION_RANGE_END_TAG: partitions[-1],
                },
            )
            _print_run(result)
            if not result.success:
                return 1
            check = defs.resolve_job_def(checkpoint_integrity_job.name).execute_in_process(
                instance=instance, run_config=QUIET
            )
            for evaluation in check.get_asset_check_evaluations():
                print(
                    f"Asset check {evaluation.check_name}: "
                    f"{'passed' if evaluation.passed else 'FAILED'}"
                )
    _print_storage(checkpoint_storage, resources["lake"], home)
    return 0


def _print_run(result) -> None:
    print(f"\nRun {result.run_id}: {'succeeded' if result.success else 'FAILED'}")
    for event in result.get_asset_materialization_events():
        materialization = event.event_specific_data.materialization
        if materialization.asset_key.to_user_string() != "user_activity":
            continue
        meta = {k: v.value for k, v in materialization.metadata.items()}
        print(
            f"  {materialization.partition}: checkpoint {meta['checkpoint_id']} "
            f"({meta['state_size']}, {meta['files_written']} files, "
            f"{meta['inline_states']} inline), {meta['batches_applied']} batches, "
            f"{meta['rows_input']} events in, {meta['duration_s']} s; "
            f"restored from {meta['restored_from']}"
        )


def _print_storage(checkpoint_storage, lake, home: Path) -> None:
    storage = checkpoint_storage.checkpoint_storage()
    job_directory = f"{storage.checkpoint_directory.rstrip('/')}/{job_id_for('user_activity')}"
    print(f"\nRetained checkpoints in {job_directory}:")
    try:
        found = list_checkpoints(job_directory, storage_options=storage.storage_options)
    except FileNotFoundError:
        found = []
    for info in found:
        size = format_size(info.state_size) if info.state_size is not None else "-"
        print(f"  chk-{info.checkpoint_id}  {info.status:<11} {size:>10}  {info.pointer}")
    print(f"Savepoints: {storage.savepoint_directory}")
    print(f"Input landing: {lake.landing_dir}\nDaily report: {lake.report_dir}")
    print(
        "\nOpen the Dagster UI on this instance:\n"
        f"  DAGSTER_HOME={home} .venv/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000\n"
        "Run this command again to continue from the latest completed checkpoint."
    )


if __name__ == "__main__":
    sys.exit(main())
