"""The click-events stages as keyed stages (pure Arrow) against the DataFrame stages.

``KeyedDriver`` simulates the keyed runner's semantics in plain Python (docs/design.md
section 7 and ``KeyedStage``'s docstring): a dict of state rows per key; the stage's clock is
the newest ``event_time`` seen, this batch included (over the whole batch); input rows behind
the clock minus the ttl are dropped before ``apply``; state rows behind it are expired (never
handed to ``apply``, dropped); the batch is routed to ``parallelism`` key-group ranges by the
stable key hash and ``apply`` runs once per range with rows, with the state of that range's
keys in the batch.
"""

import datetime as dt
from decimal import Decimal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from py4j.protocol import Py4JJavaError
from pyspark.errors import PySparkException
from pyspark.sql.pandas.types import to_arrow_schema

from pipelines import FileSource
from pipelines.examples.click_events.events import EVENT_ARROW_SCHEMA, generate_day
from pipelines.examples.click_events.stages import (
    DEDUPE_KEYED,
    DEDUPE_KEYED_STATE_SCHEMA,
    DEDUPE_OUTPUT_SCHEMA,
    DEDUPE_RETENTION,
    DEDUPE_STATE_SCHEMA,
    EVENT_SCHEMA,
    KEYED_STAGES,
    STAGES,
    USER_ACTIVITY_KEYED,
    USER_ACTIVITY_KEYED_STATE_SCHEMA,
    USER_ACTIVITY_OUTPUT_SCHEMA,
    USER_ACTIVITY_STATE_SCHEMA,
    dedupe,
    user_activity,
)
from pipelines.keyed import (
    KeyedStage,
    KeyedStateLayout,
    compute_operator_index_for_key_group,
)

MAX_PARALLELISM = 128
T0 = dt.datetime(2026, 10, 1, tzinfo=dt.UTC)


class KeyedDriver:
    """One keyed stage run batch by batch as the keyed runner runs it (see the module
    docstring), with its state as a dict of rows per key."""

    def __init__(self, stage: KeyedStage, parallelism: int = 1) -> None:
        self.stage = stage
        self.parallelism = parallelism
        self.layout = KeyedStateLayout.of(stage, MAX_PARALLELISM)
        self.state: dict[tuple, dict] = {}
        self.clock: dt.datetime | None = None
        self.late = 0
        self.expired = 0
        self.ranges_per_batch: list[int] = []

    def key_of(self, row: dict) -> tuple:
        return tuple(row[k] for k in self.stage.key)

    def run(self, batch: pa.Table) -> pa.Table:
        stage, ttl = self.stage, self.stage.ttl
        if stage.event_time is not None:
            times = [t for t in batch.column(stage.event_time).to_pylist() if t is not None]
            if times and (self.clock is None or max(times) > self.clock):
                self.clock = max(times)
        if ttl is not None and self.clock is not None:
            cutoff = ttl.cutoff(self.clock)
            on_time = np.array([t is None or t >= cutoff
                                for t in batch.column(stage.event_time).to_pylist()], bool)
            self.late += int((~on_time).sum())
            batch = batch.filter(pa.array(on_time))
            expired = [k for k, row in self.state.items()
                       if row[ttl.column] is not None and row[ttl.column] < cutoff]
            self.expired += len(expired)
            for k in expired:
                del self.state[k]
        outputs = [stage.output_schema.empty_table()]
        parts = self.ranges(batch)
        self.ranges_per_batch.append(len(parts))
        for part in parts:
            keys = {self.key_of(row) for row in part.select(list(stage.key)).to_pylist()}
            state = pa.Table.from_pylist([self.state[k] for k in keys if k in self.state],
                                         schema=stage.state_schema)
            result = stage.run(part, state)
            for row in result.upserts.to_pylist():
                self.state[self.key_of(row)] = row
            for row in result.deletes.to_pylist():
                self.state.pop(self.key_of(row), None)
            outputs.append(result.output.select(stage.output_schema.names)
                           .cast(stage.output_schema))
        return pa.concat_tables(outputs)

    def ranges(self, batch: pa.Table) -> list[pa.Table]:
        """The batch's rows per key-group range that has rows (Flink's ``g*p/m``)."""
        if not batch.num_rows:
            return []
        groups = self.layout.key_groups_of(batch)
        index = np.array([compute_operator_index_for_key_group(
            MAX_PARALLELISM, self.parallelism, int(g)) for g in groups])
        parts = [batch.filter(pa.array(index == i)) for i in range(self.parallelism)]
        return [p for p in parts if p.num_rows]

    def state_table(self) -> pa.Table:
        """The live state: the rows ``apply`` could still be handed."""
        return pa.Table.from_pylist(list(self.state.values()), schema=self.stage.state_schema)


