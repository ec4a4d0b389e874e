"""``checkpoints list/inspect/verify/orphans/read-flink`` on copies of the real Apache Flink
2.3.0 samples (/work/shared/flink-samples)."""

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from checkpoint_storage import cli

SAMPLES = Path(os.environ.get("FLINK_SAMPLES", "/work/shared/flink-samples"))
pytestmark = pytest.mark.skipif(not (SAMPLES / "scratch").is_dir(), reason="no Flink samples")

RESTORED = "858c4eba9ab0bd13ae80f7b855214a38"
ORIGINAL = "f722d28ed64854daeb21648a701176a8"
LONG_AGO = time.time() - 7 * 86400


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def run(*args) -> Ran:
    """The built-in ``checkpoints`` command, in-process, without CHECKPOINTS_* variables."""
    env = {k: None for k in os.environ if k.startswith("CHECKPOINTS_")}
    result = CliRunner().invoke(cli.build_app(plugins=False), [str(a) for a in args], env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Ran(result.exit_code, result.stdout, result.stderr)


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    root = tmp_path / "scratch"
    shutil.copytree(SAMPLES / "scratch", root)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
        os.utime(path, (LONG_AGO, LONG_AGO))
    return root


def remap(scratch: Path) -> list[str]:
    return ["--remap", f"/srv/flinkdemo={scratch}"]


def tree(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_list_shows_every_flink_checkpoint_and_savepoint(scratch: Path) -> None:
    ran = run("list", scratch, "--json")
    assert ran.returncode == 0, ran.stderr
    rows = json.loads(ran.stdout)
    assert len(rows) == 17
    assert {r["format"] for r in rows} == {"Apache Flink"}
    kinds = {Path(r["pointer"]).name: (r["checkpoint_id"], r["kind"]) for r in rows}
    assert kinds["savepoint-609553-3e06fb282423"] == (6, "savepoint")
    assert kinds["chk-10"] == (10, "checkpoint")
    text = run("list", scratch / "ckpts" / ORIGINAL)
    assert text.returncode == 0 and "Apache Flink" in text.stdout and "chk-5" in text.stdout


def test_list_relative_shows_flinks_pointers_relative_to_dir(scratch: Path) -> None:
    """``list --relative`` of Flink's directories: pointers below DIR, as for this library's."""
    ran = run("list", scratch, "--relative", "--json")
    assert ran.returncode == 0, ran.stderr
    pointers = {r["pointer"] for r in json.loads(ran.stdout)}
    assert f"ckpts/{ORIGINAL}/chk-5" in pointers
    assert "savepoints/savepoint-609553-3e06fb282423" in pointers
    assert not any(p.startswith("/") for p in pointers)


def test_flink_is_a_command_group_and_the_help_of_list_inspect_verify_names_it() -> None:
    """``orphans`` and ``read-flink`` come from the command group ``checkpoint_storage.cli.flink``;
    ``list``, ``inspect`` and ``verify`` say in their help that they read Flink's directories
    and take ``--remap``."""
    from checkpoint_storage.cli import COMMAND_GROUPS, flink

    assert flink in COMMAND_GROUPS
    assert {"orphans", "read-flink"} <= set(run("--help").stdout.split())
    for command in ("list", "inspect", "verify"):
        shown = " ".join(run(command, "--help").stdout.split())
        assert "Apache Flink" in shown and "--remap" in shown, command


def test_inspect_shows_operators_handles_inline_and_file_bytes(scratch: Path) -> None:
    chk = scratch / "ckpts" / RESTORED / "chk-8"
    ran = run("inspect", chk, "--json", *remap(scratch))
    assert ran.returncode == 0, ran.stderr
    doc = json.loads(ran.stdout)
    assert (doc["checkpoint_id"], doc["kind"], doc["format_version"]) == (8, "checkpoint", 6)
    assert [op["name"] for op in doc["operators"]][2] == "running-count"
    assert doc["inline_bytes"] > 0 and doc["file_bytes"] > 0
    assert doc["missing_files"] == []
    assert any(f"/ckpts/{ORIGINAL}/shared/" in f["path"] for f in doc["referenced_files"])
    # Without --remap the paths of the machine Flink ran on are missing here: inspect says so.
    plain = json.loads(run("inspect", chk / "_metadata", "--json").stdout)
    assert plain["missing_files"] and all(
        p.startswith("/srv/flinkdemo/") for p in plain["missing_files"]
    )
    text = run("inspect", chk, *remap(scratch))
    assert "written by:     Apache Flink (metadata format version 6)" in text.stdout
    assert "IncrementalRemoteKeyedStateHandle / FileStateHandle" in text.stdout


def test_inspect_of_a_savepoint_names_its_type(scratch: Path) -> None:
    ran = run("inspect", scratch / "savepoints" / "savepoint-609553-3e06fb282423", "--json")
    props = json.loads(ran.stdout)["properties"]
    assert (props["kind"], props["type"], props["format_type"]) == (
        "savepoint",
        "Suspend Savepoint",
        "NATIVE",
    )
    assert props["post_checkpoint_action"] == "SUSPEND"


def test_verify_passes_on_intact_copies_and_names_corrupted_files(scratch: Path) -> None:
    pointers = [p.parent for p in scratch.rglob("_metadata")]
    for pointer in pointers:
        ran = run("verify", pointer, *remap(scratch))
        assert ran.returncode == 0, (pointer, ran.stdout, ran.stderr)
    victim = scratch / "savepoints" / "savepoint-287eee-d43e8eb8a8c0"
    data_file = victim / "509c2409-fa77-46fe-ad4c-254b82c139ae"
    data_file.write_bytes(data_file.read_bytes()[:1000])
    ran = run("verify", victim, "--json")
    assert ran.returncode == 1
    problems = json.loads(ran.stdout)["problems"]
    assert [(p["path"], p["kind"]) for p in problems] == [(str(data_file), "corrupt")]
    metadata = scratch / "ckpts" / ORIGINAL / "chk-5" / "_metadata"
    metadata.write_bytes(metadata.read_bytes()[:-30])
    ran = run("verify", metadata.parent)
    assert ran.returncode == 4
    assert f"{metadata}: not a valid Apache Flink _metadata" in ran.stderr


def test_orphans_reports_claimed_files_and_added_files_without_deleting(scratch: Path) -> None:
    restored = scratch / "ckpts" / RESTORED
    (restored / "shared" / "stray").write_bytes(b"z" * 321)
    before = tree(scratch)
    ran = run("orphans", restored, "--json", *remap(scratch))
    assert ran.returncode == 0, ran.stderr
    doc = json.loads(ran.stdout)
    assert [(o["path"], o["size"]) for o in doc["orphans"]] == [
        (str(restored / "shared" / "stray"), 321)
    ]
    assert doc["orphans"][0]["age_seconds"] >= 0
    assert len(doc["external"]) == 4
    assert all(f"/ckpts/{ORIGINAL}/shared/" in e["path"] for e in doc["external"])
    assert [r["checkpoint_id"] for r in doc["retained"]] == [8, 9, 10]
    assert (doc["dry_run"], doc["deleted"]) == (True, [])
    assert tree(scratch) == before


def test_orphans_delete_needs_confirmation_and_spares_referenced_files(scratch: Path) -> None:
    original = scratch / "ckpts" / ORIGINAL
    shutil.rmtree(original / "chk-6")  # subsumed after the CLAIM restore
    before = tree(scratch)
    refused = run("orphans", original, "--delete", *remap(scratch))  # no terminal, no --yes
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert tree(scratch) == before
    ran = run(
        "orphans",
        original,
        "--delete",
        "--yes",
        "--grace",
        "1h",
        "--also-referenced-by",
        scratch / "ckpts" / RESTORED,
        "--json",
        *remap(scratch),
    )
    assert ran.returncode == 0, ran.stderr
    doc = json.loads(ran.stdout)
    assert doc["deleted"] and doc["protected_by_others"]
    assert all(not Path(p).exists() for p in doc["deleted"])
    assert all(Path(p).exists() for p in doc["protected_by_others"])
    for job in (original, scratch / "ckpts" / RESTORED):
        for chk in job.glob("chk-*"):
            assert run("verify", chk, *remap(scratch)).returncode == 0, chk


def test_read_flink_prints_the_value_state_rows(scratch: Path) -> None:
    savepoint = scratch / "savepoints" / "savepoint-fc063a-1505fc75f4a1"
    ran = run("read-flink", savepoint, "--python-value-type", "long", "--json")
    assert ran.returncode == 0, ran.stderr
    rows = json.loads(ran.stdout)["rows"]
    assert sorted(r["key"] for r in rows) == list(range(50))
    assert sum(r["value"] for r in rows) % 500 == 0
    refused = run("read-flink", scratch / "savepoints" / "savepoint-287eee-2bac4548935e")
    assert refused.returncode == 4 and "only canonical savepoints" in refused.stderr


def test_a_malformed_remap_is_a_usage_error(scratch: Path) -> None:
    ran = run("inspect", scratch / "ckpts" / RESTORED / "chk-8", "--remap", "nothing")
    assert ran.returncode == 2 and "OLD=NEW" in ran.stderr
