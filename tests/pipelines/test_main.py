"""The main job's arguments, the partitions it picks and the commands its summary prints
(no Spark here: the runs themselves are in test_defs.py)."""

import datetime as dt
import shlex
from pathlib import Path

import pytest
from dagster_shared.error import SerializableErrorInfo

from pipelines import SourcePosition
from pipelines.main import (
    backfill_command,
    error_summary,
    next_partitions,
    parse_args,
    print_retained,
)
from sensors import RetainedSnapshot

TODAY = dt.date(2026, 10, 11)
HOME = Path("/srv/dagster home")
SELECTION = ["click_events", "user_activity", "user_activity_daily_report"]


def snapshot(kind: str, checkpoint_id: int, position: SourcePosition, pointer: str):
    written = dt.datetime(2026, 10, 11, 8, tzinfo=dt.UTC)
    return RetainedSnapshot(
        checkpoint_id, kind, "completed", position, 2048, 2, written, pointer
    )


def end_of(day: str) -> SourcePosition:
    return SourcePosition(day, 4, True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--days", "0"], "argument --days: must be 1 or more, got 0"),
        (["--days", "-2"], "argument --days: must be 1 or more, got -2"),
        (["--until", "2026-13-01"], "argument --until: not a date (YYYY-MM-DD): '2026-13-01'"),
        (["--days", "2", "--until", "2026-10-05"], "argument --until: not allowed with argument"),
    ],
)
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    """--days below 1, a malformed --until, or both at once: exit 2 with the reason."""
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert 2 == exit_.value.code
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("latest", "until", "expected"),
    [
        (None, "2026-10-03", ["2026-10-01", "2026-10-02", "2026-10-03"]),
        (end_of("2026-10-01"), "2026-10-05", [f"2026-10-0{d}" for d in (2, 3, 4, 5)]),
        (SourcePosition("2026-10-02", 1, False), "2026-10-03", ["2026-10-02", "2026-10-03"]),
        (end_of("2026-10-08"), "2026-10-30", ["2026-10-09", "2026-10-10"]),
        (end_of("2026-10-05"), "2026-10-05", []),
    ],
)
def test_until_processes_every_missing_partition_up_to_the_day(latest, until, expected):
    """--until: every partition after the latest position up to and including the day,
    however many, but never today or later."""
    days = None  # --until and --days exclude each other
    assert expected == next_partitions(latest, days, TODAY, dt.date.fromisoformat(until))


def test_until_is_parsed_as_a_day():
    """--until YYYY-MM-DD is a date, and --days keeps its default only without it."""
    args = parse_args(["--until", "2026-10-05"])
    assert (dt.date(2026, 10, 5), 3) == (args.until, args.days)


def test_backfill_command_restores_the_newest_savepoint_with_dates_that_fit():
    """With a savepoint at the end of 10-03 and checkpoints up to the end of 10-06, the
    command backfills 10-04..10-06 from that savepoint, every asset of the pipeline
    selected."""
    savepoint = "/data/savepoints/scheduled/savepoint-2b2376-0123456789ab"
    snapshots = [
        snapshot("checkpoint", 9, end_of("2026-10-05"), "/data/cp/j/chk-9"),
        snapshot("checkpoint", 11, end_of("2026-10-06"), "/data/cp/j/chk-11"),
        snapshot("scheduled savepoint", 6, end_of("2026-10-03"), savepoint),
    ]
    command = shlex.split(backfill_command(snapshots, HOME, "user_activity", SELECTION))
    expected = [
        "DAGSTER_HOME=/srv/dagster home", ".venv/bin/dagster", "asset", "materialize",
        "-m", "pipelines.definitions",
        "--select", "click_events,user_activity,user_activity_daily_report",
        "--partition-range", "2026-10-04...2026-10-06",
        "--config-json",
        '{"ops": {"user_activity": {"config": {"restore_from": "' + savepoint + '"}}}}',
    ]  # fmt: skip
    assert expected == command


def test_backfill_command_without_savepoints_uses_the_oldest_retained_checkpoint():
    """Without savepoints: the oldest retained checkpoint at the end of a day, and the days
    after it up to the last one processed (the incomplete 10-06 is not a day to redo)."""
    snapshots = [
        snapshot("checkpoint", 3, SourcePosition("2026-10-04", 2, False), "/cp/chk-3"),
        snapshot("checkpoint", 4, end_of("2026-10-04"), "/cp/chk-4"),
        snapshot("checkpoint", 6, end_of("2026-10-05"), "/cp/chk-6"),
        snapshot("checkpoint", 7, SourcePosition("2026-10-06", 2, False), "/cp/chk-7"),
    ]
    command = backfill_command(snapshots, HOME, "user_activity", SELECTION)
    assert "--partition-range 2026-10-05...2026-10-05" in command
    assert '"restore_from": "/cp/chk-4"' in command


def test_no_backfill_command_when_no_snapshot_leaves_a_day_to_redo():
    """Only the end of the last day processed is retained: no command (None)."""
    snapshots = [snapshot("checkpoint", 2, end_of("2026-10-01"), "/cp/chk-2")]
    assert backfill_command(snapshots, HOME, "user_activity", SELECTION) is None


def test_retained_lines_show_kind_id_position_size_age_and_pointer(capsys):
    """One line per snapshot with its decoded position."""
    snapshots = [
        snapshot("checkpoint", 3, SourcePosition("2026-10-04", 2, False), "/cp/chk-3"),
        snapshot("savepoint", 4, end_of("2026-10-04"), "/sp/savepoint-2b2376-0123456789ab"),
    ]
    print_retained(snapshots, dt.datetime(2026, 10, 11, 10, tzinfo=dt.UTC))
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [
        ["checkpoint", "3", "2026-10-04", "after", "batch", "2", "2.0", "KiB", "2", "files",
         "2", "h", "ago", "/cp/chk-3"],
        ["savepoint", "4", "end", "of", "2026-10-04", "2.0", "KiB", "2", "files", "2", "h",
         "ago", "/sp/savepoint-2b2376-0123456789ab"],
    ] == lines  # fmt: skip


def test_a_failure_is_summarised_as_the_users_error_in_one_line():
    """Below Dagster's wrapper, the first line of the error the pipeline raised (a
    StageError), its class without the module path; the worker's traceback is left out."""
    worker = SerializableErrorInfo(
        "pyspark.errors.exceptions.captured.PythonException: An exception was thrown from the "
        "Python worker:\nTraceback (most recent call last):\n  File \"s.py\", line 3\n"
        "ValueError: bad\n", [], "PythonException")
    stage = SerializableErrorInfo(
        "pipelines.runner.StageError: pipeline p, stage s, partition d, batch 1 of 2 (id b0): "
        "ValueError: bad\n", [], "StageError", cause=worker)
    step = SerializableErrorInfo(
        'dagster._core.errors.DagsterExecutionStepExecutionError: Error occurred while '
        'executing op "p":\n', [], "DagsterExecutionStepExecutionError", cause=stage)

    assert ("StageError: pipeline p, stage s, partition d, batch 1 of 2 (id b0): ValueError: "
            "bad") == error_summary(step)
