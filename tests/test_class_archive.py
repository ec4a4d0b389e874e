"""The driver JVM's class archive (``pipelines.class_archive``): used only when whole, ignored
when it does not match the JVM, built complete or not at all, and mapped by a session that
``resources.build_spark_session`` builds."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipelines import class_archive

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def archive_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PIPELINES_CLASS_ARCHIVE_DIR", str(tmp_path))
    monkeypatch.delenv("PIPELINES_CLASS_ARCHIVE", raising=False)
    return tmp_path


def _place(path: Path, data: bytes, recorded: int) -> None:
    path.write_bytes(data)
    path.with_name(path.name + ".bytes").write_text(str(recorded))


def test_an_archive_is_used_only_at_the_size_it_was_built_with(archive_dir):
    """A JVM crashes (SIGBUS) on an archive cut short: one whose size is not the recorded one
    is not handed to it, nor one without a record (a build that did not finish)."""
    path = class_archive.archive_path()
    assert path.parent == archive_dir and path.name.endswith(".jsa")
    assert class_archive.java_options() == ""
    path.write_bytes(b"x" * 100)
    assert class_archive.java_options() == ""  # no record of its size
    _place(path, b"x" * 100, 100)
    assert class_archive.java_options().split()[0] == f"-XX:SharedArchiveFile={path}"
    assert "-Xshare:auto" in class_archive.java_options().split()
    _place(path, b"x" * 60, 100)
    assert class_archive.java_options() == ""
    path.with_name(path.name + ".bytes").write_text("not a number")
    assert class_archive.java_options() == ""


def test_archives_can_be_turned_off(archive_dir, monkeypatch):
    path = class_archive.archive_path()
    _place(path, b"x" * 10, 10)
    monkeypatch.setenv("PIPELINES_CLASS_ARCHIVE", "off")
    assert class_archive.archive_path() is None
    assert class_archive.java_options() == ""
    assert class_archive.build_class_archive() is None


def test_the_archive_name_follows_the_java_and_the_environment(archive_dir, monkeypatch, tmp_path):
    """Another Java (here: one reached through ``JAVA_HOME``, a copy of this one's binary
    with its own size) gets another archive: a JVM upgrade starts a new one."""
    before = class_archive.archive_path()
    java = Path(os.path.realpath(class_archive._java()))
    home = tmp_path / "jdk"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "java").write_bytes(java.read_bytes() + b"\0")
    monkeypatch.setenv("JAVA_HOME", str(home))
    assert class_archive.archive_path() not in (None, before)


@pytest.mark.spark
@pytest.mark.timeout(600)
def test_a_failed_build_leaves_no_archive_and_names_the_output(archive_dir, monkeypatch):
    """A training that fails (here: its JVM cannot start, an unknown option) raises, saying
    so, and leaves neither an archive nor a partial file a session could map."""
    monkeypatch.setenv("JDK_JAVA_OPTIONS", "-XX:+NoSuchOptionAnywhere")
    with pytest.raises(RuntimeError, match="class archive .* failed"):
        class_archive.build_class_archive(timeout=300)
    assert list(archive_dir.iterdir()) == []
    assert class_archive.java_options() == ""


_SESSION = textwrap.dedent("""
    from resources.spark import build_spark_session
    spark = build_spark_session("local[1]", "class-archive-test", {"spark.ui.enabled": "false"})
    assert spark.range(10).selectExpr("sum(id)").collect()[0][0] == 45
    pid = spark._jvm.ProcessHandle.current().pid()
    with open(f"/proc/{pid}/maps") as maps:
        print("MAPPED" if any("spark-driver-" in line for line in maps) else "NOT MAPPED")
""")


def _session(env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _SESSION], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.spark
@pytest.mark.timeout(900)
def test_a_session_maps_the_archive_and_ignores_one_that_does_not_match(archive_dir):
    """The archive built here is mapped by the next session's JVM; an archive that is whole
    (its recorded size) but not this JVM's (here: another file's bytes) is ignored without a
    word: the session starts and answers as without one."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PIPELINES_CLASS_ARCHIVE_DIR=str(archive_dir))
    path = class_archive.build_class_archive(timeout=600)
    assert path is not None and class_archive.java_options()
    done = _session(env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "MAPPED"

    data = path.read_bytes()
    os.chmod(path, 0o644)
    _place(path, data[:4] + bytes(len(data) - 4), len(data))  # the magic, then zeros
    done = _session(env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "NOT MAPPED"
    assert "cds" not in done.stderr.lower()
