"""The main job (the README's first command, through ``scripts/run``).

Lands the next days of click events and materializes them through Dagster on the real
instance in ``DAGSTER_HOME`` (so the runs show in the UI later), continuing from the latest
completed checkpoint, with a line per partition, batch and checkpoint as it goes; then prints
the check's result, what is retained (checkpoints and savepoints with their positions), the
commands that read the state and backfill from it, and where everything is.

    python -m pipelines.main [--days N | --until YYYY-MM-DD [--yes]]
"""

import argparse
import contextlib
import datetime as dt
import gc
import json
import logging
import os
import re
import shlex
import signal
import sys
import threading
import uuid
import warnings
from pathlib import Path

import dagster as dg

from checkpoint_storage.spi import format_age, format_size
from pipelines import SourcePosition, job_id_for
from pipelines.examples.click_events import FIRST_PARTITION, NAME, STAGES
from sensors import INTERRUPTED_TAG, RetainedSnapshot, retained_snapshots

__all__ = [
    "UNTIL_CONFIRM_ABOVE",
    "backfill_command",
    "confirm_until",
    "error_summary",
    "main",
    "next_partitions",
    "parse_args",
    "print_retained",
    "settle_heap",
]

DEFAULT_DAYS = 3
# ``--until`` picks every missing day up to it: beyond a month of partitions (hours of Spark
# work, and likely a mistyped year) the run asks first, or wants --yes.
UNTIL_CONFIRM_ABOVE = 31
# Spark's own console: errors only, without the banner of its default logging profile.
SPARK_LOG_CONFIG = Path(__file__).with_name("log4j2-console.properties")


def silence_library_warnings() -> None:
    """Warnings addressed to whoever writes Dagster code (beta, preview and superseded APIs)
    and the libraries' deprecation notices: not the concern of someone running the job."""
    for category in (dg.BetaWarning, dg.PreviewWarning, dg.SupersessionWarning):
        warnings.filterwarnings("ignore", category=category)
    for category in (DeprecationWarning, FutureWarning, UserWarning):
        warnings.filterwarnings(
            "ignore", category=category, module=r"(dagster|dagster_shared|pyspark|pyarrow|py4j)"
        )


def _day(value: str) -> dt.date:
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date (YYYY-MM-DD): {value!r}") from None


def _positive(value: str) -> int:
    try:
        days = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of days: {value!r}") from None
    if days < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {days}")
    return days


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/run",
        description="Process the next partitions of the click events through Dagster, "
        "continuing from the latest completed checkpoint.",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--days",
        type=_positive,
        default=DEFAULT_DAYS,
        help=f"process at most this many partitions (default {DEFAULT_DAYS})",
    )
    which.add_argument(
        "--until",
        type=_day,
        metavar="YYYY-MM-DD",
        help="process every partition not processed yet up to and including this day "
        "(never today or later: a day is complete once it is over); more than "
        f"{UNTIL_CONFIRM_ABOVE} partitions are processed only once confirmed, or with --yes",
    )
    parser.add_argument(
        "--yes",
        action="store_true",
        help=f"with --until: process more than {UNTIL_CONFIRM_ABOVE} partitions without asking",
    )
    parser.add_argument(
        "--allow-non-restored-state",
        action="store_true",
        help="continue from a checkpoint that holds the state of stages the pipeline no "
        "longer has (removed in an upgrade), leaving that state behind; without it the run "
        "is refused, naming them",
    )
    args = parser.parse_args(argv)
    if args.yes and args.until is None:
        parser.error("argument --yes: only with --until")
    return args


def confirm_until(
    partitions: list[str], until: dt.date | None, today: dt.date, yes: bool = False,
    answer=None,
) -> str | None:
    """None when the run may process ``partitions``; else why not (the message to exit with).
    ``--until`` today or later says that it stops at yesterday; more than
    ``UNTIL_CONFIRM_ABOVE`` partitions need ``yes`` or an answer ``y`` from ``answer`` (a
    function that asks, None when nobody can be asked: no terminal)."""
    if until is None:
        return None
    yesterday = today - dt.timedelta(days=1)
    if until > yesterday:
        print(f"--until {until} is not over yet: processing up to yesterday, {yesterday} "
              "(a day's partition exists once the day is over)", flush=True)  # fmt: skip
    if len(partitions) <= UNTIL_CONFIRM_ABOVE or yes:
        return None
    what = f"{len(partitions)} partitions, {partitions[0]} to {partitions[-1]}"
    if answer is not None:
        reply = answer(f"--until {until} selects {what}. Process them all? [y/N] ")
        if reply.strip().lower() in ("y", "yes"):
            return None
    return (
        f"--until {until} selects {what} (more than {UNTIL_CONFIRM_ABOVE}): nothing processed. "
        "Pass --yes to process them all, or choose an earlier --until or --days N."
    )


