"""``checkpoints list`` and ``checkpoints latest``: what a directory holds, and the pointer to
restore from."""

from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.text import Text

from checkpoint_storage import (
    JOB_NAME_STATE,
    SOURCE_POSITION_STATE,
    CheckpointInfo,
    JobID,
    format_age,
    latest_checkpoint,
    list_checkpoints_below,
)
from checkpoint_storage.cli.flink import RemapOption, flink_list, remap_pairs
from checkpoint_storage.cli.helpers import (
    EPILOG,
    EXIT_NOT_FOUND,
    EXIT_OK,
    DirArgument,
    JsonOption,
    StorageOption,
    UsageError,
    command_help,
    counted,
    echo,
    error,
    human_size,
    iso_utc,
    location,
    new_table,
    print_json,
    print_table,
    run_command,
    storage_options,
)
from checkpoint_storage.spi import json_object_state

__all__ = ["describe_position", "files_label", "latest_command", "list_command", "register"]

_STATUS_STYLES = {
    "completed": "green",
    "in-progress": "yellow",
    "abandoned": "dim",
    "invalid": "red",
    "foreign": "red",
    "unreadable": "magenta",
}

RelativeOption = Annotated[
    bool,
    typer.Option(
        "--relative",
        help="show pointers relative to DIR (in the table and in JSON), shorter to copy",
    ),
]


def register(app: typer.Typer) -> None:
    """Add ``list`` and ``latest`` to the ``checkpoints`` app."""
    app.command("list", help=command_help(list_command), epilog=EPILOG)(list_command)
    app.command("latest", help=command_help(latest_command), epilog=EPILOG)(latest_command)


def _source_position(data: bytes | None) -> dict | None:
    """The ``SOURCE_POSITION_STATE`` JSON object, None when absent or not of that form."""
    return json_object_state(data, {"partition", "batches", "complete"})


def describe_position(position: dict | None) -> str:
    """A source position for people: ``2026-10-06, 3 batches`` part-way through a partition,
    ``2026-10-06, partition end (4 batches)`` at its end; ``-`` for none."""
    if position is None:
        return "-"
    try:
        batches = counted(int(position["batches"]), "batch", "batches")
    except (TypeError, ValueError):
        batches = f"{position['batches']} batches"
    if position["complete"]:
        return f"{position['partition']}, partition end ({batches})"
    return f"{position['partition']}, {batches}"


def files_label(count: int, statistics: dict | None) -> str:
    """``30`` files, ``30 (4 new)`` when the statistics tell how many are new."""
    new = (statistics or {}).get("files_new")
    return str(count) if new is None else f"{count} ({new} new)"


def _job_name(states: dict) -> str | None:
    data = states.get(JOB_NAME_STATE)
    return None if data is None else data.decode("utf-8", "replace")


def _info_json(info: CheckpointInfo, now: datetime, shown: str) -> dict:
    age = info.age(now)
    return {
        "pointer": shown,
        "job_id": info.job_id,
        "checkpoint_id": info.checkpoint_id,
        "kind": info.kind,
        "status": info.status,
        "reason": info.reason,
        "state_size": info.state_size,
        "file_count": info.file_count,
        "statistics": info.statistics,
        "modified": iso_utc(info.modified),
        "age_seconds": None if age is None else round(age.total_seconds(), 3),
        "job_name": _job_name(info.master_states),
        "source_position": _source_position(info.master_states.get(SOURCE_POSITION_STATE)),
    }


def _relative_to(directory: str):
    """The pointer as shown: relative to ``directory`` when it lies below it (--relative)."""
    prefix = directory.rstrip("/") + "/"

    def shown(pointer: str) -> str:
        return pointer[len(prefix) :] if pointer.startswith(prefix) else pointer

    return shown


def _list(
    directory_arg: str, as_json: bool, options: dict, relative: bool = False, remap=()
) -> int:
    directory = location(directory_arg)
    infos = list_checkpoints_below(directory, storage_options=options)
    shown = _relative_to(directory) if relative else str
    if infos and all(i.kind == "flink" for i in infos):  # only Apache Flink's: read them
        return flink_list(infos, as_json, options, remap, shown)
    now = datetime.now(UTC)
    if as_json:
        print_json([_info_json(i, now, shown(i.pointer)) for i in infos])
        return EXIT_OK
    if not infos:
        echo(f"no checkpoints or savepoints in {directory}")
        return EXIT_OK
    jobs: dict[str | None, list[CheckpointInfo]] = {}
    for info in infos:
        jobs.setdefault(info.job_id, []).append(info)
    order = sorted(jobs, key=lambda job: (job is None, job or ""))
    for index, job in enumerate(order):
        rows = jobs[job]
        names = [_job_name(i.master_states) for i in reversed(rows)]
        name = next((n for n in names if n), None)
        if index:
            echo()
        echo(Text(_job_heading(job, name), style="bold"))
        table = new_table(
            "ID",
            "KIND",
            "STATUS",
            "POSITION",
            "SIZE",
            "WRITTEN",
            "FILES",
            "AGE",
            "POINTER",
            right={"ID", "SIZE", "WRITTEN", "FILES", "AGE"},
            pointer="POINTER",
        )
        for i in rows:
            position = _source_position(i.master_states.get(SOURCE_POSITION_STATE))
            table.add_row(
                "-" if i.checkpoint_id is None else str(i.checkpoint_id),
                i.kind,
                Text(i.status, style=_STATUS_STYLES.get(i.status, "")),
                describe_position(position),
                human_size(i.state_size),
                human_size((i.statistics or {}).get("written_size")),
                files_label(i.file_count, i.statistics),
                format_age(i.age(now), compact=True),
                shown(i.pointer),
            )
        print_table(table)
    reasons = [i for i in infos if i.reason]
    if reasons:
        echo()
    for info in reasons:
        echo(f"{info.status}: {shown(info.pointer)}: {info.reason}")
    return EXIT_OK


