"""The Spark data source ``checkpoint``: a stage's state in a pipeline checkpoint or savepoint
as a DataFrame, read in parallel on the executors (one input partition per state part)::

    spark.read.format("checkpoint").option("stage", "user_activity").load(pointer)

Options: ``stage`` (required, unless ``view`` is ``stages``), ``view`` (``state``, the
default: the stage's rows; ``stages``: the snapshot's stages at a glance, one row per stage
part, as ``checkpoints stages`` shows them: ``pipelines.stages_view.STAGE_PART_SCHEMA``),
``storage_options`` (a JSON object of fsspec options such as
an ``endpoint_url``: shipped to the executors, so no secrets) and ``storage_options_from_env``
(a JSON object mapping fsspec options to environment variables, read by the driver and by
each executor from its own environment: how credentials reach the executors). The schema is
the stage's recorded one (master state ``state-schema/<stage>``). ``variable``: one state
variable of a ``KeyedStage.with_variables`` stage, as its rows (key columns + the entry's
fields: a row per value, list element or map entry); without it, such a stage reads as its
physical rows (one per key, a nested column per variable).

The source runs on Spark's Python workers, which need this package and pyarrow:
``register_checkpoint_source`` gives a local session that names no Python for them the
driver's own, and checks any other (see there).

A local session that ``build_spark_session`` started after this module was imported (a
``SparkResource``'s) is not registered with it: Spark finds it as an installed data source
(``pipelines/_spark_data_sources/pyspark_checkpoint.py`` on its Python path) when a read first
names it, under Spark's own lock, so that the session's start does not wait for the Python
process Spark starts to look data sources up (issue 28: 0.5-1.4 s of a cold run).
"""

import json
import os
import shutil
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.types import StructType

from checkpoint_storage.spi import options_with_environment
from pipelines.stages_view import STAGE_PART_SCHEMA, snapshot_stages, stage_part_rows
from pipelines.state_reader import StatePart, open_snapshot, read_state_part, read_variable_part
from resources import add_session_python_path, on_session_created

__all__ = [
    "CHECKPOINT_SOURCE",
    "INSTALLED_SOURCE_PATH",
    "CheckpointDataSource",
    "found_by_spark",
    "register_checkpoint_source",
]

CHECKPOINT_SOURCE = "checkpoint"
_VIEWS = ("state", "stages")
# Holds pyspark_checkpoint.py only: Spark's lookup of installed data sources finds it there.
INSTALLED_SOURCE_PATH = str(Path(__file__).with_name("_spark_data_sources"))


def _json_object(options: Mapping, name: str) -> dict:
    raw = options.get(name)
    if raw is None or not str(raw).strip():
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f'option "{name}" of format "{CHECKPOINT_SOURCE}" must be a JSON object')
    return value


class CheckpointDataSource(DataSource):
    """``spark.read.format("checkpoint")``: see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return CHECKPOINT_SOURCE

    def _view(self) -> str:
        view = self.options.get("view") or "state"
        if view not in _VIEWS:
            raise ValueError(f'option "view" of format "{CHECKPOINT_SOURCE}" is one of '
                             f"{', '.join(_VIEWS)}, not {view!r}")
        return view

    def _settings(self) -> tuple[str, str, dict, dict]:
        pointer = self.options.get("path")
        stage = self.options.get("stage")
        if self._view() == "stages":
            stage = stage or ""
        if not pointer:
            raise ValueError(
                f'format "{CHECKPOINT_SOURCE}" reads a checkpoint or savepoint: pass its '
                "pointer to load(POINTER)"
            )
        static = _json_object(self.options, "storage_options")
        from_env = _json_object(self.options, "storage_options_from_env")
        if not stage and self._view() == "state":
            snapshot = open_snapshot(pointer, storage_options=_options(static, from_env))
            raise ValueError(
                f'format "{CHECKPOINT_SOURCE}" needs option "stage": the stages of {pointer} '
                f"are: {', '.join(snapshot.stages) or 'none'}"
            )
        return pointer, stage, static, from_env

    def schema(self) -> StructType:
        pointer, stage, static, from_env = self._settings()
        if self._view() == "stages":
            return from_arrow_schema(STAGE_PART_SCHEMA)
        snapshot = open_snapshot(pointer, storage_options=_options(static, from_env))
        variable = self.options.get("variable")
        if variable:
            return from_arrow_schema(snapshot.variable_schema(stage, variable))
        return from_arrow_schema(snapshot.schema(stage))

    def reader(self, schema: StructType) -> DataSourceReader:
        pointer, stage, static, from_env = self._settings()
        snapshot = open_snapshot(pointer, storage_options=_options(static, from_env))
        if self._view() == "stages":  # read from `_metadata` on the driver: a few rows
            return _StagesReader(stage_part_rows(snapshot_stages(snapshot)).to_pylist())
        variable = self.options.get("variable") or None
        if variable is not None:
            snapshot.variable_schema(stage, variable)  # an unknown variable: said here
        return _StateReader(snapshot.parts(stage), snapshot.schema(stage), static, from_env,
                            variable)


def _options(static: dict, from_env: dict) -> dict:
    return options_with_environment(static, from_env, "checkpoint state")


class _StateReader(DataSourceReader):
    """Travels to the executors: plain parts, the Arrow schema and option names only."""

    def __init__(
        self, parts: list[StatePart], schema: pa.Schema, static: dict, from_env: dict,
        variable: str | None = None,
    ) -> None:
        self.parts = parts
        self.schema = schema
        self.static = static
        self.from_env = from_env
        self.variable = variable

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(part) for part in self.parts] or [InputPartition(None)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if partition.value is None:
            return
        options = _options(self.static, self.from_env)
        if self.variable is None:
            table = read_state_part(partition.value, self.schema, options)
        else:
            table = read_variable_part(partition.value, self.schema, self.variable, options)
        yield from table.to_batches()


class _StagesReader(DataSourceReader):
    """Travels to an executor: the stage part rows, as plain values."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        yield from pa.Table.from_pylist(self.rows, STAGE_PART_SCHEMA).to_batches()


