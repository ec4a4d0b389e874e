"""Filesystem fault, concurrency and corruption scenarios (issue 7), on local disk and S3.

Each scenario takes a trial count and a ``Target`` and returns ``Outcome(trials, failures,
figure)``; ``Outcome.problems`` says what went wrong in the failed trials. The pytest suite runs
them with small N, ``benchmarks/reliability.py`` with large N. Every scenario works in a fresh
directory below ``target.base_url`` per trial (or per run).
"""

import contextlib
import logging
import multiprocessing
import queue as queue_module
import random
import time
import uuid
from dataclasses import dataclass

import fsspec

from checkpoint_storage import (
    CheckpointedStateScope,
    CheckpointMetadata,
    FileSystemCheckpointStorage,
    FileSystemCompletedCheckpointStore,
    JobID,
    OperatorState,
    OperatorSubtaskState,
    verify_checkpoint,
)
from checkpoint_storage._metadata import encode_metadata
from checkpoint_storage.exceptions import (
    CheckpointAlreadyExistsError,
    CheckpointCommitFailedError,
    CommitStateUnknownError,
    InvalidCheckpointError,
    StateIntegrityError,
)
from tests.reliability import faulty_fs

EXCLUSIVE = CheckpointedStateScope.EXCLUSIVE
THRESHOLD = 20 * 1024  # the library's default inline threshold
S3_BLOCK_SIZE = 5 * 1024 * 1024  # so that a 6 MiB state file is a multipart upload
SIZES = (0, 1024, THRESHOLD, 6 * 1024 * 1024)
JOB = JobID("7" * 32)
_CHUNK = 64 * 1024


@dataclass(frozen=True)
class Target:
    """Where a scenario writes: ``local`` (a directory) or ``s3`` (a bucket on moto)."""

    name: str
    base_url: str
    storage_options: dict
    endpoint_url: str | None = None


class Outcome(tuple):
    """``(trials, failures, figure)``; ``problems`` lists the first failures' reasons."""

    problems: list[str]

    def __new__(cls, trials: int, failures: int, figure: str, problems=()):
        self = super().__new__(cls, (trials, failures, figure))
        self.problems = list(problems)[:20]
        return self

    trials = property(lambda self: self[0])
    failures = property(lambda self: self[1])
    figure = property(lambda self: self[2])


def local_target(directory: str) -> Target:
    return Target("local", directory, {})


def s3_target(endpoint_url: str, bucket: str) -> Target:
    options = {"endpoint_url": endpoint_url, "default_block_size": S3_BLOCK_SIZE}
    return Target("s3", f"s3://{bucket}/reliability", options, endpoint_url)


# --- helpers -----------------------------------------------------------------------------


def _payload(n: int, seed) -> bytes:
    return random.Random(str(seed)).randbytes(n)


def _storage(target: Target, run: str) -> FileSystemCheckpointStorage:
    return FileSystemCheckpointStorage(
        f"{target.base_url}/{run}",
        file_state_size_threshold=THRESHOLD,
        storage_options=target.storage_options,
    )


def _real_fs(target: Target):
    fs, _ = fsspec.core.url_to_fs(target.base_url, **target.storage_options)
    fs.invalidate_cache()
    return fs


def _metadata(checkpoint_id: int, handles, master: bytes) -> CheckpointMetadata:
    return CheckpointMetadata(
        checkpoint_id=checkpoint_id,
        operator_states=(
            OperatorState(
                "op", 1, subtask_states={0: OperatorSubtaskState(handles=tuple(handles))}
            ),
        ),
        master_states={"writer": master},
    )


def _write_state(factory, data: bytes):
    with factory.create_checkpoint_state_output_stream(EXCLUSIVE) as out:
        for i in range(0, len(data), _CHUNK):
            out.write(data[i : i + _CHUNK])
        return out.close_and_get_handle()


def _prepare(access, checkpoint_id: int, seed, master: bytes = b"w"):
    """A location for ``checkpoint_id`` with one state file and one inline state written;
    returns the location and the encoded `_metadata` that would complete it."""
    location = access.initialize_location_for_checkpoint(checkpoint_id)
    handles = (
        _write_state(location, _payload(3 * THRESHOLD, (seed, "file"))),
        _write_state(location, _payload(100, (seed, "inline"))),
    )
    return location, encode_metadata(_metadata(checkpoint_id, handles, master))


