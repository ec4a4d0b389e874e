"""The keyed stage spec: validation, the checked apply, state expiry, and its place in a
pipeline spec. No Spark."""

import datetime as dt

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark.sql import types as T

from pipelines import (
    DEFAULT_MAX_PARALLELISM,
    SOURCE,
    FileSource,
    KeyedResult,
    KeyedStage,
    Stage,
    StatefulPipeline,
    StateTtl,
    TtlTimeCharacteristic,
)

STATE = pa.schema([("user", pa.string()), ("clicks", pa.int64()),
                   ("last_seen", pa.timestamp("us", "UTC"))])
T0 = dt.datetime(2026, 3, 10, tzinfo=dt.UTC)


def count_clicks(batch: pa.Table, state: pa.Table) -> KeyedResult:
    """Per user: clicks += the batch's clicks, last_seen = the batch's latest time."""
    per_user = batch.group_by("user").aggregate([("user", "count"), ("ts", "max")])
    joined = per_user.join(state, "user", join_type="left outer")
    clicks = pc.add(pc.fill_null(joined.column("clicks"), 0), joined.column("user_count"))
    upserts = pa.table({"user": joined.column("user"), "clicks": clicks,
                        "last_seen": joined.column("ts_max")})
    return KeyedResult(upserts, pa.table({"user": pa.array([], pa.string())}), upserts)


def clicks_stage(**overrides) -> KeyedStage:
    spec = {"name": "clicks", "key": "user", "state_schema": STATE, "apply": count_clicks}
    return KeyedStage(**(spec | overrides))


def batch(*rows) -> pa.Table:
    return pa.table({"user": [u for u, _ in rows],
                     "ts": pa.array([T0 + dt.timedelta(hours=h) for _, h in rows],
                                    pa.timestamp("us", "UTC"))})


def test_apply_sees_only_the_batchs_keys_state_and_returns_checked_rows():
    """``run`` calls the function and returns its upserts conformed to the state schema."""
    state = pa.table({"user": ["a"], "clicks": [2], "last_seen": [T0]}, schema=STATE)

    result = clicks_stage().run(batch(("a", 1), ("b", 2), ("a", 3)), state)

    assert {"a": 4, "b": 1} == dict(zip(result.upserts.column("user").to_pylist(),
                                        result.upserts.column("clicks").to_pylist(),
                                        strict=True))
    assert STATE == result.upserts.schema


def test_key_given_as_a_name_is_a_one_column_key():
    """``key="user"`` and ``key=["user"]`` are the same spec."""
    assert ("user",) == clicks_stage().key == clicks_stage(key=["user"]).key


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"name": "my-stage"}, ValueError, "stage name 'my-stage'"),
        ({"key": []}, ValueError, "key must be a column name"),
        ({"key": ["user", "user"]}, ValueError, "names a column twice"),
        ({"key": "account"}, ValueError, r"key column\(s\) \['account'\] are not in state_schema"),
        ({"state_schema": T.StructType()}, TypeError, "state_schema must be a pyarrow Schema"),
        ({"state_schema": STATE.append(pa.field("_hidden", pa.int8()))}, ValueError,
         "reserve"),
        ({"state_schema": pa.schema([("user", pa.float64())])}, ValueError,
         "key column 'user' has type double"),
        ({"apply": None}, TypeError, "apply must be callable"),
        ({"ttl": dt.timedelta(days=2)}, TypeError, "ttl must be a StateTtl"),
        ({"ttl": StateTtl(dt.timedelta(days=2), timestamp_column="seen")}, ValueError,
         "timestamp_column 'seen' is not in state_schema"),
        ({"ttl": StateTtl(dt.timedelta(days=2), timestamp_column="clicks")}, ValueError,
         "must be a timestamp column"),
    ],
)
def test_a_bad_keyed_stage_is_refused_naming_what_is_wrong(overrides, error, match):
    """Every invalid field is refused when the stage is defined, naming stage and field."""
    with pytest.raises(error, match=match):
        clicks_stage(**overrides)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ttl": dt.timedelta(0)}, "ttl must be a positive"),
        ({"ttl": dt.timedelta(days=1)}, "needs timestamp_column"),
        ({"ttl": dt.timedelta(days=1), "timestamp_column": "last_seen",
          "time_characteristic": TtlTimeCharacteristic.PROCESSING_TIME}, "leave timestamp_column"),
    ],
)
def test_a_bad_state_ttl_is_refused(kwargs, match):
    """Expiry needs a positive duration, and a timestamp column exactly for event time."""
    with pytest.raises(ValueError, match=match):
        StateTtl(**kwargs)


