"""Declarative aggregates (``agg.stage``, ``agg``): against a plain-Python reference
model over random batches with nulls, several batches and event-time expiry; their types,
errors and reuse from a hand-written stage; and through the StatefulRunner on Spark with a
checkpoint and a restore."""

import datetime as dt
import random
import sys
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark import cloudpickle
from pyspark.sql import types as T

from checkpoint_storage import FileSystemCheckpointStorage, RestoreMode
from pipelines import (
    FullSnapshotPolicy,
    KeyedResult,
    KeyedStage,
    Source,
    StatefulPipeline,
    StatefulRunner,
    StateTtl,
    agg,
)
from pipelines.keyed import Aggregate, Aggregates

T0 = dt.datetime(2026, 10, 1, tzinfo=dt.UTC)
TS = pa.timestamp("us", tz="UTC")
EVENTS = pa.schema([
    ("user", pa.string()),
    ("amount", pa.decimal128(12, 2)),
    ("n", pa.int64()),
    ("ts", TS),
    ("url", pa.string()),
])
AGGREGATES = {
    "clicks": agg.count(),
    "urls": agg.count("url"),
    "amount": agg.sum("amount"),
    "n": agg.sum("n"),
    "first_seen": agg.min("ts"),
    "last_seen": agg.max("ts"),
    "top_url": agg.max("url"),
    "first_url": agg.first("url", by="ts"),
    "last_url": agg.last("url", by="ts"),
}
TTL = StateTtl(dt.timedelta(hours=24), timestamp_column="last_seen")


def at(hours: int | None) -> dt.datetime | None:
    return None if hours is None else T0 + dt.timedelta(hours=hours)


# --- the reference model -----------------------------------------------------------------

def add(a, b):
    return b if a is None else a if b is None else a + b


def bound(pick, a, b):
    return b if a is None else a if b is None else pick(a, b)


def fold(acc: dict | None, user: str, row: dict) -> dict:
    """One input row into a user's aggregates, row by row as SQL defines them."""
    acc = dict(acc or {"user": user, "clicks": 0, "urls": 0, "amount": None, "n": None,
                       "first_seen": None, "last_seen": None, "top_url": None,
                       "first_url": None, "first_url_ts": None, "last_url": None,
                       "last_url_ts": None})
    acc["clicks"] += 1
    acc["urls"] += row["url"] is not None
    acc["amount"] = add(acc["amount"], row["amount"])
    acc["n"] = add(acc["n"], row["n"])
    acc["first_seen"] = bound(min, acc["first_seen"], row["ts"])
    acc["last_seen"] = bound(max, acc["last_seen"], row["ts"])
    acc["top_url"] = bound(max, acc["top_url"], row["url"])
    if row["ts"] is not None:
        if acc["first_url_ts"] is None or row["ts"] < acc["first_url_ts"]:
            acc["first_url"], acc["first_url_ts"] = row["url"], row["ts"]
        if acc["last_url_ts"] is None or row["ts"] >= acc["last_url_ts"]:
            acc["last_url"], acc["last_url_ts"] = row["url"], row["ts"]
    return acc


class Model:
    """The aggregates per user as dicts, with the runner's event-time rules: the clock is the
    newest ``ts`` seen (this batch included); rows behind clock - ttl are dropped as late,
    state whose ``last_seen`` is behind it expires (a null time never does)."""

    def __init__(self, ttl: StateTtl | None) -> None:
        self.ttl = ttl
        self.state: dict[str, dict] = {}
        self.clock: dt.datetime | None = None

    def on_time(self, batch: list[dict]) -> list[dict]:
        times = [r["ts"] for r in batch if r["ts"] is not None]
        if times and (self.clock is None or max(times) > self.clock):
            self.clock = max(times)
        if self.ttl is None or self.clock is None:
            return batch
        cutoff = self.clock - self.ttl.ttl
        self.state = {u: s for u, s in self.state.items()
                      if s["last_seen"] is None or s["last_seen"] >= cutoff}
        return [r for r in batch if r["ts"] is None or r["ts"] >= cutoff]

    def run(self, rows: list[dict]) -> tuple[list[dict], list[dict]]:
        """Rows on time into the state: the emitted rows of ``updated`` and of ``batch``."""
        alone: dict[str, dict] = {}
        for row in rows:
            self.state[row["user"]] = fold(self.state.get(row["user"]), row["user"], row)
            alone[row["user"]] = fold(alone.get(row["user"]), row["user"], row)
        return [self.state[u] for u in alone], list(alone.values())