def _commit(location, data: bytes):
    out = location.create_metadata_output_stream()
    out.write(data)
    return out.close_and_finalize_checkpoint()


def _read_or_none(fs, url: str) -> bytes | None:
    fs.invalidate_cache()
    try:
        return fs.cat_file(type(fs)._strip_protocol(url))
    except FileNotFoundError:
        return None


def _files_below(fs, url: str) -> list[str]:
    fs.invalidate_cache()
    try:
        return sorted(fs.find(type(fs)._strip_protocol(url)))
    except FileNotFoundError:
        return []


def _open_uploads(target: Target, url: str) -> list[str]:
    if target.name != "s3":
        return []
    import boto3

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=target.endpoint_url)
    uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    return [u["Key"] for u in uploads]


@contextlib.contextmanager
def _captured_warnings():
    records: list[str] = []

    class _Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = _Handler(logging.WARNING)
    logger = logging.getLogger("checkpoint_storage")
    level = logger.level
    if logger.getEffectiveLevel() > logging.WARNING:  # a runner may have quietened it
        logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _id_of(pointer: str) -> int:
    return int(pointer.rstrip("/").rsplit("chk-", 1)[1])


# --- scenario: fault points of the `_metadata` commit ------------------------------------


def metadata_fault_cases(target_name: str) -> list[tuple[str, str, str]]:
    """(point, phase, action) of every fault of the `_metadata` commit on this backend."""
    points = (
        faulty_fs.LOCAL_METADATA_POINTS
        if target_name == "local"
        else faulty_fs.COMMON_METADATA_POINTS
    )
    cases = []
    for point in points:
        for phase in faulty_fs.PHASES:
            cases += [(point, phase, "fail"), (point, phase, "delay")]
            if point in faulty_fs.WRITE_POINTS and phase == "before":
                cases.append((point, phase, "cut"))
    return cases


def metadata_commit_faults(trials: int, target: Target) -> Outcome:
    """Commit chk-2 (chk-1 complete) with one fault at a point of the `_metadata` commit;
    then `_metadata` is absent or exactly the committed bytes, the raised error tells the
    truth, and recovery returns chk-2 or chk-1, validated."""
    cases = metadata_fault_cases(target.name)
    fs = _real_fs(target)
    problems: list[str] = []
    outcomes: dict[str, int] = {}
    failures = 0
    for trial in range(trials):
        point, phase, action = cases[trial % len(cases)]
        case = f"{target.name} {point}/{phase}/{action}"
        storage = _storage(target, f"commit-{uuid.uuid4().hex[:12]}")
        with faulty_fs.injecting():
            access = storage.create_checkpoint_storage(JOB)
            access.initialize_base_locations()
            first, data1 = _prepare(access, 1, (trial, 1))
            _commit(first, data1)
            location, data = _prepare(access, 2, (trial, 2))
            plan = faulty_fs.FaultPlan([faulty_fs.Fault(point, phase, action, seconds=0.02)])
            with faulty_fs.active(plan):
                try:
                    _commit(location, data)
                    outcome = "committed"
                except CheckpointCommitFailedError:
                    outcome = "failed"
                except CommitStateUnknownError:
                    outcome = "unknown"
                except Exception as exc:  # noqa: BLE001 - any other error is a finding
                    outcome = f"raised {type(exc).__name__}: {exc}"
        outcomes[outcome.split(":")[0]] = outcomes.get(outcome.split(":")[0], 0) + 1
        chk2 = f"{access.checkpoints_directory}/chk-2/_metadata"
        stored = _read_or_none(fs, chk2)
        trial_problems = []
        if not plan.fired:
            trial_problems.append("the fault point was never reached")
        if stored is not None and stored != data:
            trial_problems.append(f"torn _metadata: {len(stored)} bytes, expected {len(data)}")
        if outcome == "committed" and stored != data:
            trial_problems.append("commit returned but _metadata is not there")
        if outcome == "failed" and stored is not None:
            trial_problems.append("CheckpointCommitFailedError but _metadata was published")
        if outcome.startswith("raised"):
            trial_problems.append(
                f"unexpected error ({outcome}), _metadata present: {stored is not None}"
            )
        latest = storage.create_checkpoint_storage(JOB).latest_completed_checkpoint()
        expected_id = 2 if stored == data else 1
        if latest is None or _id_of(latest.external_pointer) != expected_id:
            trial_problems.append(f"recovery returned {latest}, expected chk-{expected_id}")
        elif not verify_checkpoint(latest).ok:
            trial_problems.append(f"recovered {latest} does not verify")
        problems += [f"{case}: {p}" for p in trial_problems]
        failures += bool(trial_problems)
    figure = f"{len(cases)} fault cases ({target.name}), outcomes " + ", ".join(
        f"{k}={v}" for k, v in sorted(outcomes.items())
    )
    return Outcome(trials, failures, figure, problems)


