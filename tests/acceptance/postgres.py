"""A throw-away PostgreSQL server for tests: Debian's ``postgresql`` binaries, a fresh data
directory in a temp dir, trust authentication, listening on 127.0.0.1 only (plus a Unix
socket in the same temp dir), with one database for a Dagster instance.

As root the server runs as the ``postgres`` user (``initdb`` refuses root); otherwise as the
current user. ``scripts/test`` installs the ``postgresql`` package when it is missing; without
it the tests that need a server fail and say so (they never skip silently).
"""

import contextlib
import glob
import os
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["PostgresServer", "dagster_yaml", "find_postgres_bin", "running_postgres"]

DATABASE = "dagster_test"
USER = "postgres"


@dataclass(frozen=True)
class PostgresServer:
    host: str
    port: int
    user: str
    database: str
    data_dir: Path

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}@{self.host}:{self.port}/{self.database}"

    def connect(self):
        """A psycopg2 connection (autocommit) to the test database."""
        import psycopg2

        connection = psycopg2.connect(
            host=self.host, port=self.port, user=self.user, dbname=self.database
        )
        connection.autocommit = True
        return connection


def _version(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", Path(path).parent.name))


def find_postgres_bin() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` with an ``initdb``, or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version)
    return Path(found[-1]).parent if found else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_postgres(database: str = DATABASE) -> Iterator[PostgresServer]:
    """Start a server with ``database`` created; stop it and delete its data on exit."""
    bin_dir = find_postgres_bin()
    if bin_dir is None:
        pytest.fail(
            "PostgreSQL server binaries not found (/usr/lib/postgresql/*/bin/initdb): run "
            "`apt-get install postgresql` (scripts/test installs it when it can)",
            pytrace=False,
        )
    as_root = os.geteuid() == 0
    # Outside pytest's tmp dirs: those are private to the current user, and the server runs
    # as `postgres` when we are root.
    root = Path(tempfile.mkdtemp(prefix="pg-test-"))
    if as_root:
        shutil.chown(root, USER, USER)

    def run(*args: str, timeout: float = 120) -> None:
        command = [str(bin_dir / args[0]), *args[1:]]
        if as_root:
            command = ["runuser", "-u", USER, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            log = root / "log"
            tail = log.read_text()[-3000:] if log.exists() else ""
            raise RuntimeError(
                f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}\n"
                f"{done.stderr}\n{tail}"
            )

    port = _free_port()
    data = root / "data"
    started = False
    try:
        run("initdb", "-D", str(data), "-U", USER, "--auth=trust", "-E", "UTF8", "--no-sync")
        options = (
            f"-c listen_addresses=127.0.0.1 -p {port} -k {root} "
            "-c fsync=off -c full_page_writes=off -c synchronous_commit=off"
        )
        run("pg_ctl", "-D", str(data), "-l", str(root / "log"), "-w", "-t", "60",
            "-o", options, "start")  # fmt: skip
        started = True
        run("createdb", "-h", "127.0.0.1", "-p", str(port), "-U", USER, database)
        yield PostgresServer("127.0.0.1", port, USER, database, data)
    finally:
        if started:
            with contextlib.suppress(Exception):
                run("pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


def dagster_yaml(server: PostgresServer, extra: str = "") -> str:
    """A ``dagster.yaml`` whose run, event log and schedule storage is ``server``'s database
    (SQLAlchemy 2 needs the ``postgresql+psycopg2`` scheme), then ``extra``."""
    return (
        "telemetry:\n"
        "  enabled: false\n"
        "storage:\n"
        "  postgres:\n"
        "    postgres_db:\n"
        f"      username: {server.user}\n"
        f"      hostname: {server.host}\n"
        f"      db_name: {server.database}\n"
        f"      port: {server.port}\n"
        "      scheme: postgresql+psycopg2\n"
    ) + extra
