"""Hostile pointers, hostile handle paths and fuzzed `_metadata` bytes (issue 7)."""

import random

import pytest

from checkpoint_storage import FileStateHandle, FileSystemCheckpointStorage
from checkpoint_storage._filesystems import check_pointer, check_relative_path
from checkpoint_storage._metadata import HEADER_SIZE, decode_metadata
from checkpoint_storage.exceptions import UnsafePathError
from tests.reliability.proxy import FaultProxy
from tests.reliability.scenarios_net import (
    FUZZ_DIRECTORY,
    FUZZ_ROOTS,
    decode_outcome,
    fuzz_seed_metadata,
    hostile_metadata,
    mutate,
    reseal,
    scenario_decoder_fuzz,
    scenario_hostile_pointers,
)

ENCODED = [
    "%2e%2e",
    "%2E%2e",
    "%2e.",
    ".%2e",
    "%252e%252e",
    "%25252e%25252e",
    "..%2f..",
    "..\\..",
    "a\\..\\..\\b",
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("traversal", ENCODED)
def test_encoded_traversal_in_a_pointer_is_rejected_before_any_request(s3_server, traversal):
    """A pointer hiding '..' behind percent-encoding or backslashes raises UnsafePathError
    without a single S3 request."""
    bucket = s3_server.new_bucket()
    with FaultProxy(s3_server.endpoint_url) as proxy:
        storage = FileSystemCheckpointStorage(f"s3://{bucket}/cp", storage_options=proxy.options())

        with pytest.raises(UnsafePathError):
            storage.resolve_checkpoint(f"s3://{bucket}/cp/job/chk-1/{traversal}/other/chk-9")

        assert 0 == len(proxy.log)


@pytest.mark.parametrize("traversal", ENCODED)
def test_encoded_traversal_in_an_absolute_handle_path_is_rejected(traversal):
    """`_metadata` whose handle path hides '..' behind encoding is refused with
    UnsafePathError."""
    data = hostile_metadata(FUZZ_DIRECTORY, "absolute", f"{FUZZ_DIRECTORY}/{traversal}/x")

    with pytest.raises(UnsafePathError):
        decode_metadata(data, source="t", directory=FUZZ_DIRECTORY, roots=FUZZ_ROOTS)


@pytest.mark.parametrize("traversal", ENCODED)
def test_encoded_traversal_in_a_relative_handle_path_is_rejected(traversal):
    """A relative handle path hiding '..' behind encoding is refused."""
    with pytest.raises(UnsafePathError):
        check_relative_path(f"{traversal}/x")


@pytest.mark.parametrize(
    "pointer",
    ["s3://b/cp/100%/chk-1", "s3://b/cp/a%20b/chk-1", "/data/cp/x%25y/chk-3", "s3://b/a.b/..c"],
)
def test_percent_signs_and_dots_in_names_are_still_accepted(pointer):
    """Names with '%' escapes that decode to no traversal, and dotted names, still pass."""
    assert pointer == check_pointer(pointer)


def test_legitimate_handle_paths_still_decode():
    """A `_metadata` with handles inside its roots decodes (the hardening rejects no
    legitimate path)."""
    metadata = decode_metadata(
        fuzz_seed_metadata(), source="t", directory=FUZZ_DIRECTORY, roots=FUZZ_ROOTS
    )

    assert 7 == metadata.checkpoint_id
    assert {"s3://bucket/cp/job/shared/f2", f"{FUZZ_DIRECTORY}/f1"} <= {
        h.path for h in metadata.all_handles() if isinstance(h, FileStateHandle)
    }


@pytest.mark.timeout(120)
def test_hostile_pointers_and_handle_paths_are_all_rejected_without_io(s3_server):
    """500 generated hostile pointers and `_metadata` handle paths (traversal, encoded
    traversal, backslashes, control characters, other buckets, sibling prefixes, other
    checkpoints, absolute local paths) are all rejected, with zero S3 requests."""
    trials, failures, figure = scenario_hostile_pointers(500, s3_server.endpoint_url)

    assert trials >= 400, figure
    assert 0 == failures, figure


# --- decoder fuzzing -----------------------------------------------------------------------


def test_resealed_mutations_reach_the_body_parser():
    """The fuzzer's resealed mutations pass the header checks, so they test the body
    parser: some decode, some are refused deep inside the body."""
    rng = random.Random(3)
    body = fuzz_seed_metadata()[HEADER_SIZE:]

    outcomes = {decode_outcome(reseal(mutate(rng, body))) for _ in range(300)}

    assert {"invalid", "unsafe", "valid"} <= outcomes


@pytest.mark.timeout(120)
def test_decoder_raises_only_format_errors_on_random_and_mutated_bytes():
    """2000 random and mutated `_metadata` inputs raise only InvalidCheckpointError (or
    UnsafePathError for a mutated path), and decoding one peaks under the memory bound."""
    trials, failures, figure = scenario_decoder_fuzz(2000, seed=11)

    assert (2000, 0) == (trials, failures), figure
