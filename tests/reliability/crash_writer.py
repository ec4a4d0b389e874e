"""A checkpoint writer to be killed: writes checkpoints in a loop until it is SIGKILLed.

Each checkpoint: the coordinator creates ``chk-<id>``; a worker view (resolved from the
location reference, as an executor would) writes 1-4 state files of varied sizes (empty,
inline, just above the inline threshold, 1 MiB); then `_metadata` is stored and
finalized. Right after ``close_and_finalize_checkpoint()`` returns, the writer prints
``COMPLETED <id>`` and flushes, so that the parent knows which checkpoints it may never lose.
With ``--max-retained N`` it then adds each to a ``FileSystemCompletedCheckpointStore``,
which discards the ones beyond the newest N (and is recovered at each start).

It starts at one above the highest ``chk-<id>`` present (ids are never reused, as in Flink)
and prints ``READY <first id>`` once imported and set up.

    python tests/reliability/crash_writer.py checkpoints --checkpoint-dir DIR --job-id HEX
        [--seed N] [--endpoint-url URL]   # S3 (moto): credentials come from the environment

``spark`` mode instead runs the stateful runner on ``local[2,3]`` Spark (task retries, and
speculation on) over one day of input, checkpointing after every batch, while the first
attempt of partition 0 of every state write exits right after its state file was written
and the first attempt of partition 1 is SIGKILLed in the middle of writing its file. It
prints ``RESULT <json>`` with the checkpoints taken; the parent checks the storage.

    python tests/reliability/crash_writer.py spark --work-dir DIR

With ``--master spark://...`` (a standalone cluster of two worker hosts) it instead makes
attempt 0 of partition 2 a straggler (it sleeps after its write), so that speculation
launches a copy on the other host, which wins; the straggler is then killed by Spark.

    python tests/reliability/crash_writer.py spark --work-dir DIR --master spark://HOST:PORT
"""

import argparse
import json
import os
import random
import signal
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
if str(PROJECT_ROOT) not in sys.path:
    sys.path.insert(0, str(PROJECT_ROOT))

from checkpoint_storage import (  # noqa: E402 - after the path setup of a standalone script
    CheckpointedStateScope,
    CheckpointMetadata,
    CheckpointProperties,
    CompletedCheckpoint,
    FileSystemCheckpointStorage,
    FileSystemCompletedCheckpointStore,
    OperatorState,
    OperatorSubtaskState,
    store_checkpoint_metadata,
)

THRESHOLD = 20 * 1024
# Sizes of state: nothing, inline, around the threshold, and large (multipart on S3).
SIZES = (0, 1, 1024, THRESHOLD, THRESHOLD + 1, 100 * 1024, 1024 * 1024)
MASTER_STATE = "crash-writer"


def storage_for(checkpoint_dir: str, endpoint_url: str | None) -> FileSystemCheckpointStorage:
    options = {"endpoint_url": endpoint_url} if endpoint_url else None
    return FileSystemCheckpointStorage(
        checkpoint_dir, file_state_size_threshold=THRESHOLD, storage_options=options
    )


def write_checkpoint(access, checkpoint_id: int, rng: random.Random, store=None) -> None:
    location = access.initialize_location_for_checkpoint(checkpoint_id)
    # The worker side: resolve the reference, never touch directories.
    factory = access.resolve_checkpoint_storage_location(checkpoint_id, location.location_reference)
    subtasks = {}
    for subtask in range(rng.randint(1, 4)):
        size = rng.choice(SIZES)
        stream = factory.create_checkpoint_state_output_stream(
            CheckpointedStateScope.EXCLUSIVE, f"s{subtask}-"
        )
        try:
            payload = rng.randbytes(min(size, 64 * 1024)) if size else b""
            written = 0
            while written < size:
                chunk = payload[: min(len(payload), size - written)]
                stream.write(chunk)
                written += len(chunk)
            handle = stream.close_and_get_handle()
        except BaseException:
            stream.close()
            raise
        subtasks[subtask] = OperatorSubtaskState(
            () if handle is None else (handle,), {"size": str(size)}
        )
    metadata = CheckpointMetadata(
        checkpoint_id,
        (OperatorState("op", max(len(subtasks), 1), subtask_states=subtasks),),
        {MASTER_STATE: str(checkpoint_id).encode()},
        CheckpointProperties.for_checkpoint(),
        access.job_id,
        0,
    )
    out = location.create_metadata_output_stream()
    store_checkpoint_metadata(metadata, out)
    completed = out.close_and_finalize_checkpoint()
    print(f"COMPLETED {checkpoint_id}", flush=True)
    if store is not None:  # subsumes (discards) checkpoints beyond max_retained
        store.add_checkpoint(CompletedCheckpoint(completed, metadata))


