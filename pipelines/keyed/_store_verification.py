"""How the local keyed-state store (``_store``) verifies its files: the CRC-32 of a file as
Arrow writes it (``_ChecksummedFile``) or as it is read back (``_file_checksum``), the
manifest body's checksum (``_body_checksum``), and the files verified or written
(``_VERIFIED``), shared by the processes of an executor (``_siblings_claims``).

Hashing a file costs about 0.2 s per GB (zlib's CRC-32 reads at ~6 GB/s here), once per
process: a file verified, or written, by this process is remembered by its (path, device,
inode, size, mtime, ctime, checksum) and not hashed again while those hold. The processes of
one executor share this: the manifest records which files its writer verified or wrote and
their (device, inode, size, mtime, ctime), with the writer's executor (the parent process, e.g.
Spark's Python daemon that forks the workers, and the machine's boot id); a sibling worker
takes a file whose stat still matches as verified. A range's task runs in either worker, so
without it each worker hashed the segment the other had just written (236 MB a range at 8M
keys). A power loss reboots (a new boot id), a write changes the ctime: either way the file is
hashed again.
"""

import functools
import json
import os
import threading
import zlib
from collections import OrderedDict
from pathlib import Path

__all__ = ["forget_verified_files"]

_HASH_CHUNK = 8 << 20


class _ChecksummedFile:
    """A binary file that Arrow writes through, keeping the CRC-32 of what was written: the
    checksum comes without reading the file back."""

    def __init__(self, file) -> None:
        self._file = file
        self.checksum = 0
        self.closed = False

    def write(self, data) -> int:
        self.checksum = zlib.crc32(data, self.checksum)
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self.closed = True  # the caller closes the file, after fsync


class _VerifiedFiles:
    """The store files this process verified or wrote, by signature (bounded, oldest out): a
    batch's task opens its store at every batch and must not hash an unchanged file again."""

    def __init__(self, capacity: int = 4096) -> None:
        self._capacity = capacity
        self._signatures: OrderedDict[tuple, None] = OrderedDict()
        self._lock = threading.Lock()

    def holds(self, signature: tuple) -> bool:
        with self._lock:
            return signature in self._signatures

    def add(self, signature: tuple) -> None:
        with self._lock:
            self._signatures[signature] = None
            self._signatures.move_to_end(signature)
            while len(self._signatures) > self._capacity:
                self._signatures.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._signatures.clear()


_VERIFIED = _VerifiedFiles()


def forget_verified_files() -> None:
    """Forget which store files this process verified or wrote, so that the next open of each
    hashes it again, as the first open in a new Python worker does (benchmarks measure it)."""
    _VERIFIED.clear()


def _signature(path: Path, stat: os.stat_result, checksum: int) -> tuple:
    # ctime too: a write that restores the mtime (os.utime) cannot restore it
    return (str(path), *_stat_signature(stat), checksum)


@functools.cache
def _executor_of(parent: int) -> str | None:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{parent}/stat").read_text()
        started = stat[stat.rindex(")") + 2:].split()[19]  # field 22: the start time
    except (OSError, ValueError, IndexError):
        return None  # no /proc (not Linux): each process hashes what it did not write
    return f"{boot}/{parent}/{started}"


def _executor_identity() -> str | None:
    """The executor whose processes share verified files: this process's parent (the Python
    daemon that forks Spark's workers) by pid and start time, in this boot of the machine.
    None for an orphan (its parent gone) or without /proc."""
    parent = os.getppid()
    return None if parent <= 1 else _executor_of(parent)


def _siblings_claims(verified) -> dict[str, list] | None:
    """The stat signatures of the files a manifest's writer verified or wrote, if it was
    another process of this executor (its own claims this process remembers, or forgot on
    purpose: ``forget_verified_files``); None if not, or if the record is not one."""
    try:
        if (verified["executor"] is None or verified["executor"] != _executor_identity()
                or verified["pid"] == os.getpid()):
            return None
        return {str(name): list(stat) for name, stat in verified["files"].items()}
    except (TypeError, KeyError, AttributeError):
        return None  # none recorded (an older manifest): hashed


def _file_checksum(path: Path) -> int:
    checksum = 0
    buffer = bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while read := file.readinto(buffer):
            checksum = zlib.crc32(view[:read], checksum)
    return checksum


def _stat_signature(stat: os.stat_result) -> tuple:
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def _body_checksum(body: dict) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())

