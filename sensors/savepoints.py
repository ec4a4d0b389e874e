"""Savepoints on a schedule (and by hand): ``<pipeline>_savepoint_job`` and
``<pipeline>_savepoint_schedule``.

The job's one op restores the latest completed checkpoint (or ``restore_from``) on the
executors and writes it straight into a fresh ``savepoint-*`` directory through the savepoint
location's reference (``StatefulRunner.take_savepoint``, docs/design.md §4). It records an
``AssetObservation`` on the pipeline's state asset with the savepoint's pointer, size, the source
position it holds and the id of the checkpoint it was taken from, and the ``retained`` table
(every checkpoint and savepoint of the pipeline now), so every savepoint shows on the asset's
page in the UI.

Scheduled and hand-made savepoints are told apart by where they are: the schedule writes into
``<savepoint_dir>/scheduled`` (``SCHEDULED_SAVEPOINTS``), which the retention sensor may thin
out; the job launched by hand (UI, ``dagster job launch -j <pipeline>_savepoint_job``) and the
``checkpoints`` CLI write into ``<savepoint_dir>`` itself, which retention leaves alone unless
configured otherwise. The place survives outside Dagster (a run's tags do not), so retention
needs nothing but the storage to tell them apart; the runs carry a ``savepoint/kind`` tag too.

The schedule follows the pipeline's partitions unless told otherwise (``savepoint_cron``):
time-window partitions get a savepoint per partition, half a period (at most 3 hours) after
each partition closes, in the partitions' timezone (``savepoint_cron_for``: hourly at :30,
daily at 03:00, weekly on the partitions' day at 03:00, monthly on their day at 03:00, other
crons at each partition end), so every partition boundary gets a savepoint once its run had
time to finish. Static partitions have no period to follow: daily at 03:00 UTC
(``DEFAULT_SAVEPOINT_CRON``). An explicit ``cron_schedule`` or ``SAVEPOINT_CRON`` (UTC) wins;
when it fires less often than the partitions close, the schedule's description says so and a
warning is logged when it is defined. The schedule is idempotent per tick: its run key is the
scheduled time. It skips, with the reason, while there is no completed checkpoint.

No ``from __future__ import annotations``: Dagster reads the config parameters' annotations.
"""

import datetime as dt
import logging
import os

import dagster as dg

from checkpoint_storage.spi import format_size
from pipelines import StatefulPipeline, job_id_for
from pipelines.runner import SCHEDULED_SAVEPOINTS
from resources import CheckpointStorageResource, SparkResource
from sensors._assets import expired_rows_metadata, pool_for, runner_for
from sensors._retained import EVENT_KEY, SAVEPOINT_EVENT, retained_metadata

__all__ = [
    "DEFAULT_SAVEPOINT_CRON",
    "SAVEPOINT_KIND_TAG",
    "SavepointConfig",
    "build_savepoint_job",
    "build_savepoint_schedule",
    "coarser_than_partitions",
    "savepoint_cron_for",
    "savepoint_run_request",
    "savepoint_target",
]

logger = logging.getLogger(__name__)

DEFAULT_SAVEPOINT_CRON = "0 3 * * *"
SAVEPOINT_KIND_TAG = "savepoint/kind"
"""The tag of a savepoint job's runs: ``scheduled`` (the schedule's) or ``hand-made``."""
# How long after a partition closes its savepoint is taken (capped at half a period): time
# for the partition's run to finish, so the savepoint holds the partition's end.
SAVEPOINT_DELAY = dt.timedelta(hours=3)
# Coarser or not is judged by counting ticks over this many partition periods.
_COMPARED_PERIODS = 28
_PERIODS = {"HOURLY": dt.timedelta(hours=1), "DAILY": dt.timedelta(days=1),
            "WEEKLY": dt.timedelta(days=7), "MONTHLY": dt.timedelta(days=31)}  # fmt: skip


class SavepointConfig(dg.Config):
    """``scheduled``: write into ``<savepoint_dir>/scheduled`` (retention keeps the last K of
    those) instead of ``<savepoint_dir>`` (kept until disposed by hand). ``target_directory``
    overrides both. ``restore_from``: take the savepoint of that snapshot instead of the latest
    completed checkpoint."""

    scheduled: bool = False
    target_directory: str | None = None
    restore_from: str | None = None


def savepoint_target(checkpoint_storage: CheckpointStorageResource, config: SavepointConfig):
    """The directory the savepoint goes below (None: the storage's default directory)."""
    if config.target_directory:
        return config.target_directory
    if config.scheduled:
        if not checkpoint_storage.savepoint_dir:
            raise ValueError("scheduled savepoints need savepoint_dir in checkpoint_storage")
        return f"{checkpoint_storage.savepoint_dir.rstrip('/')}/{SCHEDULED_SAVEPOINTS}"
    return None


