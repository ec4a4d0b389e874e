"""The ``checkpoints`` command as an operator meets it (issues 26 and 29): a package that
imports only the library's public names, plugins that load when their command runs (an
instant ``--help``), completion of pointers and stage names, pointers that are never wrapped
on a terminal (80 and 100 columns) or are shown relative to DIR, ``latest`` of a data
directory, ``list`` of a file, and a copied job directory explained.

The app runs in-process (typer's CliRunner) but for the terminal tests, which run
``python -m checkpoint_storage.cli`` on a pseudo-terminal of a set size, and the import
test, which runs a fresh interpreter.
"""

import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from checkpoint_storage import (
    JOB_NAME_STATE,
    CheckpointMetadata,
    CheckpointProperties,
    FileSystemCheckpointStorage,
    JobID,
    OperatorState,
    OperatorSubtaskState,
    cli,
    decode_master_state,
    list_checkpoints_below,
    metadata_as_json,
)
from tests.support import SHARED, finalize, payload, run_on_terminal, write_state

ROOT = Path(__file__).resolve().parent.parent
JOB_A = JobID("a" * 32)
JOB_B = JobID("b" * 32)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

pytestmark = pytest.mark.timeout(120)


def write(access, checkpoint_id: int, *, savepoint: bool = False, shared: bool = False):
    """A completed checkpoint (or savepoint) of stages "dedupe" and "counts", its state in
    files (a SHARED-scope one with ``shared``: recorded by absolute path)."""
    location = (
        access.initialize_location_for_savepoint(checkpoint_id)
        if savepoint
        else access.initialize_location_for_checkpoint(checkpoint_id)
    )
    properties = (
        CheckpointProperties.for_savepoint if savepoint else CheckpointProperties.for_checkpoint
    )
    handles = [write_state(location, payload(4096, checkpoint_id))]
    if shared:
        handles.append(write_state(location, payload(4096, checkpoint_id + 1), SHARED))
    md = CheckpointMetadata(
        checkpoint_id,
        tuple(
            OperatorState(stage, 1, 8, {0: OperatorSubtaskState(tuple(handles))})
            for stage in ("dedupe", "counts")
        ),
        {JOB_NAME_STATE: b"orders"},
        properties(),
        access.job_id,
        1_700_000_000_000,
    )
    return finalize(location, md)


def data_directory(root: Path, jobs=(JOB_A,), *, shared: bool = False) -> Path:
    """<root>/.data (hidden, as the embedded defaults name it) with checkpoints/<job>/chk-1,2
    per job and one savepoint of the first job in savepoints/scheduled/."""
    data = root / ".data"
    for index, job in enumerate(jobs):
        storage = FileSystemCheckpointStorage(
            str(data / "checkpoints"),
            str(data / "savepoints" / "scheduled"),
            file_state_size_threshold=1024,
        )
        access = storage.create_checkpoint_storage(job)
        access.initialize_base_locations()
        write(access, 1, shared=shared)
        write(access, 2, shared=shared)
        if index == 0:
            write(access, 3, savepoint=True)
    return data


def run(*args, app=None):
    app = app or cli.build_app(plugins=False)
    result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("checkpoints: error: "), result.stderr
    return lines[-1]


def read_plugin():
    return importlib.metadata.EntryPoint("pipelines", "pipelines.cli:register", cli.PLUGIN_GROUP)


# --- the package's imports ---------------------------------------------------------------


def test_the_cli_and_the_read_plugin_import_only_public_names_of_the_library():
    """No module of checkpoint_storage.cli, nor pipelines/cli.py, imports a private module
    (``checkpoint_storage._x``) or a private name of the library."""
    files = [*sorted((ROOT / "checkpoint_storage" / "cli").glob("*.py")), ROOT / "pipelines/cli.py"]
    private = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [a.name for a in node.names]
                if any(part.startswith("_") for part in node.module.split(".")) or (
                    node.module == "checkpoint_storage" and any(n.startswith("_") for n in names)
                ):
                    private.append(f"{path.name}: from {node.module} import {', '.join(names)}")
            elif isinstance(node, ast.Import):
                private += [
                    f"{path.name}: import {a.name}"
                    for a in node.names
                    if a.name.startswith("checkpoint_storage._")
                ]
    assert [] == private
    assert (ROOT / "checkpoint_storage" / "cli" / "__init__.py").exists()


