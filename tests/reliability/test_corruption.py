"""A flipped bit or a truncation in `_metadata` or a state file (issue 7)."""

import pytest

from tests.reliability import scenarios_fs


@pytest.mark.timeout(120)
def test_corruption_local(tmp_path):
    """Every corruption is detected and recovery falls back to the previous checkpoint."""
    outcome = scenarios_fs.corruption(24, scenarios_fs.local_target(str(tmp_path)))
    assert (0, []) == (outcome.failures, outcome.problems)


@pytest.mark.timeout(300)
def test_corruption_s3(s3_server, s3_bucket):
    """Every corruption on S3 is detected and recovery falls back, saying why."""
    target = scenarios_fs.s3_target(s3_server.endpoint_url, s3_bucket)
    outcome = scenarios_fs.corruption(12, target)
    assert (0, []) == (outcome.failures, outcome.problems)
