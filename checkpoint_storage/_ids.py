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