def test_every_public_name_of_the_cli_is_importable_from_the_package():
    """The plugin API and the app: importable from checkpoint_storage.cli as before."""
    expected = {
        "JsonOption", "StorageOption", "UsageError", "build_app", "console", "echo",
        "err_console", "exit_code_for", "load_plugins", "location", "main", "new_table",
        "print_json", "print_table", "progress", "run_command", "storage_options",
        "parse_duration", "describe_position", "decode_master_state", "PLUGIN_GROUP", "PROG",
        "ENV_OPTIONS", "ENV_TARGET_OPTIONS",
    }
    assert expected <= set(cli.__all__)
    assert all(getattr(cli, name) is not None for name in cli.__all__)


# --- library functions -------------------------------------------------------------------


def test_list_checkpoints_below_finds_every_job_and_savepoint_of_a_data_directory(tmp_path):
    """Below a data directory: both jobs' checkpoints and the savepoint (attributed to its
    job by its name); hidden directories below are not searched; a job directory lists only
    itself."""
    data = data_directory(tmp_path, (JOB_A, JOB_B))
    shutil.copytree(data / "checkpoints", data / ".trash")  # hidden: never searched

    found = list_checkpoints_below(str(data))
    only_b = list_checkpoints_below(str(data / "checkpoints" / JOB_B.hex))

    assert [(JOB_A.hex, 1), (JOB_A.hex, 2), (JOB_A.hex, 3), (JOB_B.hex, 1), (JOB_B.hex, 2)] == [
        (i.job_id, i.checkpoint_id) for i in found
    ]
    assert ["checkpoint", "checkpoint", "savepoint"] == [i.kind for i in found[:3]]
    assert all(".trash" not in i.pointer for i in found)
    assert [(JOB_B.hex, 1), (JOB_B.hex, 2)] == [(i.job_id, i.checkpoint_id) for i in only_b]


def test_metadata_as_json_is_what_inspect_json_prints(tmp_path):
    """The library's JSON of a `_metadata` equals `inspect --json` but for the statistics
    inspect adds (derived here: the checkpoint records none); master states are decoded
    (text), handles typed, rows unknown (None) when not recorded."""
    data = data_directory(tmp_path)
    pointer = str(data / "checkpoints" / JOB_A.hex / "chk-2")
    from checkpoint_storage import resolve_checkpoint_pointer

    metadata = resolve_checkpoint_pointer(pointer, {}).load_metadata()
    doc = metadata_as_json(metadata, pointer)
    printed = json.loads(run("inspect", pointer, "--json").stdout)
    statistics = printed.pop("statistics")

    assert doc == printed
    assert (False, metadata.state_size) == (statistics["recorded"], statistics["full_size"])
    assert (2, JOB_A.hex, "checkpoint") == (doc["checkpoint_id"], doc["job_id"], doc["kind"])
    assert {"name": JOB_NAME_STATE, "encoding": "text", "value": "orders"}.items() <= (
        doc["master_states"][0].items()
    )
    assert ["dedupe", "counts"] == [op["operator_id"] for op in doc["operators"]]
    assert (None, "relative-file") == (
        doc["operators"][0]["rows"], doc["operators"][0]["subtasks"][0]["handles"][0]["type"]
    )
    assert ("json", {"a": 1}) == decode_master_state(b'{"a": 1}')
    assert ("base64", "AAE=") == decode_master_state(b"\x00\x01")


# --- lazy plugins: an instant CLI ---------------------------------------------------------


def test_help_and_list_import_neither_pyspark_nor_pyarrow_nor_the_plugin(tmp_path):
    """`checkpoints --help` lists the read plugin's command by its declaration, and `list`
    runs, without importing the plugin's package, pyspark or pyarrow (a fresh interpreter
    with the installed entry points)."""
    data = data_directory(tmp_path)
    code = textwrap.dedent(f"""
        import io, sys, contextlib
        from checkpoint_storage.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            codes = [main(["--help"]), main(["list", {str(data)!r}])]
        heavy = sorted(m for m in ("pyspark", "pyarrow", "pipelines") if m in sys.modules)
        print(codes, heavy, "read" in out.getvalue(), "chk-2" in out.getvalue())
    """)
    ran = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
    )

    assert "[0, 0] [] True True" == ran.stdout.strip(), ran.stderr


