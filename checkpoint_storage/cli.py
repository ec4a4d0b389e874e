"""``checkpoints``: look at and tidy checkpoint and savepoint directories.

Commands::

    checkpoints list DIR                  checkpoints and savepoints of a job or base directory
    checkpoints inspect POINTER           the `_metadata` of a checkpoint or savepoint
    checkpoints verify POINTER            read every state file, check sizes and checksums
    checkpoints latest DIR                the pointer of a job's latest completed checkpoint
    checkpoints gc DIR                    delete unreferenced files of a job (--dry-run first)
    checkpoints dispose-savepoint POINTER delete a savepoint, `_metadata` first (alias:
                                          dispose; --corrupt for a corrupt checkpoint)
    checkpoints copy-savepoint POINTER TARGET
                                          copy a savepoint elsewhere (e.g. local disk to S3)
    checkpoints lease show DIR            who holds the job directory's lease (one coordinator
                                          per job), its epoch and when it expires
    checkpoints lease break DIR           break a stale lease (--force: also a live one)

DIR and POINTER are local paths, ``file:`` URLs (``file:/abs``, ``file:///abs``,
``file://localhost/abs``, percent-encoded) or fsspec URLs (``s3://bucket/cp/<job_id>``), under
the rule a run's ``restore_from`` follows too: a relative path may start with ``./`` or
``../``; any other ``.`` or ``..`` segment is refused (exit 2). Every command
prints an aligned table by default and JSON with ``--json``. Progress bars go to stderr, only
when stderr is a terminal.

Storage options (fsspec keyword arguments such as an S3 ``endpoint_url``) come from
``--storage-option KEY=VALUE`` (repeatable; VALUE is parsed as JSON when it parses, else taken
as text) on top of the environment variable ``CHECKPOINTS_STORAGE_OPTIONS`` (a JSON object).
``copy-savepoint`` takes the target's from ``--target-storage-option`` /
``CHECKPOINTS_TARGET_STORAGE_OPTIONS`` (default: the source's). Option values are never
printed, not in errors and not in JSON; credentials belong in the environment anyway.

Exit codes::

    0  success (gc: also when there was nothing to delete)
    1  verify reported problems (a missing, corrupt or unreadable state file); gc or
       dispose-savepoint could not delete everything it tried to
    2  usage error: bad arguments or options, or a refused operation (e.g. dispose-savepoint
       of a checkpoint, or lease break of a lease still held, without --force)
    3  not found: no checkpoint at POINTER, DIR does not exist, or (latest) no completed
       checkpoint
    4  invalid, corrupt or foreign checkpoint: `_metadata` is truncated, corrupt, unsafe,
       of another checkpoint id than its chk-<id>, or written by another system (Apache
       Flink) or a newer version; gc: it kept checkpoints like that (and named them)
    5  any other error, e.g. an I/O error of the storage or a `_metadata` that cannot be
       opened (gc: it kept such checkpoints)

Errors are one line on stderr: ``checkpoints: error: <message>``.
"""

import argparse
import base64
import json
import logging
import os
import re
import sys
import textwrap
import threading
import time
from datetime import UTC, datetime, timedelta

from checkpoint_storage._access import resolve_checkpoint_pointer
from checkpoint_storage._filesystems import (
    format_size,
    normalize_pointer,
    parent_and_name,
    url_to_fs,
)
from checkpoint_storage._gc import SKIPPED_UNREADABLE
from checkpoint_storage._handles import (
    ByteStreamStateHandle,
    FileStateHandle,
    RelativeFileStateHandle,
    SegmentFileStateHandle,
)
from checkpoint_storage._ids import JobID
from checkpoint_storage._lease import (
    LeaseRecord,
    break_job_lease,
    default_lease_owner,
    read_job_lease,
)
from checkpoint_storage._metadata import CheckpointMetadata
from checkpoint_storage._tools import (
    CheckpointInfo,
    copy_savepoint,
    corruption_of,
    dispose_savepoint,
    job_storage,
    latest_checkpoint,
    list_checkpoints,
    snapshot_kind,
    verify_checkpoint,
)
from checkpoint_storage.exceptions import (
    InvalidCheckpointError,
    JobLeaseHeldError,
    UnsafePathError,
)

__all__ = ["main"]

PROG = "checkpoints"
ENV_OPTIONS = "CHECKPOINTS_STORAGE_OPTIONS"
ENV_TARGET_OPTIONS = "CHECKPOINTS_TARGET_STORAGE_OPTIONS"

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_INVALID = 4
EXIT_ERROR = 5

DEFAULT_GRACE_PERIOD = "1h"
MIN_MASKED_LENGTH = 4  # shorter option values are not masked in error text (too ambiguous)

