"""Static partitions given as a list of keys (``StatefulPipeline(partitions=[...])``): ordered
as declared without Dagster, checked, and a ``dg.StaticPartitionsDefinition`` for the Dagster
side (issue 28: a restart of a pipeline with static keys imports no Dagster, 0.5 s of a
driver's CPU while its JVM starts)."""

import json
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from pipelines import FileSource, StatefulPipeline
from pipelines.examples.click_events import KEYED_STAGES
from pipelines.examples.click_events.stages import EVENT_SCHEMA
from sensors import build_stateful_assets

ROOT = Path(__file__).resolve().parents[2]


def _pipeline(partitions) -> StatefulPipeline:
    return StatefulPipeline(name="static_keys", stages=KEYED_STAGES,
                            source=FileSource(url="/tmp/landing/{partition}",
                                              schema=EVENT_SCHEMA),
                            partitions=partitions)


def test_keys_are_ordered_as_declared_and_are_dagsters_static_partitions():
    pipeline = _pipeline(["b", "a", "c"])
    order = pipeline.order
    assert order.first == "b"
    assert (order.previous("b"), order.previous("a"), order.following("a"),
            order.following("c")) == (None, "b", "c", None)
    assert order.check_consecutive(["b", "a"]) == ["b", "a"]
    with pytest.raises(ValueError, match="not a partition"):
        order.check("d")
    definition = pipeline.partitions_def
    assert isinstance(definition, dg.StaticPartitionsDefinition)
    assert definition.get_partition_keys() == ["b", "a", "c"]
    # the same pipeline given Dagster's definition orders alike
    same = _pipeline(dg.StaticPartitionsDefinition(["b", "a", "c"]))
    assert [same.order.following(k) for k in "bac"] == [order.following(k) for k in "bac"]
    assert same.partitions_def is same.partitions


def test_the_assets_of_keys_are_partitioned_by_them():
    asset = build_stateful_assets(_pipeline(["x", "y"]))
    assert asset.partitions_def.get_partition_keys() == ["x", "y"]


@pytest.mark.parametrize("keys", [[], ["a", "a"], ["a", ""], ["a", 1]])
def test_bad_keys_are_refused(keys):
    with pytest.raises(ValueError, match="partitions given as keys"):
        _pipeline(keys)


def test_a_pipeline_of_keys_orders_its_partitions_without_importing_dagster():
    probe = ("import json, sys\n"
             "from pipelines import FileSource, StatefulPipeline\n"
             "from pipelines.examples.click_events import KEYED_STAGES\n"
             "from pipelines.examples.click_events.stages import EVENT_SCHEMA\n"
             "p = StatefulPipeline(name='k', stages=KEYED_STAGES, source=FileSource("
             "url='/tmp/{partition}', schema=EVENT_SCHEMA), partitions=['p0', 'p1'])\n"
             "print(json.dumps([p.order.previous('p1'), p.order.first,"
             " sorted(m for m in sys.modules if m.split('.')[0] == 'dagster')]))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["p0", "p0", []]