def nullable(schema: pa.Schema) -> pa.Schema:
    return pa.schema([f.with_nullable(True) for f in schema])


def rows(table: pa.Table, schema: pa.Schema) -> list[tuple]:
    """``table``'s rows as tuples of ``schema``'s columns and types, in a canonical order."""
    table = table.select(schema.names).cast(nullable(schema))
    return sorted((tuple(r.values()) for r in table.to_pylist()), key=repr)


# --- schemas -----------------------------------------------------------------------------

def test_keyed_schemas_are_the_spark_schemas_with_not_null_keys():
    """The keyed stages' schemas are the DataFrame stages' Spark schemas as Spark hands them
    to Arrow, with the state keys not null."""
    expected = [
        nullable(to_arrow_schema(EVENT_SCHEMA, timezone="UTC")),
        to_arrow_schema(DEDUPE_STATE_SCHEMA, timezone="UTC"),
        to_arrow_schema(USER_ACTIVITY_STATE_SCHEMA, timezone="UTC"),
        to_arrow_schema(USER_ACTIVITY_STATE_SCHEMA, timezone="UTC"),
        ["dedupe", "user_activity"],
        [("event_id",), ("user_id",)],
        [False, False],
    ]
    actual = [
        nullable(DEDUPE_OUTPUT_SCHEMA),
        nullable(DEDUPE_KEYED_STATE_SCHEMA),
        nullable(USER_ACTIVITY_KEYED_STATE_SCHEMA),
        nullable(USER_ACTIVITY_OUTPUT_SCHEMA),
        [s.name for s in KEYED_STAGES],
        [s.key for s in KEYED_STAGES],
        [s.state_schema.field(s.key[0]).nullable for s in KEYED_STAGES],
    ]
    assert expected == actual
    assert [s.name for s in STAGES] == [s.name for s in KEYED_STAGES]


# --- against the DataFrame stages on Spark, on the example generator's batches ------------

DAYS = ("2026-10-01", "2026-10-02", "2026-10-03", "2026-10-06")
DELIVERY = (
    [("2026-10-01", b) for b in range(3)]
    + [("2026-10-02", b) for b in range(3)]
    + [("2026-10-01", 2)]  # delivered again: duplicates of events in state, or too late
    + [("2026-10-03", b) for b in range(3)]
    + [("2026-10-01", 1)]  # two days behind: too late
    + [("2026-10-06", b) for b in range(3)]  # after a gap: the state so far expires
    + [("2026-10-03", 2)]  # too late again
)


@pytest.fixture(scope="module")
def dataframe_run(spark, tmp_path_factory):
    """The generator's batches in ``DELIVERY`` order through ``dedupe`` then
    ``user_activity`` on Spark: per batch, the input as Spark hands it to Arrow and each
    stage's output and new state as Arrow tables."""
    landing = str(tmp_path_factory.mktemp("landing"))
    for day in DAYS:
        generate_day(landing, day, batches=3, events_per_batch=120, users=20,
                     duplicate_rate=0.2, late_rate=0.25, seed=11)
    source = FileSource(url=f"{landing}/date={{partition}}", schema=EVENT_ARROW_SCHEMA,
                        suffix=".parquet")
    dedupe_state = spark.createDataFrame([], DEDUPE_STATE_SCHEMA)
    activity_state = spark.createDataFrame([], USER_ACTIVITY_STATE_SCHEMA)
    run = []
    for day, index in DELIVERY:
        # Read once: the stages then run on local rows, not on a re-read per action.
        read = source.read(spark, day, f"batch-{index:05d}.parquet")
        events = spark.createDataFrame(read.toArrow(), schema=read.schema)
        new_dedupe_state, fresh = dedupe(events, dedupe_state)
        fresh_rows = fresh.toArrow()
        new_activity_state, totals = user_activity(
            spark.createDataFrame(fresh_rows, schema=EVENT_SCHEMA), activity_state)
        step = {
            "input": events.toArrow(),
            "dedupe_output": fresh_rows,
            "dedupe_state": new_dedupe_state.toArrow(),
            "user_activity_output": totals.toArrow(),
            "user_activity_state": new_activity_state.toArrow(),
        }
        # Each state from its collected rows: no lineage growing batch after batch.
        dedupe_state = spark.createDataFrame(step["dedupe_state"], schema=DEDUPE_STATE_SCHEMA)
        activity_state = spark.createDataFrame(step["user_activity_state"],
                                               schema=USER_ACTIVITY_STATE_SCHEMA)
        run.append(step)
    return run


