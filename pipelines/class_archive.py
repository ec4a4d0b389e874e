"""A class data archive for the driver JVM: its start and first queries without loading and
verifying Spark's classes from their jars again (issue 28: a cold run and a recovery start a
new JVM every time; docs/benchmarks.md, "cold_run: the driver JVM's classes from an archive").

A JVM maps the classes of an archive (Java's application class data sharing, CDS) instead of
reading, parsing and verifying each from its jar: Spark's session start and its first queries
load ~10,000 classes, most of a fresh JVM's CPU. ``build_class_archive`` makes the archive
once per Java and pyspark installation: a training process starts a session with
``-XX:ArchiveClassesAtExit``, runs the kinds of work the pipelines run (a query, Arrow batches
through Python workers, a shuffle, Parquet written and read, a pass persisted on disk), stops,
and the JVM writes the classes it loaded as it exits; the file is moved into place only when
complete. ``scripts/setup-env`` builds it (``python -m pipelines.class_archive``; ``--force``:
again).

``java_options`` is what a session's driver adds to its ``spark.driver.extraJavaOptions``
(``resources.build_spark_session`` does) while the archive exists: the JVM maps it, or, when it
does not match this JVM and class path (Java or pyspark upgraded since), ignores it and starts
as it would without (``-Xshare:auto``); its messages about the archive are silenced either
way. Nothing else depends on it: a session without it works the same, only slower to start.
``PIPELINES_CLASS_ARCHIVE=off`` turns it off; ``PIPELINES_CLASS_ARCHIVE_DIR`` says where the
archives are kept (default ``$XDG_CACHE_HOME/checkpointed-pipelines``, else
``~/.cache/checkpointed-pipelines``). Driver only: a cluster's executors are long-lived.
Imports no Dagster (the benchmarks' sessions use it without it).
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["archive_path", "build_class_archive", "java_options"]

_QUIET = "-Xshare:auto -Xlog:cds=off -Xlog:cds+dynamic=off"
"""Use the archive when it matches, else start without it; say nothing about it either way
(a mismatch is not an error, and the dump warns of every class it cannot keep)."""


def _java() -> Path | None:
    """The ``java`` that pyspark's ``spark-submit`` runs: ``$JAVA_HOME/bin/java``, else the
    one on ``PATH``."""
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    return Path(os.path.realpath(found)) if found and os.path.exists(found) else None


def archive_path() -> Path | None:
    """Where this installation's archive is (or would be): a name that changes with the Java
    binary, pyspark's version and jars, and this Python environment, so that an upgrade of any
    of them starts from a new archive. None: no Java found, or archives turned off."""
    if os.environ.get("PIPELINES_CLASS_ARCHIVE", "").lower() in ("off", "0", "false", "no"):
        return None
    java = _java()
    if java is None:
        return None
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    identity = hashlib.sha256()
    stat = java.stat()
    identity.update(f"{java}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    identity.update(f"{pyspark.__version__}\0{sys.prefix}\0".encode())
    if jars.is_dir():
        identity.update("\0".join(sorted(os.listdir(jars))).encode())
    base = os.environ.get("PIPELINES_CLASS_ARCHIVE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"),
        "checkpointed-pipelines")
    return Path(base) / f"spark-driver-{identity.hexdigest()[:16]}.jsa"


_DYNAMIC_ARCHIVE_MAGIC = bytes.fromhex("a8ab0bf0")
"""The first bytes of a JVM's dynamic archive (0xf00baba8, little-endian)."""


def _size_record(path: Path) -> Path:
    """The file beside the archive that holds its size as built."""
    return path.with_name(path.name + ".bytes")


def java_options() -> str:
    """The driver JVM's options that map the archive, or ``""`` while there is none, or while
    its size is not the size it was built with: a JVM maps the archive, and one cut short
    (a full disk, a copy stopped half-way) would crash it (SIGBUS), not be ignored."""
    path = archive_path()
    try:
        if path is None or path.stat().st_size != int(_size_record(path).read_text()):
            return ""
    except (OSError, ValueError):
        return ""
    return f"-XX:SharedArchiveFile={path} {_QUIET}"


def build_class_archive(*, force: bool = False, timeout: float = 900) -> Path | None:
    """Build this installation's archive (unless it exists and not ``force``) and return its
    path; None when archives are off or no Java is found. The training runs in a process of
    its own (a JVM writes its archive as it exits); its output is written beside the archive
    and moved into place only once complete, so that a session never maps a partial one and
    two builds at once leave one whole archive. A failed build raises a RuntimeError naming
    the training's output, and leaves the archive as it was."""
    path = archive_path()
    if path is None:
        return None
    if java_options() and not force:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=path.name + ".", suffix=".partial", dir=path.parent)
    os.close(fd)
    os.unlink(partial)  # the JVM creates it
    try:
        done = subprocess.run([sys.executable, "-m", "pipelines.class_archive", "--train", partial],
                              capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode != 0 or not _is_archive(partial):
            raise RuntimeError(
                f"building the driver JVM's class archive {path} failed (exit "
                f"{done.returncode}); sessions start without it. The training's output:\n"
                f"{(done.stdout + done.stderr)[-4000:]}")
        # the size first, then the archive: a session maps it only once both agree
        _size_record(path).write_text(str(os.path.getsize(partial)))
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return path


def _is_archive(partial: str) -> bool:
    try:
        with open(partial, "rb") as file:
            return file.read(4) == _DYNAMIC_ARCHIVE_MAGIC
    except OSError:
        return False


def _train(partial: str) -> None:
    """Start a session whose JVM writes the classes it loaded to ``partial`` at its exit, run
    the kinds of work a pipeline's driver runs, and wait for the JVM to exit."""
    import pyarrow as pa
    from pyspark import SparkContext, StorageLevel
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (SparkSession.builder.master("local[2]").appName("class-archive")
             .config("spark.driver.extraJavaOptions",
                     f"-XX:ArchiveClassesAtExit={partial} -Xlog:cds=off -Xlog:cds+dynamic=off")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")

    def passed(batches):
        for batch in batches:
            yield pa.RecordBatch.from_arrays(
                [batch.column(0), batch.column(1)], names=["key", "value"])

    with tempfile.TemporaryDirectory() as scratch:
        frame = spark.range(0, 20_000, numPartitions=2).selectExpr(
            "id % 1000 AS key", "CAST(id AS DOUBLE) AS value", "current_timestamp() AS at")
        frame.write.parquet(f"{scratch}/rows")
        read = spark.read.parquet(f"{scratch}/rows")
        mapped = read.select("key", "value").mapInArrow(passed, "key long, value double")
        grouped = mapped.groupBy("key").agg({"value": "sum"}).persist(StorageLevel.DISK_ONLY)
        grouped.count()
        grouped.toArrow()
        grouped.unpersist()
        spark.createDataFrame([(1, "a")], "n long, s string").collect()
        spark.sparkContext.parallelize(range(4), 2).map(lambda x: x + 1).collect()
    spark.stop()
    gateway = SparkContext._gateway
    process = getattr(gateway, "proc", None)
    if process is None:
        raise RuntimeError("the session's JVM was not started by this process")
    gateway.shutdown()
    process.stdin.close()  # the JVM exits when its standard input closes, writing the archive
    if process.wait() != 0:
        raise RuntimeError(f"the JVM exited with {process.returncode} writing {partial}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--train"]:
        _train(sys.argv[2])
    else:
        built = build_class_archive(force="--force" in sys.argv[1:])
        print(f"driver JVM class archive: {built}" if built else
              "driver JVM class archive: off (PIPELINES_CLASS_ARCHIVE) or no java found")
