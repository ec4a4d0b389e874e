"""The timers contract of a keyed stage, without Spark, to run an example's pure functions
batch by batch: the watermark (newest event time seen, the batch's included, minus the
allowed lateness) moves, late rows are dropped, ``apply`` gets the batch and its keys' state,
then the timers at or before the watermark fire through ``on_timer`` with their keys' state;
deleting a key's state deletes its timers."""

import datetime as dt

import pyarrow as pa

TIMER_TYPE = pa.timestamp("us", "UTC")


def sorted_rows(table: pa.Table | None) -> list[tuple]:
    return sorted(tuple(r.values()) for r in table.to_pylist()) if table is not None else []


class TimerModel:
    def __init__(self, apply, on_timer, state_schema: pa.Schema, key: str, event_time: str,
                 lateness: dt.timedelta) -> None:
        self.apply, self.on_timer, self.schema = apply, on_timer, state_schema
        self.key, self.event_time, self.lateness = key, event_time, lateness
        self.clock: dt.datetime | None = None
        self.state: dict[object, dict] = {}
        self.timers: dict[object, set] = {}

    def state_of(self, keys) -> pa.Table:
        return pa.Table.from_pylist([self.state[k] for k in sorted(set(keys) & self.state.keys())],
                                    schema=self.schema)

    def _take(self, result) -> list[tuple]:
        for row in result.upserts.to_pylist():
            self.state[row[self.key]] = row
        for row in result.deletes.to_pylist():
            self.state.pop(row[self.key], None)
            self.timers.pop(row[self.key], None)
        for row in result.deleted_timers.to_pylist() if result.deleted_timers else []:
            self.timers.get(row[self.key], set()).discard(row["timer"])
        for row in result.timers.to_pylist() if result.timers else []:
            assert row[self.key] in self.state, "a timer needs its key's state"
            self.timers.setdefault(row[self.key], set()).add(row["timer"])
        return sorted_rows(result.output)

    def batch(self, rows: pa.Table) -> list[tuple]:
        """One batch of input rows; the output rows of ``apply`` and ``on_timer``, sorted."""
        times = [t for t in rows.column(self.event_time).to_pylist() if t is not None]
        if times:
            self.clock = max(times) if self.clock is None else max(self.clock, max(times))
        watermark = self.clock - self.lateness
        on_time = pa.array([t is not None and t >= watermark
                            for t in rows.column(self.event_time).to_pylist()], pa.bool_())
        rows = rows.filter(on_time)
        output = self._take(self.apply(rows, self.state_of(rows.column(self.key).to_pylist())))
        fired = sorted((k, t) for k, ts in self.timers.items() for t in ts if t <= watermark)
        for k, t in fired:
            self.timers[k].discard(t)
        if fired:
            table = pa.table({self.key: [k for k, _ in fired],
                              "timer": pa.array([t for _, t in fired], TIMER_TYPE)})
            output += self._take(self.on_timer(table, self.state_of(k for k, _ in fired)))
        return sorted(output)
