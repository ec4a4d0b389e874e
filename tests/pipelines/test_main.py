"""The main job's arguments, the partitions it picks and the commands its summary prints
(no Spark here, but for one session in a subprocess: the JVM options the job's submit
arguments leave; the runs themselves are in test_defs.py)."""

import datetime as dt
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from dagster_shared.error import SerializableErrorInfo

from pipelines import SourcePosition
from pipelines.main import (
    UNTIL_CONFIRM_ABOVE,
    backfill_command,
    confirm_until,
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


def _never_asked(question: str) -> str:
    raise AssertionError(f"asked {question!r}")


def test_until_far_ahead_asks_or_wants_yes_beyond_a_month(capsys):
    """Issue 29: --until years ahead picks every missing day up to yesterday (56 here); more
    than UNTIL_CONFIRM_ABOVE are processed only with --yes or a "y" at the prompt, and
    without a terminal the run exits with what to pass; it says that it stops at yesterday."""
    today = dt.date(2026, 11, 26)
    until = dt.date(2030, 1, 1)
    partitions = next_partitions(None, None, today, until)
    assert (56, "2026-10-01", "2026-11-25") == (len(partitions), partitions[0], partitions[-1])
    refused = confirm_until(partitions, until, today)
    assert refused == (
        "--until 2030-01-01 selects 56 partitions, 2026-10-01 to 2026-11-25 (more than 31): "
        "nothing processed. Pass --yes to process them all, or choose an earlier --until or "
        "--days N."
    )
    assert "--until 2030-01-01 is not over yet: processing up to yesterday, 2026-11-25" in (
        capsys.readouterr().out
    )
    asked = []
    assert None is confirm_until(partitions, until, today, answer=lambda q: asked.append(q) or "y")
    assert ["--until 2030-01-01 selects 56 partitions, 2026-10-01 to 2026-11-25. Process them "
            "all? [y/N] "] == asked  # fmt: skip
    assert refused == confirm_until(partitions, until, today, answer=lambda q: "")
    assert None is confirm_until(partitions, until, today, yes=True, answer=_never_asked)


def test_until_within_a_month_or_days_never_ask(capsys):
    """Up to UNTIL_CONFIRM_ABOVE partitions, and --days whatever its count, run without a
    question; a past --until says nothing more."""
    today = dt.date(2026, 11, 26)
    until = dt.date(2026, 10, UNTIL_CONFIRM_ABOVE)
    partitions = next_partitions(None, None, today, until)
    assert UNTIL_CONFIRM_ABOVE == len(partitions)
    assert None is confirm_until(partitions, until, today, answer=_never_asked)
    many = next_partitions(None, 50, today)
    assert None is confirm_until(many, None, today, answer=_never_asked)
    assert "" == capsys.readouterr().out


def test_yes_only_with_until(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--yes"])
    assert 2 == exit_.value.code
    assert "argument --yes: only with --until" in capsys.readouterr().err
    assert parse_args(["--until", "2026-10-05", "--yes"]).yes


@pytest.mark.timeout(300)
def test_main_refuses_months_of_partitions_without_a_terminal(tmp_path):
    """scripts/run --until 2099-12-31 without a terminal (stdin not a tty) and without
    --yes: exit 2 with the message before any run (the instance records none)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK", "SPARK_"))}
    env |= {"DAGSTER_HOME": str(tmp_path / "home"), "PIPELINE_DATA_DIR": str(tmp_path / "data")}
    done = subprocess.run(
        [sys.executable, "-m", "pipelines.main", "--until", "2099-12-31"],
        cwd=Path(__file__).resolve().parents[2], env=env, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert 2 == done.returncode, done.stdout + done.stderr
    assert "--until 2099-12-31 selects " in done.stderr
    assert "Pass --yes to process them all" in done.stderr
    assert "Run " not in done.stdout
    assert not list((tmp_path / "home").glob("storage/*/*"))  # no run's logs


def _main_child(tmp_path, code: str) -> subprocess.CompletedProcess:
    """``code`` in a new process with a fresh instance and data directory (nothing to
    process there: no Spark)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK", "SPARK_"))}
    env |= {"DAGSTER_HOME": str(tmp_path / "home"), "PIPELINE_DATA_DIR": str(tmp_path / "data")}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], env=env,
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_main_process_exits_with_its_heap_frozen(tmp_path):
    """``python -m pipelines.main`` freezes what it built before the interpreter's exit, so
    that the exit's collection does not walk the modules, definitions and run again (1-3 s
    after the last line before); the atexit handlers still run, last of all this one."""
    done = _main_child(tmp_path, (
        "import atexit, gc, runpy, sys\n"
        "atexit.register(lambda: print(f'AT EXIT {gc.get_freeze_count()} frozen, "
        "{len(gc.get_objects())} tracked', flush=True))\n"
        "sys.argv = ['pipelines.main', '--until', '2000-01-01']\n"
        "runpy.run_module('pipelines.main', run_name='__main__', alter_sys=True)\n"
    ))  # fmt: skip
    assert 0 == done.returncode, done.stdout + done.stderr
    assert "next: nothing (up to date)" in done.stdout
    frozen, tracked = (int(n) for n in re.findall(r"AT EXIT (\d+) frozen, (\d+) tracked",
                                                  done.stdout)[0])
    assert frozen > 100_000 and tracked < frozen / 20, done.stdout


@pytest.mark.timeout(300)
def test_main_freezes_the_heap_only_for_its_own_process(tmp_path):
    """``main(own_process=True)`` (the module run as a script) freezes what it imported and
    built before the run: the run's full collections no longer walk it; ``main()`` called
    in a longer-lived process (a test, a notebook) leaves that process's collector alone."""
    done = _main_child(tmp_path, (
        "import gc\n"
        "from pipelines.main import main\n"
        "assert 0 == main(['--until', '2000-01-01'])\n"
        "print('CALLED', gc.get_freeze_count(), flush=True)\n"
        "assert 0 == main(['--until', '2000-01-01'], own_process=True)\n"
        "print('OWN PROCESS', gc.get_freeze_count(), flush=True)\n"
    ))  # fmt: skip
    assert 0 == done.returncode, done.stdout + done.stderr
    assert "CALLED 0\n" in done.stdout
    assert int(re.findall(r"OWN PROCESS (\d+)", done.stdout)[0]) > 100_000


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
        "pipelines.StageError: pipeline p, stage s, partition d, batch 1 of 2 (id b0): "
        "ValueError: bad\n", [], "StageError", cause=worker)
    step = SerializableErrorInfo(
        'dagster._core.errors.DagsterExecutionStepExecutionError: Error occurred while '
        'executing op "p":\n', [], "DagsterExecutionStepExecutionError", cause=stage)

    assert ("StageError: pipeline p, stage s, partition d, batch 1 of 2 (id b0): ValueError: "
            "bad") == error_summary(step)


