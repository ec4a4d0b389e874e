"""The library stays free of the orchestration and compute layers (docs/design.md §2)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_PROBE = """
import json, sys
import {module}
print(json.dumps(sorted(sys.modules)))
"""


def _modules_after_import(module: str = "checkpoint_storage") -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE.format(module=module)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_checkpoint_storage_imports_neither_dagster_nor_pyspark():
    """A fresh interpreter importing checkpoint_storage loads no dagster or pyspark module."""
    modules = _modules_after_import()

    assert "checkpoint_storage" in modules
    assert [] == [m for m in modules if m.split(".")[0].startswith(("dagster", "pyspark"))]


def test_executors_importing_pipelines_load_no_dagster():
    """What a Spark Python worker imports to run a keyed stage (the ``pipelines`` package)
    loads no dagster module: workers start without its second of imports."""
    modules = _modules_after_import("pipelines.keyed")

    assert "pipelines.keyed" in modules
    assert [] == [m for m in modules if m.split(".")[0].startswith("dagster")]


LAYERS = ("pipelines", "resources", "sensors")


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import statement in a Python file, ``from x import y``
    giving ``x`` and ``x.y``."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _private(module: str, package: str) -> bool:
    parts = module.split(".")
    return parts[0] == package and any(part.startswith("_") for part in parts[1:])


def test_orchestration_layers_use_only_public_apis():
    """pipelines/, resources/ and sensors/ import no private module of checkpoint_storage, of
    dagster, or of each other (a user's code can do what they do)."""
    offending = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            for line, module in _imports(path):
                packages = {"checkpoint_storage", "dagster", *LAYERS} - {layer}
                if any(_private(module, package) for package in packages):
                    offending.append(f"{path.relative_to(ROOT)}:{line}: {module}")

    assert [] == offending


def test_benchmarks_use_only_public_apis_and_import_no_tests():
    """benchmarks/ import no private module of the project's packages or of dagster, and
    nothing from tests/: a benchmark does what a user's code can."""
    offending = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        for line, module in _imports(path):
            packages = ("checkpoint_storage", "dagster", *LAYERS)
            if module.split(".")[0] == "tests" or any(_private(module, p) for p in packages):
                offending.append(f"{path.relative_to(ROOT)}:{line}: {module}")

    assert [] == offending


def _imports_a_test_module(module: str) -> bool:
    last = module.split(".")[-1]
    return last.startswith("test_") or last == "conftest"


def test_tests_import_no_test_module_or_conftest():
    """No file below tests/ or benchmarks/ imports a test module or a conftest: what tests
    share lives in a support module (tests/support.py, tests/<suite>/support.py) or a named
    helper (a driver, a scenario harness), so that a test file is free to change."""
    offending = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for folder in ("tests", "benchmarks")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, module in _imports(path)
        if _imports_a_test_module(module)
    ]

    assert [] == offending


def test_the_import_check_sees_test_module_imports(tmp_path):
    """The check above flags `from tests.x.test_y import z`, `import test_y` (a module found
    on sys.path) and a conftest, and leaves support modules and `from pytest import ...`."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from tests.pipelines.test_keyed_runner import SOURCE\n"
        "import test_keyed_faults\n"
        "from tests.sensors.conftest import write_snapshot\n"
        "from tests.pipelines.support import SOURCE\n"
        "from pytest import fixture\n"
    )
    flagged = sorted({m for _, m in _imports(sample) if _imports_a_test_module(m)})

    assert ["test_keyed_faults", "tests.pipelines.test_keyed_runner",
            "tests.sensors.conftest"] == flagged


def test_the_import_check_sees_private_imports(tmp_path):
    """The check above flags `from checkpoint_storage._x import y` and `dagster._core`."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from checkpoint_storage._filesystems import url_to_fs\n"
        "import dagster._core.storage.tags\n"
        "from checkpoint_storage import FileStateHandle\n"
    )
    flagged = [m for _, m in _imports(sample) if _private(m, "checkpoint_storage")
               or _private(m, "dagster")]

    assert ["checkpoint_storage._filesystems", "checkpoint_storage._filesystems.url_to_fs",
            "dagster._core.storage.tags"] == flagged