def write_plugin(root: Path, declared: bool) -> str:
    """A plugin package ``lazyplug`` whose import is recorded in sys.modules (as any is):
    ``hello`` prints a greeting. With ``declared`` its module declares its commands."""
    package = root / "lazyplug"
    package.mkdir()
    (package / "__init__.py").write_text("")
    declaration = 'CHECKPOINTS_COMMANDS = {"hello": "Say hello."}\n' if declared else ""
    (package / "cmds.py").write_text(
        declaration
        + textwrap.dedent("""
            from checkpoint_storage.cli import echo, run_command

            def register(app):
                @app.command("hello", help="Say hello, loaded.")
                def hello(name: str) -> None:
                    run_command(lambda: echo(f"hello {name}"))
        """)
    )
    return "lazyplug.cmds:register"


@pytest.mark.parametrize("declared", [True, False])
def test_a_declared_plugin_loads_only_when_its_command_runs(tmp_path, monkeypatch, declared):
    """A plugin whose module declares CHECKPOINTS_COMMANDS is listed in --help by its
    declaration and imported only when its command runs; one without is loaded at once."""
    value = write_plugin(tmp_path, declared)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazyplug", raising=False)
    monkeypatch.delitem(sys.modules, "lazyplug.cmds", raising=False)
    entry_point = importlib.metadata.EntryPoint("lazyplug", value, cli.PLUGIN_GROUP)

    app = cli.build_app(entry_points=[entry_point])
    help_text = run("--help", app=app).stdout
    imported_by_help = "lazyplug.cmds" in sys.modules
    hello = run("hello", "you", app=app)

    assert ({"hello": "Say hello."} if declared else None) == cli.declared_commands(entry_point)
    assert "hello" in help_text and imported_by_help is (not declared)
    assert (0, "hello you\n") == (hello.exit_code, hello.stdout)
    assert "lazyplug.cmds" in sys.modules


def test_the_read_plugin_declares_its_command():
    """The installed read plugin is lazy: its declarations (read, stages, history) are found
    without importing it."""
    assert {"read", "stages", "history"} == set(cli.declared_commands(read_plugin()) or ())


# --- completion ---------------------------------------------------------------------------


def complete(app, words: str, monkeypatch) -> list[str]:
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")
    result = CliRunner().invoke(
        app,
        [],
        env={
            "_CHECKPOINTS_COMPLETE": "complete_bash",
            "COMP_WORDS": words,
            "COMP_CWORD": str(len(words.split(" ")) - 1),
        },
    )
    assert 0 == result.exit_code, result.output
    return result.stdout.split()


def test_pointers_and_stage_names_complete(tmp_path, monkeypatch):
    """DIR/POINTER arguments complete local directories (job directories, chk-<id>), and
    read's --stage completes the stages of the checkpoint given, through the lazy plugin."""
    data = data_directory(tmp_path)
    job = data / "checkpoints" / JOB_A.hex
    app = cli.build_app(entry_points=[read_plugin()])

    jobs = complete(app, f"checkpoints list {data}/checkpoints/", monkeypatch)
    checkpoints = complete(app, f"checkpoints inspect {job}/chk-", monkeypatch)
    stages = complete(app, f"checkpoints read {job}/chk-2 --stage ", monkeypatch)
    counts = complete(app, f"checkpoints read {job} --stage co", monkeypatch)

    assert [f"{data}/checkpoints/{JOB_A.hex}/"] == jobs
    assert [f"{job}/chk-1/", f"{job}/chk-2/"] == checkpoints
    assert (["dedupe", "counts"], ["counts"]) == (stages, counts)


# --- pointers you can copy ----------------------------------------------------------------


def on_terminal(columns: int, *args) -> str:
    """``checkpoints ARGS`` with stdout on a pseudo-terminal ``columns`` wide: what the
    terminal received, escape sequences removed."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR")}
    env.update(TERM="xterm-256color", PYTHONPATH=str(ROOT))
    code, shown, stderr = run_on_terminal(
        [sys.executable, "-m", "checkpoint_storage.cli", *map(str, args)], env=env, cwd=ROOT,
        columns=columns,
    )
    assert 0 == code, stderr
    return ANSI.sub("", shown).replace("\r\n", "\n")


@pytest.mark.parametrize("columns", [80, 100])
def test_pointers_are_never_wrapped_on_a_terminal(tmp_path, columns):
    """At 80 and 100 columns every pointer of `list` (long ones: a deep directory) is on one
    line, whole: in the table's last column when it fits, else on its own line below its
    row; inspect's state file paths too."""
    deep = tmp_path / ("d" * 40) / ("e" * 40)
    data = data_directory(deep)
    pointers = [i.pointer for i in list_checkpoints_below(str(data))]
    savepoint = next(p for p in pointers if "savepoint-" in p)

    listed = on_terminal(columns, "list", data)
    inspected = on_terminal(columns, "inspect", savepoint)
    lines = listed.splitlines()

    assert len(pointers) == 3 and all(len(p) > columns for p in pointers)
    for pointer in pointers:
        assert any(line.strip() == pointer for line in lines), listed
    assert any("completed" in line for line in lines)
    assert "handles:" in inspected and "relative-file" in inspected


