"""GC over foreign directories and copied checkpoint directories (issue 13)."""

import pytest

from tests.reliability import scenarios_fs, scenarios_trust


@pytest.mark.timeout(120)
def test_foreign_directories_under_gc_lose_no_file_local(tmp_path):
    """Flink's and unknown-format checkpoints survive GC with grace 0, each one reported."""
    target = scenarios_fs.local_target(str(tmp_path))
    outcome = scenarios_trust.foreign_directories_under_gc(12, target)
    assert (0, []) == (outcome.failures, outcome.problems)


@pytest.mark.timeout(300)
def test_foreign_directories_under_gc_lose_no_file_s3(s3_server, s3_bucket):
    """The same on S3 (moto): no foreign file is deleted."""
    target = scenarios_fs.s3_target(s3_server.endpoint_url, s3_bucket)
    outcome = scenarios_trust.foreign_directories_under_gc(4, target)
    assert (0, []) == (outcome.failures, outcome.problems)


@pytest.mark.timeout(120)
def test_copied_checkpoint_directories_are_never_taken_for_their_name_local(tmp_path):
    """`cp -r chk-i chk-j`: latest, store, list and GC treat chk-j as a mismatch, every time."""
    target = scenarios_fs.local_target(str(tmp_path))
    outcome = scenarios_trust.id_mismatch(12, target)
    assert (0, []) == (outcome.failures, outcome.problems)


@pytest.mark.timeout(300)
def test_copied_checkpoint_directories_are_never_taken_for_their_name_s3(s3_server, s3_bucket):
    """The same on S3 (moto)."""
    target = scenarios_fs.s3_target(s3_server.endpoint_url, s3_bucket)
    outcome = scenarios_trust.id_mismatch(4, target)
    assert (0, []) == (outcome.failures, outcome.problems)
