"""Backfill from a savepoint: a ``restore_from`` that does not exist or does not fit the
range fails the run before any Spark work, with a message that says why."""

import dataclasses
from functools import cached_property
from pathlib import Path

import dagster as dg
import pytest

from checkpoint_storage import CheckpointMetadata
from checkpoint_storage.spi import (
    SOURCE_POSITION_STATE,
    CheckpointProperties,
    OperatorState,
    OperatorSubtaskState,
)
from pipelines import SourcePosition, job_id_for
from resources import SparkResource
from tests.pipelines.support import click_pipeline
from tests.sensors.support import materialize_range, pipeline_access, resources_for
from tests.sensors.support import write_snapshot as snapshot
from tests.support import finalize, payload, write_state

SPARK_GUARD = "the Spark session was requested"


class NoSpark(SparkResource):
    """A Spark resource that fails the run if anything asks it for a session."""

    @cached_property
    def session(self):
        raise AssertionError(SPARK_GUARD)


def failure_message(result) -> str:
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    error = failure.event_specific_data.error
    return (error.cause or error).message.strip()


def test_restore_from_that_does_not_exist_fails_before_spark(tmp_path):
    """restore_from naming a directory without `_metadata` fails the run with "does not
    exist", and the Spark session was never requested."""
    resources = resources_for(tmp_path, spark_resource=NoSpark())
    missing = str(tmp_path / "savepoints" / "savepoint-2b2376-000000000000")
    with dg.instance_for_test() as instance:
        result = materialize_range(
            instance, resources, "2026-10-02", "2026-10-03",
            pipeline=click_pipeline(tmp_path), restore_from=missing,
        )  # fmt: skip
    message = failure_message(result)
    assert not result.success
    expected = f"pipelines.MissingStateError: restore_from {missing} does not exist"
    assert expected == message[: len(expected)]
    assert SPARK_GUARD not in message


def test_restore_from_that_does_not_fit_fails_before_spark(tmp_path):
    """A savepoint at the end of 10-01 restored into a range starting 10-05 fails with the
    position it holds and the one the range needs, before any Spark work."""
    resources = resources_for(tmp_path, spark_resource=NoSpark())
    access = pipeline_access(resources["checkpoint_storage"])
    pointer = snapshot(
        access, 4, SourcePosition("2026-10-01", 2, True), savepoint_dir=str(tmp_path / "sp")
    )
    with dg.instance_for_test() as instance:
        result = materialize_range(
            instance, resources, "2026-10-05", "2026-10-06",
            pipeline=click_pipeline(tmp_path), restore_from=pointer,
        )  # fmt: skip
    assert (
        f"pipelines.MissingStateError: {pointer} holds the state at end of 2026-10-01, "
        "but processing 2026-10-05 starts from the end of 2026-10-04 (or from within "
        "2026-10-05): choose a snapshot that fits, or a range that starts right after it"
    ) == failure_message(result)


def test_restore_from_that_fits_gets_as_far_as_spark(tmp_path):
    """The same savepoint restored into a range starting 10-02 passes validation: the run
    gets as far as asking for the Spark session (so the failures above are validation's)."""
    resources = resources_for(tmp_path, spark_resource=NoSpark())
    access = pipeline_access(resources["checkpoint_storage"])
    pointer = snapshot(
        access, 4, SourcePosition("2026-10-01", 2, True), savepoint_dir=str(tmp_path / "sp")
    )
    with dg.instance_for_test() as instance:
        result = materialize_range(
            instance, resources, "2026-10-02", "2026-10-02",
            pipeline=click_pipeline(tmp_path), restore_from=pointer,
        )  # fmt: skip
    assert f"AssertionError: {SPARK_GUARD}" == failure_message(result)


