"""Read-only paths change nothing (issue 13): constructing a runner (as the integrity check
and the savepoint job do) recovers its store without subsuming or deleting checkpoints."""

import pytest

from checkpoint_storage import (
    CheckpointMetadata,
    FileSystemCheckpointStorage,
    store_checkpoint_metadata,
)
from pipelines import StatefulRunner, job_id_for
from pipelines.examples.click_events import click_events_pipeline
from tests.pipelines.support import NoSpark

pytestmark = pytest.mark.timeout(60)


def test_constructing_a_runner_deletes_no_checkpoint(tmp_path):
    """Five completed checkpoints and max_retained=2: after constructing the runner all five
    `_metadata` files are still there, and its store holds all five until the next add."""
    storage = FileSystemCheckpointStorage(str(tmp_path / "cp"))
    pipeline = click_events_pipeline(
        str(tmp_path / "landing"), str(tmp_path / "report"), max_retained_checkpoints=2
    )
    access = storage.create_checkpoint_storage(job_id_for(pipeline.name))
    access.initialize_base_locations()
    for checkpoint_id in range(1, 6):
        out = access.initialize_location_for_checkpoint(
            checkpoint_id
        ).create_metadata_output_stream()
        store_checkpoint_metadata(CheckpointMetadata(checkpoint_id), out)
        out.close_and_finalize_checkpoint()
    job = tmp_path / "cp" / access.job_id.hex

    runner = StatefulRunner(NoSpark(), storage, pipeline)

    assert [1, 2, 3, 4, 5] == [c.checkpoint_id for c in runner.store.all()]
    assert [True] * 5 == [(job / f"chk-{i}" / "_metadata").is_file() for i in range(1, 6)]
