"""The YAML component: a ``defs.yaml`` naming stages, source and sinks by import path gives
the same definitions as ``pipeline_definitions`` in Python, and ``dg`` scaffolds one."""

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster.components import build_defs_for_component
from dagster.components.testing import create_defs_folder_sandbox

from pipelines import FullSnapshotPolicy
from pipelines.definitions import default_resources
from pipelines.examples.page_views import page_views_definitions
from sensors import ImportReference, PartitionsSpec, StatefulPipelineComponent, pool_for

ROOT = Path(__file__).resolve().parents[2]
BASE = "memory://component-test"
PAGE_VIEWS_YAML = {
    "type": "sensors.StatefulPipelineComponent",
    "attributes": {
        "name": "page_views",
        "partitions": {"hourly": {"start_date": "2026-10-01-00:00", "timezone": "UTC"}},
        "stages": [{"import": "pipelines.examples.page_views.STAGES"}],
        "source": {
            "import": "pipelines.FileSource",
            "params": {
                "url": "{{ env('PAGE_VIEWS_TEST_DIR') }}/landing/hour={partition}",
                "schema": "page_id string, user_id string, viewed_at timestamp",
            },
        },
        "sinks": [
            {"import": "pipelines.ParquetSink", "params": {
                "name": "sessions", "stage": "sessions",
                "url": "{{ env('PAGE_VIEWS_TEST_DIR') }}/sessions", "partition_column": "hour"}},
            {"import": "pipelines.ParquetSink", "params": {
                "name": "page_counts", "stage": "page_counts", "of": "state",
                "url": "{{ env('PAGE_VIEWS_TEST_DIR') }}/page_counts",
                "partition_column": "hour"}},
        ],  # fmt: skip
        "checkpoint_interval": 2,
        "max_retained_checkpoints": 3,
        "description": "Open page-view sessions per user (expiring after 30 minutes without a "
        "view) and the running view count per page.",
    },
}


def shape(defs: dg.Definitions) -> dict:
    """What a user sees of definitions: names, keys, partitions, pools, dependencies."""
    defs = dg.Definitions.merge(defs, dg.Definitions(resources=default_resources()))
    graph = defs.resolve_asset_graph()
    keys = sorted(k.to_user_string() for k in graph.get_all_asset_keys())
    jobs = {j.name: sorted(defs.resolve_job_def(j.name).graph.pools) for j in defs.jobs}
    return {
        "assets": keys,
        "deps": {k: sorted(p.to_user_string() for p in graph.get(dg.AssetKey(k)).parent_keys)
                 for k in keys},
        "partitions": {k: type(graph.get(dg.AssetKey(k)).partitions_def).__name__ for k in keys},
        "checks": sorted(c.to_user_string() for c in graph.asset_check_keys),
        "jobs": jobs,
        "schedules": sorted((s.name, s.cron_schedule) for s in defs.schedules),
        "sensors": sorted(s.name for s in defs.sensors),
        "descriptions": {k: graph.get(dg.AssetKey(k)).description for k in keys},
    }


def test_yaml_gives_the_same_definitions_as_python(monkeypatch):
    """page_views from defs.yaml equals page_views_definitions(...) in every name, key,
    dependency, partitioning, pool, schedule and sensor."""
    monkeypatch.setenv("PAGE_VIEWS_TEST_DIR", BASE)
    with create_defs_folder_sandbox() as sandbox:
        path = sandbox.scaffold_component(
            component_cls=StatefulPipelineComponent, defs_path="page_views",
            defs_yaml_contents=PAGE_VIEWS_YAML,
        )
        with sandbox.load_component_and_build_defs(defs_path=path) as (component, from_yaml):
            assert BASE + "/landing/hour={partition}" == component.pipeline().source.url
            expected = shape(page_views_definitions(BASE))
            assert expected == shape(from_yaml)
            pool = pool_for(component.pipeline())
            assert [pool] == expected["jobs"]["page_views_savepoint_job"]


def test_component_in_python_builds_the_same_as_yaml():
    """The component constructed in Python (no YAML) builds the same definitions."""
    attributes = PAGE_VIEWS_YAML["attributes"] | {
        "source": {"import": "pipelines.FileSource", "params": {
            "url": BASE + "/landing/hour={partition}",
            "schema": "page_id string, user_id string, viewed_at timestamp"}},
        "sinks": [],
    }  # fmt: skip
    component = StatefulPipelineComponent.model_validate(attributes)

    defs = build_defs_for_component(component)

    assert ["page_views"] == shape(defs)["assets"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({}, "exactly one of"),
        ({"daily": {"start_date": "2026-01-01"}, "static": ["a"]}, "exactly one of"),
    ],
)
def test_partitions_need_exactly_one_kind(spec, message):
    """partitions names one kind of partitioning, or the error says so."""
    with pytest.raises(ValueError, match=message):
        PartitionsSpec.model_validate(spec).resolve()


