"""JobID and location references (Flink's JobID, CheckpointStorageLocationReference and
AbstractFsCheckpointStorageAccess.encodePathAsReference/decodePathFromReference)."""

import pickle
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_storage import (
    CheckpointStorageLocationReference,
    JobID,
    decode_path_from_reference,
    encode_path_as_reference,
)

MAGIC = bytes((0x05, 0x5F, 0x3F, 0x18))

FAST = settings(max_examples=200, deadline=None)


# --- JobID ---------------------------------------------------------------------------------


def test_generate_gives_32_lowercase_hex_chars():
    """A generated job id prints as 32 lowercase hex characters."""
    job_id = JobID.generate()

    assert re.fullmatch(r"[0-9a-f]{32}", str(job_id)) is not None


def test_generate_gives_distinct_ids():
    """Generated job ids are random: 100 of them are all different."""
    ids = {str(JobID.generate()) for _ in range(100)}

    assert 100 == len(ids)


def test_from_hex_round_trips_through_str():
    """from_hex(str(id)) gives back an equal job id with the same string."""
    job_id = JobID.generate()

    parsed = JobID.from_hex(str(job_id))

    assert job_id == parsed
    assert str(job_id) == str(parsed)
    assert hash(job_id) == hash(parsed)


def test_from_hex_keeps_the_given_hex():
    """str() of a parsed job id is exactly the hex it was parsed from."""
    hex_id = "0123456789abcdef0123456789abcdef"

    assert hex_id == str(JobID.from_hex(hex_id))


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "0123456789abcdef0123456789abcde",  # 31 chars
        "0123456789abcdef0123456789abcdef0",  # 33 chars
        "0123456789ABCDEF0123456789ABCDEF",  # upper case
        "0123456789abcdef0123456789abcdeg",  # not hex
        " 0123456789abcdef0123456789abcdef",
        "0123456789abcdef0123456789abcdef\n",
        "../../../../../../../../etc/pass",  # 32 chars, path-like
        "0123456789abcdef-123456789abcdef",
    ],
)
def test_from_hex_rejects_bad_input(bad):
    """from_hex raises ValueError for anything that is not 32 lowercase hex characters."""
    with pytest.raises(ValueError):
        JobID.from_hex(bad)


def test_from_hex_rejects_none():
    """from_hex(None) is a TypeError (None is not a bad value but a missing one)."""
    with pytest.raises(TypeError):
        JobID.from_hex(None)


@FAST
@given(st.text(max_size=40))
def test_from_hex_accepts_exactly_the_32_lowercase_hex_strings(text):
    """from_hex accepts a string iff it is 32 lowercase hex characters, and keeps it."""
    valid = re.fullmatch(r"[0-9a-f]{32}", text) is not None

    if valid:
        assert text == str(JobID.from_hex(text))
    else:
        with pytest.raises(ValueError):
            JobID.from_hex(text)


def test_job_id_pickles():
    """A job id survives pickling (it travels to Spark executors)."""
    job_id = JobID.generate()

    assert job_id == pickle.loads(pickle.dumps(job_id))


# --- CheckpointStorageLocationReference ----------------------------------------------------


def test_empty_reference_is_rejected():
    """Constructing a reference from empty bytes raises ValueError (use get_default())."""
    with pytest.raises(ValueError):
        CheckpointStorageLocationReference(b"")


def test_get_default_returns_one_shared_instance():
    """get_default() returns the very same object every time."""
    assert CheckpointStorageLocationReference.get_default() is (
        CheckpointStorageLocationReference.get_default()
    )


def test_default_reference_is_default_and_has_no_bytes():
    """The default reference says it is the default and has empty reference bytes."""
    default = CheckpointStorageLocationReference.get_default()

    assert default.is_default_reference() is True
    assert b"" == default.reference_bytes


def test_non_default_reference_keeps_its_bytes():
    """A reference built from bytes is not the default and returns exactly those bytes."""
    ref = CheckpointStorageLocationReference(b"\x01\x02\x03")

    assert ref.is_default_reference() is False
    assert b"\x01\x02\x03" == ref.reference_bytes


