"""Every exception the library raises on purpose.

The tree::

    CheckpointStorageError                  root: catch this to catch everything below
    ├── UnsafePathError (ValueError)        a pointer or handle path leaves the configured roots
    ├── InvalidCheckpointError (ValueError) `_metadata` is truncated, corrupt, foreign or from an
    │   │                                   unknown format version: not a valid checkpoint
    │   ├── ForeignCheckpointError          `_metadata` in a format this library cannot read:
    │   │                                   Apache Flink's (magic 0x4960672d), an unknown one, or
    │   │                                   a newer version of this library's; never deleted
    │   ├── FlinkMetadataError              Apache Flink's `_metadata` is truncated, corrupt,
    │   │                                   of an unsupported version or uses a feature the
    │   │                                   Flink reader does not support (names the offset)
    │   ├── CheckpointIdMismatchError       `_metadata` of checkpoint m in a directory chk-n
    │   │                                   (n != m): a copied or renamed directory; never deleted
    │   └── StateIntegrityError             a state file's size or checksum differs from its handle
    ├── UnsupportedFileSystemError (ValueError)
    │                                       the filesystem cannot publish `_metadata` atomically
    ├── StorageConfigurationError (ValueError)
    │                                       the storage cannot be opened as configured here, e.g.
    │                                       an environment variable holding a credential is
    │                                       unset, or a file merging manager initialised again
    │                                       with another job's directories
    ├── CheckpointNotFoundError (FileNotFoundError)
    │                                       no checkpoint at the pointer (or no `_metadata` in it)
    ├── CheckpointAlreadyExistsError (FileExistsError)
    │                                       `_metadata` already exists: another writer committed
    ├── CheckpointCommitFailedError (OSError)
    │                                       publishing `_metadata` failed; nothing was published
    ├── UnreadableCheckpointError (OSError) `_metadata` exists but cannot be opened or read
    │                                       (permission, symbolic link loop, a directory or FIFO
    │                                       in its place): no verdict on the checkpoint
    ├── CommitStateUnknownError (OSError)   publishing `_metadata` may or may not have happened and
    │                                       reading it back could not tell: inspect before retrying
    ├── StateSizeExceededError (OSError)    a state is larger than the memory storage allows
    ├── StreamClosedError (OSError)         the stream was already closed or committed
    ├── OrphanDeletionRefusedError          deleting a job directory's orphans was refused
    │                                       (no confirmation, an unreadable _metadata, the
    │                                       retained checkpoints changed): nothing deleted
    └── JobLeaseError                       the job lease (one coordinator per job directory)
        ├── JobLeaseHeldError               another coordinator holds the job's lease (names
        │                                   the holder, its epoch and when it expires)
        └── JobLeaseLostError               this coordinator's lease expired, was released,
                                            broken or taken over: it may not publish

Bad arguments raise plain ``ValueError`` (``TypeError`` for ``None``); I/O failures of the
underlying filesystem propagate as the ``OSError`` the filesystem raised.
"""

__all__ = [
    "CheckpointAlreadyExistsError",
    "CheckpointCommitFailedError",
    "CheckpointNotFoundError",
    "CheckpointStorageError",
    "CheckpointIdMismatchError",
    "CommitStateUnknownError",
    "FlinkMetadataError",
    "ForeignCheckpointError",
    "InvalidCheckpointError",
    "JobLeaseError",
    "JobLeaseHeldError",
    "JobLeaseLostError",
    "OrphanDeletionRefusedError",
    "StateIntegrityError",
    "StateSizeExceededError",
    "StorageConfigurationError",
    "StreamClosedError",
    "UnreadableCheckpointError",
    "UnsafePathError",
    "UnsupportedFileSystemError",
]


class CheckpointStorageError(Exception):
    """Root of the library's exceptions."""


class UnsafePathError(CheckpointStorageError, ValueError):
    """A path read from a pointer or from `_metadata` escapes the roots it must stay in."""


class InvalidCheckpointError(CheckpointStorageError, ValueError):
    """The bytes are not a valid, complete checkpoint (`_metadata` or state)."""


