"""State variables of a keyed stage (``KeyedStage.with_variables``): value, list and map state
with per-variable TTL compile into one physical row per key and back (pure Arrow, against a
dict model), run through the Spark runner with checkpoints, restores and rescaling, and read
back per variable by ``read_state``, the Spark source and ``checkpoints read``."""

import datetime as dt
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark import cloudpickle

from checkpoint_storage import FileSystemCheckpointStorage, JobID
from pipelines import (
    ParquetSink,
    Source,
    StatefulPipeline,
    StatefulRunner,
    StateTtl,
    read_state,
    register_checkpoint_source,
)
from pipelines.keyed import (
    KeyedStage,
    KeyedStageTask,
    KeyedStateChain,
    ListState,
    MapState,
    StateChanges,
    TimeMode,
    TtlTimeCharacteristic,
    ValueState,
    compute_key_group_range_for_operator_index,
    extend_chains,
)
from pipelines.keyed._batch import _results, _summary
from pipelines.keyed._executor import _decode_output, _run_partition
from pipelines.keyed._routing import _ROUTE, _operator_indices, _routes
from pipelines.keyed._task import _RESULT_SCHEMA, _newer
from pipelines.state_reader import open_snapshot
from tests.pipelines.support import PARTITIONS, SOURCE, run_read_cli, storage_of

cloudpickle.register_pickle_by_value(sys.modules[__name__])

USER = pa.schema([pa.field("user", pa.string(), nullable=False)])
UTC = pa.timestamp("us", "UTC")
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
LIST_TTL, MAP_TTL = dt.timedelta(minutes=10), dt.timedelta(minutes=30)
VARIABLES = [
    ValueState("profile", pa.schema([("score", pa.int64())])),
    ListState("events", pa.schema([("n", pa.int64()), ("at", UTC)]),
              ttl=StateTtl(LIST_TTL, timestamp_column="at")),
    MapState("pages", pa.schema([("page", pa.string())]),
             pa.schema([("hits", pa.int64()), ("seen", UTC)]),
             ttl=StateTtl(MAP_TTL, timestamp_column="seen")),
]
OUTPUT = pa.schema([("user", pa.string())])


def stage_of(apply, variables=VARIABLES, **options) -> KeyedStage:
    return KeyedStage.with_variables("vars", USER, variables, apply, output_schema=OUTPUT,
                                     event_time="ts", **options)


# --- the dict model ------------------------------------------------------------------------

def new_user() -> dict:
    return {"profile": None, "events": [], "pages": {}}


def live(model: dict, now: dt.datetime) -> dict:
    """Per user, what has not expired at ``now``; users with nothing live left out."""
    result = {}
    for user, state in model.items():
        events = [e for e in state["events"] if e[1] >= now - LIST_TTL]
        pages = {p: v for p, v in state["pages"].items() if v[1] >= now - MAP_TTL}
        if state["profile"] is not None or events or pages:
            result[user] = {"profile": state["profile"], "events": events, "pages": pages}
    return result


def view_as_model(view, users) -> dict:
    result = {u: new_user() for u in users}
    for row in view.value("profile").to_pylist():
        result[row["user"]]["profile"] = row["score"]
    for row in view.list("events").to_pylist():
        result[row["user"]]["events"].append((row["n"], row["at"]))
    pages = view.map("pages").to_pylist()
    for row in pages:
        result[row["user"]]["pages"][row["page"]] = (row["hits"], row["seen"])
    by_user = defaultdict(list)
    for row in pages:
        by_user[row["user"]].append(row["page"])
    assert all(v == sorted(v) for v in by_user.values()), "map entries not sorted by user key"
    return {u: s for u, s in result.items() if s != new_user()}


class Tables:
    """Table builders for a step's changes."""

    @staticmethod
    def keys(users) -> pa.Table:
        return pa.table({"user": pa.array(sorted(users), pa.string())})

    @staticmethod
    def rows(columns: dict, types: dict) -> pa.Table:
        return pa.table({n: pa.array(v, types[n]) for n, v in columns.items()})


TYPES = {"user": pa.string(), "score": pa.int64(), "n": pa.int64(), "at": UTC,
         "page": pa.string(), "hits": pa.int64(), "seen": UTC}


