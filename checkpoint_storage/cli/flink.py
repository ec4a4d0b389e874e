"""``checkpoints orphans`` and ``checkpoints read-flink``, and ``list``, ``inspect`` and
``verify`` of Apache Flink's checkpoints and savepoints (``listing`` and ``inspecting`` hand
Flink's directories to ``flink_list``, ``flink_inspect`` and ``flink_verify``).

Paths Flink wrote on another machine are read through ``--remap OLD=NEW`` (repeatable).
The Flink reader (``checkpoint_storage.flink``) is imported when a command needs it, so that
``--help``, completion and ``list`` of this library's directories do not load it.
"""

import posixpath
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated

import typer

from checkpoint_storage import CheckpointInfo, format_age, format_size
from checkpoint_storage.cli.helpers import (
    EPILOG,
    EXIT_INVALID,
    EXIT_OK,
    EXIT_PROBLEMS,
    JsonOption,
    StorageOption,
    UsageError,
    command_help,
    echo,
    error,
    location,
    new_table,
    parse_duration,
    print_json,
    print_table,
    run_command,
    storage_options,
)
from checkpoint_storage.exceptions import CheckpointStorageError

if TYPE_CHECKING:
    from checkpoint_storage.flink import FlinkCheckpointMetadata, FlinkStreamHandle, OrphanReport

__all__ = [
    "RemapOption",
    "flink_inspect",
    "flink_list",
    "flink_verify",
    "is_flink_pointer",
    "orphans_command",
    "read_command",
    "register",
    "remap_pairs",
]

DEFAULT_GRACE = "1h"  # as gc's

RemapOption = Annotated[
    list[str] | None,
    typer.Option(
        "--remap",
        metavar="OLD=NEW",
        help="read the absolute paths Flink wrote below OLD (on another machine) below NEW "
        "(repeatable; file: URLs and plain paths alike)",
        show_default=False,
    ),
]


def _reader():
    """``checkpoint_storage.flink``, imported on first use (see the module docstring)."""
    import checkpoint_storage.flink

    return checkpoint_storage.flink


def remap_pairs(remap: list[str] | None) -> tuple[tuple[str, str], ...]:
    if not remap:
        return ()
    try:
        return _reader().parse_remap(remap)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def register(app: typer.Typer) -> None:
    """Add ``orphans`` and ``read-flink`` to the ``checkpoints`` app."""
    app.command("orphans", help=command_help(orphans_command), epilog=EPILOG)(orphans_command)
    app.command("read-flink", help=command_help(read_command), epilog=EPILOG)(read_command)


# --- hooks -------------------------------------------------------------------------------


def is_flink_pointer(pointer: str, options: dict) -> bool:
    """Whether POINTER (a checkpoint/savepoint directory or its `_metadata`) is Flink's."""
    try:
        return _reader().is_flink_checkpoint(pointer, options)
    except (OSError, ValueError):
        return False


# --- list --------------------------------------------------------------------------------


def _summary(pointer: str, m: "FlinkCheckpointMetadata", options: dict) -> dict:
    files = m.referenced_files()
    return {
        "pointer": pointer,
        "format": "Apache Flink",
        "format_version": m.version,
        "checkpoint_id": m.checkpoint_id,
        "kind": m.kind,
        "type": m.properties.type_name if m.properties else None,
        "savepoint_format": m.properties.format_type if m.properties else None,
        "status": "completed",
        "reason": None,
        "operators": len(m.operators),
        "subtasks": sum(len(op.subtasks) for op in m.operators),
        "inline_bytes": m.inline_bytes(),
        "file_bytes": sum(r.needed_bytes for r in files.values()),
        "files": len(files),
        "metadata_bytes": m.metadata_size,
    }


