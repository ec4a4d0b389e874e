"""Shared fixtures: real backends for the contract suites.

- ``s3_server``: moto's S3 server on 127.0.0.1 (one per session), with a log of every HTTP
  request it served, so tests can count PUT/GET/HEAD/LIST requests.
- ``backend``: the same test runs against fsspec's ``memory://``, local disk and S3.
"""

import os
import threading
import uuid
from dataclasses import dataclass, field

import pytest
from moto.server import DomainDispatcherApplication, ThreadedMotoServer, create_backend_app
from werkzeug.serving import make_server

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


@dataclass(frozen=True)
class Backend:
    """A real filesystem to run a test against: ``url(name)`` gives a fresh directory URL."""

    name: str
    base_url: str
    storage_options: dict

    def url(self, *parts: str) -> str:
        return "/".join((self.base_url, *parts))


@pytest.fixture(params=["memory", "local", "s3"])
def backend(request, tmp_path) -> Backend:
    if request.param == "memory":
        return Backend("memory", f"memory://test-{uuid.uuid4().hex}", {})
    if request.param == "local":
        return Backend("local", str(tmp_path), {})
    server = request.getfixturevalue("s3_server")
    return Backend("s3", f"s3://{server.new_bucket()}/base", server.storage_options)
