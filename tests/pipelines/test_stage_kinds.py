"""One interface for both stage kinds: the runner calls ``StageKind`` and never asks which kind
of stage it runs. No Spark job: the kinds are built, not run (the runner tests run them)."""

import ast
import inspect
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pytest
from pyspark.sql import types as T

from checkpoint_storage import FileSystemCheckpointStorage
from pipelines import FileSource, KeyedResult, KeyedStage, Stage, StatefulPipeline
from pipelines._stage_kinds import (
    DataFrameStageKind,
    KeyedStageKind,
    StageKind,
    stage_kinds,
)

ROOT = Path(__file__).resolve().parents[2]
KV = T.StructType([T.StructField("k", T.StringType())])
COUNTS = pa.schema([("k", pa.string()), ("n", pa.int64())])


def passthrough(input, state):
    return state, input


def count(input: pa.Table, state: pa.Table) -> KeyedResult:
    return KeyedResult(COUNTS.empty_table(), pa.table({"k": pa.array([], pa.string())}),
                       COUNTS.empty_table())


def pipeline(*stages) -> StatefulPipeline:
    return StatefulPipeline(
        name="kinds", stages=stages, source=FileSource(url="/landing/{partition}",
                                                       schema="k string"),
        partitions=dg.StaticPartitionsDefinition(["p1"]))


def test_each_stage_gets_its_kind_and_keyed_stages_share_one_driver(tmp_path):
    """``stage_kinds`` is the one place that tells the kinds apart: a DataFrame stage runs as
    a DataFrameStageKind, a keyed stage as a KeyedStageKind; the keyed stages share one
    driver, and a pipeline without one makes none."""
    storage = FileSystemCheckpointStorage(str(tmp_path / "chk"))
    spec = pipeline(Stage("raw", KV, passthrough),
                    KeyedStage("a", "k", COUNTS, count, input="source"),
                    KeyedStage("b", "k", COUNTS, count, input="source"))

    kinds = stage_kinds(None, storage, spec, "0" * 32)

    assert [(name, type(kind), kind.stage) for name, kind in kinds.items()] == [
        ("raw", DataFrameStageKind, spec.stages[0]),
        ("a", KeyedStageKind, spec.stages[1]),
        ("b", KeyedStageKind, spec.stages[2])]
    assert kinds["a"].driver is kinds["b"].driver
    assert (kinds["raw"].counts_its_input, kinds["raw"].writes_between_checkpoints,
            kinds["a"].counts_its_input, kinds["a"].writes_between_checkpoints) == (
        False, False, True, True)


def test_a_stage_kind_must_implement_the_runners_interface():
    """A kind that leaves out a method the runner calls cannot be made: the ABC says which
    (restore, apply a batch, snapshot, read whole, the state before the first batch, the state
    from rows)."""

    class Partial(StageKind):
        def empty(self):
            return None

    with pytest.raises(TypeError, match="abstract"):
        Partial()
    assert {"apply", "bootstrap", "empty", "frame", "restore", "snapshot"} == (
        StageKind.__abstractmethods__)
    for kind in (DataFrameStageKind, KeyedStageKind):
        assert not inspect.isabstract(kind)


def test_the_runner_never_asks_which_kind_of_stage_it_runs():
    """No ``isinstance`` on a stage or its state in the runner (its module and the modules of
    its restore and checkpoint writing): it calls the kind."""
    modules = ("runner.py", "_restore.py", "_checkpointing.py")
    kinds = {"Stage", "KeyedStage", "KeyedStageState", "DataFrame", "StageKind"}
    asked = [
        (module, node.lineno, ast.unparse(node))
        for module in modules
        for node in ast.walk(ast.parse((ROOT / "pipelines" / module).read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
        and kinds & {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
    ]
    assert asked == []
