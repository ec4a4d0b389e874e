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

from checkpoint_storage import format_size, list_checkpoints
from pipelines import SourcePosition, job_id_for
from pipelines.definitions import data_directory
from pipelines.examples.click_events import DAILY_PARTITIONS, FIRST_PARTITION, NAME
from pipelines.instance import ensure_dagster_home, limit_pools

__all__ = ["main", "next_partitions"]

# The console shows INFO and up; every event is still in the instance (and the UI).
QUIET = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}


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
    access = storage.create_checkpoint_storage(job_id_for(NAME))
    latest = access.latest_completed_checkpoint()
    return None if latest is None else SourcePosition.of(latest.load_metadata())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=3, help="days to process (default 3)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=dg.BetaWarning)
    home = ensure_dagster_home()

    from pipelines.definitions import defs

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
        job = defs.resolve_job_def(f"{NAME}_job")
        with dg.DagsterInstance.get() as instance:
            limit_pools(instance, defs)
            result = job.execute_in_process(
                instance=instance,
                run_config=QUIET,
                tags={
                    "dagster/asset_partition_range_start": partitions[0],
                    "dagster/asset_partition_range_end": partitions[-1],
                },
            )
            _print_run(result)
            if not result.success:
                return 1
            check = defs.resolve_job_def(f"{NAME}_integrity_job").execute_in_process(
                instance=instance, run_config=QUIET
            )
            for evaluation in check.get_asset_check_evaluations():
                print(
                    f"Asset check {evaluation.check_name}: "
                    f"{'passed' if evaluation.passed else 'FAILED'}"
                )
    _print_storage(checkpoint_storage, home)
    return 0


def _print_run(result) -> None:
    print(f"\nRun {result.run_id}: {'succeeded' if result.success else 'FAILED'}")
    for event in result.get_asset_materialization_events():
        materialization = event.event_specific_data.materialization
        if materialization.asset_key.to_user_string() != NAME:
            continue
        meta = {k: v.value for k, v in materialization.metadata.items()}
        print(
            f"  {materialization.partition}: checkpoint {meta['checkpoint_id']} "
            f"({meta['state_size']}, {meta['files_written']} files, "
            f"{meta['inline_states']} inline), {meta['batches_applied']} batches, "
            f"{meta['rows_source']} events in, {meta['duration_s']} s; "
            f"restored from {meta['restored_from']}"
        )


def _print_storage(checkpoint_storage, home: Path) -> None:
    storage = checkpoint_storage.checkpoint_storage()
    job_directory = f"{storage.checkpoint_directory.rstrip('/')}/{job_id_for(NAME)}"
    print(f"\nRetained checkpoints in {job_directory}:")
    try:
        found = list_checkpoints(job_directory, storage_options=storage.storage_options)
    except FileNotFoundError:
        found = []
    for info in found:
        size = format_size(info.state_size) if info.state_size is not None else "-"
        print(f"  chk-{info.checkpoint_id}  {info.status:<11} {size:>10}  {info.pointer}")
    print(f"Savepoints: {storage.savepoint_directory}")
    data = data_directory()
    landing = os.environ.get("LANDING_DIR", str(data / "landing"))
    reports = os.environ.get("REPORT_DIR", str(data / "reports"))
    print(f"Input landing: {landing}\nDaily report: {reports}")
    print(
        "\nOpen the Dagster UI on this instance:\n"
        f"  DAGSTER_HOME={home} .venv/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000\n"
        "Run this command again to continue from the latest completed checkpoint."
    )


if __name__ == "__main__":
    sys.exit(main())