def rows(table: pa.Table, names: list[str]) -> list[tuple]:
    return sorted((tuple(r[n] for n in names) for r in table.to_pylist()), key=repr)


def model_rows(dicts: list[dict], names: list[str]) -> list[tuple]:
    return sorted((tuple(d[n] for n in names) for d in dicts), key=repr)


def run_stage(stage: KeyedStage, state: dict, batch: list[dict]) -> KeyedResult:
    """``stage`` on a batch already filtered as the runner filters it, given the state rows
    of the batch's keys (from ``state``, a dict per key that the result updates)."""
    users = {r["user"] for r in batch}
    given = pa.Table.from_pylist([state[u] for u in users if u in state],
                                 schema=stage.state_schema)
    result = stage.run(pa.Table.from_pylist(batch, schema=EVENTS), given)
    for row in result.upserts.to_pylist():
        state[row["user"]] = row
    assert 0 == result.deletes.num_rows
    return result


USERS = st.sampled_from(["u1", "u2", "u3", "u4", "u5"])
ROW = st.fixed_dictionaries({
    "user": USERS,
    "amount": st.none() | st.integers(-10**6, 10**6).map(lambda c: Decimal(c).scaleb(-2)),
    "n": st.none() | st.integers(-10**12, 10**12),
    "ts": st.none() | st.integers(0, 40).map(at),  # ties of by across batches, and expiry
    "url": st.none() | st.sampled_from(["/a", "/b", "/c", "/d"]),
})
BATCHES = st.lists(st.lists(ROW, max_size=25), min_size=1, max_size=6)


@settings(deadline=None, max_examples=150)
@given(batches=BATCHES, with_ttl=st.booleans())
def test_aggregates_equal_a_reference_model_over_batches(batches, with_ttl):
    """Over several random batches with nulls in every aggregated column (and, with a TTL,
    rows too late and keys that expire), the upserts, the state and both kinds of output
    equal the row-by-row model, batch by batch."""
    ttl = TTL if with_ttl else None
    options = {"ttl": ttl, "event_time": "ts"} if with_ttl else {}
    updated = agg.stage("activity", "user", AGGREGATES, EVENTS, **options)
    alone = agg.stage("activity", "user", AGGREGATES, EVENTS, emit="batch", **options)
    model = Model(ttl)
    state: dict[str, dict] = {}
    state_names = updated.state_schema.names
    output_names = updated.output_schema.names
    for batch in batches:
        on_time = model.on_time(batch)
        state = {u: s for u, s in state.items() if u in model.state}  # the runner's expiry
        model_updated, model_alone = model.run(on_time)
        before = dict(state)
        result = run_stage(updated, state, on_time)
        other = run_stage(alone, dict(before), on_time)
        assert (model_rows(model_updated, state_names), model_rows(model_updated, output_names),
                model_rows(model_alone, output_names), model_rows(model_updated, state_names),
                model_rows(list(model.state.values()), state_names)) == (
            rows(result.upserts, state_names), rows(result.output, output_names),
            rows(other.output, output_names), rows(other.upserts, state_names),
            model_rows(list(state.values()), state_names))


def test_ties_nulls_late_rows_and_expiry_on_a_fixed_run():
    """Ties of ``by``: first keeps the earliest row (state before batch), last the latest;
    an all-null column stays null while ``count()`` counts its rows and ``count(col)`` does
    not; with the TTL, rows behind the clock are dropped and a key whose ``last_seen`` is
    behind it expires while a key without any time never does."""
    blank = {"amount": None, "n": None, "url": None}
    ties = agg.stage("ties", "user", AGGREGATES, EVENTS)
    state: dict[str, dict] = {}
    run_stage(ties, state, [blank | {"user": "u1", "ts": at(1), "url": "/a"},
                            blank | {"user": "u1", "ts": at(1), "url": "/b"},
                            blank | {"user": "u2", "ts": None}])
    after_first = (state["u1"]["first_url"], state["u1"]["last_url"])
    run_stage(ties, state, [blank | {"user": "u1", "ts": at(1), "url": "/c"}])
    assert ((("/a", "/b"), ("/a", "/c")), (1, 0, None, None, None)) == (
        (after_first, (state["u1"]["first_url"], state["u1"]["last_url"])),
        tuple(state["u2"][n] for n in ("clicks", "urls", "amount", "n", "first_url")))

    timed = agg.stage("timed", "user", AGGREGATES, EVENTS, ttl=TTL, event_time="ts")
    model, state = Model(TTL), {}
    for batch in ([blank | {"user": "u1", "ts": at(1)}, blank | {"user": "u2", "ts": None}],
                  [blank | {"user": "u3", "ts": at(30)}, blank | {"user": "u1", "ts": at(2)}]):
        on_time = model.on_time(batch)
        state = {u: s for u, s in state.items() if u in model.state}
        model.run(on_time)
        run_stage(timed, state, on_time)
    assert ({"u2", "u3"}, 1) == (set(state), state["u2"]["clicks"])


