"""Crash scenarios of issue 7: writers SIGKILLed at random moments, and Spark task attempts
killed mid-write and after the write (retries and speculation on).

Each scenario function takes a trial count and returns ``(trials, failures, figure)``; the
pytest suite (test_crashes.py, test_spark_task_kills.py) runs them with small N and
``benchmarks/reliability.py`` with large N. ``SCENARIOS`` lists them for the runner.
"""

import contextlib
import json
import os
import random
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from checkpoint_storage import (
    CheckpointNotFoundError,
    FileStateHandle,
    FileSystemCheckpointStorage,
    InvalidCheckpointError,
    UnsafePathError,
    collect_garbage,
    verify_checkpoint,
)
from checkpoint_storage._filesystems import METADATA_FILE_NAME, join

HERE = Path(__file__).resolve().parent
WRITER = HERE / "crash_writer.py"
PYTHON = os.path.abspath(sys.executable)
JOB_ID = "c0ffee" + "0" * 26
KILLS_PER_JOB = 10  # then a fresh job directory, so that checks stay cheap and disk bounded
STORE_RETAINED = 2  # odd jobs add each checkpoint to a store that retains this many
READY_TIMEOUT = 30.0
SPARK_TIMEOUT = 240.0

__all__ = [
    "SCENARIOS",
    "CrashStats",
    "check_recovery",
    "moto_endpoint",
    "run_crash_trials",
    "sigkill_local",
    "sigkill_s3",
    "spark_task_kills",
]


# --- SIGKILL of a checkpoint writer ------------------------------------------------------


@dataclass
class CrashStats:
    kills: int = 0
    completed_reported: int = 0  # ids the writer reported as completed before it was killed
    completed_found: int = 0  # completed checkpoints found over all recoveries (new ones)
    incomplete_found: int = 0  # chk-<id> left without `_metadata` by a kill
    subsumed: int = 0  # verified checkpoints later discarded by the store's retention
    phases: dict[str, int] = field(default_factory=dict)  # where the kills landed
    recovery_ms: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def figure(self) -> str:
        p50 = statistics.median(self.recovery_ms) if self.recovery_ms else 0.0
        return (
            f"kills={self.kills} reported_completed={self.completed_reported} "
            f"verified_by_recovery={self.completed_found} "
            f"left_incomplete={self.incomplete_found} "
            f"recovery_correct={self.kills - self._failed_trials()}/{self.kills} "
            f"recovery_p50={p50:.0f}ms subsumed_by_store={self.subsumed} "
            f"kill_phases={dict(sorted(self.phases.items()))}"
        )

    def _failed_trials(self) -> int:
        return len({p.split(":", 1)[0] for p in self.problems})


@dataclass
class _Known:
    """What the parent knows of one job directory across kills."""

    reported: set[int] = field(default_factory=set)
    verified: dict[int, list[tuple[str, int]]] = field(default_factory=dict)  # id -> files
    max_retained: int = 0  # the writer's store retains this many (0: no store)
    subsumed: set[int] = field(default_factory=set)
    phase: str = ""  # where the last kill landed, judged from the newest chk-<id>


