"""The keyed stage spec: validation, the checked apply, state expiry, and its place in a
pipeline spec. No Spark."""

import datetime as dt
from collections.abc import Callable

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
from pipelines.keyed import hash_keys, key_type_fits

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
         r"upserts: missing column\(s\) \['clicks'\]"),
        (KeyedResult(pa.concat_tables([UPSERT_A, UPSERT_A]), NO_DELETES, UPSERT_A),
         "upserts name 1 key.* more than once"),
        (KeyedResult(UPSERT_A, pa.table({"user": ["a"]}), UPSERT_A),
         "both upserted and deleted"),
        (KeyedResult(UPSERT_A, pa.table({"account": ["a"]}), UPSERT_A),
         r"deletes: missing column\(s\) \['user'\]"),
    ],
)
def test_a_bad_result_is_refused_naming_the_stage(result, match):
    """What apply returns is checked: a KeyedResult, complete rows, one per key, a key not
    both upserted and deleted; the error names the stage."""
    with pytest.raises((TypeError, ValueError), match=f"keyed stage clicks.*{match}"):
        clicks_stage(apply=bad_apply(result)).run(batch(("a", 1)), STATE.empty_table())


def kv_stage(name: str) -> Stage:
    return Stage(name, T.StructType([T.StructField("k", T.StringType())]), lambda i, s: (s, i))


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


# --- the contract of a batch's result: only the input's keys, of the state's key type --------

def upsert_users(*users) -> Callable:
    """An apply that upserts (one click for) ``users``, whatever the input holds."""
    rows = pa.table({"user": list(users), "clicks": [1] * len(users),
                     "last_seen": [T0] * len(users)}, schema=STATE)
    return bad_apply(KeyedResult(rows, NO_DELETES, rows))


def delete_users(*users) -> Callable:
    return bad_apply(KeyedResult(STATE.empty_table(), pa.table({"user": list(users)}),
                                 STATE.empty_table()))


@pytest.mark.parametrize(("apply", "what"), [(upsert_users("a", "z"), "upserts"),
                                             (delete_users("z"), "deletes")])
def test_a_key_not_in_the_input_is_refused_naming_stage_count_and_key(apply, what):
    """Upserting or deleting a key the batch's input does not have is refused: the stage was
    not given its state, and its key group may be another range's."""
    with pytest.raises(ValueError) as refused:
        clicks_stage(apply=apply).run(batch(("a", 1), ("b", 2)), STATE.empty_table())

    message = str(refused.value)
    assert message.startswith(f"keyed stage clicks: {what} change 1 key(s) that are not among "
                              "the batch's input keys, e.g. {'user': 'z'}")
    assert "for the input's keys only" in message


def test_extra_keys_may_be_changed_besides_the_inputs():
    """Keys passed as ``extra_keys`` (a timer's, later) may be upserted and deleted too."""
    both = bad_apply(KeyedResult(UPSERT_A.set_column(0, "user", pa.array(["t1"])),
                                 pa.table({"user": ["t2"]}), STATE.empty_table()))

    result = clicks_stage(apply=both).run(batch(("a", 1)), STATE.empty_table(),
                                          extra_keys=pa.table({"user": ["t1", "t2"]}))

    assert (["t1"], ["t2"]) == (result.upserts.column("user").to_pylist(),
                                result.deletes.column("user").to_pylist())


def test_a_key_of_another_type_is_refused_in_input_upserts_and_deletes():
    """int64 ids into a string key are refused, not cast: in the input (before apply runs),
    in the upserts and in the deletes, naming the stage, the column and both types."""
    ids = pa.table({"user": pa.array([80], pa.int64()), "ts": pa.array([T0])})
    called = []
    with pytest.raises(ValueError) as input_refused:
        clicks_stage(apply=lambda b, s: called.append(b)).run(ids, STATE.empty_table())
    int_upserts = pa.table({"user": pa.array([1], pa.int64()), "clicks": [1],
                            "last_seen": [T0]})
    with pytest.raises(ValueError) as upserts_refused:
        clicks_stage(apply=bad_apply(KeyedResult(int_upserts, NO_DELETES, UPSERT_A))).run(
            batch(("1", 1)), STATE.empty_table())
    with pytest.raises(ValueError) as deletes_refused:
        clicks_stage(apply=bad_apply(KeyedResult(
            STATE.empty_table(), pa.table({"user": pa.array([1], pa.int64())}), UPSERT_A))).run(
            batch(("1", 1)), STATE.empty_table())

    assert [] == called
    for refused, what in ((input_refused, "input's"), (upserts_refused, "upserts'"),
                          (deletes_refused, "deletes'")):
        assert str(refused.value).startswith(
            f"keyed stage clicks: the {what} key column 'user' has type int64, the state "
            "schema's key type is string")
        assert "Cast 'user' to string in the stage before" in str(refused.value)


WIDENINGS = [(pa.int32(), pa.int64(), [-5, 7]), (pa.uint16(), pa.int32(), [0, 65535]),
             (pa.int8(), pa.int16(), [-128, 3]),
             (pa.string(), pa.large_string(), ["ann", "bob"]),
             (pa.large_string(), pa.string(), ["ann", ""]),
             (pa.binary(), pa.large_binary(), [b"\x00", b"ab"]),
             (pa.timestamp("us", "Europe/Berlin"), pa.timestamp("us", "UTC"), [T0, T0])]


@pytest.mark.parametrize(("given", "declared", "values"), WIDENINGS, ids=str)
def test_a_lossless_widening_is_a_key_of_the_same_hash(given, declared, values):
    """What ``key_type_fits`` allows keeps each key's value and its hash (so its key group):
    ``hash_keys`` hashes the value, whatever the type holding it."""
    column = pa.array(values, given)

    assert key_type_fits(given, declared)
    assert (hash_keys(pa.table({"k": column}), ("k",)).tolist()
            == hash_keys(pa.table({"k": column.cast(declared)}), ("k",)).tolist())


@pytest.mark.parametrize(("given", "declared"), [
    (pa.int64(), pa.string()), (pa.string(), pa.int64()), (pa.int64(), pa.int32()),
    (pa.int32(), pa.uint64()), (pa.uint64(), pa.int64()), (pa.date32(), pa.date64()),
    (pa.timestamp("ms", "UTC"), pa.timestamp("us", "UTC")),
    (pa.timestamp("us"), pa.timestamp("us", "UTC")), (pa.string(), pa.binary())], ids=str)
def test_other_key_types_are_not_keys_of_the_declared_type(given, declared):
    """A narrowing, another family, another unit or naive against zoned time: refused
    (another unit counts otherwise, so it would hash otherwise)."""
    assert not key_type_fits(given, declared)


def test_an_int32_input_reaches_the_state_of_its_int64_key():
    """A widened input key is the declared key: the stage's upserts of it are accepted."""
    schema = pa.schema([("id", pa.int64()), ("n", pa.int64())])

    def count(input, state):
        rows = pa.table({"id": input.column("id"), "n": pa.repeat(1, input.num_rows)})
        return KeyedResult(rows, pa.table({"id": pa.array([], pa.int64())}), rows)

    stage = KeyedStage("ids", "id", schema, count)
    result = stage.run(pa.table({"id": pa.array([3, 4], pa.int32())}), schema.empty_table())

    assert ([3, 4], schema) == (result.upserts.column("id").to_pylist(), result.upserts.schema)
