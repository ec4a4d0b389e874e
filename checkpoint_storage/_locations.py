"""Checkpoint locations (where one checkpoint is written) and completed locations (what a
finished checkpoint is addressed by)."""

import io
import zlib
from abc import ABC, abstractmethod

from fsspec import AbstractFileSystem

from checkpoint_storage._filesystems import (
    METADATA_FILE_NAME,
    PathRoots,
    delete_recursively,
    join,
    put_if_absent,
)
from checkpoint_storage._handles import ByteStreamStateHandle, FileStateHandle, StreamStateHandle
from checkpoint_storage._metadata import (
    CheckpointMetadata,
    decode_metadata,
    encode_metadata,
    read_metadata_bytes,
    with_lease_epoch,
)
from checkpoint_storage._references import (
    CheckpointedStateScope,
    CheckpointStorageLocationReference,
)
from checkpoint_storage._streams import CheckpointStateOutputStream, CheckpointStreamFactory
from checkpoint_storage.exceptions import (
    CheckpointAlreadyExistsError,
    JobLeaseLostError,
    StreamClosedError,
)

__all__ = [
    "CheckpointMetadataOutputStream",
    "CheckpointStorageLocation",
    "CompletedCheckpointStorageLocation",
]

NOT_EXTERNALLY_ADDRESSABLE = "<checkpoint-not-externally-addressable>"


class CompletedCheckpointStorageLocation:
    """A completed checkpoint or savepoint: its pointer, its `_metadata`, and disposal.

    ``external_pointer`` is the checkpoint's directory, one canonical string whichever call
    produced the location.
    """

    def __init__(
        self,
        external_pointer: str,
        metadata_handle: StreamStateHandle,
        *,
        filesystem: AbstractFileSystem | None = None,
        roots: PathRoots | None = None,
    ) -> None:
        self._external_pointer = external_pointer
        self._metadata_handle = metadata_handle
        self._fs = filesystem
        self._roots = roots if roots is not None else PathRoots(())

    @property
    def external_pointer(self) -> str:
        return self._external_pointer

    @property
    def metadata_handle(self) -> StreamStateHandle:
        return self._metadata_handle

    @property
    def roots(self) -> PathRoots:
        """The directories this checkpoint's state may live in."""
        return self._roots

    def dispose_storage_location(self) -> None:
        """Delete the checkpoint directory and everything in it."""
        if self._fs is not None:
            delete_recursively(self._fs, self._fs._strip_protocol(self._external_pointer))

    @property
    def _metadata_source(self) -> str:
        return getattr(self._metadata_handle, "path", self._external_pointer)

    def read_metadata_bytes(self) -> bytes:
        """The raw `_metadata`, read safely (header first, bounded; see ``_metadata``)."""
        return read_metadata_bytes(self._metadata_handle, self._metadata_source)

    def load_metadata(self, checkpoint_id: int | None = None) -> CheckpointMetadata:
        """Read and validate `_metadata`. With ``checkpoint_id`` (the id of the ``chk-<id>``
        directory it was found in) the id inside must equal it (``CheckpointIdMismatchError``)."""
        return decode_metadata(
            self.read_metadata_bytes(),
            source=self._metadata_source,
            directory=self._external_pointer,
            roots=self._roots,
            filesystem=self._fs,
            checkpoint_id=checkpoint_id,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompletedCheckpointStorageLocation):
            return NotImplemented
        return self._external_pointer == other._external_pointer

    def __hash__(self) -> int:
        return hash(self._external_pointer)

    def __repr__(self) -> str:
        return f"CompletedCheckpointStorageLocation({self._external_pointer!r})"


class CheckpointMetadataOutputStream(ABC):
    """Receives `_metadata` bytes; ``close_and_finalize_checkpoint()`` publishes them
    atomically and completes the checkpoint; ``close()`` before that aborts (nothing is
    published)."""

    @abstractmethod
    def write(self, data) -> int: ...

    @abstractmethod
    def tell(self) -> int: ...

    @abstractmethod
    def flush(self) -> None: ...

    @abstractmethod
    def close_and_finalize_checkpoint(self) -> CompletedCheckpointStorageLocation: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> "CheckpointMetadataOutputStream":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class _BufferedMetadataOutputStream(CheckpointMetadataOutputStream):
    """Buffers the metadata in memory and hands it to ``publish`` in one piece, so a failure
    at any point before the put-if-absent leaves nothing behind."""

    def __init__(self, publish, lease_epoch: int | None = None) -> None:
        self._publish = publish
        self._buffer: io.BytesIO | None = io.BytesIO()
        self.lease_epoch = lease_epoch  # store_checkpoint_metadata stamps it in

    def _open_buffer(self) -> io.BytesIO:
        if self._buffer is None:
            raise StreamClosedError("the metadata stream is closed")
        return self._buffer

    def write(self, data) -> int:
        return self._open_buffer().write(data)

    def tell(self) -> int:
        return self._open_buffer().tell()

    def flush(self) -> None:
        self._open_buffer()

    def close_and_finalize_checkpoint(self) -> CompletedCheckpointStorageLocation:
        data = self._open_buffer().getvalue()
        self._buffer = None
        return self._publish(data)

    def close(self) -> None:
        self._buffer = None


