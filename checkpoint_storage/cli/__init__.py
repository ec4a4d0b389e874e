"""``checkpoints``: look at and tidy checkpoint and savepoint directories.

The manual (commands, arguments, output, exit codes, plugins) is docs/cli.md. This package
is the ``checkpoints`` app (``app``: the root command, ``COMMAND_GROUPS`` and plugin loading),
one module per command group (``listing``: list, latest; ``inspecting``: inspect, verify;
``tidying``: gc, dispose-savepoint, copy-savepoint; ``lease``: lease show, lease break;
``flink``: orphans, read-flink, and Apache Flink's directories in list, inspect, verify) and
the helpers they and plugins are built on (``helpers``). Every name below is importable from
here; that is the plugin API.
"""

from checkpoint_storage import decode_master_state
from checkpoint_storage.cli.app import (
    COMMAND_GROUPS,
    DECLARATION,
    PLUGIN_GROUP,
    build_app,
    declared_commands,
    load_plugins,
    main,
)
from checkpoint_storage.cli.helpers import (
    ENV_OPTIONS,
    ENV_TARGET_OPTIONS,
    PROG,
    DirArgument,
    JsonOption,
    PointerArgument,
    StorageOption,
    UsageError,
    complete_location,
    console,
    echo,
    err_console,
    error,
    exit_code_for,
    location,
    new_table,
    parse_duration,
    print_json,
    print_table,
    progress,
    run_command,
    storage_options,
    warn,
)
from checkpoint_storage.cli.inspecting import statistics_lines, statistics_of, statistics_table
from checkpoint_storage.cli.listing import describe_position, files_label

__all__ = [
    "COMMAND_GROUPS",
    "DECLARATION",
    "ENV_OPTIONS",
    "ENV_TARGET_OPTIONS",
    "PLUGIN_GROUP",
    "PROG",
    "DirArgument",
    "JsonOption",
    "PointerArgument",
    "StorageOption",
    "UsageError",
    "build_app",
    "complete_location",
    "console",
    "declared_commands",
    "decode_master_state",
    "describe_position",
    "echo",
    "err_console",
    "error",
    "exit_code_for",
    "files_label",
    "load_plugins",
    "location",
    "main",
    "new_table",
    "parse_duration",
    "print_json",
    "print_table",
    "progress",
    "run_command",
    "statistics_lines",
    "statistics_of",
    "statistics_table",
    "storage_options",
    "warn",
]