# --- types and errors --------------------------------------------------------------------

def test_state_and_output_types_follow_sparks_rules():
    """count is a not-null int64, integer sums int64, decimal(12, 2) sums decimal(22, 2),
    decimal(35, 4) sums decimal(38, 4), a sum's type= wins, min/max/first/last keep the
    column's type; first/last keep their ``by`` value in the state only."""
    schema = EVENTS.append(pa.field("big", pa.decimal128(35, 4))).append(
        pa.field("small", pa.int16()))
    stage = agg.stage("s", "user", {
        "c": agg.count(), "d": agg.sum("amount"), "b": agg.sum("big"), "i": agg.sum("small"),
        "t": agg.sum("amount", type=pa.decimal128(38, 2)), "m": agg.min("ts"),
        "l": agg.last("url", by="ts")}, schema)
    assert ([("user", pa.string(), False), ("c", pa.int64(), False),
             ("d", pa.decimal128(22, 2), True), ("b", pa.decimal128(38, 4), True),
             ("i", pa.int64(), True), ("t", pa.decimal128(38, 2), True), ("m", TS, True),
             ("l", pa.string(), True), ("l_ts", TS, True)],
            ["user", "c", "d", "b", "i", "t", "m", "l"], True) == (
        [(f.name, f.type, f.nullable) for f in stage.state_schema],
        stage.output_schema.names, stage.output_schema.field("user").nullable)


def test_a_sum_that_overflows_its_type_fails_naming_the_stage_and_aggregate():
    """A decimal(22, 2) total past 20 integer digits, and an int64 sum past 2**63 inside one
    batch (Arrow's integer sums would wrap), fail the batch with the stage, the aggregate and
    what to do; a sum that fits is exact."""
    stage = agg.stage("totals", "user", {"amount": agg.sum("amount"),
                                               "n": agg.sum("n")}, EVENTS)
    big = Decimal("9999999999.99")
    batch = pa.Table.from_pylist([{"user": "u", "amount": big, "n": 1}] * 3, schema=EVENTS)
    state = pa.Table.from_pylist([{"user": "u", "amount": Decimal("9" * 20 + ".99"), "n": 0}],
                                 schema=stage.state_schema)
    fits = stage.run(batch, stage.empty_state())
    assert [{"user": "u", "amount": big * 3, "n": 3}] == fits.upserts.to_pylist()
    with pytest.raises(ValueError, match=r"aggregate stage totals: amount = agg.sum\('amount'\)"
                       r" does not fit decimal128\(22, 2\).*wider type="):
        stage.run(batch, state)
    wraps = pa.Table.from_pylist([{"user": "u", "n": 2**62}] * 2, schema=EVENTS)
    with pytest.raises(ValueError, match=r"n = agg.sum\('n'\) does not fit int64"):
        stage.run(wraps, stage.empty_state())


@pytest.mark.parametrize(("aggregates", "message"), [
    ({"x": agg.sum("url")}, r"adds up 'url' of type string; sums take integers"),
    ({"x": agg.min("nope")}, r"x = agg.min\('nope'\) reads \['nope'\], not in input_schema"),
    ({"url": agg.last("url", by="ts"), "url_ts": agg.max("ts")},
     r"column name\(s\) \['url_ts'\] are used twice"),
    ({"user": agg.count()}, r"column name\(s\) \['user'\] are used twice"),
    ({"_x": agg.count()}, r"aggregate name '_x'"),
    ({}, r"aggregates must be a non-empty dict"),
    ({"x": "count"}, r"aggregate 'x' must be agg.<function>"),
])
def test_bad_declarations_are_refused_naming_the_stage(aggregates, message):
    with pytest.raises((ValueError, TypeError), match=f"aggregate stage s: .*{message}"):
        agg.stage("s", "user", aggregates, EVENTS)


def test_bad_aggregates_are_refused():
    with pytest.raises(ValueError, match="by= is the ordering column of first/last"):
        agg.last("url", by=None)
    with pytest.raises(ValueError, match="by= is the ordering column of first/last"):
        Aggregate("max", "url", by="ts")
    with pytest.raises(ValueError, match="type= is a sum's result type"):
        Aggregate("max", "url", type=pa.int64())
    with pytest.raises(ValueError, match="agg.min needs the input column"):
        Aggregate("min")


