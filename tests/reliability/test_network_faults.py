"""S3 behind a fault-injecting proxy (issue 7): discovery under LIST/HEAD errors, `_metadata`
PUTs whose response is lost, slow responses and timeouts."""

import re
import time
import uuid

import pytest
import s3fs

from checkpoint_storage import FileSystemCheckpointStorage
from tests.reliability.proxy import (
    ACCESS_DENIED,
    LOST,
    PASS,
    RESET,
    UNAVAILABLE,
    Delay,
    FaultProxy,
)
from tests.reliability.scenarios_net import (
    LOST_PUT_CASES,
    commit,
    read_object,
    scenario_discovery_faults,
    scenario_lost_metadata_put,
)


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server.endpoint_url) as running:
        yield running


def _job(proxy, bucket: str, **options):
    storage = FileSystemCheckpointStorage(
        f"s3://{bucket}/cp", storage_options=proxy.options(**options), file_state_size_threshold=0
    )
    access = storage.create_checkpoint_storage(uuid.uuid4().hex)
    access.initialize_base_locations()
    return access


# --- the harness itself --------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("action", "error"),
    [(ACCESS_DENIED, PermissionError), (UNAVAILABLE, OSError), (RESET, Exception)],
)
def test_proxy_faults_reach_the_client(proxy, s3_server, action, error):
    """An injected fault on a GET makes s3fs fail, and the proxy logs it; PASS serves it."""
    bucket = s3_server.new_bucket()
    fs = s3fs.S3FileSystem(**proxy.options(attempts=1), skip_instance_cache=True)
    fs.pipe_file(f"{bucket}/k", b"v")
    proxy.rule = lambda request: action if request.method == "GET" else PASS

    with pytest.raises(error):
        fs.cat_file(f"{bucket}/k")
    proxy.rule = lambda request: PASS

    assert proxy.count("GET", action) >= 1
    assert b"v" == fs.cat_file(f"{bucket}/k")


@pytest.mark.timeout(60)
def test_lost_response_was_applied_by_the_server(proxy, s3_server):
    """A LOST PUT reaches the server (the object exists) though the client sees an error."""
    bucket = s3_server.new_bucket()
    fs = s3fs.S3FileSystem(**proxy.options(attempts=1), skip_instance_cache=True)
    proxy.rule = lambda request: LOST if request.method == "PUT" else PASS

    with pytest.raises(Exception):  # noqa: B017 - botocore's connection error types vary
        fs.pipe_file(f"{bucket}/k", b"applied")

    assert b"applied" == read_object(s3_server.endpoint_url, bucket, "k")


@pytest.mark.timeout(60)
def test_slow_responses_still_give_the_right_answer(proxy, s3_server):
    """With every response delayed 0.2 s (below the read timeout) checkpoints and discovery
    work unchanged."""
    access = _job(proxy, s3_server.new_bucket())
    commit(access, 1)
    commit(access, 2)
    proxy.rule = lambda request: Delay(0.2)

    latest = access.latest_completed_checkpoint()

    assert f"{access.checkpoints_directory}/chk-2" == latest.external_pointer
    assert proxy.count(action=Delay(0.2)) >= 1


@pytest.mark.timeout(60)
def test_a_response_slower_than_the_read_timeout_fails_instead_of_hanging(proxy, s3_server):
    """A server that stops answering makes discovery raise a retryable OSError within the
    configured timeouts (1 s read timeout, s3fs's own 5 tries), never hang or answer None."""
    access = _job(proxy, s3_server.new_bucket(), timeout=1.0)
    commit(access, 1)
    proxy.rule = lambda request: Delay(3.0) if request.kind == "LIST" else PASS
    started = time.monotonic()

    with pytest.raises(OSError):
        access.latest_completed_checkpoint()

    assert time.monotonic() - started < 30


# --- discovery -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", [ACCESS_DENIED, UNAVAILABLE])
def test_failed_listing_raises_instead_of_reporting_no_checkpoint(proxy, s3_server, fault):
    """When listing the job directory fails, latest_completed_checkpoint() raises an
    OSError instead of returning None."""
    access = _job(proxy, s3_server.new_bucket(), attempts=1)
    commit(access, 1)
    proxy.rule = lambda request: fault if request.kind == "LIST" else PASS

    with pytest.raises(OSError):
        access.latest_completed_checkpoint()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", [ACCESS_DENIED, UNAVAILABLE])
def test_failed_head_of_the_newest_metadata_raises_instead_of_falling_back(proxy, s3_server, fault):
    """When the newest checkpoint's `_metadata` cannot be inspected, discovery raises an
    OSError instead of returning the older checkpoint."""
    access = _job(proxy, s3_server.new_bucket(), attempts=1)
    commit(access, 1)
    commit(access, 2)
    proxy.rule = lambda request: (
        fault if request.method in ("HEAD", "GET") and "/chk-2/" in request.path else PASS
    )

    with pytest.raises(OSError):
        access.latest_completed_checkpoint()


@pytest.mark.timeout(120)
def test_discovery_under_ten_percent_list_and_info_errors_is_never_wrong(s3_server):
    """With 10% of LIST/HEAD requests failing (403/503) discovery answers chk-4 or raises an
    OSError, never None or an older checkpoint."""
    trials, failures, figure = scenario_discovery_faults(25, s3_server.endpoint_url, seed=7)

    faulted = int(re.search(r"(\d+) of \d+ requests faulted", figure).group(1))
    assert faulted > 0, figure
    assert (25, 0) == (trials, failures), figure


# --- `_metadata` PUT applied, response lost ------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attempts", [1, 3])
def test_lost_metadata_put_response_commits_once(proxy, s3_server, attempts):
    """A `_metadata` PUT applied by the server whose response is lost completes the
    checkpoint: the commit returns its location, `_metadata` holds our bytes."""
    bucket = s3_server.new_bucket()
    access = _job(proxy, bucket, attempts=attempts)
    lost = []

    def rule(request):
        if request.conditional_create and not lost:
            lost.append(request)
            return LOST
        return PASS

    proxy.rule = rule

    completed, ours = commit(access, 1, b"mine")

    key = access.checkpoints_directory.removeprefix(f"s3://{bucket}/") + "/chk-1/_metadata"
    assert 1 == len(lost)
    assert f"{access.checkpoints_directory}/chk-1" == completed.external_pointer
    assert ours == read_object(s3_server.endpoint_url, bucket, key)


@pytest.mark.timeout(60)
def test_another_writers_metadata_is_still_refused(proxy, s3_server):
    """A conditional PUT that finds another writer's `_metadata` still fails with
    FileExistsError and leaves the other writer's bytes in place."""
    bucket = s3_server.new_bucket()
    access = _job(proxy, bucket, attempts=3)
    _, theirs = commit(access, 1, b"theirs")

    with pytest.raises(FileExistsError):
        commit(access, 1, b"mine")

    key = access.checkpoints_directory.removeprefix(f"s3://{bucket}/") + "/chk-1/_metadata"
    assert theirs == read_object(s3_server.endpoint_url, bucket, key)


@pytest.mark.timeout(180)
def test_lost_metadata_put_scenario_has_no_double_commit_and_no_false_failure(s3_server):
    """Every lost-response / reset case of the `_metadata` PUT ends as expected: committed
    once with our bytes (and a second commit refused), or failed with nothing stored."""
    trials = 2 * len(LOST_PUT_CASES)

    result = scenario_lost_metadata_put(trials, s3_server.endpoint_url)

    assert (trials, 0) == (result.trials, result.failures), result.figure