def flink_list(infos: list[CheckpointInfo], as_json: bool, options: dict, remap, shown=str) -> int:
    """``list`` of directories that hold only Flink's checkpoints and savepoints (``infos``,
    as ``list_checkpoints_below`` found them): each one's `_metadata` read; ``shown`` turns a
    pointer into what is printed (``--relative``)."""
    rows = []
    for info in infos:
        try:
            m = _reader().read_flink_checkpoint(info.pointer, options, remap)
            rows.append(_summary(info.pointer, m, options))
        except (CheckpointStorageError, OSError, ValueError) as exc:
            rows.append(
                {
                    "pointer": info.pointer,
                    "format": "Apache Flink",
                    "checkpoint_id": info.checkpoint_id,
                    "kind": "unknown",
                    "status": "invalid",
                    "reason": str(exc),
                }
            )
    # By directory (a job's checkpoints, then savepoints), then id.
    rows.sort(key=lambda row: (posixpath.dirname(row["pointer"]), row.get("checkpoint_id") or 0))
    for row in rows:
        row["pointer"] = shown(row["pointer"])
    if as_json:
        print_json(rows)
        return EXIT_OK
    table = new_table(
        "ID", "KIND", "TYPE", "OPERATORS", "FILES", "IN FILES", "INLINE", "POINTER",
        right={"ID", "OPERATORS", "FILES", "IN FILES", "INLINE"},
        pointer="POINTER",
    )  # fmt: skip
    for row in rows:
        if row["status"] != "completed":
            table.add_row("-", "invalid", "-", "-", "-", "-", "-", row["pointer"])
            continue
        kind = row["kind"] + (
            f" ({row['savepoint_format'].lower()})" if row["savepoint_format"] else ""
        )
        table.add_row(
            str(row["checkpoint_id"]),
            kind,
            row["type"] or "-",
            str(row["operators"]),
            str(row["files"]),
            format_size(row["file_bytes"]),
            format_size(row["inline_bytes"]),
            row["pointer"],
        )
    echo("Apache Flink checkpoints and savepoints")
    print_table(table)
    for row in rows:
        if row["status"] != "completed":
            echo(f"invalid: {row['pointer']}: {row['reason']}")
    return EXIT_OK


# --- inspect -----------------------------------------------------------------------------


def _stream_json(h: "FlinkStreamHandle | None", exists: dict[str, int | None]) -> dict | None:
    if h is None:
        return None
    doc = {"type": h.type_name, "tag": h.tag, "size": h.size, "inline": h.inline}
    if h.inline:
        doc["name"] = h.name
    if h.path is not None:
        doc["path"] = h.path
        doc["written_path"] = h.written_path or h.relative_path
        doc["file_size"] = exists.get(h.path)
        doc["missing"] = exists.get(h.path) is None
    if h.tag == 15:
        doc.update(start=h.start, scope=h.scope, logical_file_id=h.logical_file_id)
    return doc


def _handle_json(handle, exists) -> dict | None:
    if handle is None:
        return None
    doc: dict = {"type": handle.type_name, "tag": handle.tag}
    if hasattr(handle, "key_groups"):
        doc["key_groups"] = list(handle.key_groups)
        if handle.checkpoint_id is None:
            doc["offsets"] = list(handle.offsets)
            doc["delegate"] = _stream_json(handle.delegate, exists)
        else:
            doc.update(
                checkpoint_id=handle.checkpoint_id,
                backend_id=handle.backend_id,
                checkpointed_size=handle.checkpointed_size,
                meta=_stream_json(handle.meta, exists),
                shared=[
                    {"local_path": p, "handle": _stream_json(h, exists)} for p, h in handle.shared
                ],
                private=[
                    {"local_path": p, "handle": _stream_json(h, exists)} for p, h in handle.private
                ],
            )
        doc["state_handle_id"] = handle.state_handle_id
    else:
        doc["states"] = [
            {"name": n, "mode": mode, "offsets": list(o)} for n, mode, o in handle.states
        ]
        doc["delegate"] = _stream_json(handle.delegate, exists)
        if handle.tag == 17:
            doc.update(
                task_owned_dir=handle.task_owned_dir,
                shared_dir=handle.shared_dir,
                empty=handle.empty,
            )
    return doc