def changes_of(plan: dict, output: pa.Table) -> StateChanges:
    def table(items, names):
        return Tables.rows({n: [i[k] for i in items] for k, n in enumerate(names)}, TYPES)

    return StateChanges(
        output=output,
        values={"profile": table([(u, s) for u, s in plan["values"].items()],
                                 ["user", "score"])},
        cleared_values={"profile": Tables.keys(plan["cleared_values"])},
        appends={"events": table(plan["appends"], ["user", "n", "at"])},
        replaced_lists={"events": table([(u, *e) for u, es in plan["replaced"].items()
                                         for e in es], ["user", "n", "at"])},
        cleared_lists={"events": Tables.keys(plan["cleared_lists"])},
        map_puts={"pages": table([(u, p, *v) for (u, p), v in plan["puts"].items()],
                                 ["user", "page", "hits", "seen"])},
        map_removes={"pages": table(list(plan["removes"]), ["user", "page"])},
        cleared_maps={"pages": Tables.keys(plan["cleared_maps"])},
        delete_keys=Tables.keys(plan["deletes"]),
    )


def apply_to_model(model: dict, plan: dict) -> None:
    """The documented order: deletes and clears, then replacements, then appends and puts
    (removes before puts)."""
    for user in plan["users"]:
        model.setdefault(user, new_user())
    for user in plan["deletes"]:
        model[user] = new_user()
    for user in plan["cleared_values"]:
        model[user]["profile"] = None
    for user, score in plan["values"].items():
        model[user]["profile"] = score
    for user in plan["cleared_lists"]:
        model[user]["events"] = []
    for user, events in plan["replaced"].items():
        model[user]["events"] = list(events)
    for user, n, at in plan["appends"]:
        model[user]["events"].append((n, at))
    for user in plan["cleared_maps"]:
        model[user]["pages"] = {}
    for user, page in plan["removes"]:
        model[user]["pages"].pop(page, None)
    for (user, page), value in plan["puts"].items():
        model[user]["pages"][page] = value


class Read:
    """What readers show of each variable (``StateVariables.read``), as a view."""

    def __init__(self, stage: KeyedStage, physical: pa.Table, now: dt.datetime) -> None:
        self.read = lambda name: stage.apply.variables.read(physical, name, now)

    def value(self, name):
        return self.read(name)

    list = map = value


OPS = st.tuples(
    st.sampled_from(["value", "clear_value", "append", "replace", "clear_list", "put",
                     "remove", "clear_map", "delete"]),
    st.sampled_from("abcd"), st.integers(0, 99), st.integers(0, 40),
    st.sampled_from("pqr"))
STEPS = st.lists(st.tuples(st.integers(0, 15), st.lists(OPS, min_size=1, max_size=8)),
                 min_size=1, max_size=8)


def plan_of(ops, now: dt.datetime) -> dict:
    plan = {"users": set(), "deletes": set(), "cleared_values": set(), "values": {},
            "cleared_lists": set(), "replaced": {}, "appends": [], "cleared_maps": set(),
            "removes": set(), "puts": {}}
    for kind, user, number, age, page in ops:
        at = now - dt.timedelta(minutes=age)
        plan["users"].add(user)
        if kind == "value":
            plan["values"][user] = number
        elif kind == "clear_value":
            plan["cleared_values"].add(user)
        elif kind == "append":
            plan["appends"].append((user, number, at))
        elif kind == "replace":
            plan["replaced"].setdefault(user, []).append((number, at))
        elif kind == "clear_list":
            plan["cleared_lists"].add(user)
        elif kind == "put":
            plan["puts"][(user, page)] = (number, at)
        elif kind == "remove":
            plan["removes"].add((user, page))
        elif kind == "clear_map":
            plan["cleared_maps"].add(user)
        else:
            plan["deletes"].add(user)
    return plan


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(STEPS)
def test_random_changes_with_per_variable_ttl_equal_a_dict_model(steps):
    """Random value updates and clears, list appends, replacements and clears, map puts,
    removes and clears and key deletes, with per-variable event-time TTL and a clock that
    moves on: the stage's view each batch is the model's live state, the physical rows hold
    it, only touched keys are written, keys left empty are deleted, and the row-level expiry
    never hides a live entry."""
    model, physical, now = {}, {}, T0
    seen = {}

    def apply(input, state):
        users = set(input.column("user").to_pylist())
        expected = {u: s for u, s in live(model, now).items() if u in users}
        assert expected == view_as_model(state, users)
        seen["called"] = True
        return changes_of(seen["plan"], input.select(["user"]))

    stage = stage_of(apply)
    assert stage.ttl == StateTtl(MAP_TTL, TtlTimeCharacteristic.EVENT_TIME,
                                 "variables_ttl_time")
    for minutes, ops in steps:
        now += dt.timedelta(minutes=minutes)
        plan = seen["plan"] = plan_of(ops, now)
        users = sorted(plan["users"])
        input = pa.table({"user": pa.array(users, pa.string()),
                          "ts": pa.array([now] * len(users), UTC)})
        rows = [physical[u] for u in users if u in physical]
        state = pa.Table.from_pylist(rows, stage.state_schema)
        state = stage.ttl.live(state, stage.ttl.cutoff(now))  # as the store hands it
        result = stage.run(input, state, now=now)
        apply_to_model(model, plan)
        expected = live(model, now)
        upserted = {r["user"]: r for r in result.upserts.to_pylist()}
        deleted = set(result.deletes.column("user").to_pylist())
        assert set(upserted) == {u for u in users if u in expected}
        handed = set(state.column("user").to_pylist())
        assert deleted == {u for u in users if u not in expected and u in handed}
        physical.update(upserted)
        for user in deleted | (set(users) - set(upserted) - handed):
            physical.pop(user, None)  # deleted, or expired as a row (the store drops it)
        table = pa.Table.from_pylist(list(physical.values()), stage.state_schema)
        unexpired = stage.ttl.live(table, stage.ttl.cutoff(now))
        assert set(expected) <= set(unexpired.column("user").to_pylist())
        assert expected == view_as_model(Read(stage, table, now), set(physical))


