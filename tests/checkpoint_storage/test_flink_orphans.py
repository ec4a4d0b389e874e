"""Orphans of Flink job directories, on copies of the real Flink 2.3.0 samples: what the
listing and the dumps imply is what ``find_orphans`` reports; deletion needs confirmation,
spares young files, re-lists first and never touches what another directory references."""

import os
import re
import shutil
import time
from datetime import timedelta
from pathlib import Path

import pytest

from checkpoint_storage.exceptions import OrphanDeletionRefusedError
from checkpoint_storage.flink import (
    delete_orphans,
    find_orphans,
    parse_remap,
    verify_flink_checkpoint,
)

SAMPLES = Path(os.environ.get("FLINK_SAMPLES", "/work/shared/flink-samples"))
pytestmark = pytest.mark.skipif(not (SAMPLES / "scratch").is_dir(), reason="no Flink samples")

RESTORED = "858c4eba9ab0bd13ae80f7b855214a38"  # sample 7: restored in CLAIM mode from ...
ORIGINAL = "f722d28ed64854daeb21648a701176a8"  # ... sample 3's chk-6
MERGING = "737e173f51acf8eccdfd75e35b3e12f3"  # sample 6: file merging
HEAP = "287eeec738b3c129b2274f1ab2ec2d52"  # sample 1
LONG_AGO = time.time() - 7 * 86400


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """A copy of the samples' scratch tree, every file a week old."""
    root = tmp_path / "scratch"
    shutil.copytree(SAMPLES / "scratch", root)
    for job in (root / "ckpts").iterdir():
        for name in ("shared", "taskowned"):
            (job / name).mkdir(exist_ok=True)  # the empty directories Flink made
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
        os.utime(path, (LONG_AGO, LONG_AGO))
    return root


def remap_for(scratch: Path):
    return parse_remap([f"/srv/flinkdemo={scratch}"])


def dump_references(job: str) -> set[str]:
    """Every absolute file a job's dumps reference, as <scratch>/... text."""
    refs = set()
    for dump in (SAMPLES / "dumps").glob(f"ckpts__{job}__*.txt"):
        refs |= set(re.findall(r"(?:path|file)=(<scratch>/\S+)", dump.read_text()))
    return refs


def listed_files(job: str) -> set[str]:
    """The files LISTING.txt section A has under a job's shared/ and taskowned/."""
    text = (SAMPLES / "LISTING.txt").read_text().split("## B.")[0]
    pattern = rf"^scratch/(ckpts/{job}/(?:shared|taskowned)/\S+) \d+$"
    return {"<scratch>/" + m for m in re.findall(pattern, text, re.M)}


def as_scratch(paths, scratch: Path) -> set[str]:
    return {p.replace(str(scratch), "<scratch>", 1) for p in paths}


@pytest.mark.parametrize("job", [ORIGINAL, RESTORED, MERGING, HEAP])
def test_orphans_are_what_the_listing_and_dumps_imply(scratch: Path, job: str) -> None:
    report = find_orphans(str(scratch / "ckpts" / job), remap=remap_for(scratch))
    expected = listed_files(job) - dump_references(job)
    assert as_scratch((o.path for o in report.orphans), scratch) == expected
    assert not report.unreadable
    ids = {int(p.name.split("-")[1]) for p in (scratch / "ckpts" / job).glob("chk-*")}
    assert {c.checkpoint_id for c in report.retained} == ids
    assert all(o.size > 0 and o.modified is not None for o in report.orphans)


def test_the_claim_job_references_the_other_jobs_shared_files(scratch: Path) -> None:
    report = find_orphans(str(scratch / "ckpts" / RESTORED), remap=remap_for(scratch))
    expected = {p for p in dump_references(RESTORED) if f"/ckpts/{ORIGINAL}/shared/" in p}
    assert expected  # the sample has them
    assert as_scratch((e.path for e in report.external), scratch) == expected
    # Flink deleted 2 OPTIONS files of the old chk-6 after the claim; sample 3's copy was
    # taken before, so here all exist: sizes are known.
    assert all(e.size is not None and e.checkpoint_ids for e in report.external)


def test_files_added_to_a_copy_are_orphans_and_nothing_is_deleted(scratch: Path) -> None:
    job = scratch / "ckpts" / ORIGINAL
    (job / "shared" / "stray-sst").write_bytes(b"x" * 123)
    (job / "taskowned" / "stray-meta").write_bytes(b"y" * 7)
    before = {p: p.stat().st_size for p in scratch.rglob("*") if p.is_file()}
    report = find_orphans(str(job), remap=remap_for(scratch))
    names = {Path(o.path).name: o.size for o in report.orphans}
    assert names["stray-sst"] == 123 and names["stray-meta"] == 7
    assert {p: p.stat().st_size for p in scratch.rglob("*") if p.is_file()} == before


def test_delete_needs_confirmation(scratch: Path) -> None:
    job = scratch / "ckpts" / ORIGINAL
    (job / "shared" / "stray").write_bytes(b"x")
    report = find_orphans(str(job))
    with pytest.raises(OrphanDeletionRefusedError, match="explicit confirmation"):
        delete_orphans(report, confirm=False, grace_period=timedelta(0))
    assert (job / "shared" / "stray").exists()


