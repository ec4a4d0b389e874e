"""Trust scenarios of issue 13 at test size: an endpoint ignoring If-None-Match, processes
racing for one job's lease (local disk and S3), discovery behind aborted directories."""

import math

import pytest

from tests.reliability.scenarios_lease import (
    discovery_aborted,
    lease_race,
    max_overlap,
    scenario_ignoring_endpoint,
)


def test_max_overlap_counts_simultaneous_intervals():
    """The harness's overlap count: touching intervals do not overlap, nested ones do."""
    assert (1, 2, 3) == (
        max_overlap([(0, 1), (1, 2), (2, 3)]),
        max_overlap([(0, 3), (1, 2)]),
        max_overlap([(0, 10), (1, 9), (2, 8)]),
    )


@pytest.mark.timeout(60)
def test_an_ignoring_endpoint_never_overwrites_silently(s3_server):
    """Every coordinator behind the ignoring endpoint is refused; no `_metadata` changes."""
    result = scenario_ignoring_endpoint(2, s3_server.endpoint_url)

    assert (2, 0) == (result.trials, result.failures), result.figure


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sixteen_processes_racing_for_a_lease_on_local_disk(tmp_path):
    """16 processes, one job: at most one owner at once, unique epochs and ids, each
    `_metadata` records its epoch; a SIGKILLed owner is replaced after its ttl."""
    at_once, problems, figure = lease_race(str(tmp_path / "cp"), {}, 16, kill_ttl=1.0)

    assert (1, []) == (at_once, problems), figure


@pytest.mark.timeout(120)
def test_processes_racing_for_a_lease_on_s3(s3_server):
    """The same on S3 (moto) with 3 processes."""
    bucket = s3_server.new_bucket()
    at_once, problems, figure = lease_race(
        f"s3://{bucket}/cp", s3_server.storage_options, 3, kill_ttl=1.0
    )

    assert (1, []) == (at_once, problems), figure


@pytest.mark.timeout(120)
def test_discovery_behind_aborted_directories_lists(s3_server):
    """1,200 aborted directories: at most ceil(n/1000) + 1 LIST pages, a handful of other
    requests, the right answer."""
    counts, seconds, right = discovery_aborted(s3_server.endpoint_url, 1200)

    assert (True, True) == (
        right,
        counts.get("LIST", 0) <= math.ceil(1201 / 1000) + 1,
    ), counts
    assert sum(counts.values()) <= 8, counts
