"""Flink's checkpoint storage layer, in Python, over any fsspec filesystem.

The coordinator (e.g. a Spark driver) creates checkpoint locations and publishes `_metadata`
last; workers (e.g. Spark executors) resolve a location reference into a stream factory and
write their state through it. See DESIGN.md §3 and docs/metadata-format.md.
"""

from checkpoint_storage._access import (
    CheckpointStateToolset,
    CheckpointStorageAccess,
    CheckpointStorageCoordinatorView,
    CheckpointStorageWorkerView,
)
from checkpoint_storage._file_merging import (
    FileMergingSnapshotManager,
    FileMergingType,
    LogicalFile,
    PhysicalFile,
    PhysicalFilePoolType,
    SpaceStat,
    SubtaskKey,
    create_file_merging_snapshot_manager,
)
from checkpoint_storage._gc import GarbageCollectionResult, collect_garbage
from checkpoint_storage._handles import (
    ByteStreamStateHandle,
    FileStateHandle,
    RelativeFileStateHandle,
    SegmentFileStateHandle,
    StreamStateHandle,
)
from checkpoint_storage._ids import JobID
from checkpoint_storage._lease import (
    DEFAULT_LEASE_TTL,
    JobLease,
    LeaseRecord,
    break_job_lease,
    read_job_lease,
)
from checkpoint_storage._locations import (
    CheckpointMetadataOutputStream,
    CheckpointStorageLocation,
    CompletedCheckpointStorageLocation,
)
from checkpoint_storage._metadata import (
    CheckpointMetadata,
    CheckpointProperties,
    OperatorState,
    OperatorSubtaskState,
    SavepointFormatType,
    SnapshotType,
    load_checkpoint_metadata,
    store_checkpoint_metadata,
)
from checkpoint_storage._references import (
    CheckpointedStateScope,
    CheckpointStorageLocationReference,
    decode_path_from_reference,
    encode_path_as_reference,
)
from checkpoint_storage._retention import CheckpointRetentionPolicy, JobStatus, RestoreMode
from checkpoint_storage._shared_state import SharedStateRegistry
from checkpoint_storage._storage import (
    CheckpointStorage,
    FileSystemCheckpointStorage,
    MemoryCheckpointStorage,
)
from checkpoint_storage._store import (
    CompletedCheckpoint,
    CompletedCheckpointStore,
    FileSystemCompletedCheckpointStore,
    StandaloneCompletedCheckpointStore,
    abort_checkpoint,
    discard_checkpoint,
)
from checkpoint_storage._streams import CheckpointStateOutputStream, CheckpointStreamFactory
from checkpoint_storage._tools import (
    CheckpointInfo,
    VerificationProblem,
    VerificationReport,
    copy_savepoint,
    dispose_savepoint,
    latest_checkpoint,
    list_checkpoints,
    verify_checkpoint,
)
from checkpoint_storage.exceptions import (
    CheckpointAlreadyExistsError,
    CheckpointCommitFailedError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    CommitStateUnknownError,
    InvalidCheckpointError,
    JobLeaseError,
    JobLeaseHeldError,
    JobLeaseLostError,
    StateIntegrityError,
    StateSizeExceededError,
    StorageConfigurationError,
    StreamClosedError,
    UnsafePathError,
    UnsupportedFileSystemError,
)

__all__ = [
    "DEFAULT_LEASE_TTL",
    "ByteStreamStateHandle",
    "CheckpointAlreadyExistsError",
    "CheckpointCommitFailedError",
    "CheckpointInfo",
    "CheckpointMetadata",
    "CheckpointMetadataOutputStream",
    "CheckpointNotFoundError",
    "CheckpointProperties",
    "CheckpointRetentionPolicy",
    "CheckpointStateOutputStream",
    "CheckpointStateToolset",
    "CheckpointStorage",
    "CheckpointStorageAccess",
    "CheckpointStorageCoordinatorView",
    "CheckpointStorageError",
    "CheckpointStorageLocation",
    "CheckpointStorageLocationReference",
    "CheckpointStorageWorkerView",
    "CheckpointStreamFactory",
    "CheckpointedStateScope",
    "CommitStateUnknownError",
    "CompletedCheckpoint",
    "CompletedCheckpointStorageLocation",
    "CompletedCheckpointStore",
    "FileMergingSnapshotManager",
    "FileMergingType",
    "FileStateHandle",
    "FileSystemCheckpointStorage",
    "FileSystemCompletedCheckpointStore",
    "GarbageCollectionResult",
    "InvalidCheckpointError",
    "JobID",
    "JobLease",
    "JobLeaseError",
    "JobLeaseHeldError",
    "JobLeaseLostError",
    "JobStatus",
    "LeaseRecord",
    "LogicalFile",
    "MemoryCheckpointStorage",
    "OperatorState",
    "OperatorSubtaskState",
    "PhysicalFile",
    "PhysicalFilePoolType",
    "RelativeFileStateHandle",
    "RestoreMode",
    "SavepointFormatType",
    "SegmentFileStateHandle",
    "SharedStateRegistry",
    "SnapshotType",
    "SpaceStat",
    "StandaloneCompletedCheckpointStore",
    "StateIntegrityError",
    "StateSizeExceededError",
    "StorageConfigurationError",
    "StreamClosedError",
    "StreamStateHandle",
    "SubtaskKey",
    "UnsafePathError",
    "UnsupportedFileSystemError",
    "VerificationProblem",
    "VerificationReport",
    "abort_checkpoint",
    "break_job_lease",
    "collect_garbage",
    "copy_savepoint",
    "create_file_merging_snapshot_manager",
    "decode_path_from_reference",
    "discard_checkpoint",
    "dispose_savepoint",
    "encode_path_as_reference",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint_metadata",
    "read_job_lease",
    "store_checkpoint_metadata",
    "verify_checkpoint",
]