def check_recovery(storage: FileSystemCheckpointStorage, job_id: str, known: _Known) -> list[str]:
    """After a kill: every ``chk-<id>`` is either incomplete (no `_metadata`) or complete and
    valid (new ones are verified byte for byte, earlier ones by one listing: every file
    they reference still there with its size); every id the writer reported is complete;
    ``latest_completed_checkpoint()`` is the newest valid one. Returns the problems."""
    problems = []
    access = storage.create_checkpoint_storage(job_id)
    fs = access._fs
    job = access._path(access.checkpoints_directory)
    fs.invalidate_cache(job)
    listing = {name.rstrip("/"): info for name, info in fs.find(job, detail=True).items()}
    valid = []
    with_metadata = []  # what latest_completed_checkpoint() may pick: a valid `_metadata`
    present = access._checkpoint_ids()
    for checkpoint_id in present:
        directory = join(access.checkpoints_directory, f"chk-{checkpoint_id}")
        if checkpoint_id in known.verified:
            missing = [
                path
                for path, size in known.verified[checkpoint_id]
                if listing.get(path, {}).get("size") != size
            ]
            if join(job, f"chk-{checkpoint_id}", METADATA_FILE_NAME) not in listing:
                missing.append(METADATA_FILE_NAME)
            else:
                with_metadata.append(checkpoint_id)
            if not missing:
                valid.append(checkpoint_id)
            elif METADATA_FILE_NAME in missing and _subsumable(known, checkpoint_id, listing, job):
                known.subsumed.add(checkpoint_id)  # discarded by retention, `_metadata` first
            else:
                problems.append(f"chk-{checkpoint_id} lost files after a later kill: {missing}")
            continue
        try:
            location = access.resolve_checkpoint(directory)
            report = verify_checkpoint(location, max_workers=4)
        except CheckpointNotFoundError:
            continue  # never completed: invisible
        except (InvalidCheckpointError, UnsafePathError) as exc:
            problems.append(f"chk-{checkpoint_id} visible with an invalid _metadata: {exc}")
            continue
        with_metadata.append(checkpoint_id)
        if not report.ok:
            problems.append(
                f"chk-{checkpoint_id} visible as complete with bad files: "
                f"{[p.message for p in report.problems]}"
            )
            continue
        if report.checkpoint_id != checkpoint_id:
            problems.append(f"chk-{checkpoint_id} holds checkpoint {report.checkpoint_id}")
            continue
        files = [
            (access._path(h.path), h.state_size)
            for h in location.load_metadata().all_handles()
            if isinstance(h, FileStateHandle)
        ]
        known.verified[checkpoint_id] = files
        valid.append(checkpoint_id)
    for checkpoint_id in set(known.verified) - set(valid) - known.subsumed:
        if checkpoint_id not in present:  # the whole directory went
            if _subsumable(known, checkpoint_id, listing, job):
                known.subsumed.add(checkpoint_id)
            else:
                problems.append(f"chk-{checkpoint_id} vanished")
    known.phase = _phase(listing, job, max(present, default=None))
    for checkpoint_id in known.reported - set(valid) - known.subsumed:
        if checkpoint_id not in known.verified and _subsumable(known, checkpoint_id, listing, job):
            known.subsumed.add(checkpoint_id)  # discarded before this process first saw it
    lost = sorted(known.reported - set(valid) - known.subsumed)
    if lost:
        problems.append(f"reported completed but not valid now: {lost}")
    latest = access.latest_completed_checkpoint()
    # It validates `_metadata` only (reading every state file would cost a restore): a
    # checkpoint with bad files is reported above, not here.
    expected = f"chk-{max(with_metadata)}" if with_metadata else None
    actual = None if latest is None else latest.external_pointer.rstrip("/").rsplit("/", 1)[1]
    if expected != actual:
        problems.append(f"latest_completed_checkpoint() is {actual}, newest valid is {expected}")
    return problems


def _subsumable(known: _Known, checkpoint_id: int, listing: dict, job: str) -> bool:
    """Whether a store retaining ``max_retained`` may have discarded ``checkpoint_id``: it
    does so only once that many newer checkpoints are complete."""
    if not known.max_retained:
        return False
    newer = [
        name
        for name in listing
        if name.endswith("/" + METADATA_FILE_NAME)
        and (chk := name[len(job) + 1 :].split("/")[0]).startswith("chk-")
        and int(chk[4:]) > checkpoint_id
    ]
    return len(newer) >= known.max_retained


def _phase(listing: dict, job: str, newest: int | None) -> str:
    """Where the kill landed, from what the newest ``chk-<id>`` holds."""
    if newest is None:
        return "before the first checkpoint"
    prefix = f"{job}/chk-{newest}/"
    names = [name[len(prefix) :] for name in listing if name.startswith(prefix)]
    if METADATA_FILE_NAME in names:
        return "after the _metadata commit"
    if any(n.endswith(".inprogress") for n in names):
        return "inside the _metadata commit"
    if names:
        return "while writing state"
    return "after creating chk-<id>"


def _read_lines(proc: subprocess.Popen, until: float) -> Iterator[str]:
    """Lines of the child's stdout until EOF or the deadline."""
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    buffer = b""
    try:
        while (remaining := until - time.monotonic()) > 0:
            if not selector.select(remaining):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                yield line.decode()
    finally:
        selector.close()


