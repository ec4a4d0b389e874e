"""Job identifiers."""

import re
import secrets
from dataclasses import dataclass

_HEX32 = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class JobID:
    """A job's identity: 32 lowercase hex characters, as Flink prints its ``JobID``."""

    hex: str

    def __post_init__(self) -> None:
        if not isinstance(self.hex, str) or not _HEX32.fullmatch(self.hex):
            raise ValueError(f"a job id is 32 lowercase hex characters, got {self.hex!r}")

    @classmethod
    def generate(cls) -> "JobID":
        return cls(secrets.token_hex(16))

    @classmethod
    def from_hex(cls, value: str) -> "JobID":
        if value is None:
            raise TypeError("job id must not be None")
        return cls(value)

    @classmethod
    def of(cls, value: "JobID | str") -> "JobID":
        """Accept a ``JobID`` or its hex string, as every API taking a job id does."""
        return value if isinstance(value, JobID) else cls.from_hex(value)

    def __str__(self) -> str:
        return self.hex


def is_job_id(name: str) -> bool:
    """Whether ``name`` is a job id (the name of a job directory ``<base>/<job_id>``)."""
    return bool(_HEX32.fullmatch(name))


MAX_CHECKPOINT_ID = 2**63 - 1
_CHK_DIR = re.compile(r"chk-([1-9][0-9]{0,18})")


def checkpoint_directory_id(name: str) -> int | None:
    """The id of a checkpoint directory named ``chk-<id>`` (decimal, no leading zero, ``0 < id
    < 2**63`` as Flink's ``long`` ids), else None: ``chk-0``, ``chk-007``, ``chk-+1`` and
    ``chk-99999999999999999999`` are not checkpoint directories."""
    match = _CHK_DIR.fullmatch(name)
    if match is None:
        return None
    checkpoint_id = int(match.group(1))
    return checkpoint_id if checkpoint_id <= MAX_CHECKPOINT_ID else None
