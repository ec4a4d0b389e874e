"""``checkpoints``: look at and tidy checkpoint and savepoint directories.

Commands::

    checkpoints list DIR                  the checkpoints and savepoints of a job directory,
                                          or of every job below DIR (a base directory, or a
                                          data directory with checkpoints/ and savepoints/):
                                          per job its pipeline name, per checkpoint its id,
                                          kind, status, source position, size, files and age
    checkpoints inspect POINTER           the `_metadata` of a checkpoint or savepoint, its
                                          master states decoded (JSON, Arrow schemas, text)
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
    checkpoints --install-completion      install shell completion (bash, zsh, fish,
                                          PowerShell); --show-completion prints the script

DIR and POINTER are local paths, ``file:`` URLs (``file:/abs``, ``file:///abs``,
``file://localhost/abs``, percent-encoded) or fsspec URLs (``s3://bucket/cp/<job_id>``), under
the rule a run's ``restore_from`` follows too: a relative path may start with ``./`` or
``../``; any other ``.`` or ``..`` segment is refused (exit 2).

Output: aligned tables, coloured on a terminal and plain text otherwise (for scripts that
read them); JSON with ``--json``. Progress (verify, copy-savepoint, gc) goes to stderr, only
when stderr is a terminal. ``list`` and ``inspect`` decode the well-known master states
(``checkpoint_storage.JOB_NAME_STATE``, ``SOURCE_POSITION_STATE``, ``STATE_SCHEMA_PREFIX``).

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

Plugins: the app (``build_app``) is a ``typer.Typer``; building it loads every entry point
of the group ``checkpoint_storage.cli`` (``PLUGIN_GROUP``), each a callable
``register(app: typer.Typer) -> None`` that adds commands, e.g. in a ``pyproject.toml``::

    [project.entry-points."checkpoint_storage.cli"]
    read = "mypackage.cli:register"

This package imports no plugin. A plugin that fails to load is named in a warning and the
other commands still work. A plugin command behaves like a built-in one when it uses this
module's helpers: ``JsonOption`` and ``StorageOption`` (the ``--json`` and
``--storage-option``/``-o`` parameters), ``run_command(body)`` (runs the command's body and
turns its exception into the one-line error and its exit code), ``location(arg)`` (the path
rule above), ``storage_options(flags)`` (the flags on top of ``$CHECKPOINTS_STORAGE_OPTIONS``,
values registered for redaction), ``echo``, ``new_table``/``print_table``, ``print_json``,
``progress`` and the rich consoles ``console`` (stdout) and ``err_console`` (stderr).
"""