def _file_sizes(m: "FlinkCheckpointMetadata", options: dict) -> dict[str, int | None]:
    sizes: dict[str, int | None] = {}
    for path in m.referenced_files():
        try:
            sizes[path] = _reader().file_size(path, options)
        except OSError:
            sizes[path] = None
    return sizes


def flink_document(m: "FlinkCheckpointMetadata", options: dict) -> dict:
    sizes = _file_sizes(m, options)
    doc = _summary(m.directory, m, options)
    doc["properties"] = (
        None
        if m.properties is None
        else {
            "kind": m.properties.kind,
            "type": m.properties.type_name,
            "format_type": m.properties.format_type,
            "post_checkpoint_action": m.properties.post_checkpoint_action,
            "sharing_files_strategy": m.properties.sharing_files_strategy,
            **m.properties.flags,
        }
    )
    doc["master_states"] = [
        {"name": s.name, "version": s.version, "size": len(s.data)} for s in m.master_states
    ]
    doc["operators"] = [
        {
            "operator_id": op.operator_id,
            "name": op.name,
            "uid": op.uid,
            "parallelism": op.parallelism,
            "max_parallelism": op.max_parallelism,
            "fully_finished": op.fully_finished,
            "coordinator_state": _stream_json(op.coordinator_state, sizes),
            "subtasks": [
                {
                    "index": s.index,
                    "finished": s.finished,
                    "managed_operator_state": _handle_json(s.managed_operator_state, sizes),
                    "raw_operator_state": _handle_json(s.raw_operator_state, sizes),
                    "managed_keyed_state": _handle_json(s.managed_keyed_state, sizes),
                    "raw_keyed_state": _handle_json(s.raw_keyed_state, sizes),
                }
                for s in op.subtasks
            ],
        }
        for op in m.operators
    ]
    doc["referenced_files"] = [
        {
            "path": path,
            "needed_bytes": ref.needed_bytes,
            "handle_size": ref.whole_file_size,
            "file_size": sizes[path],
            "missing": sizes[path] is None,
            "handles": ref.handles,
        }
        for path, ref in sorted(m.referenced_files().items())
    ]
    doc["missing_files"] = sorted(p for p, size in sizes.items() if size is None)
    return doc


def _where(h: "FlinkStreamHandle", directory: str) -> str:
    if h.inline:
        return "inline"
    if h.path is None:
        return "(empty segment)"
    prefix = directory.rstrip("/") + "/"
    where = h.path[len(prefix) :] if h.path.startswith(prefix) else h.path
    return f"{where} @{h.start}" if h.tag == 15 else where


def flink_inspect(pointer: str, as_json: bool, options: dict, remap) -> int:
    m = _reader().read_flink_checkpoint(pointer, options, remap)
    doc = flink_document(m, options)
    if as_json:
        print_json(doc)
        return EXIT_OK
    props = m.properties
    header = [
        ("pointer", m.directory),
        ("written by", f"Apache Flink (metadata format version {m.version})"),
        ("checkpoint id", str(m.checkpoint_id)),
        ("kind", m.kind if props is None else f"{m.kind}: {props.type_name}"),
    ]
    if props is not None and props.format_type:
        header.append(("savepoint format", props.format_type))
    header += [
        ("master states", ", ".join(s.name for s in m.master_states) or "none"),
        ("_metadata", format_size(m.metadata_size)),
        ("state inline", format_size(doc["inline_bytes"])),
        ("state in files", f"{format_size(doc['file_bytes'])} in {doc['files']} files"),
    ]
    width = max(len(k) for k, _ in header)
    for key, value in header:
        echo(f"{key + ':':<{width + 1}} {value}")
    echo()
    ops = new_table(
        "OPERATOR", "UID", "ID", "PARALLELISM", "MAX", "SUBTASKS",
        right={"PARALLELISM", "MAX", "SUBTASKS"},
    )  # fmt: skip
    for op in m.operators:
        ops.add_row(
            op.name or "-",
            op.uid or "-",
            op.operator_id,
            str(op.parallelism),
            str(op.max_parallelism),
            "finished" if op.fully_finished else str(len(op.subtasks)),
        )
    print_table(ops)
    echo()
    handles = new_table(
        "OPERATOR", "SUBTASK", "STATE", "HANDLE", "KEY GROUPS", "FILE", "SIZE",
        right={"SUBTASK", "SIZE"},
        fold={"FILE"},
    )  # fmt: skip
    for op in m.operators:
        for s in op.subtasks:
            for label, handle in (
                ("managed operator", s.managed_operator_state),
                ("raw operator", s.raw_operator_state),
                ("managed keyed", s.managed_keyed_state),
                ("raw keyed", s.raw_keyed_state),
            ):
                if handle is None:
                    continue
                kg = getattr(handle, "key_groups", None)
                kg_text = f"{kg[0]}-{kg[1]}" if kg else ""
                for stream in handle.stream_handles():
                    handles.add_row(
                        op.name or op.operator_id,
                        str(s.index),
                        label,
                        f"{handle.type_name} / {stream.type_name}",
                        kg_text,
                        _where(stream, m.directory),
                        format_size(stream.size),
                    )
    print_table(handles)
    for path in doc["missing_files"]:
        echo(f"missing: {path}")
    return EXIT_OK