def test_a_row_expires_when_all_its_variables_have():
    """The row's expiry column is its latest entry's expiry on the longest TTL's scale: the
    row outlives a 10-minute list element by exactly that, a value without TTL never lets it
    expire."""
    values = iter([{}, {"profile": pa.table({"user": ["a"], "score": [1]})}])

    def apply(input, state):
        return StateChanges(output=input.select(["user"]), values=next(values),
                            appends={"events": pa.table({
                                "user": ["a"], "n": [1], "at": pa.array([T0], UTC)})})

    stage = stage_of(apply)
    input = pa.table({"user": ["a"], "ts": pa.array([T0], UTC)})
    upserts = stage.run(input, stage.empty_state(), now=T0).upserts
    cutoff = stage.ttl.cutoff
    assert 1 == stage.ttl.live(upserts, cutoff(T0 + LIST_TTL)).num_rows
    assert 0 == stage.ttl.live(upserts, cutoff(T0 + LIST_TTL + dt.timedelta(seconds=1))).num_rows
    with_value = stage.run(input, upserts, now=T0).upserts
    assert 1 == stage.ttl.live(with_value, cutoff(T0 + dt.timedelta(days=9))).num_rows


def test_processing_time_ttl_stamps_each_entry_when_it_is_written():
    """Under processing-time TTL each element carries a hidden write time: an element
    appended at 00:00 is gone at 00:11, one appended at 00:05 is still there; the stage never
    sees the hidden field."""
    ttl = StateTtl(LIST_TTL, TtlTimeCharacteristic.PROCESSING_TIME)
    batches = iter([[1], [2], []])
    views = []

    def apply(input, state):
        views.append(state.list("ns").to_pylist())
        return StateChanges(output=input, appends={"ns": pa.table({
            "user": pa.array(["a"] * len(n := next(batches)), pa.string()),
            "n": pa.array(n, pa.int64())})})

    stage = KeyedStage.with_variables("pt", USER, [ListState("ns", pa.schema([("n", pa.int64())]),
                                                             ttl=ttl)], apply,
                                      output_schema=OUTPUT)
    state = stage.empty_state()
    for minutes in (0, 5, 11):
        result = stage.run(pa.table({"user": ["a"]}), state,
                           now=T0 + dt.timedelta(minutes=minutes))
        state = result.upserts
    assert [[], [{"user": "a", "n": 1}], [{"user": "a", "n": 2}]] == views
    assert stage.ttl == StateTtl(LIST_TTL, TtlTimeCharacteristic.PROCESSING_TIME)


def test_an_append_rewrites_only_the_keys_appended_to():
    """1 of 100 keys appends: one physical row is upserted (with its whole list), the others
    are not written."""
    def apply(input, state):
        return StateChanges(output=input, appends={"events": pa.table({
            "user": ["k7"], "n": [1], "at": pa.array([T0], UTC)})})

    stage = stage_of(apply)
    keys = pa.table({"user": [f"k{i}" for i in range(100)],
                     "ts": pa.array([T0] * 100, UTC)})
    result = stage.run(keys, stage.empty_state(), now=T0)
    assert ["k7"] == result.upserts.column("user").to_pylist()
    assert 0 == result.deletes.num_rows