def _job_heading(job: str | None, name: str | None) -> str:
    if job is None:
        return "no job id (savepoints whose _metadata cannot be read)"
    return f"pipeline {name} (job {job})" if name else f"job {job}"



def _is_job_directory(directory: str) -> bool:
    try:
        JobID(directory.rstrip("/").rpartition("/")[2])
    except ValueError:
        return False
    return True


def _job_directories_below(directory: str, options: dict) -> list[str]:
    """The job directories at or below ``directory`` that hold a completed checkpoint."""
    jobs = {
        info.pointer.rstrip("/").rpartition("/")[0]
        for info in list_checkpoints_below(directory, storage_options=options)
        if info.completed and info.kind != "savepoint"
    }
    return sorted(jobs)


def _latest(directory_arg: str, as_json: bool, options: dict) -> int:
    directory = location(directory_arg)
    try:
        pointer = latest_checkpoint(directory, storage_options=options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if pointer is None and not _is_job_directory(directory):
        # a base or data directory, as `list` takes it: the job below it, when there is one
        jobs = _job_directories_below(directory, options)
        if len(jobs) > 1:
            raise UsageError(
                f"{directory} holds the checkpoints of {counted(len(jobs), 'job')}: "
                f"{', '.join(jobs)}; pass one of these job directories"
            )
        if jobs:
            pointer = latest_checkpoint(jobs[0], storage_options=options)
    if as_json:
        print_json({"pointer": pointer})
    elif pointer is not None:
        echo(pointer)
    if pointer is None:
        error(f"no completed checkpoint in {directory} or below it; pass a job directory "
              "<base>/<job_id>")
        return EXIT_NOT_FOUND
    return EXIT_OK


def list_command(
    directory: DirArgument,
    relative: RelativeOption = False,
    json_output: JsonOption = False,
    storage_option: StorageOption = None,
    remap: RemapOption = None,
) -> None:
    """The checkpoints and savepoints of a job directory, or of every job below DIR.

    DIR is a job directory (<base>/<job_id>), a base directory of job directories, a
    directory of savepoints, or a directory above them (e.g. a data directory with
    checkpoints/ and savepoints/scheduled/ below it: DIR is searched two levels deep). Per
    job: its pipeline name (master state "pipeline-name"); per chk-<id> or savepoint-*
    directory: id, kind, status (completed / invalid / foreign / unreadable / in-progress /
    abandoned: no _metadata and the job lease released, expired or taken since),
    source position (master state "source-position", e.g. "2026-10-06, 3 batches"), state
    size (full size: all it references), bytes written (by this checkpoint: files no
    checkpoint listed before it references, and inline state; "-" when not known), file
    count (and how many are new), age and pointer (last; on a narrow terminal on its own line, never
    wrapped). --relative shows pointers relative to DIR. JSON: a list of objects with keys
    pointer, job_id, checkpoint_id, kind, status, reason, state_size, file_count,
    statistics (recorded or derived checkpoint statistics, see docs/operations.md; null
    unless completed), modified, age_seconds, job_name, source_position (the position's
    JSON object). A file as DIR is
    a usage error (exit 2). Apache Flink's directories (only Flink's checkpoints and
    savepoints below DIR) are listed with each one's _metadata read (docs/storage-flink.md):
    id, kind, type, operators, files, sizes; --remap OLD=NEW reads paths Flink wrote on
    another machine.
    """
    run_command(
        lambda: _list(
            directory,
            json_output,
            storage_options(storage_option),
            relative,
            remap_pairs(remap),
        )
    )


def latest_command(
    directory: DirArgument, json_output: JsonOption = False, storage_option: StorageOption = None
) -> None:
    """The pointer of a job's latest completed checkpoint.

    Prints the pointer of the newest completed checkpoint (valid _metadata, highest id) of
    the job directory DIR (<base>/<job_id>), and nothing else. DIR may also be a directory
    above one job directory (a base or data directory, searched as list does); above
    several, it is a usage error naming them (exit 2). Exits 3 when there is none. JSON:
    {"pointer": ...}.
    """
    run_command(lambda: _latest(directory, json_output, storage_options(storage_option)))
