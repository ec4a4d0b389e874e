"""Fixtures for the acceptance tests: one real ``dagster dev`` (webserver + daemon) per test
session, storing checkpoints and savepoints on moto's S3 server (``s3_server`` from
tests/conftest.py, in this pytest process on 127.0.0.1), the click events' landing and
reports and the page views' data (``PAGE_VIEWS_DIR``) in local temp dirs, and a temporary
DAGSTER_HOME. Shared by the end-to-end test and the browser test, so that the browser sees
the materializations the end-to-end test made; the browser test makes one itself when it
runs alone.
"""

import json
import os
from pathlib import Path

import pytest

from tests.acceptance.dagster_process import DagsterDev, start_dagster_dev, stop_process_group
from tests.acceptance.support import PipelineEnv


@pytest.fixture(scope="session")
def pipeline_env(s3_server, tmp_path_factory) -> PipelineEnv:
    bucket = s3_server.new_bucket()
    data = tmp_path_factory.mktemp("pipeline-data")
    return PipelineEnv(
        bucket=bucket,
        checkpoint_dir=f"s3://{bucket}/checkpoints",
        savepoint_dir=f"s3://{bucket}/savepoints",
        storage_options=s3_server.storage_options,
        landing_dir=str(data / "landing"),
        report_dir=str(data / "reports"),
        page_views_dir=str(data / "page_views"),
        artifacts=tmp_path_factory.mktemp("dagster-dev"),
    )


@pytest.fixture(scope="session")
def dagster_dev(pipeline_env: PipelineEnv):
    env = {
        "SPARK_MASTER": "local[2]",
        "CHECKPOINT_DIR": pipeline_env.checkpoint_dir,
        "SAVEPOINT_DIR": pipeline_env.savepoint_dir,
        "CHECKPOINT_STORAGE_OPTIONS": json.dumps(pipeline_env.storage_options),
        "LANDING_DIR": pipeline_env.landing_dir,
        "REPORT_DIR": pipeline_env.report_dir,
        "PAGE_VIEWS_DIR": pipeline_env.page_views_dir,
        "PIPELINE_DATA_DIR": str(pipeline_env.artifacts / "data"),
        # The test seam in sensors/_assets.py: runs tagged test/fail_after_batch fail.
        "PIPELINE_FAULT_INJECTION": "1",
        # Credentials come from the environment (tests/conftest.py sets the test ones).
        "AWS_ACCESS_KEY_ID": os.environ["AWS_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"],
        "AWS_DEFAULT_REGION": os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
    }
    home = pipeline_env.artifacts / "dagster_home"
    dev: DagsterDev = start_dagster_dev(home, env, pipeline_env.artifacts / "dagster-dev.log")
    try:
        yield dev
    finally:
        stop_process_group(dev.proc)


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    """test-artifacts/ at the repo root (git-ignored): screenshots and logs worth keeping."""
    path = Path(__file__).resolve().parents[2] / "test-artifacts"
    path.mkdir(exist_ok=True)
    return path