def next_partitions(
    latest,
    days: int | None,
    today: dt.date,
    until: dt.date | None = None,
    first: str = FIRST_PARTITION,
) -> list[str]:
    """The partitions to process next: from the one after ``latest`` (a ``SourcePosition``;
    the one it stopped inside when incomplete; ``first`` without one), ``days`` of them or
    every one up to and including ``until``, never today or later."""
    if latest is None:
        start = dt.date.fromisoformat(first)
    elif latest.complete:
        start = dt.date.fromisoformat(latest.partition) + dt.timedelta(days=1)
    else:
        start = dt.date.fromisoformat(latest.partition)
    last = today - dt.timedelta(days=1)  # a daily partition exists once its day is over
    if until is not None:
        last = min(last, until)
    count = (last - start).days + 1
    if days is not None:
        count = min(days, count)
    return [(start + dt.timedelta(days=i)).isoformat() for i in range(max(0, count))]


def backfill_command(
    snapshots: list[RetainedSnapshot], home: Path, name: str, selection: list[str]
) -> str | None:
    """The ``dagster asset materialize`` command that backfills ``selection`` (the assets of
    pipeline ``name`` and its deps) from a retained snapshot with dates that fit it: from the
    newest savepoint (else the oldest retained checkpoint) at the end of a day before the
    last processed one, the days after it up to the last processed one. None when no
    snapshot leaves a day to backfill."""
    completed = [s for s in snapshots if s.status == "completed" and s.position is not None]
    done = [s.position for s in completed if s.position.complete]
    if not done:
        return None
    last_done = max(p.partition for p in done)
    savepoints = [s for s in completed if "savepoint" in s.kind]
    checkpoints = [s for s in completed if "savepoint" not in s.kind]
    for snapshot in [*reversed(savepoints), *checkpoints]:
        position = snapshot.position
        if position.complete and position.partition < last_done:
            begin = dt.date.fromisoformat(position.partition) + dt.timedelta(days=1)
            config = {"ops": {name: {"config": {"restore_from": snapshot.pointer}}}}
            return (
                f"DAGSTER_HOME={shlex.quote(str(home))} .venv/bin/dagster asset materialize "
                f"-m pipelines.definitions --select {','.join(selection)} "
                f"--partition-range {begin.isoformat()}...{last_done} "
                f"--config-json {shlex.quote(json.dumps(config))}"
            )
    return None


# --- the console -------------------------------------------------------------------------


def error_summary(error) -> str:
    """One line for a Dagster error (a ``SerializableErrorInfo``): the first line of the
    error user code raised, below Dagster's own wrappers (e.g. a ``StageError``: pipeline,
    stage, partition, batch and the original error), without its module path; the stack
    traces stay in the run's event log."""
    while error.cause is not None and error.cls_name.startswith("Dagster"):
        error = error.cause
    lines = [line for line in error.message.strip().splitlines() if line.strip()]
    first = lines[0] if lines else error.cls_name
    qualified, separator, rest = first.partition(": ")
    if separator and qualified.endswith(error.cls_name):
        return f"{error.cls_name}: {rest}"
    return first