# --- verify ------------------------------------------------------------------------------


def flink_verify(pointer: str, as_json: bool, options: dict, remap) -> int:
    report = _reader().verify_flink_checkpoint(pointer, options, remap)
    if as_json:
        print_json(
            {
                "pointer": report.pointer,
                "format": "Apache Flink",
                "checkpoint_id": report.checkpoint_id,
                "ok": report.ok,
                "files_checked": report.files_checked,
                "bytes_in_files": report.bytes_in_files,
                "inline_bytes": report.inline_bytes,
                "problems": [
                    {"path": p.path, "kind": p.kind, "reason": p.reason} for p in report.problems
                ],
            }
        )
    else:
        verdict = "ok" if report.ok else f"{len(report.problems)} problem(s)"
        echo(
            f"{report.pointer}: Apache Flink checkpoint {report.checkpoint_id}, "
            f"{report.files_checked} files ({format_size(report.bytes_in_files)}), "
            f"{format_size(report.inline_bytes)} inline: {verdict}"
        )
        for p in report.problems:
            echo(f"{p.kind}: {p.reason}")
        if any(p.kind == "missing" for p in report.problems) and not remap:
            echo("if Flink wrote these paths on another machine, map them with --remap OLD=NEW")
    if report.ok:
        return EXIT_OK
    error(
        f"verification of {report.pointer} found {len(report.problems)} problem(s); "
        f"first: {report.problems[0].reason}"
    )
    return EXIT_PROBLEMS


# --- orphans -----------------------------------------------------------------------------


def _orphans_json(report: "OrphanReport", now: datetime) -> dict:
    def age(moment):
        return None if moment is None else round((now - moment).total_seconds(), 3)

    return {
        "job_dir": report.job_dir,
        "listed_at": report.listed_at.isoformat(),
        "retained": [
            {"pointer": c.pointer, "checkpoint_id": c.checkpoint_id, "writer": c.writer}
            for c in report.retained
        ],
        "unreadable": [{"pointer": u.pointer, "reason": u.reason} for u in report.unreadable],
        "incomplete": list(report.incomplete),
        "orphans": [
            {
                "path": o.path,
                "size": o.size,
                "modified": None if o.modified is None else o.modified.isoformat(),
                "age_seconds": age(o.modified),
            }
            for o in report.orphans
        ],
        "orphan_bytes": report.orphan_bytes,
        "referenced_inside": report.referenced_inside,
        "external": [
            {
                "path": e.path,
                "size": e.size,
                "missing": e.missing,
                "checkpoint_ids": list(e.checkpoint_ids),
            }
            for e in report.external
        ],
        "protected_by_others": list(report.protected_by_others),
    }