def test_an_input_that_does_not_fit_the_input_schema_is_refused():
    stage = agg.stage("s", "user", {"n": agg.sum("n")}, EVENTS)
    with pytest.raises(ValueError, match=r"aggregate stage s: the input's columns \['user', "
                                         r"'n'\] do not fit input_schema"):
        stage.run(pa.table({"user": ["u"], "n": ["x"]}), stage.empty_state())


def test_the_apply_is_reusable_from_a_hand_written_stage():
    """``Aggregates.apply`` is a plain function: a hand-written stage calls it and adds its
    own rule (here: alert on users whose count passes 2) without repeating the joins."""
    counts = Aggregates(("user",), {"clicks": agg.count(), "last_seen": agg.max("ts")}, EVENTS)

    def alerting(input: pa.Table, state: pa.Table) -> KeyedResult:
        result = counts.apply(input, state)
        alerts = result.upserts.filter(pc.greater(result.upserts.column("clicks"), 2))
        return KeyedResult(result.upserts, result.deletes, alerts)

    stage = KeyedStage("alerts", "user", counts.state_schema, alerting,
                       output_schema=counts.state_schema)
    first = stage.run(pa.Table.from_pylist([{"user": "a", "ts": at(1)}] * 2
                                           + [{"user": "b", "ts": at(2)}], schema=EVENTS),
                      stage.empty_state())
    second = stage.run(pa.Table.from_pylist([{"user": "a", "ts": at(3)}], schema=EVENTS),
                       first.upserts.filter(pc.equal(first.upserts.column("user"), "a")))
    assert (0, [{"user": "a", "clicks": 3, "last_seen": at(3)}]) == (
        first.output.num_rows, second.output.to_pylist())


# --- through the runner on Spark ---------------------------------------------------------

SPARK_EVENTS = T.StructType([
    T.StructField("user", T.StringType()),
    T.StructField("amount", T.DecimalType(12, 2)),
    T.StructField("n", T.LongType()),
    T.StructField("ts", T.TimestampType()),
    T.StructField("url", T.StringType()),
])
PARTITIONS = dg.StaticPartitionsDefinition(["p1", "p2"])


@dataclass(frozen=True)
class RandomEvents(Source):
    """Events made up from the batch id, with nulls in every aggregated column."""

    def batches(self, spark, partition):
        return [f"{partition}-{i}" for i in range(3)]

    def read(self, spark, partition, batch):
        return spark.createDataFrame(self.rows(batch), SPARK_EVENTS)

    def rows(self, batch: str) -> list[dict]:
        rng = random.Random(batch)
        maybe = lambda value: None if rng.random() < 0.2 else value  # noqa: E731
        return [{"user": f"u{rng.randrange(12)}",
                 "amount": maybe(Decimal(rng.randrange(-5000, 5000)).scaleb(-2)),
                 "n": maybe(rng.randrange(100)), "ts": maybe(at(rng.randrange(48))),
                 "url": maybe(f"/{rng.randrange(5)}")} for _ in range(40)]


cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_an_aggregate_stage_through_the_runner_checkpoints_and_restores(spark, tmp_path: Path):
    """On two key-group ranges: p1, a checkpoint, a new runner restored from it (NO_CLAIM,
    into another job) runs p2; its state equals the model over both partitions' rows."""
    source = RandomEvents()
    pipeline = StatefulPipeline(
        name="aggregates", stages=[agg.stage("activity", "user", AGGREGATES, EVENTS)],
        source=source, partitions=PARTITIONS, checkpoint_interval=2, max_parallelism=16,
        keyed_parallelism=2, full_snapshot=FullSnapshotPolicy(every=2, min_bytes=0))

    def runner(directory: Path) -> StatefulRunner:
        storage = FileSystemCheckpointStorage(str(directory / "checkpoints"),
                                              file_state_size_threshold=0)
        return StatefulRunner(spark, storage, pipeline, keyed_local_dir=str(directory / "local"))

    first = runner(tmp_path / "a")
    (done,) = first.run(["p1"])
    second = runner(tmp_path / "b")
    second.run(["p2"], restore_from=done.checkpoint.pointer,
               restore_mode=RestoreMode.NO_CLAIM)

    model = Model(None)
    for partition in ("p1", "p2"):
        for batch in source.batches(None, partition):
            model.run(model.on_time(source.rows(batch)))
    names = pipeline.stages[0].state_schema.names
    state = second.restore_states(second.store.latest().metadata)["activity"].toArrow()
    assert model_rows(list(model.state.values()), names) == rows(state, names)
