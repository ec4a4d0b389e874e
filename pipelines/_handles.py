"""State handles as plain values, so they can travel between processes: from the executors
that wrote state to the driver, from the driver to the executors that read it, and into the
parts the state readers hand out. Never a filesystem, never a credential: ``handle()``
rebuilds a handle with the storage options of the process it runs in."""

from collections.abc import Mapping
from dataclasses import dataclass

from checkpoint_storage import InvalidCheckpointError, url_to_fs
from checkpoint_storage.spi import (
    ByteStreamStateHandle,
    CheckpointedStateScope,
    FileStateHandle,
    RelativeFileStateHandle,
    SegmentFileStateHandle,
    StreamStateHandle,
)

__all__ = ["StateHandleRef"]


@dataclass(frozen=True)
class StateHandleRef:
    """A state handle as plain values (no filesystem, no credentials), so that it can travel to
    another process; ``handle(storage_options)`` rebuilds the handle there."""

    kind: str  # "inline", "file", "relative" or "segment"
    path: str  # the file's URL; an inline handle's name
    size: int
    checksum: int | None = None
    data: bytes | None = None
    relative_path: str | None = None
    start: int = 0
    scope: str | None = None
    logical_file_id: str | None = None

    @classmethod
    def of(cls, handle: StreamStateHandle) -> "StateHandleRef":
        if isinstance(handle, ByteStreamStateHandle):
            return cls("inline", handle.handle_name, handle.state_size, data=handle.data)
        if isinstance(handle, RelativeFileStateHandle):
            return cls(
                "relative", handle.path, handle.state_size, handle.checksum,
                relative_path=handle.relative_path,
            )
        if isinstance(handle, FileStateHandle):
            return cls("file", handle.path, handle.state_size, handle.checksum)
        if isinstance(handle, SegmentFileStateHandle):
            return cls(
                "segment", handle.path, handle.state_size, handle.checksum,
                start=handle.start_position, scope=handle.scope.value,
                logical_file_id=handle.logical_file_id,
            )
        raise InvalidCheckpointError(f"cannot read a state handle of type {type(handle).__name__}")

    def handle(self, storage_options: Mapping | None = None) -> StreamStateHandle:
        if self.kind == "inline":
            return ByteStreamStateHandle(self.path, self.data or b"")
        fs = url_to_fs(self.path, dict(storage_options or {}))[0]
        if self.kind == "relative":
            return RelativeFileStateHandle(
                self.path, self.relative_path, self.size, self.checksum, filesystem=fs
            )
        if self.kind == "file":
            return FileStateHandle(self.path, self.size, self.checksum, filesystem=fs)
        if self.kind == "segment":
            return SegmentFileStateHandle(
                self.path, self.start, self.size, CheckpointedStateScope(self.scope),
                self.logical_file_id, self.checksum, filesystem=fs,
            )
        raise ValueError(f"unknown state handle kind {self.kind!r}")

    def describe(self) -> str:
        if self.kind == "inline":
            return f"inline state {self.path} (in `_metadata`)"
        if self.kind == "segment":
            return f"segment [{self.start}, {self.start + self.size}) of state file {self.path}"
        return f"state file {self.path}"
