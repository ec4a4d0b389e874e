"""Checkpoint statistics: what each checkpoint records of the bytes and files it wrote against
those it references, per stage and in total, compared with a walk of the directory; a
restored run's; and those derived for a checkpoint written without them."""

import io
import sys
from pathlib import Path

import pytest
from pyspark import cloudpickle

from checkpoint_storage import list_checkpoints
from checkpoint_storage.spi import (
    STATISTICS_STATE,
    ByteStreamStateHandle,
    checkpoint_statistics,
    store_checkpoint_metadata,
)
from pipelines import StatefulRunner
from tests.pipelines.mixed_stages import mixed_pipeline
from tests.pipelines.support import storage_of

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def runner_of(spark, tmp_path: Path, **options) -> StatefulRunner:
    return StatefulRunner(spark, storage_of(tmp_path, file_state_size_threshold=512),
                          mixed_pipeline(**options), keyed_local_dir=str(tmp_path / "local"))


def walk(job: Path) -> dict[str, int]:
    """Every state file of the job directory (in shared/ and chk-<id>/, not `_metadata`)
    and its size."""
    return {str(p): p.stat().st_size for p in job.rglob("*")
            if p.is_file() and p.name != "_metadata"
            and p.relative_to(job).parts[0].startswith(("shared", "chk-"))}


def checked_against_the_walk(job: Path, before: dict[str, int], summary) -> dict:
    """The recorded statistics of ``summary``'s checkpoint, checked against the files that
    appeared below ``job`` since ``before``: the checkpoint's own directory and new shared
    files are what it wrote; the sizes of the files and inline states it references are its
    full size."""
    [info] = list_checkpoints(summary.pointer)
    recorded = info.statistics
    assert recorded["recorded"] is True and recorded["checkpoint_id"] == summary.checkpoint_id
    metadata = info.metadata
    handles = metadata.all_handles()
    inline = sum(h.state_size for h in handles if isinstance(h, ByteStreamStateHandle))
    after = walk(job)
    new = {path: size for path, size in after.items() if path not in before}
    referenced = {h.path for h in handles if hasattr(h, "path")}
    assert set(new) <= referenced, "a file written but not referenced"
    assert recorded["files_new"] == len(new)
    assert recorded["files_reused"] == len(referenced - set(new))
    assert recorded["files"] == len(referenced)
    assert recorded["written_size"] == sum(new.values()) + inline
    assert recorded["full_size"] == sum(after[p] for p in referenced) + inline
    assert recorded["full_size"] == summary.state_bytes
    stages = {s["stage"]: s for s in recorded["stages"]}
    assert stages.keys() == {"totals", "customers"}
    assert stages["customers"]["kind"] == "plain"
    assert stages["totals"]["kind"] == "keyed"
    for name in ("written_size", "full_size", "files_new", "files_reused"):
        assert recorded[name] == sum(s[name] for s in stages.values())
    assert stages["customers"]["full_snapshots"] is None
    for name in ("full_snapshots", "change_files", "full_snapshots_new", "change_files_new"):
        assert recorded[name] == stages["totals"][name]  # the keyed stage's: the only one
    chains = stages["totals"]
    assert chains["full_snapshots"] + chains["change_files"] == sum(
        len(s.handles) for s in metadata.operator_states[0].subtask_states.values())
    assert stages["totals"]["live_rows"] == summary.state_rows["totals"]
    assert stages["customers"]["live_rows"] == summary.state_rows["customers"]
    durations = recorded["durations_ms"]
    assert durations["batch"] > 0 and durations["state_write"] > 0
    assert durations["metadata_publication"] is None  # cannot be in its own _metadata
    assert summary.statistics["durations_ms"]["metadata_publication"] > 0
    return recorded


@pytest.mark.timeout(240)
def test_statistics_equal_a_walk_of_the_directory_for_plain_and_keyed_stages(spark, tmp_path):
    """Three partitions, one checkpoint each, the third a full snapshot of the keyed stage:
    each checkpoint's recorded bytes and files written equal the files new in its directory
    and in shared/, its full size the referenced files' sizes; then a restored run (another
    runner, as a new process would) records the same way, naming the previous publication."""
    runner = runner_of(spark, tmp_path)
    job = tmp_path / "checkpoints" / str(runner.job_id)
    seen = []
    for partition in ["p1", "p2"]:
        before = walk(job) if job.exists() else {}
        [result] = runner.run([partition])
        seen.append(checked_against_the_walk(job, before, result.checkpoint))
    first, second = seen
    assert first["files_reused"] == 0 and first["written_size"] == first["full_size"]
    assert first["previous_publication"] is None
    assert second["previous_publication"]["checkpoint_id"] == first["checkpoint_id"]
    # p2's checkpoint keeps p1's change files (no full snapshot due yet): reused, not written
    keyed = {s["stage"]: s for s in second["stages"]}["totals"]
    assert keyed["files_reused"] > 0 and keyed["change_files_new"] < keyed["change_files"]
    assert second["written_size"] < second["full_size"]

    restored = runner_of(spark, tmp_path)
    before = walk(job)
    [result] = restored.run(["p3"])
    assert result.restored_from is not None
    third = checked_against_the_walk(job, before, result.checkpoint)
    assert third["previous_publication"] is None  # this runner published nothing before
    keyed = {s["stage"]: s for s in third["stages"]}["totals"]
    assert keyed["full_snapshots"] == keyed["full_snapshots_new"] > 0


@pytest.mark.timeout(240)
def test_a_checkpoint_without_statistics_gets_them_derived_from_its_handles(spark, tmp_path):
    """A checkpoint written before statistics (its master state removed): the listing derives
    sizes and new against reused files from the handles and the checkpoint before it, equal
    to what was recorded; what only the writer knew is None."""
    runner = runner_of(spark, tmp_path)
    runner.run(["p1", "p2"])
    infos = [i for i in list_checkpoints(str(tmp_path / "checkpoints" / str(runner.job_id)))
             if i.completed]
    newest = infos[-1]
    recorded = newest.statistics
    master = {k: v for k, v in newest.metadata.master_states.items() if k != STATISTICS_STATE}
    old = type(newest.metadata)(newest.metadata.checkpoint_id, newest.metadata.operator_states,
                                master, newest.metadata.properties, newest.metadata.job_id,
                                newest.metadata.timestamp_ms, newest.metadata.lease_epoch)
    written = io.BytesIO()
    store_checkpoint_metadata(old, written)
    (Path(newest.pointer) / "_metadata").write_bytes(written.getvalue())

    derived = list_checkpoints(str(tmp_path / "checkpoints" / str(runner.job_id)))[-1].statistics
    assert derived["recorded"] is False
    for name in ("full_size", "written_size", "files", "files_new", "files_reused",
                 "inline_handles", "live_rows", "expired_rows"):
        assert derived[name] == recorded[name], name
    assert derived["durations_ms"] == {"batch": None, "state_write": None,
                                       "metadata_publication": None}
    assert {s["stage"]: s["kind"] for s in derived["stages"]} == {"totals": None,
                                                                  "customers": None}
    assert derived["full_snapshots"] is None
    # alone (no checkpoint before it to compare with), what it wrote is not known
    alone = checkpoint_statistics(old)
    assert alone["full_size"] == recorded["full_size"] and alone["written_size"] is None