EPILOG = f"""\
storage options:
  --storage-option KEY=VALUE (repeatable) on top of ${ENV_OPTIONS} (a JSON object);
  VALUE is parsed as JSON when it parses, else taken as text. Values are never printed.

exit codes:
  0  success (gc: also when there was nothing to delete)
  1  verify reported problems; gc or dispose-savepoint could not delete everything
  2  usage error (bad arguments, or a refused operation)
  3  checkpoint or directory not found (latest: no completed checkpoint)
  4  invalid, corrupt or foreign (e.g. Apache Flink's) checkpoint; gc kept such ones
  5  other error (e.g. storage I/O, a _metadata that cannot be opened)
"""


class UsageError(Exception):
    """Bad arguments or options: exit code 2."""


# --- redaction of storage option values --------------------------------------------------


class _Redactor:
    """Replaces every storage option value in text printed by this command."""

    def __init__(self) -> None:
        self._secrets: set[str] = set()

    def add_raw(self, value: str) -> None:
        """A value as typed: JSON objects and lists are searched for text values; JSON
        booleans, numbers and null are not secrets."""
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        if isinstance(parsed, dict | list):
            self.add(value)
        self.add_value(parsed)

    def add_value(self, value: object) -> None:
        if isinstance(value, dict):
            for item in value.values():
                self.add_value(item)
        elif isinstance(value, list | tuple):
            for item in value:
                self.add_value(item)
        elif isinstance(value, str):
            self.add(value)

    def add(self, text: str) -> None:
        if len(text) >= MIN_MASKED_LENGTH:
            self._secrets.add(text)

    def __call__(self, text: str) -> str:
        for secret in sorted(self._secrets, key=len, reverse=True):
            text = text.replace(secret, "***")
        return text


_redact = _Redactor()


def _prescan_secrets(argv: list[str]) -> None:
    """Register option values before argparse sees them, so that even argparse's own error
    messages cannot echo them."""
    flags = ("--storage-option", "--target-storage-option", "-o")
    for index, arg in enumerate(argv):
        value = None
        if arg in flags:
            value = argv[index + 1] if index + 1 < len(argv) else None
        elif arg.startswith("-o") and not arg.startswith("--"):
            value = arg[2:].lstrip("=")
        else:
            for flag in flags[:2]:
                if arg.startswith(flag + "="):
                    value = arg[len(flag) + 1 :]
        if value is not None:
            _redact.add_raw(value.partition("=")[2] if "=" in value else value)
    for name in (ENV_OPTIONS, ENV_TARGET_OPTIONS):
        raw = os.environ.get(name)
        if raw:
            _redact.add_raw(raw)


def _parse_options(env_name: str, flags: list[str] | None) -> dict:
    options: dict = {}
    raw = os.environ.get(env_name)
    if raw and raw.strip():
        try:
            parsed = json.loads(raw)
        except ValueError:
            raise UsageError(
                f"${env_name} is not valid JSON: it must be a JSON object of storage options"
            ) from None
        if not isinstance(parsed, dict):
            raise UsageError(f"${env_name} must be a JSON object of storage options")
        options.update(parsed)
    for item in flags or ():
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError("storage options are given as KEY=VALUE (the '=' is missing)")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    _redact.add_value(options)
    return options


# --- output helpers ----------------------------------------------------------------------


def _size(n: int | None) -> str:
    return "-" if n is None else format_size(n)


def _age(delta: timedelta | None) -> str:
    if delta is None:
        return "-"
    seconds = max(0, int(delta.total_seconds()))
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= length:
            return f"{seconds // length}{unit}"
    return f"{seconds}s"


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _iso(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _crc(checksum: int | None) -> str | None:
    return None if checksum is None else f"{checksum:08x}"


def _preview(data: bytes, limit: int = 40) -> str:
    text = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in data[:limit])
    return text + ("…" if len(data) > limit else "")


def _table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: list[str]) -> str:
        parts = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(cells)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2, sort_keys=False))


