"""A local store's directory on disk: the names of its files, the version its manifest
records (read without opening the store) and its removal, which refuses a directory that is
not a store."""

import json
import os
import re
import shutil
from pathlib import Path

__all__ = ["LocalStoreError", "only_store_files", "remove_store", "stored_version"]

_MANIFEST = "MANIFEST.json"
_PREFIXES = ("segment-", "run-", f".{_MANIFEST}")
_FILE_NAME = re.compile(r"(segment|run)-[0-9a-f]{32}\.arrow")


class LocalStoreError(ValueError):
    """A local store directory that cannot be used: its caller rebuilds it from the chain."""


def only_store_files(directory: Path) -> bool:
    """Whether ``directory`` holds store files (segments, runs, manifest temporaries) and
    nothing else: a store whose manifest was lost."""
    try:
        names = [entry.name for entry in directory.iterdir()]
    except (FileNotFoundError, NotADirectoryError):
        return False
    return bool(names) and all(_FILE_NAME.fullmatch(name)
                               or name.startswith(f".{_MANIFEST}.") for name in names)


def stored_version(directory: str | os.PathLike) -> str | None:
    """The ``version`` a store directory's manifest records, without opening the store (None:
    no store there, or an unreadable manifest)."""
    try:
        document = json.loads((Path(directory) / _MANIFEST).read_text())
        version = document.get("body", {}).get("version")  # unverified: a hint, not state
    except (OSError, ValueError, AttributeError):
        return None
    return version if isinstance(version, str) else None


def remove_store(directory: str | os.PathLike) -> None:
    """Delete a local store's directory, whatever state it holds. A directory that is not a
    store (no manifest, not empty, and not only store files) is refused: a misconfigured path
    must not lose files."""
    directory = Path(directory)
    if not directory.exists():
        return
    if (not (directory / _MANIFEST).exists() and any(directory.iterdir())
            and not only_store_files(directory)):
        raise LocalStoreError(f"{directory} is not a local keyed-state store (no {_MANIFEST}) "
                              "and is not empty; refusing to delete it: point the store "
                              "directory elsewhere")
    shutil.rmtree(directory)
