"""``checkpoints read``: the rows of a stage's state in a pipeline checkpoint or savepoint.

A plugin of the ``checkpoints`` command (entry point group ``checkpoint_storage.cli``:
``register(app)`` adds the command to its typer app)::

    checkpoints read POINTER --stage NAME [--limit N] [--where COLUMN=VALUE ...]
                     [--json | --csv | --parquet PATH] [--storage-option KEY=VALUE ...]

Output: a table of the first ``--limit`` rows (default 20) with a footer "N of M rows";
``--json`` prints JSON lines (one object per row: times in ISO 8601, decimals as strings,
bytes as hex), ``--csv`` CSV with a header, ``--parquet PATH`` writes a Parquet file (a local
path or fsspec URL, read with the same storage options; an existing file is kept). These
three write every matching row unless ``--limit`` is given. ``--where`` keeps rows whose
column equals the value (converted to the column's type; repeat it: all must hold).

Every file is verified (size and CRC-32) as it is read. Exit codes are those of
``checkpoints``: 2 usage (an unknown stage or column, a value of the wrong type), 3 no
checkpoint at POINTER, 4 invalid or corrupt (a state file that fails its checksum or is
missing), 5 any other error (e.g. storage I/O).
"""

import datetime as dt
import io
import json
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Annotated

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from checkpoint_storage import url_to_fs
from checkpoint_storage.cli import exit_code_for
from pipelines.state_reader import open_snapshot

__all__ = ["DEFAULT_TABLE_ROWS", "exit_code", "parse_storage_options", "register", "rows_as_json"]

ENV_STORAGE_OPTIONS = "CHECKPOINTS_STORAGE_OPTIONS"
DEFAULT_TABLE_ROWS = 20
PROG = "checkpoints"


def register(app: typer.Typer) -> None:
    """Add ``read`` to the ``checkpoints`` typer app (the entry point's hook)."""
    app.command("read")(read)


def parse_storage_options(flags: Iterable[str] | None) -> dict:
    """fsspec options: the JSON object in ``$CHECKPOINTS_STORAGE_OPTIONS``, then each
    ``KEY=VALUE`` flag (VALUE as JSON when it parses, else as text)."""
    options: dict = {}
    raw = os.environ.get(ENV_STORAGE_OPTIONS, "")
    if raw.strip():
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise typer.BadParameter(
                f"${ENV_STORAGE_OPTIONS} must be a JSON object of storage options"
            )
        options.update(parsed)
    for flag in flags or ():
        key, sep, value = flag.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(
                "give storage options as KEY=VALUE (the '=' is missing)",
                param_hint="--storage-option",
            )
        try:
            options[key.strip()] = json.loads(value)
        except ValueError:
            options[key.strip()] = value
    return options


def exit_code(exc: BaseException) -> int:
    """The exit code of an error: 2 usage, 3 not found, 4 invalid or corrupt, 5 other."""
    return exit_code_for(exc)


def _fail(exc: BaseException, options: Mapping) -> typer.Exit:
    message = " ".join(str(exc).split()) or type(exc).__name__
    for value in options.values():  # option values are never printed
        if isinstance(value, str) and len(value) >= 4:
            message = message.replace(value, "***")
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return typer.Exit(exit_code(exc))


def _parse_where(items: Iterable[str] | None) -> dict[str, str]:
    where = {}
    for item in items or ():
        column, sep, value = item.partition("=")
        if not sep or not column:
            raise typer.BadParameter(f"{item!r} is not COLUMN=VALUE", param_hint="--where")
        where[column] = value
    return where


def read(
    pointer: Annotated[
        str,
        typer.Argument(metavar="POINTER", help="A checkpoint or savepoint (its dir or _metadata)."),
    ],
    stage: Annotated[str, typer.Option("--stage", help="The stage whose state to read.")],
    limit: Annotated[
        int | None,
        typer.Option(min=0, help=f"At most N rows (table default: {DEFAULT_TABLE_ROWS})."),
    ] = None,
    where: Annotated[
        list[str] | None,
        typer.Option("--where", metavar="COLUMN=VALUE", help="Keep rows where COLUMN=VALUE."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines, one per row.")] = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="CSV with a header.")] = False,
    parquet: Annotated[
        str | None, typer.Option("--parquet", metavar="PATH", help="Write a Parquet file.")
    ] = None,
    storage_option: Annotated[
        list[str] | None,
        typer.Option("--storage-option", "-o", metavar="KEY=VALUE", help="An fsspec option."),
    ] = None,
) -> None:
    """Print or export the rows of a stage's state in a pipeline checkpoint or savepoint
    (every state file verified as it is read)."""
    if sum((as_json, as_csv, parquet is not None)) > 1:
        raise typer.BadParameter("choose one of --json, --csv and --parquet")
    options = parse_storage_options(storage_option)
    conditions = _parse_where(where)
    try:
        snapshot = open_snapshot(pointer, storage_options=options)
        table = snapshot.read(stage, where=conditions)
        shown = table if limit is None else table.slice(0, limit)
        if as_json:
            for line in rows_as_json(shown):
                typer.echo(line)
        elif as_csv:
            out = io.BytesIO()
            pacsv.write_csv(shown, out)
            typer.echo(out.getvalue().decode(), nl=False)
        elif parquet is not None:
            _write_parquet(shown, parquet, options)
            print(f"wrote {shown.num_rows} rows of stage {stage} to {parquet}", file=sys.stderr)
        else:
            _print_table(snapshot, stage, table, DEFAULT_TABLE_ROWS if limit is None else limit)
    except typer.Exit:
        raise
    except Exception as exc:  # noqa: BLE001 - one line and a documented exit code
        raise _fail(exc, options) from None


def _write_parquet(table: pa.Table, url: str, options: Mapping) -> None:
    fs, path = url_to_fs(url, dict(options))
    if fs.exists(path):
        raise FileExistsError(f"--parquet {url} exists: remove it or choose another path")
    with fs.open(path, "wb") as f:
        pq.write_table(table, f)


def _print_table(snapshot, stage: str, table: pa.Table, limit: int) -> None:
    kind = "savepoint" if snapshot.is_savepoint else "checkpoint"
    view = Table(
        title=Text(
            f"stage {stage} of pipeline {snapshot.pipeline_name}, {kind} {snapshot.checkpoint_id}"
        ),
        caption=f"{min(limit, table.num_rows)} of {table.num_rows} rows",
    )
    for field in table.schema:
        numeric = pa.types.is_integer(field.type) or pa.types.is_floating(field.type) or (
            pa.types.is_decimal(field.type)
        )
        view.add_column(field.name, justify="right" if numeric else "left", overflow="fold")
    for row in table.slice(0, limit).to_pylist():
        # Text, not markup: state values may hold "[...]".
        view.add_row(*(Text("null", style="dim") if v is None else Text(_text(v))
                       for v in row.values()))
    Console().print(view)


def _text(value: object) -> str:
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def rows_as_json(table: pa.Table) -> Iterable[str]:
    """One JSON object per row: times in ISO 8601, decimals as strings, bytes as hex."""
    for row in table.to_pylist():
        yield json.dumps(row, default=_text, ensure_ascii=False)