def test_references_are_equal_and_hash_equal_by_bytes():
    """Two references built from equal bytes are equal and hash the same."""
    a = CheckpointStorageLocationReference(bytes([1, 2, 3, 4, 5]))
    b = CheckpointStorageLocationReference(bytearray([1, 2, 3, 4, 5]))

    assert a is not b
    assert a == b
    assert hash(a) == hash(b)
    assert 1 == len({a, b})


def test_references_with_different_bytes_differ():
    """References with different bytes are not equal; none equals the default."""
    a = CheckpointStorageLocationReference(b"\x01")
    b = CheckpointStorageLocationReference(b"\x02")

    assert a != b
    assert a != CheckpointStorageLocationReference.get_default()
    assert CheckpointStorageLocationReference.get_default() != a


def test_reference_does_not_alias_a_mutable_buffer():
    """Mutating the bytearray a reference was built from does not change the reference."""
    buffer = bytearray(b"\x05\x06\x07")
    ref = CheckpointStorageLocationReference(buffer)

    buffer[0] = 0xFF

    assert b"\x05\x06\x07" == ref.reference_bytes


def test_repr_of_default_says_default():
    """repr of the default reference contains '(default)'."""
    assert "(default)" in repr(CheckpointStorageLocationReference.get_default())


def test_repr_of_other_reference_shows_hex():
    """repr of a non-default reference shows its bytes in hex."""
    ref = CheckpointStorageLocationReference(bytes([0xDE, 0xAD, 0xBE, 0xEF]))

    assert "deadbeef" in repr(ref).lower()
    assert "(default)" not in repr(ref)


def test_pickled_default_is_the_default_instance():
    """Unpickling the default reference gives back the one shared default instance."""
    default = CheckpointStorageLocationReference.get_default()

    restored = pickle.loads(pickle.dumps(default))

    assert restored is default


def test_pickled_reference_round_trips():
    """A non-default reference survives pickling with equal bytes."""
    ref = encode_path_as_reference("s3://bucket/savepoints/savepoint-abc123-0123456789ab")

    restored = pickle.loads(pickle.dumps(ref))

    assert ref == restored
    assert ref.reference_bytes == restored.reference_bytes
    assert restored.is_default_reference() is False


# --- encode / decode -----------------------------------------------------------------------


def test_encode_is_magic_number_then_utf8_path():
    """encode_path_as_reference gives 05 5F 3F 18 followed by the path in UTF-8."""
    path = "s3://bücket/check/points"

    ref = encode_path_as_reference(path)

    assert MAGIC + path.encode("utf-8") == ref.reference_bytes
    assert ref.is_default_reference() is False


def test_decode_reverses_encode():
    """decode(encode(p)) == p for a plain local path."""
    path = "/tmp/flink/savepoints/savepoint-0123ab-abcdefabcdef"

    assert path == decode_path_from_reference(encode_path_as_reference(path))


def test_decode_accepts_bytes_built_by_hand():
    """A reference of the magic number and a UTF-8 path decodes to that path (wire format)."""
    ref = CheckpointStorageLocationReference(MAGIC + "memory://a/ß/c".encode())

    assert "memory://a/ß/c" == decode_path_from_reference(ref)


def test_decode_rejects_default_reference():
    """The default reference does not encode a path: ValueError."""
    with pytest.raises(ValueError):
        decode_path_from_reference(CheckpointStorageLocationReference.get_default())


@pytest.mark.parametrize(
    "data", [b"\x05", b"\x05\x5f", b"\x05\x5f\x3f", MAGIC, b"\x00\x00\x00\x00"]
)
def test_decode_rejects_four_bytes_or_fewer(data):
    """A reference of at most 4 bytes (even exactly the magic number) is rejected."""
    with pytest.raises(ValueError):
        decode_path_from_reference(CheckpointStorageLocationReference(data))


@pytest.mark.parametrize(
    "magic",
    [
        bytes((0x05, 0x5F, 0x3F, 0x19)),
        bytes((0x18, 0x3F, 0x5F, 0x05)),
        bytes((0x00, 0x00, 0x00, 0x00)),
        b"s3:/",
    ],
)
def test_decode_rejects_wrong_magic_number(magic):
    """A reference whose first 4 bytes are not 05 5F 3F 18 is rejected."""
    with pytest.raises(ValueError):
        decode_path_from_reference(CheckpointStorageLocationReference(magic + b"/some/path"))


