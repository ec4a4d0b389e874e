"""Publishing `_metadata`: a PUT whose outcome is unknown is resolved by reading the object back
(issue: recovery rules). Faults are injected around a real memory filesystem."""

import os
import uuid

import fsspec
import pytest

from checkpoint_storage._filesystems import _put_if_absent_remote, put_if_absent
from checkpoint_storage.exceptions import (
    CheckpointAlreadyExistsError,
    CheckpointCommitFailedError,
    CommitStateUnknownError,
)

DATA = b"our _metadata"


@pytest.fixture
def fs_path():
    fs = fsspec.filesystem("memory")
    return fs, f"/commit-{uuid.uuid4().hex}/_metadata"


def lost_response(fs, path, data):
    """A PUT the server applied, whose response never arrived."""

    def put():
        fs.pipe_file(path, data)
        raise TimeoutError("read timed out")

    return put


def test_applied_put_with_lost_response_counts_as_committed(fs_path):
    """The object is ours: the commit succeeded, no error and no second write."""
    fs, path = fs_path
    _put_if_absent_remote(fs, path, DATA, "memory://x", lost_response(fs, path, DATA))
    assert DATA == fs.cat_file(path)


def test_put_that_never_arrived_is_a_failed_commit(fs_path):
    """Nothing was stored: commit failed, and retrying is safe."""
    fs, path = fs_path

    def put():
        raise ConnectionResetError("reset by peer")

    with pytest.raises(CheckpointCommitFailedError, match="retrying is safe"):
        _put_if_absent_remote(fs, path, DATA, "memory://x", put)


def test_other_content_after_an_unknown_outcome_is_another_writers_commit(fs_path):
    """Another writer's bytes are there: FileExistsError, never a false success."""
    fs, path = fs_path
    _put_if_absent_remote(fs, path, b"theirs", "memory://x", lost_response(fs, path, b"theirs"))
    with pytest.raises(CheckpointAlreadyExistsError):
        _put_if_absent_remote(fs, path, DATA, "memory://x", lost_response(fs, path, b"theirs"))


def test_unreadable_outcome_is_commit_state_unknown(fs_path):
    """When the read-back fails too, the outcome is reported as unknown, not as failed."""
    fs, path = fs_path

    class Unreadable(type(fs)):
        def cat_file(self, *args, **kwargs):
            raise TimeoutError("still unreachable")

    def put():
        raise TimeoutError("read timed out")

    with pytest.raises(CommitStateUnknownError, match="may or may not"):
        _put_if_absent_remote(Unreadable(), path, DATA, "memory://x", put)


def test_local_publish_leaves_no_temp_file_when_the_target_exists(tmp_path):
    """A refused local publish cleans up its staged temp file and keeps the first bytes."""
    target = tmp_path / "_metadata"
    fs = fsspec.filesystem("file")
    put_if_absent(fs, str(target), b"first")
    with pytest.raises(FileExistsError):
        put_if_absent(fs, str(target), b"second")
    assert (["_metadata"], b"first") == (os.listdir(tmp_path), target.read_bytes())


def test_local_publish_into_a_missing_directory_is_a_failed_commit(tmp_path):
    """A missing chk directory fails the commit with a message saying nothing was published."""
    fs = fsspec.filesystem("file")
    with pytest.raises(CheckpointCommitFailedError, match="Nothing was published"):
        put_if_absent(fs, str(tmp_path / "missing" / "_metadata"), DATA)
