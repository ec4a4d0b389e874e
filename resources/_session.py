"""What a ``SparkResource`` does to each session it creates, kept apart from Dagster so that
``pipelines`` can add to it without importing Dagster (executors import ``pipelines``)."""

from collections.abc import Callable

from pyspark.sql import SparkSession

__all__ = ["SESSION_SETUPS", "on_session_created"]

SESSION_SETUPS: list[Callable[[SparkSession], None]] = []


def on_session_created(setup: Callable[[SparkSession], None]) -> None:
    """Have every ``SparkResource`` run ``setup`` on its session when it first hands it out
    (once per setup). Imports point from pipelines to resources, so this is how pipelines
    adds to the session (its ``checkpoint`` data source) without resources importing it."""
    if setup not in SESSION_SETUPS:
        SESSION_SETUPS.append(setup)
