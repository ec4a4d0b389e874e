"""Dagster resources: the Spark session and the checkpoint storage. Resources stay on the
driver; only the plain objects they hand out travel to executors.

Exports load on first use: ``pipelines`` imports ``on_session_created`` (no Dagster) and
executors import ``pipelines``, so this package must not import Dagster up front."""

import importlib

__all__ = [
    "DEFAULT_SPARK_CONF",
    "CheckpointStorageResource",
    "SparkResource",
    "build_spark_session",
    "on_session_created",
]

_MODULES = {
    "DEFAULT_SPARK_CONF": "resources.spark",
    "CheckpointStorageResource": "resources.checkpoint_storage",
    "SparkResource": "resources.spark",
    "build_spark_session": "resources.spark",
    "on_session_created": "resources._session",
}


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'resources' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
