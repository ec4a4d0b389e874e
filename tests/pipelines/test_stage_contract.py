"""Stages that break their contract fail at once, naming what broke: a keyed stage that
changes keys it was not given or gets keys of another type, a DataFrame stage whose new state
is not its declared schema, and any stage that raises (in the driver or in a Spark Python
worker): one line naming pipeline, stage, partition and batch, with the original error's."""

import sys
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pytest
from pyspark import cloudpickle
from pyspark.sql import functions as F
from pyspark.sql import types as T

from checkpoint_storage import FileSystemCheckpointStorage
from pipelines import (
    KeyedResult,
    KeyedStage,
    Source,
    Stage,
    StageError,
    StatefulPipeline,
    StatefulRunner,
)
from pipelines.main import error_summary
from pipelines.runner import error_line
from sensors import build_stateful_assets
from tests.pipelines.support import resources_for

PARTITIONS = dg.StaticPartitionsDefinition(["p1"])
KV = pa.schema([pa.field("k", pa.string(), nullable=False), ("n", pa.int64())])
STATE = T.StructType([T.StructField("k", T.StringType(), False),
                      T.StructField("n", T.LongType(), True)])


@dataclass(frozen=True)
class Rows(Source):
    """Two batches of ``rows`` each, with the key column typed ``key_type``."""

    key_type: str = "string"

    def batches(self, spark, partition):
        return [f"{partition}-b0", f"{partition}-b1"]

    def read(self, spark, partition, batch):
        keys = ["a", "b"] if self.key_type == "string" else [1, 2]
        return spark.createDataFrame([(k, 1) for k in keys], f"k {self.key_type}, v long")


def totals(input: pa.Table, state: pa.Table) -> KeyedResult:
    rows = pa.table({"k": input.column("k"), "n": input.column("v")})
    return KeyedResult(rows, pa.table({"k": pa.array([], pa.string())}), rows)


def upserts_another_key(input: pa.Table, state: pa.Table) -> KeyedResult:
    rows = pa.table({"k": [*input.column("k").to_pylist(), "zz"],
                     "n": [1] * (input.num_rows + 1)})
    return KeyedResult(rows, pa.table({"k": pa.array([], pa.string())}), rows)


def deletes_another_key(input: pa.Table, state: pa.Table) -> KeyedResult:
    return KeyedResult(KV.empty_table(), pa.table({"k": ["zz"]}), KV.empty_table())


def raising_in_worker(input, state):
    """A DataFrame stage whose function fails on the executors, not when it is applied."""

    def fail(batches):
        for batch in batches:
            raise ValueError("bad row k=a")
            yield batch

    return state, input.mapInArrow(fail, input.schema)


cloudpickle.register_pickle_by_value(sys.modules[__name__])


def pipeline(stage, *, source=None, **options) -> StatefulPipeline:
    return StatefulPipeline(name="contract", stages=[stage], source=source or Rows(),
                            partitions=PARTITIONS, checkpoint_interval=1, max_parallelism=16,
                            **options)


def runner_of(spark, tmp_path: Path, spec: StatefulPipeline) -> StatefulRunner:
    storage = FileSystemCheckpointStorage(str(tmp_path / "checkpoints"),
                                          savepoint_dir=str(tmp_path / "savepoints"))
    return StatefulRunner(spark, storage, spec, keyed_local_dir=str(tmp_path / "local"))


def completed(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "checkpoints").glob("*/chk-*/_metadata"))


def failure(spark, tmp_path: Path, spec: StatefulPipeline) -> StageError:
    """The error of running ``spec``'s partition p1, which must leave no checkpoint."""
    with pytest.raises(StageError) as failed:
        runner_of(spark, tmp_path, spec).run(["p1"])
    assert [] == completed(tmp_path)
    return failed.value


BATCH_1 = "pipeline contract, stage {}, partition p1, batch 1 of 2 (id p1-b0): "


# --- keyed stages -------------------------------------------------------------------------

@pytest.mark.timeout(180)
@pytest.mark.parametrize(("apply", "what"), [(upserts_another_key, "upserts"),
                                             (deletes_another_key, "deletes")])
