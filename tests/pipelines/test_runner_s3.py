"""The stateful runner with DataFrame stages and its checkpoints on S3 (moto's server on
127.0.0.1): the executors write and read state through the worker view at ``s3://bucket/...``.
(Keyed stages on S3: test_state_reader.py's savepoint on S3.)

Landing and report directories stay local: Spark itself cannot read s3:// here.
"""

import fsspec
import pytest

from checkpoint_storage import FileSystemCheckpointStorage, RelativeFileStateHandle
from pipelines import (
    FileSource,
    MissingStateError,
    SourcePosition,
    StatefulRunner,
    empty_state,
    job_id_for,
)
from pipelines.examples.click_events import (
    EVENT_ARROW_SCHEMA,
    NAME,
    STAGES,
    click_events_pipeline,
    generate_day,
)
from pipelines.examples.click_events.events import batch_urls
from pipelines.examples.click_events.stages import EVENT_SCHEMA
from tests.pipelines.support import InjectedFault, NoSpark, apply_batch_by_batch, rows

pytestmark = pytest.mark.timeout(900)

D1, D2 = "2026-10-01", "2026-10-02"
BATCHES = 3
INTERVAL = 2
JOB = job_id_for(NAME).hex


def make_runner(
    spark, s3_server, bucket: str, local, landing: str, chk: str = "chk", **kwargs
) -> StatefulRunner:
    storage = FileSystemCheckpointStorage(
        f"s3://{bucket}/{chk}",
        f"s3://{bucket}/sp",
        file_state_size_threshold=0,
        storage_options=s3_server.storage_options,
    )
    pipeline = click_events_pipeline(
        landing, str(local / "report"), checkpoint_interval=INTERVAL, max_retained_checkpoints=10,
        stages=STAGES,
    )
    return StatefulRunner(spark, storage, pipeline, **kwargs)


def restored_rows(runner: StatefulRunner, pointer: str) -> dict:
    metadata = runner.storage.resolve_checkpoint(pointer).load_metadata()
    states = runner.restore_states(metadata)
    try:
        return {name: rows(df) for name, df in states.items()}
    finally:
        for state in states.values():
            state.unpersist()


def file_handles(runner: StatefulRunner, pointer: str):
    return runner.storage.resolve_checkpoint(pointer).load_metadata().all_handles()


def s3_exists(s3_server, url: str) -> bool:
    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    fs.invalidate_cache()
    return fs.exists(url)


@pytest.fixture(scope="module")
def landing(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("landing"))
    generate_day(directory, D1, batches=BATCHES, events_per_batch=200, users=20)
    return directory


@pytest.fixture(scope="module")
def sample_states(spark, landing) -> dict:
    """The stages' state after the first day, computed without the runner, in 3 partitions."""
    data = spark.read.schema(EVENT_SCHEMA).parquet(*batch_urls(landing, D1))
    states = {}
    for stage in STAGES:
        state, data = stage.apply(data, empty_state(spark, stage))
        states[stage.name] = state.repartition(3).localCheckpoint(eager=True)
    return states


def test_empty_day_landed_on_s3_lists_no_batches(s3_server, s3_bucket):
    """A day landed on S3 without batches lists no batches, unlike a day that never landed
    (an object store has no empty directories)."""
    options = s3_server.storage_options
    landing = f"s3://{s3_bucket}/landing"
    generate_day(landing, D1, batches=0, storage_options=options)
    source = FileSource(
        url=f"{landing}/date={{partition}}",
        schema=EVENT_ARROW_SCHEMA,
        suffix=".parquet",
        storage_options=options,
    )
    with pytest.raises(FileNotFoundError, match=f"no input landed for partition {D2}"):
        source.batches(NoSpark(), D2)
    assert [] == source.batches(NoSpark(), D1)