class _ProgressBar:
    """A progress bar on stderr, only when stderr is a terminal; safe to call from threads."""

    def __init__(self, label: str, stream=None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        try:
            self._enabled = self._stream.isatty()
        except (AttributeError, ValueError):
            self._enabled = False
        self._label = label
        self._lock = threading.Lock()
        self._last = 0.0
        self._shown = False

    def __call__(self, done: int, total: int) -> None:
        if not self._enabled:
            return
        now = time.monotonic()
        with self._lock:
            if done < total and now - self._last < 0.1:
                return
            self._last = now
            fraction = done / total if total else 1.0
            filled = int(fraction * 30)
            self._stream.write(
                f"\r{self._label} [{'#' * filled}{'.' * (30 - filled)}] {fraction:4.0%} "
                f"{_size(done)} / {_size(total)}\x1b[K"
            )
            self._stream.flush()
            self._shown = True

    def close(self) -> None:
        with self._lock:
            if self._shown:
                self._stream.write("\n")
                self._stream.flush()
                self._shown = False


class _Spinner:
    """Elapsed time on stderr while an operation without progress reports runs (TTY only)."""

    def __init__(self, label: str) -> None:
        self._label = label
        self._enabled = sys.stderr.isatty()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "_Spinner":
        if self._enabled:
            self._thread.start()
        return self

    def _run(self) -> None:
        start = time.monotonic()
        frames = "|/-\\"
        i = 0
        while not self._stop.wait(0.2):
            elapsed = int(time.monotonic() - start)
            sys.stderr.write(f"\r{self._label} {frames[i % 4]} {elapsed}s\x1b[K")
            sys.stderr.flush()
            i += 1

    def __exit__(self, *exc_info) -> None:
        if self._enabled:
            self._stop.set()
            self._thread.join()
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


# --- arguments ---------------------------------------------------------------------------


def _location(arg: str) -> str:
    """A DIR/POINTER/TARGET argument under the library's one pointer rule
    (``normalize_pointer``: ``file:`` URLs, relative paths, no '.'/'..' inside), after ``~``
    expansion as a shell does."""
    if not arg or not arg.strip():
        raise UsageError("an empty path was given")
    if arg.startswith("~"):
        arg = os.path.expanduser(arg)
    try:
        return normalize_pointer(arg)
    except (UnsafePathError, ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """``3600``, ``3600s``, ``30m``, ``1h``, ``1h30m``, ``2d``, ``500ms`` as a timedelta."""
    value = text.strip().lower().replace(" ", "")
    if re.fullmatch(r"\d+(?:\.\d+)?", value):
        return timedelta(seconds=float(value))
    parts = _DURATION.findall(value)
    if not value or "".join(n + u for n, u in parts) != value:
        raise UsageError(
            f"invalid duration {text!r}: use e.g. 3600s, 30m, 1h, 1h30m, 2d (or plain seconds)"
        )
    return timedelta(seconds=sum(float(n) * _UNITS[u] for n, u in parts))


class _Parser(argparse.ArgumentParser):
    """No abbreviated options (so option values are always recognised as such), and usage
    errors as exceptions (exit 2 with one error line)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.print_usage(sys.stderr)
        raise UsageError(message)


def _unrecognized(extras: list[str]) -> str:
    """Names the unrecognised flags but no values: a mistyped --storage-option must not echo
    its value."""
    flags = [a.partition("=")[0] for a in extras if a.startswith("-")]
    values = len(extras) - len(flags)
    parts = [*flags, *([f"{values} extra value{'s' if values > 1 else ''}"] if values else [])]
    return "unrecognized arguments: " + ", ".join(parts)


def _common(parser: argparse.ArgumentParser, *, target_options: bool = False) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print JSON (stable keys) instead of a table"
    )
    parser.add_argument(
        "--storage-option",
        "-o",
        action="append",
        metavar="KEY=VALUE",
        help=f"an fsspec storage option (repeatable), on top of ${ENV_OPTIONS}",
    )
    if target_options:
        parser.add_argument(
            "--target-storage-option",
            action="append",
            metavar="KEY=VALUE",
            help=f"a storage option of TARGET (repeatable), on top of ${ENV_TARGET_OPTIONS}; "
            "default: the source's options",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Look at and tidy Flink-style checkpoint and savepoint directories.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    def command(name: str, help_text: str, description: str, aliases=(), **kwargs):
        sub = commands.add_parser(
            name,
            aliases=list(aliases),
            help=help_text,
            description=textwrap.fill(description, 88),
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _common(sub, **kwargs)
        return sub

    sub = command(
        "list",
        "checkpoints and savepoints of a job or base directory",
        "List every chk-<id> and savepoint-* directory of DIR: a job directory "
        "(<base>/<job_id>), a base directory of job directories, or a directory of "
        "savepoints. Shows id, kind, status (completed / invalid / in-progress), state "
        "size, file count and age. JSON: a list of objects with keys pointer, job_id, "
        "checkpoint_id, kind, status, reason, state_size, file_count, modified, age_seconds.",
    )
    sub.add_argument("directory", metavar="DIR")
    sub.set_defaults(handler=_cmd_list)

    sub = command(
        "inspect",
        "show the metadata of a checkpoint or savepoint",
        "Show the _metadata of POINTER (a checkpoint or savepoint directory, or its "
        "_metadata file): job id, timestamp, properties, master states, operators, "
        "subtasks and state handles (type, path or inline size, size, CRC-32).",
    )
    sub.add_argument("pointer", metavar="POINTER")
    sub.set_defaults(handler=_cmd_inspect)

    sub = command(
        "verify",
        "read every state file and check sizes and checksums",
        "Read every state file POINTER references and check its size and CRC-32. Exits 1 "
        "naming each missing, corrupt or unreadable file; 4 if _metadata itself is invalid. "
        "JSON keys: "
        "pointer, checkpoint_id, ok, handles_checked, bytes_read, problems (path, kind, "
        "reason).",
    )
    sub.add_argument("pointer", metavar="POINTER")
    sub.set_defaults(handler=_cmd_verify)

    sub = command(
        "latest",
        "the pointer of a job's latest completed checkpoint",
        "Print the pointer of the newest completed checkpoint (valid _metadata, highest id) "
        "of the job directory DIR (<base>/<job_id>), and nothing else. Exits 3 when there "
        'is none. JSON: {"pointer": ...}.',
    )
    sub.add_argument("directory", metavar="DIR")
    sub.set_defaults(handler=_cmd_latest)

    sub = command(
        "gc",
        "delete unreferenced files of a job",
        "Delete the files under the job directory DIR (<base>/<job_id>) that no retained "
        "checkpoint or savepoint references and that are older than the grace period. "
        "Never touches referenced files, taskowned/ or savepoints. A checkpoint whose "
        "_metadata cannot be read (Apache Flink's or another format, corrupt, of another id "
        "than its chk-<id>, or unreadable) keeps all its files, and while there is one "
        "nothing in shared/ is collected; gc names each and exits 4 (5 if only unreadable "
        "ones). JSON keys: dry_run, deleted, kept, bytes_deleted, removed_directories, "
        "skipped (pointer, metadata, reason, detail).",
    )
    sub.add_argument("directory", metavar="DIR")
    sub.add_argument(
        "--dry-run", action="store_true", help="print what would be deleted; delete nothing"
    )
    sub.add_argument(
        "--delete-corrupt",
        action="store_true",
        help="also delete checkpoints of this library whose _metadata is corrupt (after the "
        "grace period); foreign, mismatched and unreadable ones are never deleted",
    )
    sub.add_argument(
        "--grace-period",
        default=DEFAULT_GRACE_PERIOD,
        metavar="DURATION",
        help="keep files younger than this, e.g. 3600s, 30m, 1h, 2d (default: "
        f"{DEFAULT_GRACE_PERIOD}); must exceed the longest checkpoint's duration",
    )
    sub.set_defaults(handler=_cmd_gc)

    sub = command(
        "dispose-savepoint",
        "delete a savepoint (_metadata first); alias: dispose",
        "Delete the savepoint POINTER in Flink's order: _metadata first (from then on it is "
        "no longer addressable), then its state files, then its directory. Refuses a "
        "checkpoint unless --force. With --corrupt, deletes a checkpoint or savepoint of "
        "this library whose _metadata is corrupt (and refuses any other): _metadata first, "
        "then its own directory. Exits 1 if some files could not be deleted.",
        aliases=["dispose"],
    )
    sub.add_argument("pointer", metavar="POINTER")
    sub.add_argument(
        "--force",
        action="store_true",
        help="dispose even if _metadata says it is a checkpoint (its shared state is kept)",
    )
    sub.add_argument(
        "--corrupt",
        action="store_true",
        help="dispose a checkpoint whose _metadata is corrupt (only such a one); its "
        "directory goes, shared state stays for gc",
    )
    sub.set_defaults(handler=_cmd_dispose)

    sub = command(
        "copy-savepoint",
        "copy a savepoint to another directory or filesystem",
        "Copy the savepoint POINTER into TARGET (another directory or filesystem, e.g. "
        "s3://bucket/savepoints) as TARGET/<savepoint directory name>: state files first, "
        "_metadata last, then verify the copy and print its pointer. JSON keys: source, "
        "pointer.",
        target_options=True,
    )
    sub.add_argument("pointer", metavar="POINTER")
    sub.add_argument("target", metavar="TARGET")
    sub.set_defaults(handler=_cmd_copy)

    lease = commands.add_parser(
        "lease",
        help="show or break a job directory's lease",
        description=textwrap.fill(
            "A coordinator holds its job directory's lease (DIR/_lease) while it writes "
            "checkpoints: one coordinator per job. Show who holds it, or break a stale one.",
            88,
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    lease_commands = lease.add_subparsers(
        dest="lease_command", metavar="ACTION", parser_class=_Parser
    )
    lease_commands.required = True

    def lease_command(name: str, help_text: str, description: str):
        sub = lease_commands.add_parser(
            name,
            help=help_text,
            description=textwrap.fill(description, 88),
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _common(sub)
        sub.add_argument("directory", metavar="DIR")
        return sub

    sub = lease_command(
        "show",
        "who holds the lease",
        "Show the lease of the job directory DIR (<base>/<job_id>): state (held / expired / "
        "released / unreadable / none), epoch, owner, when it was acquired and renewed, and "
        "when it expires. JSON keys: directory, state, epoch, owner, acquired_at, renewed_at, "
        "expires_at, ttl_seconds, broken_by, reason.",
    )
    sub.set_defaults(handler=_cmd_lease_show)
    sub = lease_command(
        "break",
        "break a stale lease",
        "Break the lease of the job directory DIR: the next epoch is written as a released "
        "tombstone, so the old holder can no longer publish checkpoints and the next "
        "coordinator takes the lease at once. A lease that is still held (renewed within "
        "its ttl) is refused (exit 2) unless --force. JSON keys: directory, broken, "
        "previous (as in lease show).",
    )
    sub.add_argument(
        "--force",
        action="store_true",
        help="break the lease even though its holder renewed it within its ttl",
    )
    sub.set_defaults(handler=_cmd_lease_break)
    return parser


# --- commands ----------------------------------------------------------------------------


def _info_json(info: CheckpointInfo, now: datetime) -> dict:
    age = info.age(now)
    return {
        "pointer": info.pointer,
        "job_id": info.job_id,
        "checkpoint_id": info.checkpoint_id,
        "kind": info.kind,
        "status": info.status,
        "reason": info.reason,
        "state_size": info.state_size,
        "file_count": info.file_count,
        "modified": _iso(info.modified),
        "age_seconds": None if age is None else round(age.total_seconds(), 3),
    }


def _cmd_list(args, options: dict) -> int:
    directory = _location(args.directory)
    infos = list_checkpoints(directory, storage_options=options)
    now = datetime.now(UTC)
    if args.json:
        _print_json([_info_json(i, now) for i in infos])
        return EXIT_OK
    if not infos:
        print(f"no checkpoints or savepoints in {directory}")
        return EXIT_OK
    rows = [
        [
            (i.job_id or "-")[:8],
            "-" if i.checkpoint_id is None else str(i.checkpoint_id),
            i.kind,
            i.status,
            _size(i.state_size),
            str(i.file_count),
            _age(i.age(now)),
            i.pointer,
        ]
        for i in infos
    ]
    print(
        _table(
            ["JOB", "ID", "KIND", "STATUS", "SIZE", "FILES", "AGE", "POINTER"],
            rows,
            right={1, 4, 5, 6},
        )
    )
    for info in infos:
        if info.reason:
            print(f"{info.status}: {info.pointer}: {info.reason}")
    return EXIT_OK


def _handle_json(handle) -> dict:
    if isinstance(handle, ByteStreamStateHandle):
        return {
            "type": "inline",
            "name": handle.handle_name,
            "path": None,
            "relative_path": None,
            "size": handle.state_size,
            "crc32": None,
        }
    if isinstance(handle, SegmentFileStateHandle):
        return {
            "type": "segment",
            "name": handle.logical_file_id,
            "path": handle.path,
            "relative_path": None,
            "size": handle.state_size,
            "crc32": _crc(handle.checksum),
            "start": handle.start_position,
            "scope": handle.scope.value.lower(),
        }
    relative = handle.relative_path if isinstance(handle, RelativeFileStateHandle) else None
    return {
        "type": "relative-file" if relative is not None else "file",
        "name": None,
        "path": handle.path,
        "relative_path": relative,
        "size": handle.state_size,
        "crc32": _crc(handle.checksum),
    }


def _metadata_json(pointer: str, metadata: CheckpointMetadata) -> dict:
    timestamp = (
        None
        if metadata.timestamp_ms is None
        else datetime.fromtimestamp(metadata.timestamp_ms / 1000, UTC)
    )
    return {
        "pointer": pointer,
        "checkpoint_id": metadata.checkpoint_id,
        "job_id": None if metadata.job_id is None else metadata.job_id.hex,
        "timestamp_ms": metadata.timestamp_ms,
        "timestamp": _iso(timestamp),
        "kind": snapshot_kind(metadata),
        "properties": {
            "snapshot_type": metadata.properties.snapshot_type.name.lower(),
            "format_type": metadata.properties.format_type.name.lower(),
        },
        "state_size": metadata.state_size,
        "master_states": [
            {
                "name": name,
                "size": len(value),
                "preview": _preview(value),
                "base64": base64.b64encode(value).decode("ascii"),
            }
            for name, value in metadata.master_states.items()
        ],
        "operators": [
            {
                "operator_id": op.operator_id,
                "parallelism": op.parallelism,
                "max_parallelism": op.max_parallelism,
                "state_size": op.state_size,
                "subtasks": [
                    {
                        "index": index,
                        "properties": dict(subtask.properties),
                        "handles": [_handle_json(h) for h in subtask.handles],
                    }
                    for index, subtask in op.subtask_states.items()
                ],
            }
            for op in metadata.operator_states
        ],
    }


def _cmd_inspect(args, options: dict) -> int:
    completed = resolve_checkpoint_pointer(_location(args.pointer), options)
    metadata = completed.load_metadata()
    doc = _metadata_json(completed.external_pointer, metadata)
    if args.json:
        _print_json(doc)
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
            f"{_size(metadata.state_size)} ({metadata.state_size} bytes) in "
            f"{_count(len(handles), 'handle')}: {_count(files, 'file')}, "
            + (
                f"{_count(len(segments), 'segment')} in {_count(physical, 'physical file')}, "
                if segments
                else ""
            )
            + f"{len(handles) - files - len(segments)} inline",
        ),
    ]
    width = max(len(k) for k, _ in header)
    for key, value in header:
        print(f"{key + ':':<{width + 1}} {value}")
    print()
    print("master states:")
    if doc["master_states"]:
        rows = [[m["name"], _size(m["size"]), m["preview"]] for m in doc["master_states"]]
        print(_indent(_table(["NAME", "SIZE", "PREVIEW"], rows, right={1})))
    else:
        print("  (none)")
    print()
    print("operators:")
    if doc["operators"]:
        rows = [
            [
                op["operator_id"],
                str(op["parallelism"]),
                "-" if op["max_parallelism"] is None else str(op["max_parallelism"]),
                str(len(op["subtasks"])),
                str(sum(len(s["handles"]) for s in op["subtasks"])),
                _size(op["state_size"]),
            ]
            for op in doc["operators"]
        ]
        headers = ["OPERATOR", "PARALLELISM", "MAX", "SUBTASKS", "HANDLES", "SIZE"]
        print(_indent(_table(headers, rows, right={1, 2, 3, 4, 5})))
    else:
        print("  (none)")
    print()
    print("handles:")
    rows = []
    for op in doc["operators"]:
        for subtask in op["subtasks"]:
            for h in subtask["handles"]:
                if h["type"] == "inline":
                    where = _below(h["name"], doc["pointer"]) + " (inline)"
                elif h["type"] == "segment":
                    where = (
                        f"{_below(h['path'], parent_and_name(doc['pointer'])[0])}"
                        f"[{h['start']}:{h['start'] + h['size']}] ({h['scope']})"
                    )
                else:
                    where = h["relative_path"] or _below(h["path"], doc["pointer"])
                rows.append(
                    [
                        op["operator_id"],
                        str(subtask["index"]),
                        h["type"],
                        _size(h["size"]),
                        h["crc32"] or "-",
                        where,
                    ]
                )
    if rows:
        headers = ["OPERATOR", "SUBTASK", "TYPE", "SIZE", "CRC32", "PATH"]
        print(_indent(_table(headers, rows, right={1, 3})))
    else:
        print("  (none)")
    props = [
        f"  {op['operator_id']}[{s['index']}] {key}={value}"
        for op in doc["operators"]
        for s in op["subtasks"]
        for key, value in s["properties"].items()
    ]
    if props:
        print()
        print("subtask properties:")
        print("\n".join(props))
    return EXIT_OK


def _below(path: str, directory: str) -> str:
    """``path`` relative to ``directory`` when it lies below it (shorter tables)."""
    prefix = directory.rstrip("/") + "/"
    return path[len(prefix) :] if path.startswith(prefix) else path


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def _cmd_verify(args, options: dict) -> int:
    completed = resolve_checkpoint_pointer(_location(args.pointer), options)
    bar = _ProgressBar("verifying")
    try:
        report = verify_checkpoint(completed, progress=bar)
    finally:
        bar.close()
    if args.json:
        _print_json(
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
        verdict = "ok" if report.ok else _count(len(report.problems), "problem")
        print(
            f"{report.pointer}: checkpoint {report.checkpoint_id}, "
            f"{_count(report.handles_checked, 'handle')}, {_size(report.bytes_read)} read: "
            f"{verdict}"
        )
        if report.problems:
            rows = [[p.kind, p.path] for p in report.problems]
            print(_table(["PROBLEM", "PATH"], rows))
            for p in report.problems:
                print(f"{p.kind}: {p.reason}")
    if report.ok:
        return EXIT_OK
    verdicts = [p for p in report.problems if p.kind in ("missing", "corrupt")]
    first = (verdicts or list(report.problems))[0]
    _error(
        f"verification of {report.pointer} found {_count(len(report.problems), 'problem')}; "
        f"first: {first.reason}"
    )
    return EXIT_PROBLEMS


def _cmd_latest(args, options: dict) -> int:
    directory = _location(args.directory)
    try:
        pointer = latest_checkpoint(directory, storage_options=options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        _print_json({"pointer": pointer})
    elif pointer is not None:
        print(pointer)
    if pointer is None:
        _error(f"no completed checkpoint in {directory}; pass a job directory <base>/<job_id>")
        return EXIT_NOT_FOUND
    return EXIT_OK


def _cmd_gc(args, options: dict) -> int:
    directory = _location(args.directory)
    grace = parse_duration(args.grace_period)
    name = directory.rstrip("/").rpartition("/")[2]
    try:
        JobID(name)
    except ValueError:
        raise UsageError(
            f"gc needs a job directory <base>/<job_id> (32 hex characters), got {directory}"
        ) from None
    access = job_storage(directory, options)
    fs, path = url_to_fs(directory, options)
    fs.invalidate_cache(path)
    fs.info(path)  # FileNotFoundError (exit 3) for a job directory that does not exist
    try:
        from checkpoint_storage._gc import collect_garbage
    except ImportError:
        _error("gc is not available: this installation has no garbage collector")
        return EXIT_ERROR
    with _Spinner("collecting garbage"):
        try:
            result = collect_garbage(
                access,
                grace_period=grace,
                dry_run=args.dry_run,
                delete_corrupt=args.delete_corrupt,
            )
        except (FileNotFoundError, ValueError, InvalidCheckpointError):
            raise
        except OSError as exc:
            _error(f"gc of {directory} failed: {_one_line(exc)}")
            return EXIT_PROBLEMS
    if args.json:
        _print_json(
            {
                "dry_run": bool(result.dry_run),
                "deleted": list(result.deleted),
                "kept": list(result.kept),
                "bytes_deleted": result.bytes_deleted,
                "removed_directories": list(getattr(result, "removed_directories", ())),
                "skipped": [
                    {
                        "pointer": s.pointer,
                        "metadata": s.metadata,
                        "reason": s.reason,
                        "detail": s.detail,
                    }
                    for s in result.skipped
                ],
                "shared_collected": result.shared_collected,
            }
        )
    else:
        verb = "would delete" if result.dry_run else "deleted"
        print(f"{directory}: {result.summary()}")
        for url in result.deleted:
            print(f"  {verb}: {url}")
        for s in result.skipped:
            print(f"  kept ({s.reason}): {s.pointer}: {s.detail}")
    if not result.skipped:
        return EXIT_OK
    first = result.skipped[0]
    _error(
        f"gc of {directory} kept {_count(len(result.skipped), 'checkpoint')} whose _metadata "
        f"it cannot read, and shared/: first {first.metadata} ({first.reason}): {first.detail}"
    )
    if all(s.reason == SKIPPED_UNREADABLE for s in result.skipped):
        return EXIT_ERROR
    return EXIT_INVALID


def _cmd_dispose(args, options: dict) -> int:
    pointer = _location(args.pointer)
    # Resolve and load first: "not found" (3), "corrupt" (4) and I/O errors before anything is
    # deleted (5) keep their exit codes; only failures while deleting are exit 1.
    completed = resolve_checkpoint_pointer(pointer, options)
    if args.corrupt:
        problem = corruption_of(completed)  # raises for foreign (4) and unreadable (5)
        if problem is None:
            raise UsageError(
                f"{completed.external_pointer} is not corrupt (its _metadata is valid): "
                "--corrupt only disposes a checkpoint whose _metadata is corrupt"
            )
        message = f"disposed corrupt {completed.external_pointer} ({_one_line(problem)})"
        return _dispose(completed, options, args, message, corrupt=True)
    metadata = completed.load_metadata()
    if not metadata.properties.is_savepoint() and not args.force:
        raise UsageError(
            f"{completed.external_pointer} is a {snapshot_kind(metadata)}, not a savepoint: "
            "checkpoints are disposed by their job's retention; pass --force to dispose it"
        )
    message = f"disposed {completed.external_pointer}"
    return _dispose(completed, options, args, message, force=args.force)


def _dispose(completed, options: dict, args, message: str, **flags) -> int:
    """``dispose_savepoint`` with the CLI's reporting: deletion failures exit 1; not found
    (disposed concurrently), invalid and usage errors keep their own exit codes."""
    try:
        dispose_savepoint(completed.external_pointer, storage_options=options, **flags)
    except (FileNotFoundError, InvalidCheckpointError, UnsafePathError, ValueError):
        raise
    except Exception as exc:  # noqa: BLE001 - deletion failures: exit 1
        _error(f"disposing {completed.external_pointer} failed: {_one_line(exc)}")
        return EXIT_PROBLEMS
    if args.json:
        _print_json({"pointer": completed.external_pointer, "disposed": True})
    else:
        print(message)
    return EXIT_OK


def _cmd_copy(args, options: dict) -> int:
    source = _location(args.pointer)
    target = _location(args.target)
    target_options = (
        _parse_options(ENV_TARGET_OPTIONS, args.target_storage_option)
        if args.target_storage_option or os.environ.get(ENV_TARGET_OPTIONS)
        else None
    )
    bar = _ProgressBar("copying")
    try:
        pointer = copy_savepoint(
            source,
            target,
            storage_options=options,
            target_storage_options=target_options,
            progress=bar,
        )
    finally:
        bar.close()
    if args.json:
        _print_json({"source": source, "pointer": pointer})
    else:
        print(pointer)
    return EXIT_OK


def _lease_json(directory: str, record: LeaseRecord | None) -> dict:
    if record is None:
        return {"directory": directory, "state": "none", "epoch": None, "owner": None}
    unreadable = record.unreadable is not None

    def moment(value: float) -> str | None:
        return None if unreadable else _iso(datetime.fromtimestamp(value, UTC))

    return {
        "directory": directory,
        "state": record.state(),
        "epoch": record.epoch,
        "owner": None if unreadable else record.owner,
        "acquired_at": moment(record.acquired_at),
        "renewed_at": moment(record.renewed_at),
        "expires_at": moment(record.expires_at),
        "ttl_seconds": None if unreadable else record.ttl_seconds,
        "broken_by": record.broken_by,
        "reason": record.unreadable,
    }


def _job_lease_directory(args, options: dict):
    directory = _location(args.directory)
    fs, path = url_to_fs(directory, options)
    return directory, fs, path


def _cmd_lease_show(args, options: dict) -> int:
    directory, fs, path = _job_lease_directory(args, options)
    record = read_job_lease(fs, path)
    if args.json:
        _print_json(_lease_json(directory, record))
    elif record is None:
        print(f"{directory}: no lease has been taken")
    else:
        print(f"{directory}: {record.describe()}")
    return EXIT_OK


def _cmd_lease_break(args, options: dict) -> int:
    directory, fs, path = _job_lease_directory(args, options)
    try:
        broken = break_job_lease(
            fs, path, by=f"checkpoints lease break ({default_lease_owner()})", force=args.force
        )
    except JobLeaseHeldError as exc:
        raise UsageError(
            f"{_one_line(exc)}; pass --force to break it anyway (only when that coordinator "
            "is gone)"
        ) from None
    if args.json:
        _print_json(
            {
                "directory": directory,
                "broken": broken is not None,
                "previous": None if broken is None else _lease_json(directory, broken),
            }
        )
    elif broken is None:
        print(f"{directory}: no lease to break (never taken, or released)")
    else:
        print(f"{directory}: broke the lease ({broken.describe()})")
    return EXIT_OK


# --- main --------------------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _error(message: str) -> None:
    print(f"{PROG}: error: {_redact(' '.join(message.split()))}", file=sys.stderr)


def exit_code_for(exc: BaseException) -> int:
    """The exit code an exception maps to (see the module docstring)."""
    if isinstance(exc, UsageError):
        return EXIT_USAGE
    if isinstance(exc, InvalidCheckpointError | UnsafePathError):
        return EXIT_INVALID
    if isinstance(exc, FileNotFoundError):
        return EXIT_NOT_FOUND
    if isinstance(exc, ValueError):
        return EXIT_USAGE
    return EXIT_ERROR


class _Redacting(logging.Formatter):
    """One line per record, no traceback, option values masked."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            message += f" ({_one_line(record.exc_info[1])})"
        return _redact(f"{PROG}: {record.levelname.lower()}: {' '.join(message.split())}")


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Redacting())
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if not isinstance(h.formatter, _Redacting)]
    root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > logging.WARNING:
        root.setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    """Run the ``checkpoints`` command; returns its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _prescan_secrets(argv)
    _configure_logging()
    try:
        try:
            parser = build_parser()
            args, extras = parser.parse_known_args(argv)
        except SystemExit as exc:  # --help
            return int(exc.code or 0)
        if extras:
            parser.print_usage(sys.stderr)
            raise UsageError(_unrecognized(extras))
        options = _parse_options(ENV_OPTIONS, args.storage_option)
        return args.handler(args, options)
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - one line, no traceback, a documented code
        _error(_one_line(exc))
        return exit_code_for(exc)


if __name__ == "__main__":
    sys.exit(main())
