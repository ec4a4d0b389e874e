"""Spark's Python worker daemon (``pyspark.daemon``), quiet when a cancelled task's worker
finds its socket closed, and with what every worker imports imported once, before it forks
them. Sessions built by ``build_spark_session`` on a local master run it
(``spark.python.daemon.module``).

A task cancelled while its Python worker runs (Ctrl-C in ``scripts/run`` cancels every job)
has its socket closed by the JVM; the worker's last flush then fails, and ``pyspark.daemon``
prints that ``BrokenPipeError`` with a traceback on the driver's console. Nobody is left to
read that output: the JVM already abandoned the task and reports its failure itself. Here
that worker ends quietly instead, as a failed worker (not reused).

A forked worker imported pyspark's worker, pyarrow, pandas and ``pipelines`` itself, about 1 s
of CPU each at the first task it ran; a keyed batch's pass runs two Python workers per task
(the routing ``mapInArrow`` and the range's), so a fresh ``local[2]`` process paid it four
times in its first batches (docs/benchmarks.md, "cold_run: the workers' imports done once").
``preload`` imports them here once; each worker is forked with them. pyspark imports them
after the fork because pyarrow and numpy start threads at import, and a thread in a process
that forks can leave a child with a lock that no thread will release: ``preload`` makes both
start none (OpenBLAS with one thread, as Spark runs one task per core; Arrow's jemalloc
without its background thread: Arrow allocates with mimalloc, set to hand freed memory back
at once), and
``tests/test_spark_resource.py`` checks that the daemon stays single-threaded. Imports no
Dagster: it runs in the daemon's process.

After its imports the daemon only forks: the pages of the libraries' code and constants that
the imports touched (~100 MiB: pyarrow's libraries, numpy's, Python's own) it never reads
again, and a forked worker maps what it reads itself (the kernel does not copy a file
mapping's page table to a child). ``drop_library_pages`` hands them back: the daemon's RSS
~183 -> ~93 MiB at an 8M-key restart, its workers unchanged (docs/benchmarks.md,
"state_growth: the warm-up after the prefetch").
"""

import ctypes
import gc
import importlib
import os
import re
import sys
import zipimport

import pyspark.daemon as _pyspark_daemon

__all__ = ["PRELOADED", "drop_library_pages", "forget_zip_importers", "preload", "worker"]

_worker = _pyspark_daemon.worker

# What a worker of a keyed batch imports before its task runs (`python -X importtime` in the
# workers of a cold run): pyspark's worker side, Arrow, pandas (pyspark's Arrow UDF
# serializers) and the keyed stages' executor side (with ``pipelines``).
PRELOADED = (
    "pyspark.worker",
    "pyspark.worker_message",
    "pyspark.sql.conversion",
    "pyspark.logger.worker_io",
    "pyspark.sql.streaming.stateful_processor_util",
    "pyarrow",
    "pyarrow.compute",
    "pyarrow.acero",
    "pandas",
    "pipelines.keyed",
    "pipelines.warm_up",
)

# Settings that keep the libraries above from starting threads at import (a user's own win).
_NO_THREADS = {"OPENBLAS_NUM_THREADS": "1", "JE_ARROW_MALLOC_CONF": "background_thread:false"}

# Arrow's allocator (mimalloc) hands freed memory back to the system at once. By default
# (arenas committed eagerly, a purge 10 ms after a free) the pages a task freed stayed in its
# worker's RSS: a range's task (acero's group-bys and joins over a batch) kept ~50 MiB it had
# freed to the task's end, and an 8M-key recovery's workers peaked at ~200 MiB each, ~150
# with these (docs/benchmarks.md, "state_growth: a recovery's workers"); a steady batch's
# time did not change. A user's own setting wins.
_ARROW_RETURNS_MEMORY = {"MIMALLOC_ARENA_EAGER_COMMIT": "0", "MIMALLOC_PURGE_DELAY": "0"}


def preload() -> list[str]:
    """Import ``PRELOADED`` in this (the daemon's) process; the names that failed. A failure
    is left to the worker: it imports the module itself and reports the error of its task."""
    for name, value in (_NO_THREADS | _ARROW_RETURNS_MEMORY).items():
        os.environ.setdefault(name, value)
    failed = []
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001
            failed.append(name)
    return failed


def forget_zip_importers() -> int:
    """Drop the zip archives' importers from ``sys.path_importer_cache``; how many.

    A forked worker adds Spark's files directory to ``sys.path`` at its first task (pyspark's
    ``setup_spark_files``) and calls ``importlib.invalidate_caches()``, where Python 3.11's
    ``zipimporter`` reads its archive's whole directory again, once per importer: the ~15 of
    pyspark.zip's packages and spark-core's jar (on the workers' ``PYTHONPATH``, ~6,000
    entries), 0.3 s of CPU and 16 MiB in each worker. The archives do not change while the
    daemon runs, and the cache is only a cache: an import through an archive later makes its
    importer again from the directory ``zipimport`` keeps, read here once and shared with
    every forked worker."""
    archives = [path for path, finder in sys.path_importer_cache.items()
                if isinstance(finder, zipimport.zipimporter)]
    for path in archives:
        del sys.path_importer_cache[path]
    return len(archives)


_MADV_DONTNEED = 4  # Linux
_MAPPING = re.compile(r"([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ (\d+)")


def drop_library_pages() -> int:
    """Hand back the resident pages of this process's private, read-only file mappings that
    hold no page of its own (``Anonymous: 0 kB``: every page is the file's, as the page cache
    holds it, so reading it again faults in the same bytes, as after the kernel dropped it
    under memory pressure); the bytes they held. A mapping with a private copy of a page (a
    library's relocated constants) is left as it is. 0 where ``/proc/self/smaps`` or
    ``madvise`` is not available."""
    try:
        with open("/proc/self/smaps") as smaps:
            lines = smaps.read().splitlines()
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    clean: list[tuple[int, int, int]] = []  # (start, end, resident bytes)
    mapping = None
    resident = 0
    for line in lines:
        header = _MAPPING.match(line)
        if header:
            start, end, perms, inode = header.groups()
            # private, not writable, a file's
            mapping = ((int(start, 16), int(end, 16))
                       if perms[1] == "-" and perms[3] == "p" and inode != "0" else None)
        elif mapping is not None and line.startswith("Rss:"):
            resident = int(line.split()[1]) * 1024
        elif mapping is not None and line.startswith("Anonymous:"):
            if int(line.split()[1]) == 0 and resident:
                clean.append((*mapping, resident))
            mapping = None
    return sum(held for start, end, held in clean
               if madvise(start, end - start, _MADV_DONTNEED) == 0)


def worker(sock, authenticated: bool) -> int:
    """``pyspark.daemon.worker``; 1 (a failed worker) when the JVM closed the socket."""
    try:
        return _worker(sock, authenticated)
    except (BrokenPipeError, ConnectionResetError):
        return 1


# The daemon's manager calls ``worker`` by its module-level name in each forked worker.
_pyspark_daemon.worker = worker

if __name__ == "__main__":
    # A worker, forked from here, finds it in its ``__main__``: it started with these imported.
    preload_failed = preload()
    forget_zip_importers()
    # The imports' objects out of the collector's reach: a forked worker's collections wrote
    # to every one of them (their headers), copying the daemon's pages into each worker
    # (private pages of a worker at an 8M-key recovery's batch: 124 -> 84-113 MiB).
    gc.collect()
    gc.freeze()
    drop_library_pages()
    _pyspark_daemon.manager()