# --- scenario: exceptions inside streams -------------------------------------------------


def stream_failure_cases() -> list[tuple[int, str]]:
    """(size, mode) pairs: a user exception in a state or metadata stream, or a fault at a
    state file point."""
    modes = ["raise:state", "raise:metadata"]
    for point in faulty_fs.STATE_POINTS:
        for phase in faulty_fs.PHASES:
            modes.append(f"fault:{point}:{phase}:fail")
    modes.append("fault:state.write:before:cut")
    return [(size, mode) for size in SIZES for mode in modes]


class _Boom(Exception):
    pass


def _write_all(out, size: int, seed) -> None:
    data = _payload(size, seed)
    for i in range(0, size, _CHUNK):
        out.write(data[i : i + _CHUNK])


def stream_exceptions(trials: int, target: Target) -> Outcome:
    """A stream that fails (user exception or a fault) leaves no file at the target and no
    open multipart upload, at every size."""
    cases = stream_failure_cases()
    fs = _real_fs(target)
    problems: list[str] = []
    failures = 0
    for trial in range(trials):
        before = len(problems)
        size, mode = cases[trial % len(cases)]
        case = f"{target.name} {size} B {mode}"
        storage = _storage(target, f"stream-{uuid.uuid4().hex[:12]}")
        plan = faulty_fs.FaultPlan()
        if mode.startswith("fault:"):
            _, point, phase, action = mode.split(":")
            # Mid-stream for the large state: the multipart upload has begun by then.
            skip = max(0, size // _CHUNK - 2) if point == "state.write" else 0
            plan.faults.append(faulty_fs.Fault(point, phase, action, skip=skip))
        with faulty_fs.injecting():
            access = storage.create_checkpoint_storage(JOB)
            access.initialize_base_locations()
            location = access.initialize_location_for_checkpoint(1)
            handle = None
            with faulty_fs.active(plan):
                try:
                    if mode == "raise:metadata":
                        with location.create_metadata_output_stream() as out:
                            _write_all(out, size, trial)
                            raise _Boom()
                    with location.create_checkpoint_state_output_stream(EXCLUSIVE) as out:
                        _write_all(out, size, trial)
                        if mode == "raise:state":
                            raise _Boom()
                        handle = out.close_and_get_handle()
                except (_Boom, faulty_fs.InjectedFault):
                    pass
                except Exception as exc:  # noqa: BLE001
                    problems.append(f"{case}: unexpected {type(exc).__name__}: {exc}")
        file_expected = size > THRESHOLD
        if mode.startswith("fault:") and file_expected and not plan.fired:
            problems.append(f"{case}: the fault was never reached")
        if handle is not None and plan.fired:
            problems.append(f"{case}: the stream committed {handle} despite the fault")
        if handle is None or not file_expected:
            leftovers = _files_below(fs, access.checkpoints_directory)
            if leftovers:
                problems.append(f"{case}: files left at the target: {leftovers}")
        uploads = _open_uploads(target, access.checkpoints_directory)
        if uploads:
            problems.append(f"{case}: open multipart uploads: {uploads}")
        failures += len(problems) > before
    figure = f"{len(cases)} cases ({target.name}, sizes {', '.join(map(str, SIZES))} B)"
    return Outcome(trials, failures, figure, problems)


# --- scenario: concurrent commits of one checkpoint id -----------------------------------


def _commit_worker(target: Target, run: str, writer: int, rounds: int, barrier, results) -> None:
    """One of the racing writers: each round, prepare checkpoint ``round + 1`` with its own
    state, wait for the others, then commit."""
    access = _storage(target, run).create_checkpoint_storage(JOB)
    for round_ in range(rounds):
        try:
            location, data = _prepare(access, round_ + 1, (run, round_, writer), b"%d" % writer)
        except Exception as exc:  # noqa: BLE001
            results.put((round_, writer, "error", f"prepare: {exc!r}"))
            barrier.wait()  # the others still race this round
            continue
        barrier.wait()
        try:
            _commit(location, data)
            results.put((round_, writer, "won", data))
        except CheckpointAlreadyExistsError as exc:
            results.put((round_, writer, "exists", isinstance(exc, FileExistsError)))
        except Exception as exc:  # noqa: BLE001
            results.put((round_, writer, "error", repr(exc)))


def concurrent_commits(trials: int, target: Target, processes: int = 16) -> Outcome:
    """``processes`` spawned processes commit the same checkpoint id at once, ``trials``
    rounds: exactly one wins, the others get FileExistsError, the stored bytes are the
    winner's and the checkpoint verifies."""
    run = f"race-{uuid.uuid4().hex[:12]}"
    storage = _storage(target, run)
    access = storage.create_checkpoint_storage(JOB)
    access.initialize_base_locations()
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(processes, timeout=120)
    results = ctx.Queue()
    workers = [
        ctx.Process(target=_commit_worker, args=(target, run, w, trials, barrier, results))
        for w in range(processes)
    ]
    for worker in workers:
        worker.start()
    by_round: dict[int, list] = {r: [] for r in range(trials)}
    try:
        deadline = time.monotonic() + 120 + 10 * trials
        for _ in range(processes * trials):
            r, w, kind, detail = results.get(timeout=max(1.0, deadline - time.monotonic()))
            by_round[r].append((w, kind, detail))
    except queue_module.Empty:
        pass
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
                worker.join()
    fs = _real_fs(target)
    problems: list[str] = []
    failures = 0
    for r, entries in by_round.items():
        before = len(problems)
        case = f"{target.name} round {r}"
        won = [(w, data) for w, kind, data in entries if kind == "won"]
        lost = [w for w, kind, is_fee in entries if kind == "exists" and is_fee]
        others = [(w, kind, d) for w, kind, d in entries if kind not in ("won", "exists")]
        if len(entries) != processes:
            problems.append(f"{case}: {len(entries)} of {processes} writers reported")
        if len(won) != 1:
            problems.append(f"{case}: {len(won)} winners {[w for w, _ in won]}")
        if len(lost) != processes - 1:
            problems.append(f"{case}: {len(lost)} FileExistsError, others: {others[:3]}")
        metadata_url = f"{access.checkpoints_directory}/chk-{r + 1}/_metadata"
        stored = _read_or_none(fs, metadata_url)
        if won and stored != won[0][1]:
            problems.append(f"{case}: stored _metadata is not the winner's")
        completed = storage.resolve_checkpoint(f"{access.checkpoints_directory}/chk-{r + 1}")
        if won and completed.load_metadata().master_states["writer"] != b"%d" % won[0][0]:
            problems.append(f"{case}: loaded metadata names another writer")
        if not verify_checkpoint(completed).ok:
            problems.append(f"{case}: the committed checkpoint does not verify")
        failures += len(problems) > before
    figure = f"{processes} processes x {trials} rounds ({target.name})"
    return Outcome(trials, failures, figure, problems)


# --- scenario: corruption ----------------------------------------------------------------


def _mutate(data: bytes, kind: str, rng: random.Random) -> bytes:
    if kind == "bitflip":
        position = rng.randrange(len(data) * 8)
        mutated = bytearray(data)
        mutated[position // 8] ^= 1 << (position % 8)
        return bytes(mutated)
    return data[: rng.randrange(len(data))]


def corruption(trials: int, target: Target, seed: int = 7) -> Outcome:
    """One random bit flip or truncation in chk-2's `_metadata` or state file is detected
    every time, and recovery falls back to chk-1, saying why."""
    fs = _real_fs(target)
    problems: list[str] = []
    counts: dict[str, int] = {}
    failures = 0
    for trial in range(trials):
        before = len(problems)
        rng = random.Random(seed * 1_000_003 + trial)
        victim = rng.choice(("metadata", "state"))
        kind = rng.choice(("bitflip", "truncate"))
        case = f"{target.name} trial {trial} {victim}/{kind}"
        counts[f"{victim}/{kind}"] = counts.get(f"{victim}/{kind}", 0) + 1
        storage = _storage(target, f"corrupt-{uuid.uuid4().hex[:12]}")
        access = storage.create_checkpoint_storage(JOB)
        access.initialize_base_locations()
        for checkpoint_id in (1, 2):
            location, data = _prepare(access, checkpoint_id, (seed, trial, checkpoint_id))
            _commit(location, data)
        chk2 = f"{access.checkpoints_directory}/chk-2"
        state = next(
            h
            for h in storage.resolve_checkpoint(chk2).load_metadata().all_handles()
            if hasattr(h, "path")
        )
        path = f"{chk2}/_metadata" if victim == "metadata" else state.path
        fs_path = type(fs)._strip_protocol(path)
        fs.pipe_file(fs_path, _mutate(fs.cat_file(fs_path), kind, rng))
        fs.invalidate_cache()
        fresh = storage.create_checkpoint_storage(JOB)
        if victim == "metadata":
            try:
                fresh.resolve_checkpoint(chk2).load_metadata()
                problems.append(f"{case}: corrupt _metadata loaded without error")
            except InvalidCheckpointError:
                pass
            with _captured_warnings() as warnings:
                latest = fresh.latest_completed_checkpoint()
            if latest is None or _id_of(latest.external_pointer) != 1:
                problems.append(f"{case}: latest_completed_checkpoint() returned {latest}")
            if not any("chk-2" in w and "not a valid" in w for w in warnings):
                problems.append(f"{case}: no warning says why chk-2 was skipped: {warnings}")
            with _captured_warnings():
                store = FileSystemCompletedCheckpointStore(fresh, max_retained=5)
            if [c.checkpoint_id for c in store.all()] != [1]:
                problems.append(f"{case}: store recovered {store.all()}")
        else:
            try:
                with state.open() as stream:
                    stream.read()
                problems.append(f"{case}: corrupt state file read without error")
            except StateIntegrityError:
                pass
            store = FileSystemCompletedCheckpointStore(fresh, max_retained=5)
            chosen, why = None, []
            for checkpoint in reversed(store.all()):
                report = verify_checkpoint(fresh.resolve_checkpoint(checkpoint.external_pointer))
                if report.ok:
                    chosen = checkpoint.checkpoint_id
                    break
                why += [f"{p.kind}: {p.reason}" for p in report.problems]
            if chosen != 1:
                problems.append(f"{case}: verified recovery chose {chosen}")
            if not any(w.startswith("corrupt:") and state.path in w for w in why):
                problems.append(f"{case}: the report does not say why chk-2 is rejected: {why}")
        failures += len(problems) > before
    figure = f"{target.name} " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
    return Outcome(trials, failures, figure, problems)


# --- the runner's table --------------------------------------------------------------------


def _on_each_backend(function, *, s3_share: int = 1):
    """``function(trials, target)`` as two runner entries (local disk, S3 on moto), each
    taking the trial count only; S3 runs ``trials // s3_share`` (its trials are slower)."""

    def local(trials: int) -> Outcome:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="reliability-") as directory:
            return function(trials, local_target(directory))

    def s3(trials: int) -> Outcome:
        from tests.reliability.scenarios_net import _upstream, new_bucket

        upstream = _upstream(None)
        return function(max(1, trials // s3_share), s3_target(upstream, new_bucket(upstream)))

    return local, s3


SCENARIOS = {}
for _name, _function, _s3_share in (
    ("fs_metadata_commit_faults", metadata_commit_faults, 1),
    ("fs_stream_exceptions", stream_exceptions, 1),
    ("fs_concurrent_commits", concurrent_commits, 10),
    ("fs_corruption", corruption, 2),
):
    SCENARIOS[f"{_name}_local"], SCENARIOS[f"{_name}_s3"] = _on_each_backend(
        _function, s3_share=_s3_share
    )
