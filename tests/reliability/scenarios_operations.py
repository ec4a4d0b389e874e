"""Rewinds, time travel and recovery (issue 25) as reliability scenarios, on real Spark
(``local[2]``) with the keyed hourly pipeline of tests/pipelines/test_rewind.py (a keyed count
per key, one or two batches per hour), checked against a dict recomputation:

- ``rewind``: run hours 1-8, backfill 3-5 from the end of 2 (a savepoint there, or the
  retained end of hour 2 with no savepoint, at random; 1-3 retained checkpoints, 1-2 batches
  an hour), then continue with 9. Nothing of 6-8 is lost: the head (end of 8) survives
  retention and garbage collection and restores equal to the recomputation, the backfill says
  "rewound from end of 8 to end of 2; the head is kept at <head>", and 9 continues from the
  head and equals the recomputation of 1-9.
- ``time_travel``: 50 hourly partitions with ``retain_partition_ends=48`` and one retained
  checkpoint: each of the 48 retained ends restores (and reads with ``checkpoints read
  --as-of``) equal to the recomputation, and after garbage collection the job directory holds
  exactly the files the retained checkpoints reference; the figure gives its bytes against
  the head alone.
- ``recovery``: each trial runs 3 hours of 2-3 batches and injects one failure at a random
  point of the run (in turn: after a batch is applied, before a checkpoint's ``_metadata``, in
  an executor task after it wrote a state file), then recovers as the recovery sensor does: a new
  run from the first hour that did not complete, restoring the newest retained checkpoint. The
  final state must equal the recomputation, the recovery must restore the last checkpoint the
  failed run completed, and replay only the batches after it.

Each returns ``Outcome(trials, failures, figure)`` (``problems``: the first failures' reasons);
tests/reliability/test_operations.py runs them small, ``benchmarks/reliability.py`` as asked.
"""

import contextlib
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from pipelines import SourcePosition, StatefulRunner
from resources import build_spark_session
from tests.pipelines.hourly import (
    collect,
    expected,
    hour,
    hours,
    on_disk,
    pipeline,
    read_as_of,
    referenced,
    runner_of,
    state_at,
)
from tests.reliability.scenarios_fs import Outcome

__all__ = ["SCENARIOS", "recovery", "rewind", "time_travel"]


