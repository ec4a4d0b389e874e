"""Dagster resources: the Spark session and the checkpoint storage. Resources stay on the
driver; only the plain objects they hand out travel to executors."""

from resources.checkpoint_storage import CheckpointStorageResource, refuse_credentials
from resources.spark import (
    DEFAULT_SPARK_CONF,
    SparkResource,
    build_spark_session,
    on_session_created,
)

__all__ = [
    "DEFAULT_SPARK_CONF",
    "CheckpointStorageResource",
    "SparkResource",
    "build_spark_session",
    "on_session_created",
    "refuse_credentials",
]