_SESSION_JVM_ARGUMENTS = """
import json
from pipelines.main import _quiet_spark
from resources import build_spark_session
_quiet_spark()
session = build_spark_session("local[1]", "quiet-console", {"spark.ui.enabled": "false"})
jvm = session.sparkContext._jvm
print(json.dumps(list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
                      .getInputArguments())))
session.stop()
"""


@pytest.mark.spark
@pytest.mark.timeout(180)
def test_the_quiet_spark_console_keeps_the_sessions_java_options():
    """The main job's submit arguments carry its console's log4j2 configuration and leave
    the session's own JVM options in place: a session built after them (in a process of its
    own: a JVM starts once) runs with both, the class archive's too when there is one."""
    from pipelines import class_archive
    from resources.spark import session_settings

    environment = {k: v for k, v in os.environ.items() if k != "PYSPARK_SUBMIT_ARGS"}
    done = subprocess.run([sys.executable, "-c", _SESSION_JVM_ARGUMENTS], env=environment,
                          capture_output=True, text=True, timeout=170, check=True)
    arguments = json.loads(done.stdout.strip().splitlines()[-1])
    assert [a for a in arguments if a.startswith("-Dlog4j2.configurationFile=file:")]
    wanted = session_settings("local[1]")["spark.driver.extraJavaOptions"].split()
    assert "-XX:TieredStopAtLevel=1" in wanted
    assert set(wanted) <= set(arguments), arguments
    assert set(class_archive.java_options().split()) <= set(arguments)
