"""The ``checkpoints`` app: the root command, its command groups and its plugins.

Each command group is a module with ``register(app)``, listed once in ``COMMAND_GROUPS``; a
new group (e.g. for another system's directories) is a new module added there.

Plugins are entry points of the group ``checkpoint_storage.cli`` (``PLUGIN_GROUP``), each a
callable ``register(app: typer.Typer) -> None`` that adds commands. A plugin whose module
declares its commands as a literal ``CHECKPOINTS_COMMANDS = {"name": "one-line help"}`` is
lazy: that literal is read from the module's source without importing it, the commands are
listed in ``--help`` and complete at once, and the module is imported (``register`` called)
only when one of them runs or completes its arguments. Any other plugin is loaded at start.
"""

import ast
import contextlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
from collections.abc import Iterable, Iterator

import typer
from typer.core import TyperGroup

from checkpoint_storage.cli import flink, inspecting, lease, listing, tidying
from checkpoint_storage.cli.helpers import (
    EPILOG,
    EXIT_ERROR,
    EXIT_OK,
    PROG,
    echo,
    error,
    exit_code_for,
    one_line,
    prescan_secrets,
    redact,
    warn,
)

__all__ = [
    "COMMAND_GROUPS",
    "DECLARATION",
    "PLUGIN_GROUP",
    "build_app",
    "declared_commands",
    "load_plugins",
    "main",
]

PLUGIN_GROUP = "checkpoint_storage.cli"
DECLARATION = "CHECKPOINTS_COMMANDS"
"""The name of a lazy plugin's declaration of its commands (see the module docstring)."""

COMMAND_GROUPS = (listing, inspecting, tidying, lease, flink)
"""The built-in command groups, in the order ``--help`` lists them."""


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
            message += f" ({one_line(record.exc_info[1])})"
        return redact(f"{PROG}: {record.levelname.lower()}: {' '.join(message.split())}")


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


class _DeclaredCommand(typer.core.TyperCommand):
    """A lazy plugin's command as ``--help`` and completion of command names show it; the
    real command replaces it before it parses anything (``_CheckpointsGroup.resolve_command``)."""

    def __init__(self, name: str, help_text: str) -> None:
        super().__init__(name=name, help=help_text, short_help=help_text)


class _LazyPlugin:
    """A plugin whose commands are declared: loaded when one of them is resolved."""

    def __init__(self, entry_point: importlib.metadata.EntryPoint, commands: dict[str, str]):
        self.entry_point = entry_point
        self.commands = commands
        self._loaded: dict | None = None

    def command(self, name: str):
        if self._loaded is None:
            scratch = typer.Typer()
            scratch.callback()(lambda: None)  # a group even when it gets one command
            try:
                self.entry_point.load()(scratch)
            except Exception as exc:
                raise RuntimeError(
                    f"plugin {self.entry_point.name} ({self.entry_point.value}) was not "
                    f"loaded: {one_line(exc)}"
                ) from exc
            self._loaded = dict(typer.main.get_command(scratch).commands)
        if name not in self._loaded:
            raise RuntimeError(
                f"plugin {self.entry_point.name} ({self.entry_point.value}) declares the "
                f"command {name!r} in {DECLARATION} but did not register it"
            )
        return self._loaded[name]


