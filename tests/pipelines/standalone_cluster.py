"""A standalone Spark master and worker started from the pyspark package, and the driver
(cluster_driver.py) in a subprocess: the harness of test_cluster.py and of the speculation
scenarios (tests/reliability/scenarios_crash.py). Every process carries a marker in its
environment, so that ``Cluster.stop`` finds and stops them all."""

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pyspark

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "cluster_driver.py"
SPARK_HOME = Path(pyspark.__file__).resolve().parent
SPARK_CLASS = SPARK_HOME / "bin" / "spark-class"
# The venv's interpreter by its own path (not resolved: a venv's python is a symlink).
PYTHON = os.path.abspath(sys.executable)
MARKER = "CLUSTER_TEST_MARKER"
STARTUP_TIMEOUT = 60
DRIVER_TIMEOUT = 200


def _processes_with(marker: str) -> list[int]:
    """Our processes whose environment carries ``marker``: the daemons, the executors and
    their Python workers (the PySpark daemon moves to its own process group)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"{MARKER}={marker}".encode() in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when pytest dies (e.g. killed by a CI timeout),
    so that no daemon outlives the run. Linux's PR_SET_PDEATHSIG survives the exec."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stop(processes: list[subprocess.Popen], marker: str) -> list[int]:
    """Stop the process groups we started, then anything left carrying our marker; returns
    the pids that survived SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
        for pid in _processes_with(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for proc in processes:
                proc.poll()  # reap
            if not any(_alive(p) for p in _processes_with(marker)) and all(
                proc.poll() is not None for proc in processes
            ):
                return []
            time.sleep(0.2)
    return [p for p in _processes_with(marker) if _alive(p)]


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class Cluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.marker = uuid.uuid4().hex
        self.work_dir = root / "worker"
        self.log_dir = root / "logs"
        self.conf_dir = root / "conf"
        for directory in (self.work_dir, self.log_dir, self.conf_dir):
            directory.mkdir(parents=True)
        # Read by the master and worker (and the driver's spark-submit): no REST submission
        # server, which would bind the fixed port 6066.
        (self.conf_dir / "spark-defaults.conf").write_text("spark.master.rest.enabled false\n")
        self.url = ""  # known once the master has started
        self.webui_port = 0
        self.processes: list[subprocess.Popen] = []
        self.master: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "SPARK_"))}
        env.pop("PYTHONPATH", None)
        env |= {
            "SPARK_HOME": str(SPARK_HOME),
            "SPARK_CONF_DIR": str(self.conf_dir),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_WORKER_DIR": str(self.work_dir),
            "SPARK_LOG_DIR": str(self.log_dir),
            "SPARK_DAEMON_MEMORY": "256m",
            "PYSPARK_PYTHON": PYTHON,
            "PYSPARK_DRIVER_PYTHON": PYTHON,
            MARKER: self.marker,
        }
        return env

    def _spawn(self, name: str, args: list) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - owned by the child
        try:
            proc = subprocess.Popen(
                [str(a) for a in args],
                cwd=self.root,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        finally:
            log.close()
        self.processes.append(proc)
        return proc

    def start(self) -> None:
        # Port 0 everywhere: the master reports the ports it bound in its log, so no port is
        # picked in advance (and raced for).
        self.master = self._spawn(
            "master",
            [
                SPARK_CLASS,
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                0,
                "--webui-port",
                0,
            ],
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT
        log = self.log_dir / "master.log"
        while True:
            self._check_running(deadline, "the master did not start")
            text = _tail(log, 10**6)
            url = re.search(r"Starting Spark master at (spark://127\.0\.0\.1:\d+)", text)
            ui = re.search(r"Successfully started service 'MasterUI' on port (\d+)", text)
            if url and ui:
                self.url, self.webui_port = url.group(1), int(ui.group(1))
                break
            time.sleep(0.3)
        self.worker = self._spawn(
            "worker",
            [
                SPARK_CLASS,
                "org.apache.spark.deploy.worker.Worker",
                "--host",
                "127.0.0.1",
                "--port",
                0,
                "--webui-port",
                0,
                "--cores",
                2,
                "--memory",
                "1g",
                "--work-dir",
                self.work_dir,
                self.url,
            ],
        )
        while True:
            self._check_running(deadline, "no worker registered")
            with contextlib.suppress(OSError, ValueError):
                state = self.master_state()
                if any(w.get("state") == "ALIVE" for w in state.get("workers", [])):
                    return
            time.sleep(0.3)

    def completed_apps(self, timeout: float = 15) -> list[tuple[str, str]]:
        """(name, state) of the applications the master saw finish, once there are any."""
        deadline = time.monotonic() + timeout
        while True:
            apps = [(a["name"], a["state"]) for a in self.master_state()["completedapps"]]
            if apps or time.monotonic() > deadline:
                return apps
            time.sleep(0.3)

    def _check_running(self, deadline: float, what: str) -> None:
        for proc in (self.master, self.worker):
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{proc.args[1]} exited with {proc.returncode}:\n{self.logs()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {STARTUP_TIMEOUT}s:\n{self.logs()}")

    def master_state(self) -> dict:
        url = f"http://127.0.0.1:{self.webui_port}/json/"
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.load(response)

    def run_driver(self, work: Path) -> subprocess.CompletedProcess:
        proc = self._spawn_driver(work)
        try:
            out, err = proc.communicate(timeout=DRIVER_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(
                f"the driver timed out after {DRIVER_TIMEOUT}s:\n{err[-6000:]}\n{self.logs()}"
            ) from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def _spawn_driver(self, work: Path) -> subprocess.Popen:
        proc = subprocess.Popen(
            [PYTHON, str(DRIVER), "--master", self.url, "--work-dir", str(work)],
            cwd=self.root,
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.processes.append(proc)
        return proc

    def logs(self) -> str:
        parts = [f"--- {p.name}\n{_tail(p)}" for p in sorted(self.log_dir.glob("*.log"))]
        parts += [
            f"--- {p.relative_to(self.root)}\n{_tail(p)}"
            for p in sorted(self.work_dir.glob("app-*/*/stderr"))
        ]
        return "\n".join(parts)

    def stop(self) -> list[int]:
        return _stop(self.processes, self.marker)