def test_event_time_expiry_marks_rows_older_than_the_cutoff():
    """At now = T0 + 2 days with a one-day TTL, a key last seen before T0 + 1 day expired."""
    ttl = StateTtl(dt.timedelta(days=1), timestamp_column="last_seen")
    state = pa.table({"user": ["old", "edge", "new"], "clicks": [1, 1, 1],
                      "last_seen": [T0, T0 + dt.timedelta(days=1), T0 + dt.timedelta(days=2)]},
                     schema=STATE)

    assert [True, False, False] == ttl.expired(state, ttl.cutoff(T0 + dt.timedelta(days=2))
                                               ).to_pylist()


def bad_apply(result):
    return lambda batch, state: result


UPSERT_A = pa.table({"user": ["a"], "clicks": [1], "last_seen": [T0]}, schema=STATE)
NO_DELETES = pa.table({"user": pa.array([], pa.string())})


@pytest.mark.parametrize(
    ("result", "match"),
    [
        ((UPSERT_A, NO_DELETES), "apply returned tuple"),
        (KeyedResult(UPSERT_A.drop_columns(["clicks"]), NO_DELETES, UPSERT_A),
         r"upserts lack column\(s\) \['clicks'\]"),
        (KeyedResult(pa.concat_tables([UPSERT_A, UPSERT_A]), NO_DELETES, UPSERT_A),
         "upserts name 1 key.* more than once"),
        (KeyedResult(UPSERT_A, pa.table({"user": ["a"]}), UPSERT_A),
         "both upserted and deleted"),
        (KeyedResult(UPSERT_A, pa.table({"account": ["a"]}), UPSERT_A),
         r"deletes lack column\(s\) \['user'\]"),
    ],
)
def test_a_bad_result_is_refused_naming_the_stage(result, match):
    """What apply returns is checked: a KeyedResult, complete rows, one per key, a key not
    both upserted and deleted; the error names the stage."""
    with pytest.raises((TypeError, ValueError), match=f"keyed stage clicks.*{match}"):
        clicks_stage(apply=bad_apply(result)).run(batch(("a", 1)), STATE.empty_table())


def kv_stage(name: str) -> Stage:
    return Stage(name, T.StructType([T.StructField("k", T.StringType())]), lambda s, i: (s, i))


def pipeline(**overrides) -> StatefulPipeline:
    spec = {"name": "clicks", "stages": [kv_stage("raw"), clicks_stage(input=SOURCE)],
            "source": FileSource(url="/landing/date={partition}", schema="user string, ts "
                                 "timestamp"),
            "partitions": dg.DailyPartitionsDefinition(start_date="2026-03-01")}
    return StatefulPipeline(**(spec | overrides))


def test_a_pipeline_mixes_dataframe_and_keyed_stages():
    """Keyed stages sit beside DataFrame stages, with inputs wired as for any stage, and the
    pipeline's max parallelism defaults to Flink's 128."""
    spec = pipeline(stages=[kv_stage("raw"), clicks_stage(input=SOURCE), kv_stage("after")])

    assert [SOURCE, SOURCE, "clicks"] == [spec.input_of(i) for i in range(3)]
    assert (clicks_stage(input=SOURCE),) == spec.keyed_stages
    assert 128 == DEFAULT_MAX_PARALLELISM == spec.max_parallelism


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"max_parallelism": 0}, "max_parallelism must be in"),
        ({"max_parallelism": 40000}, "max_parallelism must be in"),
        ({"stages": [clicks_stage(), clicks_stage()]}, "two stages are called 'clicks'"),
        ({"stages": [clicks_stage(input="later")]}, "stage 'clicks' reads 'later'"),
        ({"stages": ["clicks"]}, "is not a Stage or KeyedStage"),
    ],
)
def test_a_pipeline_refuses_bad_keyed_wiring(overrides, match):
    """Max parallelism outside Flink's bounds, duplicate names or unknown inputs are refused
    for keyed stages as for DataFrame stages."""
    with pytest.raises((ValueError, TypeError), match=match):
        pipeline(**overrides)
