"""``sensors.StatefulPipelineComponent`` from a user's own Dagster project (issue 29), made the
way Dagster's docs make one, outside this repository and without PYTHONPATH:

1. ``create-dagster project my-pipelines`` (the project scaffold: its own ``pyproject.toml``,
   ``src/my_pipelines/definitions.py`` and ``defs/`` folder), in a temporary directory;
2. the project's ``.venv`` gets this package as a wheel built from a copy of its sources and
   the project itself with ``pip install -e`` (their dependencies, already installed for this
   repository, are reached through a path entry: nothing is downloaded but ``create-dagster``
   and the two build backends, and this repository's virtualenv is not modified);
3. ``dg scaffold defs sensors.StatefulPipelineComponent views``, the ``defs.yaml`` pointed at
   a stage in the project's own module ``my_pipelines.stages``, the resources in
   ``defs/resources.py``;
4. ``dg check defs``, then ``dg launch`` of one partition: the state holds what the user's
   stage computed.

Skips, with the reason, only when the package registry cannot be reached (create-dagster,
setuptools' wheel support and hatchling come from it).
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import dagster
import pytest
import yaml

from checkpoint_storage import FileSystemCheckpointStorage
from pipelines import job_id_for, read_state
from pipelines.examples.page_views import land_hour

ROOT = Path(__file__).resolve().parents[2]
PARTITION = "2026-10-01-00:00"
SOURCES = ["pyproject.toml", "README.md", "checkpoint_storage", "pipelines", "resources",
           "sensors"]  # fmt: skip
STAGES_MODULE = '''
"""The user's own stage: a running count of views per page."""

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from pipelines import SOURCE, Stage

COUNTS = T.StructType(
    [T.StructField("page_id", T.StringType()), T.StructField("views", T.LongType())]
)


def count_views(views: DataFrame, state: DataFrame) -> tuple[DataFrame, DataFrame]:
    batch = views.groupBy("page_id").agg(F.count("*").alias("views"))
    total = state.unionByName(batch).groupBy("page_id").agg(
        F.sum("views").cast("long").alias("views")
    )
    return total, batch


STAGES = [Stage("view_counts", COUNTS, count_views, input=SOURCE)]
'''
RESOURCES_MODULE = '''
import dagster as dg

from resources import CheckpointStorageResource, SparkResource


@dg.definitions
def resources() -> dg.Definitions:
    return dg.Definitions(
        resources={
            "spark": SparkResource(master="local[1]"),
            "checkpoint_storage": CheckpointStorageResource(
                checkpoint_dir=dg.EnvVar("CHECKPOINT_DIR"),
                savepoint_dir=dg.EnvVar("SAVEPOINT_DIR"),
            ),
        }
    )
