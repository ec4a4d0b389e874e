"""Local keyed-state stores damaged between and during runs (issue 24): a keyed stage runs one
partition of two batches per round on real Spark (``local[2]``), each round by a new runner
over the same executor-local store directories; before each round (``during=False``) or
between the round's two batches, in the same Python workers that verified the store already
(``during=True``), one range's store is damaged at random (a bit flipped at a random offset of
a random store file, a file truncated or deleted, or the directory replaced by a stale copy of
an earlier round's). Every checkpoint's state must equal a recomputation: a damaged store is
rebuilt from the checkpoint (with a warning naming the file), never used.

``local_store_damage(trials, during=...)`` returns ``Outcome(trials, failures, figure)``; the
pytest suite (test_local_store_damage.py) runs each with ~20 and ~10 rounds,
``benchmarks/reliability.py`` with as many as asked. ``SCENARIOS`` lists them for the runner.
"""

import contextlib
import logging
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
from pyspark import cloudpickle
from pyspark.sql import types as T

from checkpoint_storage import FileSystemCheckpointStorage
from pipelines import (
    FullSnapshotPolicy,
    KeyedStage,
    Source,
    StatefulPipeline,
    StatefulRunner,
    read_state,
)
from resources import build_spark_session
from tests.pipelines.support import TOTALS, customer_totals
from tests.reliability.scenarios_fs import Outcome

__all__ = ["SCENARIOS", "local_store_damage"]

ORDERS = T.StructType([T.StructField("customer", T.StringType()),
                       T.StructField("amount", T.LongType())])
DAMAGES = ("flip", "flip", "truncate", "delete", "stale")  # bit flips twice as often


@dataclass(frozen=True)
class RoundOrders(Source):
    """One batch per partition, its rows made up from the partition's name."""

    customers: int = 150
    rows_per_batch: int = 60

    def batches(self, spark, partition):
        return [f"{partition}-a", f"{partition}-b"]

    def read(self, spark, partition, batch):
        return spark.createDataFrame(self.rows(batch), ORDERS)

    def rows(self, batch: str) -> list[tuple[str, int]]:
        rng = random.Random(batch)
        return [(f"c{rng.randrange(self.customers)}", rng.randrange(1, 100))
                for _ in range(self.rows_per_batch)]




cloudpickle.register_pickle_by_value(sys.modules[__name__])


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _store_files(store: Path) -> list[Path]:
    return sorted(p for p in store.iterdir()
                  if p.name == "MANIFEST.json" or p.name.endswith(".arrow"))


def _damage(rng: random.Random, stores: list[Path], copies: list[dict[Path, Path]],
            kind: str) -> tuple[Path, Path]:
    """Damage one store of ``stores`` as ``kind`` says; (the store, the file damaged or the
    directory for a stale copy, from ``copies``: copies of the stores older than the last
    round's)."""
    store = rng.choice(stores)
    if kind == "stale":
        old = rng.choice([c for c in copies if store in c])[store]
        shutil.rmtree(store)
        shutil.copytree(old, store)
        return store, store
    target = rng.choice(_store_files(store))
    size = target.stat().st_size
    if kind == "flip":
        at = rng.randrange(size)
        with open(target, "r+b") as file:
            file.seek(at)
            byte = file.read(1)[0]
            file.seek(at)
            file.write(bytes([byte ^ (1 << rng.randrange(8))]))
    elif kind == "truncate":
        with open(target, "r+b") as file:
            file.truncate(rng.randrange(size))
    else:
        target.unlink()
    return store, target


def _recomputed(source: RoundOrders, partitions: list[str]) -> dict[str, tuple[int, int]]:
    orders, total = Counter(), Counter()
    for batch in (b for p in partitions for b in (f"{p}-a", f"{p}-b")):
        for customer, amount in source.rows(batch):
            orders[customer] += 1
            total[customer] += amount
    return {c: (orders[c], total[c]) for c in orders}


def _committed(runner: StatefulRunner) -> dict[str, tuple[int, int]]:
    table = read_state(runner.store.latest().external_pointer, "totals")
    return dict(zip(table.column("customer").to_pylist(),
                    zip(table.column("orders").to_pylist(), table.column("total").to_pylist(),
                        strict=True), strict=True))


