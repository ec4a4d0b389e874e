"""The code location: ``workspace.yaml`` and ``[tool.dagster]`` both load this module.

It is the composition root: each example pipeline's definitions (``sensors.
pipeline_definitions``), merged with ``dagster.Definitions.merge``, and the resources they
share, on the embedded defaults unless the environment says otherwise:

- ``SPARK_MASTER`` (``local[*]``); ``CHECKPOINT_DIR``, ``SAVEPOINT_DIR`` and
  ``CHECKPOINT_STORAGE_OPTIONS`` (JSON of non-secret fsspec options, e.g. an S3
  ``endpoint_url``); ``PIPELINE_DATA_DIR`` (``.data`` under the project) for everything else:
  the click events' landing and report directories (``LANDING_DIR``, ``REPORT_DIR``) and the
  page views' (``PAGE_VIEWS_DIR``); ``DATA_STORAGE_OPTIONS`` (JSON of non-secret fsspec
  options) for the examples' data read and written through fsspec (landing zones and
  Parquet sinks, e.g. an S3 ``endpoint_url``).
"""

import json
import os
from pathlib import Path

import dagster as dg

from pipelines.examples.click_events import click_events_definitions
from pipelines.examples.page_views import page_views_definitions
from resources import CheckpointStorageResource, SparkResource

__all__ = ["PROJECT_ROOT", "default_resources", "defs"]

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def data_directory() -> Path:
    return Path(os.environ.get("PIPELINE_DATA_DIR", PROJECT_ROOT / ".data"))


def default_resources() -> dict:
    """The resources every pipeline of the location shares."""
    data = data_directory()
    env = os.environ.get
    return {
        "spark": SparkResource(master=env("SPARK_MASTER", "local[*]")),
        "checkpoint_storage": CheckpointStorageResource(
            checkpoint_dir=env("CHECKPOINT_DIR", str(data / "checkpoints")),
            savepoint_dir=env("SAVEPOINT_DIR", str(data / "savepoints")),
            storage_options=json.loads(env("CHECKPOINT_STORAGE_OPTIONS", "{}")),
        ),
    }


def _definitions() -> dg.Definitions:
    data = data_directory()
    env = os.environ.get
    data_options = json.loads(env("DATA_STORAGE_OPTIONS", "{}"))
    return dg.Definitions.merge(
        # Pipelines defined in YAML (sensors.StatefulPipelineComponent), if any.
        dg.load_from_defs_folder(path_within_project=PROJECT_ROOT),
        click_events_definitions(
            env("LANDING_DIR", str(data / "landing")),
            env("REPORT_DIR", str(data / "reports")),
            storage_options=data_options,
        ),
        page_views_definitions(
            env("PAGE_VIEWS_DIR", str(data / "page_views")), storage_options=data_options
        ),
        dg.Definitions(
            resources=default_resources(),
            # One process (and one Spark session) per run, not one per step.
            executor=dg.in_process_executor,
        ),
    )


defs = _definitions()