def test_claim_of_another_pipelines_checkpoint_fails_before_spark(tmp_path):
    """restore_mode CLAIM of a checkpoint in another pipeline's job directory fails the run
    with ClaimRefusedError saying to use NO_CLAIM, before any Spark work; the checkpoint stays.
    """
    resources = resources_for(tmp_path, spark_resource=NoSpark())
    storage = resources["checkpoint_storage"].checkpoint_storage()
    other = storage.create_checkpoint_storage(job_id_for("another_pipeline"))
    other.initialize_base_locations()
    pointer = snapshot(other, 4, SourcePosition("2026-10-01", 2, True))
    with dg.instance_for_test() as instance:
        result = materialize_range(
            instance, resources, "2026-10-02", "2026-10-02",
            pipeline=click_pipeline(tmp_path), restore_from=pointer, restore_mode="CLAIM",
        )  # fmt: skip
    message = failure_message(result)
    assert message.startswith(f"pipelines.ClaimRefusedError: restore_from {pointer}")
    assert ("use NO_CLAIM" in message, SPARK_GUARD in message) == (True, False)
    assert Path(pointer, "_metadata").is_file()


def _pointers(result, name: str) -> dict[str, str]:
    return {m.partition: m.metadata["checkpoint_pointer"].path
            for m in result.asset_materializations_for_node(name) if m.asset_key.path == [name]}


@pytest.mark.timeout(600)
def test_a_backfill_from_a_retained_partition_end_keeps_the_head_and_records_it(tmp_path):
    """With the last 3 partition ends retained (and 1 checkpoint), a backfill of 10-02 from the
    checkpoint at the end of 10-01 needs no savepoint; its materialization records "rewound
    from end of 10-03 to end of 10-01; the head is kept at <pointer>", and the head is still
    retained afterwards."""
    resources = resources_for(tmp_path)
    pipeline = dataclasses.replace(click_pipeline(tmp_path, max_retained_checkpoints=1),
                                   retain_partition_ends=3)
    with dg.instance_for_test() as instance:
        first = materialize_range(instance, resources, "2026-10-01", "2026-10-03",
                                  pipeline=pipeline)
        assert first.success
        pointers = _pointers(first, pipeline.name)
        backfill = materialize_range(instance, resources, "2026-10-02", "2026-10-02",
                                     pipeline=pipeline, restore_from=pointers["2026-10-01"])
    assert backfill.success
    (materialization,) = [m for m in backfill.asset_materializations_for_node(pipeline.name)
                          if m.asset_key.path == [pipeline.name]]
    assert materialization.metadata["rewound"].value == (
        f"rewound from end of 2026-10-03 to end of 2026-10-01; the head is kept at "
        f"{pointers['2026-10-03']} (a run of 2026-10-04 continues from it)")
    assert Path(pointers["2026-10-03"], "_metadata").exists()


def test_a_savepoint_holding_a_removed_stage_fails_before_spark_unless_allowed(tmp_path):
    """A savepoint that also holds stage ``gone``, which the pipeline no longer has: the run
    fails naming it and the run config's allow_non_restored_state, before any Spark work;
    with allow_non_restored_state it gets as far as Spark."""
    resources = resources_for(tmp_path, spark_resource=NoSpark())
    access = pipeline_access(resources["checkpoint_storage"])
    location = access.initialize_location_for_savepoint(4, str(tmp_path / "sp"))
    handles = [write_state(location, payload(64, n)) for n in (1, 2)]
    metadata = CheckpointMetadata(
        4, tuple(OperatorState(name, 1, subtask_states={0: OperatorSubtaskState((handle,))})
                 for name, handle in zip(("user_activity", "gone"), handles, strict=True)),
        {SOURCE_POSITION_STATE: SourcePosition("2026-10-01", 2, True).to_bytes()},
        CheckpointProperties.for_savepoint(), access.job_id, 0)
    pointer = finalize(location, metadata).external_pointer
    with dg.instance_for_test() as instance:
        refused = materialize_range(
            instance, resources, "2026-10-02", "2026-10-02",
            pipeline=click_pipeline(tmp_path), restore_from=pointer,
        )  # fmt: skip
        allowed = materialize_range(
            instance, resources, "2026-10-02", "2026-10-02",
            pipeline=click_pipeline(tmp_path), restore_from=pointer,
            allow_non_restored_state=True,
        )  # fmt: skip
    message = failure_message(refused)
    assert "NonRestoredStateError" in message and "stage(s) ['gone']" in message
    assert "allow_non_restored_state=True" in message and SPARK_GUARD not in message
    assert f"AssertionError: {SPARK_GUARD}" == failure_message(allowed)
