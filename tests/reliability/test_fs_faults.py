"""Fault injection at named points of state files and the `_metadata` commit (issue 7)."""

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from checkpoint_storage import FileSystemCheckpointStorage
from tests.reliability import faulty_fs, scenarios_fs


@pytest.fixture
def local(tmp_path) -> scenarios_fs.Target:
    return scenarios_fs.local_target(str(tmp_path))


@pytest.fixture
def s3(s3_server, s3_bucket) -> scenarios_fs.Target:
    return scenarios_fs.s3_target(s3_server.endpoint_url, s3_bucket)


@pytest.mark.timeout(30)
def test_injecting_routes_the_library_through_the_harness_and_restores_it(tmp_path):
    """Inside injecting() the library's filesystem is the faulty one; afterwards the real."""
    with faulty_fs.injecting():
        access = FileSystemCheckpointStorage(str(tmp_path)).create_checkpoint_storage("a" * 32)
        assert faulty_fs.FaultyLocalFileSystem is type(access._fs)
    assert LocalFileSystem is type(fsspec.core.url_to_fs(str(tmp_path))[0])


@pytest.mark.timeout(30)
def test_a_fault_fires_once_at_its_point(tmp_path):
    """A fail fault raises at its point once, then the filesystem delegates again."""
    plan = faulty_fs.FaultPlan([faulty_fs.Fault("state.close", "before")])
    with faulty_fs.injecting(plan):
        fs = fsspec.filesystem("file")
        f = fs.open(str(tmp_path / "x"), "wb")
        f.write(b"abc")
        with pytest.raises(faulty_fs.InjectedFault):
            f.close()
        f.close()
    assert [("state.close", "before", "fail")] == plan.fired
    assert b"abc" == (tmp_path / "x").read_bytes()


@pytest.mark.timeout(60)
def test_metadata_commit_faults_local(local):
    """Every fault point of the local `_metadata` commit, before and after: never torn."""
    cases = scenarios_fs.metadata_fault_cases("local")
    outcome = scenarios_fs.metadata_commit_faults(len(cases), local)
    assert (0, []) == (outcome.failures, outcome.problems)


@pytest.mark.timeout(120)
def test_metadata_commit_faults_s3(s3):
    """The conditional PUT of `_metadata` failing before or after it applied: never torn."""
    cases = scenarios_fs.metadata_fault_cases("s3")
    outcome = scenarios_fs.metadata_commit_faults(2 * len(cases), s3)
    assert (0, []) == (outcome.failures, outcome.problems)


@pytest.mark.timeout(120)
def test_stream_exceptions_local(local):
    """A state or metadata stream failing at any size leaves nothing at the target."""
    outcome = scenarios_fs.stream_exceptions(len(scenarios_fs.stream_failure_cases()), local)
    assert (0, []) == (outcome.failures, outcome.problems)


@pytest.mark.timeout(300)
def test_stream_exceptions_s3(s3):
    """A failing stream leaves no object and no open multipart upload on S3."""
    outcome = scenarios_fs.stream_exceptions(len(scenarios_fs.stream_failure_cases()), s3)
    assert (0, []) == (outcome.failures, outcome.problems)