def run_checkpoints(args) -> None:
    rng = random.Random(args.seed)
    access = storage_for(args.checkpoint_dir, args.endpoint_url).create_checkpoint_storage(
        args.job_id
    )
    access.initialize_base_locations()
    store = None
    if args.max_retained:
        # Recovery of the store subsumes what a kill left beyond max_retained.
        store = FileSystemCompletedCheckpointStore(access, args.max_retained)
    checkpoint_id = max(access._checkpoint_ids(), default=0) + 1
    print(f"READY {checkpoint_id} {os.getpid()}", flush=True)
    written = 0
    while not args.max_checkpoints or written < args.max_checkpoints:
        write_checkpoint(access, checkpoint_id, rng, store)
        checkpoint_id += 1
        written += 1


# --- spark mode: task attempts killed mid-write and after the write -----------------------

SPARK_PARTITION = "2026-10-01"
SPARK_BATCHES = 3


STRAGGLER_SLEEP = 30.0


def straggle(subtask: int, attempt: int) -> None:
    """``task_after_write``: attempt 0 of partition 2 stalls after its write, so that a
    speculative copy overtakes it."""
    if subtask == 2 and attempt == 0:
        import time

        time.sleep(STRAGGLER_SLEEP)


def _project_zip(target: Path) -> Path:
    import zipfile

    with zipfile.ZipFile(target, "w") as zf:
        # ``pipelines`` imports ``resources`` (``on_session_created``) on the executors too.
        for package in ("checkpoint_storage", "pipelines", "resources"):
            for path in sorted((PROJECT_ROOT / package).rglob("*.py")):
                zf.write(path, path.relative_to(PROJECT_ROOT).as_posix())
    return target


def kill_after_write(subtask: int, attempt: int) -> None:
    """``task_after_write``: attempt 0 of partition 0 dies (the Python worker exits) after
    its state file is complete, before the handle reaches the driver."""
    if subtask == 0 and attempt == 0:
        os._exit(17)