def run_crash_trials(
    trials: int,
    checkpoint_dir: str,
    *,
    endpoint_url: str | None = None,
    seed: int = 0,
    max_delay: float = 0.1,
) -> CrashStats:
    """``trials`` times: start crash_writer.py, SIGKILL it a random 0..``max_delay`` s after
    it is ready, then check recovery in this process. Every ``KILLS_PER_JOB`` kills the
    writer moves on to a fresh job directory below ``checkpoint_dir``."""
    rng = random.Random(seed)
    stats = CrashStats()
    options = {"endpoint_url": endpoint_url} if endpoint_url else None
    known = _Known()
    job_dirs: list[str] = []
    for trial in range(trials):
        if trial % KILLS_PER_JOB == 0:
            base = join(checkpoint_dir, f"job{trial // KILLS_PER_JOB}")
            job_dirs.append(base)
            storage = FileSystemCheckpointStorage(
                base, file_state_size_threshold=20 * 1024, storage_options=options
            )
            known = _Known(max_retained=STORE_RETAINED if trial // KILLS_PER_JOB % 2 else 0)
            if len(job_dirs) > 1 and endpoint_url is None:
                shutil.rmtree(job_dirs[-2], ignore_errors=True)  # checked already
        command = [
            PYTHON,
            str(WRITER),
            "checkpoints",
            "--checkpoint-dir",
            base,
            "--job-id",
            JOB_ID,
            "--seed",
            str(seed * 100_003 + trial),
        ]
        if endpoint_url:
            command += ["--endpoint-url", endpoint_url]
        if known.max_retained:
            command += ["--max-retained", str(known.max_retained)]
        with tempfile.TemporaryFile() as stderr:
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr)
            reported: list[int] = []
            ready = False
            died = None
            try:
                lines = _read_lines(proc, time.monotonic() + READY_TIMEOUT)
                for line in lines:
                    if line.startswith("READY"):
                        ready = True
                        break
                if ready:
                    time.sleep(rng.uniform(0, max_delay))
                if proc.poll() is not None:
                    died = proc.returncode
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                for line in _read_lines(proc, time.monotonic() + 10):
                    if line.startswith("COMPLETED "):
                        reported.append(int(line.split()[1]))
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                proc.stdout.close()
            stats.kills += 1
            if not ready or died is not None:
                stderr.seek(0)
                tail = stderr.read()[-2000:].decode(errors="replace")
                stats.problems.append(f"trial {trial}: writer not ready or died ({died}): {tail}")
                continue
        known.reported.update(reported)
        stats.completed_reported += len(reported)
        before = len(known.verified)
        started = time.monotonic()
        try:
            problems = check_recovery(storage, JOB_ID, known)
        except Exception as exc:  # noqa: BLE001 - a failed recovery is a failed trial
            problems = [f"recovery raised {type(exc).__name__}: {exc}"]
        stats.recovery_ms.append((time.monotonic() - started) * 1000)
        stats.completed_found += len(known.verified) - before
        stats.phases[known.phase] = stats.phases.get(known.phase, 0) + 1
        if trial % KILLS_PER_JOB == KILLS_PER_JOB - 1 or trial == trials - 1:
            stats.subsumed += len(known.subsumed)
        stats.problems += [f"trial {trial}: {p}" for p in problems]
        access = storage.create_checkpoint_storage(JOB_ID)
        ids = access._checkpoint_ids()
        if ids and max(ids) not in known.verified:
            stats.incomplete_found += 1
    return stats


def sigkill_local(trials: int, base_dir: str | None = None) -> tuple[int, int, str]:
    """SIGKILL at random moments during checkpoint writes on local disk."""
    with tempfile.TemporaryDirectory(dir=base_dir) as directory:
        stats = run_crash_trials(trials, directory, seed=1)
    return (
        stats.kills,
        len({p.split(":", 1)[0] for p in stats.problems}),
        _with_first_problem(stats),
    )


def sigkill_s3(trials: int, endpoint_url: str | None = None) -> tuple[int, int, str]:
    """SIGKILL at random moments during checkpoint writes on S3 (moto's server)."""
    with contextlib.ExitStack() as stack:
        if endpoint_url is None:
            endpoint_url = stack.enter_context(moto_endpoint())
        bucket = _new_bucket(endpoint_url)
        stats = run_crash_trials(
            trials, f"s3://{bucket}/crash", endpoint_url=endpoint_url, seed=2, max_delay=0.3
        )
    return (
        stats.kills,
        len({p.split(":", 1)[0] for p in stats.problems}),
        _with_first_problem(stats),
    )


def _with_first_problem(stats: CrashStats) -> str:
    if not stats.problems:
        return stats.figure()
    return f"{stats.figure()} first_problem={stats.problems[0][:300]!r}"


def _new_bucket(endpoint_url: str) -> str:
    import boto3

    name = f"crash-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=endpoint_url).create_bucket(Bucket=name)
    return name


def moto_endpoint():
    """A moto S3 server on 127.0.0.1 for the runner (pytest uses its ``s3_server``)."""
    from tests.reliability.scenarios_net import moto_server

    return moto_server()


# --- Spark task attempts killed ----------------------------------------------------------


