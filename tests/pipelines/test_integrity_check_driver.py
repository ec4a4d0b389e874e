"""``checkpoint_integrity`` after a run that snapshotted keyed ranges verifies the whole last
checkpoint and restores each stage's rows: a small state is replayed in the driver, without
Spark (issue 28, the cold run), and its verdicts are those of a restore by the executors."""

from pathlib import Path

import pytest

import pipelines._restore as restore_module
from checkpoint_storage import FileSystemCheckpointStorage, resolve_checkpoint_pointer
from checkpoint_storage.spi import store_checkpoint_metadata
from pipelines import StatefulRunner
from pipelines.examples.click_events import STAGES, generate_day
from sensors import integrity_check_result
from tests.pipelines.support import NoSpark, click_pipeline

pytestmark = pytest.mark.spark

DAYS = ("2026-10-01", "2026-10-02")
# As the click events land in scripts/run, smaller: a day's 4 batches make each range's chain
# reach the small-state snapshot (FullSnapshotPolicy.small_every) in the second day.
LANDING = {"batches": 4, "events_per_batch": 300, "users": 30, "seed": 1}


@pytest.fixture(scope="module")
def checked_run(spark, tmp_path_factory):
    """Two days of click events through the keyed stages, the second in a run of its own that
    restores the first (as a cold run of scripts/run) and snapshots the ranges; the state in
    files (threshold 0). The tests leave it as they found it."""
    tmp_path = tmp_path_factory.mktemp("integrity")
    for day in DAYS:
        generate_day(str(tmp_path / "landing"), day, **LANDING)
    pipeline = click_pipeline(tmp_path)
    storage = FileSystemCheckpointStorage(str(tmp_path / "checkpoints"),
                                          str(tmp_path / "savepoints"),
                                          file_state_size_threshold=0)
    StatefulRunner(spark, storage, pipeline).run([DAYS[0]])
    results = StatefulRunner(spark, storage, pipeline).run([DAYS[1]])
    return pipeline, storage, results


def check(pipeline, storage, results, spark=None):
    """The check as a run that materialized the state evaluates it (no Spark: ``NoSpark``)."""
    runner = StatefulRunner(spark or NoSpark(), storage, pipeline)
    return integrity_check_result(pipeline, runner, results[-1].checkpoint.pointer,
                                  results=results)


def recorded_rows(pointer: str) -> dict[str, int]:
    metadata = resolve_checkpoint_pointer(pointer, None).load_metadata()
    return {op.operator_id: sum(int(s.properties["rows"]) for s in op.subtask_states.values())
            for op in metadata.operator_states}


def test_a_small_state_is_restored_and_counted_without_spark(checked_run):
    """The whole checkpoint verified and restored with each stage's rows as recorded, by the
    driver alone (a runner whose session fails on any use)."""
    pipeline, storage, results = checked_run
    result = check(pipeline, storage, results)
    assert result.passed, result.description
    meta = {k: v.value for k, v in result.metadata.items()}
    assert meta["verified"].startswith("the whole checkpoint (the run snapshotted keyed ranges")
    recorded = recorded_rows(results[-1].checkpoint.pointer)
    assert all(n > 0 for n in recorded.values())
    assert recorded == {name[len("restored_rows_"):]: n for name, n in meta.items()
                        if name.startswith("restored_rows_")}


def test_the_driver_counts_what_a_restore_by_the_executors_counts(checked_run, spark,
                                                                  monkeypatch):
    """Above the threshold the executors restore the state (Spark jobs), as before: the same
    verdict and the same counts."""
    pipeline, storage, results = checked_run
    driver = check(pipeline, storage, results)
    monkeypatch.setattr(restore_module, "DRIVER_REPLAY_BYTES", 0)
    with pytest.raises(AssertionError, match="Spark was used"):
        check(pipeline, storage, results)
    executors = check(pipeline, storage, results, spark)
    assert (True, True) == (driver.passed, executors.passed)
    assert ({k: v.value for k, v in driver.metadata.items()}
            == {k: v.value for k, v in executors.metadata.items()})


def test_a_wrong_row_count_fails_the_check(checked_run):
    """A `_metadata` whose recorded rows differ from what its files restore fails the check
    with both counts."""
    pipeline, storage, results = checked_run
    pointer = results[-1].checkpoint.pointer
    metadata = resolve_checkpoint_pointer(pointer, None).load_metadata()
    path = Path(pointer) / "_metadata"
    original = path.read_bytes()
    subtask = next(iter(metadata.operator_states[0].subtask_states.values()))
    subtask.properties["rows"] = str(int(subtask.properties["rows"]) + 1)
    try:
        with path.open("wb") as out:
            store_checkpoint_metadata(metadata, out)
        result = check(pipeline, storage, results)
    finally:
        path.write_bytes(original)
    assert not result.passed
    assert "differ from the recorded" in result.description


@pytest.mark.parametrize("damage", ["flipped byte", "missing"])
def test_a_damaged_or_missing_state_file_fails_the_check(checked_run, damage):
    """A state file of the last checkpoint with a flipped byte, or gone, fails the check and
    names the file, before anything is restored."""
    pipeline, storage, results = checked_run
    pointer = results[-1].checkpoint.pointer
    metadata = resolve_checkpoint_pointer(pointer, None).load_metadata()
    victim = Path(sorted(h.path for h in metadata.all_handles() if getattr(h, "path", None))[0])
    original = victim.read_bytes()
    try:
        if damage == "missing":
            victim.unlink()
        else:
            data = bytearray(original)
            data[len(data) // 2] ^= 0x01
            victim.write_bytes(bytes(data))
        result = check(pipeline, storage, results)
    finally:
        victim.write_bytes(original)
    assert not result.passed
    assert victim.name in result.description
    assert ("missing" if damage == "missing" else "corrupt") in result.description


def test_dataframe_stages_are_restored_and_counted_without_spark(spark, tmp_path):
    """A pipeline of DataFrame stages (state snapshotted whole at every checkpoint): the
    check restores its Parquet parts in the driver, with the rows as recorded."""
    generate_day(str(tmp_path / "landing"), DAYS[0], **LANDING)
    pipeline = click_pipeline(tmp_path, stages=STAGES)
    storage = FileSystemCheckpointStorage(str(tmp_path / "checkpoints"),
                                          str(tmp_path / "savepoints"),
                                          file_state_size_threshold=0)
    results = StatefulRunner(spark, storage, pipeline).run([DAYS[0]])
    result = check(pipeline, storage, results)
    assert result.passed, result.description
    meta = {k: v.value for k, v in result.metadata.items()}
    assert meta["verified"] == "the whole checkpoint (the state is snapshotted whole)"
    assert recorded_rows(results[-1].checkpoint.pointer) == {
        name[len("restored_rows_"):]: n for name, n in meta.items()
        if name.startswith("restored_rows_")}
