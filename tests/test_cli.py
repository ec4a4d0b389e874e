"""The ``checkpoints`` command (issues 3 and 14, "Operator CLI", "Operators see and read their
state") against real local directories and against S3 (moto): output, JSON, exit codes, storage
option values that are never printed, shell completion and the plugin hook.

Most tests run the typer app in-process through typer's ``CliRunner``; a few run the installed
``checkpoints`` executable next to the interpreter (else ``python -m checkpoint_storage.cli``)
as a subprocess: a terminal for the progress bar, and the script itself.
"""

import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest
import typer
from typer.testing import CliRunner

from checkpoint_storage import (
    JOB_NAME_STATE,
    SOURCE_POSITION_STATE,
    STATE_SCHEMA_PREFIX,
    CheckpointMetadata,
    CheckpointProperties,
    FileStateHandle,
    FileSystemCheckpointStorage,
    JobID,
    OperatorState,
    OperatorSubtaskState,
    cli,
    load_checkpoint_metadata,
)
from checkpoint_storage._access import resolve_checkpoint_pointer
from checkpoint_storage.exceptions import UnsafePathError
from tests.support import (
    finalize,
    make_flink_job_directory,
    payload,
    read,
    run_on_terminal,
    write_state,
)

ROOT = Path(__file__).resolve().parent.parent
EXECUTABLE = Path(sys.executable).parent / "checkpoints"
THRESHOLD = 1024
JOB = JobID("c" * 32)
CANARY = "CANARY-s3cr3t-4711"

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------------------------
#  helpers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ran:
    returncode: int
    stdout: str
    stderr: str


def command() -> list[str]:
    if EXECUTABLE.exists():
        return [str(EXECUTABLE)]
    return [sys.executable, "-m", "checkpoint_storage.cli"]


