"""Extension points of the checkpoint storage layer: what code that *writes* checkpoints through
the library, or builds a layer on it, uses (Flink's state backend side of the storage).

``checkpoint_storage`` itself exports what a user of the storage needs (create it, list,
verify, copy and delete snapshots, collect garbage, read `_metadata`, inspect the job lease).
A pipeline runner, a state backend or a tool that writes or restores state needs more of the
Flink model; it is here, grouped by what it is for:

- **Access views** (``CheckpointStorageAccess``: ``CheckpointStorageCoordinatorView`` +
  ``CheckpointStorageWorkerView``, ``CheckpointStateToolset``): what
  ``CheckpointStorage.create_checkpoint_storage(job_id)`` returns. The coordinator (a Spark
  driver) creates locations and publishes `_metadata`; workers (Spark executors) resolve a
  location reference into a stream factory. ``resolve_checkpoint_pointer`` turns a pointer
  into its completed location without a storage object.
- **Locations** (``CheckpointStorageLocation``, ``CheckpointMetadataOutputStream``,
  ``CompletedCheckpointStorageLocation``): where one checkpoint or savepoint is written, the
  stream that publishes its `_metadata` (put-if-absent), and the completed result.
- **Location references** (``CheckpointStorageLocationReference``,
  ``encode_path_as_reference`` / ``decode_path_from_reference``, ``CheckpointedStateScope``):
  the opaque bytes the coordinator ships to workers, and who owns a state stream (one
  checkpoint or many).
- **Streams** (``CheckpointStreamFactory``, ``CheckpointStateOutputStream``,
  ``DEFAULT_FILE_STATE_THRESHOLD``, ``DEFAULT_WRITE_BUFFER_SIZE``): where workers write state;
  a stream ends in a state handle (inline below the threshold).
- **State handles** (``StreamStateHandle`` and its kinds ``ByteStreamStateHandle``,
  ``FileStateHandle``, ``RelativeFileStateHandle``, ``SegmentFileStateHandle``;
  ``verify_state_handles``): what `_metadata` records per piece of state, and a check that
  the files behind handles still hold what they recorded.
- **The `_metadata` model** (``OperatorState``, ``OperatorSubtaskState``,
  ``CheckpointProperties``, ``SnapshotType``, ``SavepointFormatType``,
  ``store_checkpoint_metadata``): what a coordinator puts into ``CheckpointMetadata`` and how
  it writes it (``checkpoint_storage.load_checkpoint_metadata`` reads it back).
- **Master state names** (``JOB_NAME_STATE``, ``SOURCE_POSITION_STATE``,
  ``STATE_SCHEMA_PREFIX``, ``STATE_FORMAT_PREFIX``, ``STATISTICS_STATE``): the convention
  that makes a writer's checkpoints readable by the ``checkpoints`` command and other tools.
- **Checkpoint statistics** (``STATISTICS_STATE``, ``compute_checkpoint_statistics``,
  ``encode_checkpoint_statistics``, ``checkpoint_statistics``): what a writer records of each
  checkpoint (bytes written against referenced, files new and reused, rows, durations), and
  what a reader gets back (derived from the handles for checkpoints written without them).
- **Completed checkpoint stores and the shared state registry** (``CompletedCheckpointStore``,
  ``FileSystemCompletedCheckpointStore``, ``StandaloneCompletedCheckpointStore``,
  ``CompletedCheckpoint``, ``AlsoRetained``, ``SharedStateRegistry``, ``JobStatus``,
  ``abort_checkpoint``, ``discard_checkpoint``): which checkpoints a job retains, subsumption,
  CLAIM / NO_CLAIM restores, and who deletes which files.
- **The job lease** (``JobLease``, ``DEFAULT_LEASE_TTL``): one coordinator per job directory;
  a filesystem access's ``acquire_job_lease(owner, ttl=...)`` returns the held lease.
- **File merging** (Flink FLIP-306: ``create_file_merging_snapshot_manager``,
  ``FileMergingSnapshotManager``, ``FileMergingType``, ``PhysicalFilePoolType``,
  ``SubtaskKey``, ``LogicalFile``, ``PhysicalFile``, ``SpaceStat``, ``DEFAULT_MAX_FILE_SIZE``)
  and its cross-process variant on local disk (``AppendingSegmentStreamFactory``,
  ``appends_in_place``, ``is_appended_segment``, ``APPENDED_FILE_PREFIX``): many small states
  packed into few physical files.
- **Filesystem helpers** the layers above share (``options_with_environment``,
  ``refuse_credentials``, ``format_size``, ``format_age``, ``normalize_pointer``): fsspec
  options with secrets read from environment variables, a guard against credentials travelling
  to executors, sizes and ages for people, and a pointer in its canonical form.
  ``checkpoint_storage.url_to_fs`` opens a URL.
- **Packaging** (``lazy_names``): how a package built on the library keeps names outside
  its narrow ``__all__`` importable, each imported on first use.
- **Tool helpers** for operator tools built on the library, like the ``checkpoints`` command
  (``snapshot_kind``, ``corruption_of``, ``job_storage``, ``default_lease_owner``,
  ``decode_master_state``): a snapshot's kind from its path, what a load error says about a
  file's corruption, the storage of one job directory, the lease owner this process writes, and
  a master state decoded for display.

Every name here is also importable from ``checkpoint_storage`` itself, so that code written
before this module existed keeps working; new code imports extension points from here.
"""