class _CheckpointsGroup(TyperGroup):
    """The root command: parses and dispatches like click, and ends the way every
    ``checkpoints`` command ends: option values registered for redaction before parsing,
    parser errors as one line with exit 2, never a traceback. Lazy plugins' commands are
    listed by their declaration and loaded when resolved."""

    lazy: dict[str, _LazyPlugin] = {}  # command name -> its plugin; set per app

    def list_commands(self, ctx) -> list[str]:
        names = super().list_commands(ctx)
        return [*names, *(name for name in self.lazy if name not in names)]

    def get_command(self, ctx, cmd_name: str):
        command = super().get_command(ctx, cmd_name)
        if command is None and cmd_name in self.lazy:
            return _DeclaredCommand(cmd_name, self.lazy[cmd_name].commands[cmd_name])
        return command

    def resolve_command(self, ctx, args):
        name, command, rest = super().resolve_command(ctx, args)
        if isinstance(command, _DeclaredCommand):
            command = self.lazy[name].command(name)
            self.commands[name] = command
        return name, command, rest

    def main(
        self,
        args=None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra,
    ):
        argv = [str(arg) for arg in (sys.argv[1:] if args is None else args)]
        prescan_secrets(argv)
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
                error(_parser_error(exc))
                code = exit_code_for(exc)
            except typer.Abort:
                error("aborted")
                code = EXIT_ERROR
            except SystemExit as exc:  # --show-completion and completion requests end so
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            except Exception as exc:  # noqa: BLE001 - e.g. a plugin without run_command
                error(one_line(exc))
                code = exit_code_for(exc)
        if standalone_mode:
            sys.exit(code)
        return code


def declared_commands(entry_point: importlib.metadata.EntryPoint) -> dict[str, str] | None:
    """The ``CHECKPOINTS_COMMANDS`` literal (command name -> one-line help) of the module of
    ``entry_point``, read from its source without importing it or its package; None when
    the module has none (or its source cannot be found, e.g. only bytecode is installed)."""
    path = _source_of(entry_point.module)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as source:
            tree = ast.parse(source.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == DECLARATION for t in targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return None
            if isinstance(value, dict) and value and all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()
            ):
                return value
            return None
    return None


def _source_of(module: str) -> str | None:
    """The source file of ``module``, found without importing it or its parent packages (a
    top-level package's spec is found, not executed)."""
    top, _, rest = module.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not rest:
        return spec.origin if spec.origin and spec.origin.endswith(".py") else None
    *packages, leaf = rest.split(".")
    for directory in spec.submodule_search_locations or ():
        for candidate in (
            os.path.join(directory, *packages, leaf + ".py"),
            os.path.join(directory, *packages, leaf, "__init__.py"),
        ):
            if os.path.isfile(candidate):
                return candidate
    return None


def load_plugins(
    app: typer.Typer, entry_points: Iterable[importlib.metadata.EntryPoint] | None = None
) -> list[str]:
    """Let each plugin add its commands to ``app``, now: every entry point of the group
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
            warn(
                f"plugin {entry_point.name} ({entry_point.value}) was not loaded: {one_line(exc)}"
            )
            continue
        loaded.append(entry_point.name)
    return loaded


def build_app(
    *,
    plugins: bool = True,
    entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
) -> typer.Typer:
    """The ``checkpoints`` command as a typer app: the built-in commands (``COMMAND_GROUPS``)
    and (``plugins``) those of the plugins: ``entry_points``, default the installed ones of
    ``PLUGIN_GROUP``. Plugins that declare their commands are loaded when one runs, the others
    now (``load_plugins``)."""
    lazy: dict[str, _LazyPlugin] = {}
    app = typer.Typer(
        name=PROG,
        cls=type("CheckpointsGroup", (_CheckpointsGroup,), {"lazy": lazy}),
        help="Look at and tidy Flink-style checkpoint and savepoint directories.",
        epilog=EPILOG,
        no_args_is_help=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    for group in COMMAND_GROUPS:
        group.register(app)
    if not plugins:
        return app
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=PLUGIN_GROUP)
    eager = []
    for entry_point in entry_points:
        commands = declared_commands(entry_point)
        if commands is None:
            eager.append(entry_point)
            continue
        plugin = _LazyPlugin(entry_point, commands)
        lazy.update(dict.fromkeys(commands, plugin))
    load_plugins(app, eager)
    return app


def main(argv: list[str] | None = None) -> int:
    """Run the ``checkpoints`` command; returns its exit code."""
    command = typer.main.get_command(build_app())
    args = list(sys.argv[1:] if argv is None else argv)
    return command.main(args=args, prog_name=PROG, standalone_mode=False)
