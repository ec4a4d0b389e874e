"""What a ``SparkResource`` does to each session it creates, kept apart from Dagster so that
``pipelines`` can add to it without importing Dagster (executors import ``pipelines``)."""

from collections.abc import Callable

from pyspark.sql import SparkSession

__all__ = ["SESSION_PYTHON_PATHS", "SESSION_SETUPS", "add_session_python_path",
           "on_session_created"]

SESSION_SETUPS: list[Callable[[SparkSession], None]] = []

SESSION_PYTHON_PATHS: list[str] = []


def on_session_created(setup: Callable[[SparkSession], None]) -> None:
    """Have every ``SparkResource`` run ``setup`` on its session when it first hands it out
    (once per setup). Imports point from pipelines to resources, so this is how pipelines
    adds to the session (its ``checkpoint`` data source) without resources importing it."""
    if setup not in SESSION_SETUPS:
        SESSION_SETUPS.append(setup)


def add_session_python_path(directory: str) -> None:
    """Put ``directory`` on the ``PYTHONPATH`` of the JVM that ``build_spark_session`` starts
    (from now on), and so of the Python processes that JVM starts: Spark's lookup of
    installed data sources (``pyspark_*`` modules) and its workers. This is how pipelines
    has Spark find its ``checkpoint`` data source on first use, without a registration
    (and the Python process it starts) on every session's start."""
    if directory not in SESSION_PYTHON_PATHS:
        SESSION_PYTHON_PATHS.append(directory)
