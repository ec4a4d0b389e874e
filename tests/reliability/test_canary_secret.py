"""A canary secret in the storage credentials never leaks (issue 7): not into the library's
logs, `_metadata`, the objects shipped to executors, reprs, or Dagster event metadata."""

import logging
import os
import uuid

import dagster as dg
import pytest

from checkpoint_storage import FileSystemCheckpointStorage
from resources import CheckpointStorageResource
from tests.pipelines.support import click_pipeline, materialize_range, resources_for
from tests.reliability.proxy import FaultProxy
from tests.reliability.scenarios_net import (
    CANARY_VARIABLE,
    canary_artifacts,
    scenario_canary_secret,
)

# Set at import (collection), before any Spark JVM starts, so that Spark's Python workers
# inherit it: storage_options_from_env is read in every process that opens the storage.
CANARY = f"canary-{uuid.uuid4().hex}"
os.environ[CANARY_VARIABLE] = CANARY


@pytest.mark.timeout(120)
def test_canary_from_storage_options_from_env_never_leaks(s3_server):
    """A secret read via storage_options_from_env is used for S3 yet appears in no log
    record, `_metadata`, pickled executor task or storage, error message, or repr."""
    bucket = s3_server.new_bucket()
    with FaultProxy(s3_server.endpoint_url) as proxy:
        storage = FileSystemCheckpointStorage(
            f"s3://{bucket}/cp",
            storage_options=proxy.options(attempts=1),
            storage_options_from_env={"key": "AWS_ACCESS_KEY_ID", "secret": CANARY_VARIABLE},
            file_state_size_threshold=0,
        )

        artifacts, logs = canary_artifacts(storage, proxy, s3_server.endpoint_url, bucket)

        assert CANARY == storage.create_checkpoint_storage(uuid.uuid4().hex)._fs.secret
    assert any(line.endswith(": committed") for line in logs)
    assert any("skipping invalid" in line for line in logs)
    assert [] == [name for name, data in artifacts if CANARY.encode() in data]


@pytest.mark.timeout(120)
def test_canary_in_aws_secret_access_key_never_leaks(s3_server, monkeypatch):
    """A secret in AWS_SECRET_ACCESS_KEY (found by botocore itself) appears in no log
    record, `_metadata`, pickled executor task or storage, error message, or repr."""
    canary = f"aws-canary-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", canary)
    bucket = s3_server.new_bucket()
    with FaultProxy(s3_server.endpoint_url) as proxy:  # its own endpoint: a fresh client
        storage = FileSystemCheckpointStorage(
            f"s3://{bucket}/cp",
            storage_options=proxy.options(attempts=1),
            file_state_size_threshold=0,
        )

        artifacts, logs = canary_artifacts(storage, proxy, s3_server.endpoint_url, bucket)

        fs = storage.create_checkpoint_storage(uuid.uuid4().hex)._fs
        assert canary == fs.s3._request_signer._credentials.secret_key
    assert logs
    assert [] == [name for name, data in artifacts if canary.encode() in data]


@pytest.mark.timeout(600)
def test_canary_stays_out_of_dagster_events_and_shipped_tasks(spark, tmp_path, caplog):  # noqa: F811
    """A Dagster run whose checkpoint storage takes an option from the canary variable
    succeeds (executors read it from their environment) and no event of the run, nor the
    library's logs, contains the canary."""
    storage = CheckpointStorageResource(
        checkpoint_dir=str(tmp_path / "checkpoints"),
        savepoint_dir=str(tmp_path / "savepoints"),
        storage_options_from_env={"secret": CANARY_VARIABLE},
    )
    resources = resources_for(tmp_path, storage=storage)

    with dg.instance_for_test() as instance, caplog.at_level(logging.DEBUG, "checkpoint_storage"):
        result = materialize_range(
            instance, resources, "2026-10-01", "2026-10-01", pipeline=click_pipeline(tmp_path)
        )
        events = instance.all_logs(result.run_id)
        serialized = [dg.serialize_value(event) for event in events]

    assert result.success
    assert any("checkpoint_pointer" in text for text in serialized)
    assert [] == [text[:200] for text in serialized if CANARY in text]
    assert CANARY not in caplog.text


@pytest.mark.timeout(120)
def test_canary_scenario_finds_no_leak(s3_server):
    """The runner's canary scenario (fresh canary per trial) finds no artifact holding it."""
    trials, failures, figure = scenario_canary_secret(2, s3_server.endpoint_url)

    assert (2, 0) == (trials, failures), figure
