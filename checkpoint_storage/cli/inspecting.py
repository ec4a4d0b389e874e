"""``checkpoints inspect`` and ``checkpoints verify``: one checkpoint's `_metadata`, and
whether every state file it references is intact."""

import json

import typer
from rich.text import Text

from checkpoint_storage import (
    FileStateHandle,
    SegmentFileStateHandle,
    list_checkpoints,
    metadata_as_json,
    resolve_checkpoint_pointer,
    verify_checkpoint,
)
from checkpoint_storage.cli.flink import (
    RemapOption,
    flink_inspect,
    flink_verify,
    is_flink_pointer,
    remap_pairs,
)
from checkpoint_storage.cli.helpers import (
    EPILOG,
    EXIT_OK,
    EXIT_PROBLEMS,
    JsonOption,
    PointerArgument,
    StorageOption,
    command_help,
    counted,
    echo,
    error,
    human_size,
    location,
    new_table,
    print_json,
    print_table,
    progress,
    run_command,
    storage_options,
)
from checkpoint_storage.spi import checkpoint_statistics

__all__ = [
    "inspect_command",
    "register",
    "statistics_lines",
    "statistics_of",
    "statistics_table",
    "verify_command",
]


def register(app: typer.Typer) -> None:
    """Add ``inspect`` and ``verify`` to the ``checkpoints`` app."""
    app.command("inspect", help=command_help(inspect_command), epilog=EPILOG)(inspect_command)
    app.command("verify", help=command_help(verify_command), epilog=EPILOG)(verify_command)


def _master_state_lines(state: dict) -> list[str]:
    """One master state for people: ``name (encoding, size): value``, or the value's lines
    indented below (schemas, text of several lines). Never cut."""
    head = f"  {state['name']} ({state['encoding'].replace('-', ' ')}, {human_size(state['size'])})"
    value = state["value"]
    if state["encoding"] == "json":
        return [f"{head}: {json.dumps(value, ensure_ascii=False)}"]
    if state["encoding"] == "arrow-schema":
        fields = [
            f"    {f['name']}: {f['type']}{'' if f['nullable'] else ' not null'}" for f in value
        ]
        return [f"{head}:", *(fields or ["    (no fields)"])]
    if state["encoding"] == "text" and "\n" in value:
        return [f"{head}:", *(f"    {line}" for line in value.splitlines())]
    return [f"{head}: {value}"]


def statistics_of(pointer: str, metadata, options: dict) -> dict:
    """The statistics of the checkpoint at ``pointer``: recorded, or derived from its handles
    and those of the checkpoints of its job directory before it (listed when needed)."""
    statistics = checkpoint_statistics(metadata)
    if statistics["recorded"]:
        return statistics
    job = pointer.rstrip("/").rpartition("/")[0]
    try:
        listed = list_checkpoints(job, storage_options=options)
    except (OSError, ValueError):  # not in a job directory: what the handles alone tell
        return statistics
    same = [i for i in listed if i.pointer.rstrip("/") == pointer.rstrip("/") and i.statistics]
    return same[0].statistics if same else statistics


def _ms(value) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _count(value, new=None) -> str:
    if value is None:
        return "-"
    return str(value) if new is None else f"{value} ({new} new)"


def statistics_lines(statistics: dict) -> list[str]:
    """The totals of checkpoint ``statistics`` for people, a few lines; ``-`` where not
    known (a checkpoint written without statistics)."""
    durations = statistics["durations_ms"]
    previous = statistics.get("previous_publication")
    lines = [
        f"  {'recorded' if statistics['recorded'] else 'derived from the handles (not recorded)'}",
        f"  written {human_size(statistics['written_size'])} of "
        f"{human_size(statistics['full_size'])} full size; files "
        f"{_count(statistics['files'])}: {_count(statistics['files_new'])} new, "
        f"{_count(statistics['files_reused'])} reused; "
        f"{_count(statistics['inline_handles'])} inline",
    ]
    if statistics["full_snapshots"] is not None or statistics["change_files"] is not None:
        lines.append(
            f"  keyed state: full snapshots "
            f"{_count(statistics['full_snapshots'], statistics['full_snapshots_new'])}, "
            f"change files {_count(statistics['change_files'], statistics['change_files_new'])}")
    lines.append(f"  rows: {_count(statistics['live_rows'])} live, "
                 f"{_count(statistics['expired_rows'])} expired")
    lines.append(
        f"  durations: batch {_ms(durations.get('batch'))}, state write "
        f"{_ms(durations.get('state_write'))}, _metadata publication "
        f"{_ms(durations.get('metadata_publication'))}"
        + (f" (of chk-{previous['checkpoint_id']}: {_ms(previous['ms'])})" if previous else ""))
    return lines


