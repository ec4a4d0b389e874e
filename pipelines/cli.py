"""``checkpoints read``: the rows of a stage's state in a pipeline checkpoint or savepoint;
``checkpoints stages``: its stages at a glance; ``checkpoints history``: the statistics of a
job's retained checkpoints (and of older ones, from a Dagster instance's event log).

A plugin of the ``checkpoints`` command (entry point group ``checkpoint_storage.cli``;
``register(app)`` adds the command), built on its helpers so that it behaves like the
built-in commands: the same ``--storage-option``/``-o`` and ``$CHECKPOINTS_STORAGE_OPTIONS``,
one-line redacted errors and the same exit codes::

    checkpoints read POINTER_OR_JOB --stage NAME [--variable NAME] [--as-of PARTITION] [--limit N]
                     [--where COLUMN=VALUE ...] [--json | --csv | --parquet PATH]
                     [-o KEY=VALUE ...]
    checkpoints stages POINTER_OR_JOB [--json] [-o KEY=VALUE ...]
    checkpoints history JOB [--dagster-asset KEY] [--json] [-o KEY=VALUE ...]
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
    JsonOption,
    StorageOption,
    UsageError,
    complete_location,
    echo,
    files_label,
    location,
    new_table,
    print_json,
    print_table,
    run_command,
    storage_options,
)
from checkpoint_storage.spi import SOURCE_POSITION_STATE, resolve_checkpoint_pointer

if TYPE_CHECKING:
    import pyarrow as pa

    from pipelines.state_reader import PipelineSnapshot

__all__ = ["CHECKPOINTS_COMMANDS", "DEFAULT_TABLE_ROWS", "complete_stage", "history_command",
           "partition_end_pointer", "read_command", "register", "rows_as_json",
           "stages_command"]

# Read by `checkpoints` from this file's source without importing it (a literal): `read` is
# listed and completes at once, and pyspark and pyarrow are imported only when it runs.
CHECKPOINTS_COMMANDS = {
    "read": "Print or export the rows of a stage's state.",
    "stages": "The stages of a pipeline checkpoint: kind, key, schema, TTL, rows, key groups.",
    "history": "The statistics of a job's retained checkpoints, oldest first.",
}

DEFAULT_TABLE_ROWS = 20


def register(app: typer.Typer) -> None:
    """Add ``read`` to the ``checkpoints`` app (the ``checkpoint_storage.cli`` entry point)."""
    # Paragraphs of one line each, so that help wraps them to the terminal.
    for name, command in (("read", read_command), ("stages", stages_command),
                          ("history", history_command)):
        paragraphs = inspect.cleandoc(command.__doc__ or "").split("\n\n")
        app.command(name, help="\n\n".join(" ".join(p.split()) for p in paragraphs))(command)


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
    row: times in ISO 8601, decimals as strings, bytes as hex), --csv CSV with a header
    (a list, struct or map column, such as a stage's _timers or variables, as JSON text),
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
        pacsv.write_csv(nested_as_json(rows), out)
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


def nested_as_json(table: "pa.Table") -> "pa.Table":
    """``table`` with each list, struct or map column as JSON text (one value a cell, as
    ``--json`` writes it), which CSV has no form for; other columns as they are."""
    import pyarrow as pa

    for index, field in enumerate(table.schema):
        if pa.types.is_nested(field.type):
            text = [None if value is None
                    else json.dumps(value, default=_text, ensure_ascii=False)
                    for value in table.column(index).to_pylist()]
            table = table.set_column(index, pa.field(field.name, pa.string()),
                                     pa.array(text, pa.string()))
    return table


# --- stages ----------------------------------------------------------------------------------

def stages_command(
    pointer: Annotated[
        str,
        typer.Argument(
            metavar="POINTER_OR_JOB", show_default=False, autocompletion=complete_location
        ),
    ],
    json_output: JsonOption = False,
    storage_option: StorageOption = None,
) -> None:
    """The stages of a pipeline checkpoint or savepoint.

    Per stage of POINTER_OR_JOB (a job directory: its latest completed checkpoint), read from
    its _metadata alone: kind (plain: a DataFrame stage; keyed), key, schema, TTL, timers
    (when the keyed state has a _timers column), max parallelism and parallelism, live and
    expired rows, the bytes it references and those this checkpoint wrote; then per part
    (subtask) its key group range, rows and files (full snapshot, change files, state file;
    paths relative to the job directory). JSON: a list of stages with keys stage, kind,
    format, key, schema, ttl, timers, max_parallelism, parallelism, clock, live_rows,
    expired_rows, state_size, written_size and parts (subtask, key_groups, live_rows,
    expired_rows, files: role, type, path, size). Exit 3: no checkpoint there; 4: not a
    pipeline's.
    """
    run_command(lambda: _stages(pointer, json_output, storage_options(storage_option)))


def _latest_or_pointer(pointer: str, options: dict) -> str:
    where = location(pointer)
    name = where.rstrip("/").rpartition("/")[2]
    if name.startswith(("chk-", "savepoint-")) or name == "_metadata":
        return where
    try:
        latest = latest_checkpoint(where, storage_options=options)
    except ValueError:
        return where
    return latest or where


def _stages(pointer: str, as_json: bool, options: dict) -> None:
    from pipelines.stages_view import stages_of

    where = _latest_or_pointer(pointer, options)
    stages = stages_of(where, storage_options=options)
    if as_json:
        print_json(stages)
        return
    echo(f"stages of {where}")
    table = new_table("STAGE", "KIND", "KEY", "TTL", "TIMERS", "MAX", "PARTS", "LIVE ROWS",
                      "EXPIRED", "SIZE", "WRITTEN",
                      right={"MAX", "PARTS", "LIVE ROWS", "EXPIRED", "SIZE", "WRITTEN"})
    for stage in stages:
        ttl = stage["ttl"]
        table.add_row(
            stage["stage"], stage["kind"], ", ".join(stage["key"] or []) or "-",
            "-" if ttl is None else f"{_duration(ttl['seconds'])} ({ttl['time_characteristic']})",
            stage["timers"] or "-", _dash(stage["max_parallelism"]), str(stage["parallelism"]),
            _dash(stage["live_rows"]), _dash(stage["expired_rows"]),
            _size(stage["state_size"]), _size(stage["written_size"]))
    print_table(table)
    for stage in stages:
        echo()
        echo(Text(f"{stage['stage']} ({stage['kind']}): schema "
                  + ", ".join(f"{f['name']} {f['type']}" for f in stage["schema"]),
                  style="bold"))
        parts = new_table("PART", "KEY GROUPS", "LIVE ROWS", "EXPIRED", "ROLE", "SIZE", "FILE",
                          right={"PART", "LIVE ROWS", "EXPIRED", "SIZE"}, pointer="FILE")
        for part in stage["parts"]:
            groups = part["key_groups"]
            for index, file in enumerate(part["files"] or [None]):
                first = index == 0
                parts.add_row(
                    str(part["subtask"]) if first else "",
                    ("-" if groups is None else f"{groups[0]}-{groups[1]}") if first else "",
                    _dash(part["live_rows"]) if first else "",
                    _dash(part["expired_rows"]) if first else "",
                    "-" if file is None else file["role"],
                    "-" if file is None else _size(file["size"]),
                    "-" if file is None else (file["path"] or "(inline)"))
        print_table(parts, indent=2)


def _duration(seconds: float) -> str:
    """``30d``, ``1h30m``, ``45s``, ``0.5s``: a TTL, short."""
    whole, parts = int(seconds), []
    if whole != seconds or not whole:
        return f"{seconds:g}s"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if whole >= size:
            parts.append(f"{whole // size}{unit}")
            whole %= size
    return "".join(parts)


def _dash(value) -> str:
    return "-" if value is None else str(value)


def _size(value) -> str:
    from checkpoint_storage.spi import format_size

    return "-" if value is None else format_size(value)


# --- history ---------------------------------------------------------------------------------

def history_command(
    job: Annotated[
        str,
        typer.Argument(metavar="JOB", show_default=False, autocompletion=complete_location),
    ],
    dagster_asset: Annotated[
        str | None,
        typer.Option(
            "--dagster-asset", metavar="KEY", show_default=False,
            help="also what the Dagster instance ($DAGSTER_HOME) recorded of older "
            "checkpoints: the materializations of asset KEY (a/b for a path)",
        ),
    ] = None,
    json_output: JsonOption = False,
    storage_option: StorageOption = None,
) -> None:
    """The statistics of a job's retained checkpoints, oldest first.

    Per retained checkpoint of the job directory JOB (<base>/<job_id>): id, time, source
    position, bytes written against full size, files new and reused, full snapshots and
    change files (keyed stages), live and expired rows, and the durations of its batches,
    state write and _metadata publication ("-" where not known: a checkpoint written
    without statistics records none; a _metadata publication is recorded by the next
    checkpoint). --dagster-asset KEY adds, from the Dagster instance at $DAGSTER_HOME, what
    the asset's materializations recorded of checkpoints no longer retained (source
    "dagster"). JSON: a list of objects with keys source, checkpoint_id, timestamp_ms, kind,
    position, recorded, written_size, full_size, files_new, files_reused, full_snapshots,
    change_files, live_rows, expired_rows, durations_ms (batch, state_write,
    metadata_publication) and pointer.
    """
    run_command(lambda: _history(job, dagster_asset, json_output,
                                 storage_options(storage_option)))


def _dagster_events(asset: str) -> list[tuple[int | None, dict]]:
    import os

    if not os.environ.get("DAGSTER_HOME"):
        raise UsageError("--dagster-asset reads the Dagster instance at $DAGSTER_HOME: set it")
    import dagster as dg

    key = dg.AssetKey(asset.split("/"))
    with dg.DagsterInstance.get() as instance:
        records = instance.fetch_materializations(key, limit=10_000, ascending=True).records
    events = []
    for record in records:
        materialization = record.asset_materialization
        if materialization is None:
            continue
        metadata = {name: getattr(value, "value", value)
                    for name, value in materialization.metadata.items()}
        events.append((int(record.timestamp * 1000), metadata))
    return events


def _history(job: str, dagster_asset: str | None, as_json: bool, options: dict) -> None:
    from pipelines.statistics import checkpoint_history, history_from_events

    rows = checkpoint_history(location(job), storage_options=options)
    if dagster_asset is not None:
        retained = {r["checkpoint_id"] for r in rows}
        rows = sorted([*history_from_events(_dagster_events(dagster_asset), retained), *rows],
                      key=lambda r: r["checkpoint_id"])
    if as_json:
        print_json(rows)
        return
    if not rows:
        echo(f"no retained checkpoints in {location(job)}")
        return
    table = new_table("ID", "TIME", "POSITION", "WRITTEN", "SIZE", "FILES", "ROWS", "BATCH",
                      "WRITE", "PUBLISH", "FROM",
                      right={"ID", "WRITTEN", "SIZE", "FILES", "ROWS", "BATCH", "WRITE",
                             "PUBLISH"})
    for row in rows:
        durations = row["durations_ms"]
        files = (None if row["files_new"] is None or row["files_reused"] is None
                 else row["files_new"] + row["files_reused"])
        table.add_row(
            str(row["checkpoint_id"]), _time(row["timestamp_ms"]), row["position"] or "-",
            _size(row["written_size"]), _size(row["full_size"]),
            "-" if files is None else files_label(files, row),
            _dash(row["live_rows"]), *(_milliseconds(durations.get(name))
                                       for name in ("batch", "state_write",
                                                    "metadata_publication")),
            "checkpoint" if row["source"] == "checkpoint" else "dagster")
    print_table(table)


def _time(timestamp_ms: int | None) -> str:
    if timestamp_ms is None:
        return "-"
    moment = dt.datetime.fromtimestamp(timestamp_ms / 1000, dt.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def _milliseconds(value) -> str:
    return "-" if value is None else f"{value:.0f} ms"