def _latest_checkpoint_pointer(
    pipeline: StatefulPipeline, checkpoint_storage: CheckpointStorageResource
) -> str | None:
    """Storage only (no Spark): the newest completed checkpoint of the pipeline, or None."""
    storage = checkpoint_storage.checkpoint_storage()
    access = storage.create_checkpoint_storage(job_id_for(pipeline.name))
    latest = access.latest_completed_checkpoint()
    return None if latest is None else latest.external_pointer


def build_savepoint_job(pipeline: StatefulPipeline) -> dg.JobDefinition:
    """``<pipeline>_savepoint_job``: one op that restores the latest completed checkpoint (or
    ``restore_from``) on the executors, writes it into a fresh savepoint directory and records
    it as an observation of the pipeline's state asset."""
    name = pipeline.name

    @dg.op(
        name=f"{name}_take_savepoint",
        description=f"Write a self-contained savepoint of the latest completed checkpoint of "
        f"{name} (executors write straight into the savepoint directory) and record it as an "
        f"observation of {name}.",
        pool=pool_for(pipeline),
    )
    def take_savepoint(
        context: dg.OpExecutionContext,
        config: SavepointConfig,
        spark: SparkResource,
        checkpoint_storage: CheckpointStorageResource,
    ) -> None:
        target = savepoint_target(checkpoint_storage, config)
        source = config.restore_from or _latest_checkpoint_pointer(pipeline, checkpoint_storage)
        if source is None:  # before any Spark work
            raise dg.Failure(
                f"no completed checkpoint of {name} in {checkpoint_storage.checkpoint_dir} to "
                f"take a savepoint of: materialize {name} first"
            )
        runner = runner_for(pipeline, spark, checkpoint_storage)
        summary = runner.take_savepoint(target, restore_from=config.restore_from)
        kind = "scheduled" if config.scheduled else "hand-made"
        context.log_event(
            dg.AssetObservation(
                name,
                # The UI's event list shows no label: the description says what this is first.
                description=f"Savepoint ({kind}) of {source}, at {summary.position}",
                metadata={
                    EVENT_KEY: SAVEPOINT_EVENT,
                    "savepoint_pointer": dg.MetadataValue.path(summary.pointer),
                    "savepoint_kind": kind,
                    "taken_from": dg.MetadataValue.path(source),
                    "checkpoint_id": summary.checkpoint_id,
                    "source_position": str(summary.position),
                    "source_partition": summary.position.partition,
                    "state_bytes": summary.state_bytes,
                    "state_size": format_size(summary.state_bytes),
                    "files_written": summary.files_written,
                    "inline_states": summary.inline_states,
                    **{f"state_rows_{stage}": n for stage, n in summary.state_rows.items()},
                    **expired_rows_metadata(summary),
                    **retained_metadata(runner.storage, name),
                },
            )
        )
        context.log.info(
            f"{kind} savepoint {summary.pointer} ({format_size(summary.state_bytes)}) holds the "
            f"state at {summary.position}, from checkpoint {summary.checkpoint_id}"
        )

    @dg.job(
        name=f"{name}_savepoint_job",
        description=f"Take a savepoint of {name}'s latest completed checkpoint. Launched by "
        "the savepoint schedule (into <savepoint_dir>/scheduled) or by hand (into "
        "<savepoint_dir>).",
        tags={SAVEPOINT_KIND_TAG: "hand-made"},
    )
    def savepoint_job():
        take_savepoint()

    return savepoint_job


def savepoint_run_request(
    pipeline: StatefulPipeline, scheduled_time: dt.datetime
) -> dg.RunRequest:
    """The run a tick at ``scheduled_time`` requests: one per scheduled time."""
    return dg.RunRequest(
        run_key=f"scheduled-savepoint-{scheduled_time.astimezone(dt.UTC).isoformat()}",
        run_config={
            "ops": {f"{pipeline.name}_take_savepoint": {"config": {"scheduled": True}}}
        },
        tags={SAVEPOINT_KIND_TAG: "scheduled"},
    )


