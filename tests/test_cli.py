"""The ``checkpoints`` command (issue 3, "Operator CLI"), run as a subprocess against real local
directories and against S3 (moto): output, JSON, exit codes, and storage option values that
are never printed.

Runs the installed ``checkpoints`` executable next to the interpreter when there is one, else
``python -m checkpoint_storage.cli``.
"""

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint_storage import (
    CheckpointMetadata,
    CheckpointProperties,
    FileStateHandle,
    FileSystemCheckpointStorage,
    JobID,
    OperatorState,
    OperatorSubtaskState,
    load_checkpoint_metadata,
)
from checkpoint_storage._access import resolve_checkpoint_pointer
from checkpoint_storage.exceptions import UnsafePathError
from tests.support import finalize, make_flink_job_directory, payload, read, write_state

ROOT = Path(__file__).resolve().parent.parent
EXECUTABLE = Path(sys.executable).parent / "checkpoints"
THRESHOLD = 1024
JOB = JobID("c" * 32)
CANARY = "CANARY-s3cr3t-4711"

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------------------------
#  helpers
# --------------------------------------------------------------------------------------------


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


def run(*args, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*command(), *map(str, args)],
        capture_output=True,
        text=True,
        env=environment(env),
        cwd=cwd,
        timeout=90,
    )


def error_line(result: subprocess.CompletedProcess) -> str:
    """The last stderr line, which must be the command's one-line error."""
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines, "no error message on stderr"
    assert lines[-1].startswith("checkpoints: error: "), result.stderr
    return lines[-1]


def write_checkpoint(access, checkpoint_id, sizes, properties=None, subtask=0):
    location = (
        access.initialize_location_for_savepoint(checkpoint_id)
        if properties is not None and properties.is_savepoint()
        else access.initialize_location_for_checkpoint(checkpoint_id)
    )
    data = [payload(n, checkpoint_id * 10 + i) for i, n in enumerate(sizes)]
    handles = tuple(write_state(location, d) for d in data)
    md = CheckpointMetadata(
        checkpoint_id,
        (OperatorState("dedupe", 2, 8, {subtask: OperatorSubtaskState(handles, {"k": "v"})}),),
        {"position": b"batch-17\x00"},
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
    """`--help` works on the command and every subcommand (exit 0) and lists the exit codes."""
    results = [run("--help"), *(run(name, "--help") for name in COMMANDS)]

    assert [0] * 8 == [r.returncode for r in results]
    for name, result in zip(["", *COMMANDS], results, strict=True):
        assert f"usage: checkpoints {name}".strip() in result.stdout
        assert "exit codes:" in result.stdout
        assert "3  checkpoint or directory not found" in result.stdout


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
    """Bad arguments exit 2 with `checkpoints: error: ...` and no traceback."""
    result = run(*args)

    assert 2 == result.returncode
    error_line(result)


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


def test_progress_bar_only_on_a_terminal(layout):
    """On a TTY, verify draws a progress bar on stderr up to 100%; through a pipe, nothing."""
    primary, secondary = pty.openpty()
    try:
        process = subprocess.Popen(
            [*command(), "verify", layout.chk2.external_pointer],
            stdout=subprocess.PIPE,
            stderr=secondary,
            env=environment(),
            cwd=ROOT,
        )
        os.close(secondary)
        secondary = -1
        chunks = []
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        stdout, _ = process.communicate(timeout=60)
    finally:
        os.close(primary)
        if secondary >= 0:
            os.close(secondary)
    terminal = b"".join(chunks).decode()

    assert 0 == process.returncode
    assert "verifying [" in terminal and "100%" in terminal
    assert "verifying" not in stdout.decode()
    assert "" == run("verify", layout.chk2.external_pointer).stderr


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
    assert ["position", "9", "B", "batch-17."] in [line.split() for line in out.splitlines()]
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
    ] == list(doc)
    assert (9, JOB.hex, "savepoint", 1_700_000_000_000, "2023-11-14T22:13:20.000Z") == (
        doc["checkpoint_id"],
        doc["job_id"],
        doc["kind"],
        doc["timestamp_ms"],
        doc["timestamp"],
    )
    assert [{"name": "position", "size": 9, "preview": "batch-17.", "base64": "YmF0Y2gtMTcA"}] == (
        doc["master_states"]
    )
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
    header, *lines = table.stdout.splitlines()
    assert ["JOB", "ID", "KIND", "STATUS", "SIZE", "FILES", "AGE", "POINTER"] == header.split()
    assert ["in-progress"] == [line.split()[3] for line in lines if "chk-3" in line][:1]
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
        "latest-env": run("latest", f"{base}/{JOB.hex}", env=env_options),
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
    """`inspect` of Flink's `_metadata` exits 4 saying who wrote it; `list` shows its rows as
    Flink's (kind flink, status foreign), exit 0."""
    job, _ = flink_job(tmp_path)

    inspect = run("inspect", job / "chk-5" / "_metadata")
    listing = run("list", job, "--json")

    assert 4 == inspect.returncode
    assert (
        f"checkpoints: error: {job}/chk-5/_metadata was written by Apache Flink (metadata "
        "format version 6); this library cannot read it"
    ) in error_line(inspect)
    assert 0 == listing.returncode
    assert [(i, "flink", "foreign") for i in (3, 5, 6)] == [
        (e["checkpoint_id"], e["kind"], e["status"]) for e in json.loads(listing.stdout)
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
