"""Helpers for the schedule and sensor tests: tmp-dir resources, and snapshots written with
the library alone (no Spark) for tests that only need storage in a known shape."""

import os
import time
from pathlib import Path

from checkpoint_storage import (
    CheckpointMetadata,
    CheckpointProperties,
    OperatorState,
    OperatorSubtaskState,
)
from checkpoint_storage.spi import SOURCE_POSITION_STATE
from pipelines import SourcePosition, StatefulPipeline, job_id_for
from pipelines.examples.click_events import NAME, click_events_pipeline
from resources import CheckpointStorageResource
from tests.pipelines import support
from tests.support import finalize, payload, write_state

SMALL_LANDING = {"batches_per_day": 2, "events_per_batch": 200, "users": 20, "seed": 3}
STATE_BYTES = 2048  # above the threshold below: each snapshot has one state file
# Dagster's run tags, as the strings Dagster documents (no private imports).
PARTITION_NAME_TAG = "dagster/partition"
ASSET_PARTITION_RANGE_START_TAG = "dagster/asset_partition_range_start"
ASSET_PARTITION_RANGE_END_TAG = "dagster/asset_partition_range_end"


def unused_click_pipeline(**options) -> StatefulPipeline:
    """The click-events pipeline (``user_activity``) for tests that run no Spark: its landing
    and report directories are never read; ``options`` go to ``click_events_pipeline``."""
    return click_events_pipeline("/nonexistent/landing", "/nonexistent/reports", **options)


def storage_resource(tmp_path: Path, **options) -> CheckpointStorageResource:
    return CheckpointStorageResource(
        checkpoint_dir=str(tmp_path / "checkpoints"),
        savepoint_dir=str(tmp_path / "savepoints"),
        file_state_size_threshold=1024,
        **options,
    )


def resources_for(tmp_path: Path, spark_resource=None, **storage) -> dict:
    return support.resources_for(
        tmp_path, spark_resource=spark_resource, storage=storage_resource(tmp_path, **storage)
    )


def materialize_range(instance, resources, first: str, last: str, *, pipeline, **config):
    """``support.materialize_range`` of ``pipeline`` with this suite's small landing."""
    return support.materialize_range(
        instance, resources, first, last, pipeline=pipeline, landing=SMALL_LANDING, **config
    )


def pipeline_access(resource: CheckpointStorageResource):
    access = resource.checkpoint_storage().create_checkpoint_storage(job_id_for(NAME))
    access.initialize_base_locations()
    return access


def write_snapshot(
    access,
    checkpoint_id: int,
    position: SourcePosition,
    *,
    savepoint_dir: str | None = None,
    age_s: float = 0.0,
) -> str:
    """A completed checkpoint (or, with ``savepoint_dir``, a savepoint below it) of the
    pipeline holding ``position`` and one state file; its files are made ``age_s`` old."""
    if savepoint_dir is None:
        location = access.initialize_location_for_checkpoint(checkpoint_id)
        properties = CheckpointProperties.for_checkpoint()
    else:
        location = access.initialize_location_for_savepoint(checkpoint_id, savepoint_dir)
        properties = CheckpointProperties.for_savepoint()
    handle = write_state(location, payload(STATE_BYTES, checkpoint_id))
    metadata = CheckpointMetadata(
        checkpoint_id,
        (OperatorState("user_activity", 1, subtask_states={0: OperatorSubtaskState((handle,))}),),
        {SOURCE_POSITION_STATE: position.to_bytes()},
        properties,
        access.job_id,
        int(time.time() * 1000),
    )
    pointer = finalize(location, metadata).external_pointer
    if age_s:
        age(Path(pointer), age_s)
    return pointer


def age(path: Path, seconds: float) -> None:
    """Set the modification time of ``path`` (and everything below it) ``seconds`` back."""
    stamp = time.time() - seconds
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(item, (stamp, stamp))


def files_below(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
