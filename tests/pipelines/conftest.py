"""A session-scoped real Spark (local[2]) for the pipeline tests."""

import pytest

from resources import build_spark_session


@pytest.fixture(scope="session")
def spark():
    session = build_spark_session(
        "local[2]", "tests", {"spark.sql.shuffle.partitions": "4", "spark.ui.enabled": "false"}
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
