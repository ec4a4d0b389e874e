"""The files of a local store (``_store``) on disk: each store file written with its size and
CRC-32 recorded, verified before Arrow parses it, memory-mapped while it is live (the pages a
read touched handed back on request), and the manifest that names the live files.

The manifest records each file's size and CRC-32 and carries a CRC-32 of its own body; it is
replaced atomically. Opening checks the manifest, then each file's size and checksum: a flipped
bit, a truncated, missing or stale file raises ``LocalStoreError`` naming it. A file is hashed
once per executor, not at every open: ``_store_verification`` (its docstring says how).
"""

import ctypes
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.ipc as ipc

from pipelines.keyed._store_directory import _FILE_NAME, _MANIFEST, LocalStoreError
from pipelines.keyed._store_verification import (
    _VERIFIED,
    _body_checksum,
    _ChecksummedFile,
    _executor_identity,
    _file_checksum,
    _signature,
    _stat_signature,
)


def _madvise() -> "ctypes._CFuncPtr | None":
    """The C library's ``madvise`` (None where there is none to call: nothing is dropped)."""
    try:
        function = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return function


_MADVISE = _madvise()
_MADV_DONTNEED = 4  # Linux's value; elsewhere the call fails and changes nothing


class StoreFiles:
    """The store files and the manifest of one store's ``directory``: what was recorded of each
    (size and CRC-32), what each was when verified or written (its stat signature), and the
    memory maps of the live ones."""

    def __init__(self, directory: Path, *, verify: bool) -> None:
        self.directory = directory
        self.verify = verify
        self.checksums: dict[str, tuple[int, int]] = {}  # file name -> (size, CRC-32)
        # what each live file and the manifest were when verified or written (``unchanged``)
        self._signatures: dict[str, tuple] = {}
        # file name -> (its memory map, the map's address and size): the pages a read
        # touched are handed back after it (``drop_mapped_pages``)
        self._maps: dict[str, tuple[pa.MemoryMappedFile, int, int]] = {}

    # --- the manifest -----------------------------------------------------------------------

    def write_manifest(self, body: dict, live: list[str]) -> None:
        """Replace the manifest by one of ``body`` naming the ``live`` files (their sizes and
        checksums, and the ones this process verified or wrote, added to it)."""
        self.checksums = {name: self.checksums[name] for name in live}
        body = body | {"files": {n: list(self.checksums[n]) for n in live},
                       "verified": self._claims(live)}
        text = json.dumps({"body": body, "crc32": _body_checksum(body)}).encode()
        temporary = self.directory / f".{_MANIFEST}.{uuid.uuid4().hex}"
        with open(temporary, "wb") as file:
            file.write(text)
        os.replace(temporary, self.directory / _MANIFEST)
        # No fsync here nor of the files: the store is a cache verified when a process first
        # opens it, so a power loss costs a rebuild, never wrong state (docs/design.md, 7.3)
        self._signatures = {n: self._signatures[n] for n in live}
        self._signatures[_MANIFEST] = _stat_signature(os.stat(self.directory / _MANIFEST))

    def _claims(self, live: list[str]) -> dict | None:
        """For the manifest: the live files this process verified or wrote, by their stat
        signature, for the sibling processes of its executor (``verify_file``); None outside
        one."""
        executor = _executor_identity()
        if executor is None:
            return None
        files = {}
        for name in live:
            stat = self._signatures.get(name)
            if stat is not None and _VERIFIED.holds(
                    (str(self.directory / name), *stat, self.checksums[name][1])):
                files[name] = list(stat)
        return {"executor": executor, "pid": os.getpid(), "files": files}

    def read_manifest(self, manifest: Path) -> dict:
        """The manifest's body, its checksum checked; a v2 manifest (no checksums) refused."""
        try:
            with open(manifest, "rb") as file:
                # the file read, not the name's later target: ``unchanged`` compares with it
                self._signatures[_MANIFEST] = _stat_signature(os.fstat(file.fileno()))
                document = json.loads(file.read())
        except (OSError, ValueError) as exc:
            raise LocalStoreError(f"local store {self.directory}: unreadable {manifest} "
                                  f"({exc}); rebuild it from the checkpoint chain") from exc
        if not isinstance(document, dict) or "crc32" not in document:
            written = document.get("format") if isinstance(document, dict) else None
            raise LocalStoreError(
                f"local store {self.directory}: {manifest} records no checksums (format "
                f"{written!r}, written before stores verified their files), so it cannot be "
                "verified; rebuild it from the checkpoint chain")
        body = document.get("body")
        if not isinstance(body, dict) or _body_checksum(body) != document["crc32"]:
            raise LocalStoreError(f"local store {self.directory}: {manifest} is damaged (its "
                                  "checksum does not match); rebuild it from the checkpoint "
                                  "chain")
        return body

    # --- the store files --------------------------------------------------------------------

    def verify_file(self, name: str, checksums: dict[str, tuple[int, int]],
                    claimed: dict[str, list] | None = None) -> None:
        """Check that the store file ``name`` has the size and CRC-32 the manifest recorded
        (the checksum once per executor while the file's inode and times hold: ``claimed``,
        the stat signatures of the files a sibling process verified or wrote)."""
        path = self.directory / name
        if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or name not in checksums:
            raise LocalStoreError(f"the manifest names {name!r}, not a store file it recorded "
                                  "a checksum for")
        size, checksum = checksums[name]
        try:
            stat = path.stat()
        except FileNotFoundError:
            raise LocalStoreError(f"{path} is missing (the manifest names it)") from None
        if stat.st_size != size:
            raise LocalStoreError(f"{path} has {stat.st_size} bytes, the manifest recorded "
                                  f"{size} (truncated or replaced)")
        signature = _signature(path, stat, checksum)
        self._signatures[name] = _stat_signature(stat)
        if not self.verify or _VERIFIED.holds(signature):
            return
        if claimed and claimed.get(name) == list(self._signatures[name]):
            _VERIFIED.add(signature)  # a sibling hashed or wrote this very file
            return
        actual = _file_checksum(path)
        if actual != checksum:
            raise LocalStoreError(f"{path} is damaged: its CRC-32 is {actual:08x}, the "
                                  f"manifest recorded {checksum:08x}")
        _VERIFIED.add(signature)

    def write_arrow(self, prefix: str, table: pa.Table) -> str:
        """A new store file named for ``prefix`` holding ``table`` (Arrow IPC file)."""
        def write(file) -> int:
            sink = _ChecksummedFile(file)
            with ipc.new_file(sink, table.schema) as writer:
                # As few record batches as the table has chunks: a segment of one batch maps
                # to contiguous columns, so its hash column needs no copy and takes need no
                # concatenation (a 4-chunk segment of 4M rows took 14 ms per take, 1 chunk
                # 0.4 ms)
                writer.write_table(table, max_chunksize=1 << 26)
            return sink.checksum

        return self.write_file(prefix, write)

    def write_file(self, prefix: str, write: Callable[[BinaryIO], int]) -> str:
        """A new store file named for ``prefix``, written by ``write`` (given the open file,
        returns the CRC-32 of what it wrote), its size and checksum recorded."""
        name = f"{prefix}-{uuid.uuid4().hex}.arrow"
        path = self.directory / name
        with open(path, "wb") as file:
            checksum = write(file)
        stat = path.stat()
        self.checksums[name] = (stat.st_size, checksum)
        self._signatures[name] = _stat_signature(stat)
        _VERIFIED.add(_signature(path, stat, checksum))  # known good: just written
        return name

    def mapped(self, name: str) -> pa.MemoryMappedFile:
        """``name``'s file memory-mapped, the map kept (with its address) while the file is
        live, so that only a live map's pages are ever dropped."""
        source = pa.memory_map(str(self.directory / name))
        if source.size():
            self._maps[name] = (source, source.read_buffer(source.size()).address,
                                source.size())
            source.seek(0)
        return source

    def drop_mapped_pages(self) -> None:
        """Hand back the pages of the mapped files a read touched (``MADV_DONTNEED``: the
        file's pages stay in the page cache; a later access maps them again). A steady
        batch's keys touch pages of the whole segment (its 20,000 keys a range at 4M: +120
        MiB resident a worker, kept to the task's end); the stage, the change file and the
        store's write need none of them."""
        if _MADVISE is None:
            return
        for _, address, size in self._maps.values():
            _MADVISE(ctypes.c_void_p(address), ctypes.c_size_t(size), _MADV_DONTNEED)

    def keep_maps_of(self, live: set[str]) -> None:
        """Let go of the maps of the files no longer ``live``."""
        self._maps = {name: mapped for name, mapped in self._maps.items() if name in live}

    def unchanged(self) -> bool:
        """Whether the manifest and every file it names are still the ones read or written
        (device, inode, size, mtime, ctime); False once closed. A few stat calls, no read."""
        if not self._signatures:
            return False  # closed
        try:
            return all(_stat_signature(os.stat(self.directory / name)) == signature
                       for name, signature in self._signatures.items())
        except OSError:
            return False

    def close(self) -> None:
        self._maps = {}
        self._signatures = {}  # closed: never ``unchanged``
