"""Helpers shared by the checkpoint_storage test suites."""

import random
import uuid
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Backend:
    """A real filesystem to run a test against: ``url(name)`` gives a fresh directory URL."""

    name: str
    base_url: str
    storage_options: dict

    def url(self, *parts: str) -> str:
        return "/".join((self.base_url, *parts))


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


# --- Apache Flink test data ------------------------------------------------------------------

FLINK_MAGIC_BYTES = bytes.fromhex("4960672d")


def flink_metadata(version: int = 6, seed: int = 0, size: int = 600) -> bytes:
    """A `_metadata` as Apache Flink writes it: the magic number 0x4960672d, the format version
    as a big-endian int, then (here arbitrary) serialized checkpoint metadata."""
    return FLINK_MAGIC_BYTES + version.to_bytes(4, "big") + payload(size, seed)


def make_flink_job_directory(fs, job_url: str, ids=(3, 5, 6), shared_files: int = 13) -> set[str]:
    """Lay out what an Apache Flink 2.x job with RocksDB incremental checkpoints leaves on
    storage: ``chk-<id>/_metadata`` (Flink's format) plus exclusive files per retained
    checkpoint, ``shared/`` SST files and an empty ``taskowned/``. Returns the URLs of every
    file written (``job_url`` is a canonical URL of ``fs``)."""
    written = []

    def put(url: str, data: bytes) -> None:
        path = type(fs)._strip_protocol(url)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(path, data)
        written.append(url)

    fs.makedirs(type(fs)._strip_protocol(f"{job_url}/taskowned"), exist_ok=True)
    for checkpoint_id in ids:
        put(f"{job_url}/chk-{checkpoint_id}/_metadata", flink_metadata(6, checkpoint_id))
        put(f"{job_url}/chk-{checkpoint_id}/{uuid.uuid4()}", payload(300, checkpoint_id + 100))
    for index in range(shared_files):
        put(f"{job_url}/shared/{uuid.uuid4()}", payload(1000 + index, index))
    fs.invalidate_cache()
    return set(written)


def run_on_terminal(argv: list[str], *, env: dict, cwd, stream: str = "stdout",
                    columns: int | None = None) -> tuple[int, str, str]:
    """``argv`` run with ``stream`` ("stdout" or "stderr") on a pseudo-terminal (``columns``
    wide when given) and the other through a pipe: (exit code, what the terminal showed, the
    pipe's text)."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import termios

    primary, secondary = pty.openpty()
    if columns is not None:
        fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, stream: secondary}
    try:
        process = subprocess.Popen(argv, env=env, cwd=cwd, **streams)
        os.close(secondary)
        secondary = -1
        chunks = []
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        os.close(primary)
        if secondary >= 0:
            os.close(secondary)
    piped = stderr if stream == "stdout" else stdout
    return process.returncode, b"".join(chunks).decode(), piped.decode()
