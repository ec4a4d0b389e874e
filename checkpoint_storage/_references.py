"""Location references: how the coordinator tells workers where a checkpoint goes."""

import enum
import re

__all__ = [
    "CheckpointStorageLocationReference",
    "CheckpointedStateScope",
    "decode_path_from_reference",
    "encode_path_as_reference",
]

# Flink's AbstractFsCheckpointStorageAccess.REFERENCE_MAGIC_NUMBER (0x05 5F 3F 18).
REFERENCE_MAGIC_NUMBER = bytes((0x05, 0x5F, 0x3F, 0x18))
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


def _valid_path(path: str) -> bool:
    return bool(path) and not _CONTROL_CHARS.search(path)


class CheckpointedStateScope(enum.Enum):
    """Who owns a piece of state: one checkpoint (EXCLUSIVE) or many (SHARED)."""

    EXCLUSIVE = "EXCLUSIVE"
    SHARED = "SHARED"


class CheckpointStorageLocationReference:
    """Opaque bytes that workers resolve into a stream factory.

    The default reference (empty bytes) means "this job's ``chk-<id>`` directory"; savepoints
    and other non-default locations encode their directory with ``encode_path_as_reference``.
    """

    __slots__ = ("_encoded",)

    def __init__(self, encoded: bytes) -> None:
        if encoded is None:
            raise TypeError("encoded reference must not be None")
        encoded = bytes(encoded)
        if not encoded:
            raise ValueError(
                "an empty reference is the default reference: use "
                "CheckpointStorageLocationReference.get_default()"
            )
        self._encoded = encoded

    @staticmethod
    def get_default() -> "CheckpointStorageLocationReference":
        return _DEFAULT

    def is_default_reference(self) -> bool:
        return not self._encoded

    @property
    def reference_bytes(self) -> bytes:
        return self._encoded

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CheckpointStorageLocationReference):
            return NotImplemented
        return self._encoded == other._encoded

    def __hash__(self) -> int:
        return hash(self._encoded)

    def __repr__(self) -> str:
        if not self._encoded:
            return "CheckpointStorageLocationReference(default)"
        return f"CheckpointStorageLocationReference({self._encoded.hex()})"

    def __reduce__(self):
        # Unpickling the default must give back the shared default instance.
        if not self._encoded:
            return (CheckpointStorageLocationReference.get_default, ())
        return (CheckpointStorageLocationReference, (self._encoded,))


_DEFAULT: "CheckpointStorageLocationReference | None" = None
_DEFAULT = CheckpointStorageLocationReference.__new__(CheckpointStorageLocationReference)
_DEFAULT._encoded = b""


def encode_path_as_reference(path: str) -> CheckpointStorageLocationReference:
    """The reference to a directory: magic number, then the path in UTF-8."""
    if path is None:
        raise TypeError("path must not be None")
    if not isinstance(path, str) or not _valid_path(path):
        raise ValueError(f"path must be a non-empty string without control characters: {path!r}")
    return CheckpointStorageLocationReference(REFERENCE_MAGIC_NUMBER + path.encode("utf-8"))


def decode_path_from_reference(reference: CheckpointStorageLocationReference) -> str:
    """The directory a non-default reference points to; ValueError for anything else."""
    if reference is None:
        raise TypeError("reference must not be None")
    if reference.is_default_reference():
        raise ValueError("the default reference does not encode a path")
    data = reference.reference_bytes
    if len(data) <= len(REFERENCE_MAGIC_NUMBER):
        raise ValueError(f"reference of {len(data)} bytes is too short to hold a path")
    if data[: len(REFERENCE_MAGIC_NUMBER)] != REFERENCE_MAGIC_NUMBER:
        raise ValueError("reference does not start with the path reference magic number")
    try:
        path = data[len(REFERENCE_MAGIC_NUMBER) :].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError("reference does not encode a valid UTF-8 path") from exc
    if not _valid_path(path):
        raise ValueError(f"reference does not encode a valid path: {path!r}")
    return path