@pytest.mark.parametrize(("variables", "message"), [
    ([ValueState("user", pa.schema([("x", pa.int64())]))], "collide with the key columns"),
    ([ValueState("v", pa.schema([("user", pa.int64())]))], "named as key columns"),
    ([ValueState("v", pa.schema([("x", pa.int64())])),
      ListState("v", pa.schema([("x", pa.int64())]))], "declared twice"),
    ([ValueState("v", pa.schema([("x", pa.int64())]),
                 ttl=StateTtl(LIST_TTL, TtlTimeCharacteristic.PROCESSING_TIME)),
      ListState("l", pa.schema([("at", UTC)]), ttl=StateTtl(LIST_TTL, timestamp_column="at"))],
     "mix event time and processing time"),
    ([ValueState("v", pa.schema([("x", pa.int64())]),
                 ttl=StateTtl(LIST_TTL, TtlTimeCharacteristic.PROCESSING_TIME)),
      ListState("l", pa.schema([("x", pa.int64())]))], "every variable needs a ttl"),
])
def test_declarations_that_cannot_compile_are_refused(variables, message):
    with pytest.raises(ValueError, match=message):
        stage_of(lambda i, s: None, variables=variables)


def test_bad_variables_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"\['_x'\] start with '_'"):
        ValueState("v", pa.schema([("_x", pa.int64())]))
    with pytest.raises(ValueError, match="not a field of the variable"):
        ListState("l", pa.schema([("n", pa.int64())]), ttl=StateTtl(LIST_TTL,
                                                                    timestamp_column="at"))
    with pytest.raises(ValueError, match="a variable's name is a column name"):
        ValueState("no good", pa.schema([("x", pa.int64())]))
    with pytest.raises(ValueError, match="user keys must be"):
        MapState("m", pa.schema([("k", pa.float64())]), pa.schema([("x", pa.int64())]))


@pytest.mark.parametrize(("function", "message"), [
    (lambda i, s: s.value("nope"), "no state variable 'nope'; the variables are: profile"),
    (lambda i, s: s.list("profile"), r"'profile' is a value variable; read it with "
                                     r"state.value\('profile'\)"),
    (lambda i, s: StateChanges(output=i, appends={"nope": i}),
     r"appends\['nope'\]: the stage declares no variable 'nope'"),
    (lambda i, s: StateChanges(output=i, appends={"profile": i}),
     r"'profile' is a value variable; StateChanges.appends is for list variables"),
    (lambda i, s: StateChanges(output=i, values={"profile": i.select(["user"])}),
     r"values\['profile'\]: missing column\(s\) \['score'\]"),
    (lambda i, s: StateChanges(output=i, values={"profile": pa.table({
        "user": ["a"], "score": ["not a number"]})}), "does not fit the schema"),
    (lambda i, s: StateChanges(output=i, values={"profile": pa.table({
        "user": pa.array([1], pa.int64()), "score": [1]})}), "key column 'user' has type int64"),
    (lambda i, s: i, "returned Table, expected a StateChanges"),
    (lambda i, s: StateChanges(output=i, timers=pa.table({
        "user": ["a"], "timer": pa.array([T0], UTC)})), "returned timers but the stage has no "
                                                        "time_mode"),
])
def test_bad_changes_are_refused_naming_the_variable(function, message):
    stage = stage_of(function)
    input = pa.table({"user": ["a"], "ts": pa.array([T0], UTC)})
    with pytest.raises((ValueError, TypeError), match=message):
        stage.run(input, stage.empty_state(), now=T0)


# --- through the runner --------------------------------------------------------------------

ORDERS_USER = pa.schema([pa.field("customer", pa.string(), nullable=False)])
TOTALS = pa.schema([("orders", pa.int64()), ("total", pa.int64())])
ORDERS_OUTPUT = pa.schema([("customer", pa.string()), ("orders", pa.int64()),
                           ("total", pa.int64())])