def keyed_run(dataframe_run, parallelism: int):
    """The same inputs through the keyed stages under ``KeyedDriver``: the per-batch steps
    and the two drivers."""
    dedupe_driver = KeyedDriver(DEDUPE_KEYED, parallelism)
    activity_driver = KeyedDriver(USER_ACTIVITY_KEYED, parallelism)
    run = []
    for step in dataframe_run:
        fresh = dedupe_driver.run(step["input"])
        totals = activity_driver.run(fresh)
        run.append({
            "dedupe_output": fresh,
            "dedupe_state": dedupe_driver.state_table(),
            "user_activity_output": totals,
            "user_activity_state": activity_driver.state_table(),
        })
    return run, dedupe_driver, activity_driver


SCHEMAS = {
    "dedupe_output": DEDUPE_OUTPUT_SCHEMA,
    "dedupe_state": DEDUPE_KEYED_STATE_SCHEMA,
    "user_activity_output": USER_ACTIVITY_OUTPUT_SCHEMA,
    "user_activity_state": USER_ACTIVITY_KEYED_STATE_SCHEMA,
}


@pytest.mark.parametrize("parallelism", [1, 2, 3])
def test_keyed_stages_equal_the_dataframe_stages_batch_by_batch(dataframe_run, parallelism):
    """On the generator's batches (duplicates, late events, a redelivered day, a gap that
    expires the state), the keyed stages' outputs and states equal the DataFrame stages',
    batch by batch, whatever the number of key-group ranges."""
    keyed, _, _ = keyed_run(dataframe_run, parallelism)
    expected = [{name: rows(step[name], schema) for name, schema in SCHEMAS.items()}
                for step in dataframe_run]
    actual = [{name: rows(step[name], schema) for name, schema in SCHEMAS.items()}
              for step in keyed]
    assert expected == actual


def test_the_batches_have_duplicates_late_events_and_expiry(dataframe_run):
    """The comparison above is not vacuous: the batches carry duplicates and events too late,
    state expires, and three ranges split every batch with rows on time."""
    _, dedupe_driver, activity_driver = keyed_run(dataframe_run, 3)
    delivered = sum(s["input"].num_rows for s in dataframe_run)
    passed = sum(s["dedupe_output"].num_rows for s in dataframe_run)
    late_batches = sum(1 for s in dataframe_run
                       if s["input"].num_rows and not s["dedupe_output"].num_rows)
    expected = [True, True, True, True, True]
    actual = [
        delivered - passed > dedupe_driver.late > 0,  # duplicates beyond the late rows
        dedupe_driver.expired > 0,
        late_batches >= 2,
        set(dedupe_driver.ranges_per_batch) == {0, 3},
        max(activity_driver.ranges_per_batch) == 3,
    ]
    assert expected == actual


def test_keyed_outputs_have_the_dataframe_outputs_types(dataframe_run):
    """The keyed stages' output columns have the names and types of the DataFrame stages'
    outputs as Spark hands them to Arrow."""
    step = dataframe_run[0]
    expected = [nullable(step["dedupe_output"].schema),
                nullable(step["user_activity_output"].schema)]
    actual = [nullable(DEDUPE_OUTPUT_SCHEMA), nullable(USER_ACTIVITY_OUTPUT_SCHEMA)]
    assert expected == actual


# --- the pure functions against dict models ----------------------------------------------

