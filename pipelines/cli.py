"""``checkpoints read``: the rows of a stage's state in a pipeline checkpoint or savepoint.

A plugin of the ``checkpoints`` command (entry point group ``checkpoint_storage.cli``;
``register(app)`` adds the command), built on its helpers so that it behaves like the
built-in commands: the same ``--storage-option``/``-o`` and ``$CHECKPOINTS_STORAGE_OPTIONS``,
one-line redacted errors and the same exit codes::

    checkpoints read POINTER_OR_JOB --stage NAME [--variable NAME] [--as-of PARTITION] [--limit N]
                     [--where COLUMN=VALUE ...] [--json | --csv | --parquet PATH]
                     [-o KEY=VALUE ...]
"""

import datetime as dt
import inspect
import io
import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Annotated

import typer
from rich.text import Text

from checkpoint_storage import (
    CheckpointNotFoundError,
    latest_checkpoint,
    list_checkpoints,
    url_to_fs,
)
from checkpoint_storage.cli import (
    StorageOption,
    UsageError,
    complete_location,
    echo,
    location,
    new_table,
    print_table,
    run_command,
    storage_options,
)
from checkpoint_storage.spi import SOURCE_POSITION_STATE, resolve_checkpoint_pointer

if TYPE_CHECKING:
    import pyarrow as pa

    from pipelines.state_reader import PipelineSnapshot

__all__ = ["CHECKPOINTS_COMMANDS", "DEFAULT_TABLE_ROWS", "complete_stage",
           "partition_end_pointer", "read_command", "register", "rows_as_json"]

# Read by `checkpoints` from this file's source without importing it (a literal): `read` is
# listed and completes at once, and pyspark and pyarrow are imported only when it runs.
CHECKPOINTS_COMMANDS = {"read": "Print or export the rows of a stage's state."}

DEFAULT_TABLE_ROWS = 20


def register(app: typer.Typer) -> None:
    """Add ``read`` to the ``checkpoints`` app (the ``checkpoint_storage.cli`` entry point)."""
    # Paragraphs of one line each, so that help wraps them to the terminal.
    paragraphs = inspect.cleandoc(read_command.__doc__ or "").split("\n\n")
    app.command("read", help="\n\n".join(" ".join(p.split()) for p in paragraphs))(
        read_command
    )


def complete_stage(ctx: typer.Context, incomplete: str) -> list[str]:
    """Shell completion of --stage: the stages (operators) of the checkpoint or savepoint
    already given (of a job directory: its latest completed checkpoint), storage options from
    ``$CHECKPOINTS_STORAGE_OPTIONS``. Nothing when it cannot be read."""
    # `--stage` still waiting for its value stops the parse: the words typed before it are
    # left in ctx.args, unassigned
    pointer = ctx.params.get("pointer") or next(iter(ctx.args), None)
    if not pointer:
        return []
    try:
        options = storage_options(None)
        where = location(pointer)
        latest = None if where.rstrip("/").rpartition("/")[2].startswith("chk-") else (
            latest_checkpoint(where, storage_options=options)
        )
        completed = resolve_checkpoint_pointer(latest or where, options)
        stages = [op.operator_id for op in completed.load_metadata().operator_states]
    except Exception:  # noqa: BLE001 - completion offers what it can, never an error
        return []
    return [stage for stage in stages if stage.startswith(incomplete)]


def read_command(
    pointer: Annotated[
        str,
        typer.Argument(
            metavar="POINTER_OR_JOB", show_default=False, autocompletion=complete_location
        ),
    ],
    stage: Annotated[
        str,
        typer.Option(
            "--stage", metavar="NAME", help="the stage whose state to read",
            autocompletion=complete_stage,
        ),
    ],
    variable: Annotated[
        str | None,
        typer.Option(
            "--variable", metavar="NAME", show_default=False,
            help="a state variable of the stage: its rows (key + fields; a row per list "
            "element or map entry) instead of the physical rows, one per key",
        ),
    ] = None,
    as_of: Annotated[
        str | None,
        typer.Option(
            "--as-of", metavar="PARTITION", show_default=False,
            help="read the retained checkpoint at the end of PARTITION in the job directory "
            "POINTER_OR_JOB (or the one of the checkpoint POINTER_OR_JOB)",
        ),
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option(
            min=0, metavar="N", show_default=False,
            help=f"at most N rows (the table: {DEFAULT_TABLE_ROWS} unless given)",
        ),
    ] = None,
    where: Annotated[
        list[str] | None,
        typer.Option(
            "--where", metavar="COLUMN=VALUE", show_default=False,
            help="keep rows whose COLUMN equals VALUE (repeatable: all must hold)",
        ),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="JSON lines: one object per row")
    ] = False,
    csv_output: Annotated[bool, typer.Option("--csv", help="CSV with a header row")] = False,
    parquet: Annotated[
        str | None,
        typer.Option("--parquet", metavar="PATH", show_default=False,
                     help="write the rows to a new Parquet file (path or fsspec URL)"),
    ] = None,
    storage_option: StorageOption = None,
) -> None:
    """Print or export the rows of a stage's state.

    Reads the state of stage NAME in the pipeline checkpoint or savepoint POINTER_OR_JOB,
    every state file verified (size and CRC-32) as it is read. --as-of PARTITION reads the
    state as of the end of PARTITION instead: the newest retained checkpoint there in the job
    directory POINTER_OR_JOB (or the job directory of the checkpoint named); exit 3 naming the
    retained partition ends when there is none. Prints a table of the first rows
    (20, or --limit) with a footer "N of M rows". --json prints JSON lines (one object per
    row: times in ISO 8601, decimals as strings, bytes as hex), --csv CSV with a header,
    --parquet PATH writes a Parquet file (never over an existing one); these three give every
    matching row unless --limit is given. --where COLUMN=VALUE keeps rows whose column equals
    VALUE, converted to the column's type (a time without offset is in the column's zone).
    --variable NAME reads one state variable of a stage that declares them (its rows: key
    columns and the value's fields, one row per list element or map entry); without it such
    a stage shows its physical rows, one per key, and names its variables on stderr.
    Exit 2: an unknown stage or column, or a value of the wrong type; 3: no checkpoint at
    POINTER; 4: not a pipeline's, or a state file is corrupt or missing (named).
    """
    run_command(
        lambda: _read(
            pointer, stage, limit, where, json_output, csv_output, parquet,
            storage_options(storage_option), as_of, variable,
        )
    )


