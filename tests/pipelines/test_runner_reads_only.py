"""Read-only paths change nothing (issue 13): constructing a runner (as the integrity check
and the savepoint job do) recovers its store without subsuming or deleting checkpoints."""

import pytest

from checkpoint_storage import (
    CheckpointMetadata,
    FileSystemCheckpointStorage,
    store_checkpoint_metadata,
)
from pipelines.runner import StatefulRunner, job_id_for
from tests.pipelines.support import NoSpark

pytestmark = pytest.mark.timeout(60)


def test_constructing_a_runner_deletes_no_checkpoint(tmp_path):
    """Five completed checkpoints and max_retained=2: after constructing the runner all five
    `_metadata` files are still there, and its store holds all five until the next add."""
    storage = FileSystemCheckpointStorage(str(tmp_path / "cp"))
    access = storage.create_checkpoint_storage(job_id_for("readonly"))
    access.initialize_base_locations()
    for checkpoint_id in range(1, 6):
        out = access.initialize_location_for_checkpoint(
            checkpoint_id
        ).create_metadata_output_stream()
        store_checkpoint_metadata(CheckpointMetadata(checkpoint_id), out)
        out.close_and_finalize_checkpoint()
    job = tmp_path / "cp" / access.job_id.hex

    runner = StatefulRunner(
        NoSpark(),
        storage,
        landing_dir=str(tmp_path / "landing"),
        report_dir=str(tmp_path / "report"),
        first_partition="2026-03-01",
        pipeline_name="readonly",
        max_retained=2,
    )

    assert [1, 2, 3, 4, 5] == [c.checkpoint_id for c in runner.store.all()]
    assert [True] * 5 == [(job / f"chk-{i}" / "_metadata").is_file() for i in range(1, 6)]
