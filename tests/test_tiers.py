"""The test tiers (tests/conftest.py, scripts/test): tests are marked ``spark``, ``s3``,
``dagster`` and ``slow`` from what they use, and the fast tier refuses to start a JVM or a
moto server, naming the missing marker."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Each test starts pytest (importing dagster and pyspark to collect): the full suite's.
pytestmark = pytest.mark.slow

# Collects the given files and prints each test's tier markers as JSON.
_COLLECT = """
import json, sys
import pytest

class Marks:
    def pytest_collection_finish(self, session):
        tiers = {"spark", "s3", "dagster", "slow"}
        found = {i.nodeid: sorted({m.name for m in i.iter_markers()} & tiers)
                 for i in session.items}
        print("MARKS " + json.dumps(found))

sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]],
                     plugins=[Marks()]))
"""


def _marks(*files: str) -> dict[str, list[str]]:
    result = subprocess.run(
        [sys.executable, "-c", _COLLECT, *files], cwd=ROOT, capture_output=True, text=True,
        timeout=240, env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    assert 0 == result.returncode, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("MARKS "))
    return json.loads(line[len("MARKS "):])


@pytest.mark.timeout(300)
def test_tests_are_marked_by_the_fixtures_modules_and_directories_they_use():
    """The spark fixture gives ``spark``; a backend parameter "s3" gives ``s3`` to that case
    only; a module that imports dagster gives ``dagster``; tests/acceptance gives ``dagster``,
    ``spark`` and ``slow``; a test that uses none of them has no tier marker."""
    marks = _marks(
        "tests/pipelines/test_keyed_runner.py",
        "tests/checkpoint_storage/test_lease.py",
        "tests/sensors/test_retention_sensor.py",
        "tests/acceptance/test_ui_chromium.py",
        "tests/test_imports.py",
    )

    def of(prefix: str) -> set[tuple[str, ...]]:
        return {tuple(m) for node, m in marks.items() if node.startswith(prefix)}

    runner = "tests/pipelines/test_keyed_runner.py::test_partitions_equal_a_recomputation"
    assert ["spark"] == marks[runner + "_and_the_state_sink_writes_it"]
    lease = "tests/checkpoint_storage/test_lease.py::test_waiting_acquires_once_the_holder_releases"
    assert ([], [], ["s3"]) == (marks[lease + "[memory]"], marks[lease + "[local]"],
                                marks[lease + "[s3]"])
    assert {"dagster"} <= {t for m in of("tests/sensors/test_retention_sensor.py") for t in m}
    assert {("dagster", "s3", "slow", "spark")} == of("tests/acceptance/test_ui_chromium.py")
    assert {()} == of("tests/test_imports.py")


_UNMARKED = """
def test_starts_spark():
    from resources import build_spark_session

    build_spark_session("local[1]", "unmarked", {"spark.ui.enabled": "false"}).stop()


def test_starts_moto():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    server.stop()
"""


@pytest.mark.timeout(300)
def test_the_fast_tier_fails_an_unmarked_test_that_starts_a_jvm_or_a_moto_server(tmp_path):
    """Under CHECKPOINT_TESTS_FAST=1 (what ``scripts/test --fast`` sets) an unmarked test that
    starts Spark or moto fails, and the failure says which marker it lacks."""
    (tmp_path / "test_unmarked.py").write_text(_UNMARKED)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"), "-q",
         str(tmp_path / "test_unmarked.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env=os.environ | {"PYTHONPATH": str(ROOT), "CHECKPOINT_TESTS_FAST": "1"},
    )
    output = result.stdout + result.stderr

    assert "2 failed" in output, output[-4000:]
    assert "this test starts a JVM (Spark) but is not marked 'spark'" in output
    assert "this test starts moto's S3 server but is not marked 's3'" in output


@pytest.mark.timeout(300)
def test_scripts_test_fast_leaves_out_the_marked_tiers_and_passes_arguments_on():
    """``scripts/test --fast ARGS`` runs pytest with ARGS on the tests marked with no tier."""
    result = subprocess.run(
        [str(ROOT / "scripts" / "test"), "--fast", "--collect-only", "-q",
         "tests/pipelines/test_keyed_runner.py", "tests/test_imports.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )
    collected = [x for x in result.stdout.splitlines() if "::" in x]

    assert 0 == result.returncode, result.stdout[-3000:] + result.stderr[-3000:]
    assert collected and all(x.startswith("tests/test_imports.py::") for x in collected)