@dataclass
class SparkKillReport:
    checkpoint_ids: list[int]
    completed_per_id: dict[int, int]
    problems: list[str]
    killed_attempts: int  # orphan files of attempt 0 (one per killed attempt)
    expected_kills: int  # attempt 0 of partitions 0 and 1 of every stage and checkpoint
    stray_orphans: list[str]  # unreferenced files that no killed/overtaken attempt wrote
    referenced_attempts: set[str]  # "attempt" properties of the subtasks that were killed
    orphans: list[str]
    gc_deleted: list[str]
    referenced_after_gc_ok: bool
    speculative: int
    seconds: float


def _spark_driver(
    work_dir: Path, master: str | None = None, env: dict | None = None
) -> tuple[dict, float]:
    started = time.monotonic()
    env = dict(os.environ if env is None else env)
    env.pop("PYSPARK_PYTHON", None)
    env.pop("PYSPARK_DRIVER_PYTHON", None)
    command = [PYTHON, str(WRITER), "spark", "--work-dir", str(work_dir)]
    if master:
        command += ["--master", master]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: the JVM and Python workers too
    )
    try:
        out, err = proc.communicate(timeout=SPARK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the driver's group
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"spark driver failed ({proc.returncode}): {err[-3000:]}{out[-1000:]}")
    return json.loads(lines[-1].removeprefix("RESULT ")), time.monotonic() - started


def check_spark_run(
    work_dir: Path, master: str | None = None, env: dict | None = None
) -> SparkKillReport:
    """Run the Spark driver, then check its storage: one completed checkpoint per id, every
    referenced file valid, the killed attempts' files unreferenced orphans that
    collect_garbage (grace 0) removes, and nothing referenced removed."""
    result, seconds = _spark_driver(work_dir, master, env)
    storage = FileSystemCheckpointStorage(result["checkpoint_dir"], file_state_size_threshold=0)
    access = storage.create_checkpoint_storage(result["job_id"])
    fs = access._fs
    job = access._path(access.checkpoints_directory)
    problems: list[str] = []
    ids = [c["id"] for c in result["taken"]]
    completed: dict[int, int] = {}
    referenced: set[str] = set()
    attempts: set[str] = set()
    speculative = 0  # referenced states of partition >= 2 written by a later attempt
    expected = 0
    stragglers = 0
    for checkpoint_id in access._checkpoint_ids():
        location = access.resolve_checkpoint(
            join(access.checkpoints_directory, f"chk-{checkpoint_id}")
        )
        report = verify_checkpoint(location)
        if not report.ok:
            problems.append(f"chk-{checkpoint_id}: {[p.message for p in report.problems]}")
        metadata = location.load_metadata()
        completed[metadata.checkpoint_id] = completed.get(metadata.checkpoint_id, 0) + 1
        referenced.add(join(job, f"chk-{checkpoint_id}", METADATA_FILE_NAME))
        for op in metadata.operator_states:
            expected += len({0, 1} & set(op.subtask_states))
            stragglers += 2 in op.subtask_states
            for subtask, state in op.subtask_states.items():
                for handle in state.handles:
                    if isinstance(handle, FileStateHandle):
                        referenced.add(access._path(handle.path))
                if subtask in (0, 1):
                    attempts.add(state.properties["attempt"])
                elif state.properties["attempt"] != "0":
                    speculative += 1
    # State files only: task-owned state and the job lease's records are not GC's to take.
    files = {
        name.rstrip("/")
        for name, info in fs.find(job, detail=True).items()
        if info.get("type") == "file" and "/taskowned/" not in name and "/_lease/" not in name
    }
    orphans = sorted(files - referenced)
    missing = sorted(referenced - files)
    if missing:
        problems.append(f"referenced but missing: {missing}")
    killed = sum(1 for path in orphans if any(f"-{s:05d}-a0-" in path for s in (0, 1)))
    losers = ("-00000-a0-", "-00001-a0-")
    if master:  # speculation: the overtaken attempt 0 of partition 2 is the loser
        losers = ("-00002-a0-",)
        killed = sum(1 for path in orphans if "-00002-a0-" in path)
        expected = stragglers
    strays = [path for path in orphans if not any(loser in path for loser in losers)]
    gc = collect_garbage(access, grace_period=0)
    deleted = sorted(access._path(url) for url in gc.deleted)
    after = {
        name.rstrip("/")
        for name, info in fs.find(job, detail=True).items()
        if info.get("type") == "file"
    }
    referenced_ok = referenced <= after
    for checkpoint_id in access._checkpoint_ids():
        location = access.resolve_checkpoint(
            join(access.checkpoints_directory, f"chk-{checkpoint_id}")
        )
        if not verify_checkpoint(location).ok:
            problems.append(f"chk-{checkpoint_id} invalid after garbage collection")
    return SparkKillReport(
        ids,
        completed,
        problems,
        killed,
        expected,
        strays,
        attempts,
        orphans,
        deleted,
        referenced_ok,
        speculative,
        seconds,
    )