def orders_step(input: pa.Table, state) -> StateChanges:
    batch = input.group_by("customer").aggregate([([], "count_all"), ("amount", "sum")])
    joined = batch.join(state.value("totals"), "customer", join_type="left outer")
    totals = pa.table({
        "customer": joined.column("customer"),
        "orders": pc.add(joined.column("count_all"), pc.fill_null(joined.column("orders"), 0)),
        "total": pc.add(joined.column("amount_sum"), pc.fill_null(joined.column("total"), 0))})
    bucketed = input.append_column("bucket", pc.divide(input.column("amount"), 25))
    counts = bucketed.group_by(["customer", "bucket"]).aggregate([([], "count_all")])
    counts = counts.join(state.map("buckets"), ["customer", "bucket"], join_type="left outer")
    puts = pa.table({"customer": counts.column("customer"), "bucket": counts.column("bucket"),
                     "orders": pc.add(counts.column("count_all"),
                                      pc.fill_null(counts.column("orders"), 0))})
    return StateChanges(output=totals, values={"totals": totals},
                        appends={"amounts": input.select(["customer", "amount"])},
                        map_puts={"buckets": puts})


def orders_pipeline(parallelism: int) -> StatefulPipeline:
    stage = KeyedStage.with_variables("orders", ORDERS_USER, [
        ValueState("totals", TOTALS),
        ListState("amounts", pa.schema([("amount", pa.int64())])),
        MapState("buckets", pa.schema([("bucket", pa.int64())]),
                 pa.schema([("orders", pa.int64())])),
    ], orders_step, output_schema=ORDERS_OUTPUT)
    return StatefulPipeline(name="order_variables", stages=[stage], source=SOURCE,
                            partitions=PARTITIONS, checkpoint_interval=2, max_parallelism=8,
                            keyed_parallelism=parallelism)


