"""Flink's checkpoint storage layer, in Python, over any fsspec filesystem.

The coordinator (e.g. a Spark driver) creates checkpoint locations and publishes `_metadata`
last; workers (e.g. Spark executors) resolve a location reference into a stream factory and
write their state through it. See docs/design.md §3 and docs/metadata-format.md.

``__all__`` is what a user of the storage needs: create it (``FileSystemCheckpointStorage``),
find, verify, copy and delete checkpoints and savepoints, collect garbage, read `_metadata`,
inspect or break the job lease, and the errors to catch (the whole tree is in
``checkpoint_storage.exceptions``). What code that writes checkpoints through the library uses
(access views, locations, streams, state handles, the `_metadata` model, stores, file merging)
is documented in ``checkpoint_storage.spi``; Apache Flink's checkpoints are read by
``checkpoint_storage.flink``. Those names, and every exception, stay importable from this
package too, so that existing code keeps working.
"""

from checkpoint_storage import exceptions, spi
from checkpoint_storage._filesystems import url_to_fs
from checkpoint_storage._gc import GarbageCollectionResult, collect_garbage
from checkpoint_storage._ids import JobID
from checkpoint_storage._lazy import lazy_names
from checkpoint_storage._lease import LeaseRecord, break_job_lease, read_job_lease
from checkpoint_storage._listing import (
    CheckpointInfo,
    latest_checkpoint,
    list_checkpoints,
    list_checkpoints_below,
)
from checkpoint_storage._metadata import CheckpointMetadata, load_checkpoint_metadata
from checkpoint_storage._metadata_json import metadata_as_json
from checkpoint_storage._retention import CheckpointRetentionPolicy, RestoreMode
from checkpoint_storage._storage import (
    CheckpointStorage,
    FileSystemCheckpointStorage,
    MemoryCheckpointStorage,
)
from checkpoint_storage._tools import (
    VerificationProblem,
    VerificationReport,
    copy_savepoint,
    dispose_savepoint,
    verify_checkpoint,
)
from checkpoint_storage.exceptions import (
    CheckpointNotFoundError,
    CheckpointStorageError,
    CommitStateUnknownError,
    InvalidCheckpointError,
    JobLeaseHeldError,
    JobLeaseLostError,
)

__all__ = [
    # storage
    "CheckpointStorage",
    "FileSystemCheckpointStorage",
    "JobID",
    "MemoryCheckpointStorage",
    "url_to_fs",
    # _metadata
    "CheckpointMetadata",
    "load_checkpoint_metadata",
    "metadata_as_json",
    # retention and restore
    "CheckpointRetentionPolicy",
    "RestoreMode",
    # finding, verifying, copying and deleting snapshots
    "CheckpointInfo",
    "GarbageCollectionResult",
    "VerificationProblem",
    "VerificationReport",
    "collect_garbage",
    "copy_savepoint",
    "dispose_savepoint",
    "latest_checkpoint",
    "list_checkpoints",
    "list_checkpoints_below",
    "verify_checkpoint",
    # the job lease
    "LeaseRecord",
    "break_job_lease",
    "read_job_lease",
    # errors (the whole tree: checkpoint_storage.exceptions)
    "CheckpointNotFoundError",
    "CheckpointStorageError",
    "CommitStateUnknownError",
    "InvalidCheckpointError",
    "JobLeaseHeldError",
    "JobLeaseLostError",
]

# The Flink reader's names, exported here before checkpoint_storage.flink existed: written out
# (tests/test_api.py checks them against its __all__) so that importing this package does not
# load the reader.
_FLINK_NAMES = (
    "SUPPORTED_FLINK_VERSIONS", "FlinkCheckpointMetadata", "FlinkCheckpointProperties",
    "FlinkFileReference", "FlinkKeyedStateHandle", "FlinkMasterState", "FlinkOperatorState",
    "FlinkOperatorStateHandle", "FlinkStreamHandle", "FlinkSubtaskState", "is_flink_metadata",
    "parse_flink_metadata", "parse_remap", "remap_path", "FlinkFileProblem",
    "FlinkVerificationReport", "file_size", "is_flink_checkpoint", "read_flink_checkpoint",
    "verify_flink_checkpoint", "ExternalReference", "OrphanDeletion", "OrphanFile",
    "OrphanReport", "RetainedCheckpoint", "UnreadableCheckpoint", "delete_orphans",
    "find_orphans", "FlinkStateRow", "FlinkStateRows", "read_heap_value_rows",
)  # fmt: skip

# Names outside __all__ that code written before checkpoint_storage.spi existed imports from
# here (docs/design.md names them so): every extension point, every exception and the Flink
# reader's names.
_ELSEWHERE = {
    **dict.fromkeys(spi.__all__, "checkpoint_storage.spi"),
    **dict.fromkeys(_FLINK_NAMES, "checkpoint_storage.flink"),
    **dict.fromkeys(exceptions.__all__, "checkpoint_storage.exceptions"),
}


__getattr__, __dir__ = lazy_names(__name__, globals(), _ELSEWHERE)
