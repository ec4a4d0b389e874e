"""Reading the state of a pipeline's checkpoints and savepoints: the Spark-free reader
(``pipelines.read_state``), the Spark data source ``checkpoint`` and ``checkpoints read``
return the rows the runner restores, verify what they read, and say clearly what is wrong.

One real run of the click-events pipeline (two days, local[2]) and a savepoint serve every
test; tests that break state do it in a copy of the savepoint (savepoints are relocatable).
"""

import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from checkpoint_storage import (
    CheckpointMetadata,
    CheckpointNotFoundError,
    FileStateHandle,
    FileSystemCheckpointStorage,
    InvalidCheckpointError,
    JobID,
    StateIntegrityError,
    copy_savepoint,
    store_checkpoint_metadata,
)
from pipelines import (
    StatefulRunner,
    UnknownStageError,
    open_snapshot,
    read_state,
    register_checkpoint_source,
    state_stages,
)
from pipelines.examples.click_events import click_events_pipeline, generate_day
from resources import SparkResource
from tests.pipelines.support import run_read_cli as run_cli

pytestmark = pytest.mark.timeout(900)

DAYS = ("2026-10-01", "2026-10-02")
STAGES = ["dedupe", "user_activity"]
# Between the sizes of the stages' Parquet files: some state is inline, some in files.
FILE_STATE_THRESHOLD = 4000
# tests/conftest.py sets these before Spark starts, so the executors have them too.
CREDENTIALS_FROM_ENV = {"key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY"}


@dataclass(frozen=True)
class Snapshots:
    runner: StatefulRunner
    checkpoints: list[str]
    savepoint: str
    work: Path


def table_rows(table: pa.Table) -> list[tuple]:
    return sorted((tuple(row.values()) for row in table.to_pylist()), key=repr)


def restored_rows(runner: StatefulRunner, pointer: str) -> dict[str, list[tuple]]:
    """Each stage's rows as the runner restores them from ``pointer``."""
    states = runner.restore_states(runner.storage.resolve_checkpoint(pointer).load_metadata())
    try:
        return {name: table_rows(df.toArrow()) for name, df in states.items()}
    finally:
        for state in states.values():
            state.unpersist()


@pytest.fixture(scope="module")
def snapshots(spark, tmp_path_factory) -> Snapshots:
    work = tmp_path_factory.mktemp("state-reader")
    for day in DAYS:
        generate_day(str(work / "landing"), day, batches=3, events_per_batch=200, users=20)
    storage = FileSystemCheckpointStorage(
        str(work / "checkpoints"),
        str(work / "savepoints"),
        file_state_size_threshold=FILE_STATE_THRESHOLD,
    )
    pipeline = click_events_pipeline(
        str(work / "landing"), str(work / "reports"), checkpoint_interval=2,
        max_retained_checkpoints=10,
    )
    runner = StatefulRunner(spark, storage, pipeline)
    results = runner.run(list(DAYS))
    checkpoints = [c.pointer for result in results for c in result.checkpoints_taken]
    savepoint = runner.take_savepoint().pointer
    register_checkpoint_source(spark)
    return Snapshots(runner, checkpoints, savepoint, work)


@pytest.fixture(scope="module")
def expected(snapshots) -> dict[str, dict[str, list[tuple]]]:
    """Pointer -> stage -> rows restored by the runner, for a mid-partition checkpoint, the
    last checkpoint and the savepoint."""
    pointers = [snapshots.checkpoints[0], snapshots.checkpoints[-1], snapshots.savepoint]
    return {pointer: restored_rows(snapshots.runner, pointer) for pointer in pointers}


def broken_copy(snapshots: Snapshots, tmp_path: Path) -> tuple[str, str, str]:
    """A copy of the savepoint, a stage with state in files, and one of its files."""
    pointer = str(shutil.copytree(snapshots.savepoint, tmp_path / "copy"))
    metadata = open_snapshot(pointer).metadata
    return next(
        (pointer, op.operator_id, handle.path)
        for op in metadata.operator_states
        for state in op.subtask_states.values()
        for handle in state.handles
        if isinstance(handle, FileStateHandle)
    )


def flip_a_byte(path: str) -> None:
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(path).write_bytes(bytes(data))




# --- the Python reader ---------------------------------------------------------------------


def test_reader_returns_the_rows_the_runner_restores(snapshots, expected):
    """For checkpoints and a savepoint, each stage's rows read without Spark equal the state
    the runner restores, and the snapshot holds both inline and file state."""
    kinds = {
        type(h).__name__
        for h in open_snapshot(snapshots.savepoint).metadata.all_handles()
    }
    read = {
        pointer: {stage: table_rows(read_state(pointer, stage)) for stage in STAGES}
        for pointer in expected
    }

    assert ({"ByteStreamStateHandle", "RelativeFileStateHandle"}, expected) == (kinds, read)


def test_stages_are_listed_in_pipeline_order(snapshots):
    """A checkpoint and a savepoint list the pipeline's stages."""
    assert [STAGES, STAGES] == [
        state_stages(snapshots.checkpoints[-1]), state_stages(snapshots.savepoint)
    ]