def orders_model(partitions) -> dict:
    model = defaultdict(lambda: {"totals": [0, 0], "amounts": [], "buckets": Counter()})
    for partition in partitions:
        for batch in SOURCE.batches(None, partition):
            for customer, amount in SOURCE.rows(batch):
                state = model[customer]
                state["totals"][0] += 1
                state["totals"][1] += amount
                state["amounts"].append(amount)
                state["buckets"][amount // 25] += 1
    return model


def read_model(pointer: str) -> dict:
    model = defaultdict(lambda: {"totals": [0, 0], "amounts": [], "buckets": Counter()})
    for row in read_state(pointer, "orders", variable="totals").to_pylist():
        model[row["customer"]]["totals"] = [row["orders"], row["total"]]
    for row in read_state(pointer, "orders", variable="amounts").to_pylist():
        model[row["customer"]]["amounts"].append(row["amount"])
    for row in read_state(pointer, "orders", variable="buckets").to_pylist():
        model[row["customer"]]["buckets"][row["bucket"]] = row["orders"]
    return model


def comparable(model: dict) -> dict:
    # Within a batch, the rows of a key reach its range in no guaranteed order.
    return {c: (s["totals"], sorted(s["amounts"]), dict(s["buckets"]))
            for c, s in model.items()}


@pytest.mark.timeout(300)
def test_a_stage_of_three_variables_runs_restores_and_rescales(spark, tmp_path: Path):
    """A value, a list and a map per customer: p1 on 2 ranges, then a new runner restores
    its checkpoint and runs p2 on 3 ranges; after each, every variable read back from the
    checkpoint (``read_state``, the Spark source, ``checkpoints read --variable``) equals the
    dict model; the physical rows are one per key."""
    done = []
    for partition, parallelism in (("p1", 2), ("p2", 3)):
        runner = StatefulRunner(spark, storage_of(tmp_path), orders_pipeline(parallelism),
                                keyed_local_dir=str(tmp_path / "local"))
        runner.run([partition])
        done.append(partition)
        pointer = runner.store.latest().external_pointer
        assert comparable(orders_model(done)) == comparable(read_model(pointer))
    snapshot = open_snapshot(pointer)
    assert ["totals", "amounts", "buckets"] == snapshot.variables("orders")
    physical = snapshot.read("orders")
    assert len(orders_model(done)) == physical.num_rows == len(
        set(physical.column("customer").to_pylist()))

    register_checkpoint_source(spark)
    frame = (spark.read.format("checkpoint").option("stage", "orders")
             .option("variable", "buckets").load(pointer))
    assert ["customer", "bucket", "orders"] == frame.columns
    assert sorted((c, b, n) for c, s in orders_model(done).items()
                  for b, n in s["buckets"].items()) == sorted(tuple(r) for r in frame.collect())

    result = run_read_cli(pointer, "--stage", "orders", "--variable", "totals", "--json")
    assert 0 == result.exit_code, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert {c: s["totals"] for c, s in orders_model(done).items()} == {
        r["customer"]: [r["orders"], r["total"]] for r in lines}
    unknown = run_read_cli(pointer, "--stage", "orders", "--variable", "nope")
    assert 2 == unknown.exit_code
    assert "no state variable 'nope'; the variables are: totals, amounts, buckets" in (
        unknown.output)


# --- with timers ---------------------------------------------------------------------------

TIMED = pa.schema([("k", pa.int64()), ("timer", UTC), ("n", pa.int64())])


class Job:
    """One keyed stage's storage, chains and clock; ``run`` applies a batch as the runner's
    Spark job does (routing, one ``_run_partition`` per range) in this process."""

    def __init__(self, root: Path, stage: KeyedStage, parallelism: int) -> None:
        self.root, self.stage, self.parallelism = root, stage, parallelism
        self.storage = FileSystemCheckpointStorage(str(root / "checkpoints"),
                                                   file_state_size_threshold=0)
        self.job_id = JobID.generate()
        self.access = self.storage.create_checkpoint_storage(self.job_id)
        self.access.initialize_base_locations()
        self.chains = [KeyedStateChain(compute_key_group_range_for_operator_index(
            8, parallelism, i), None) for i in range(parallelism)]
        self.clock, self.checkpoint_id = None, 0

    def run(self, rows: pa.Table) -> tuple[list[dict], int]:
        """Apply one batch; its output rows and fired timers."""
        self.checkpoint_id += 1
        location = self.access.initialize_location_for_checkpoint(self.checkpoint_id)
        task = KeyedStageTask(self.storage, str(self.job_id), self.checkpoint_id,
                              location.location_reference, self.stage,
                              self.stage.output_schema, 8, self.parallelism,
                              tuple(self.chains), self.checkpoint_id, clock=self.clock,
                              local_dir=str(self.root / "local"))
        routes = _routes(task.parallelism)
        routed = pa.Table.from_batches(list(_operator_indices(
            task, routes, rows.schema, iter(rows.to_batches()))))
        results = []
        for route in routes:
            mine = routed.filter(pc.equal(routed.column(_ROUTE), route))
            results += pa.Table.from_batches(list(_run_partition(
                task, iter(mine.to_batches()))), _RESULT_SCHEMA).to_pylist()
        _, newest, _ = _summary(task, results)
        ranges = _results(task, [Spark(r) for r in results if r["row_kind"] != "output"])
        payloads = pa.Table.from_pylist([r for r in results if r["row_kind"] == "output"],
                                        _RESULT_SCHEMA)
        output = pa.Table.from_batches(list(_decode_output(TIMED, iter(
            payloads.to_batches()))), TIMED).to_pylist()
        self.chains = extend_chains(self.chains, ranges)
        self.clock = _newer(self.clock, newest)
        return output, sum(r.fired_timers for r in ranges)


class Spark(dict):
    def asDict(self) -> dict:  # noqa: N802 - as Spark's Row
        return dict(self)


def t(minutes: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


def keyed_rows(rows: list[tuple[int, float]]) -> pa.Table:
    return pa.table({"k": pa.array([k for k, _ in rows], pa.int64()),
                     "ts": pa.array([t(m) for _, m in rows], UTC)})

def test_variables_and_timers_compose(tmp_path: Path):
    """A stage of a value and a list with an event-time timer 30 minutes after each row, run
    by the executor's own functions (no Spark): timers registered in ``StateChanges`` fire
    once the clock passes them; ``on_timer`` sees the variables, emits the count per fired
    timer and clears the list; the list is empty, the count kept, in the next batch."""
    seen = []

    def apply(input, state):
        seen.append({r["k"]: r["n"] for r in state.value("count").to_pylist()})
        seen.append(sorted((r["k"], r["ts"]) for r in state.list("times").to_pylist()))
        counts = input.group_by("k").aggregate([([], "count_all")]).join(
            state.value("count"), "k", join_type="left outer")
        counts = pa.table({"k": counts.column("k"), "n": pc.add(
            counts.column("count_all"), pc.fill_null(counts.column("n"), 0))})
        timers = pa.table({"k": input.column("k"), "timer": pc.add(
            input.column("ts"), pa.scalar(dt.timedelta(minutes=30)))})
        return StateChanges(output=TIMED.empty_table(), values={"count": counts},
                            appends={"times": input.select(["k", "ts"])}, timers=timers)

    def on_timer(fired, state):
        emitted = fired.join(state.value("count"), "k", join_type="left outer")
        return StateChanges(output=emitted.select(["k", "timer", "n"]),
                            cleared_lists={"times": fired.select(["k"]).group_by("k")
                                           .aggregate([])})

    stage = KeyedStage.with_variables(
        "timed", pa.schema([pa.field("k", pa.int64(), nullable=False)]),
        [ValueState("count", pa.schema([("n", pa.int64())])),
         ListState("times", pa.schema([("ts", UTC)]))],
        apply, output_schema=TIMED, event_time="ts",
        time_mode=TimeMode.EVENT_TIME, on_timer=on_timer)
    job = Job(tmp_path, stage, 2)

    assert ([], 0) == job.run(keyed_rows([(1, 0), (2, 5)]))
    output, fired = job.run(keyed_rows([(3, 40)]))
    assert 2 == fired
    assert [(1, t(30), 1), (2, t(35), 1)] == sorted(
        (r["k"], r["timer"], r["n"]) for r in output)
    job.run(keyed_rows([(1, 41)]))
    assert [{1: 1}, []] == seen[-2:]  # the count kept, the list cleared by on_timer


# --- with timers, on Spark -----------------------------------------------------------------

TIMED_EVENTS = {  # per partition, per batch: (key, minutes)
    "p1": [[(1, 0), (2, 5)], [(3, 40)]],
    "p2": [[(1, 41)], [(4, 100)]],
}


class TimedKeys(Source):
    """``TIMED_EVENTS`` as DataFrames: the same batch always has the same rows."""

    def batches(self, spark, partition):
        return [f"{partition}-{i}" for i in range(len(TIMED_EVENTS[partition]))]

    def read(self, spark, partition, batch):
        part, index = batch.rsplit("-", 1)
        return spark.createDataFrame(keyed_rows(TIMED_EVENTS[part][int(index)]).to_pandas(),
                                     "k long, ts timestamp")


def count_and_remember(input, state) -> StateChanges:
    """Counts each key's rows (a value), appends their times (a list) and registers a timer
    30 minutes after each row."""
    counts = input.group_by("k").aggregate([([], "count_all")]).join(
        state.value("count"), "k", join_type="left outer")
    counts = pa.table({"k": counts.column("k"), "n": pc.add(
        counts.column("count_all"), pc.fill_null(counts.column("n"), 0))})
    timers = pa.table({"k": input.column("k"), "timer": pc.add(
        input.column("ts"), pa.scalar(dt.timedelta(minutes=30)))})
    return StateChanges(output=TIMED.empty_table(), values={"count": counts},
                        appends={"times": input.select(["k", "ts"])}, timers=timers)


def emit_count_and_clear(fired, state) -> StateChanges:
    emitted = fired.join(state.value("count"), "k", join_type="left outer")
    return StateChanges(output=emitted.select(["k", "timer", "n"]),
                        cleared_lists={"times": fired.select(["k"]).group_by("k").aggregate([])})


def timed_variables_pipeline(tmp_path: Path, parallelism: int) -> StatefulPipeline:
    stage = KeyedStage.with_variables(
        "timed", pa.schema([pa.field("k", pa.int64(), nullable=False)]),
        [ValueState("count", pa.schema([("n", pa.int64())])),
         ListState("times", pa.schema([("ts", UTC)]))],
        count_and_remember, output_schema=TIMED, event_time="ts",
        time_mode=TimeMode.EVENT_TIME, on_timer=emit_count_and_clear)
    return StatefulPipeline(
        name="timed_variables", stages=[stage], source=TimedKeys(),
        partitions=dg.StaticPartitionsDefinition(["p1", "p2"]), checkpoint_interval=1,
        max_parallelism=8, keyed_parallelism=parallelism,
        sinks=[ParquetSink(name="fired", stage="timed", of="output",
                           url=str(tmp_path / "fired"))])


@pytest.mark.timeout(600)
def test_variables_with_an_event_time_timer_run_and_restore_on_spark(spark, tmp_path: Path):
    """Through the runner: p1 on 2 ranges, then a new runner restores its checkpoint and runs
    p2 on 3 ranges. A timer fires once the clock (the newest event time) reaches it, emits the
    key's count and clears its list: the sink, the variables and the pending timers read back
    equal a model worked out by hand (each fired timer once, none early)."""
    for partition, parallelism in (("p1", 2), ("p2", 3)):
        runner = StatefulRunner(spark, storage_of(tmp_path),
                                timed_variables_pipeline(tmp_path, parallelism),
                                keyed_local_dir=str(tmp_path / "local"))
        runner.run([partition])
    pointer = runner.store.latest().external_pointer
    fired = pa.concat_tables([pq.read_table(path) for path in sorted(
        (tmp_path / "fired").rglob("*.parquet"))])
    physical = read_state(pointer, "timed")

    assert (
        # p1: the clock reaches 40, k1's (30) and k2's (35) fire; p2: 100, k3's and k1's
        [(1, t(30), 1), (1, t(71), 2), (2, t(35), 1), (3, t(70), 1)],
        {1: 2, 2: 1, 3: 1, 4: 1},
        [(4, t(100))],  # the other keys' lists cleared by their timers
        {4: [t(130)]},  # pending
    ) == (
        sorted((r["k"], r["timer"], r["n"]) for r in fired.to_pylist()),
        {r["k"]: r["n"] for r in read_state(pointer, "timed", variable="count").to_pylist()},
        sorted((r["k"], r["ts"]) for r in read_state(
            pointer, "timed", variable="times").to_pylist()),
        {k: v for k, v in zip(physical.column("k").to_pylist(),
                              physical.column("_timers").to_pylist(), strict=True) if v},
    )


SEEN = pa.schema([("k", pa.int64()), ("recent", pa.int64()), ("kept", pa.int64())])


def count_what_is_left(input, state) -> StateChanges:
    """Emits, per key in the batch, how many entries of each list it sees, then appends."""
    keys = input.group_by("k").aggregate([])
    for name in ("recent", "kept"):
        left = state.list(name).group_by("k").aggregate([([], "count_all")])
        keys = keys.join(left, "k", join_type="left outer").rename_columns(
            [*keys.column_names, name])
    output = pa.table({"k": keys.column("k"),
                       **{n: pc.fill_null(keys.column(n), 0) for n in ("recent", "kept")}})
    rows = input.select(["k", "ts"])
    return StateChanges(output=output.cast(SEEN), appends={"recent": rows, "kept": rows})


def ttl_variables_pipeline(tmp_path: Path) -> StatefulPipeline:
    def written(ttl: dt.timedelta) -> StateTtl:
        return StateTtl(ttl, TtlTimeCharacteristic.PROCESSING_TIME)

    stage = KeyedStage.with_variables(
        "ttl", pa.schema([pa.field("k", pa.int64(), nullable=False)]),
        [ListState("recent", pa.schema([("ts", UTC)]),
                   ttl=written(dt.timedelta(microseconds=1))),
         ListState("kept", pa.schema([("ts", UTC)]), ttl=written(dt.timedelta(days=1)))],
        count_what_is_left, output_schema=SEEN)
    return StatefulPipeline(
        name="ttl_variables", stages=[stage], source=TimedKeys(),
        partitions=dg.StaticPartitionsDefinition(["p1", "p2"]), checkpoint_interval=1,
        max_parallelism=8, keyed_parallelism=2,
        sinks=[ParquetSink(name="seen", stage="ttl", of="output", url=str(tmp_path / "seen"))])


@pytest.mark.timeout(600)
def test_processing_time_ttl_variables_expire_by_the_write_time_on_spark(spark, tmp_path):
    """Through the runner, p1 then (a new runner, restored) p2: a list whose entries live
    1 us is empty in every later batch (each batch is a Spark job, far longer than that),
    one whose entries live a day holds every earlier row; read back, the expired list is
    empty and the other holds all rows (the write times survive the restore)."""
    for partition in ("p1", "p2"):
        runner = StatefulRunner(spark, storage_of(tmp_path), ttl_variables_pipeline(tmp_path),
                                keyed_local_dir=str(tmp_path / "local"))
        runner.run([partition])
    pointer = runner.store.latest().external_pointer
    seen = pa.concat_tables([pq.read_table(path) for path in sorted(
        (tmp_path / "seen").rglob("*.parquet"))])

    assert (
        [(1, 0, 0), (1, 0, 1), (2, 0, 0), (3, 0, 0), (4, 0, 0)],
        [],
        [(1, t(0)), (1, t(41)), (2, t(5)), (3, t(40)), (4, t(100))],
    ) == (
        sorted((r["k"], r["recent"], r["kept"]) for r in seen.to_pylist()),
        read_state(pointer, "ttl", variable="recent").to_pylist(),
        sorted((r["k"], r["ts"]) for r in read_state(
            pointer, "ttl", variable="kept").to_pylist()),
    )
