"""A loopback HTTP fault proxy in front of moto's S3 server (stdlib only, threads).

Each client connection carries exactly one request: the proxy reads it (headers plus a
``Content-Length`` or chunked body), asks ``rule(request)`` what to do, and answers with
``Connection: close``, so botocore opens a fresh connection for the next request and every
fault hits exactly one request. Actions:

- ``PASS``: forward to the server and relay its response.
- ``Error(status, code)``: answer with an S3 XML error; the server never sees the request.
- ``Delay(seconds)``: forward, wait, then relay (a slow response; long enough to trip the
  client's ``read_timeout`` it becomes a timeout).
- ``RESET``: reset the connection (TCP RST) without forwarding.
- ``LOST``: forward, read the server's whole response, then reset the connection: the
  request was applied but the client never learns it.

Every request is logged with the action taken (``proxy.log``). All sockets have timeouts and
``stop()`` closes everything, so a broken test cannot hang on the proxy.

``drop_headers`` (lower-case names) are removed from every forwarded request: with
``{"if-none-match"}`` the proxy plays an S3-compatible server that ignores conditional
writes (the request log still shows what the client sent).
"""

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

SOCKET_TIMEOUT = 10.0


@dataclass(frozen=True)
class Request:
    method: str
    target: str  # path and query as sent, e.g. /bucket/key?list-type=2
    headers: dict  # lower-case names

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]

    @property
    def query(self) -> str:
        return self.target.partition("?")[2]

    @property
    def kind(self) -> str:
        """PUT, GET, HEAD, DELETE, POST or LIST (a GET of a bucket, with or without params)."""
        key = self.path.lstrip("/").partition("/")[2]
        if self.method == "GET" and (not key or "list-type" in self.query):
            return "LIST"
        return self.method

    @property
    def conditional_create(self) -> bool:
        return self.headers.get("if-none-match") == "*"


@dataclass(frozen=True)
class Error:
    status: int
    code: str


@dataclass(frozen=True)
class Delay:
    seconds: float


PASS = "pass"
IGNORES_CONDITIONAL_WRITES = frozenset({"if-none-match"})  # drop_headers of such a server
RESET = "reset"
LOST = "lost"
SLOW_DOWN = Error(503, "SlowDown")  # s3fs retries this code itself
UNAVAILABLE = Error(503, "ServiceUnavailable")  # s3fs does not retry this code
ACCESS_DENIED = Error(403, "AccessDenied")
INTERNAL_ERROR = Error(500, "InternalError")

_REASONS = {403: "Forbidden", 500: "Internal Server Error", 503: "Service Unavailable"}


def client_options(endpoint_url: str, *, attempts: int = 1, timeout: float = 3.0) -> dict:
    """s3fs options with explicit timeouts and botocore retries: ``attempts`` tries per
    request (1 = an HTTP error reaches s3fs). s3fs itself (a class attribute, not an option)
    retries connection errors and ``SlowDown`` up to 5 times with a backoff of 0.1 s * 1.7^i,
    at most ~2 s; other HTTP errors (403, 500, 503 ServiceUnavailable) it raises at once."""
    return {
        "endpoint_url": endpoint_url,
        "config_kwargs": {
            "connect_timeout": timeout,
            "read_timeout": timeout,
            "retries": {"max_attempts": attempts, "mode": "standard"},
        },
    }


