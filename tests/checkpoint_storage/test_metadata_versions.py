"""`_metadata` format version 2 (issue 13): the lease epoch is appended to the body; files of
version 1 (written before leases) still load, with no epoch."""

import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoint_storage import CheckpointMetadata, InvalidCheckpointError, JobID
from checkpoint_storage._filesystems import PathRoots
from checkpoint_storage._metadata import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    decode_metadata,
    encode_metadata,
)

pytestmark = pytest.mark.timeout(60)

DIRECTORY = "memory:///cp/job/chk-1"
ROOTS = PathRoots((DIRECTORY,))
_HEADER = struct.Struct(">8sHHQI")


def _decode(data: bytes) -> CheckpointMetadata:
    return decode_metadata(data, source="test", directory=DIRECTORY, roots=ROOTS)


def _as_version_1(data: bytes) -> bytes:
    """The version-1 encoding of metadata without a lease epoch: the v2 body minus its
    trailing absent-epoch flag, under a version-1 header (what the old writer produced)."""
    body = data[HEADER_SIZE:]
    assert body[-1:] == b"\x00"
    body = body[:-1]
    return _HEADER.pack(MAGIC, 1, 0, len(body), zlib.crc32(body)) + body


metadata_without_epoch = st.builds(
    CheckpointMetadata,
    st.integers(0, 2**63 - 1),
    master_states=st.dictionaries(st.text(max_size=10), st.binary(max_size=50), max_size=3),
    job_id=st.none() | st.builds(JobID.generate),
    timestamp_ms=st.none() | st.integers(-(2**63), 2**63 - 1),
)

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_the_writer_uses_version_2():
    """New files carry format version 2."""
    data = encode_metadata(CheckpointMetadata(1, lease_epoch=7))

    assert (MAGIC, 2) == (data[:8], FORMAT_VERSION)
    assert 2 == int.from_bytes(data[8:10], "big")


@SETTINGS
@given(metadata=metadata_without_epoch, epoch=st.integers(1, 2**63 - 1))
def test_the_lease_epoch_round_trips(metadata, epoch):
    """Any metadata with any lease epoch decodes to itself."""
    stamped = CheckpointMetadata(
        metadata.checkpoint_id,
        master_states=metadata.master_states,
        job_id=metadata.job_id,
        timestamp_ms=metadata.timestamp_ms,
        lease_epoch=epoch,
    )

    assert stamped == _decode(encode_metadata(stamped))


@SETTINGS
@given(metadata=metadata_without_epoch)
def test_version_1_files_still_load_without_an_epoch(metadata):
    """A version-1 file (no epoch field) loads as the same metadata, lease_epoch None."""
    loaded = _decode(_as_version_1(encode_metadata(metadata)))

    assert (metadata, None) == (loaded, loaded.lease_epoch)


def test_a_version_1_header_over_a_version_2_body_is_rejected():
    """The epoch field is only read from version 2: under a version-1 header it is trailing
    garbage, and the file is refused (fail closed)."""
    data = encode_metadata(CheckpointMetadata(1, lease_epoch=3))
    body = data[HEADER_SIZE:]
    relabelled = _HEADER.pack(MAGIC, 1, 0, len(body), zlib.crc32(body)) + body

    with pytest.raises(InvalidCheckpointError, match="trailing bytes"):
        _decode(relabelled)


@pytest.mark.parametrize("version", [0, 3, 65535])
def test_unknown_versions_are_rejected(version):
    """Versions other than 1 and 2 are refused, naming the versions this library reads."""
    data = encode_metadata(CheckpointMetadata(1))
    body = data[HEADER_SIZE:]
    other = _HEADER.pack(MAGIC, version, 0, len(body), zlib.crc32(body)) + body

    with pytest.raises(InvalidCheckpointError, match="reads versions 1, 2"):
        _decode(other)


@pytest.mark.parametrize("epoch", [0, -1, 2**63, True, "1"])
def test_an_out_of_range_epoch_is_refused(epoch):
    """lease_epoch is an int in [1, 2^63)."""
    with pytest.raises(ValueError):
        CheckpointMetadata(1, lease_epoch=epoch)