IDS = st.sampled_from("abcdefgh")
USERS = st.sampled_from(["u1", "u2", "u3", "u4"])
HOURS = st.integers(0, 120)
AMOUNTS = st.integers(-10_000, 10_000).map(lambda c: Decimal(c).scaleb(-2))


def at(hours: int) -> dt.datetime:
    return T0 + dt.timedelta(hours=hours)


def event_table(events: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(events, schema=DEDUPE_OUTPUT_SCHEMA)


EVENTS = st.lists(
    st.fixed_dictionaries({
        "event_id": IDS,
        "user_id": USERS,
        "event_ts": st.none() | HOURS.map(at),
        "amount": st.none() | AMOUNTS,
    }),
    max_size=20,
)


@settings(deadline=None, max_examples=200)
@given(events=EVENTS, state=st.dictionaries(IDS, HOURS.map(at)))
def test_dedupe_events_passes_the_first_delivery_of_each_id_without_state(events, state):
    """dedupe_events outputs, and stores, each id's first delivery with a timestamp whose id
    has no state; nothing else."""
    seen, passed = set(state), []
    for event in events:
        if event["event_ts"] is not None and event["event_id"] not in seen:
            seen.add(event["event_id"])
            passed.append(event)
    state_table = pa.Table.from_pylist(
        [{"event_id": k, "event_ts": v} for k, v in state.items()],
        schema=DEDUPE_KEYED_STATE_SCHEMA)
    result = DEDUPE_KEYED.run(event_table(events), state_table)
    expected = (rows(event_table(passed), DEDUPE_OUTPUT_SCHEMA),
                sorted((e["event_id"], e["event_ts"]) for e in passed), [])
    actual = (rows(result.output, DEDUPE_OUTPUT_SCHEMA),
              rows(result.upserts, DEDUPE_KEYED_STATE_SCHEMA),
              result.deletes.to_pylist())
    assert expected == actual


def add(a, b):
    """Spark's null-skipping sum of two values."""
    return b if a is None else a if b is None else a + b


def bound(pick, a, b):
    """Spark's null-skipping min/max of two values."""
    return b if a is None else a if b is None else pick(a, b)


ACTIVITY_STATE = st.dictionaries(USERS, st.fixed_dictionaries({
    "event_count": st.integers(1, 1_000),
    "amount_sum": st.none() | AMOUNTS,
    "first_seen": st.none() | HOURS.map(at),
    "last_seen": st.none() | HOURS.map(at),
}))


@settings(deadline=None, max_examples=200)
@given(events=EVENTS, state=ACTIVITY_STATE)
def test_user_activity_totals_outputs_the_batch_and_adds_it_to_the_state(events, state):
    """user_activity_totals outputs each user's count, amount sum, first and last event time
    in the batch (nulls skipped) and upserts them added to the user's state."""
    totals: dict[str, dict] = {}
    for e in events:
        t = totals.setdefault(e["user_id"], {"user_id": e["user_id"], "event_count": 0,
                                             "amount_sum": None, "first_seen": None,
                                             "last_seen": None})
        t["event_count"] += 1
        t["amount_sum"] = add(t["amount_sum"], e["amount"])
        t["first_seen"] = bound(min, t["first_seen"], e["event_ts"])
        t["last_seen"] = bound(max, t["last_seen"], e["event_ts"])
    merged = []
    for user, t in totals.items():
        old = state.get(user, {"event_count": 0, "amount_sum": None, "first_seen": None,
                               "last_seen": None})
        merged.append({
            "user_id": user,
            "event_count": t["event_count"] + old["event_count"],
            "amount_sum": add(t["amount_sum"], old["amount_sum"]),
            "first_seen": bound(min, t["first_seen"], old["first_seen"]),
            "last_seen": bound(max, t["last_seen"], old["last_seen"]),
        })
    state_table = pa.Table.from_pylist([{"user_id": u} | v for u, v in state.items()],
                                       schema=USER_ACTIVITY_KEYED_STATE_SCHEMA)
    result = USER_ACTIVITY_KEYED.run(event_table(events), state_table)
    expected = (
        rows(pa.Table.from_pylist(list(totals.values()), schema=USER_ACTIVITY_OUTPUT_SCHEMA),
             USER_ACTIVITY_OUTPUT_SCHEMA),
        rows(pa.Table.from_pylist(merged, schema=USER_ACTIVITY_KEYED_STATE_SCHEMA),
             USER_ACTIVITY_KEYED_STATE_SCHEMA),
        [],
    )
    actual = (rows(result.output, USER_ACTIVITY_OUTPUT_SCHEMA),
              rows(result.upserts, USER_ACTIVITY_KEYED_STATE_SCHEMA),
              result.deletes.to_pylist())
    assert expected == actual


def dataframe_dedupe_model(batches: list[list[dict]]) -> list[tuple[list, list]]:
    """``dedupe``'s computation in plain Python: per batch, its output and new state."""
    state: dict[str, dt.datetime] = {}
    steps = []
    for batch in batches:
        deduped = list({e["event_id"]: e for e in batch}.values())
        times = list(state.values()) + [e["event_ts"] for e in deduped]
        if not times:
            steps.append((deduped, sorted(state.items())))
            continue
        horizon = max(times) - DEDUPE_RETENTION
        output = [e for e in deduped if e["event_ts"] >= horizon and e["event_id"] not in state]
        state = {k: v for k, v in state.items() if v >= horizon} | {
            e["event_id"]: e["event_ts"] for e in output}
        steps.append((output, sorted(state.items())))
    return steps


@st.composite
def redeliveries(draw):
    """Batches of deliveries of a fixed set of events: a duplicate is the same event again
    (as the generator's are), its time anywhere within five days, so some arrive too late."""
    pool = draw(st.lists(st.tuples(USERS, HOURS, AMOUNTS), min_size=1, max_size=12))
    events = [{"event_id": f"e{i}", "user_id": u, "event_ts": at(h), "amount": a}
              for i, (u, h, a) in enumerate(pool)]
    indices = st.lists(st.integers(0, len(events) - 1), max_size=10)
    return [[events[i] for i in batch] for batch in draw(st.lists(indices, max_size=6))]


@settings(deadline=None, max_examples=150)
@given(batches=redeliveries(), parallelism=st.integers(1, 3))
def test_keyed_dedupe_under_the_runner_equals_the_dataframe_dedupe(batches, parallelism):
    """With duplicates being redeliveries, the keyed dedupe under the runner's semantics
    (clock, late rows dropped, expiry, any number of ranges) outputs and keeps what
    ``dedupe`` does, batch by batch."""
    driver = KeyedDriver(DEDUPE_KEYED, parallelism)
    expected = [(rows(event_table(out), DEDUPE_OUTPUT_SCHEMA), state)
                for out, state in dataframe_dedupe_model(batches)]
    actual = []
    for batch in batches:
        output = driver.run(event_table(batch))
        state = sorted((r["event_id"], r["event_ts"]) for r in driver.state_table().to_pylist())
        actual.append((rows(output, DEDUPE_OUTPUT_SCHEMA), state))
    assert expected == actual


@pytest.mark.parametrize("stage", KEYED_STAGES, ids=lambda s: s.name)
def test_keyed_layer_refuses_null_keys(stage):
    """A null event id or user id is refused by the keyed layer."""
    events = event_table([{"event_id": None, "user_id": None, "event_ts": at(0),
                           "amount": Decimal("1.00")}])
    with pytest.raises(ValueError, match="must not be null"):
        KeyedStateLayout.of(stage, MAX_PARALLELISM).key_groups_of(events)


def test_the_source_refuses_nulls_before_either_stage(spark, tmp_path):
    """The pipeline's source refuses a null in any column (its schema is not null), so no
    null key or time reaches the stages, keyed or not."""
    (tmp_path / "date=2026-10-01").mkdir()
    pq.write_table(event_table([{"event_id": None, "user_id": "u1", "event_ts": at(0),
                                 "amount": Decimal("1.00")}]),
                   tmp_path / "date=2026-10-01" / "batch-00000.parquet")
    source = FileSource(url=f"{tmp_path}/date={{partition}}", schema=EVENT_ARROW_SCHEMA)
    with pytest.raises((PySparkException, Py4JJavaError), match="non-nullable"):
        source.read(spark, "2026-10-01", "batch-00000.parquet").collect()