def test_static_partitions_keep_their_declared_order():
    """static partitions come out in the declared order, not sorted."""
    partitions = PartitionsSpec.model_validate({"static": ["c", "a", "b"]}).resolve()

    assert ["c", "a", "b"] == partitions.get_partition_keys()


@pytest.mark.parametrize(
    ("path", "message"),
    [("nowhere.module.thing", "cannot import"), ("pipelines.NoSuchName", "cannot import"),
     ("justaname", "package.module.attribute")],
)
def test_bad_import_paths_say_what_is_wrong(path, message):
    """An import path that cannot be imported fails with the path and the reason."""
    with pytest.raises(ValueError, match=message):
        ImportReference.model_validate({"import": path}).resolve()


def test_keyed_stages_and_their_settings_come_from_yaml():
    """Keyed stages by import path, with max_parallelism, keyed_parallelism and the
    full snapshot policy, give the pipeline those settings."""
    attributes = PAGE_VIEWS_YAML["attributes"] | {
        "stages": [{"import": "pipelines.examples.click_events.KEYED_STAGES"}],
        "source": {"import": "pipelines.FileSource", "params": {
            "url": BASE + "/{partition}", "schema": "a string"}},
        "sinks": [],
        "max_parallelism": 64,
        "keyed_parallelism": 4,
        "full_snapshot": {"every": 5, "ratio": 0.5, "small_every": 8},
    }  # fmt: skip

    pipeline = StatefulPipelineComponent.model_validate(attributes).pipeline()

    assert (["dedupe", "user_activity"], 64, 4, FullSnapshotPolicy(5, 0.5, small_every=8)) == (
        [s.name for s in pipeline.keyed_stages], pipeline.max_parallelism,
        pipeline.keyed_parallelism, pipeline.full_snapshot)


def test_a_stage_reference_that_is_not_a_stage_is_refused(monkeypatch):
    """stages must resolve to pipelines.Stage or KeyedStage objects."""
    attributes = PAGE_VIEWS_YAML["attributes"] | {
        "stages": [{"import": "pipelines.examples.page_views.SESSION_GAP"}],
        "source": {"import": "pipelines.FileSource", "params": {
            "url": BASE + "/{partition}", "schema": "a string"}},
        "sinks": [],
    }  # fmt: skip

    with pytest.raises(TypeError, match="not a pipelines.Stage"):
        StatefulPipelineComponent.model_validate(attributes).pipeline()


@pytest.mark.timeout(300)
def test_dg_scaffolds_a_pipeline_that_loads(tmp_path):
    """`dg scaffold defs sensors.StatefulPipelineComponent <name>` in a copy of the project
    writes a defs.yaml that loads into the code location with the pipeline's definitions."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "workspace.yaml"):
        (project / name).write_text((ROOT / name).read_text())
    for package in ("checkpoint_storage", "resources", "pipelines", "sensors"):
        subprocess.run(["cp", "-r", str(ROOT / package), str(project / package)], check=True)
    env = os.environ | {"PYTHONPATH": str(project), "DAGSTER_HOME": str(tmp_path / "home"),
                        "PIPELINE_DATA_DIR": str(tmp_path / "data")}
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    dg_cli = str(Path(sys.executable).parent / "dg")

    subprocess.run([dg_cli, "scaffold", "defs", "sensors.StatefulPipelineComponent", "orders"],
                   cwd=project, env=env, check=True, capture_output=True, timeout=240)

    written = yaml.safe_load((project / "pipelines/defs/orders/defs.yaml").read_text())
    assert ("sensors.StatefulPipelineComponent", "orders") == (
        written["type"], written["attributes"]["name"]
    )
    listing = subprocess.run(
        [sys.executable, "-c", "from pipelines.definitions import defs; "
         "print(sorted(j.name for j in defs.jobs))"],
        cwd=project, env=env, check=True, capture_output=True, text=True, timeout=240,
    )
    assert "'orders_job'" in listing.stdout and "'orders_savepoint_job'" in listing.stdout
