"""A pipeline of a keyed and a plain (DataFrame) stage, for the checkpoint statistics and
views tests."""

from pyspark.sql import types as T

from pipelines import FullSnapshotPolicy, KeyedStage, Stage, StatefulPipeline
from tests.pipelines.support import PARTITIONS, SOURCE, TOTALS, customer_totals

CUSTOMERS = T.StructType([T.StructField("customer", T.StringType())])


def known_customers(input, state):
    """A plain (DataFrame) stage: the customers seen so far."""
    customers = state.unionByName(input.select("customer")).distinct()
    return customers, input.select("customer").distinct()


def mixed_pipeline(ttl=None, **options) -> StatefulPipeline:
    """A keyed and a plain stage, one checkpoint per partition of 4 batches; a range
    snapshots whole once it has 8 change files (at the third checkpoint)."""
    return StatefulPipeline(
        name="statistics",
        stages=[KeyedStage("totals", "customer", TOTALS, customer_totals, ttl=ttl),
                Stage("customers", CUSTOMERS, known_customers, input="source")],
        source=SOURCE, partitions=PARTITIONS,
        **({"checkpoint_interval": 10, "max_parallelism": 16,
            "full_snapshot": FullSnapshotPolicy(every=8, ratio=1000.0, min_bytes=0)} | options))
