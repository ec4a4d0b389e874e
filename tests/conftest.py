"""Shared fixtures: real backends for the contract suites, and the test tiers.

- ``s3_server``: moto's S3 server on 127.0.0.1 (one per session), with a log of every HTTP
  request it served, so tests can count PUT/GET/HEAD/LIST requests.
- ``backend``: the same test runs against fsspec's ``memory://``, local disk and S3.
- ``spark``: a real Spark (local[2]), one per session (per xdist worker).
- Tiers: every test is marked ``spark``, ``s3``, ``dagster`` and/or ``slow`` from what it
  uses (``pytest_collection_modifyitems``), so a new test is classified without a decorator;
  ``scripts/test --fast`` runs the rest with the guard of ``FAST_TIER_ENV``.
"""

import os
import shutil
import stat
import tempfile
import threading
import types
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from moto.server import DomainDispatcherApplication, ThreadedMotoServer, create_backend_app
from werkzeug.serving import make_server

from tests.support import Backend

# Credentials come from the environment, never from storage options (docs/design.md §5).
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


@dataclass(frozen=True)
class S3Request:
    method: str
    path: str
    query: str
    conditional_create: bool  # carries If-None-Match: *

    @property
    def kind(self) -> str:
        """PUT, GET, HEAD, DELETE, LIST (a GET on a bucket with list parameters) or POST."""
        key = self.path.lstrip("/").partition("/")[2]
        if self.method == "GET" and (not key or "list-type" in self.query):
            return "LIST"
        return self.method


@dataclass
class S3Server:
    endpoint_url: str
    requests: list[S3Request] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint_url}

    def new_bucket(self) -> str:
        import boto3

        name = f"test-{uuid.uuid4().hex[:16]}"
        boto3.client("s3", endpoint_url=self.endpoint_url).create_bucket(Bucket=name)
        return name

    def clear_log(self) -> None:
        with self._lock:
            self.requests.clear()

    def count(self, kind: str, bucket: str | None = None) -> int:
        with self._lock:
            return sum(
                1
                for r in self.requests
                if r.kind == kind and (bucket is None or r.path.lstrip("/").startswith(bucket))
            )

    def log(self, environ: dict) -> None:
        request = S3Request(
            method=environ["REQUEST_METHOD"],
            path=environ.get("PATH_INFO", ""),
            query=environ.get("QUERY_STRING", ""),
            conditional_create=environ.get("HTTP_IF_NONE_MATCH") == "*",
        )
        with self._lock:
            self.requests.append(request)


class _LoggingMotoServer(ThreadedMotoServer):
    """moto's threaded server with a WSGI layer that records each request."""

    def __init__(self, log) -> None:
        super().__init__(ip_address="127.0.0.1", port=0, verbose=False)
        self._log = log

    def _server_entry(self) -> None:
        app = DomainDispatcherApplication(create_backend_app)

        def logged(environ, start_response):
            self._log(environ)
            return app(environ, start_response)

        self._server = make_server(self._ip_address, self._port, logged, True)
        self._server_ready_event.set()
        self._server.serve_forever()


@pytest.fixture(scope="session")
def s3_server():
    holder: list[S3Server] = []
    server = _LoggingMotoServer(lambda environ: holder[0].log(environ))
    server.start()
    host, port = server.get_host_and_port()
    holder.append(S3Server(endpoint_url=f"http://{host}:{port}"))
    yield holder[0]
    server.stop()


@pytest.fixture
def s3_bucket(s3_server) -> str:
    return s3_server.new_bucket()


@pytest.fixture(params=["memory", "local", "s3"])
def backend(request, tmp_path) -> Backend:
    if request.param == "memory":
        return Backend("memory", f"memory://test-{uuid.uuid4().hex}", {})
    if request.param == "local":
        return Backend("local", str(tmp_path), {})
    server = request.getfixturevalue("s3_server")
    return Backend("s3", f"s3://{server.new_bucket()}/base", server.storage_options)