def spark_task_kills(runs: int, *, speculation: bool = False) -> tuple[int, int, str]:
    """Spark task attempts killed mid-write and after the write on ``local[2,3]`` (or, with
    ``speculation``, overtaken by speculative copies on a two-host cluster); ``runs`` driver
    runs. A trial is one killed (or overtaken) attempt."""
    trials = failures = 0
    figures = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as directory:
            try:
                check = check_speculation_run if speculation else check_spark_run
                report = check(Path(directory))
            except Exception as exc:  # noqa: BLE001 - a failed run is a failed trial
                trials += 1
                failures += 1
                figures.append(f"run failed: {str(exc)[-300:]!r}")
                continue
        ok = (
            not report.problems
            and all(report.completed_per_id.get(i) == 1 for i in report.checkpoint_ids)
            and sorted(report.completed_per_id) == sorted(report.checkpoint_ids)
            and not report.stray_orphans
            # A killed worker leaves its file; an overtaken one that Spark kills mid-write
            # may abort (delete) it first.
            and (
                report.killed_attempts <= report.expected_kills
                if speculation
                else report.killed_attempts == report.expected_kills
            )
            and report.orphans == report.gc_deleted
            and report.referenced_after_gc_ok
            and report.referenced_attempts == ({"0"} if speculation else {"1"})
            and report.speculative == (report.expected_kills if speculation else 0)
        )
        trials += report.expected_kills or 1
        failures += 0 if ok else max(report.expected_kills, 1)
        figures.append(
            f"checkpoints={len(report.checkpoint_ids)} killed_attempts={report.expected_kills} "
            f"loser_files={report.killed_attempts} "
            f"orphans={len(report.orphans)} gc_removed={len(report.gc_deleted)} "
            f"speculative_attempts={report.speculative} {report.seconds:.0f}s"
            + ("" if ok else f" problems={report.problems[:2]}")
        )
    return trials, failures, "; ".join(figures)


# --- speculation on a standalone cluster of two worker hosts -----------------------------


@contextlib.contextmanager
def two_host_cluster(root: Path) -> Iterator[object]:
    """A standalone master and two workers, on 127.0.0.1 and 127.0.0.2 (Linux routes all of
    127/8 to loopback): Spark only launches a speculative copy on another host than the
    original attempt's, so local mode and one-worker clusters never speculate. Built on the
    harness of tests/pipelines/standalone_cluster.py; every process is stopped on exit."""
    from tests.pipelines import standalone_cluster

    class TwoHostCluster(standalone_cluster.Cluster):
        def start(self) -> None:
            super().start()
            self._spawn("worker2", [
                standalone_cluster.SPARK_CLASS, "org.apache.spark.deploy.worker.Worker",
                "--host", "127.0.0.2", "--port", 0, "--webui-port", 0, "--cores", 1,
                "--memory", "1g", "--work-dir", self.work_dir, self.url,
            ])
            deadline = time.monotonic() + standalone_cluster.STARTUP_TIMEOUT
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError, ValueError):
                    workers = self.master_state().get("workers", [])
                    if sum(w.get("state") == "ALIVE" for w in workers) >= 2:
                        return
                time.sleep(0.3)
            raise TimeoutError(f"the second worker did not register:\n{self.logs()}")

    cluster = TwoHostCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        survivors = cluster.stop()
        if survivors:
            raise RuntimeError(f"cluster processes survived SIGKILL: {survivors}")


def check_speculation_run(work_dir: Path) -> SparkKillReport:
    """The runner on a two-host cluster with speculation, attempt 0 of partition 2 a
    straggler; then the same storage checks as ``check_spark_run``."""
    with two_host_cluster(work_dir / "cluster") as cluster:
        driver = work_dir / "driver"
        driver.mkdir()
        return check_spark_run(driver, master=cluster.url, env=cluster.env())


SCENARIOS = {
    "sigkill_local": sigkill_local,
    "sigkill_s3": sigkill_s3,
    # One Spark run kills 9 task attempts and takes about 30 s: 1 run per 100 trials.
    "spark_task_kills": lambda trials: spark_task_kills(max(1, trials // 100)),
    # A two-host standalone cluster: about 75 s per run, 3 overtaken attempts each.
    "spark_speculation": lambda trials: spark_task_kills(
        max(1, trials // 200), speculation=True
    ),
}