class ForeignCheckpointError(InvalidCheckpointError):
    """`_metadata` was written by another system (Apache Flink, or an unknown format) or by a
    newer version of this library: this library cannot read it, so it cannot tell what the
    checkpoint references. Such a checkpoint is skipped and never deleted.

    ``format_name`` is ``"Apache Flink"``, ``"newer version"`` (of this library's format) or
    ``"unknown"``; ``format_version`` the version the header names, when it names one."""

    def __init__(
        self, message: str, *, format_name: str = "unknown", format_version: int | None = None
    ) -> None:
        super().__init__(message)
        self.format_name = format_name
        self.format_version = format_version


class FlinkMetadataError(InvalidCheckpointError):
    """Apache Flink's `_metadata` cannot be read: truncated, corrupt, of a format version the
    reader does not know, or using a feature it does not support (changelog handles, channel
    state of unaligned checkpoints). ``offset`` is the byte the reader stopped at,
    ``format_version`` the version the header names when the version is the reason. What
    cannot be read is reported and kept, never deleted."""

    def __init__(
        self, message: str, *, offset: int | None = None, format_version: int | None = None
    ) -> None:
        super().__init__(message)
        self.offset = offset
        self.format_version = format_version


class CheckpointIdMismatchError(InvalidCheckpointError):
    """The id inside `_metadata` differs from its directory's ``chk-<id>`` (a copied or
    renamed checkpoint directory). Skipped by discovery and recovery; never deleted by GC."""


class StateIntegrityError(InvalidCheckpointError):
    """A state file does not have the size or checksum its handle records."""


class UnsupportedFileSystemError(CheckpointStorageError, ValueError):
    """The filesystem offers no put-if-absent primitive to publish `_metadata` with."""


class CheckpointNotFoundError(CheckpointStorageError, FileNotFoundError):
    """No completed checkpoint exists at the given pointer."""


class CheckpointAlreadyExistsError(CheckpointStorageError, FileExistsError):
    """`_metadata` is already present: the checkpoint was completed by another writer."""


class CheckpointCommitFailedError(CheckpointStorageError, OSError):
    """Publishing `_metadata` failed and nothing was published; retrying is safe."""


class UnreadableCheckpointError(CheckpointStorageError, OSError):
    """`_metadata` exists but cannot be opened or read (permission, a symbolic link loop, a
    directory, FIFO or device in its place). The message names the file and what to do; it
    says nothing about whether the checkpoint is valid, so nothing is deleted because of it."""


class CommitStateUnknownError(CheckpointStorageError, OSError):
    """Publishing `_metadata` may have succeeded; read the location before retrying."""


class StateSizeExceededError(CheckpointStorageError, OSError):
    """A state stream exceeded the maximum size of the memory checkpoint storage."""


class StreamClosedError(CheckpointStorageError, OSError):
    """The stream was closed or already returned its handle."""


class OrphanDeletionRefusedError(CheckpointStorageError):
    """Deleting the orphans of a job directory was refused before anything was deleted:
    no explicit confirmation, a `_metadata` that cannot be read, or retained checkpoints
    that changed since the listing. The message says which and what to do."""


class StorageConfigurationError(CheckpointStorageError, ValueError):
    """The storage cannot be opened as configured in this process (e.g. an environment
    variable that holds a credential is not set)."""


class JobLeaseError(CheckpointStorageError):
    """Root of the job lease errors (one coordinator per job directory)."""


class JobLeaseHeldError(JobLeaseError):
    """Another coordinator holds the job's lease. ``holder``, ``epoch`` and ``expires_at``
    (epoch seconds, by the holder's last renewal; None when unknown) describe it."""

    def __init__(
        self,
        message: str,
        *,
        holder: str | None = None,
        epoch: int | None = None,
        expires_at: float | None = None,
    ) -> None:
        super().__init__(message)
        self.holder = holder
        self.epoch = epoch
        self.expires_at = expires_at


class JobLeaseLostError(JobLeaseError):
    """This coordinator no longer holds the job's lease (expired, released, broken or taken
    over by a newer epoch): it must not publish `_metadata`; acquire the lease again."""
