"""The README's "Your own pipeline" file runs as pasted, and the API reference builds from the
docstrings of the four packages."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_pipeline() -> str:
    """The Python block of the README's "Your own pipeline" section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Your own pipeline", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.spark  # the example runs Spark and Dagster in a subprocess
@pytest.mark.dagster
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_readme_pipeline_runs_as_pasted(tmp_path):
    """Saved as my_pipeline.py and run, the README's example lands two days, runs them
    through Dagster and prints the running totals of the second day."""
    (tmp_path / "my_pipeline.py").write_text(readme_pipeline())
    env = os.environ | {"PYTHONPATH": str(ROOT)}

    result = subprocess.run(
        [sys.executable, "-W", "ignore", "my_pipeline.py"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=540,
    )

    assert 0 == result.returncode, result.stderr[-3000:]
    totals = [line.split()[1:] for line in result.stdout.splitlines()[-2:]]
    assert [["docs", "2"], ["home", "2"]] == totals
    assert (tmp_path / "data" / "checkpoints").is_dir()


@pytest.mark.slow  # pdoc imports and renders the four packages
@pytest.mark.timeout(300)
def test_api_reference_documents_the_public_names(tmp_path):
    """scripts/api-docs writes one page per package, with the public names documented."""
    subprocess.run([str(ROOT / "scripts" / "api-docs"), str(tmp_path)], cwd=ROOT, check=True,
                   capture_output=True, timeout=280)

    pages = {p.name: p.read_text() for p in tmp_path.glob("*.html")}
    expected = {
        "pipelines.html": ["StatefulPipeline", "Stage", "FileSource", "ParquetSink",
                           "StatefulRunner"],
        "sensors.html": ["pipeline_definitions", "StatefulPipelineComponent"],
        "checkpoint_storage.html": ["FileSystemCheckpointStorage", "collect_garbage"],
        "resources.html": ["CheckpointStorageResource", "SparkResource"],
    }
    missing = {page: [n for n in names if f'id="{n}"' not in pages.get(page, "")]
               for page, names in expected.items()}
    assert {page: [] for page in expected} == missing
