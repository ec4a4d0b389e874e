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


# Every other block that claims to run is marked: a line `<!-- runs -->` right before its
# ```python fence (invisible on GitHub). Marked blocks run standalone in an empty directory.
RUNS_MARKER = "<!-- runs -->"
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)


def python_blocks(path: Path) -> list[tuple[int, bool, str]]:
    """(line, marked to run, code) of each Python block of a Markdown file."""
    text = path.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        if match.group(1) == "python":
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            line = text.count("\n", 0, match.start()) + 1
            blocks.append((line, before.strip() == RUNS_MARKER, match.group(2)))
    return blocks


def marked_blocks() -> list:
    return [pytest.param(code, id=f"{path.relative_to(ROOT)}:{line}")
            for path in DOC_FILES for line, marked, code in python_blocks(path) if marked]


def test_docs_mark_blocks_to_run():
    """The docs hold runnable blocks besides the README's pipeline, and every marker sits right
    before a Python block (a marker elsewhere would leave its block silently untested)."""
    markers = sum(line.strip() == RUNS_MARKER
                  for path in DOC_FILES for line in path.read_text().splitlines())
    assert 2 <= len(marked_blocks()) == markers


@pytest.mark.timeout(120)
@pytest.mark.parametrize("code", marked_blocks())
def test_marked_block_runs(code, tmp_path):
    """A block marked to run runs as pasted, alone, in an empty directory."""
    (tmp_path / "block.py").write_text(code)
    env = os.environ | {"PYTHONPATH": str(ROOT)}

    result = subprocess.run([sys.executable, "-W", "ignore", "block.py"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=100)

    assert 0 == result.returncode, result.stderr[-3000:]


def test_every_python_block_parses():
    """Blocks that do not run (placeholders, `...`) are still valid Python."""
    errors = []
    for path in DOC_FILES:
        for line, _, code in python_blocks(path):
            try:
                compile(code, f"{path.name}:{line}", "exec")
            except SyntaxError as error:
                errors.append(f"{path.relative_to(ROOT)}:{line}: {error}")
    assert [] == errors


def github_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings."""
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", path.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower().replace("`", "")).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def relative_links(path: Path) -> list[str]:
    """Link targets of a Markdown file that are not URLs, outside code blocks and spans."""
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", path.read_text()))
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", text)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def test_links_between_docs_resolve():
    """Every relative link of the README and docs/*.md names a file that exists, and a heading
    of it when the link has an anchor."""
    broken = []
    for path in DOC_FILES:
        for target in relative_links(path):
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in github_anchors(linked):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert [] == broken


def test_readme_is_short_and_leads_to_the_docs():
    """The README stays a page a newcomer reads (about 200 lines) and links each doc."""
    readme = (ROOT / "README.md").read_text()
    links = set(relative_links(ROOT / "README.md"))

    assert len(readme.splitlines()) <= 200
    assert "## Changelog" in readme
    missing = [doc for doc in ("pipelines", "operations", "cli", "storage", "benchmarks",
                               "design") if f"docs/{doc}.md" not in links]
    assert [] == missing


def test_every_benchmark_is_documented():
    """docs/benchmarks.md has a section per script in benchmarks/."""
    anchors = github_anchors(ROOT / "docs" / "benchmarks.md")
    scripts = [p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_")]

    assert [] == [script for script in sorted(scripts) if script not in anchors]