@pytest.fixture(scope="session")
def spark():
    # Imported here: collecting the tests that need no Spark loads no pyspark.
    from resources import build_spark_session

    session = build_spark_session(
        "local[2]", "tests", {"spark.sql.shuffle.partitions": "4", "spark.ui.enabled": "false"}
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


# --- Test tiers -----------------------------------------------------------------------------

# Set by `scripts/test --fast`: starting a JVM (in this process or any subprocess) or a moto
# server fails, so a test that does so without its marker shows up instead of slowing the tier.
FAST_TIER_ENV = "CHECKPOINT_TESTS_FAST"
TESTS = Path(__file__).resolve().parent
# Directories whose every test is of these tiers: the acceptance tests run `dagster dev` (or
# a Dagster instance on PostgreSQL), whose runs start Spark.
DIRECTORY_MARKS = {"acceptance": ("dagster", "spark", "slow")}
# Fixtures that start what a tier stands for (the fixture closure includes indirect use).
FIXTURE_MARKS = {"spark": "spark", "s3_server": "s3", "dagster_dev": "dagster"}
# Objects whose presence in a test module's globals means its tests start a JVM: they build
# a SparkSession themselves or hand Dagster a SparkResource.
SPARK_STARTERS = ("SparkSession", "SparkResource", "build_spark_session")
NOT_MARKED = (
    "this test {what} but is not marked {marker!r}: tests/conftest.py marks tests by the "
    "fixtures they use ({fixtures}) and by module; mark this one with "
    "@pytest.mark.{marker} (or pytestmark = pytest.mark.{marker} for its module)"
)


def _module_uses_dagster(module: types.ModuleType) -> bool:
    """The module imports dagster or a class or function of it: its tests run Dagster (a
    constant such as a partitions definition imported from a helper does not count)."""
    for value in vars(module).values():
        if isinstance(value, types.ModuleType):
            name = value.__name__
        elif isinstance(value, type | types.FunctionType):
            name = value.__module__
        else:
            continue
        if name.split(".")[0] in ("dagster", "dagster_postgres"):
            return True
    return False


def _tier_marks(item: pytest.Item) -> set[str]:
    marks = set()
    path = Path(str(item.path)).resolve()
    if path.is_relative_to(TESTS) and len(path.relative_to(TESTS).parts) > 1:
        marks.update(DIRECTORY_MARKS.get(path.relative_to(TESTS).parts[0], ()))
    fixtures = set(getattr(item, "fixturenames", ()))
    marks.update(mark for fixture, mark in FIXTURE_MARKS.items() if fixture in fixtures)
    # Parametrized backends ("memory"/"local"/"s3") fetch s3_server only for the "s3" case.
    callspec = getattr(item, "callspec", None)
    if callspec is not None and any(isinstance(v, str) and v == "s3"
                                    for v in callspec.params.values()):
        marks.add("s3")
    module = getattr(item, "module", None)
    if module is not None:
        if _module_uses_dagster(module):
            marks.add("dagster")
        if any(name in vars(module) for name in SPARK_STARTERS):
            marks.add("spark")
    return marks


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in sorted(_tier_marks(item) - {m.name for m in item.iter_markers()}):
            item.add_marker(marker)


_REFUSING_JAVA = """#!/bin/sh
echo "{message}" >&2
exit 1
"""


def pytest_configure(config):
    if os.environ.get(FAST_TIER_ENV) != "1":
        return
    # Spark (a SparkSession, spark-submit, spark-class, here or in any subprocess that inherits
    # the environment) runs $JAVA_HOME/bin/java, else the first java on PATH: a java that
    # refuses, naming why, makes every JVM start fail.
    home = Path(tempfile.mkdtemp(prefix="fast-tier-java-home-"))
    (home / "bin").mkdir()
    java = home / "bin" / "java"
    message = NOT_MARKED.format(what="starts a JVM (Spark)", marker="spark",
                                fixtures=", ".join(FIXTURE_MARKS))
    java.write_text(_REFUSING_JAVA.format(message=f"fast tier ({FAST_TIER_ENV}=1): "
                                          + message.replace('"', "'")))
    java.chmod(java.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.environ["JAVA_HOME"] = str(home)
    os.environ["PATH"] = f"{home / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"

    def refuse(self, *args, **kwargs):
        raise RuntimeError(
            f"fast tier ({FAST_TIER_ENV}=1): "
            + NOT_MARKED.format(what="starts moto's S3 server", marker="s3",
                                fixtures=", ".join(FIXTURE_MARKS))
        )

    ThreadedMotoServer.start = refuse
    config.add_cleanup(lambda: shutil.rmtree(home, ignore_errors=True))
