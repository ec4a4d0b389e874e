"""Apache Flink's checkpoints and savepoints, read in pure Python (no JVM, no pickle); see
docs/storage-flink.md.

What it reads: Flink's `_metadata` of format versions 3 to 6 (Flink 1.11 to 2.x) with every
handle type the filesystem storage and the heap and RocksDB backends write
(``parse_flink_metadata``, ``read_flink_checkpoint``); whether every file a checkpoint
references is there with the size its handles need (``verify_flink_checkpoint``), also when
Flink wrote the paths on another machine (``remap``: ``parse_remap``, ``remap_path``); and the
keyed ValueState rows of a canonical savepoint whose keys and values use Flink's primitive
serializers, PyFlink's states included (``read_heap_value_rows``).

What it refuses, raising ``FlinkMetadataError`` (``checkpoint_storage.exceptions``) that names
the file, the byte offset and what was found: other format versions, changelog handles,
unaligned checkpoints' channel state, and truncated, corrupt or hostile input; for rows also
checkpoints and native savepoints, list/map state of Java types, windows' namespaces, TTL,
compressed key groups and POJO/Kryo/Avro types. Nothing it cannot read is ever deleted.

``find_orphans`` lists the files under a job directory's ``shared/`` and ``taskowned/`` that
no retained checkpoint references; it works on this library's job directories too (their
checkpoints are read with this library's `_metadata` reader). ``delete_orphans`` deletes them
only when confirmed, past a grace period, after listing again, and never while a `_metadata`
cannot be read.
"""

from checkpoint_storage._flink_metadata import (
    SUPPORTED_FLINK_VERSIONS,
    FlinkCheckpointMetadata,
    FlinkCheckpointProperties,
    FlinkFileReference,
    FlinkKeyedStateHandle,
    FlinkMasterState,
    FlinkOperatorState,
    FlinkOperatorStateHandle,
    FlinkStreamHandle,
    FlinkSubtaskState,
    is_flink_metadata,
    parse_flink_metadata,
    parse_remap,
    remap_path,
)
from checkpoint_storage._flink_orphans import (
    ExternalReference,
    FlinkFileProblem,
    FlinkVerificationReport,
    OrphanDeletion,
    OrphanFile,
    OrphanReport,
    RetainedCheckpoint,
    UnreadableCheckpoint,
    delete_orphans,
    file_size,
    find_orphans,
    is_flink_checkpoint,
    read_flink_checkpoint,
    verify_flink_checkpoint,
)
from checkpoint_storage._flink_state import FlinkStateRow, FlinkStateRows, read_heap_value_rows

__all__ = [
    # _metadata
    "SUPPORTED_FLINK_VERSIONS",
    "FlinkCheckpointMetadata",
    "FlinkCheckpointProperties",
    "FlinkFileReference",
    "FlinkKeyedStateHandle",
    "FlinkMasterState",
    "FlinkOperatorState",
    "FlinkOperatorStateHandle",
    "FlinkStreamHandle",
    "FlinkSubtaskState",
    "is_flink_metadata",
    "parse_flink_metadata",
    "parse_remap",
    "remap_path",
    # checkpoint directories: read and verify
    "FlinkFileProblem",
    "FlinkVerificationReport",
    "file_size",
    "is_flink_checkpoint",
    "read_flink_checkpoint",
    "verify_flink_checkpoint",
    # orphans of a job directory
    "ExternalReference",
    "OrphanDeletion",
    "OrphanFile",
    "OrphanReport",
    "RetainedCheckpoint",
    "UnreadableCheckpoint",
    "delete_orphans",
    "find_orphans",
    # canonical savepoints' rows
    "FlinkStateRow",
    "FlinkStateRows",
    "read_heap_value_rows",
]