class _KillMidWrite:
    """A state stream that SIGKILLs its Python worker right after its first bytes reached
    the file: a torn state file, exactly what a task killed mid-write leaves."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, data) -> int:
        n = self._stream.write(data)
        self._stream.flush()  # the threshold is 0: this creates the file and pushes bytes
        os.kill(os.getpid(), signal.SIGKILL)
        return n

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _KillingFactory:
    def __init__(self, factory) -> None:
        self._factory = factory

    def create_checkpoint_state_output_stream(self, scope, name_prefix: str = ""):
        from pyspark import TaskContext

        stream = self._factory.create_checkpoint_state_output_stream(scope, name_prefix)
        context = TaskContext.get()
        if context is not None and context.partitionId() == 1 and context.attemptNumber() == 0:
            return _KillMidWrite(stream)
        return stream


class KillingStorage(FileSystemCheckpointStorage):
    """The storage config shipped to executors; its worker view kills attempt 0 of
    partition 1 mid-write. Defined in ``__main__``, so Spark ships it by value."""

    def create_checkpoint_storage(self, job_id):
        access = super().create_checkpoint_storage(job_id)
        resolve = access.resolve_checkpoint_storage_location

        def resolve_killing(checkpoint_id, reference):
            return _KillingFactory(resolve(checkpoint_id, reference))

        access.resolve_checkpoint_storage_location = resolve_killing
        return access


def run_spark(args) -> None:
    from pipelines import StatefulRunner
    from pipelines.examples.click_events import (
        FIRST_PARTITION,
        STAGES,
        click_events_pipeline,
        generate_day,
    )
    from resources import build_spark_session

    work = Path(args.work_dir)
    landing, reports = str(work / "landing"), str(work / "reports")
    generate_day(
        landing, SPARK_PARTITION, batches=SPARK_BATCHES, events_per_batch=300, users=40, seed=3
    )
    cluster = args.master is not None
    conf = {"spark.task.maxFailures": "3"}
    if cluster:
        python = os.path.abspath(sys.executable)
        conf |= {
            "spark.pyspark.python": python,
            "spark.pyspark.driver.python": python,
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.executor.memory": "512m",
            "spark.executor.cores": "1",
            "spark.cores.max": "2",
            "spark.speculation.minTaskRuntime": "100ms",
            "spark.locality.wait": "0s",
        }
    spark = build_spark_session(
        args.master or "local[2,3]",  # local: 2 cores, 3 attempts per task
        "reliability-task-kills",
        conf
        | {
            "spark.speculation": "true",
            "spark.speculation.interval": "100ms",
            "spark.speculation.quantile": "0.5",
            "spark.speculation.multiplier": "1.5",
            "spark.sql.shuffle.partitions": "4",
            "spark.default.parallelism": "4",
            "spark.ui.enabled": "false",
            "spark.driver.memory": "512m",
        },
    )
    spark.sparkContext.setLogLevel("FATAL")
    try:
        if cluster:
            spark.sparkContext.addPyFile(str(_project_zip(work / "project.zip")))
            storage = FileSystemCheckpointStorage(
                str(work / "checkpoints"), file_state_size_threshold=0
            )
            hook = straggle
        else:
            storage = KillingStorage(str(work / "checkpoints"), file_state_size_threshold=0)
            hook = kill_after_write
        assert SPARK_PARTITION == FIRST_PARTITION  # it starts from empty state
        # DataFrame stages: the crash points are their state files' writes
        pipeline = click_events_pipeline(landing, reports, checkpoint_interval=1, stages=STAGES)
        runner = StatefulRunner(spark, storage, pipeline, task_after_write=hook)
        (outcome,) = runner.run([SPARK_PARTITION])
        result = {
            "checkpoint_dir": str(work / "checkpoints"),
            "job_id": str(runner.job_id),
            "taken": [
                {"id": c.checkpoint_id, "pointer": c.pointer, "files": c.files_written}
                for c in outcome.checkpoints_taken
            ],
        }
    finally:
        spark.stop()
    print("RESULT " + json.dumps(result, sort_keys=True), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    modes = parser.add_subparsers(dest="mode", required=True)
    checkpoints = modes.add_parser("checkpoints")
    checkpoints.add_argument("--checkpoint-dir", required=True)
    checkpoints.add_argument("--job-id", required=True)
    checkpoints.add_argument("--endpoint-url")
    checkpoints.add_argument("--seed", type=int, default=0)
    checkpoints.add_argument("--max-checkpoints", type=int, default=0, help="0: until killed")
    checkpoints.add_argument(
        "--max-retained", type=int, default=0, help="add to a FileSystemCompletedCheckpointStore"
    )
    spark = modes.add_parser("spark")
    spark.add_argument("--work-dir", required=True)
    spark.add_argument("--master", help="a standalone master: speculation instead of kills")
    args = parser.parse_args(argv)
    if args.mode == "spark":
        run_spark(args)
    else:
        run_checkpoints(args)


if __name__ == "__main__":
    main()