def register_checkpoint_source(spark: SparkSession) -> None:
    """Make ``spark.read.format("checkpoint")`` available in ``spark``.

    The source runs on Spark's Python workers. When the session names no Python for them
    (``PYSPARK_PYTHON`` unset when it started: PySpark then runs ``python3`` from the PATH,
    and ignores a ``spark.pyspark.python`` given to the builder) and runs locally, its
    workers get this interpreter, the driver's, which has this package. Workers that run
    another Python (set by ``PYSPARK_PYTHON``, or on a cluster) are checked with a one-task
    job: a ``RuntimeError`` says what to set when they cannot import the source.

    A local session whose JVM finds the source itself (``found_by_spark``) is left as it is:
    Spark looks it up when a read first names it (a registration would make it look data
    sources up now, and refuse to replace the one it finds).
    """
    _check_workers_python(spark)
    if found_by_spark(spark):
        return
    spark.dataSource.register(CheckpointDataSource)


def found_by_spark(spark: SparkSession) -> bool:
    """Whether ``spark``'s JVM finds ``format("checkpoint")`` as an installed data source when
    first asked: a local master whose JVM has ``INSTALLED_SOURCE_PATH`` on its ``PYTHONPATH``
    (it started after this module was imported: ``build_spark_session``), and whose data
    source lookup and workers both run this interpreter (which has this package). Three
    py4j calls, no Spark job."""
    context = spark.sparkContext
    if not context.master.startswith("local") or not _is_this_python(context.pythonExec):
        return False
    getenv = context._jvm.java.lang.System.getenv
    if INSTALLED_SOURCE_PATH not in (getenv("PYTHONPATH") or "").split(os.pathsep):
        return False
    # Spark's lookup runs the driver's Python as Spark knows it (PythonUtils.defaultPythonExec)
    lookup = getenv("PYSPARK_DRIVER_PYTHON") or getenv("PYSPARK_PYTHON") or "python3"
    return _is_this_python(lookup)


def _is_this_python(command: str) -> bool:
    # By path, not by file: a virtualenv's python is a link to the base interpreter, and
    # only its own path gives it the virtualenv's packages.
    found = shutil.which(command) or command
    return os.path.abspath(found) == os.path.abspath(sys.executable)


def _check_workers_python(spark: SparkSession) -> None:
    context = spark.sparkContext
    workers = context.pythonExec
    if _is_this_python(workers):
        return
    if "PYSPARK_PYTHON" not in os.environ and context.master.startswith("local"):
        # PySpark's fallback (python3 from the PATH) need not have pyarrow or this package;
        # local workers run on this machine, where the driver's interpreter has both. Every
        # Python function the session creates from now on carries it.
        context.pythonExec = sys.executable
        return
    try:
        context.parallelize([0], 1).map(_import_on_worker).collect()
    except Exception as exc:  # a worker's error, as Spark wraps it
        lines = [line.strip() for line in str(exc).splitlines() if "Error:" in line]
        cause = lines[-1] if lines else type(exc).__name__
        raise RuntimeError(
            f'format "{CHECKPOINT_SOURCE}" reads state on Spark\'s Python workers, which run '
            f"{workers!r} and cannot import it ({cause}). Set PYSPARK_PYTHON, before the "
            "session starts, to a Python that has flink-style-checkpoints (and so pyarrow) "
            "installed on the driver and every executor (spark-submit: --conf "
            f"spark.pyspark.python=PATH); this driver runs {sys.executable}."
        ) from exc


def _import_on_worker(_) -> bool:
    # Unpickling this function on a worker imports this module: pyarrow, pyspark's data
    # source API and the reader, what the source needs there.
    return True


# Sessions of the Dagster SparkResource come with the data source: found by Spark on first
# use in the sessions it starts, else registered.
add_session_python_path(INSTALLED_SOURCE_PATH)
on_session_created(register_checkpoint_source)
