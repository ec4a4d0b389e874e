"""16 processes commit the same checkpoint id at once (issue 7)."""

import pytest

from tests.reliability import scenarios_fs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_concurrent_commits_local(tmp_path):
    """Exactly one of 16 racing processes wins on local disk; the rest get FileExistsError."""
    outcome = scenarios_fs.concurrent_commits(3, scenarios_fs.local_target(str(tmp_path)))
    assert (0, []) == (outcome.failures, outcome.problems)


@pytest.mark.timeout(300)
def test_concurrent_commits_s3(s3_server, s3_bucket):
    """Exactly one of 16 racing processes wins on S3; the stored bytes are the winner's."""
    target = scenarios_fs.s3_target(s3_server.endpoint_url, s3_bucket)
    outcome = scenarios_fs.concurrent_commits(3, target)
    assert (0, []) == (outcome.failures, outcome.problems)
