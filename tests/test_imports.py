"""The library stays free of the orchestration and compute layers (DESIGN §2)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_PROBE = """
import json, sys
import checkpoint_storage
print(json.dumps(sorted(sys.modules)))
"""


def _modules_after_import() -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE],
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
