"""Click events: their schema and a seeded generator of realistic input batches.

The generator stands in for a real source. It lands each day's events as several Parquet
batches, ``<landing_dir>/date=<YYYY-MM-DD>/batch-<NNNNN>.parquet``, in delivery order, with
the two things real click streams have: duplicate deliveries (the same event again, in the
same or a later batch) and late events (timestamps hours behind the batch they arrive in).
"""

import datetime as dt
import random
import uuid
from dataclasses import dataclass
from decimal import Decimal

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "EVENT_ARROW_SCHEMA",
    "GeneratedDay",
    "batch_urls",
    "day_directory",
    "generate_day",
]

EVENT_ARROW_SCHEMA = pa.schema(
    [
        pa.field("event_id", pa.string(), nullable=False),
        pa.field("user_id", pa.string(), nullable=False),
        pa.field("event_ts", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("amount", pa.decimal128(12, 2), nullable=False),
    ]
)


@dataclass(frozen=True)
class GeneratedDay:
    partition: str
    batches: int
    rows: int
    duplicates: int
    late_events: int


def day_directory(landing_dir: str, partition: str) -> str:
    return f"{landing_dir.rstrip('/')}/date={partition}"


def batch_urls(landing_dir: str, partition: str, storage_options: dict | None = None) -> list[str]:
    """The day's batch files in delivery order. A day that never landed raises
    FileNotFoundError (an empty day is an empty directory)."""
    directory = day_directory(landing_dir, partition)
    fs, path = fsspec.core.url_to_fs(directory, **(storage_options or {}))
    try:
        names = fs.ls(path, detail=False)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no input landed for {partition} in {directory}: materialize click_events for "
            f"{partition} first"
        ) from None
    files = sorted(n for n in names if n.rsplit("/", 1)[-1].startswith("batch-"))
    return [fs.unstrip_protocol(f) for f in files]


def generate_day(
    landing_dir: str,
    partition: str,
    *,
    batches: int = 4,
    events_per_batch: int = 2_000,
    users: int = 500,
    duplicate_rate: float = 0.05,
    late_rate: float = 0.03,
    seed: int = 0,
    storage_options: dict | None = None,
) -> GeneratedDay:
    """Write ``partition``'s batches, replacing any earlier landing of that day (so that
    re-materializing a day is idempotent). Same seed and arguments, same bytes."""
    if batches < 0 or events_per_batch < 0 or users < 1:
        raise ValueError("batches and events_per_batch must be >= 0, users >= 1")
    day = dt.date.fromisoformat(partition)
    rng = random.Random(f"{seed}:{partition}")
    start = dt.datetime.combine(day, dt.time(), tzinfo=dt.UTC)
    span = 86_400 / max(batches, 1)
    directory = day_directory(landing_dir, partition)
    fs, path = fsspec.core.url_to_fs(directory, **(storage_options or {}))
    if fs.exists(path):
        fs.rm(path, recursive=True)
    fs.makedirs(path, exist_ok=True)
    delivered: list[dict] = []
    rows = duplicates = late = 0
    for index in range(batches):
        batch: list[dict] = []
        for _ in range(events_per_batch):
            if delivered and rng.random() < duplicate_rate:
                batch.append(rng.choice(delivered[-5 * events_per_batch :]))
                duplicates += 1
                continue
            offset = span * index + rng.random() * span
            if rng.random() < late_rate:
                offset -= rng.uniform(1, 30) * 3600  # arrives hours late
                late += 1
            event = {
                "event_id": str(uuid.UUID(int=rng.getrandbits(128))),
                "user_id": f"user-{rng.randrange(users):05d}",
                "event_ts": start + dt.timedelta(seconds=offset),
                "amount": Decimal(rng.randrange(1, 50_000)) / 100,
            }
            batch.append(event)
            delivered.append(event)
        table = pa.Table.from_pylist(batch, schema=EVENT_ARROW_SCHEMA)
        with fs.open(f"{path}/batch-{index:05d}.parquet", "wb") as f:
            pq.write_table(table, f)
        rows += len(batch)
    if batches == 0:
        # Object stores have no empty directories: without a file, an empty day would read
        # as a day that never landed.
        fs.touch(f"{path}/_SUCCESS")
    return GeneratedDay(partition, batches, rows, duplicates, late)
