"""The helpers every ``checkpoints`` command is built on, and the plugin API (docs/cli.md,
"Plugins"): a plugin command behaves like a built-in one when it uses them.

- parameters: ``JsonOption`` (``--json``), ``StorageOption`` (``--storage-option``/``-o``),
  ``DirArgument``/``PointerArgument`` (completing local directories and pointers);
- ``run_command(body)``: runs a command's body; its exception becomes the one-line error
  ``checkpoints: error: ...`` and its exit code (``exit_code_for``);
- ``location(arg)``: a DIR/POINTER argument under the library's pointer rule;
- ``storage_options(flags)``: the flags on top of ``$CHECKPOINTS_STORAGE_OPTIONS``, every value
  registered so that no output shows it;
- output: ``echo``, ``new_table``/``print_table`` (a pointer column is never wrapped on a
  terminal), ``print_json``, ``progress`` and the rich consoles ``console`` (stdout) and
  ``err_console`` (stderr).

Only what every command needs is imported here (typer, rich's console and table): a command
imports the rest when it runs, so that ``checkpoints --help`` and completion stay instant.
"""

import contextlib
import inspect
import io
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from checkpoint_storage import format_size, normalize_pointer
from checkpoint_storage.exceptions import InvalidCheckpointError, UnsafePathError

__all__ = [
    "ENV_OPTIONS",
    "ENV_TARGET_OPTIONS",
    "EPILOG",
    "PROG",
    "DirArgument",
    "JsonOption",
    "PointerArgument",
    "StorageOption",
    "UsageError",
    "command_help",
    "console",
    "echo",
    "err_console",
    "error",
    "exit_code_for",
    "location",
    "new_table",
    "parse_duration",
    "print_json",
    "print_table",
    "progress",
    "run_command",
    "storage_options",
    "warn",
]

PROG = "checkpoints"
ENV_OPTIONS = "CHECKPOINTS_STORAGE_OPTIONS"
ENV_TARGET_OPTIONS = "CHECKPOINTS_TARGET_STORAGE_OPTIONS"

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_INVALID = 4
EXIT_ERROR = 5
EXIT_INTERRUPTED = 130

MIN_MASKED_LENGTH = 4  # shorter option values are not masked in error text (too ambiguous)
PLAIN_WIDTH = 100_000  # a table's plain text is never wrapped
POINTER_INDENT = 2  # a pointer on its own line below its row

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


redact = _Redactor()

_OPTION_FLAGS = ("--storage-option", "--target-storage-option", "-o")


def prescan_secrets(argv: list[str]) -> None:
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
            redact.add_raw(value.partition("=")[2] if "=" in value else value)
    for name in (ENV_OPTIONS, ENV_TARGET_OPTIONS):
        raw = os.environ.get(name)
        if raw:
            redact.add_raw(raw)


def storage_options(flags: Iterable[str] | None, env_name: str = ENV_OPTIONS) -> dict:
    """The fsspec storage options of a command: ``flags`` (``KEY=VALUE`` strings, VALUE
    parsed as JSON when it parses) on top of the JSON object in the environment variable
    ``env_name``. Every value is registered so that no output of the command shows it.
    Raises ``UsageError`` (exit 2) for a malformed flag or variable, naming no value."""
    options: dict = {}
    raw = os.environ.get(env_name)
    if raw and raw.strip():
        redact.add_raw(raw)
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
    redact.add_value(options)
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
    """A rich Table whose text cells are literal (never markup); ``pointer`` names the
    column that is never wrapped on a terminal."""

    pointer: str | None = None

    def add_row(self, *renderables, **kwargs) -> None:
        cells = [Text(cell) if isinstance(cell, str) else cell for cell in renderables]
        super().add_row(*cells, **kwargs)


