"""``map_in_arrow``: a ``mapInArrow`` whose UDF is made once per Spark context and key (issue
28, the steady batch's wall): a later plan with the same key maps its own rows, a projection
of its output does not prune its input, and a plan costs one py4j round trip."""

import sys
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark import cloudpickle

from pipelines._map_in_arrow import map_in_arrow, repartition_by, with_literal
from tests.pipelines.support import py4j_calls

cloudpickle.register_pickle_by_value(sys.modules[__name__])
SCHEMA = "total long, names string"


def _sums(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Each row's sum of its integer columns, and the names of the columns it got."""
    for batch in batches:
        longs = [c for c in batch.columns if pa.types.is_integer(c.type)]
        total = longs[0]
        for column in longs[1:]:
            total = pc.add(total, column)
        yield pa.RecordBatch.from_arrays(
            [total, pa.array([",".join(batch.schema.names)] * batch.num_rows)],
            names=["total", "names"])


@pytest.mark.timeout(300)
def test_a_cached_udf_maps_each_plans_own_rows_unpruned(spark):
    first = spark.range(3).selectExpr("id AS a", "id * 10 AS b")
    second = spark.range(2).selectExpr("id + 100 AS a", "id AS b", "'x' AS `c.d`")
    mapped = [map_in_arrow(frame, _sums, SCHEMA, ("test sums",)) for frame in (first, second)]
    assert [[0, 11, 22], [100, 102]] == [sorted(r["total"] for r in m.collect()) for m in mapped]
    # a projection of the output only: the optimizer must not prune the UDF's input
    assert [["a,b"], ["a,b,c.d"]] == [sorted({r["names"] for r in m.select("names").collect()})
                                      for m in mapped]


@pytest.mark.timeout(300)
def test_a_cached_plan_is_one_py4j_round_trip_a_piece(spark, monkeypatch):
    frame = spark.range(4).selectExpr("id AS a", "id AS b")
    map_in_arrow(repartition_by(with_literal(frame, "t", 1), 2, "a"), _sums, SCHEMA,
                 ("test sums",), ["a", "b", "t"])
    calls = py4j_calls(monkeypatch)
    planned = map_in_arrow(repartition_by(with_literal(frame, "t", 7), 2, "a"), _sums,
                           SCHEMA, ("test sums",), ["a", "b", "t"])
    assert len(calls) <= 4, calls  # the literal, the projection, the repartition, the UDF
    monkeypatch.undo()
    assert [7, 9, 11, 13] == sorted(r["total"] for r in planned.collect())