import base64
import contextlib
import importlib.metadata
import inspect
import io
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer
from fsspec import AbstractFileSystem
from rich.console import Console
from rich.padding import Padding
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from checkpoint_storage._access import resolve_checkpoint_pointer
from checkpoint_storage._filesystems import (
    METADATA_FILE_NAME,
    format_age,
    format_size,
    normalize_pointer,
    parent_and_name,
    to_url,
    url_to_fs,
)
from checkpoint_storage._gc import SKIPPED_UNREADABLE, collect_garbage
from checkpoint_storage._handles import (
    ByteStreamStateHandle,
    FileStateHandle,
    RelativeFileStateHandle,
    SegmentFileStateHandle,
)
from checkpoint_storage._ids import JobID, checkpoint_directory_id, is_job_id
from checkpoint_storage._lease import (
    LeaseRecord,
    break_job_lease,
    default_lease_owner,
    read_job_lease,
)
from checkpoint_storage._master_states import (
    JOB_NAME_STATE,
    SOURCE_POSITION_STATE,
)
from checkpoint_storage._metadata import CheckpointMetadata
from checkpoint_storage._tools import (
    CheckpointInfo,
    _attribute_savepoints,
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

__all__ = [
    "ENV_OPTIONS",
    "ENV_TARGET_OPTIONS",
    "PLUGIN_GROUP",
    "PROG",
    "JsonOption",
    "StorageOption",
    "UsageError",
    "build_app",
    "console",
    "decode_master_state",
    "describe_position",
    "echo",
    "err_console",
    "exit_code_for",
    "load_plugins",
    "location",
    "main",
    "new_table",
    "parse_duration",
    "print_json",
    "print_table",
    "progress",
    "run_command",
    "storage_options",
]

PROG = "checkpoints"
PLUGIN_GROUP = "checkpoint_storage.cli"
ENV_OPTIONS = "CHECKPOINTS_STORAGE_OPTIONS"
ENV_TARGET_OPTIONS = "CHECKPOINTS_TARGET_STORAGE_OPTIONS"

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_INVALID = 4
EXIT_ERROR = 5
EXIT_INTERRUPTED = 130

DEFAULT_GRACE_PERIOD = "1h"
MIN_MASKED_LENGTH = 4  # shorter option values are not masked in error text (too ambiguous)
# How deep `list` looks below DIR for directories of jobs and savepoints: DIR/x/y, e.g.
# <data>/savepoints/scheduled.
LIST_DEPTH = 2
PLAIN_WIDTH = 100_000  # a table's plain text is never wrapped

EPILOG = f"""\
storage options:
  --storage-option KEY=VALUE (repeatable), on top of ${ENV_OPTIONS}
  (a JSON object); VALUE is parsed as JSON when it parses, else taken as
  text. Values are never printed.

exit codes:
  0  success (gc: also when there was nothing to delete)
  1  verify reported problems; gc or dispose-savepoint could not delete
     everything
  2  usage error (bad arguments, or a refused operation)
  3  checkpoint or directory not found (latest: no completed checkpoint)
  4  invalid, corrupt or foreign (e.g. Apache Flink's) checkpoint; gc kept
     such ones
  5  other error (e.g. storage I/O, a _metadata that cannot be opened)
"""

logger = logging.getLogger("checkpoint_storage")


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

_OPTION_FLAGS = ("--storage-option", "--target-storage-option", "-o")


def _prescan_secrets(argv: list[str]) -> None:
    """Register option values before the parser sees them, so that even its own error
    messages cannot echo them."""
    for index, arg in enumerate(argv):
        value = None
        if arg in _OPTION_FLAGS:
            value = argv[index + 1] if index + 1 < len(argv) else None
        elif arg.startswith("-o") and not arg.startswith("--"):
            value = arg[2:].lstrip("=")
        else:
            for flag in _OPTION_FLAGS[:2]:
                if arg.startswith(flag + "="):
                    value = arg[len(flag) + 1 :]
        if value is not None:
            _redact.add_raw(value.partition("=")[2] if "=" in value else value)
    for name in (ENV_OPTIONS, ENV_TARGET_OPTIONS):
        raw = os.environ.get(name)
        if raw:
            _redact.add_raw(raw)


def storage_options(flags: Iterable[str] | None, env_name: str = ENV_OPTIONS) -> dict:
    """The fsspec storage options of a command: ``flags`` (``KEY=VALUE`` strings, VALUE
    parsed as JSON when it parses) on top of the JSON object in the environment variable
    ``env_name``. Every value is registered so that no output of the command shows it.
    Raises ``UsageError`` (exit 2) for a malformed flag or variable, naming no value."""
    options: dict = {}
    raw = os.environ.get(env_name)
    if raw and raw.strip():
        _redact.add_raw(raw)
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
        key, sep, value = item.lstrip("=").partition("=")  # `-o=KEY=VALUE` as `-o KEY=VALUE`
        key = key.strip()
        if not sep or not key:
            raise UsageError("storage options are given as KEY=VALUE (the '=' is missing)")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    _redact.add_value(options)
    return options


# --- output ------------------------------------------------------------------------------

# Never markup or emoji codes: paths and names are printed as they are ("[0:30]", ":x:").
console = Console(highlight=False, markup=False, emoji=False, soft_wrap=True)
"""stdout. A rich console: styles show only on a terminal."""
err_console = Console(stderr=True, highlight=False, markup=False, emoji=False, soft_wrap=True)
"""stderr: errors, warnings and progress."""


def echo(text: str | Text = "", *, err: bool = False) -> None:
    """A line on stdout (stderr with ``err``): styled on a terminal, the plain text as it is
    otherwise."""
    target = err_console if err else console
    if target.is_terminal:
        target.print(text if isinstance(text, Text) else Text(text), soft_wrap=True)
    else:
        target.file.write((text.plain if isinstance(text, Text) else text) + "\n")
        target.file.flush()


class _LiteralTable(Table):
    """A rich Table whose text cells are literal (never markup)."""

    def add_row(self, *renderables, **kwargs) -> None:
        cells = [Text(cell) if isinstance(cell, str) else cell for cell in renderables]
        super().add_row(*cells, **kwargs)


def new_table(*headers: str, right: Iterable[str] = (), fold: Iterable[str] = ()) -> Table:
    """A table in this command's style: no borders, two spaces between columns, bold headers
    on a terminal. Columns named in ``right`` are right-aligned; those in ``fold`` (paths)
    fold on a narrow terminal instead of being cut. Text cells are printed literally."""
    right, fold = set(right), set(fold)
    table = _LiteralTable(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for header in headers:
        table.add_column(
            header,
            justify="right" if header in right else "left",
            overflow="fold" if header in fold else "ellipsis",
            no_wrap=header not in fold,
        )
    return table


def print_table(table: Table, *, indent: int = 0, err: bool = False) -> None:
    """``table`` on stdout (stderr with ``err``), ``indent`` spaces in: as rich renders it on
    a terminal; as plain aligned text otherwise, never wrapped, without trailing spaces."""
    target = err_console if err else console
    if target.is_terminal:
        target.print(Padding(table, (0, 0, 0, indent)), soft_wrap=False)
        return
    plain = Console(
        file=io.StringIO(),
        width=PLAIN_WIDTH,
        color_system=None,
        force_terminal=False,
        highlight=False,
        markup=False,
        emoji=False,
    )
    plain.print(table)
    lines = [" " * indent + line.rstrip() for line in plain.file.getvalue().splitlines()]
    target.file.write("\n".join(lines) + "\n")
    target.file.flush()


def print_json(value: object) -> None:
    """``value`` as indented JSON on stdout (keys in their order), coloured on a terminal."""
    text = json.dumps(value, indent=2, sort_keys=False)
    if console.is_terminal:
        console.print_json(text, sort_keys=False)
    else:
        echo(text)


def _ignore_progress(done: int, total: int) -> None:
    pass


@contextlib.contextmanager
def progress(label: str) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr while the block runs, only when stderr is a terminal. Yields
    the callback ``update(done_bytes, total_bytes)`` (thread-safe; a no-op without a
    terminal) that ``verify_checkpoint`` and ``copy_savepoint`` take as ``progress``."""
    if not err_console.is_terminal:
        yield _ignore_progress
        return
    bar = Progress(
        TextColumn(label),
        BarColumn(),
        TaskProgressColumn(),
        DownloadColumn(binary_units=True),
        TimeElapsedColumn(),
        console=err_console,
        redirect_stdout=False,
        redirect_stderr=False,
    )
    with bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


@contextlib.contextmanager
def _activity(label: str) -> Iterator[None]:
    """A spinner and the elapsed time on stderr (terminal only) for work without progress
    reports; gone when the block ends."""
    if not err_console.is_terminal:
        yield
        return
    spinner = Progress(
        SpinnerColumn(),
        TextColumn(label),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        redirect_stdout=False,
        redirect_stderr=False,
    )
    with spinner:
        spinner.add_task(label, total=None)
        yield


def _size(n: int | None) -> str:
    return "-" if n is None else format_size(n)


def _count(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def _iso(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _crc(checksum: int | None) -> str | None:
    return None if checksum is None else f"{checksum:08x}"


_STATUS_STYLES = {
    "completed": "green",
    "in-progress": "yellow",
    "abandoned": "dim",
    "invalid": "red",
    "foreign": "red",
    "unreadable": "magenta",
}


# --- errors ------------------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _error(message: str) -> None:
    text = _redact(" ".join(message.split()))
    echo(Text.assemble((f"{PROG}: error: ", "bold red"), text), err=True)


def _warn(message: str) -> None:
    text = _redact(" ".join(message.split()))
    echo(Text.assemble((f"{PROG}: warning: ", "yellow"), text), err=True)


def exit_code_for(exc: BaseException) -> int:
    """The exit code an exception maps to (see the module docstring)."""
    if isinstance(exc, UsageError):
        return EXIT_USAGE
    if isinstance(exc, typer.TyperException):  # the parser's usage errors (exit code 2)
        return EXIT_USAGE if getattr(exc, "exit_code", None) == EXIT_USAGE else EXIT_ERROR
    if isinstance(exc, InvalidCheckpointError | UnsafePathError):
        return EXIT_INVALID
    if isinstance(exc, FileNotFoundError):
        return EXIT_NOT_FOUND
    if isinstance(exc, ValueError):
        return EXIT_USAGE
    return EXIT_ERROR


def _quiet_stdout() -> None:
    """The reader of stdout went away (e.g. `| head`): drop what is still to be written."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    with contextlib.suppress(OSError, ValueError):
        os.dup2(devnull, sys.stdout.fileno())


def run_command(body: Callable[[], int | None]) -> None:
    """Run a command's body as every ``checkpoints`` command runs: its return value (None:
    0) is the exit code; an exception becomes one redacted line ``checkpoints: error: ...``
    on stderr and the exit code ``exit_code_for`` gives it (UsageError: 2, not found: 3,
    invalid checkpoint: 4, anything else: 5), never a traceback. Raises ``typer.Exit`` for
    a code other than 0."""
    try:
        code = body() or EXIT_OK
    except (typer.Exit, typer.Abort):
        raise
    except KeyboardInterrupt:
        _error("interrupted")
        code = EXIT_INTERRUPTED
    except BrokenPipeError:
        _quiet_stdout()
        code = EXIT_OK
    except Exception as exc:  # noqa: BLE001 - one line, no traceback, a documented code
        _error(_one_line(exc))
        code = exit_code_for(exc)
    if code != EXIT_OK:
        raise typer.Exit(code)


def _parser_error(exc: typer.TyperException) -> str:
    """A usage error of the parser as one line, naming flags but never extra values (a
    mistyped option's value may be a secret)."""
    message = " ".join(exc.format_message().split())
    if message.startswith("Got unexpected extra argument"):
        message = "got unexpected extra arguments (not shown)"
    ctx = getattr(exc, "ctx", None)
    if ctx is not None:
        message = f"{message.rstrip('.')}; see '{ctx.command_path} --help'"
    return message


class _Redacting(logging.Formatter):
    """One line per record, no traceback, option values masked."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            message += f" ({_one_line(record.exc_info[1])})"
        return _redact(f"{PROG}: {record.levelname.lower()}: {' '.join(message.split())}")


class _StderrHandler(logging.Handler):
    """Writes to ``err_console`` (whatever ``sys.stderr`` is when a record comes; above a
    progress bar on a terminal)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            echo(self.format(record), err=True)
        except Exception:  # noqa: BLE001 - logging must not fail the command
            self.handleError(record)


@contextlib.contextmanager
def _command_logging() -> Iterator[None]:
    """Warnings of the library on stderr while a command runs, one redacted line each."""
    handler = _StderrHandler(logging.WARNING)
    handler.setFormatter(_Redacting())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > logging.WARNING:
        root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


class _CheckpointsGroup(TyperGroup):
    """The root command: parses and dispatches like click, and ends the way every
    ``checkpoints`` command ends: option values registered for redaction before parsing,
    parser errors as one line with exit 2, never a traceback."""

    def main(
        self,
        args=None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra,
    ):
        argv = [str(arg) for arg in (sys.argv[1:] if args is None else args)]
        _prescan_secrets(argv)
        with _command_logging():
            try:
                result = super().main(
                    args=argv,
                    prog_name=PROG,
                    complete_var=complete_var,
                    standalone_mode=False,
                    **extra,
                )
                code = result if isinstance(result, int) else EXIT_OK
            except typer.TyperException as exc:
                _error(_parser_error(exc))
                code = exit_code_for(exc)
            except typer.Abort:
                _error("aborted")
                code = EXIT_ERROR
            except SystemExit as exc:  # --show-completion and completion requests end so
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            except Exception as exc:  # noqa: BLE001 - e.g. a plugin without run_command
                _error(_one_line(exc))
                code = exit_code_for(exc)
        if standalone_mode:
            sys.exit(code)
        return code


# --- arguments ---------------------------------------------------------------------------


def location(arg: str) -> str:
    """A DIR/POINTER/TARGET argument under the library's one pointer rule
    (``file:`` URLs, relative paths, no '.'/'..' inside), after ``~`` expansion as a shell
    does; ``UsageError`` (exit 2) otherwise."""
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


JsonOption = Annotated[
    bool, typer.Option("--json", help="print JSON (stable keys) instead of a table")
]
"""The ``--json`` flag of every command: ``json_output: JsonOption = False``."""

StorageOption = Annotated[
    list[str] | None,
    typer.Option(
        "--storage-option",
        "-o",
        metavar="KEY=VALUE",
        help=f"an fsspec storage option (repeatable), on top of ${ENV_OPTIONS}",
        show_default=False,
    ),
]
"""The ``--storage-option``/``-o`` flag of every command: ``storage_option: StorageOption =
None``, then ``storage_options(storage_option)`` inside ``run_command``."""

_TargetStorageOption = Annotated[
    list[str] | None,
    typer.Option(
        "--target-storage-option",
        metavar="KEY=VALUE",
        help=f"a storage option of TARGET (repeatable), on top of ${ENV_TARGET_OPTIONS}; "
        "default: the source's options",
        show_default=False,
    ),
]
_Dir = Annotated[str, typer.Argument(metavar="DIR", show_default=False)]
_Pointer = Annotated[str, typer.Argument(metavar="POINTER", show_default=False)]


# --- list --------------------------------------------------------------------------------


def _entry_name(entry: dict) -> str:
    return parent_and_name(entry["name"].rstrip("/"))[1]


def _holds_snapshots_or_jobs(name: str) -> bool:
    return (
        checkpoint_directory_id(name) is not None
        or name.startswith("savepoint-")
        or is_job_id(name)
    )


def _listing(fs: AbstractFileSystem, path: str) -> list[dict]:
    """The entries of a directory below DIR; one that cannot be listed is skipped with a
    warning (it was not asked for by name)."""
    fs.invalidate_cache(path)
    try:
        return fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    except OSError as exc:
        _warn(f"skipped {to_url(fs, path)}: cannot list it ({_one_line(exc)})")
        return []


def _holders_below(fs: AbstractFileSystem, entries: list[dict], depth: int) -> list[str]:
    """The directories among ``entries`` and below them (to ``LIST_DEPTH``) that hold job,
    ``chk-<id>`` or ``savepoint-*`` directories, e.g. <data>/checkpoints and
    <data>/savepoints/scheduled. Hidden (``.x``) and internal (``_x``) ones are skipped."""
    found = []
    for entry in entries:
        name = _entry_name(entry)
        if (
            entry.get("type") != "directory"
            or _holds_snapshots_or_jobs(name)
            or name.startswith((".", "_"))
        ):
            continue
        child = entry["name"].rstrip("/")
        child_entries = _listing(fs, child)
        if any(_entry_name(e) == METADATA_FILE_NAME for e in child_entries):
            continue  # a checkpoint directory under another name: not a base directory
        if any(
            e.get("type") == "directory" and _holds_snapshots_or_jobs(_entry_name(e))
            for e in child_entries
        ):
            found.append(child)
        if depth < LIST_DEPTH:
            found += _holders_below(fs, child_entries, depth + 1)
    return found


def _sort_key(info: CheckpointInfo) -> tuple:
    return (info.job_id or "", info.checkpoint_id is None, info.checkpoint_id or 0, info.pointer)


def _list_below(directory: str, options: dict) -> list[CheckpointInfo]:
    """What ``list_checkpoints`` finds in ``directory``, and below a directory that is not a
    job or checkpoint directory also in its subdirectories of jobs and savepoints."""
    infos = list_checkpoints(directory, storage_options=options)
    fs, path = url_to_fs(directory, options)
    if is_job_id(parent_and_name(path)[1]):
        return infos
    entries = _listing(fs, path)
    if any(_entry_name(e) == METADATA_FILE_NAME for e in entries):
        return infos
    holders = _holders_below(fs, entries, 1)
    if not holders:
        return infos
    for holder in holders:
        infos = [*infos, *list_checkpoints(to_url(fs, holder), storage_options=options)]
    return sorted(_attribute_savepoints(infos), key=_sort_key)


def _source_position(data: bytes | None) -> dict | None:
    """The ``SOURCE_POSITION_STATE`` JSON object, None when absent or not of that form."""
    if data is None:
        return None
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(value, dict) or not {"partition", "batches", "complete"} <= set(value):
        return None
    return value


def describe_position(position: dict | None) -> str:
    """A source position for people: ``2026-10-06, 3 batches`` part-way through a partition,
    ``2026-10-06, partition end (4 batches)`` at its end; ``-`` for none."""
    if position is None:
        return "-"
    try:
        batches = _count(int(position["batches"]), "batch", "batches")
    except (TypeError, ValueError):
        batches = f"{position['batches']} batches"
    if position["complete"]:
        return f"{position['partition']}, partition end ({batches})"
    return f"{position['partition']}, {batches}"


def _job_name(states: dict) -> str | None:
    data = states.get(JOB_NAME_STATE)
    return None if data is None else data.decode("utf-8", "replace")


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
        "job_name": _job_name(info.master_states),
        "source_position": _source_position(info.master_states.get(SOURCE_POSITION_STATE)),
    }


def _list(directory_arg: str, as_json: bool, options: dict) -> int:
    directory = location(directory_arg)
    infos = _list_below(directory, options)
    now = datetime.now(UTC)
    if as_json:
        print_json([_info_json(i, now) for i in infos])
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
            "FILES",
            "AGE",
            "POINTER",
            right={"ID", "SIZE", "FILES", "AGE"},
            fold={"POINTER"},
        )
        for i in rows:
            position = _source_position(i.master_states.get(SOURCE_POSITION_STATE))
            table.add_row(
                "-" if i.checkpoint_id is None else str(i.checkpoint_id),
                i.kind,
                Text(i.status, style=_STATUS_STYLES.get(i.status, "")),
                describe_position(position),
                _size(i.state_size),
                str(i.file_count),
                format_age(i.age(now), compact=True),
                i.pointer,
            )
        print_table(table)
    reasons = [i for i in infos if i.reason]
    if reasons:
        echo()
    for info in reasons:
        echo(f"{info.status}: {info.pointer}: {info.reason}")
    return EXIT_OK