def test_a_key_not_in_the_input_fails_alike_at_every_parallelism(spark, tmp_path, apply,
                                                                  what):
    """A keyed stage that upserts or deletes a key its input does not have fails the batch at
    parallelism 1 (where it once overwrote state never read) and 2 (where it once failed on
    a change file naming neither stage nor key) with the same line, before any checkpoint."""
    stage = KeyedStage("totals", "k", KV, apply)
    errors = [failure(spark, tmp_path / str(p), pipeline(stage, keyed_parallelism=p))
              for p in (1, 2)]

    assert str(errors[0]) == str(errors[1])
    assert str(errors[0]).startswith(
        BATCH_1.format("totals") + f"ValueError: keyed stage totals: {what} change 1 key(s) "
        "that are not among the batch's input keys, e.g. {'k': 'zz'}")
    assert "\n" not in str(errors[0])


@pytest.mark.timeout(180)
def test_an_int64_input_key_into_a_string_key_is_refused_before_the_spark_job(spark,
                                                                              tmp_path):
    """int64 ids into a string key are refused on the driver, before the batch's Spark job
    runs, naming stage, column, both types and what to do; no checkpoint is written."""
    spec = pipeline(KeyedStage("totals", "k", KV, totals), source=Rows("long"),
                    keyed_parallelism=2)
    runner = runner_of(spark, tmp_path, spec)
    spark.sparkContext.setJobGroup("int_keys", "int keys")
    try:
        with pytest.raises(StageError) as failed:
            runner.run(["p1"])
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)

    assert [] == spark.sparkContext.statusTracker().getJobIdsForGroup("int_keys")
    assert str(failed.value).startswith(
        BATCH_1.format("totals") + "ValueError: keyed stage totals: the input's key column "
        "'k' has type int64, the state schema's key type is string")
    assert "Cast 'k' to string in the stage before" in str(failed.value)
    assert [] == completed(tmp_path)


# --- DataFrame stages ---------------------------------------------------------------------