def local_store_damage(trials: int, seed: int = 24, spark=None, *,
                       during: bool = False) -> Outcome:
    """``trials`` rounds (at least 2): round 0 warms the stores, each later one damages a
    store (before the round, or between its batches ``during`` it) and runs a partition.
    Failures: a round that raised, committed a wrong value (counted per key), or used a
    damaged store without a warning naming the damage."""
    rounds = max(2, trials)
    rng = random.Random(seed)
    spark = spark or build_spark_session("local[2]", "local-store-damage",
                                         {"spark.sql.shuffle.partitions": "4",
                                          "spark.ui.enabled": "false"})
    partitions = [f"r{i:03d}" for i in range(rounds)]
    source = RoundOrders()
    warnings = _Warnings()
    logging.getLogger("pipelines").addHandler(warnings)
    problems: list[str] = []
    kinds, rebuilt_after, named, wrong = Counter(), 0, 0, 0
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="local-store-damage-"))
    try:
        storage = FileSystemCheckpointStorage(str(work / "checkpoints"),
                                              file_state_size_threshold=0)
        pipeline = StatefulPipeline(
            name="damaged_stores",
            stages=[KeyedStage("totals", "customer", TOTALS, customer_totals)],
            source=source, partitions=dg.StaticPartitionsDefinition(partitions),
            checkpoint_interval=1, max_parallelism=16, keyed_parallelism=2,
            # a snapshot every other round reads every value of the stores
            full_snapshot=FullSnapshotPolicy(every=2, min_bytes=0))
        local = work / "local"
        copies: list[tuple[int, dict[Path, Path]]] = []  # (round, copies of its stores)
        for number, partition in enumerate(partitions):
            stores = sorted({p.parent for p in local.rglob("MANIFEST.json")})
            kind = damaged = None
            stale = [c for taken, c in copies if taken < number - 1]  # older than current
            if number:
                kind = rng.choice(DAMAGES if stale else DAMAGES[:-1])
                kinds[kind] += 1
            del warnings.messages[:]
            lines: list[str] = []
            hit: list[Path] = []

            def damage(point: str, batch: int = 0, *, kind=kind, hit=hit, stale=stale,
                       **info) -> None:
                if point == "batch_applied" and batch == 0 and kind is not None:
                    # the stores as the first batch left them, in the workers that opened them
                    now = sorted({p.parent for p in local.rglob("MANIFEST.json")})
                    hit.append(_damage(rng, now, stale, kind)[1])

            if kind is not None and not during:
                hit.append(_damage(rng, stores, stale, kind)[1])
            try:
                runner = StatefulRunner(spark, storage, pipeline, keyed_local_dir=str(local),
                                        fault_hook=damage if during else None)
                runner.run([partition], on_progress=lines.append)
            except Exception as exc:  # noqa: BLE001 - a round that raised is a failed one
                problems.append(f"round {number} ({kind} {damaged}): {type(exc).__name__}: "
                                f"{str(exc)[:300]}")
                # as an operator would: without local stores, so that later rounds still run
                shutil.rmtree(local, ignore_errors=True)
                runner = StatefulRunner(spark, storage, pipeline, keyed_local_dir=str(local))
                runner.run([partition])
            damaged = hit[0] if hit else None
            committed = _committed(runner)
            expected = _recomputed(source, partitions[:number + 1])
            bad = sum(committed.get(k) != v for k, v in expected.items()) + len(
                committed.keys() - expected.keys())
            wrong += bad
            if bad:
                problems.append(f"round {number} ({kind} {damaged}): {bad} wrong value(s)")
            if kind is not None:
                rebuilt = any("rebuilt" in line for line in lines)
                rebuilt_after += rebuilt
                if not rebuilt:
                    problems.append(f"round {number} ({kind} {damaged}): not rebuilt")
                reported = kind == "stale" or any(
                    damaged.name in m or str(damaged.parent) in m for m in warnings.messages)
                named += reported
                if not reported:
                    problems.append(f"round {number} ({kind} {damaged}): no warning names it")
            if number % 3 == 0:  # an older copy of every store, for later stale copies
                keep = work / "copies" / str(number)
                copies.append((number, {
                    s: shutil.copytree(s, keep / s.relative_to(local))
                    for s in sorted({p.parent for p in local.rglob("MANIFEST.json")})}))
    finally:
        logging.getLogger("pipelines").removeHandler(warnings)
        with contextlib.suppress(OSError):
            shutil.rmtree(work)
    damaged_rounds = rounds - 1
    figure = (f"{rounds} rounds, {damaged_rounds} damaged {'during' if during else 'before'} "
              f"the run ("
              + ", ".join(f"{k} {kinds[k]}" for k in sorted(kinds))
              + f"); rebuilt after damage {rebuilt_after}/{damaged_rounds}, damage named in a "
              f"warning {named}/{damaged_rounds}; wrong values committed {wrong}; "
              f"{time.monotonic() - started:.0f} s")
    return Outcome(rounds, len(problems), figure, problems)


SCENARIOS = {
    # about 2-4 s per round on local[2]
    "local_store_damage": lambda trials: local_store_damage(max(2, min(trials, 60))),
    "local_store_damage_during_runs": lambda trials: local_store_damage(
        max(2, min(trials, 60)), during=True),
}