def statistics_table(statistics: dict):
    """Per stage: kind, full and written size, files (new, reused), full snapshots and
    change files (new of them), live and expired rows."""
    table = new_table(
        "STAGE", "KIND", "SIZE", "WRITTEN", "FILES", "NEW", "REUSED", "FULL SNAPSHOTS",
        "CHANGE FILES", "LIVE ROWS", "EXPIRED ROWS",
        right={"SIZE", "WRITTEN", "FILES", "NEW", "REUSED", "FULL SNAPSHOTS", "CHANGE FILES",
               "LIVE ROWS", "EXPIRED ROWS"},
    )
    for stage in statistics["stages"]:
        table.add_row(
            stage["stage"], stage["kind"] or "-", human_size(stage["full_size"]),
            human_size(stage["written_size"]), _count(stage["files"]),
            _count(stage["files_new"]), _count(stage["files_reused"]),
            _count(stage["full_snapshots"], stage["full_snapshots_new"]),
            _count(stage["change_files"], stage["change_files_new"]),
            _count(stage["live_rows"]), _count(stage["expired_rows"]),
        )
    return table


def _inspect(pointer_arg: str, as_json: bool, options: dict, remap=()) -> int:
    if is_flink_pointer(location(pointer_arg), options):
        return flink_inspect(location(pointer_arg), as_json, options, remap)
    completed = resolve_checkpoint_pointer(location(pointer_arg), options)
    metadata = completed.load_metadata()
    doc = metadata_as_json(metadata, completed.external_pointer)
    statistics = statistics_of(completed.external_pointer, metadata, options)
    if as_json:
        print_json(doc | {"statistics": statistics})
        return EXIT_OK
    handles = metadata.all_handles()
    files = sum(1 for h in handles if isinstance(h, FileStateHandle))
    segments = [h for h in handles if isinstance(h, SegmentFileStateHandle)]
    physical = len({h.path for h in segments})
    header = [
        ("pointer", doc["pointer"]),
        ("checkpoint id", str(doc["checkpoint_id"])),
        ("kind", doc["kind"]),
        (
            "properties",
            f"snapshot type {doc['properties']['snapshot_type']}, "
            f"format {doc['properties']['format_type']}",
        ),
        ("job id", doc["job_id"] or "-"),
        (
            "timestamp",
            "-" if doc["timestamp"] is None else f"{doc['timestamp']} ({doc['timestamp_ms']})",
        ),
        (
            "state size",
            f"{human_size(metadata.state_size)} ({metadata.state_size} bytes) in "
            f"{counted(len(handles), 'handle')}: {counted(files, 'file')}, "
            + (
                f"{counted(len(segments), 'segment')} in {counted(physical, 'physical file')}, "
                if segments
                else ""
            )
            + f"{len(handles) - files - len(segments)} inline",
        ),
    ]
    width = max(len(k) for k, _ in header)
    for key, value in header:
        echo(Text.assemble((f"{key + ':':<{width + 1}}", "bold"), f" {value}"))
    echo()
    echo(Text("statistics:", style="bold"))
    for line in statistics_lines(statistics):
        echo(line)
    if statistics["stages"]:
        print_table(statistics_table(statistics), indent=2)
    echo()
    echo(Text("master states:", style="bold"))
    for state in doc["master_states"]:
        for line in _master_state_lines(state):
            echo(line)
    if not doc["master_states"]:
        echo("  (none)")
    echo()
    echo(Text("operators:", style="bold"))
    if doc["operators"]:
        table = new_table(
            "OPERATOR",
            "PARALLELISM",
            "MAX",
            "SUBTASKS",
            "HANDLES",
            "SIZE",
            "LIVE ROWS",
            "EXPIRED ROWS",
            right={"PARALLELISM", "MAX", "SUBTASKS", "HANDLES", "SIZE", "LIVE ROWS",
                   "EXPIRED ROWS"},
        )
        for op in doc["operators"]:
            table.add_row(
                op["operator_id"],
                str(op["parallelism"]),
                "-" if op["max_parallelism"] is None else str(op["max_parallelism"]),
                str(len(op["subtasks"])),
                str(sum(len(s["handles"]) for s in op["subtasks"])),
                human_size(op["state_size"]),
                "-" if op["live_rows"] is None else str(op["live_rows"]),
                "-" if op["expired_rows"] is None else str(op["expired_rows"]),
            )
        print_table(table, indent=2)
    else:
        echo("  (none)")
    echo()
    echo(Text("handles:", style="bold"))
    table = new_table(
        "OPERATOR",
        "SUBTASK",
        "TYPE",
        "SIZE",
        "CRC32",
        "PATH",
        right={"SUBTASK", "SIZE"},
        pointer="PATH",
    )
    for op in doc["operators"]:
        for subtask in op["subtasks"]:
            for h in subtask["handles"]:
                table.add_row(
                    op["operator_id"],
                    str(subtask["index"]),
                    h["type"],
                    human_size(h["size"]),
                    h["crc32"] or "-",
                    _handle_where(h, doc["pointer"]),
                )
    if table.row_count:
        print_table(table, indent=2)
    else:
        echo("  (none)")
    props = [
        f"  {op['operator_id']}[{s['index']}] {key}={value}"
        for op in doc["operators"]
        for s in op["subtasks"]
        for key, value in s["properties"].items()
    ]
    if props:
        echo()
        echo(Text("subtask properties:", style="bold"))
        for line in props:
            echo(line)
    return EXIT_OK


