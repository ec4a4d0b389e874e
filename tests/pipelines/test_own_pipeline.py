"""A pipeline of a user's own, written here from the public API alone (``pipelines``,
``sensors``, ``resources``): static partitions in a declared order, a generated source, a
DataFrame stage and a Parquet sink. Two partitions run through Dagster with a failure in
between; the recovery the sensor plans finishes the job, and state and sink output equal a
recomputation without failures."""

import random
from dataclasses import dataclass

import dagster as dg
import pandas as pd
import pytest
from pyspark.sql import functions as F
from pyspark.sql import types as T

from pipelines import ParquetSink, Source, Stage, StatefulPipeline, StatefulRunner
from resources import CheckpointStorageResource, SparkResource
from sensors import FAULT_INJECTION_ENV, FAULT_TAG, pipeline_definitions, plan_recovery

# Declared order, deliberately not sorted: the pipeline follows the declaration.
REGIONS = dg.StaticPartitionsDefinition(["emea", "amer", "apac"])
ORDER_SCHEMA = T.StructType(
    [
        T.StructField("customer", T.StringType()),
        T.StructField("amount", T.LongType()),
    ]
)
TOTALS_SCHEMA = T.StructType(
    [
        T.StructField("customer", T.StringType()),
        T.StructField("orders", T.LongType()),
        T.StructField("total", T.LongType()),
    ]
)


@dataclass(frozen=True)
class GeneratedOrders(Source):
    """Orders made up from the batch id: the same batch always has the same rows."""

    batches_per_region: int = 4
    rows_per_batch: int = 40

    def batches(self, spark, partition):
        return [f"{partition}-{i:03d}" for i in range(self.batches_per_region)]

    def read(self, spark, partition, batch):
        rng = random.Random(batch)
        rows = [
            (f"{partition}-c{rng.randrange(8)}", rng.randrange(1, 100))
            for _ in range(self.rows_per_batch)
        ]
        return spark.createDataFrame(rows, ORDER_SCHEMA)


def customer_totals(orders, state):
    batch = orders.groupBy("customer").agg(
        F.count(F.lit(1)).cast("long").alias("orders"), F.sum("amount").cast("long").alias("total")
    )
    merged = state.unionByName(batch).groupBy("customer").agg(
        F.sum("orders").cast("long").alias("orders"), F.sum("total").cast("long").alias("total")
    )
    return merged, batch


def orders_pipeline(sink_dir: str) -> StatefulPipeline:
    return StatefulPipeline(
        name="customer_totals",
        stages=[Stage("totals", TOTALS_SCHEMA, customer_totals)],
        source=GeneratedOrders(),
        partitions=REGIONS,
        sinks=[
            ParquetSink(name="batches", stage="totals", url=sink_dir, partition_column="region")
        ],
        checkpoint_interval=2,
    )


def sorted_frame(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values(list(frame.columns)).reset_index(drop=True)


@pytest.mark.timeout(600)
def test_own_pipeline_recovers_to_the_recomputed_state(spark, tmp_path, monkeypatch):
    """A failure part-way into the second partition, then the recovery run the sensor plans:
    the state and the sink's rows equal those of an uninterrupted recomputation."""
    pipeline = orders_pipeline(str(tmp_path / "sink"))
    storage = CheckpointStorageResource(
        checkpoint_dir=str(tmp_path / "checkpoints"), savepoint_dir=str(tmp_path / "savepoints")
    )
    defs = dg.Definitions.merge(
        pipeline_definitions(pipeline, automation_status="STOPPED"),
        dg.Definitions(resources={"spark": SparkResource(master="local[2]"),
                                  "checkpoint_storage": storage}),
    )
    job = defs.resolve_job_def("customer_totals_job")
    monkeypatch.setenv(FAULT_INJECTION_ENV, "1")
    with dg.instance_for_test() as instance:
        first = job.execute_in_process(instance=instance, partition_key="emea")
        failed = job.execute_in_process(
            instance=instance, partition_key="amer", tags={FAULT_TAG: "3"}, raise_on_error=False
        )
        assert (True, False) == (first.success, failed.success)

        request = plan_recovery(instance, failed.dagster_run, 3, pipeline)
        assert isinstance(request, dg.RunRequest)
        assert "amer" == request.partition_key
        recovered = job.execute_in_process(
            instance=instance, partition_key=request.partition_key, tags=request.tags,
            run_config=request.run_config,
        )
        assert recovered.success
        metadata = recovered.asset_materializations_for_node("customer_totals")[0].metadata
        # The failed run checkpointed after batches 1 and 2 of amer: only 3 and 4 are left.
        assert ("end of amer", 2) == (
            metadata["source_position"].value, metadata["batches_applied"].value
        )

    # The recomputation: the same pipeline, no failures, other directories.
    reference = orders_pipeline(str(tmp_path / "reference-sink"))
    runner = StatefulRunner(
        spark,
        CheckpointStorageResource(checkpoint_dir=str(tmp_path / "reference")).checkpoint_storage(),
        reference,
    )
    runner.run(["emea", "amer"])

    def state(directory):
        probe = StatefulRunner(
            spark,
            CheckpointStorageResource(checkpoint_dir=str(directory)).checkpoint_storage(),
            pipeline,
        )
        latest = probe.store.latest()
        frame = probe.restore_states(latest.metadata)["totals"].toPandas()
        return sorted_frame(frame)

    pd.testing.assert_frame_equal(state(tmp_path / "reference"), state(tmp_path / "checkpoints"))
    for region in ("emea", "amer"):
        expected = sorted_frame(pd.read_parquet(tmp_path / "reference-sink" / f"region={region}"))
        actual = sorted_frame(pd.read_parquet(tmp_path / "sink" / f"region={region}"))
        pd.testing.assert_frame_equal(expected, actual)