class MetadataTarget(ABC):
    """Where a location publishes its `_metadata`: a file, or process memory."""

    @abstractmethod
    def publish(self, data: bytes) -> CompletedCheckpointStorageLocation: ...

    @abstractmethod
    def dispose(self) -> None: ...


class FileMetadataTarget(MetadataTarget):
    """`_metadata` in ``directory`` (a canonical URL), published with put-if-absent.

    With a job ``lease``, the bytes are stamped with its epoch and the lease is checked
    (``JobLease.check()``: one listing of the lease directory) immediately before the
    put-if-absent: a coordinator that lost its lease publishes nothing (``JobLeaseLostError``).
    """

    def __init__(
        self, fs: AbstractFileSystem, directory: str, roots: PathRoots, lease=None
    ) -> None:
        self._fs = fs
        self._directory = directory
        self._roots = roots
        self._metadata_url = join(directory, METADATA_FILE_NAME)
        self.lease = lease

    @property
    def lease_epoch(self) -> int | None:
        return None if self.lease is None else self.lease.epoch

    def _path(self, url: str) -> str:
        return self._fs._strip_protocol(url)

    def _stamped(self, data: bytes) -> bytes:
        """``data`` carrying the lease's epoch; bytes written without it are re-encoded
        (the encoding round-trips exactly), another epoch is refused."""
        metadata = decode_metadata(
            data, source=self._metadata_url, directory=self._directory, roots=self._roots
        )
        if metadata.lease_epoch == self.lease.epoch:
            return data
        if metadata.lease_epoch is not None:
            raise JobLeaseLostError(
                f"the _metadata for {self._directory} records lease epoch "
                f"{metadata.lease_epoch}, but it is published under epoch {self.lease.epoch}"
            )
        return encode_metadata(with_lease_epoch(metadata, self.lease.epoch))

    def publish(self, data: bytes) -> CompletedCheckpointStorageLocation:
        if self.lease is not None:
            data = self._stamped(data)
            self.lease.check()  # the last thing before the conditional PUT: fencing
        put_if_absent(self._fs, self._path(self._metadata_url), data)
        handle = FileStateHandle(
            self._metadata_url, len(data), zlib.crc32(data), filesystem=self._fs
        )
        return CompletedCheckpointStorageLocation(
            self._directory, handle, filesystem=self._fs, roots=self._roots
        )

    def dispose(self) -> None:
        delete_recursively(self._fs, self._path(self._directory))


class MemoryMetadataTarget(MetadataTarget):
    """Keeps `_metadata` in process memory (MemoryCheckpointStorage without a directory)."""

    def __init__(self, completed: dict, checkpoint_id: int) -> None:
        self._completed = completed
        self._checkpoint_id = checkpoint_id

    def publish(self, data: bytes) -> CompletedCheckpointStorageLocation:
        completed = CompletedCheckpointStorageLocation(
            NOT_EXTERNALLY_ADDRESSABLE,
            ByteStreamStateHandle(f"chk-{self._checkpoint_id}/_metadata", data),
        )
        if self._completed.setdefault(self._checkpoint_id, completed) is not completed:
            raise CheckpointAlreadyExistsError(
                f"checkpoint {self._checkpoint_id} is already completed"
            )
        return completed

    def dispose(self) -> None:
        pass


class CheckpointStorageLocation(CheckpointStreamFactory):
    """Where the coordinator's checkpoint (or savepoint) is written: a stream factory for its
    state plus the metadata stream that completes it."""

    def __init__(
        self,
        streams: CheckpointStreamFactory,
        reference: CheckpointStorageLocationReference,
        metadata_target: MetadataTarget,
    ) -> None:
        self._streams = streams
        self._reference = reference
        self._metadata_target = metadata_target
        self._finalized = False

    @property
    def location_reference(self) -> CheckpointStorageLocationReference:
        return self._reference

    def create_checkpoint_state_output_stream(
        self, scope: CheckpointedStateScope, name_prefix: str = ""
    ) -> CheckpointStateOutputStream:
        return self._streams.create_checkpoint_state_output_stream(scope, name_prefix)

    def create_metadata_output_stream(self) -> CheckpointMetadataOutputStream:
        """A stream for `_metadata`. Costs no I/O: another writer's `_metadata` is detected
        by the put-if-absent at finalization (FileExistsError). Under a job lease, the
        finalization first checks the lease (``JobLeaseLostError`` when lost)."""
        if self._finalized:
            raise CheckpointAlreadyExistsError(
                "this location was already finalized: its checkpoint is complete"
            )
        return _BufferedMetadataOutputStream(
            self._publish, getattr(self._metadata_target, "lease_epoch", None)
        )

    def _publish(self, data: bytes) -> CompletedCheckpointStorageLocation:
        completed = self._metadata_target.publish(data)
        self._finalized = True
        return completed

    def dispose_on_failure(self) -> None:
        """Delete everything written to this location (the checkpoint failed)."""
        self._metadata_target.dispose()