def _confirmed(report: "OrphanReport", yes: bool) -> bool:
    if yes:
        return True
    if not sys.stdin.isatty():
        raise UsageError("--delete needs confirmation: add --yes (no terminal to ask on)")
    answer = input(
        f"delete {len(report.orphans)} orphan file(s), {format_size(report.orphan_bytes)} "
        f"(older than the grace period) under {report.job_dir}? type 'yes': "
    )
    return answer.strip().lower() == "yes"


def _orphans(
    job_dir: str,
    as_json: bool,
    options: dict,
    remap,
    *,
    also: list[str],
    delete: bool,
    yes: bool,
    grace: str,
) -> int:
    directory = location(job_dir)
    grace_period = parse_duration(grace)
    others = [location(d) for d in also]
    report = _reader().find_orphans(
        directory, storage_options=options, remap=remap, also_referenced_by=others
    )
    now = datetime.now(UTC)
    doc = _orphans_json(report, now)
    if not as_json:
        retained = ", ".join(f"{c.checkpoint_id}" for c in report.retained) or "none"
        echo(f"{report.job_dir}: retained checkpoints {retained}")
        table = new_table("ORPHAN", "SIZE", "AGE", right={"SIZE", "AGE"}, fold={"ORPHAN"})
        for o in report.orphans:
            table.add_row(o.path, format_size(o.size), format_age(o.age(now), compact=True))
        if report.orphans:
            print_table(table)
        echo(
            f"{len(report.orphans)} orphan file(s), {format_size(report.orphan_bytes)}; "
            f"{report.referenced_inside} referenced file(s) inside the job directory"
        )
        if report.external:
            echo(f"referenced outside {report.job_dir} (kept there):")
            ext = new_table("FILE", "SIZE", "CHECKPOINTS", right={"SIZE"}, fold={"FILE"})
            for e in report.external:
                size = "MISSING" if e.missing else format_size(e.size)
                ext.add_row(e.path, size, ",".join(map(str, e.checkpoint_ids)))
            print_table(ext)
        for path in report.protected_by_others:
            echo(f"kept (referenced by --also-referenced-by): {path}")
        for u in report.unreadable:
            echo(f"unreadable (kept, blocks deletion): {u.pointer}: {u.reason}")
        for p in report.incomplete:
            echo(f"no _metadata (in progress or failed; its files are in the grace): {p}")
    if not delete:
        if as_json:
            print_json({**doc, "deleted": [], "dry_run": True})
        return EXIT_INVALID if report.unreadable else EXIT_OK
    if not report.orphans:
        if as_json:
            print_json({**doc, "deleted": [], "dry_run": False})
        return EXIT_OK
    if not _confirmed(report, yes):
        echo("nothing deleted")
        return EXIT_OK
    result = _reader().delete_orphans(
        report, confirm=True, grace_period=grace_period, storage_options=options
    )
    if as_json:
        print_json(
            {
                **doc,
                "dry_run": False,
                "deleted": list(result.deleted),
                "bytes_deleted": result.bytes_deleted,
                "kept_young": list(result.kept_young),
                "kept_referenced": list(result.kept_referenced),
                "failed": [{"path": p, "reason": r} for p, r in result.failed],
            }
        )
    else:
        echo(
            f"deleted {len(result.deleted)} file(s), {format_size(result.bytes_deleted)}; "
            f"kept {len(result.kept_young)} younger than {grace}"
        )
        for path, reason in result.failed:
            echo(f"not deleted: {path}: {reason}")
    return EXIT_PROBLEMS if result.failed else EXIT_OK


