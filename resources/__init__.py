"""Dagster resources: the Spark session and the checkpoint storage. Resources stay on the
driver; only the plain objects they hand out travel to executors.

Exports load on first use: ``pipelines`` imports ``on_session_created`` (no Dagster) and
executors import ``pipelines``, so this package must not import Dagster up front."""

from checkpoint_storage.spi import lazy_names

__all__ = [
    "DEFAULT_SPARK_CONF",
    "CheckpointStorageResource",
    "SparkResource",
    "add_session_python_path",
    "build_spark_session",
    "on_session_created",
]

_MODULES = {
    "DEFAULT_SPARK_CONF": "resources.spark",
    "CheckpointStorageResource": "resources.checkpoint_storage",
    "SparkResource": "resources.spark",
    "add_session_python_path": "resources._session",
    "build_spark_session": "resources.spark",
    "on_session_created": "resources._session",
}


__getattr__, __dir__ = lazy_names(__name__, globals(), _MODULES)