def as_state(input):
    """The input as the declared state (``k`` made NOT NULL)."""
    return input.select(F.coalesce("k", F.lit("")).alias("k"), F.col("v").alias("n"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("new_state", "difference"), [
    (lambda i: as_state(i).withColumn("extra", F.lit(1)), "column(s) ['extra'] not in "
     "state_schema"),
    (lambda i: as_state(i).withColumn("n", F.col("n").cast("int")), "column 'n' is int, "
     "declared bigint"),
    (lambda i: i.select(F.col("k"), F.col("v").alias("n")), "column 'k' is nullable, "
     "declared NOT NULL"),
    (lambda i: as_state(i).select("n", "k"), "columns in the order ['n', 'k'], declared "
     "['k', 'n']"),
], ids=["extra column", "int for long", "nullable", "order"])
def test_a_state_unlike_the_declared_schema_never_reaches_a_checkpoint(spark, tmp_path,
                                                                       new_state, difference):
    """A DataFrame stage whose new state has an extra column, INT instead of LONG, a nullable
    column declared NOT NULL or another column order fails at that batch, naming the stage
    and the difference; no checkpoint completes (once, two did)."""
    stage = Stage("kv", STATE, lambda input, state: (new_state(input), input))

    error = failure(spark, tmp_path, pipeline(stage))

    assert str(error).startswith(
        BATCH_1.format("kv") + "ValueError: stage kv: the new state does not match the "
        f"stage's state_schema: {difference}. Return the declared columns")


@pytest.mark.timeout(180)
def test_the_declared_schema_passes(spark, tmp_path):
    """A new state of exactly the declared schema is checkpointed as before."""
    stage = Stage("kv", STATE, lambda input, state: (as_state(input), input))
    runner_of(spark, tmp_path, pipeline(stage)).run(["p1"])

    assert 2 == len(completed(tmp_path))  # after batch 1, and at the end of p1


@pytest.mark.timeout(180)
def test_a_stage_raising_in_a_spark_worker_is_one_line_without_java_traces(spark, tmp_path):
    """A stage function failing on the executors fails the run with a first line naming
    pipeline, stage, partition, batch and the worker's own exception line; the original
    error (the Python traceback) is its cause."""
    error = failure(spark, tmp_path, pipeline(Stage("boom", STATE, raising_in_worker)))

    assert BATCH_1.format("boom") + "ValueError: bad row k=a" == str(error)
    assert ("boom", "p1", 0, "p1-b0") == (error.stage, error.partition, error.batch_index,
                                          error.batch_id)
    assert "bad row" in str(error.__cause__)


@pytest.mark.timeout(180)
def test_a_stage_raising_in_the_driver_names_where(spark, tmp_path):
    """A stage function failing on the driver: the same line, with the driver's error."""

    def fail(input, state):
        raise ValueError("no column 'x'\nsecond line")

    error = failure(spark, tmp_path, pipeline(Stage("early", STATE, fail)))

    assert BATCH_1.format("early") + "ValueError: no column 'x'" == str(error)


def test_a_py4j_error_is_reduced_to_the_workers_exception_line():
    """A Py4J error's text (Java frames around the worker's traceback) gives the worker's own
    exception line; a Java error without one gives the Java exception's line."""
    worker = RuntimeError(
        "An error occurred while calling o97.collectToPython.\n: org.apache.spark."
        "SparkException: Job aborted due to stage failure: Task 0 in stage 3.0 failed 1 "
        "times: org.apache.spark.api.python.PythonException: Traceback (most recent call "
        "last):\n  File \"/x/stage.py\", line 9, in apply\n    raise ValueError('bad')\n"
        "ValueError: bad\n\n\tat org.apache.spark.api.python.BasePythonRunner.handle(X.scala:1)"
        "\n\tat java.base/java.lang.Thread.run(Thread.java:840)\n")
    java = RuntimeError("An error occurred while calling o5.x.\n: java.lang.OutOfMemoryError: "
                        "Java heap space\n\tat org.apache.spark.X.y(X.scala:1)\n")

    assert ("ValueError: bad", "java.lang.OutOfMemoryError: Java heap space") == (
        error_line(worker), error_line(java))


# --- Dagster ------------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_the_dagster_step_failure_carries_the_one_line(spark, tmp_path):
    """Run through Dagster, the step fails with the StageError: its message is the line, and
    the line scripts/run prints."""
    spec = pipeline(Stage("boom", STATE, raising_in_worker))
    with dg.instance_for_test() as instance:
        result = dg.materialize([build_stateful_assets(spec)], instance=instance,
                                resources=resources_for(tmp_path), partition_key="p1",
                                raise_on_error=False)
    (failed,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    error = failed.event_specific_data.error

    assert not result.success
    assert (f"pipelines.StageError: {BATCH_1.format('boom')}ValueError: bad row k=a"
            == error.cause.message.strip())
    # what scripts/run prints of it
    assert f"StageError: {BATCH_1.format('boom')}ValueError: bad row k=a" == error_summary(error)


def test_a_dataframe_stage_written_for_the_old_argument_order_is_refused():
    """``Stage.apply`` takes ``(input, state)``, as ``KeyedStage.apply`` does; a function
    whose first parameter is named as the state (the order before) is refused when the stage
    is declared, saying how to fix it, rather than be handed the batch as its state."""

    def totals(state, orders):
        return state, orders

    def moved(old_state, batch, horizon=None):
        return old_state, batch

    refused = []
    for function in (totals, moved):
        with pytest.raises(TypeError) as error:
            Stage("totals", STATE, function)
        refused.append(str(error.value))

    assert refused == [
        "stage totals: totals(state, orders, ...) takes the state first, but a stage's apply "
        "takes (input, state): input first, like a keyed stage's (the order changed; see the "
        "changelog). Swap its parameters: def totals(orders, state, ...)",
        "stage totals: moved(old_state, batch, ...) takes the state first, but a stage's apply "
        "takes (input, state): input first, like a keyed stage's (the order changed; see the "
        "changelog). Swap its parameters: def moved(batch, old_state, ...)",
    ]
    # Input first, names that tell nothing, and callables without a signature are taken.
    for function in (lambda orders, state: (state, orders), lambda s, i: (s, i),
                     lambda old_state, new_state: (new_state, old_state), max):
        assert Stage("totals", STATE, function).apply is function