def orphans_command(
    job_dir: Annotated[str, typer.Argument(metavar="JOB_DIR", show_default=False)],
    delete: Annotated[
        bool, typer.Option("--delete", help="delete the orphans (asks first, unless --yes)")
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", help="confirm --delete without asking")] = False,
    grace: Annotated[
        str,
        typer.Option(
            "--grace",
            metavar="DURATION",
            help="never delete a file younger than this (e.g. 30m, 1h, 2d); must exceed the "
            "longest checkpoint's duration",
        ),
    ] = DEFAULT_GRACE,
    also_referenced_by: Annotated[
        list[str] | None,
        typer.Option(
            "--also-referenced-by",
            metavar="DIR",
            help="another job directory (or savepoint directory) whose checkpoints may "
            "reference files here, e.g. a job restored from this one in CLAIM mode "
            "(repeatable): what they reference is never deleted",
            show_default=False,
        ),
    ] = None,
    remap: RemapOption = None,
    json_output: JsonOption = False,
    storage_option: StorageOption = None,
) -> None:
    """Files of a job directory that no retained checkpoint references.

    Lists the files under JOB_DIR/shared/ and JOB_DIR/taskowned/ (Apache Flink's or this
    library's job directory) that no retained checkpoint (chk-<id> with a _metadata)
    references, with sizes and ages, and the files its checkpoints reference outside
    JOB_DIR (another job's shared/, as after a restore in CLAIM mode). Deletes nothing
    unless --delete (confirmed interactively or with --yes); then lists again first and
    refuses if the retained checkpoints changed, skips files younger than --grace, and
    never deletes what a checkpoint under --also-referenced-by references. A _metadata
    that cannot be read is reported, blocks deletion and exits 4. JSON keys: job_dir,
    listed_at, retained, unreadable, incomplete, orphans (path, size, modified,
    age_seconds), orphan_bytes, referenced_inside, external (path, size, missing,
    checkpoint_ids), protected_by_others, dry_run, deleted.
    """
    run_command(
        lambda: _orphans(
            job_dir,
            json_output,
            storage_options(storage_option),
            remap_pairs(remap),
            also=also_referenced_by or [],
            delete=delete,
            yes=yes,
            grace=grace,
        )
    )


# --- read --------------------------------------------------------------------------------


def _read(
    pointer: str, as_json: bool, options: dict, remap, operator: str | None, python_type
) -> int:
    m = _reader().read_flink_checkpoint(location(pointer), options, remap)
    result = _reader().read_heap_value_rows(
        m, options, operator=operator, python_value_type=python_type
    )
    if as_json:
        print_json(
            {
                "pointer": m.directory,
                "operator": result.operator,
                "states": result.states,
                "rows": [
                    {"key_group": r.key_group, "state": r.state, "key": r.key, "value": r.value}
                    for r in result.rows
                ],
            }
        )
        return EXIT_OK
    table = new_table("KEY GROUP", "STATE", "KEY", "VALUE", right={"KEY GROUP"})
    for r in result.rows:
        table.add_row(str(r.key_group), r.state, repr(r.key), repr(r.value))
    print_table(table)
    echo(f"{len(result.rows)} row(s) of operator {result.operator}")
    return EXIT_OK


def read_command(
    pointer: Annotated[str, typer.Argument(metavar="POINTER", show_default=False)],
    operator: Annotated[
        str | None,
        typer.Option("--operator", help="operator uid, name or id (default: the only keyed one)"),
    ] = None,
    python_value_type: Annotated[
        str | None,
        typer.Option(
            "--python-value-type",
            metavar="TYPE",
            help="decode PyFlink state values as long, int, double or boolean (default: hex)",
        ),
    ] = None,
    remap: RemapOption = None,
    json_output: JsonOption = False,
    storage_option: StorageOption = None,
) -> None:
    """Keyed ValueState rows of a Flink canonical savepoint.

    Prints the ValueState rows (key group, state, key, value) of an operator of the Apache
    Flink canonical savepoint POINTER (heap or RocksDB backend: the layout is the same),
    where keys and values use Flink's primitive serializers (int, long, short, byte,
    boolean, float, double, char, String; Rows of them as keys). PyFlink's states are
    read too: their values are the bytes PyFlink's coder wrote, printed as hex or decoded
    with --python-value-type. Checkpoints and native savepoints, list/map state of Java
    types, windows, TTL, compressed key groups and POJO/Kryo/Avro types are not supported
    and are refused naming what was found (exit 4). JSON keys: pointer, operator, states,
    rows (key_group, state, key, value).
    """
    run_command(
        lambda: _read(
            pointer,
            json_output,
            storage_options(storage_option),
            remap_pairs(remap),
            operator,
            python_value_type,
        )
    )