def test_checkpoint_on_s3_restores_the_written_rows(
    spark, s3_server, s3_bucket, tmp_path, landing, sample_states
):
    """The executors write each partition's state to an s3:// file in the checkpoint's
    directory, and a restore reads the same rows back."""
    runner = make_runner(spark, s3_server, s3_bucket, tmp_path, landing)
    summary = runner.checkpoint(sample_states, SourcePosition(D1, BATCHES, True))
    handles = file_handles(runner, summary.pointer)
    prefix = f"s3://{s3_bucket}/chk/{JOB}/chk-1/"
    assert (
        (prefix.rstrip("/"), 6),
        {(RelativeFileStateHandle, True, True)},
        {name: rows(df) for name, df in sample_states.items()},
    ) == (
        (summary.pointer, len(handles)),
        {(type(h), h.path.startswith(prefix), s3_exists(s3_server, h.path)) for h in handles},
        restored_rows(runner, summary.pointer),
    )


def test_savepoint_on_s3_is_written_into_its_directory(
    spark, s3_server, s3_bucket, tmp_path, landing, sample_states
):
    """take_savepoint on S3: the executors write every state file into the savepoint's own
    s3:// directory, and it restores the checkpoint's rows."""
    runner = make_runner(spark, s3_server, s3_bucket, tmp_path, landing)
    runner.checkpoint(sample_states, SourcePosition(D1, BATCHES, True))
    savepoint = runner.take_savepoint()
    handles = file_handles(runner, savepoint.pointer)
    assert (
        (True, f"s3://{s3_bucket}/sp"),
        {(RelativeFileStateHandle, True)},
        {name: rows(df) for name, df in sample_states.items()},
    ) == (
        (savepoint.savepoint, savepoint.pointer.rsplit("/", 1)[0]),
        {(type(h), h.path == f"{savepoint.pointer}/{h.relative_path}") for h in handles},
        restored_rows(runner, savepoint.pointer),
    )


def test_missing_state_names_a_fitting_savepoint_on_s3(
    spark, s3_server, s3_bucket, tmp_path, landing, sample_states
):
    """Without a checkpoint to start from, the error names the s3:// savepoint that fits, by
    the pointer take_savepoint returned."""
    runner = make_runner(spark, s3_server, s3_bucket, tmp_path, landing)
    runner.checkpoint(sample_states, SourcePosition(D1, BATCHES, True))
    savepoint = runner.take_savepoint()
    fresh = make_runner(NoSpark(), s3_server, s3_bucket, tmp_path, landing, chk="fresh")
    with pytest.raises(MissingStateError) as failure:
        fresh.run([D2])
    assert f"restore_from: {savepoint.pointer}" in str(failure.value)


def test_recovery_on_s3_is_exactly_once(spark, s3_server, s3_bucket, tmp_path, landing):
    """After a crash past a mid-partition checkpoint on S3, a fresh runner resumes from it,
    applies only the remaining batches, and ends with the state and report of applying each
    batch exactly once."""

    def fault(point, **info):
        if point == "batch_applied" and info == {"partition": D1, "batch": BATCHES - 1}:
            raise InjectedFault()

    crashed = make_runner(spark, s3_server, s3_bucket, tmp_path, landing, fault_hook=fault)
    with pytest.raises(InjectedFault):
        crashed.run([D1])
    mid = crashed.store.latest()
    recovery = make_runner(spark, s3_server, s3_bucket, tmp_path, landing)
    (result,) = recovery.run([D1])
    expected_states, expected_report = apply_batch_by_batch(spark, landing, (D1,))
    assert (
        (SourcePosition(D1, INTERVAL, False), f"s3://{s3_bucket}/chk/{JOB}"),
        (mid.external_pointer, BATCHES - INTERVAL),
        expected_states,
        expected_report,
    ) == (
        (SourcePosition.of(mid.metadata), mid.external_pointer.rsplit("/", 1)[0]),
        (result.restored_from, result.batches_applied),
        restored_rows(recovery, result.checkpoint.pointer),
        rows(spark.read.parquet(str(tmp_path / "report"))),
    )