def test_where_and_limit_select_rows(snapshots, expected):
    """``where`` values convert to the column's type (text for numbers and times too) and
    keep the equal rows; ``limit`` caps the rows."""
    all_rows = expected[snapshots.savepoint]["user_activity"]
    user, count, _, first_seen, _ = all_rows[3]
    read = [
        table_rows(read_state(snapshots.savepoint, "user_activity", where=where))
        for where in (
            {"user_id": user},
            {"event_count": str(count)},
            {"first_seen": first_seen.isoformat(), "user_id": user},
            {"first_seen": first_seen.replace(tzinfo=None).isoformat()},
        )
    ]
    limited = read_state(snapshots.savepoint, "dedupe", limit=5).num_rows

    assert (
        [
            [r for r in all_rows if r[0] == user],
            [r for r in all_rows if r[1] == count],
            [r for r in all_rows if r[0] == user],
            [r for r in all_rows if r[3] == first_seen],
        ],
        5,
    ) == (read, limited)


def test_where_rejects_unknown_columns_and_values_of_another_type(snapshots):
    """An unknown column is named with the columns there are; a value that does not convert
    is named with the column and its type."""
    with pytest.raises(ValueError, match="unknown column 'nope'; the columns are: user_id, "):
        read_state(snapshots.savepoint, "user_activity", where={"nope": 1})
    with pytest.raises(ValueError, match="'many' is no value of column 'event_count' \\(type int"):
        read_state(snapshots.savepoint, "user_activity", where={"event_count": "many"})


def test_unknown_stage_names_the_stages_present(snapshots):
    """Asking for a stage the snapshot has no state of lists the stages it has."""
    with pytest.raises(UnknownStageError, match="its stages are: dedupe, user_activity"):
        read_state(snapshots.savepoint, "sessions")


def test_a_corrupt_state_file_is_named(snapshots, tmp_path):
    """A flipped byte in a state file fails its checksum; the error names the stage and
    the file."""
    pointer, stage, path = broken_copy(snapshots, tmp_path)
    flip_a_byte(path)

    with pytest.raises(StateIntegrityError, match=f"stage '{stage}': state file {path} does not"):
        read_state(pointer, stage)


def test_a_missing_state_file_is_named(snapshots, tmp_path):
    """A deleted state file makes the snapshot invalid; the error names the file."""
    pointer, stage, path = broken_copy(snapshots, tmp_path)
    Path(path).unlink()

    with pytest.raises(InvalidCheckpointError, match=f"state file {path} is missing"):
        read_state(pointer, stage)


def test_a_checkpoint_not_written_by_a_pipeline_is_refused(tmp_path):
    """A checkpoint without the pipeline's master states is no pipeline checkpoint."""
    access = FileSystemCheckpointStorage(str(tmp_path)).create_checkpoint_storage(JobID("1" * 32))
    access.initialize_base_locations()
    out = access.initialize_location_for_checkpoint(1).create_metadata_output_stream()
    store_checkpoint_metadata(CheckpointMetadata(1), out)
    pointer = out.close_and_finalize_checkpoint().external_pointer

    with pytest.raises(InvalidCheckpointError, match="not one a pipeline wrote"):
        state_stages(pointer)


def test_a_pointer_without_a_checkpoint_is_not_found(tmp_path):
    """A pointer at nothing raises CheckpointNotFoundError."""
    with pytest.raises(CheckpointNotFoundError):
        state_stages(str(tmp_path / "nothing"))


def test_a_savepoint_on_s3_reads_with_and_without_spark(
    spark, snapshots, expected, s3_server, s3_bucket, tmp_path
):
    """A savepoint copied to S3 (moto) reads back the same rows through storage options: in
    Python, in Spark with the credentials taken from each executor's environment, and with
    ``checkpoints read --storage-option``."""
    options = s3_server.storage_options
    pointer = copy_savepoint(
        snapshots.savepoint, f"s3://{s3_bucket}/savepoints", target_storage_options=options
    )
    read = {
        stage: table_rows(read_state(pointer, stage, storage_options=options)) for stage in STAGES
    }
    frame = (
        spark.read.format("checkpoint")
        .option("stage", "dedupe")
        .option("storage_options", json.dumps(options))
        .option("storage_options_from_env", json.dumps(CREDENTIALS_FROM_ENV))
        .load(pointer)
    )
    cli = run_cli(
        pointer, "--stage", "user_activity", "--parquet", str(tmp_path / "out.parquet"),
        "-o", f"endpoint_url={options['endpoint_url']}",
    )

    assert (
        expected[snapshots.savepoint],
        expected[snapshots.savepoint]["dedupe"],
        (0, expected[snapshots.savepoint]["user_activity"]),
    ) == (
        read,
        table_rows(frame.toArrow()),
        (cli.exit_code, table_rows(pq.read_table(tmp_path / "out.parquet"))),
    )


# --- the Spark data source -----------------------------------------------------------------