def test_a_short_pointer_stays_in_the_last_column(tmp_path):
    """When the table fits with its pointers, they stay in the POINTER column, last."""
    data = data_directory(tmp_path)
    listed = on_terminal(200, "list", data / "checkpoints" / JOB_A.hex)
    rows = [line for line in listed.splitlines() if "completed" in line]

    assert 2 == len(rows)
    assert all(row.rstrip().endswith(f"{JOB_A.hex}/chk-{n}") for n, row in enumerate(rows, 1))


def test_relative_shows_pointers_relative_to_the_directory_given(tmp_path):
    """--relative: the table's and the JSON's pointers are relative to DIR."""
    data = data_directory(tmp_path)

    table = run("list", data, "--relative")
    as_json = json.loads(run("list", data, "--relative", "--json").stdout)

    assert 0 == table.exit_code
    expected = [f"checkpoints/{JOB_A.hex}/chk-1", f"checkpoints/{JOB_A.hex}/chk-2"]
    assert expected == [i["pointer"] for i in as_json][:2]
    assert as_json[2]["pointer"].startswith("savepoints/scheduled/savepoint-aaaaaa-")
    assert all(p in table.stdout.split() for p in expected)
    assert str(data) not in table.stdout


# --- inconsistencies ----------------------------------------------------------------------


def test_latest_of_a_data_directory_finds_its_one_job(tmp_path):
    """`latest .data` prints what `list .data` shows as the newest checkpoint of the one job
    below; with two jobs below, exit 2 naming both job directories."""
    one = data_directory(tmp_path / "one")
    two = data_directory(tmp_path / "two", (JOB_A, JOB_B))

    latest = run("latest", one)
    ambiguous = run("latest", two)

    assert (0, f"{one}/checkpoints/{JOB_A.hex}/chk-2\n") == (latest.exit_code, latest.stdout)
    assert 2 == ambiguous.exit_code
    message = error_line(ambiguous)
    assert f"{two}/checkpoints/{JOB_A.hex}" in message
    assert f"{two}/checkpoints/{JOB_B.hex}" in message
    assert "pass one of these job directories" in message


def test_list_of_a_file_is_a_usage_error(tmp_path):
    """`list FILE` exits 2 saying it is a file, not a directory (it listed nothing, exit 0)."""
    data = data_directory(tmp_path)
    metadata = data / "checkpoints" / JOB_A.hex / "chk-2" / "_metadata"

    result = run("list", metadata)

    assert 2 == result.exit_code
    assert f"{metadata} is a file, not a directory" in error_line(result)


def test_a_copied_job_directory_says_checkpoints_cannot_be_moved(tmp_path):
    """A checkpoint whose shared state is recorded by absolute path, read from a copy of its
    job directory: exit 4 naming where it was written, that checkpoints cannot be moved and
    savepoints can, not "tampered with"."""
    data = data_directory(tmp_path, shared=True)
    original = data / "checkpoints" / JOB_A.hex
    copy = tmp_path / "copy" / JOB_A.hex
    shutil.copytree(original, copy)

    result = run("verify", copy / "chk-2")

    message = error_line(result)
    assert 4 == result.exit_code
    assert f"moved or copied from {original}" in message
    assert "cannot be moved (a savepoint can)" in message
    assert "copy-savepoint" in message and "tampered" not in message


def test_read_runs_through_the_lazy_plugin(tmp_path):
    """`read` resolved through the declaration loads the plugin and runs it: an unknown stage
    is a usage error naming the checkpoint's stages."""
    data = data_directory(tmp_path)
    app = cli.build_app(entry_points=[read_plugin()])

    result = run("read", data / "checkpoints" / JOB_A.hex / "chk-2", "--stage", "nope", app=app)

    assert 2 == result.exit_code
    assert "its stages are: dedupe, counts" in error_line(result)