def savepoint_cron_for(partitions: dg.PartitionsDefinition) -> tuple[str, str]:
    """The default savepoint cron and its timezone for a pipeline's ``partitions``: one
    savepoint per time-window partition, half a period (at most ``SAVEPOINT_DELAY``) after
    it closes; ``DEFAULT_SAVEPOINT_CRON`` in UTC for static partitions (no period)."""
    if not isinstance(partitions, dg.TimeWindowPartitionsDefinition):
        return DEFAULT_SAVEPOINT_CRON, "UTC"
    kind = partitions.schedule_type.name if partitions.schedule_type is not None else None
    if kind not in _PERIODS:  # another cron: at each partition end
        return partitions.cron_schedule, partitions.timezone
    delay = min(SAVEPOINT_DELAY, _PERIODS[kind] / 2) // dt.timedelta(minutes=1)
    if kind == "HOURLY":
        minute = (partitions.minute_offset + delay) % 60
        return partitions.get_cron_schedule(minute_of_hour=minute), partitions.timezone
    minutes = partitions.hour_offset * 60 + partitions.minute_offset + delay
    days, minutes = divmod(minutes, 24 * 60)  # past midnight: the day after
    day = {}
    if kind == "WEEKLY":
        day = {"day_of_week": ((partitions.day_offset or 0) + days) % 7}
    elif kind == "MONTHLY":  # Dagster's monthly offsets stop at day 28 as well
        day = {"day_of_month": min(28, (partitions.day_offset or 1) + days)}
    cron = partitions.get_cron_schedule(
        minute_of_hour=minutes % 60, hour_of_day=minutes // 60, **day
    )
    return cron, partitions.timezone


def _ticks(cron: str, timezone: str, start: dt.datetime, end: dt.datetime) -> int:
    """How many times ``cron`` fires (complete periods) between ``start`` and ``end``."""
    windows = dg.TimeWindowPartitionsDefinition(
        start=start, end=end, cron_schedule=cron, fmt="%Y-%m-%d-%H:%M", timezone=timezone
    )
    return len(windows.get_partition_keys())


def coarser_than_partitions(
    cron: str, timezone: str, partitions: dg.PartitionsDefinition
) -> bool:
    """Whether ``cron`` fires less often than ``partitions`` close (static: never)."""
    if not isinstance(partitions, dg.TimeWindowPartitionsDefinition):
        return False
    kind = partitions.schedule_type.name if partitions.schedule_type is not None else None
    start = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)  # a Monday: weeks and months align
    end = start + _PERIODS.get(kind, dt.timedelta(days=1)) * _COMPARED_PERIODS
    closed = _ticks(partitions.cron_schedule, partitions.timezone, start, end)
    # One tick of slack: a cron offset from the partitions' own loses the window's last one.
    return _ticks(cron, timezone, start, end) < closed - 1


_warned: set[tuple[str, str]] = set()


def build_savepoint_schedule(
    pipeline: StatefulPipeline,
    job: dg.JobDefinition,
    cron_schedule: str | None = None,
    default_status: dg.DefaultScheduleStatus = dg.DefaultScheduleStatus.RUNNING,
) -> dg.ScheduleDefinition:
    """``<pipeline>_savepoint_schedule`` on ``cron_schedule`` or ``SAVEPOINT_CRON`` (UTC),
    else the pipeline's partitions' (``savepoint_cron_for``). An explicit cron coarser than
    the partitions is kept, described as such and logged once."""
    name = pipeline.name
    explicit = cron_schedule or os.environ.get("SAVEPOINT_CRON")
    if explicit:
        cron, timezone = explicit, "UTC"
        origin = "explicit" if cron_schedule else "SAVEPOINT_CRON"
    else:
        cron, timezone = savepoint_cron_for(pipeline.partitions_def)
        origin = (
            "static partitions: a fixed default"
            if not isinstance(pipeline.partitions_def, dg.TimeWindowPartitionsDefinition)
            else "one per partition, after it closes"
        )
    description = (
        f"Take a savepoint of {name} into <savepoint_dir>/scheduled on '{cron}' ({timezone}; "
        f"{origin}). Skips while there is no completed checkpoint."
    )
    if explicit and coarser_than_partitions(cron, timezone, pipeline.partitions_def):
        coarser = (
            f"'{cron}' ({origin}) is coarser than {name}'s partitions "
            f"('{pipeline.partitions_def.cron_schedule}'): not every partition boundary gets a "
            "savepoint"
        )
        description += f" Note: {coarser}."
        if (name, cron) not in _warned:  # the code location may be built more than once
            _warned.add((name, cron))
            logger.warning("savepoint schedule of %s: %s", name, coarser)

    @dg.schedule(
        name=f"{name}_savepoint_schedule",
        job=job,
        cron_schedule=cron,
        execution_timezone=timezone,
        default_status=default_status,
        description=description,
    )
    def savepoint_schedule(
        context: dg.ScheduleEvaluationContext, checkpoint_storage: CheckpointStorageResource
    ):
        if _latest_checkpoint_pointer(pipeline, checkpoint_storage) is None:
            return dg.SkipReason(
                f"no completed checkpoint of {name} in {checkpoint_storage.checkpoint_dir} "
                "yet: nothing to take a savepoint of"
            )
        scheduled = context.scheduled_execution_time or dt.datetime.now(dt.UTC)
        return savepoint_run_request(pipeline, scheduled)

    return savepoint_schedule
