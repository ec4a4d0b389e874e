"""Helpers shared by the checkpoint_storage test suites."""

import random

import fsspec

from checkpoint_storage import (
    CheckpointedStateScope,
    CheckpointMetadata,
    OperatorState,
    OperatorSubtaskState,
    store_checkpoint_metadata,
)

EXCLUSIVE = CheckpointedStateScope.EXCLUSIVE
SHARED = CheckpointedStateScope.SHARED


def payload(n: int, seed: int) -> bytes:
    """``n`` reproducible pseudo-random bytes."""
    return random.Random(seed).randbytes(n)


def fs_of(backend):
    """An fsspec filesystem to inspect the backend with (listing caches dropped)."""
    fs, _ = fsspec.core.url_to_fs(backend.base_url, **backend.storage_options)
    fs.invalidate_cache()
    return fs


def norm(fs, url: str) -> str:
    """A URL or path as the filesystem's own path, without protocol or trailing slash."""
    return type(fs)._strip_protocol(url).rstrip("/")


def parent(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0]


def read(handle) -> bytes:
    stream = handle.open()
    try:
        return stream.read()
    finally:
        stream.close()


def write_state(factory, data: bytes, scope=EXCLUSIVE):
    with factory.create_checkpoint_state_output_stream(scope) as out:
        out.write(data)
        return out.close_and_get_handle()


def metadata(checkpoint_id: int, handles=(), master: bytes = b"pos-0") -> CheckpointMetadata:
    """Metadata of one operator with one subtask holding ``handles``."""
    return CheckpointMetadata(
        checkpoint_id=checkpoint_id,
        operator_states=(
            OperatorState(
                "op", 1, subtask_states={0: OperatorSubtaskState(handles=tuple(handles))}
            ),
        ),
        master_states={"pos": master},
    )


def finalize(location, md: CheckpointMetadata):
    out = location.create_metadata_output_stream()
    store_checkpoint_metadata(md, out)
    return out.close_and_finalize_checkpoint()


def loaded_handles(md: CheckpointMetadata):
    return list(md.operator_states[0].subtask_states[0].handles)
