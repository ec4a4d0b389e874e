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


def test_the_package_and_the_cli_load_the_flink_reader_only_when_asked():
    """Importing checkpoint_storage and its CLI (what ``checkpoints --help`` and ``list``
    start with) loads no module of the Flink reader; asking the package for one of its names
    does."""
    modules = _modules_after_import("checkpoint_storage.cli")
    asked = _modules_after_import("checkpoint_storage; checkpoint_storage.find_orphans")

    assert "checkpoint_storage.cli.flink" in modules
    flink_reader = ("checkpoint_storage.flink", "checkpoint_storage._flink")
    reader = [m for m in modules if m.startswith(flink_reader)]
    assert [] == reader
    assert {"checkpoint_storage.flink", "checkpoint_storage._flink_orphans"} <= set(asked)


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


PACKAGES = ("checkpoint_storage", *LAYERS)


def _surface_violations(path: Path, own: str) -> list[str]:
    """Imports in ``path`` (of package ``own``) of another project package that bypass its
    declared surface: a private module, or a name outside the ``__all__`` of the public module
    it comes from (``checkpoint_storage``, ``checkpoint_storage.spi``, ``pipelines.runner``...).
    A public submodule imported by name (``from pipelines import state_io``) is its own
    surface."""
    import ast
    import importlib

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            imported = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported = [(node.module, alias.name) for alias in node.names]
        else:
            continue
        for module, name in imported:
            package = module.split(".")[0]
            if package not in PACKAGES or package == own:
                continue
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            where = f"{shown}:{node.lineno}"
            if any(part.startswith("_") for part in module.split(".")):
                found.append(f"{where}: {module} is private")
                continue
            if name is None:
                continue
            exported = importlib.import_module(module)
            submodule = getattr(exported, name, None)
            if getattr(submodule, "__name__", None) == f"{module}.{name}" and not name.startswith(
                    "_"):
                continue
            if name not in getattr(exported, "__all__", ()):
                found.append(f"{where}: {name} is not in {module}.__all__")
    return found


def test_packages_import_each_other_through_their_declared_surfaces():
    """checkpoint_storage, pipelines, resources and sensors import each other only through
    names in a public module's ``__all__``: a package's own (what its users need),
    ``checkpoint_storage.spi`` (the storage layer's extension points) or a documented module
    below a package (``checkpoint_storage.exceptions``, ``pipelines.runner``, ...). A name that
    is importable for old code but outside every ``__all__`` is not for the project's layers."""
    offending = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            offending += _surface_violations(path, package)

    assert [] == offending


def test_the_surface_check_sees_names_outside_all(tmp_path):
    """The check above flags a name a package keeps importable outside ``__all__``, and a
    private module; it passes ``__all__`` names, spi names and public submodules."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from checkpoint_storage import OperatorState, FileSystemCheckpointStorage\n"
        "from checkpoint_storage.spi import OperatorState\n"
        "from pipelines import check_restore_from, state_io\n"
        "import checkpoint_storage._metadata\n"
    )

    found = _surface_violations(sample, "sensors")

    assert ["sample.py:1: OperatorState is not in checkpoint_storage.__all__",
            "sample.py:3: check_restore_from is not in pipelines.__all__",
            "sample.py:4: checkpoint_storage._metadata is private"] == found