def environment(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTS_")}
    env.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    env.update(extra or {})
    return env


@contextlib.contextmanager
def working_directory(path: Path):
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def invoke(app: typer.Typer, *args, env: dict | None = None, cwd: Path = ROOT) -> Ran:
    """``app`` run in-process by typer's CliRunner, without CHECKPOINTS_* variables but
    those in ``env``."""
    overrides = {k: None for k in os.environ if k.startswith("CHECKPOINTS_")}
    overrides.update(env or {})
    with working_directory(cwd):
        result = CliRunner().invoke(app, [str(a) for a in args], env=overrides)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Ran(result.exit_code, result.stdout, result.stderr)


def run(*args, env: dict | None = None, cwd: Path = ROOT) -> Ran:
    """The built-in ``checkpoints`` command, in-process."""
    return invoke(cli.build_app(plugins=False), *args, env=env, cwd=cwd)


def run_installed(*args, env: dict | None = None, cwd: Path = ROOT) -> Ran:
    """The installed ``checkpoints`` script, as a subprocess."""
    result = subprocess.run(
        [*command(), *map(str, args)],
        capture_output=True,
        text=True,
        env=environment(env),
        cwd=cwd,
        timeout=90,
    )
    return Ran(result.returncode, result.stdout, result.stderr)


def error_line(result: Ran) -> str:
    """The last stderr line, which must be the command's one-line error."""
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines, "no error message on stderr"
    assert lines[-1].startswith("checkpoints: error: "), result.stderr
    return lines[-1]


def table_rows(text: str, header: str) -> list[list[str]]:
    """The rows (split on whitespace) of the plain table whose header starts with
    ``header``, up to the first empty line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


def write_checkpoint(
    access, checkpoint_id, sizes, properties=None, subtask=0, master=None, target=None
):
    location = (
        access.initialize_location_for_savepoint(checkpoint_id, target)
        if properties is not None and properties.is_savepoint()
        else access.initialize_location_for_checkpoint(checkpoint_id)
    )
    data = [payload(n, checkpoint_id * 10 + i) for i, n in enumerate(sizes)]
    handles = tuple(write_state(location, d) for d in data)
    md = CheckpointMetadata(
        checkpoint_id,
        (OperatorState("dedupe", 2, 8, {subtask: OperatorSubtaskState(handles, {"k": "v"})}),),
        {"position": b"batch-17\x00"} if master is None else master,
        properties or CheckpointProperties.for_checkpoint(),
        access.job_id,
        1_700_000_000_000,
    )
    return finalize(location, md), data


def state_files(completed) -> list[str]:
    handles = load_checkpoint_metadata(completed).all_handles()
    return [h.path for h in handles if isinstance(h, FileStateHandle)]


class Layout:
    """Local directories: <tmp>/cp/<job>/ with chk-1, chk-2 (completed), chk-3 (in progress),
    chk-4 (corrupt `_metadata`), and <tmp>/sp/ with one savepoint."""

    def __init__(self, tmp_path: Path) -> None:
        storage = FileSystemCheckpointStorage(
            str(tmp_path / "cp"), str(tmp_path / "sp"), file_state_size_threshold=THRESHOLD
        )
        self.base = tmp_path / "cp"
        self.job_dir = self.base / JOB.hex
        self.access = storage.create_checkpoint_storage(JOB)
        self.access.initialize_base_locations()
        self.chk1, _ = write_checkpoint(self.access, 1, (2048, 10))
        self.chk2, self.data2 = write_checkpoint(self.access, 2, (2048, 3000, 4000, 20))
        write_state(self.access.initialize_location_for_checkpoint(3), payload(2048, 3))
        chk4, _ = write_checkpoint(self.access, 4, (2048,))
        Path(chk4.metadata_handle.path).write_bytes(b"\x89CKPT but not really")
        self.chk4 = chk4
        self.savepoint, self.sp_data = write_checkpoint(
            self.access, 9, (2048, 5000, 30), CheckpointProperties.for_savepoint(), subtask=1
        )


@pytest.fixture
def layout(tmp_path) -> Layout:
    return Layout(tmp_path)


# --------------------------------------------------------------------------------------------
#  help and usage
# --------------------------------------------------------------------------------------------

COMMANDS = ["list", "inspect", "verify", "latest", "gc", "dispose-savepoint", "copy-savepoint"]


def test_help_on_every_command_documents_the_exit_codes():
    """`--help` (and `-h`) works on the command and every subcommand (exit 0) and lists the
    exit codes."""
    results = [run("--help"), *(run(name, "--help") for name in COMMANDS), run("lease", "-h")]

    assert [0] * 9 == [r.returncode for r in results]
    for name, result in zip(["", *COMMANDS, "lease"], results, strict=True):
        assert f"Usage: checkpoints {name}".strip() in result.stdout
        assert "exit codes:" in result.stdout
        assert "3  checkpoint or directory not found" in result.stdout


def test_the_installed_script_runs_the_same_command():
    """The `checkpoints` script (pyproject's entry point, `checkpoint_storage.cli:main`)
    shows the same help and ends a usage error with exit 2 and one error line."""
    help_text = run_installed("--help")
    usage = run_installed("verify")

    assert (0, 2) == (help_text.returncode, usage.returncode)
    assert "Usage: checkpoints [OPTIONS] COMMAND [ARGS]..." in help_text.stdout
    assert "checkpoints: error: Missing argument 'POINTER'; see 'checkpoints verify --help'" == (
        error_line(usage)
    )


def test_main_returns_the_exit_code(tmp_path, capsys):
    """`main(argv)` returns the exit code instead of exiting, and its output goes to
    whatever sys.stdout/sys.stderr are."""
    missing = cli.main(["list", str(tmp_path / "nowhere")])
    usage = cli.main(["frobnicate"])
    captured = capsys.readouterr()

    assert (3, 2) == (missing, usage)
    assert [
        f"checkpoints: error: {tmp_path / 'nowhere'} does not exist",
        "checkpoints: error: No such command 'frobnicate'; see 'checkpoints --help'",
    ] == captured.err.splitlines()


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["frobnicate"],
        ["verify"],
        ["gc", "/tmp/x/" + "c" * 32, "--grace-period", "soon"],
        ["list", "/tmp", "--storage-option", "no-equals-sign"],
    ],
    ids=["no-command", "unknown-command", "missing-argument", "bad-duration", "bad-option"],
)
def test_usage_errors_exit_2_with_one_error_line(args):
    """Bad arguments exit 2 with `checkpoints: error: ...` (one line, nothing else) and no
    traceback."""
    result = run(*args)

    assert 2 == result.returncode
    assert [error_line(result)] == result.stderr.splitlines()


def test_extra_arguments_are_not_echoed():
    """Extra arguments are a usage error that names no value (one may be an option's
    secret)."""
    result = run("list", "/tmp", "-o", "secret", CANARY)

    assert 2 == result.returncode
    assert CANARY not in result.stdout + result.stderr
    assert "unexpected extra arguments" in error_line(result)


def test_invalid_options_environment_variable_is_a_usage_error():
    """A CHECKPOINTS_STORAGE_OPTIONS that is not a JSON object exits 2 without echoing it."""
    result = run("list", "/tmp", env={"CHECKPOINTS_STORAGE_OPTIONS": f"[{CANARY!r}"})

    assert 2 == result.returncode
    assert "CHECKPOINTS_STORAGE_OPTIONS" in error_line(result)
    assert CANARY not in result.stdout + result.stderr


# --------------------------------------------------------------------------------------------
#  verify
# --------------------------------------------------------------------------------------------


def test_verify_intact_checkpoint_exits_0(layout):
    """An intact checkpoint verifies: exit 0, `ok`, nothing on stderr."""
    result = run("verify", layout.chk2.external_pointer)

    assert (0, "") == (result.returncode, result.stderr)
    assert result.stdout.strip().endswith(": ok")
    assert "4 handles" in result.stdout


def damage(kind: str, path: str) -> None:
    file = Path(path)
    if kind == "truncated":
        file.write_bytes(file.read_bytes()[:-7])
    elif kind == "bit-flipped":
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 0x10
        file.write_bytes(bytes(data))
    else:
        file.unlink()


@pytest.mark.parametrize(
    ("kind", "problem"),
    [("truncated", "corrupt"), ("bit-flipped", "corrupt"), ("missing", "missing")],
)
def test_verify_damaged_state_file_exits_1_naming_it(layout, kind, problem):
    """A truncated, bit-flipped or missing state file: exit 1; stderr and --json name it."""
    victim = state_files(layout.chk2)[1]
    damage(kind, victim)

    result = run("verify", layout.chk2.external_pointer, "--json")

    report = json.loads(result.stdout)
    assert 1 == result.returncode
    assert victim in error_line(result)
    assert (False, 4, [(victim, problem)]) == (
        report["ok"],
        report["handles_checked"],
        [(p["path"], p["kind"]) for p in report["problems"]],
    )


def test_verify_table_names_every_damaged_file(layout):
    """Without --json the report lists each damaged file once per problem."""
    first, second, _ = state_files(layout.chk2)
    damage("truncated", first)
    damage("missing", second)

    result = run("verify", layout.chk2.external_pointer)

    assert 1 == result.returncode
    assert "2 problems" in result.stdout
    assert [1, 1] == [
        sum(first in line and line.startswith("corrupt ") for line in result.stdout.splitlines()),
        sum(second in line and line.startswith("missing ") for line in result.stdout.splitlines()),
    ]


def test_verify_corrupt_metadata_exits_4(layout):
    """A corrupt `_metadata` is exit 4 (invalid checkpoint)."""
    result = run("verify", layout.chk4.external_pointer)

    assert 4 == result.returncode
    assert "not a valid or complete checkpoint" in error_line(result)


def on_terminal(*args, stream: str) -> tuple[int, str, str]:
    """The installed script run with ``stream`` ("stdout" or "stderr") on a pseudo-terminal
    and the other through a pipe: (exit code, what the terminal showed, the pipe's text)."""
    env = {k: v for k, v in environment({"TERM": "xterm-256color"}).items() if k != "NO_COLOR"}
    return run_on_terminal([*command(), *map(str, args)], env=env, cwd=ROOT, stream=stream)


def test_progress_bar_only_on_a_terminal(layout):
    """On a TTY, verify draws a progress bar on stderr up to 100%; through a pipe, nothing."""
    code, terminal, stdout = on_terminal("verify", layout.chk2.external_pointer, stream="stderr")

    assert 0 == code
    assert "verifying" in terminal and "100%" in terminal
    assert "verifying" not in stdout
    assert "" == run_installed("verify", layout.chk2.external_pointer).stderr


def test_colours_only_on_a_terminal(layout):
    """A table is coloured (ANSI escapes) on a terminal and plain text through a pipe."""
    code, terminal, _ = on_terminal("list", layout.job_dir, stream="stdout")
    piped = run_installed("list", layout.job_dir)

    assert (0, 0) == (code, piped.returncode)
    assert ("\x1b[" in terminal, "\x1b[" in piped.stdout) == (True, False)
    assert "completed" in terminal and "completed" in piped.stdout


# --------------------------------------------------------------------------------------------
#  inspect, list, latest
# --------------------------------------------------------------------------------------------


def test_inspect_shows_operators_handles_and_master_states(layout):
    """The table shows job id, kind, master state with a printable preview, the operator, and
    each handle (type, relative path or inline, CRC-32)."""
    metadata = load_checkpoint_metadata(layout.savepoint)
    files = [h for h in metadata.all_handles() if isinstance(h, FileStateHandle)]

    result = run("inspect", layout.savepoint.external_pointer)

    out = result.stdout
    assert (0, "") == (result.returncode, result.stderr)
    assert f"job id:        {JOB.hex}" in out
    assert "kind:          savepoint" in out
    assert "  position (base64, 9 B): YmF0Y2gtMTcA" in out.splitlines()
    assert "dedupe" in out and "subtask properties:" in out and "dedupe[1] k=v" in out
    for handle in files:
        row = next(line for line in out.splitlines() if handle.relative_path in line)
        assert "relative-file" in row and f"{handle.checksum:08x}" in row
    assert 1 == sum("(inline)" in line for line in out.splitlines())


def test_inspect_json_has_stable_keys(layout):
    """--json gives the metadata with stable keys and exact values."""
    result = run("inspect", layout.savepoint.external_pointer, "--json")

    doc = json.loads(result.stdout)
    (operator,) = doc["operators"]
    (subtask,) = operator["subtasks"]
    assert [
        "pointer",
        "checkpoint_id",
        "job_id",
        "timestamp_ms",
        "timestamp",
        "kind",
        "properties",
        "state_size",
        "master_states",
        "operators",
        "statistics",
    ] == list(doc)
    assert (9, JOB.hex, "savepoint", 1_700_000_000_000, "2023-11-14T22:13:20.000Z") == (
        doc["checkpoint_id"],
        doc["job_id"],
        doc["kind"],
        doc["timestamp_ms"],
        doc["timestamp"],
    )
    assert [
        {
            "name": "position",
            "size": 9,
            "encoding": "base64",
            "value": "YmF0Y2gtMTcA",
            "base64": "YmF0Y2gtMTcA",
        }
    ] == doc["master_states"]
    assert ("dedupe", 2, 8, 1, {"k": "v"}) == (
        operator["operator_id"],
        operator["parallelism"],
        operator["max_parallelism"],
        subtask["index"],
        subtask["properties"],
    )
    assert [len(d) for d in layout.sp_data] == [h["size"] for h in subtask["handles"]]
    assert ["relative-file", "relative-file", "inline"] == [h["type"] for h in subtask["handles"]]
    assert sum(map(len, layout.sp_data)) == doc["state_size"]


def test_list_base_directory_shows_completed_in_progress_and_invalid(layout):
    """`list` over the base directory: every chk-<id> with its status; the savepoint directory
    lists the savepoint; the table names the columns and explains the invalid one."""
    listing = run("list", layout.base, "--json")
    savepoints = run("list", layout.base.parent / "sp", "--json")
    table = run("list", layout.job_dir)

    rows = [
        (e["checkpoint_id"], e["kind"], e["status"], e["file_count"])
        for e in json.loads(listing.stdout)
    ]
    assert (0, 0, 0) == (listing.returncode, savepoints.returncode, table.returncode)
    assert [
        (1, "checkpoint", "completed", 1),
        (2, "checkpoint", "completed", 3),
        (3, "checkpoint", "in-progress", 1),
        (4, "checkpoint", "invalid", 1),
    ] == rows
    assert [(9, "savepoint", "completed", layout.savepoint.external_pointer)] == [
        (e["checkpoint_id"], e["kind"], e["status"], e["pointer"])
        for e in json.loads(savepoints.stdout)
    ]
    heading, header, *lines = table.stdout.splitlines()
    assert f"job {JOB.hex}" == heading
    assert ["ID", "KIND", "STATUS", "POSITION", "SIZE", "WRITTEN", "FILES", "AGE",
            "POINTER"] == (header.split()
    )
    assert ["in-progress"] == [line.split()[2] for line in lines if "chk-3" in line][:1]
    assert any(line.startswith("invalid: ") and "chk-4" in line for line in lines)


def test_list_missing_directory_exits_3(tmp_path):
    """Listing a directory that does not exist is exit 3."""
    result = run("list", tmp_path / "nowhere")

    assert 3 == result.returncode
    error_line(result)


def test_latest_prints_only_the_pointer(layout):
    """`latest` prints the newest valid checkpoint's pointer and nothing else on stdout; the
    corrupt chk-4 it skipped is a warning on stderr (chk-3 is in progress)."""
    result = run("latest", layout.job_dir)

    assert (0, layout.chk2.external_pointer + "\n") == (result.returncode, result.stdout)
    (warning,) = result.stderr.splitlines()
    assert warning.startswith("checkpoints: warning: skipping invalid checkpoint")
    assert layout.chk4.external_pointer in warning


def test_latest_without_completed_checkpoint_exits_3(tmp_path):
    """A job directory without a completed checkpoint: exit 3 and nothing on stdout."""
    result = run("latest", tmp_path / "cp" / JOB.hex)

    assert (3, "") == (result.returncode, result.stdout)
    error_line(result)


def test_not_found_pointer_exits_3(tmp_path):
    """inspect, verify and dispose-savepoint of a pointer with nothing there exit 3."""
    missing = tmp_path / "sp" / "savepoint-cccccc-000000000000"
    results = [run(cmd, missing) for cmd in ("inspect", "verify", "dispose-savepoint")]

    assert [3, 3, 3] == [r.returncode for r in results]
    assert all(str(missing) in error_line(r) for r in results)


# --------------------------------------------------------------------------------------------
#  dispose-savepoint
# --------------------------------------------------------------------------------------------


def test_dispose_savepoint_deletes_it(layout):
    """dispose-savepoint removes the savepoint directory and exits 0."""
    directory = Path(layout.savepoint.external_pointer)

    result = run("dispose-savepoint", directory, "--json")

    assert 0 == result.returncode
    assert {"pointer": str(directory), "disposed": True} == json.loads(result.stdout)
    assert not directory.exists()


def test_dispose_refuses_a_checkpoint_without_force(layout):
    """A checkpoint is refused with exit 2 and left intact; --force disposes it."""
    pointer = layout.chk1.external_pointer

    refused = run("dispose-savepoint", pointer)
    assert 2 == refused.returncode
    assert "--force" in error_line(refused)
    assert Path(pointer, "_metadata").exists()

    forced = run("dispose-savepoint", pointer, "--force")
    assert 0 == forced.returncode
    assert not Path(pointer).exists()


def test_dispose_with_undeletable_state_exits_1_and_metadata_is_gone(layout):
    """A state file that cannot be deleted (here: replaced by a directory) makes disposal exit
    1, and `_metadata` is gone all the same: deleted first."""
    victim = Path(state_files(layout.savepoint)[0])
    victim.unlink()
    victim.mkdir()
    (victim / "inside").write_bytes(b"x")

    result = run("dispose-savepoint", layout.savepoint.external_pointer)

    assert 1 == result.returncode
    assert str(victim) in error_line(result)
    assert not Path(layout.savepoint.external_pointer, "_metadata").exists()


# --------------------------------------------------------------------------------------------
#  S3: copy-savepoint and storage options
# --------------------------------------------------------------------------------------------


def test_copy_savepoint_local_to_s3_restores_there(layout, s3_server):
    """copy-savepoint to S3 prints only the new pointer; the copy verifies and its handles
    read the original bytes from S3."""
    target = f"s3://{s3_server.new_bucket()}/savepoints"
    name = Path(layout.savepoint.external_pointer).name

    result = run(
        "copy-savepoint",
        layout.savepoint.external_pointer,
        target,
        "--target-storage-option",
        f"endpoint_url={s3_server.endpoint_url}",
    )

    assert (0, f"{target}/{name}\n", "") == (result.returncode, result.stdout, result.stderr)
    remote = FileSystemCheckpointStorage(target, storage_options=s3_server.storage_options)
    restored = load_checkpoint_metadata(remote.resolve_checkpoint(f"{target}/{name}"))
    assert layout.sp_data == [read(h) for h in restored.all_handles()]
    verify = run("verify", f"{target}/{name}", "-o", f"endpoint_url={s3_server.endpoint_url}")
    assert 0 == verify.returncode


def s3_layout(s3_server) -> str:
    """A job with two checkpoints on S3; returns the base URL."""
    base = f"s3://{s3_server.new_bucket()}/cp"
    storage = FileSystemCheckpointStorage(
        base, storage_options=s3_server.storage_options, file_state_size_threshold=THRESHOLD
    )
    access = storage.create_checkpoint_storage(JOB)
    write_checkpoint(access, 1, (2048,))
    write_checkpoint(access, 2, (2048, 10))
    return base


def test_storage_option_values_are_never_printed(s3_server):
    """A secret passed as a storage option (flag or environment) appears in no output: not on
    success, not in --json, not in errors (not found, unreachable endpoint, usage)."""
    base = s3_layout(s3_server)
    flags = ["-o", f"endpoint_url={s3_server.endpoint_url}", "-o", "key=testing"]
    secret = ["-o", f"secret={CANARY}"]
    unreachable = [
        "-o",
        "endpoint_url=http://127.0.0.1:9",
        "-o",
        'config_kwargs={"retries": {"max_attempts": 1}}',
        *secret,
    ]
    env_options = {
        "CHECKPOINTS_STORAGE_OPTIONS": json.dumps(
            {"endpoint_url": s3_server.endpoint_url, "key": "testing", "secret": CANARY}
        )
    }

    results = {
        "list": run("list", base, "--json", *flags, *secret),
        "inspect": run("inspect", f"{base}/{JOB.hex}/chk-2", *flags, *secret),
        "latest-env": run_installed("latest", f"{base}/{JOB.hex}", env=env_options),
        "not-found": run("verify", f"{base}/{JOB.hex}/chk-7", *flags, *secret),
        "unreachable": run("list", base, *unreachable),
        "usage": run("list", base, "-o", CANARY),
        "typo": run("list", base, "--storage-opt", f"secret={CANARY}"),
    }

    codes = {name: r.returncode for name, r in results.items()}
    assert {
        "list": 0,
        "inspect": 0,
        "latest-env": 0,
        "not-found": 3,
        "unreachable": 5,
        "usage": 2,
        "typo": 2,
    } == codes
    for name, result in results.items():
        assert CANARY not in result.stdout + result.stderr, name
    assert "127.0.0.1:9" not in results["unreachable"].stderr
    assert f"{base}/{JOB.hex}/chk-2\n" == results["latest-env"].stdout
    assert [1, 2] == [e["checkpoint_id"] for e in json.loads(results["list"].stdout)]


# --------------------------------------------------------------------------------------------
#  gc (last: the collector is another module)
# --------------------------------------------------------------------------------------------


def test_gc_dry_run_lists_orphans_then_gc_deletes_them(layout):
    """`gc --dry-run` names an unreferenced file without deleting it; `gc` deletes it and
    keeps every referenced file; --json has stable keys."""
    pytest.importorskip("checkpoint_storage._gc")
    orphan = Path(layout.chk2.external_pointer, "orphan-of-a-crashed-writer")
    orphan.write_bytes(b"o" * 4096)
    past = orphan.stat().st_mtime - 7200
    os.utime(orphan, (past, past))
    referenced = state_files(layout.chk1) + state_files(layout.chk2)

    dry = run("gc", layout.job_dir, "--dry-run", "--grace-period", "1h")
    assert 4 == dry.returncode
    assert f"would delete: {orphan}" in dry.stdout
    assert orphan.exists()

    real = run("gc", layout.job_dir, "--grace-period", "1h", "--json")
    doc = json.loads(real.stdout)
    # issue 13: chk-4's _metadata cannot be read, so gc keeps it (and shared/) and exits 4
    assert 4 == real.returncode
    assert [
        "dry_run",
        "deleted",
        "kept",
        "bytes_deleted",
        "removed_directories",
        "skipped",
        "shared_collected",
    ] == list(doc)
    assert [layout.chk4.external_pointer] == [s["pointer"] for s in doc["skipped"]]
    assert (False, [str(orphan)], 4096) == (doc["dry_run"], doc["deleted"], doc["bytes_deleted"])
    assert not orphan.exists()
    assert all(Path(p).exists() for p in referenced)


def test_gc_needs_a_job_directory(layout):
    """gc of a directory that is not <base>/<job_id> is a usage error; of a missing job
    directory, not found."""
    pytest.importorskip("checkpoint_storage._gc")
    wrong = run("gc", layout.base)
    missing = run("gc", layout.base / ("d" * 32))

    assert (2, 3) == (wrong.returncode, missing.returncode)
    error_line(wrong)
    error_line(missing)


# --------------------------------------------------------------------------------------------
#  trust (issue 13): foreign and corrupt checkpoints, pointers, exit codes
# --------------------------------------------------------------------------------------------


def flink_job(tmp_path: Path) -> tuple[Path, set[str]]:
    import fsspec

    job = tmp_path / "flink" / ("f" * 32)
    return job, make_flink_job_directory(fsspec.filesystem("file"), str(job))


def files_below(directory: Path) -> set[str]:
    return {str(p) for p in directory.rglob("*") if p.is_file()}


def flip_last_byte(path: str) -> None:
    data = bytearray(Path(path).read_bytes())
    data[-1] ^= 1
    Path(path).write_bytes(bytes(data))


def test_gc_of_a_flink_job_directory_deletes_nothing_names_each_file_and_exits_4(tmp_path):
    """`gc --grace-period 0s [--dry-run]` in Flink's job directory deletes no file, names every
    `_metadata` as Flink's with its version, and exits 4."""
    job, written = flink_job(tmp_path)

    dry = run("gc", job, "--grace-period", "0s", "--dry-run")
    real = run("gc", job, "--grace-period", "0s", "--json")

    assert (4, 4) == (dry.returncode, real.returncode)
    assert dry.stdout.startswith(f"{job}: dry run: would delete 0 files (0 bytes); kept 19 files")
    for checkpoint_id in (3, 5, 6):
        assert (
            f"kept (foreign): {job}/chk-{checkpoint_id}: {job}/chk-{checkpoint_id}/_metadata was "
            "written by Apache Flink (metadata format version 6)"
        ) in dry.stdout
    assert f"first {job}/chk-3/_metadata (foreign)" in error_line(real)
    assert ([], False) == (
        json.loads(real.stdout)["deleted"],
        json.loads(real.stdout)["shared_collected"],
    )
    assert written == files_below(job)


def test_inspect_and_list_name_flinks_metadata(tmp_path):
    """`inspect` of Flink's `_metadata` whose body is not Flink's layout exits 4 saying so;
    `list` shows its rows as Flink's (format Apache Flink, status invalid), exit 0. (Real
    Flink checkpoints: tests/test_cli_flink.py.)"""
    job, _ = flink_job(tmp_path)

    inspect = run("inspect", job / "chk-5" / "_metadata")
    listing = run("list", job, "--json")

    assert 4 == inspect.returncode
    assert (
        f"checkpoints: error: {job}/chk-5/_metadata: not a valid Apache Flink _metadata at byte"
    ) in error_line(inspect)
    assert 0 == listing.returncode
    assert [(i, "Apache Flink", "invalid") for i in (3, 5, 6)] == [
        (e["checkpoint_id"], e["format"], e["status"]) for e in json.loads(listing.stdout)
    ]


def test_file_urls_are_local_paths(layout):
    """`file:/abs`, `file://localhost/abs` and percent-encoded `file:///` URLs name the local
    checkpoint (inspect exits 0 with its plain path as pointer)."""
    path = layout.chk2.external_pointer
    moved = Path(layout.base.parent / "a b%")
    Path(layout.base).rename(moved)
    path = str(moved / JOB.hex / "chk-2")
    encoded = path.replace("%", "%25").replace(" ", "%20")

    results = [
        run("inspect", "--json", url)
        for url in (f"file:{encoded}", f"file://localhost{encoded}", f"file://{encoded}")
    ]

    assert [(0, path)] * 3 == [(r.returncode, json.loads(r.stdout)["pointer"]) for r in results]


def test_dot_segments_follow_the_library_rule_with_advice(layout):
    """'..' inside a pointer is refused (exit 2) with the very message `restore_from` gets; a
    relative path starting with ../ works from its directory."""
    inner = f"{layout.job_dir}/chk-1/../chk-2"
    with pytest.raises(UnsafePathError) as library:
        resolve_checkpoint_pointer(inner, None)

    refused = run("inspect", inner)
    relative = run("inspect", "--json", "../chk-2", cwd=layout.job_dir / "chk-1")

    assert 2 == refused.returncode
    assert f"checkpoints: error: {library.value}" == error_line(refused)
    assert f"write it as {layout.job_dir}/chk-2" in error_line(refused)
    assert (0, layout.chk2.external_pointer) == (
        relative.returncode,
        json.loads(relative.stdout)["pointer"],
    )


def test_a_job_directory_given_to_inspect_or_verify_suggests_latest(layout):
    """`inspect`/`verify` of a job directory exit 3 and suggest `checkpoints latest DIR`."""
    for name in ("inspect", "verify"):
        result = run(name, layout.job_dir)

        assert 3 == result.returncode
        assert f"`checkpoints latest {layout.job_dir}`" in error_line(result)
        assert "does not exist" not in error_line(result)


def test_verify_exits_1_on_an_unreadable_state_file(layout):
    """A state file replaced by a directory is a reported problem ("unreadable"): exit 1."""
    state = state_files(layout.chk2)[0]
    os.remove(state)
    os.mkdir(state)

    result = run("verify", layout.chk2.external_pointer, "--json")

    assert 1 == result.returncode
    assert ["unreadable"] == [p["kind"] for p in json.loads(result.stdout)["problems"]]


def test_gc_with_nothing_to_delete_exits_0(tmp_path):
    """A job directory without garbage: exit 0, nothing deleted."""
    storage = FileSystemCheckpointStorage(str(tmp_path / "cp"), file_state_size_threshold=THRESHOLD)
    access = storage.create_checkpoint_storage(JOB)
    access.initialize_base_locations()
    write_checkpoint(access, 1, (2048,))

    result = run("gc", tmp_path / "cp" / JOB.hex, "--grace-period", "0s")

    assert (0, "") == (result.returncode, result.stderr)
    assert "deleted 0 files (0 bytes); kept 2 files" in result.stdout


def test_gc_deletes_a_corrupt_checkpoint_only_with_delete_corrupt(tmp_path):
    """A checkpoint of ours with a corrupt `_metadata`: gc keeps it and exits 4; with
    --delete-corrupt it is deleted and gc exits 0."""
    storage = FileSystemCheckpointStorage(str(tmp_path / "cp"), file_state_size_threshold=THRESHOLD)
    access = storage.create_checkpoint_storage(JOB)
    access.initialize_base_locations()
    write_checkpoint(access, 1, (2048,))
    corrupt, _ = write_checkpoint(access, 2, (2048,))
    flip_last_byte(corrupt.metadata_handle.path)
    job = tmp_path / "cp" / JOB.hex
    files = files_below(Path(corrupt.external_pointer))

    kept = run("gc", job, "--grace-period", "0s")
    assert 4 == kept.returncode
    assert f"kept (corrupt): {corrupt.external_pointer}" in kept.stdout
    assert files == files_below(Path(corrupt.external_pointer))

    deleted = run("gc", job, "--grace-period", "0s", "--delete-corrupt", "--json")
    assert (0, sorted(files)) == (deleted.returncode, json.loads(deleted.stdout)["deleted"])


def test_dispose_corrupt_removes_only_a_corrupt_checkpoint(layout):
    """`dispose --corrupt` removes a corrupt checkpoint of ours (exit 0) and refuses a valid
    one (exit 2, nothing deleted)."""
    corrupt, _ = write_checkpoint(layout.access, 5, (2048,))
    flip_last_byte(corrupt.metadata_handle.path)

    disposed = run("dispose", corrupt.external_pointer, "--corrupt")
    refused = run("dispose-savepoint", layout.chk1.external_pointer, "--corrupt")

    assert (0, 2) == (disposed.returncode, refused.returncode)
    assert not Path(corrupt.external_pointer).exists()
    assert "is not corrupt" in error_line(refused)
    assert Path(layout.chk1.metadata_handle.path).exists()


def test_copy_savepoint_copies_a_checkpoint_whose_files_lie_inside_it(layout, tmp_path):
    """copy-savepoint of chk-2 (its files all inside it, properties say checkpoint) exits 0
    and the copy verifies."""
    result = run("copy-savepoint", layout.chk2.external_pointer, tmp_path / "copies")
    verify = run("verify", result.stdout.strip())

    assert (0, 0) == (result.returncode, verify.returncode)
    assert str(tmp_path / "copies" / "chk-2") == result.stdout.strip()


@pytest.mark.timeout(60)
def test_an_unopenable_newest_metadata_is_named_and_list_goes_on(layout):
    """A newest `_metadata` that is a symbolic link loop: `latest` exits 5 naming it (no bare
    errno); `list` marks the row unreadable and exits 0."""
    chk7 = layout.job_dir / "chk-7"
    chk7.mkdir()
    os.symlink(chk7 / "_metadata", chk7 / "_metadata")

    latest = run("latest", layout.job_dir)
    listing = run("list", layout.job_dir, "--json")

    assert 5 == latest.returncode
    assert error_line(latest).startswith(f"checkpoints: error: cannot read {chk7}/_metadata (")
    assert 0 == listing.returncode
    assert (7, "unreadable") == tuple(
        (e["checkpoint_id"], e["status"]) for e in json.loads(listing.stdout)
    )[-1]


# --------------------------------------------------------------------------------------------
#  issue 14: a data directory's jobs, decoded master states
# --------------------------------------------------------------------------------------------


def position(partition: str, batches: int, complete: bool) -> bytes:
    """A source position as a pipeline writes it (SOURCE_POSITION_STATE)."""
    raw = {"partition": partition, "batches": batches, "complete": complete, "digest": "d" * 32}
    return json.dumps(raw, sort_keys=True).encode()


def pipeline_states(name: str, partition: str, batches: int, complete: bool) -> dict:
    return {
        SOURCE_POSITION_STATE: position(partition, batches, complete),
        JOB_NAME_STATE: name.encode(),
    }


class DataDirectory:
    """<tmp>/.data as the Dagster code location lays it out: checkpoints/<job>/chk-<id> of two
    pipelines, savepoints/savepoint-* and savepoints/scheduled/savepoint-*, and landing/ with
    input files (no checkpoints)."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / ".data"
        storage = FileSystemCheckpointStorage(
            str(self.root / "checkpoints"),
            str(self.root / "savepoints"),
            file_state_size_threshold=THRESHOLD,
        )
        self.clicks = JobID("a" * 32)
        self.views = JobID("b" * 32)
        clicks = storage.create_checkpoint_storage(self.clicks)
        views = storage.create_checkpoint_storage(self.views)
        write_checkpoint(
            clicks, 1, (2048,), master=pipeline_states("clicks", "2026-10-06", 3, False)
        )
        write_checkpoint(
            clicks, 2, (2048,), master=pipeline_states("clicks", "2026-10-06", 4, True)
        )
        write_checkpoint(views, 7, (2048,), master=pipeline_states("views", "2026-10-05", 1, False))
        savepoint = CheckpointProperties.for_savepoint()
        self.manual, _ = write_checkpoint(
            clicks, 2, (2048,), savepoint, master=pipeline_states("clicks", "2026-10-06", 4, True)
        )
        self.scheduled, _ = write_checkpoint(
            views,
            8,
            (2048,),
            savepoint,
            master=pipeline_states("views", "2026-10-06", 2, False),
            target=str(self.root / "savepoints" / "scheduled"),
        )
        (self.root / "landing" / "2026-10-06").mkdir(parents=True)
        (self.root / "landing" / "2026-10-06" / "batch-1.json").write_text("{}")


def test_list_of_a_data_directory_finds_every_job_below_it(tmp_path):
    """`list .data` finds the jobs under checkpoints/ and their savepoints under savepoints/
    (also savepoints/scheduled/), each row with its decoded source position and job name."""
    data = DataDirectory(tmp_path)

    result = run("list", ".data", "--json", cwd=tmp_path)

    rows = json.loads(result.stdout)
    assert (0, "") == (result.returncode, result.stderr)
    assert [
        (data.clicks.hex, 1, "checkpoint", "clicks", ("2026-10-06", 3, False)),
        (data.clicks.hex, 2, "checkpoint", "clicks", ("2026-10-06", 4, True)),
        (data.clicks.hex, 2, "savepoint", "clicks", ("2026-10-06", 4, True)),
        (data.views.hex, 7, "checkpoint", "views", ("2026-10-05", 1, False)),
        (data.views.hex, 8, "savepoint", "views", ("2026-10-06", 2, False)),
    ] == [
        (
            r["job_id"],
            r["checkpoint_id"],
            r["kind"],
            r["job_name"],
            tuple(r["source_position"][k] for k in ("partition", "batches", "complete")),
        )
        for r in rows
    ]
    assert [data.manual.external_pointer, data.scheduled.external_pointer] == [
        r["pointer"] for r in rows if r["kind"] == "savepoint"
    ]


def test_list_table_shows_each_pipeline_and_its_positions(tmp_path):
    """The table of a data directory has one section per job, headed by the pipeline's name,
    with positions as `partition, N batches` and `partition, partition end (N batches)`."""
    data = DataDirectory(tmp_path)

    result = run("list", tmp_path / ".data")

    sections = result.stdout.split("\n\n")
    assert 0 == result.returncode
    assert [
        f"pipeline clicks (job {data.clicks.hex})",
        f"pipeline views (job {data.views.hex})",
    ] == [section.splitlines()[0] for section in sections]
    clicks = [line.split("  ") for line in sections[0].splitlines()[2:]]
    cells = [[c.strip() for c in row if c.strip()] for row in clicks]
    assert [
        ["1", "checkpoint", "completed", "2026-10-06, 3 batches"],
        ["2", "checkpoint", "completed", "2026-10-06, partition end (4 batches)"],
        ["2", "savepoint", "completed", "2026-10-06, partition end (4 batches)"],
    ] == [row[:4] for row in cells]
    views = [line.split("  ") for line in sections[1].splitlines()[2:]]
    assert ["7", "checkpoint", "completed", "2026-10-05, 1 batch"] == (
        [c.strip() for c in views[0] if c.strip()][:4]
    )


def test_list_of_a_job_directory_lists_only_that_job(tmp_path):
    """`list` of one job directory lists that job's checkpoints, not its savepoints elsewhere
    nor other jobs."""
    data = DataDirectory(tmp_path)

    result = run("list", tmp_path / ".data" / "checkpoints" / data.views.hex, "--json")

    assert [(data.views.hex, 7)] == [
        (r["job_id"], r["checkpoint_id"]) for r in json.loads(result.stdout)
    ]


def test_inspect_decodes_master_states_in_full(tmp_path):
    """`inspect` shows a JSON master state whole, an Arrow schema as its fields, text as text
    and other bytes as base64, in the table and in --json."""
    storage = FileSystemCheckpointStorage(str(tmp_path / "cp"), file_state_size_threshold=THRESHOLD)
    access = storage.create_checkpoint_storage(JOB)
    schema = pa.schema([("user", pa.string()), pa.field("clicks", pa.int64(), nullable=False)])
    master = {
        **pipeline_states("clicks", "2026-10-06", 3, False),
        STATE_SCHEMA_PREFIX + "totals": schema.serialize().to_pybytes(),
        "opaque": b"\x00\x01\xfe",
    }
    completed, _ = write_checkpoint(access, 3, (2048,), master=master)

    table = run("inspect", completed.external_pointer)
    doc = json.loads(run("inspect", completed.external_pointer, "--json").stdout)

    assert 0 == table.returncode
    lines = table.stdout.splitlines()
    start = lines.index("master states:")
    assert [
        f"  source-position (json, {len(master[SOURCE_POSITION_STATE])} B): "
        f'{{"batches": 3, "complete": false, "digest": "{"d" * 32}", "partition": "2026-10-06"}}',
        "  pipeline-name (text, 6 B): clicks",
        f"  state-schema/totals (arrow schema, {len(master['state-schema/totals'])} B):",
        "    user: string",
        "    clicks: int64 not null",
        "  opaque (base64, 3 B): AAH+",
    ] == lines[start + 1 : start + 7]
    assert [
        ("source-position", "json", json.loads(master[SOURCE_POSITION_STATE])),
        ("pipeline-name", "text", "clicks"),
        (
            "state-schema/totals",
            "arrow-schema",
            [
                {"name": "user", "type": "string", "nullable": True},
                {"name": "clicks", "type": "int64", "nullable": False},
            ],
        ),
        ("opaque", "base64", "AAH+"),
    ] == [(m["name"], m["encoding"], m["value"]) for m in doc["master_states"]]


# --------------------------------------------------------------------------------------------
#  shell completion
# --------------------------------------------------------------------------------------------


def test_completion_is_offered_and_completes_commands(monkeypatch):
    """`--help` offers --install-completion and --show-completion; the bash script uses the
    command's completion variable, and a completion request completes a command name."""
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")
    app = cli.build_app(plugins=False)

    help_text = invoke(app, "--help")
    script = invoke(app, "--show-completion", "bash")
    completion = invoke(
        app,
        env={
            "_CHECKPOINTS_COMPLETE": "complete_bash",
            "COMP_WORDS": "checkpoints li",
            "COMP_CWORD": "1",
        },
    )

    assert "--install-completion" in help_text.stdout and "--show-completion" in help_text.stdout
    assert (0, True) == (script.returncode, "_CHECKPOINTS_COMPLETE=complete_bash" in script.stdout)
    assert (0, ["list"]) == (completion.returncode, completion.stdout.split())


# --------------------------------------------------------------------------------------------
#  plugins
# --------------------------------------------------------------------------------------------


def register_tiny(app: typer.Typer) -> None:
    """A plugin: `checkpoints tiny DIR` prints the directory and the storage option keys
    (never values), through the helpers built-in commands use."""

    @app.command("tiny")
    def tiny(
        directory: str,
        json_output: cli.JsonOption = False,
        storage_option: cli.StorageOption = None,
    ) -> None:
        def body() -> int:
            options = cli.storage_options(storage_option)
            where = cli.location(directory)
            if not Path(where).exists():
                raise FileNotFoundError(f"{where} does not exist")
            if json_output:
                cli.print_json({"directory": where, "options": sorted(options)})
            else:
                cli.echo(f"{where}: {', '.join(sorted(options))}")
            return 0

        cli.run_command(body)


def register_broken(app: typer.Typer) -> None:
    raise RuntimeError("this plugin cannot load")


def test_a_plugin_command_behaves_like_a_built_in_one(tmp_path):
    """A registered command runs with the common storage options (values from the
    environment included, never printed), the path rule (exit 2) and the error mapping
    (not found: exit 3, one line)."""
    app = cli.build_app(plugins=False)
    register_tiny(app)
    env = {"CHECKPOINTS_STORAGE_OPTIONS": json.dumps({"secret": CANARY})}

    ok = invoke(app, "tiny", tmp_path, "-o", "endpoint_url=http://x", "--json", env=env)
    refused = invoke(app, "tiny", f"{tmp_path}/a/../b")
    missing = invoke(app, "tiny", tmp_path / "nowhere", "-o", f"key={CANARY}")

    assert {"directory": str(tmp_path), "options": ["endpoint_url", "secret"]} == (
        json.loads(ok.stdout)
    )
    assert (0, 2, 3) == (ok.returncode, refused.returncode, missing.returncode)
    assert f"checkpoints: error: {tmp_path / 'nowhere'} does not exist" == error_line(missing)
    error_line(refused)
    assert all(CANARY not in r.stdout + r.stderr for r in (ok, refused, missing))


def test_the_plugin_loader_calls_every_entry_point_and_survives_a_broken_one(capsys):
    """`load_plugins` calls each entry point of the group with the app; a plugin that fails
    is named in a warning and the others still register."""
    broken = f"{__name__}:register_broken"
    entry_points = [
        importlib.metadata.EntryPoint("broken", broken, cli.PLUGIN_GROUP),
        importlib.metadata.EntryPoint("tiny", f"{__name__}:register_tiny", cli.PLUGIN_GROUP),
    ]
    app = cli.build_app(plugins=False)

    loaded = cli.load_plugins(app, entry_points)
    warning = capsys.readouterr().err
    result = invoke(app, "tiny", ROOT)

    assert (["tiny"], 0, f"{ROOT}: \n") == (loaded, result.returncode, result.stdout)
    assert (
        f"checkpoints: warning: plugin broken ({broken}) was not loaded: this plugin cannot load\n"
    ) == warning