def test_spark_source_returns_the_restored_rows_in_parallel(spark, snapshots, expected):
    """``spark.read.format("checkpoint")`` returns each stage's restored rows, one input
    partition per state handle, for a checkpoint and the savepoint; a SparkResource's
    session has the format too."""
    pointers = [snapshots.checkpoints[-1], snapshots.savepoint]
    frames = {
        pointer: {
            stage: spark.read.format("checkpoint").option("stage", stage).load(pointer)
            for stage in STAGES
        }
        for pointer in pointers
    }
    handles = {
        pointer: {stage: len(open_snapshot(pointer).parts(stage)) for stage in STAGES}
        for pointer in pointers
    }
    resource_rows = table_rows(
        SparkResource(master="local[2]").session.read.format("checkpoint")
        .option("stage", "user_activity").load(snapshots.savepoint).toArrow()
    )

    assert (
        {pointer: expected[pointer] for pointer in pointers},
        handles,
        expected[snapshots.savepoint]["user_activity"],
    ) == (
        {p: {s: table_rows(df.toArrow()) for s, df in by.items()} for p, by in frames.items()},
        {p: {s: df.rdd.getNumPartitions() for s, df in by.items()} for p, by in frames.items()},
        resource_rows,
    )


def test_spark_source_names_the_stages_when_the_stage_is_wrong(spark, snapshots):
    """A missing or unknown ``stage`` option fails with the stages the snapshot has."""
    reader = spark.read.format("checkpoint")
    with pytest.raises(Exception, match="needs option \"stage\".*dedupe, user_activity"):
        reader.load(snapshots.savepoint).schema  # noqa: B018 - resolving the schema fails
    with pytest.raises(Exception, match="its stages are: dedupe, user_activity"):
        reader.option("stage", "sessions").load(snapshots.savepoint).schema  # noqa: B018


# --- checkpoints read ----------------------------------------------------------------------


def test_cli_exports_the_restored_rows(snapshots, expected, tmp_path):
    """--json (JSON lines), --csv and --parquet give back each stage's restored rows."""
    pointer = snapshots.savepoint
    exported = {}
    for stage in STAGES:
        schema = open_snapshot(pointer).schema(stage)
        as_json = run_cli(pointer, "--stage", stage, "--json")
        as_csv = run_cli(pointer, "--stage", stage, "--csv")
        target = tmp_path / f"{stage}.parquet"
        as_parquet = run_cli(pointer, "--stage", stage, "--parquet", str(target))
        json_rows = [json.loads(line) for line in as_json.stdout.splitlines()]
        csv_table = pacsv.read_csv(
            io.BytesIO(as_csv.stdout.encode()),
            convert_options=pacsv.ConvertOptions(column_types=schema),
        )
        exported[stage] = (
            (as_json.exit_code, as_csv.exit_code, as_parquet.exit_code),
            table_rows(pa.Table.from_pylist(json_rows).cast(schema)),
            table_rows(csv_table),
            table_rows(pq.read_table(target)),
        )

    assert {
        stage: ((0, 0, 0), rows, rows, rows) for stage, rows in expected[pointer].items()
    } == exported


def test_cli_table_shows_the_first_rows_of_all(snapshots, expected):
    """The table shows 20 rows by default, --limit of them when given, and says of how many;
    --where counts the matching rows."""
    pointer = snapshots.savepoint
    total = len(expected[pointer]["dedupe"])
    user = expected[pointer]["user_activity"][0][0]
    outputs = [
        run_cli(pointer, "--stage", "dedupe"),
        run_cli(pointer, "--stage", "dedupe", "--limit", "3"),
        run_cli(pointer, "--stage", "user_activity", "--where", f"user_id={user}"),
    ]

    assert [
        (0, f"20 of {total} rows"), (0, f"3 of {total} rows"), (0, "1 of 1 rows")
    ] == [(r.exit_code, r.stdout.strip().splitlines()[-1].strip()) for r in outputs]


def test_cli_errors_have_one_line_and_their_exit_code(snapshots, tmp_path):
    """An unknown stage or column exits 2, no checkpoint 3, a corrupt state file 4 naming
    the file; each with one line on stderr."""
    pointer, stage, path = broken_copy(snapshots, tmp_path)
    flip_a_byte(path)
    cases = [
        ((snapshots.savepoint, "--stage", "sessions"), "its stages are: dedupe, user_activity"),
        ((snapshots.savepoint, "--stage", "dedupe", "--where", "nope=1"), "column 'nope'"),
        ((str(tmp_path / "nothing"), "--stage", "dedupe"), "checkpoints: error: "),
        ((pointer, "--stage", stage, "--json"), f"state file {path} does not match"),
    ]
    results = [run_cli(*args) for args, _ in cases]

    assert [(2, 1, True), (2, 1, True), (3, 1, True), (4, 1, True)] == [
        (r.exit_code, len(r.stderr.splitlines()), message in r.stderr)
        for r, (_, message) in zip(results, cases, strict=True)
    ]