@pytest.mark.parametrize("tail", [b"\xff", b"\xc3", b"/a/\x80b", b"\xed\xa0\x80", b"\xc0\xaf"])
def test_decode_rejects_invalid_utf8(tail):
    """The magic number followed by bytes that are not UTF-8 is rejected with ValueError."""
    with pytest.raises(ValueError):
        decode_path_from_reference(CheckpointStorageLocationReference(MAGIC + tail))


def test_decode_error_is_not_a_bare_unicode_error():
    """Invalid UTF-8 is reported as the library's ValueError, not a raw UnicodeDecodeError."""
    with pytest.raises(ValueError) as info:
        decode_path_from_reference(CheckpointStorageLocationReference(MAGIC + b"\xff\xfe"))

    assert not isinstance(info.value, UnicodeDecodeError)


def test_encode_rejects_empty_path():
    """Encoding an empty path is a ValueError (it could not be decoded again)."""
    with pytest.raises(ValueError):
        encode_path_as_reference("")


def test_encode_rejects_none():
    """Encoding None is a TypeError."""
    with pytest.raises(TypeError):
        encode_path_as_reference(None)


def test_decode_rejects_none():
    """Decoding None is a TypeError."""
    with pytest.raises(TypeError):
        decode_path_from_reference(None)


# --- properties ----------------------------------------------------------------------------

# Paths as users configure them: printable characters, any script, no surrounding blanks.
paths = st.text(
    alphabet=st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")),
    min_size=1,
    max_size=200,
).filter(lambda p: p.isprintable() and p == p.strip())


@FAST
@given(paths)
def test_reference_codec_round_trips(path):
    """decode(encode(p)) == p for every non-empty printable path."""
    ref = encode_path_as_reference(path)

    assert path == decode_path_from_reference(ref)
    assert MAGIC + path.encode("utf-8") == ref.reference_bytes


@FAST
@given(paths)
def test_reference_codec_round_trips_through_pickle(path):
    """A pickled path reference still decodes to its path (references travel to executors)."""
    ref = pickle.loads(pickle.dumps(encode_path_as_reference(path)))

    assert path == decode_path_from_reference(ref)


@FAST
@given(st.binary(min_size=1, max_size=64))
def test_random_bytes_decode_only_with_the_magic_number(data):
    """Random bytes never decode unless they start with the magic number (and hold a path)."""
    ref = CheckpointStorageLocationReference(data)

    if not data.startswith(MAGIC) or len(data) <= 4:
        with pytest.raises(ValueError):
            decode_path_from_reference(ref)
    else:
        try:
            decoded = decode_path_from_reference(ref)
        except ValueError:
            return  # not a valid path: rejected, as it should be
        assert data[4:] == decoded.encode("utf-8")


@FAST
@given(st.binary(min_size=1, max_size=64))
def test_random_suffix_after_magic_decodes_or_raises_value_error(tail):
    """After the magic number, any bytes either decode to exactly those bytes or raise
    ValueError: never another exception, never a different path."""
    ref = CheckpointStorageLocationReference(MAGIC + tail)

    try:
        decoded = decode_path_from_reference(ref)
    except ValueError:
        return
    assert tail == decoded.encode("utf-8")


@FAST
@given(st.binary(min_size=1, max_size=64), st.binary(min_size=1, max_size=64))
def test_equality_is_equality_of_bytes(a, b):
    """Two references are equal exactly when their bytes are."""
    ra, rb = CheckpointStorageLocationReference(a), CheckpointStorageLocationReference(b)

    assert (a == b) == (ra == rb)
    if a == b:
        assert hash(ra) == hash(rb)


@FAST
@given(st.text(min_size=1, max_size=50))
def test_every_reference_encode_produces_decodes_again(path):
    """encode either refuses a path (ValueError) or produces a reference that decodes back
    to it: the library never hands out a reference it cannot read itself."""
    try:
        ref = encode_path_as_reference(path)
    except ValueError:
        return

    assert path == decode_path_from_reference(ref)