class Interrupt:
    """Ctrl-C during a run (``stop_spark_on_interrupt``): whether it came, and how far the run
    had got, from the progress lines it printed."""

    _TO_APPLY = re.compile(r"(\S+): (\d+) of (\d+) batches to apply")
    _BATCH = re.compile(r"(\S+): batch (\d+) of (\d+) ")

    def __init__(self, instance: dg.DagsterInstance | None = None,
                 run_id: str | None = None) -> None:
        self.requested = threading.Event()
        self.partition: str | None = None
        self.applied = 0  # batches of ``partition`` in the state
        self.session = None
        self.instance, self.run_id = instance, run_id  # the run to tag as stopped by its user

    def note(self, message: str) -> None:
        if match := self._TO_APPLY.match(message):
            self.partition = match[1]
            self.applied = int(match[3]) - int(match[2])
        elif match := self._BATCH.match(message):
            self.partition, self.applied = match[1], int(match[2])

    def line(self, name: str, latest) -> str:
        """The one line that reports the interrupted run; ``latest``: the newest completed
        checkpoint (``CompletedCheckpointStorageLocation``) or None."""
        where = (
            f"{self.partition} at batch {self.applied + 1}" if self.partition
            else "before its first batch"
        )  # fmt: skip
        state = (
            "is empty (no completed checkpoint)" if latest is None
            else f"is at {latest.external_pointer} "
            f"({SourcePosition.of(latest.load_metadata())})"
        )  # fmt: skip
        return (
            f"interrupted: {name} {where}; the state {state}; run scripts/run again to continue"
        )


_interrupt: Interrupt | None = None  # the run in progress, for the progress logger