def _handle_where(h: dict, pointer: str) -> str:
    if h["type"] == "inline":
        return _below(h["name"], pointer) + " (inline)"
    if h["type"] == "segment":
        return (
            f"{_below(h['path'], pointer.rstrip('/').rpartition('/')[0])}"
            f"[{h['start']}:{h['start'] + h['size']}] ({h['scope']})"
        )
    return h["relative_path"] or _below(h["path"], pointer)


def _below(path: str, directory: str) -> str:
    """``path`` relative to ``directory`` when it lies below it (shorter tables)."""
    prefix = directory.rstrip("/") + "/"
    return path[len(prefix) :] if path.startswith(prefix) else path


def _verify(pointer_arg: str, as_json: bool, options: dict, remap=()) -> int:
    if is_flink_pointer(location(pointer_arg), options):
        return flink_verify(location(pointer_arg), as_json, options, remap)
    completed = resolve_checkpoint_pointer(location(pointer_arg), options)
    with progress("verifying") as update:
        report = verify_checkpoint(completed, progress=update)
    if as_json:
        print_json(
            {
                "pointer": report.pointer,
                "checkpoint_id": report.checkpoint_id,
                "ok": report.ok,
                "handles_checked": report.handles_checked,
                "bytes_read": report.bytes_read,
                "problems": [
                    {"path": p.path, "kind": p.kind, "reason": p.reason} for p in report.problems
                ],
            }
        )
    else:
        verdict = "ok" if report.ok else counted(len(report.problems), "problem")
        echo(
            f"{report.pointer}: checkpoint {report.checkpoint_id}, "
            f"{counted(report.handles_checked, 'handle')}, {human_size(report.bytes_read)} read: "
            f"{verdict}"
        )
        if report.problems:
            table = new_table("PROBLEM", "PATH", pointer="PATH")
            for p in report.problems:
                table.add_row(Text(p.kind, style="red"), p.path)
            print_table(table)
            for p in report.problems:
                echo(f"{p.kind}: {p.reason}")
    if report.ok:
        return EXIT_OK
    verdicts = [p for p in report.problems if p.kind in ("missing", "corrupt")]
    first = (verdicts or list(report.problems))[0]
    error(
        f"verification of {report.pointer} found {counted(len(report.problems), 'problem')}; "
        f"first: {first.reason}"
    )
    return EXIT_PROBLEMS



def inspect_command(
    pointer: PointerArgument,
    json_output: JsonOption = False,
    storage_option: StorageOption = None,
    remap: RemapOption = None,
) -> None:
    """The metadata of a checkpoint or savepoint.

    Shows the _metadata of POINTER (a checkpoint or savepoint directory, or its _metadata
    file): job id, timestamp, properties, master states decoded (JSON in full, Arrow
    schemas as their fields, text; anything else as base64), operators, subtasks and state
    handles (type, path or inline size, size, CRC-32), and its statistics: bytes written
    against full size, files new and reused, full snapshots and change files, live and
    expired rows, durations, per stage and in total (recorded, or derived from the handles
    for a checkpoint written without them: "-" where not known). JSON: master_states is a
    list of name, size, encoding (json / arrow-schema / text / base64), value and base64;
    statistics as docs/operations.md describes them.

    An Apache Flink checkpoint or savepoint (docs/storage-flink.md) is shown as Flink wrote
    it: format version, properties, operators (name, uid, parallelism), subtasks' handles
    with their key groups, files and sizes, and the referenced files that are missing;
    --remap OLD=NEW reads paths Flink wrote on another machine.
    """
    run_command(
        lambda: _inspect(
            pointer, json_output, storage_options(storage_option), remap_pairs(remap)
        )
    )


def verify_command(
    pointer: PointerArgument,
    json_output: JsonOption = False,
    storage_option: StorageOption = None,
    remap: RemapOption = None,
) -> None:
    """Read every state file and check sizes and checksums.

    Reads every state file POINTER references and checks its size and CRC-32. Exits 1 naming
    each missing, corrupt or unreadable file; 4 if _metadata itself is invalid. JSON keys:
    pointer, checkpoint_id, ok, handles_checked, bytes_read, problems (path, kind, reason).

    For an Apache Flink checkpoint or savepoint (docs/storage-flink.md): every file its
    handles reference exists and is at least as large as their offsets and sizes need
    (Flink's handles carry no checksum); --remap OLD=NEW reads paths Flink wrote on another
    machine. JSON keys: pointer, format, checkpoint_id, ok, files_checked, bytes_in_files,
    inline_bytes, problems.
    """
    run_command(
        lambda: _verify(
            pointer, json_output, storage_options(storage_option), remap_pairs(remap)
        )
    )