def test_delete_spares_young_files_and_every_referenced_file(scratch: Path) -> None:
    job = scratch / "ckpts" / ORIGINAL
    (job / "shared" / "old-stray").write_bytes(b"x" * 10)
    os.utime(job / "shared" / "old-stray", (LONG_AGO, LONG_AGO))
    (job / "shared" / "new-stray").write_bytes(b"x" * 10)  # just written: within the grace
    remap = remap_for(scratch)
    report = find_orphans(str(job), remap=remap)
    result = delete_orphans(report, confirm=True, grace_period=timedelta(hours=1))
    assert str(job / "shared" / "old-stray") in result.deleted
    assert str(job / "shared" / "new-stray") in result.kept_young
    assert (job / "shared" / "new-stray").exists()
    assert not (job / "shared" / "old-stray").exists()
    for chk in sorted(job.glob("chk-*")):
        assert verify_flink_checkpoint(str(chk), remap=remap).ok, chk


def test_delete_is_refused_when_a_checkpoint_appeared_since_the_listing(scratch: Path) -> None:
    job = scratch / "ckpts" / ORIGINAL
    (job / "shared" / "stray").write_bytes(b"x")
    os.utime(job / "shared" / "stray", (LONG_AGO, LONG_AGO))
    report = find_orphans(str(job))
    shutil.copytree(job / "chk-6", job / "chk-7")  # a checkpoint completes meanwhile
    with pytest.raises(OrphanDeletionRefusedError, match="changed since the listing.*chk-7"):
        delete_orphans(report, confirm=True, grace_period=timedelta(0))
    assert (job / "shared" / "stray").exists()


def test_files_another_directory_references_are_never_deleted(scratch: Path) -> None:
    original = scratch / "ckpts" / ORIGINAL
    shutil.rmtree(original / "chk-6")  # as after the CLAIM restore subsumed it
    remap = remap_for(scratch)
    alone = find_orphans(str(original), remap=remap)
    claimed = {
        e.path for e in find_orphans(str(scratch / "ckpts" / RESTORED), remap=remap).external
    }
    assert claimed & {o.path for o in alone.orphans}  # without the other job, they look orphaned
    report = find_orphans(
        str(original), remap=remap, also_referenced_by=[str(scratch / "ckpts" / RESTORED)]
    )
    assert not claimed & {o.path for o in report.orphans}
    assert set(report.protected_by_others) == claimed & {o.path for o in alone.orphans}
    delete_orphans(report, confirm=True, grace_period=timedelta(0))
    assert all(Path(p).exists() for p in claimed)
    for chk in sorted((scratch / "ckpts" / RESTORED).glob("chk-*")):
        assert verify_flink_checkpoint(str(chk), remap=remap).ok, chk


def test_an_unreadable_metadata_is_reported_and_blocks_deletion(scratch: Path) -> None:
    job = scratch / "ckpts" / ORIGINAL
    metadata = job / "chk-5" / "_metadata"
    metadata.write_bytes(metadata.read_bytes()[:100])
    (job / "shared" / "stray").write_bytes(b"x")
    os.utime(job / "shared" / "stray", (LONG_AGO, LONG_AGO))
    report = find_orphans(str(job))
    assert [u.pointer for u in report.unreadable] == [str(job / "chk-5")]
    assert "FlinkMetadataError" in report.unreadable[0].reason
    with pytest.raises(OrphanDeletionRefusedError, match="cannot be read"):
        delete_orphans(report, confirm=True, grace_period=timedelta(0))
    assert metadata.exists() and (job / "shared" / "stray").exists()


def test_verify_names_a_truncated_and_a_missing_file(scratch: Path) -> None:
    remap = remap_for(scratch)
    chk = scratch / "ckpts" / ORIGINAL / "chk-5"
    assert verify_flink_checkpoint(str(chk), remap=remap).ok
    victim = scratch / "ckpts" / ORIGINAL / "shared" / "dedb09f4-af48-4b5d-833f-c27a9a9ee91c"
    victim.write_bytes(victim.read_bytes()[:-1])
    gone = scratch / "ckpts" / ORIGINAL / "shared" / "9a557b9a-c39a-4036-8769-fa59cb54a05f"
    gone.unlink()
    report = verify_flink_checkpoint(str(chk), remap=remap)
    assert {(p.path, p.kind) for p in report.problems} == {
        (str(victim), "corrupt"),
        (str(gone), "missing"),
    }


def test_orphans_of_this_librarys_job_directory(tmp_path: Path) -> None:
    """`find_orphans` reads this library's `_metadata` too: a shared file of a retained
    checkpoint is referenced, one an aborted checkpoint left is an orphan."""
    from checkpoint_storage import FileSystemCheckpointStorage, JobID
    from tests.support import SHARED, finalize, metadata, payload, write_state

    storage = FileSystemCheckpointStorage(
        str(tmp_path / "cp"), str(tmp_path / "sp"), file_state_size_threshold=16
    )
    access = storage.create_checkpoint_storage(JobID.generate())
    access.initialize_base_locations()
    loc1 = access.initialize_location_for_checkpoint(1)
    kept = write_state(loc1, payload(100, 1), SHARED)
    finalize(loc1, metadata(1, [kept]))
    loc2 = access.initialize_location_for_checkpoint(2)  # aborted: no _metadata
    lost = write_state(loc2, payload(100, 2), SHARED)

    report = find_orphans(access.checkpoints_directory)

    assert [(c.checkpoint_id, c.writer) for c in report.retained] == [(1, "this library")]
    assert [o.path for o in report.orphans] == [lost.path]
    assert report.referenced_inside == 1 and not report.external
    assert report.incomplete == (f"{access.checkpoints_directory}/chk-2",)