def _read(
    pointer: str,
    stage: str,
    limit: int | None,
    where: list[str] | None,
    json_output: bool,
    csv_output: bool,
    parquet: str | None,
    options: dict,
    as_of: str | None = None,
    variable: str | None = None,
) -> None:
    import pyarrow.csv as pacsv

    from pipelines.state_reader import open_snapshot

    if sum((json_output, csv_output, parquet is not None)) > 1:
        raise UsageError("choose one of --json, --csv and --parquet")
    conditions = _where(where)
    if as_of is not None:
        pointer = partition_end_pointer(location(pointer), as_of, options)
        echo(f"as of the end of {as_of}: {pointer}", err=True)
    snapshot = open_snapshot(location(pointer), storage_options=options)
    table = snapshot.read(stage, where=conditions, variable=variable)
    if variable is None and (names := snapshot.variables(stage)):
        echo(f"stage {stage} has state variables {', '.join(names)}: these are its physical "
             "rows, one per key; --variable NAME reads one variable's rows", err=True)
    rows = table if limit is None else table.slice(0, limit)
    if json_output:
        for line in rows_as_json(rows):
            echo(line)
    elif csv_output:
        out = io.BytesIO()
        pacsv.write_csv(rows, out)
        echo(out.getvalue().decode().rstrip("\n"))
    elif parquet is not None:
        _write_parquet(rows, location(parquet), options)
        echo(f"wrote {rows.num_rows} rows of stage {stage} to {parquet}", err=True)
    else:
        _print_rows(snapshot, stage, table, DEFAULT_TABLE_ROWS if limit is None else limit)


def partition_end_pointer(pointer_or_job: str, partition: str, options: Mapping) -> str:
    """The newest completed checkpoint at the end of ``partition`` in the job directory
    ``pointer_or_job`` (a checkpoint's ``chk-<id>`` stands for its job directory);
    ``CheckpointNotFoundError`` naming the partition ends retained there when there is
    none."""
    from pipelines.runner import SourcePosition

    parent, _, name = pointer_or_job.rstrip("/").rpartition("/")
    job = parent if parent and name.startswith("chk-") and name[4:].isdigit() else pointer_or_job
    ends: dict[str, tuple[int, str]] = {}
    for info in list_checkpoints(job, storage_options=dict(options)):
        data = info.master_states.get(SOURCE_POSITION_STATE)
        if info.status != "completed" or data is None or info.checkpoint_id is None:
            continue
        position = SourcePosition.from_bytes(data)
        if position.complete and (position.partition not in ends
                                  or info.checkpoint_id > ends[position.partition][0]):
            ends[position.partition] = (info.checkpoint_id, info.pointer)
    if partition in ends:
        return ends[partition][1]
    retained = ", ".join(sorted(ends)) or "none"
    raise CheckpointNotFoundError(
        f"no retained checkpoint in {job} holds the state at the end of {partition}; the "
        f"retained partition ends are: {retained}. Keep more of them with the pipeline's "
        "retain_partition_ends, or read a savepoint taken there")


def _where(items: Iterable[str] | None) -> dict[str, str]:
    conditions = {}
    for item in items or ():
        column, sep, value = item.partition("=")
        if not sep or not column:
            raise UsageError(f"--where {item!r}: give COLUMN=VALUE")
        conditions[column] = value
    return conditions


def _write_parquet(table: "pa.Table", url: str, options: Mapping) -> None:
    import pyarrow.parquet as pq

    fs, path = url_to_fs(url, dict(options))
    if fs.exists(path):
        raise UsageError(f"--parquet {url} exists: remove it or choose another path")
    with fs.open(path, "wb") as f:
        pq.write_table(table, f)


def _print_rows(snapshot: "PipelineSnapshot", stage: str, table: "pa.Table", limit: int) -> None:
    import pyarrow as pa

    kind = "savepoint" if snapshot.is_savepoint else "checkpoint"
    echo(f"stage {stage} of pipeline {snapshot.pipeline_name}, {kind} {snapshot.checkpoint_id}")
    numeric = [
        field.name for field in table.schema
        if pa.types.is_integer(field.type) or pa.types.is_floating(field.type)
        or pa.types.is_decimal(field.type)
    ]
    view = new_table(*table.schema.names, right=numeric, fold=table.schema.names)
    for row in table.slice(0, limit).to_pylist():
        view.add_row(*(Text("null", style="dim") if v is None else _text(v) for v in row.values()))
    print_table(view)
    echo(f"{min(limit, table.num_rows)} of {table.num_rows} rows")


def _text(value: object) -> str:
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def rows_as_json(table: "pa.Table") -> Iterable[str]:
    """One JSON object per row: times in ISO 8601, decimals as strings, bytes as hex."""
    for row in table.to_pylist():
        yield json.dumps(row, default=_text, ensure_ascii=False)