@contextlib.contextmanager
def stop_spark_on_interrupt(interrupt: Interrupt):
    """Ctrl-C while the block runs cancels its Spark jobs instead of raising
    KeyboardInterrupt: a KeyboardInterrupt raised in the middle of a py4j call (pyspark's own
    SIGINT handler raises one) breaks the gateway connection and every later call fails with
    py4j and Java traces. SIGINT is blocked in this thread (and the threads it starts) and
    taken by a watcher thread, which silences Spark's log and cancels its jobs until the block
    ends: the run fails at its next Spark job, its lease is released, and the block returns
    with ``interrupt.requested`` set. A second Ctrl-C exits at once (130)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from resources import on_session_created

    on_session_created(lambda session: setattr(interrupt, "session", session))
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    finished = threading.Event()

    def watch() -> None:
        while not finished.is_set():
            if signal.sigtimedwait({signal.SIGINT}, 0.2) is not None:
                break
        else:
            return
        interrupt.requested.set()
        if interrupt.instance is not None and interrupt.run_id is not None:
            # before the run fails: the recovery sensor must never relaunch what the user
            # stopped
            with contextlib.suppress(Exception):
                interrupt.instance.add_run_tags(interrupt.run_id, {INTERRUPTED_TAG: "Ctrl-C"})
        quiet = False
        while not finished.is_set():
            session = interrupt.session
            if session is not None:
                with contextlib.suppress(Exception):  # the session may be stopping
                    if not quiet:
                        session.sparkContext.setLogLevel("OFF")
                        quiet = True
                    session.sparkContext.cancelAllJobs()  # also jobs started meanwhile
            if signal.sigtimedwait({signal.SIGINT}, 0.5) is not None:
                print("interrupted again: exiting at once", flush=True)
                os._exit(130)

    watcher = threading.Thread(target=watch, name="interrupt-watcher", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        finished.set()
        watcher.join()
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _ProgressFormatter(logging.Formatter):
    """``HH:MM:SS  message``: the message as the step logged it, without Dagster's job, run
    id and step prefix; warnings keep Dagster's full text, a failure is one line (Dagster's
    message and the error's ``error_summary``: its traces are in the run's event log)."""

    def format(self, record: logging.LogRecord) -> str:
        meta = getattr(record, "dagster_meta", None) or {}
        message = record.getMessage()
        if record.levelno < logging.WARNING and meta.get("orig_message"):
            message = meta["orig_message"]
        event = meta.get("dagster_event")
        error = getattr(getattr(event, "event_specific_data", None), "error", None)
        if getattr(event, "event_type_value", None) == "RUN_FAILURE" and getattr(
                error, "cls_name", None) == "DagsterExecutionStepExecutionError":
            error = None  # the failed step's line said it
        if record.levelno >= logging.ERROR and error is not None:
            message = f"{meta.get('orig_message') or ''} {error_summary(error)}".strip()
        stamp = dt.datetime.fromtimestamp(record.created).strftime("%H:%M:%S")
        level = "" if record.levelno < logging.WARNING else f"{record.levelname}: "
        return f"{stamp}  {level}{message}"


# Run config naming the console logger: without it a run logs through Dagster's default one.
PROGRESS = {"loggers": {"console": {}}}


@dg.logger(description="Progress lines on stdout: INFO and up, one line each.")
def progress_logger(init_context) -> logging.Logger:
    log = logging.getLogger("pipelines.main.progress")
    log.setLevel(logging.INFO)
    log.propagate = False
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(_ProgressFormatter())
        handler.addFilter(_follow_interrupt)
        log.addHandler(handler)
    return log


def _follow_interrupt(record: logging.LogRecord) -> bool:
    """Feed progress lines to the run's ``Interrupt``; once Ctrl-C came, drop the warnings
    and errors of the run failing because of it (its one line says what happened)."""
    if _interrupt is None:
        return True
    if record.levelno >= logging.WARNING:
        return not _interrupt.requested.is_set()
    meta = getattr(record, "dagster_meta", None) or {}
    _interrupt.note(meta.get("orig_message") or record.getMessage())
    return True


def _quiet_spark() -> None:
    """Spark's console logging: errors only (its own log4j2 configuration, unless the
    environment already passes submit arguments). Given as the driver's
    ``spark.driver.defaultJavaOptions``, which Spark puts before the session's
    ``extraJavaOptions``: the session keeps its own JVM options (``build_spark_session``'s)."""
    option = f"-Dlog4j2.configurationFile={SPARK_LOG_CONFIG.as_uri()}"
    os.environ.setdefault(
        "PYSPARK_SUBMIT_ARGS",
        f"--conf {shlex.quote('spark.driver.defaultJavaOptions=' + option)} pyspark-shell")


# --- the job -----------------------------------------------------------------------------


def _latest_position(storage, name: str) -> SourcePosition | None:
    latest = storage.create_checkpoint_storage(job_id_for(name)).latest_completed_checkpoint()
    return None if latest is None else SourcePosition.of(latest.load_metadata())


def settle_heap() -> None:
    """Leave what exists now out of the garbage collector's full collections (``gc.freeze``):
    in a ``scripts/run`` process the imported modules and the definitions live until it
    exits, yet each full collection walked all of them again (5 per cold run, 0.1-0.7 s
    each by the load) and so did the interpreter's exit (1-3 s after the last line:
    docs/benchmarks.md, "cold_run: the Dagster run's own cost"). Objects stay freed by their
    reference counts; only cycles among what is frozen now wait for the process's end."""
    gc.freeze()


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """The job; ``own_process``: this process ends after it (``python -m pipelines.main``), so
    what it imported and built before the run is frozen (``settle_heap``)."""
    args = parse_args(argv)
    silence_library_warnings()
    _quiet_spark()
    from pipelines.instance import ensure_dagster_home, limit_pools

    home = ensure_dagster_home()
    # Imported here: loading the code location builds the definitions, after the filters.
    from pipelines.definitions import defs

    # Every run's events are still in the instance (and the UI); the console gets progress.
    defs = dg.Definitions.merge(defs, dg.Definitions(loggers={"console": progress_logger}))
    if own_process:
        settle_heap()  # before the instance's storage modules load, while the JVM starts
    storage = defs.resources["checkpoint_storage"].checkpoint_storage()
    latest = _latest_position(storage, NAME)
    today = dt.datetime.now(dt.UTC).date()
    days = None if args.until is not None else args.days
    partitions = next_partitions(latest, days, today, args.until)
    refused = confirm_until(
        partitions, args.until, today, args.yes, input if sys.stdin.isatty() else None
    )
    if refused:
        print(refused, file=sys.stderr, flush=True)
        return 2
    print(f"Dagster instance: {home}")
    print(
        f"Latest completed checkpoint: {latest or 'none'}; "
        f"next: {_range(partitions) or 'nothing (up to date)'}",
        flush=True,
    )
    status = 0
    if partitions:
        # The JVM starts while Dagster prepares the run; the run's resource takes the session.
        defs.resources["spark"].start()
        job = defs.resolve_job_def(f"{NAME}_job")
        global _interrupt
        run_id = str(uuid.uuid4())
        with dg.DagsterInstance.get() as instance:
            _interrupt = interrupt = Interrupt(instance, run_id)
            limit_pools(instance, defs)
            if own_process:
                settle_heap()  # the instance and its storage modules, before the run
            with stop_spark_on_interrupt(interrupt):
                result = job.execute_in_process(
                    instance=instance,
                    run_id=run_id,
                    run_config=PROGRESS | (
                        {"ops": {NAME: {"config": {"allow_non_restored_state": True}}}}
                        if args.allow_non_restored_state else {}),
                    tags={
                        "dagster/asset_partition_range_start": partitions[0],
                        "dagster/asset_partition_range_end": partitions[-1],
                    },
                    raise_on_error=False,
                )
        if interrupt.requested.is_set():
            latest = storage.create_checkpoint_storage(job_id_for(NAME))
            print(interrupt.line(NAME, latest.latest_completed_checkpoint()), flush=True)
            return 130
        _print_run(result, NAME)
        status = 0 if result.success else 1
    _print_state(storage, home, defs)
    return status


def _range(partitions: list[str]) -> str:
    if len(partitions) > 2:
        return f"{partitions[0]} to {partitions[-1]} ({len(partitions)} days)"
    return ", ".join(partitions)


def _print_run(result, name: str) -> None:
    print(f"\nRun {result.run_id}: {'succeeded' if result.success else 'FAILED'}")
    for event in result.get_asset_materialization_events():
        materialization = event.event_specific_data.materialization
        if materialization.asset_key.to_user_string() != name:
            continue
        meta = {k: v.value for k, v in materialization.metadata.items()}
        print(
            f"  {materialization.partition}: checkpoint {meta['checkpoint_id']} "
            f"({meta['state_size']}, {meta['files_written']} files, "
            f"{meta['inline_states']} inline), {meta['batches_applied']} batches, "
            f"{meta['rows_source']} events in, {meta['duration_s']} s; "
            f"restored from {meta['restored_from']}"
        )
    for evaluation in result.get_asset_check_evaluations():
        print(
            f"Asset check {evaluation.check_name}: "
            f"{'passed' if evaluation.passed else 'FAILED'}"
            + ("" if evaluation.passed else f" ({evaluation.description})")
        )
    if not result.success:
        for event in result.all_events:
            if event.event_type_value == "STEP_FAILURE":
                print(f"  {error_summary(event.event_specific_data.error)}")
        print(f"  Full traceback: the run's page in the Dagster UI (run {result.run_id}; how to "
              "open it is below)")


def print_retained(snapshots: list[RetainedSnapshot], now: dt.datetime) -> None:
    """One line per retained checkpoint and savepoint: kind, id, decoded position, size,
    files, age, pointer."""
    if not snapshots:
        print("  nothing yet")
    for s in snapshots:
        where = str(s.position) if s.position else s.status
        size = "-" if s.state_size is None else format_size(s.state_size)
        print(
            f"  {s.kind:<19} {s.checkpoint_id!s:>4}  {where:<26} {size:>10} "
            f"{s.file_count:>3} files {format_age(s.age(now)):>7} ago  {s.pointer}"
        )


def _print_state(storage, home: Path, defs: dg.Definitions) -> None:
    from pipelines.definitions import data_directory

    snapshots = retained_snapshots(storage, NAME)
    print(f"\nRetained checkpoints and savepoints of {NAME}:")
    print_retained(snapshots, dt.datetime.now(dt.UTC))
    newest = next(
        (s for s in reversed(snapshots) if "savepoint" not in s.kind and s.position), None
    )
    if newest is not None:
        print(f"\nRead the state of the newest checkpoint ({newest.position}):")
        for stage in STAGES:
            pointer = shlex.quote(newest.pointer)
            print(f"  .venv/bin/checkpoints read {pointer} --stage {stage.name}")
    group = [s.key.to_user_string() for s in defs.resolve_all_asset_specs()
             if s.group_name == NAME]  # fmt: skip
    command = backfill_command(snapshots, home, NAME, group)
    if command:
        print(
            "\nBackfill from a retained snapshot (dates that fit it; the days run again, in "
            f"one run):\n  {command}"
        )
    data = data_directory()
    landing = os.environ.get("LANDING_DIR", str(data / "landing"))
    reports = os.environ.get("REPORT_DIR", str(data / "reports"))
    print(f"\nInput landing: {landing}\nDaily report: {reports}")
    print(
        "\nOpen the Dagster UI on this instance:\n"
        f"  DAGSTER_HOME={home} .venv/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000\n"
        "Run this command again to continue from the latest completed checkpoint "
        "(--until YYYY-MM-DD to catch up to a day)."
    )


if __name__ == "__main__":
    try:
        sys.exit(main(own_process=True))
    except KeyboardInterrupt:  # Ctrl-C outside a run: no Spark to stop, nothing to report
        print("\ninterrupted", flush=True)
        sys.exit(130)
    finally:
        settle_heap()  # the exit's collection: what the run built is not walked either