class FaultProxy:
    """``with FaultProxy(upstream_url) as proxy:`` serves on ``proxy.endpoint_url``."""

    def __init__(
        self,
        upstream_url: str,
        rule: Callable[[Request], object] | None = None,
        *,
        drop_headers: frozenset[str] | set[str] = frozenset(),
    ):
        parts = urlsplit(upstream_url)
        self._upstream = (parts.hostname, parts.port)
        self.rule = rule or (lambda request: PASS)
        self.drop_headers = frozenset(h.lower() for h in drop_headers)
        self.log: list[tuple[Request, object]] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.endpoint_url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stopping = threading.Event()
        self._connections: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._serve, name="fault-proxy", daemon=True)

    def __enter__(self) -> "FaultProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def options(self, **kwargs) -> dict:
        return client_options(self.endpoint_url, **kwargs)

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)
        self._listener.close()
        with self._lock:
            for conn in list(self._connections):
                with contextlib.suppress(OSError):
                    conn.close()

    def count(self, kind: str | None = None, action: object = None) -> int:
        with self._lock:
            return sum(
                1
                for request, taken in self.log
                if (kind is None or request.kind == kind) and (action is None or taken == action)
            )

    def clear_log(self) -> None:
        with self._lock:
            self.log.clear()

    # --- serving -------------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(SOCKET_TIMEOUT)
            with self._lock:
                self._connections.add(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            parsed = _read_request(conn, self.drop_headers)
            if parsed is None:
                return
            request, raw = parsed
            action = self.rule(request)
            with self._lock:
                self.log.append((request, action))
            if isinstance(action, Error):
                conn.sendall(_error_response(action, request))
            elif action == RESET:
                _reset(conn)
            else:
                response = self._forward(raw)
                if isinstance(action, Delay):
                    time.sleep(action.seconds)
                if action == LOST:
                    _reset(conn)
                else:
                    conn.sendall(response)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            with self._lock:
                self._connections.discard(conn)

    def _forward(self, raw: bytes) -> bytes:
        with socket.create_connection(self._upstream, timeout=SOCKET_TIMEOUT) as upstream:
            upstream.sendall(raw)
            chunks = []
            while chunk := upstream.recv(65536):
                chunks.append(chunk)
        return _close_after(b"".join(chunks))


def _reset(conn: socket.socket) -> None:
    """Close with a TCP RST instead of a FIN."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def _read_until(conn: socket.socket, buffer: bytearray, marker: bytes) -> int:
    while (index := buffer.find(marker)) < 0:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("client closed mid-request")
        buffer += chunk
    return index


def _read_exactly(conn: socket.socket, buffer: bytearray, n: int) -> None:
    while len(buffer) < n:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("client closed mid-body")
        buffer += chunk


def _read_request(
    conn: socket.socket, drop_headers: frozenset[str] = frozenset()
) -> tuple[Request, bytes] | None:
    """One request from the client, and its raw bytes rewritten to ``Connection: close``
    (without ``drop_headers``)."""
    buffer = bytearray()
    try:
        head_end = _read_until(conn, buffer, b"\r\n\r\n")
    except ConnectionError:
        return None
    head = bytes(buffer[:head_end]).decode("latin-1")
    lines = head.split("\r\n")
    method, target, version = lines[0].split(" ", 2)
    headers = {}
    kept = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
        if name.strip().lower() not in ("connection", "keep-alive", "expect", *drop_headers):
            kept.append(line)
    body_start = head_end + 4
    if headers.get("expect", "").lower() == "100-continue":
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if headers.get("transfer-encoding", "").lower() == "chunked":
        position = body_start
        while True:
            line_end = _read_until_from(conn, buffer, b"\r\n", position)
            size = int(bytes(buffer[position:line_end]).split(b";")[0], 16)
            position = line_end + 2
            if size == 0:
                # trailers end with an empty line
                while True:
                    line_end = _read_until_from(conn, buffer, b"\r\n", position)
                    empty = line_end == position
                    position = line_end + 2
                    if empty:
                        break
                break
            _read_exactly(conn, buffer, position + size + 2)
            position += size + 2
        body = bytes(buffer[body_start:position])
    else:
        length = int(headers.get("content-length", "0") or 0)
        _read_exactly(conn, buffer, body_start + length)
        body = bytes(buffer[body_start : body_start + length])
    raw_head = "\r\n".join([lines[0], *kept, "Connection: close"]) + "\r\n\r\n"
    return Request(method, target, headers), raw_head.encode("latin-1") + body


def _read_until_from(conn: socket.socket, buffer: bytearray, marker: bytes, start: int) -> int:
    while (index := buffer.find(marker, start)) < 0:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("client closed mid-body")
        buffer += chunk
    return index


def _close_after(response: bytes) -> bytes:
    """The server's response with its connection headers replaced by ``Connection: close``."""
    head, sep, body = response.partition(b"\r\n\r\n")
    lines = [
        line
        for line in head.split(b"\r\n")
        if line.split(b":", 1)[0].strip().lower() not in (b"connection", b"keep-alive")
    ]
    return b"\r\n".join([*lines, b"Connection: close"]) + sep + body


def _error_response(error: Error, request: Request) -> bytes:
    body = b""
    if request.method != "HEAD":
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{error.code}</Code><Message>injected by the fault proxy</Message>"
            f"<Resource>{request.path}</Resource><RequestId>fault</RequestId></Error>"
        ).encode()
    head = (
        f"HTTP/1.1 {error.status} {_REASONS.get(error.status, 'Error')}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body