def _job_heading(job: str | None, name: str | None) -> str:
    if job is None:
        return "no job id (savepoints whose _metadata cannot be read)"
    return f"pipeline {name} (job {job})" if name else f"job {job}"


# --- inspect -----------------------------------------------------------------------------


_ARROW_CONTINUATION = b"\xff\xff\xff\xff"  # how an Arrow IPC message (a schema) begins


def _arrow_schema_fields(data: bytes) -> list[dict] | None:
    if not data.startswith(_ARROW_CONTINUATION):
        return None
    import pyarrow as pa  # only for master states that look like Arrow schemas

    try:
        schema = pa.ipc.read_schema(pa.py_buffer(data))
    except (pa.ArrowException, ValueError):
        return None
    return [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in schema]


def _is_text(text: str) -> bool:
    return all(c.isprintable() or c in "\n\t" for c in text)


def decode_master_state(data: bytes) -> tuple[str, object]:
    """``(encoding, value)`` of a master state: ``json`` (a JSON object or array, parsed),
    ``arrow-schema`` (an Arrow IPC schema, e.g. ``STATE_SCHEMA_PREFIX`` states: its fields
    as ``{name, type, nullable}``), ``text`` (printable UTF-8) or ``base64``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if isinstance(value, dict | list):
            return "json", value
        if _is_text(text):
            return "text", text
    fields = _arrow_schema_fields(data)
    if fields is not None:
        return "arrow-schema", fields
    return "base64", base64.b64encode(data).decode("ascii")


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


def _master_state_json(name: str, data: bytes) -> dict:
    encoding, value = decode_master_state(data)
    return {
        "name": name,
        "size": len(data),
        "encoding": encoding,
        "value": value,
        "base64": base64.b64encode(data).decode("ascii"),
    }


def _recorded_rows(op) -> dict:
    """The rows an operator's subtasks recorded (the well-known subtask properties ``rows``
    and ``expired_rows``, a pipeline's): stored rows, of those expired by a TTL but not
    dropped yet, and live (stored less expired). None where a subtask did not record it
    (a checkpoint written before it was recorded: unknown, not 0)."""

    def total(name: str) -> int | None:
        try:
            counts = [int(s.properties[name]) for s in op.subtask_states.values()]
        except (KeyError, ValueError):
            return None
        return sum(counts) if counts else None

    rows, expired = total("rows"), total("expired_rows")
    live = None if rows is None or expired is None else rows - expired
    return {"rows": rows, "live_rows": live, "expired_rows": expired}


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
            _master_state_json(name, value) for name, value in metadata.master_states.items()
        ],
        "operators": [
            {
                "operator_id": op.operator_id,
                "parallelism": op.parallelism,
                "max_parallelism": op.max_parallelism,
                "state_size": op.state_size,
                **_recorded_rows(op),
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


def _master_state_lines(state: dict) -> list[str]:
    """One master state for people: ``name (encoding, size): value``, or the value's lines
    indented below (schemas, text of several lines). Never cut."""
    head = f"  {state['name']} ({state['encoding'].replace('-', ' ')}, {_size(state['size'])})"
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


def _inspect(pointer_arg: str, as_json: bool, options: dict) -> int:
    completed = resolve_checkpoint_pointer(location(pointer_arg), options)
    metadata = completed.load_metadata()
    doc = _metadata_json(completed.external_pointer, metadata)
    if as_json:
        print_json(doc)
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
        echo(Text.assemble((f"{key + ':':<{width + 1}}", "bold"), f" {value}"))
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
                _size(op["state_size"]),
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
        fold={"PATH"},
    )
    for op in doc["operators"]:
        for subtask in op["subtasks"]:
            for h in subtask["handles"]:
                table.add_row(
                    op["operator_id"],
                    str(subtask["index"]),
                    h["type"],
                    _size(h["size"]),
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
            f"{_below(h['path'], parent_and_name(pointer)[0])}"
            f"[{h['start']}:{h['start'] + h['size']}] ({h['scope']})"
        )
    return h["relative_path"] or _below(h["path"], pointer)


def _below(path: str, directory: str) -> str:
    """``path`` relative to ``directory`` when it lies below it (shorter tables)."""
    prefix = directory.rstrip("/") + "/"
    return path[len(prefix) :] if path.startswith(prefix) else path


# --- verify, latest, gc, dispose, copy ---------------------------------------------------


def _verify(pointer_arg: str, as_json: bool, options: dict) -> int:
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
        verdict = "ok" if report.ok else _count(len(report.problems), "problem")
        echo(
            f"{report.pointer}: checkpoint {report.checkpoint_id}, "
            f"{_count(report.handles_checked, 'handle')}, {_size(report.bytes_read)} read: "
            f"{verdict}"
        )
        if report.problems:
            table = new_table("PROBLEM", "PATH", fold={"PATH"})
            for p in report.problems:
                table.add_row(Text(p.kind, style="red"), p.path)
            print_table(table)
            for p in report.problems:
                echo(f"{p.kind}: {p.reason}")
    if report.ok:
        return EXIT_OK
    verdicts = [p for p in report.problems if p.kind in ("missing", "corrupt")]
    first = (verdicts or list(report.problems))[0]
    _error(
        f"verification of {report.pointer} found {_count(len(report.problems), 'problem')}; "
        f"first: {first.reason}"
    )
    return EXIT_PROBLEMS


def _latest(directory_arg: str, as_json: bool, options: dict) -> int:
    directory = location(directory_arg)
    try:
        pointer = latest_checkpoint(directory, storage_options=options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if as_json:
        print_json({"pointer": pointer})
    elif pointer is not None:
        echo(pointer)
    if pointer is None:
        _error(f"no completed checkpoint in {directory}; pass a job directory <base>/<job_id>")
        return EXIT_NOT_FOUND
    return EXIT_OK


def _gc(
    directory_arg: str,
    as_json: bool,
    options: dict,
    *,
    grace_period: str,
    dry_run: bool,
    delete_corrupt: bool,
) -> int:
    directory = location(directory_arg)
    grace = parse_duration(grace_period)
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
    with _activity("collecting garbage"):
        try:
            result = collect_garbage(
                access, grace_period=grace, dry_run=dry_run, delete_corrupt=delete_corrupt
            )
        except (FileNotFoundError, ValueError, InvalidCheckpointError):
            raise
        except OSError as exc:
            _error(f"gc of {directory} failed: {_one_line(exc)}")
            return EXIT_PROBLEMS
    if as_json:
        print_json(
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
        echo(f"{directory}: {result.summary()}")
        for url in result.deleted:
            echo(f"  {verb}: {url}")
        for s in result.skipped:
            echo(f"  kept ({s.reason}): {s.pointer}: {s.detail}")
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


def _dispose(pointer_arg: str, as_json: bool, options: dict, *, force: bool, corrupt: bool):
    pointer = location(pointer_arg)
    # Resolve and load first: "not found" (3), "corrupt" (4) and I/O errors before anything is
    # deleted (5) keep their exit codes; only failures while deleting are exit 1.
    completed = resolve_checkpoint_pointer(pointer, options)
    if corrupt:
        problem = corruption_of(completed)  # raises for foreign (4) and unreadable (5)
        if problem is None:
            raise UsageError(
                f"{completed.external_pointer} is not corrupt (its _metadata is valid): "
                "--corrupt only disposes a checkpoint whose _metadata is corrupt"
            )
        message = f"disposed corrupt {completed.external_pointer} ({_one_line(problem)})"
        return _dispose_reporting(completed, options, as_json, message, corrupt=True)
    metadata = completed.load_metadata()
    if not metadata.properties.is_savepoint() and not force:
        raise UsageError(
            f"{completed.external_pointer} is a {snapshot_kind(metadata)}, not a savepoint: "
            "checkpoints are disposed by their job's retention; pass --force to dispose it"
        )
    message = f"disposed {completed.external_pointer}"
    return _dispose_reporting(completed, options, as_json, message, force=force)


def _dispose_reporting(completed, options: dict, as_json: bool, message: str, **flags) -> int:
    """``dispose_savepoint`` with the CLI's reporting: deletion failures exit 1; not found
    (disposed concurrently), invalid and usage errors keep their own exit codes."""
    try:
        dispose_savepoint(completed.external_pointer, storage_options=options, **flags)
    except (FileNotFoundError, InvalidCheckpointError, UnsafePathError, ValueError):
        raise
    except Exception as exc:  # noqa: BLE001 - deletion failures: exit 1
        _error(f"disposing {completed.external_pointer} failed: {_one_line(exc)}")
        return EXIT_PROBLEMS
    if as_json:
        print_json({"pointer": completed.external_pointer, "disposed": True})
    else:
        echo(message)
    return EXIT_OK


def _copy(pointer_arg: str, target_arg: str, as_json: bool, options: dict, target_flags) -> int:
    source = location(pointer_arg)
    target = location(target_arg)
    target_options = (
        storage_options(target_flags, ENV_TARGET_OPTIONS)
        if target_flags or os.environ.get(ENV_TARGET_OPTIONS)
        else None
    )
    with progress("copying") as update:
        pointer = copy_savepoint(
            source,
            target,
            storage_options=options,
            target_storage_options=target_options,
            progress=update,
        )
    if as_json:
        print_json({"source": source, "pointer": pointer})
    else:
        echo(pointer)
    return EXIT_OK


# --- lease -------------------------------------------------------------------------------


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


def _lease_show(directory_arg: str, as_json: bool, options: dict) -> int:
    directory = location(directory_arg)
    fs, path = url_to_fs(directory, options)
    record = read_job_lease(fs, path)
    if as_json:
        print_json(_lease_json(directory, record))
    elif record is None:
        echo(f"{directory}: no lease has been taken")
    else:
        echo(f"{directory}: {record.describe()}")
    return EXIT_OK


def _lease_break(directory_arg: str, as_json: bool, options: dict, *, force: bool) -> int:
    directory = location(directory_arg)
    fs, path = url_to_fs(directory, options)
    try:
        broken = break_job_lease(
            fs, path, by=f"checkpoints lease break ({default_lease_owner()})", force=force
        )
    except JobLeaseHeldError as exc:
        raise UsageError(
            f"{_one_line(exc)}; pass --force to break it anyway (only when that coordinator "
            "is gone)"
        ) from None
    if as_json:
        print_json(
            {
                "directory": directory,
                "broken": broken is not None,
                "previous": None if broken is None else _lease_json(directory, broken),
            }
        )
    elif broken is None:
        echo(f"{directory}: no lease to break (never taken, or released)")
    else:
        echo(f"{directory}: broke the lease ({broken.describe()})")
    return EXIT_OK


# --- the app -----------------------------------------------------------------------------


def list_command(
    directory: _Dir, json_output: JsonOption = False, storage_option: StorageOption = None
) -> None:
    """The checkpoints and savepoints of a job directory, or of every job below DIR.

    DIR is a job directory (<base>/<job_id>), a base directory of job directories, a
    directory of savepoints, or a directory above them (e.g. a data directory with
    checkpoints/ and savepoints/scheduled/ below it: DIR is searched two levels deep). Per
    job: its pipeline name (master state "pipeline-name"); per chk-<id> or savepoint-*
    directory: id, kind, status (completed / invalid / foreign / unreadable / in-progress /
    abandoned: no _metadata and the job lease released, expired or taken since),
    source position (master state "source-position", e.g. "2026-10-06, 3 batches"), state
    size, file count and age. JSON: a list of objects with keys pointer, job_id,
    checkpoint_id, kind, status, reason, state_size, file_count, modified, age_seconds,
    job_name, source_position (the position's JSON object).
    """
    run_command(lambda: _list(directory, json_output, storage_options(storage_option)))


def inspect_command(
    pointer: _Pointer, json_output: JsonOption = False, storage_option: StorageOption = None
) -> None:
    """The metadata of a checkpoint or savepoint.

    Shows the _metadata of POINTER (a checkpoint or savepoint directory, or its _metadata
    file): job id, timestamp, properties, master states decoded (JSON in full, Arrow
    schemas as their fields, text; anything else as base64), operators, subtasks and state
    handles (type, path or inline size, size, CRC-32). JSON: master_states is a list of
    name, size, encoding (json / arrow-schema / text / base64), value and base64.
    """
    run_command(lambda: _inspect(pointer, json_output, storage_options(storage_option)))


def verify_command(
    pointer: _Pointer, json_output: JsonOption = False, storage_option: StorageOption = None
) -> None:
    """Read every state file and check sizes and checksums.

    Reads every state file POINTER references and checks its size and CRC-32. Exits 1 naming
    each missing, corrupt or unreadable file; 4 if _metadata itself is invalid. JSON keys:
    pointer, checkpoint_id, ok, handles_checked, bytes_read, problems (path, kind, reason).
    """
    run_command(lambda: _verify(pointer, json_output, storage_options(storage_option)))


def latest_command(
    directory: _Dir, json_output: JsonOption = False, storage_option: StorageOption = None
) -> None:
    """The pointer of a job's latest completed checkpoint.

    Prints the pointer of the newest completed checkpoint (valid _metadata, highest id) of
    the job directory DIR (<base>/<job_id>), and nothing else. Exits 3 when there is none.
    JSON: {"pointer": ...}.
    """
    run_command(lambda: _latest(directory, json_output, storage_options(storage_option)))


def gc_command(
    directory: _Dir,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="print what would be deleted; delete nothing")
    ] = False,
    delete_corrupt: Annotated[
        bool,
        typer.Option(
            "--delete-corrupt",
            help="also delete checkpoints of this library whose _metadata is corrupt (after "
            "the grace period); foreign, mismatched and unreadable ones are never deleted",
        ),
    ] = False,
    grace_period: Annotated[
        str,
        typer.Option(
            "--grace-period",
            metavar="DURATION",
            help="keep files younger than this, e.g. 3600s, 30m, 1h, 2d; must exceed the "
            "longest checkpoint's duration",
        ),
    ] = DEFAULT_GRACE_PERIOD,
    json_output: JsonOption = False,
    storage_option: StorageOption = None,
) -> None:
    """Delete unreferenced files of a job.

    Deletes the files under the job directory DIR (<base>/<job_id>) that no retained
    checkpoint or savepoint references and that are older than the grace period. Never
    touches referenced files, taskowned/ or savepoints. A checkpoint whose _metadata cannot
    be read (Apache Flink's or another format, corrupt, of another id than its chk-<id>, or
    unreadable) keeps all its files, and while there is one nothing in shared/ is collected;
    gc names each and exits 4 (5 if only unreadable ones). JSON keys: dry_run, deleted,
    kept, bytes_deleted, removed_directories, skipped (pointer, metadata, reason, detail),
    shared_collected.
    """
    run_command(
        lambda: _gc(
            directory,
            json_output,
            storage_options(storage_option),
            grace_period=grace_period,
            dry_run=dry_run,
            delete_corrupt=delete_corrupt,
        )
    )


def dispose_command(
    pointer: _Pointer,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="dispose even if _metadata says it is a checkpoint (its shared state is kept)",
        ),
    ] = False,
    corrupt: Annotated[
        bool,
        typer.Option(
            "--corrupt",
            help="dispose a checkpoint whose _metadata is corrupt (only such a one); its "
            "directory goes, shared state stays for gc",
        ),
    ] = False,
    json_output: JsonOption = False,
    storage_option: StorageOption = None,
) -> None:
    """Delete a savepoint (_metadata first); alias: dispose.

    Deletes the savepoint POINTER in Flink's order: _metadata first (from then on it is no
    longer addressable), then its state files, then its directory. Refuses a checkpoint
    unless --force. With --corrupt, deletes a checkpoint or savepoint of this library whose
    _metadata is corrupt (and refuses any other): _metadata first, then its own directory.
    Exits 1 if some files could not be deleted.
    """
    run_command(
        lambda: _dispose(
            pointer, json_output, storage_options(storage_option), force=force, corrupt=corrupt
        )
    )


def copy_command(
    pointer: _Pointer,
    target: Annotated[str, typer.Argument(metavar="TARGET", show_default=False)],
    json_output: JsonOption = False,
    storage_option: StorageOption = None,
    target_storage_option: _TargetStorageOption = None,
) -> None:
    """Copy a savepoint to another directory or filesystem.

    Copies the savepoint POINTER into TARGET (another directory or filesystem, e.g.
    s3://bucket/savepoints) as TARGET/<savepoint directory name>: state files first,
    _metadata last, then verifies the copy and prints its pointer. JSON keys: source,
    pointer.
    """
    run_command(
        lambda: _copy(
            pointer,
            target,
            json_output,
            storage_options(storage_option),
            target_storage_option,
        )
    )


def lease_show_command(
    directory: _Dir, json_output: JsonOption = False, storage_option: StorageOption = None
) -> None:
    """Who holds the lease.

    Shows the lease of the job directory DIR (<base>/<job_id>): state (held / expired /
    released / unreadable / none), epoch, owner, when it was acquired and renewed, and when
    it expires. JSON keys: directory, state, epoch, owner, acquired_at, renewed_at,
    expires_at, ttl_seconds, broken_by, reason.
    """
    run_command(lambda: _lease_show(directory, json_output, storage_options(storage_option)))


def lease_break_command(
    directory: _Dir,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="break the lease even though its holder renewed it within its ttl"
        ),
    ] = False,
    json_output: JsonOption = False,
    storage_option: StorageOption = None,
) -> None:
    """Break a stale lease.

    Breaks the lease of the job directory DIR: the next epoch is written as a released
    tombstone, so the old holder can no longer publish checkpoints and the next coordinator
    takes the lease at once. A lease that is still held (renewed within its ttl) is refused
    (exit 2) unless --force. JSON keys: directory, broken, previous (as in lease show).
    """
    run_command(
        lambda: _lease_break(directory, json_output, storage_options(storage_option), force=force)
    )


def load_plugins(
    app: typer.Typer, entry_points: Iterable[importlib.metadata.EntryPoint] | None = None
) -> list[str]:
    """Let each plugin add its commands to ``app``: every entry point of the group
    ``PLUGIN_GROUP`` (default: the installed ones) is loaded and called as
    ``register(app)``. Returns the names of those that did; one that fails is named in a
    warning on stderr and skipped."""
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=PLUGIN_GROUP)
    loaded = []
    for entry_point in entry_points:
        try:
            entry_point.load()(app)
        except Exception as exc:  # noqa: BLE001 - a broken plugin leaves the others working
            _warn(
                f"plugin {entry_point.name} ({entry_point.value}) was not loaded: {_one_line(exc)}"
            )
            continue
        loaded.append(entry_point.name)
    return loaded


def _help(function: Callable) -> str:
    """A command's docstring as help: paragraphs of one line each, rewrapped to the
    terminal."""
    paragraphs = inspect.cleandoc(function.__doc__ or "").split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs)


def build_app(*, plugins: bool = True) -> typer.Typer:
    """The ``checkpoints`` command as a typer app: the built-in commands and (``plugins``)
    those of the installed plugins (``load_plugins``)."""
    app = typer.Typer(
        name=PROG,
        cls=_CheckpointsGroup,
        help="Look at and tidy Flink-style checkpoint and savepoint directories.",
        epilog=EPILOG,
        no_args_is_help=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    commands = [
        ("list", list_command),
        ("inspect", inspect_command),
        ("verify", verify_command),
        ("latest", latest_command),
        ("gc", gc_command),
        ("dispose-savepoint", dispose_command),
        ("copy-savepoint", copy_command),
    ]
    for name, function in commands:
        app.command(name, help=_help(function), epilog=EPILOG)(function)
    app.command("dispose", help=_help(dispose_command), epilog=EPILOG, hidden=True)(
        dispose_command
    )
    lease = typer.Typer(
        help="Show or break a job directory's lease. A coordinator holds its job directory's "
        "lease (DIR/_lease) while it writes checkpoints: one coordinator per job.",
        epilog=EPILOG,
        no_args_is_help=False,
    )
    lease.command("show", help=_help(lease_show_command), epilog=EPILOG)(lease_show_command)
    lease.command("break", help=_help(lease_break_command), epilog=EPILOG)(lease_break_command)
    app.add_typer(lease, name="lease")
    if plugins:
        load_plugins(app)
    return app


def main(argv: list[str] | None = None) -> int:
    """Run the ``checkpoints`` command; returns its exit code."""
    command = typer.main.get_command(build_app())
    args = list(sys.argv[1:] if argv is None else argv)
    return command.main(args=args, prog_name=PROG, standalone_mode=False)


if __name__ == "__main__":
    sys.exit(main())