def new_table(
    *headers: str, right: Iterable[str] = (), fold: Iterable[str] = (), pointer: str | None = None
) -> Table:
    """A table in this command's style: no borders, two spaces between columns, bold headers
    on a terminal. Columns named in ``right`` are right-aligned; those in ``fold`` fold on a
    narrow terminal instead of being cut. The column ``pointer`` (the last one: pointers and
    paths to copy) is never wrapped: on a terminal too narrow for the table, each row's
    pointer goes on its own line below the row. Text cells are printed literally."""
    right, fold = set(right), set(fold)
    if pointer is not None and headers[-1] != pointer:
        raise ValueError(f"the pointer column {pointer!r} must be the last one")
    table = _LiteralTable(box=None, pad_edge=False, show_edge=False, header_style="bold")
    table.pointer = pointer
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
    a terminal (its pointer column never wrapped, see ``new_table``); as plain aligned text
    otherwise, never wrapped, without trailing spaces."""
    target = err_console if err else console
    if target.is_terminal:
        if getattr(table, "pointer", None) is not None:
            _print_with_pointers(target, table, indent)
        else:
            target.print(Padding(table, (0, 0, 0, indent), expand=False), soft_wrap=False)
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


def _print_with_pointers(target: Console, table: Table, indent: int) -> None:
    """A table whose last column holds pointers: as it is when it fits the terminal with
    the pointers whole; else without that column, each row followed by its pointer on a line
    of its own (which the terminal may wrap, but never breaks: it copies as one line)."""
    pointer_column = table.columns[-1]
    pointer_column.no_wrap, pointer_column.overflow = True, "ignore"
    natural = target.measure(table, options=target.options.update_width(PLAIN_WIDTH)).maximum
    if natural + indent <= target.width:
        target.print(Padding(table, (0, 0, 0, indent), expand=False), soft_wrap=False)
        return
    pointers = [cell.plain if isinstance(cell, Text) else str(cell)
                for cell in pointer_column._cells]
    table.columns.pop()
    with target.capture() as captured:
        target.print(Padding(table, (0, 0, 0, indent), expand=False), soft_wrap=False)
    lines = captured.get().rstrip("\n").split("\n")
    header, rows = lines[: len(lines) - len(pointers)], lines[len(lines) - len(pointers) :]
    out = [*header]
    for row, pointer in zip(rows, pointers, strict=True):
        out += [row, " " * (indent + POINTER_INDENT) + pointer]
    target.file.write("\n".join(out) + "\n")
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
    from rich.progress import (  # only for a terminal: rich.progress is slow to import
        BarColumn,
        DownloadColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )

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
def activity(label: str) -> Iterator[None]:
    """A spinner and the elapsed time on stderr (terminal only) for work without progress
    reports; gone when the block ends."""
    if not err_console.is_terminal:
        yield
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

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


def human_size(n: int | None) -> str:
    return "-" if n is None else format_size(n)


def counted(n: int, word: str, plural: str | None = None) -> str:
    """``1 file``, ``2 files``."""
    return f"{n} {word if n == 1 else plural or word + 's'}"


def iso_utc(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# --- errors ------------------------------------------------------------------------------


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def error(message: str) -> None:
    """``checkpoints: error: <message>`` on stderr: one line, option values masked."""
    text = redact(" ".join(message.split()))
    echo(Text.assemble((f"{PROG}: error: ", "bold red"), text), err=True)


def warn(message: str) -> None:
    """``checkpoints: warning: <message>`` on stderr: one line, option values masked."""
    text = redact(" ".join(message.split()))
    echo(Text.assemble((f"{PROG}: warning: ", "yellow"), text), err=True)


def exit_code_for(exc: BaseException) -> int:
    """The exit code an exception maps to (docs/cli.md, "Exit codes")."""
    if isinstance(exc, UsageError):
        return EXIT_USAGE
    if isinstance(exc, typer.TyperException):  # the parser's usage errors (exit code 2)
        return EXIT_USAGE if getattr(exc, "exit_code", None) == EXIT_USAGE else EXIT_ERROR
    if isinstance(exc, InvalidCheckpointError | UnsafePathError):
        return EXIT_INVALID
    if isinstance(exc, FileNotFoundError):
        return EXIT_NOT_FOUND
    if isinstance(exc, ValueError | NotADirectoryError):  # e.g. a file given for a DIR
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
        error("interrupted")
        code = EXIT_INTERRUPTED
    except BrokenPipeError:
        _quiet_stdout()
        code = EXIT_OK
    except Exception as exc:  # noqa: BLE001 - one line, no traceback, a documented code
        error(one_line(exc))
        code = exit_code_for(exc)
    if code != EXIT_OK:
        raise typer.Exit(code)


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

TargetStorageOption = Annotated[
    list[str] | None,
    typer.Option(
        "--target-storage-option",
        metavar="KEY=VALUE",
        help=f"a storage option of TARGET (repeatable), on top of ${ENV_TARGET_OPTIONS}; "
        "default: the source's options",
        show_default=False,
    ),
]
def complete_location(incomplete: str) -> list[str]:
    """Shell completion of a DIR or POINTER argument: the local directories (and
    ``_metadata`` files) whose path starts with ``incomplete``, hidden ones only when asked
    for (``.d``). URLs are not listed (that would need their storage options and requests)."""
    if "://" in incomplete or incomplete.startswith("file:"):
        return []
    head, slash, prefix = incomplete.rpartition("/")
    parent = head + slash  # "" (the current directory), "/", "a/", "/a/b/"
    try:
        entries = sorted(os.scandir(os.path.expanduser(parent) or "."), key=lambda e: e.name)
    except OSError:
        return []
    found = []
    for entry in entries:
        if not entry.name.startswith(prefix) or (
            entry.name.startswith(".") and not prefix.startswith(".")
        ):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir():
                found.append(f"{parent}{entry.name}/")
            elif entry.name == "_metadata":
                found.append(f"{parent}{entry.name}")
    return found


DirArgument = Annotated[
    str, typer.Argument(metavar="DIR", show_default=False, autocompletion=complete_location)
]
"""A DIR argument (a job, base or data directory), completing local directories."""
PointerArgument = Annotated[
    str, typer.Argument(metavar="POINTER", show_default=False, autocompletion=complete_location)
]
"""A POINTER argument (a checkpoint or savepoint), completing local directories."""


def command_help(function: Callable) -> str:
    """A command's docstring as help: paragraphs of one line each, rewrapped to the
    terminal."""
    paragraphs = inspect.cleandoc(function.__doc__ or "").split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs)