from checkpoint_storage._access import (
    CheckpointStateToolset,
    CheckpointStorageAccess,
    CheckpointStorageCoordinatorView,
    CheckpointStorageWorkerView,
    resolve_checkpoint_pointer,
)
from checkpoint_storage._appending import (
    APPENDED_FILE_PREFIX,
    AppendingSegmentStreamFactory,
    appends_in_place,
    is_appended_segment,
)
from checkpoint_storage._file_merging import (
    DEFAULT_MAX_FILE_SIZE,
    FileMergingSnapshotManager,
    FileMergingType,
    PhysicalFilePoolType,
    SpaceStat,
    SubtaskKey,
    create_file_merging_snapshot_manager,
)
from checkpoint_storage._filesystems import (
    format_age,
    format_size,
    normalize_pointer,
    options_with_environment,
    refuse_credentials,
)
from checkpoint_storage._handles import (
    ByteStreamStateHandle,
    FileStateHandle,
    RelativeFileStateHandle,
    SegmentFileStateHandle,
    StreamStateHandle,
)
from checkpoint_storage._lazy import lazy_names
from checkpoint_storage._lease import DEFAULT_LEASE_TTL, JobLease, default_lease_owner
from checkpoint_storage._listing import job_storage
from checkpoint_storage._locations import (
    CheckpointMetadataOutputStream,
    CheckpointStorageLocation,
    CompletedCheckpointStorageLocation,
)
from checkpoint_storage._master_states import (
    JOB_NAME_STATE,
    SOURCE_POSITION_STATE,
    STATE_FORMAT_PREFIX,
    STATE_SCHEMA_PREFIX,
    STATISTICS_STATE,
    json_object_state,
)
from checkpoint_storage._metadata import (
    CheckpointProperties,
    OperatorState,
    OperatorSubtaskState,
    SavepointFormatType,
    SnapshotType,
    store_checkpoint_metadata,
)
from checkpoint_storage._metadata_json import decode_master_state
from checkpoint_storage._physical_files import LogicalFile, PhysicalFile
from checkpoint_storage._references import (
    CheckpointedStateScope,
    CheckpointStorageLocationReference,
    decode_path_from_reference,
    encode_path_as_reference,
)
from checkpoint_storage._retention import JobStatus
from checkpoint_storage._shared_state import SharedStateRegistry
from checkpoint_storage._statistics import (
    checkpoint_statistics,
    compute_checkpoint_statistics,
    encode_checkpoint_statistics,
)
from checkpoint_storage._storage import DEFAULT_FILE_STATE_THRESHOLD, DEFAULT_WRITE_BUFFER_SIZE
from checkpoint_storage._store import (
    AlsoRetained,
    CompletedCheckpoint,
    CompletedCheckpointStore,
    FileSystemCompletedCheckpointStore,
    StandaloneCompletedCheckpointStore,
    abort_checkpoint,
    discard_checkpoint,
)
from checkpoint_storage._streams import CheckpointStateOutputStream, CheckpointStreamFactory
from checkpoint_storage._tools import (
    corruption_of,
    snapshot_kind,
    verify_state_handles,
)

__all__ = [
    # access views
    "CheckpointStateToolset",
    "CheckpointStorageAccess",
    "CheckpointStorageCoordinatorView",
    "CheckpointStorageWorkerView",
    "resolve_checkpoint_pointer",
    # locations
    "CheckpointMetadataOutputStream",
    "CheckpointStorageLocation",
    "CompletedCheckpointStorageLocation",
    # location references
    "CheckpointStorageLocationReference",
    "CheckpointedStateScope",
    "decode_path_from_reference",
    "encode_path_as_reference",
    # streams
    "DEFAULT_FILE_STATE_THRESHOLD",
    "DEFAULT_WRITE_BUFFER_SIZE",
    "CheckpointStateOutputStream",
    "CheckpointStreamFactory",
    # state handles
    "ByteStreamStateHandle",
    "FileStateHandle",
    "RelativeFileStateHandle",
    "SegmentFileStateHandle",
    "StreamStateHandle",
    "verify_state_handles",
    # the _metadata model
    "CheckpointProperties",
    "OperatorState",
    "OperatorSubtaskState",
    "SavepointFormatType",
    "SnapshotType",
    "store_checkpoint_metadata",
    # master state names
    "JOB_NAME_STATE",
    "SOURCE_POSITION_STATE",
    "STATE_FORMAT_PREFIX",
    "STATE_SCHEMA_PREFIX",
    "STATISTICS_STATE",
    "json_object_state",
    # checkpoint statistics
    "checkpoint_statistics",
    "compute_checkpoint_statistics",
    "encode_checkpoint_statistics",
    # completed checkpoint stores, shared state
    "AlsoRetained",
    "CompletedCheckpoint",
    "CompletedCheckpointStore",
    "FileSystemCompletedCheckpointStore",
    "JobStatus",
    "SharedStateRegistry",
    "StandaloneCompletedCheckpointStore",
    "abort_checkpoint",
    "discard_checkpoint",
    # the job lease
    "DEFAULT_LEASE_TTL",
    "JobLease",
    # file merging
    "APPENDED_FILE_PREFIX",
    "DEFAULT_MAX_FILE_SIZE",
    "AppendingSegmentStreamFactory",
    "FileMergingSnapshotManager",
    "FileMergingType",
    "LogicalFile",
    "PhysicalFile",
    "PhysicalFilePoolType",
    "SpaceStat",
    "SubtaskKey",
    "appends_in_place",
    "create_file_merging_snapshot_manager",
    "is_appended_segment",
    # filesystem helpers
    "format_age",
    "format_size",
    "normalize_pointer",
    "options_with_environment",
    "refuse_credentials",
    # packaging
    "lazy_names",
    # tool helpers
    "corruption_of",
    "decode_master_state",
    "default_lease_owner",
    "job_storage",
    "snapshot_kind",
]