'''


def run(command: list, cwd: Path, env: dict, timeout: float = 600) -> str:
    done = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert 0 == done.returncode, f"{command} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def virtualenv(path: Path) -> Path:
    """A virtualenv whose packages are its own, then (a plain path entry, no .pth files of
    it, so not this repository's editable install) those of this repository's virtualenv."""
    base = Path(sys.base_prefix) / "bin" / "python3"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(path)], check=True)
    (site,) = path.glob("lib/python*/site-packages")
    (site / "zz_dependencies.pth").write_text(str(Path(dagster.__file__).parents[1]) + "\n")
    return path / "bin" / "python"


def pip(python: Path, *arguments, env: dict) -> str:
    # This repository's pip, installing into ``python``'s environment.
    return run([sys.executable, "-m", "pip", "--python", python, "install", *arguments],
               Path.cwd(), env)  # fmt: skip


@pytest.mark.timeout(900)
def test_component_in_a_users_own_dagster_project(tmp_path):
    assert not tmp_path.is_relative_to(ROOT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")
           and not k.startswith("DAGSTER_")}  # fmt: skip
    env["DAGSTER_HOME"] = str(tmp_path / "dagster_home")
    (tmp_path / "dagster_home").mkdir()
    (tmp_path / "dagster_home" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")

    # 1. The project, with Dagster's own scaffold.
    tools = virtualenv(tmp_path / "tools")
    try:
        pip(tools, "--no-deps", f"create-dagster=={dagster.__version__}", env=env)
    except AssertionError as exc:
        pytest.skip(f"create-dagster could not be installed (no package registry?): {exc}")
    run([tools.parent / "create-dagster", "project", "--no-uv-sync", "my-pipelines"],
        tmp_path, env)  # fmt: skip
    project = tmp_path / "my-pipelines"
    package = project / "src" / "my_pipelines"
    assert (package / "definitions.py").is_file() and (package / "defs").is_dir()
    pyproject = project / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace(
        'dependencies = [', 'dependencies = [\n    "flink-style-checkpoints",', 1))  # fmt: skip

    # 2. Its virtualenv: this package (a wheel of a copy of its sources) and the project.
    python = virtualenv(project / ".venv")
    sources = tmp_path / "flink-style-checkpoints"
    sources.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, sources / name, **({"ignore": shutil.ignore_patterns(
            "__pycache__")} if (ROOT / name).is_dir() else {}))  # fmt: skip
    try:  # its build backend (setuptools with bdist_wheel) from the registry
        run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", tmp_path / "dist",
             sources], tmp_path, env)  # fmt: skip
    except AssertionError as exc:
        pytest.skip(f"this package's build backend could not be installed: {exc}")
    (wheel,) = (tmp_path / "dist").glob("flink_style_checkpoints-*.whl")
    pip(python, "--no-deps", wheel, env=env)
    try:
        pip(python, "--no-deps", "-e", project, env=env)
    except AssertionError as exc:
        pytest.skip(f"the project's build backend could not be installed: {exc}")
    env |= {"VIRTUAL_ENV": str(project / ".venv"),
            "PATH": f"{project / '.venv' / 'bin'}{os.pathsep}{env['PATH']}"}  # fmt: skip
    where = run([python, "-c", "import json, sensors, pipelines, my_pipelines; print(json.dumps("
                 "[sensors.__file__, pipelines.__file__, my_pipelines.__file__]))"], project,
                env)  # fmt: skip
    files = json.loads(where.strip().splitlines()[-1])
    assert all(not Path(f).resolve().is_relative_to(ROOT) for f in files), files
    assert all(Path(f).resolve().is_relative_to(tmp_path) for f in files), files

    # 3. The component, pointed at the project's own stage; resources in defs/.
    dg = [python, "-m", "dagster_dg_cli.cli"]
    run([*dg, "scaffold", "defs", "sensors.StatefulPipelineComponent", "views"], project, env)
    defs_yaml = package / "defs" / "views" / "defs.yaml"
    component = yaml.safe_load(defs_yaml.read_text())
    assert "sensors.StatefulPipelineComponent" == component["type"]
    attributes = component["attributes"]
    attributes["stages"] = [{"import": "my_pipelines.stages.STAGES"}]
    attributes["sinks"] = []
    defs_yaml.write_text(yaml.safe_dump(component, sort_keys=False))
    (package / "stages.py").write_text(textwrap.dedent(STAGES_MODULE).lstrip())
    (package / "defs" / "resources.py").write_text(textwrap.dedent(RESOURCES_MODULE).lstrip())

    data = tmp_path / "data"
    env |= {"PIPELINE_DATA_DIR": str(data), "CHECKPOINT_DIR": str(data / "checkpoints"),
            "SAVEPOINT_DIR": str(data / "savepoints")}  # fmt: skip
    land_hour(str(data / "views"), PARTITION, batches=2, views_per_batch=50,
              users=5, pages=4, seed=3)  # fmt: skip

    # 4. Checked, then one partition launched: the state holds the user's stage's counts.
    run([*dg, "check", "defs"], project, env)
    run([*dg, "launch", "--assets", "views", "--partition", PARTITION], project, env)
    storage = FileSystemCheckpointStorage(str(data / "checkpoints"))
    latest = storage.create_checkpoint_storage(job_id_for("views")).latest_completed_checkpoint()
    assert latest is not None, f"no completed checkpoint in {data / 'checkpoints'}"
    state = read_state(latest.external_pointer, "view_counts").to_pylist()
    assert 100 == sum(row["views"] for row in state), state
    assert {row["page_id"] for row in state} <= {f"page-{i:03d}" for i in range(4)}