def _spark(spark):
    return spark or build_spark_session(
        "local[2]", "operations-scenarios",
        {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"},
    )  # fmt: skip


@contextlib.contextmanager
def _work_dir(prefix: str):
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _size(files: set[str]) -> int:
    return sum(os.path.getsize(f) for f in files)


def rewind(trials: int, seed: int = 25, spark=None) -> Outcome:
    """``trials`` rewinds (see the module's docstring); failures: a trial that raised, lost
    the head, said nothing, left stray or missing files, or a state that differs."""
    rng = random.Random(seed)
    spark = _spark(spark)
    problems, said, kept, continued, wrong, stray = [], 0, 0, 0, 0, 0
    sources = {"savepoint": 0, "partition end": 0}
    started = time.monotonic()
    for trial in range(trials):
        source = ("savepoint", "partition end")[trial % 2]
        sources[source] += 1
        batches, retained = rng.choice((1, 2)), rng.choice((1, 2, 3))
        spec = pipeline(
            batches,
            max_retained_checkpoints=retained,
            retain_partition_ends=8 if source == "partition end" else 0,
        )
        what = f"trial {trial} ({source}, {batches} batches, {retained} retained)"
        with _work_dir("rewind-") as work:
            try:
                runner = runner_of(spark, work, spec)
                runner.run(hours(1, 2))
                savepoint = runner.take_savepoint().pointer if source == "savepoint" else None
                head = runner.run(hours(3, 8))[-1].checkpoint.pointer
                lines: list[str] = []
                backfill = runner_of(spark, work, spec)
                rewound = backfill.run(
                    hours(3, 5), restore_from=savepoint, on_progress=lines.append
                )
                note = (
                    f"rewound from end of {hour(8)} to end of {hour(2)}; the head is kept at {head}"
                )
                if any(line.startswith(note) for line in lines) and rewound[0].rewound:
                    said += 1
                else:
                    problems.append(f"{what}: no line says {note!r}")
                collect(backfill)
                job_dir = Path(backfill.access.checkpoints_directory)
                extra = on_disk(job_dir) ^ referenced(backfill)
                stray += len(extra)
                if extra:
                    problems.append(f"{what}: files not as referenced: {sorted(extra)[:3]}")
                if head in [c.external_pointer for c in backfill.store.all()]:
                    kept += 1
                else:
                    problems.append(f"{what}: the head {head} is no longer retained")
                checks = [
                    (state_at(backfill, head), hours(1, 8)),
                    (state_at(backfill, rewound[-1].checkpoint.pointer), hours(1, 5)),
                ]
                later = runner_of(spark, work, spec).run([hour(9)])
                if later[0].restored_from == head:
                    continued += 1
                else:
                    problems.append(f"{what}: 9 restored {later[0].restored_from}, not {head}")
                checks.append((state_at(backfill, later[-1].checkpoint.pointer), hours(1, 9)))
                bad = sum(state != expected(parts, batches) for state, parts in checks)
                wrong += bad
                if bad:
                    problems.append(f"{what}: {bad} state(s) differ from the recomputation")
            except Exception as exc:  # noqa: BLE001 - a trial that raised is a failed one
                problems.append(f"{what}: {type(exc).__name__}: {str(exc)[:300]}")
    figure = (
        f"{trials} rewinds (8 hours, 3-5 again from the end of 2: from a savepoint "
        f"{sources['savepoint']}, from a retained end {sources['partition end']}; then "
        f"9): said so {said}/{trials}, head kept {kept}/{trials}, 9 continued from the "
        f"head {continued}/{trials}, states unequal to the recomputation {wrong}, files "
        f"unlike the references {stray}; {time.monotonic() - started:.0f} s"
    )
    return Outcome(trials, len(problems), figure, problems)


def time_travel(trials: int = 1, seed: int = 48, spark=None, *, ends: int = 48) -> Outcome:
    """``ends + 2`` hourly partitions with the last ``ends`` partition ends retained; each
    retained end is a trial (restored and read ``--as-of``, equal to the recomputation)."""
    spark = _spark(spark)
    batches = random.Random(seed).choice((1, 2))
    problems, restored, read = [], 0, 0
    started = time.monotonic()
    spec = pipeline(batches, max_retained_checkpoints=1, retain_partition_ends=ends)
    with _work_dir("time-travel-") as work:
        runner = runner_of(spark, work, spec)
        results = runner.run(hours(1, ends + 2))
        head = results[-1].checkpoint.pointer
        retained = {
            SourcePosition.of(c.metadata).partition: c.external_pointer for c in runner.store.all()
        }
        if sorted(retained) != hours(3, ends + 2):
            problems.append(f"retained ends {sorted(retained)}, not those of hours 3-{ends + 2}")
        collect(runner)
        job_dir = Path(runner.access.checkpoints_directory)
        files, wanted = on_disk(job_dir), referenced(runner)
        if files != wanted:
            problems.append(
                f"after GC, stray {sorted(files - wanted)[:3]}, missing "
                f"{sorted(wanted - files)[:3]}"
            )
        head_alone = {str(Path(head) / "_metadata")} | {
            h.path
            for h in runner.access.resolve_checkpoint(head).load_metadata().all_handles()
            if hasattr(h, "path")
        }
        for n in range(3, ends + 3):
            want = expected(hours(1, n), batches)
            if hour(n) in retained and state_at(runner, retained[hour(n)]) == want:
                restored += 1
            else:
                problems.append(f"end of {hour(n)}: not restored equal to the recomputation")
            if read_as_of(job_dir, hour(n)) == want:
                read += 1
            else:
                problems.append(f"checkpoints read --as-of {hour(n)}: unequal")
        total, alone = _size(files), _size(head_alone)
    figure = (
        f"{ends + 2} hourly partitions ({batches} batch(es) each), ends of the last "
        f"{ends} retained {len(retained)}; restored equal {restored}/{ends}, read --as-of "
        f"equal {read}/{ends}; after GC the job directory holds exactly the referenced "
        f"files: {'yes' if files == wanted else 'no'} ({len(files)} files, {total} B vs "
        f"the head alone {alone} B, {total / alone:.2f}x: a state of a few keys, where "
        f"each end's _metadata dominates; benchmarks/partition_ends.py measures 1M keys); "
        f"{time.monotonic() - started:.0f} s"
    )
    return Outcome(ends, len(problems), figure, problems)


class InjectedFailure(RuntimeError):
    pass


def _executor_fault(armed: str):
    """``task_after_write``: the first write after ``armed`` appears raises (once: whoever
    removes the file)."""

    def after_write(subtask: int, attempt: int) -> None:
        try:
            os.remove(armed)
        except FileNotFoundError:
            return
        raise InjectedFailure(f"injected: task of range {subtask} after a state file write")

    return after_write


def _injected(exc: BaseException | None) -> bool:
    """Whether ``exc`` or one of its causes is the injected failure (a task's comes back inside
    Spark's error, as text)."""
    while exc is not None:
        if isinstance(exc, InjectedFailure) or "InjectedFailure" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def recovery(trials: int, seed: int = 2525, spark=None) -> Outcome:
    """``trials`` runs, each failed at one random point and recovered (module docstring)."""
    rng = random.Random(seed)
    spark = _spark(spark)
    problems, kinds, failed, recovered, replayed_right, wrong = [], {}, 0, 0, 0, 0
    started = time.monotonic()
    parts = hours(1, 3)
    for trial in range(trials):
        batches, interval = rng.choice((2, 3)), rng.choice((1, 2))
        spec = pipeline(batches, checkpoint_interval=interval, max_retained_checkpoints=2)
        # Checkpoints: every `interval` batches and at each hour's end.
        per_hour = len({*range(interval, batches + 1, interval), batches})
        kind = ("batch_applied", "before_metadata", "executor")[trial % 3]
        kinds[kind] = kinds.get(kind, 0) + 1
        what = f"trial {trial} ({batches} batches, checkpoint every {interval}, {kind}"
        with _work_dir("recovery-") as work:
            armed = str(work / "armed")
            if kind == "batch_applied":
                at = (rng.choice(parts), rng.randrange(batches))
                what += f" after batch {at[1]} of {at[0]})"
            elif kind == "before_metadata":
                at = rng.randrange(1, per_hour * len(parts) + 1)
                what += f" before checkpoint {at}'s _metadata)"
            else:
                at = rng.randrange(len(parts) * batches)  # arm it after this many batches
                what += f" at the first write after batch {at})"
                if at == 0:
                    Path(armed).touch()
            applied = [0]

            def fault(point: str, *, kind=kind, at=at, armed=armed, applied=applied, **info):
                if point == "batch_applied":
                    applied[0] += 1
                    if kind == "batch_applied" and (info["partition"], info["batch"]) == at:
                        raise InjectedFailure(f"injected after batch {at[1]} of {at[0]}")
                    if kind == "executor" and applied[0] == at:
                        Path(armed).touch()
                if kind == "before_metadata" and info.get("checkpoint_id") == at:
                    raise InjectedFailure(f"injected before checkpoint {at}'s _metadata")

            try:
                done: list[str] = []
                runner = StatefulRunner(
                    spark,
                    runner_of(spark, work, spec).storage,
                    spec,
                    keyed_local_dir=str(work / "local"),
                    fault_hook=fault,
                    task_after_write=_executor_fault(armed),
                )
                try:
                    runner.run(
                        parts, on_partition_done=lambda r, done=done: done.append(r.partition)
                    )
                    problems.append(f"{what}: the injected failure did not fail the run")
                    continue
                except Exception as exc:  # noqa: BLE001 - the injected failure, somewhere below
                    if not _injected(exc):
                        problems.append(f"{what}: failed otherwise: {str(exc)[:300]}")
                        continue
                failed += 1
                with contextlib.suppress(FileNotFoundError):
                    os.remove(armed)
                remaining = parts[len(done) :]
                fresh = runner_of(spark, work, spec)
                latest = fresh.store.latest()
                results = fresh.run(remaining)
                recovered += 1
                # The recovery restores the newest checkpoint the failed run completed, and
                # replays only the batches after its position.
                position = SourcePosition.of(latest.metadata) if latest else None
                in_hour = 0
                if position is not None and position.partition == remaining[0]:
                    in_hour = position.batches
                ok_restore = results[0].restored_from == (
                    latest.external_pointer if latest else None
                )
                ok_replay = results[0].batches_applied == batches - in_hour
                if ok_restore and ok_replay:
                    replayed_right += 1
                else:
                    problems.append(
                        f"{what}: recovery restored {results[0].restored_from} (newest: "
                        f"{latest.external_pointer if latest else None}), replayed "
                        f"{results[0].batches_applied} batches of {remaining[0]}"
                    )
                if state_at(fresh, results[-1].checkpoint.pointer) != expected(parts, batches):
                    wrong += 1
                    problems.append(f"{what}: the recovered state differs from the recomputation")
            except Exception as exc:  # noqa: BLE001 - a trial that raised is a failed one
                problems.append(f"{what}: {type(exc).__name__}: {str(exc)[:300]}")
    figure = (
        f"{trials} runs of 3 hours, one failure each at a random point ("
        + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
        + f"): failed {failed}/{trials}, recovered {recovered}/{failed}, restored the "
        f"last completed checkpoint and replayed only what followed {replayed_right}/"
        f"{recovered}, states unequal to the recomputation {wrong}; "
        f"{time.monotonic() - started:.0f} s"
    )
    return Outcome(trials, len(problems), figure, problems)


SCENARIOS = {
    # about 15-30 s per rewind, 1-2 s per recovery trial on local[2]
    "rewind": lambda trials: rewind(max(2, min(trials, 10))),
    "time_travel": lambda trials: time_travel(),
    "recovery": lambda trials: recovery(max(3, min(trials, 60))),
}
