"""Helpers for the acceptance tests: a real ``dagster dev`` (webserver + daemon) in its own
process group, and a small GraphQL client over plain HTTP.

Lessons behind the process handling: ``dagster dev`` started in the background of a
non-interactive shell ignores SIGTERM, and its children (webserver, daemon, code server, run
workers, Spark JVMs) outlive a parent that is only killed by itself. So it is started in a new
session (``start_new_session=True``, its pid is the process group id), and stopped by process
group: SIGTERM, a grace period, then SIGKILL, and finally we check that no process of the
session, nor any descendant that left it, is still alive.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCATION = "checkpointed_pipelines"
REPOSITORY = "__repository__"
DAGSTER_YAML = "telemetry:\n  enabled: false\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, probe: Callable[[], object], timeout: float, interval: float = 1.0):
    """Poll ``probe`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = probe()
            if value:
                return value
        except (OSError, urllib.error.URLError, GraphQLError) as exc:
            last_error = exc
        time.sleep(interval)
    raise TimeoutError(
        f"timed out after {timeout:.0f}s waiting for {what} (last error: {last_error})"
    )


# --- processes -------------------------------------------------------------------------


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, session id, state) of every process, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name is in parentheses and may contain spaces: split after it.
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(entry)] = (int(fields[1]), int(fields[3]), fields[0])
    return table


def process_tree(root: int) -> set[int]:
    """Live (not zombie) processes of ``root``'s session and ``root``'s descendants."""
    table = _proc_table()
    found = {pid for pid, (_, sid, state) in table.items() if sid == root and state != "Z"}
    if root in table:
        found.add(root)
    frontier = set(found)
    while frontier:
        children = {
            pid for pid, (ppid, _, state) in table.items()
            if ppid in frontier and pid not in found and state != "Z"
        }  # fmt: skip
        found |= children
        frontier = children
    return found


def _alive(pid: int) -> bool:
    table = _proc_table()
    return pid in table and table[pid][2] != "Z"


def stop_process_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM the process group of ``proc`` (and stray descendants), wait, then SIGKILL;
    raise if anything we started is still alive afterwards."""
    pids = process_tree(proc.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids |= process_tree(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 10.0)
        while time.monotonic() < deadline:
            if proc.poll() is None:
                time.sleep(0.2)
                continue
            if not any(_alive(pid) for pid in pids | process_tree(proc.pid)):
                return
            time.sleep(0.2)
    left = sorted(pid for pid in pids | process_tree(proc.pid) if _alive(pid))
    if proc.poll() is None:
        left.append(proc.pid)
    if left:
        raise RuntimeError(f"processes still alive after SIGKILL: {left}")


# --- GraphQL -----------------------------------------------------------------------------


class GraphQLError(RuntimeError):
    pass


@dataclass
class DagsterDev:
    """A running ``dagster dev``: its process, port, DAGSTER_HOME and the environment of its
    code location."""

    proc: subprocess.Popen
    port: int
    home: Path
    log_path: Path
    env: dict[str, str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def graphql(self, query: str, variables: dict | None = None, timeout: float = 60) -> dict:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        request = urllib.request.Request(
            f"{self.url}/graphql", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = json.loads(response.read())
        if payload.get("errors"):
            raise GraphQLError(json.dumps(payload["errors"])[:2000])
        return payload["data"]

    # --- runs ---

    def launch_run(self, job: str, run_config: dict, tags: dict[str, str]) -> str:
        data = self.graphql(LAUNCH_RUN, {
            "executionParams": {
                "selector": {
                    "repositoryLocationName": LOCATION,
                    "repositoryName": REPOSITORY,
                    "jobName": job,
                },
                "runConfigData": run_config,
                "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in tags.items()]},
            }
        })["launchRun"]  # fmt: skip
        if data["__typename"] != "LaunchRunSuccess":
            raise GraphQLError(f"launchRun of {job} failed: {json.dumps(data)[:2000]}")
        return data["run"]["runId"]

    def run(self, run_id: str) -> dict:
        return self.graphql(RUN, {"runId": run_id})["runOrError"]

    def wait_for_run(self, run_id: str, timeout: float, statuses=("SUCCESS", "FAILURE")) -> dict:
        def finished():
            run = self.run(run_id)
            return run if run.get("status") in (*statuses, "CANCELED") else None

        try:
            return wait_for(f"run {run_id} to end", finished, timeout, interval=2)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n--- dagster dev log ---\n{self.log_tail()}") from exc

    def runs_tagged(self, key: str, value: str) -> list[dict]:
        data = self.graphql(RUNS_TAGGED, {"tags": [{"key": key, "value": value}]})
        return data["runsOrError"]["results"]

    def run_errors(self, run_id: str) -> str:
        data = self.graphql(RUN_FAILURES, {"runId": run_id})["logsForRun"]
        messages = []
        for event in data.get("events", []):
            messages.append(event.get("message") or "")
            error = event.get("error") or {}
            messages.append(error.get("message") or "")
            messages += [cause.get("message") or "" for cause in error.get("causes") or []]
        return "\n".join(m for m in messages if m)[-4000:]

    # --- assets ---

    def materializations(self, asset: str = "user_activity") -> list[dict]:
        data = self.graphql(ASSET_EVENTS, {"path": [asset]})["assetOrError"]
        return data.get("assetMaterializations", [])

    def observations(self, asset: str = "user_activity") -> list[dict]:
        data = self.graphql(ASSET_EVENTS, {"path": [asset]})["assetOrError"]
        return data.get("assetObservations", [])

    def check_executions(self, check: str, asset: str = "user_activity") -> list[dict]:
        """The check's executions, newest first: runId, status (SUCCEEDED, FAILED, SKIPPED,
        IN_PROGRESS, EXECUTION_FAILED) and the evaluation's metadata."""
        return self.graphql(CHECK_EXECUTIONS, {"path": [asset], "name": check})[
            "assetCheckExecutions"
        ]

    # --- automation ---

    def sensor_ticks(self, name: str) -> list[dict]:
        data = self.graphql(SENSOR_TICKS, {"selector": {
            "repositoryLocationName": LOCATION,
            "repositoryName": REPOSITORY,
            "sensorName": name,
        }})["sensorOrError"]  # fmt: skip
        if data["__typename"] != "Sensor":
            raise GraphQLError(json.dumps(data)[:1000])
        return data["sensorState"]["ticks"]

    def location_loaded(self) -> bool:
        entries = self.graphql(WORKSPACE)["workspaceOrError"]["locationEntries"]
        for entry in entries:
            if entry["name"] == LOCATION:
                located = entry["locationOrLoadError"] or {}
                if located.get("__typename") == "PythonError":
                    raise RuntimeError(f"code location failed to load: {located['message']}")
                return entry["loadStatus"] == "LOADED" and located.get("__typename") is not None
        return False


def metadata(event: dict) -> dict[str, object]:
    """An event's metadata entries as ``label -> value`` (a table as a list of row dicts)."""
    values = {}
    for entry in event.get("metadataEntries", []):
        if entry.get("table") is not None:
            values[entry["label"]] = [json.loads(r) for r in entry["table"]["records"]]
            continue
        for key in ("path", "text", "intValue", "floatValue"):
            if key in entry and entry[key] is not None:
                values[entry["label"]] = entry[key]
                break
    return values


def metadata_from_run(event: dict, run_id: str) -> bool:
    return event.get("runId") == run_id


def start_dagster_dev(
    home: Path,
    env: dict[str, str],
    log_path: Path,
    dagster_yaml: str | None = DAGSTER_YAML,
    workspace: Path | str = "workspace.yaml",
) -> DagsterDev:
    """``dagster dev -w <workspace>`` (default: the project's) on 127.0.0.1 in its own session,
    with ``home`` as DAGSTER_HOME (``dagster_yaml``, default: telemetry off; None: keep the one
    in ``home``); returns once the code location (named ``LOCATION``) is loaded."""
    home.mkdir(parents=True, exist_ok=True)
    if dagster_yaml is not None:
        (home / "dagster.yaml").write_text(dagster_yaml)
    port = free_port()
    full_env = os.environ | env | {"DAGSTER_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    dagster = Path(sys.executable).with_name("dagster")
    log = open(log_path, "wb")  # noqa: SIM115  (kept open for the process's lifetime)
    proc = subprocess.Popen(
        [str(dagster), "dev", "-h", "127.0.0.1", "-p", str(port), "-w", str(workspace)],
        cwd=ROOT,
        env=full_env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    dev = DagsterDev(proc, port, home, log_path, full_env)
    try:

        def ready():
            if proc.poll() is not None:
                raise RuntimeError(f"dagster dev exited with {proc.returncode}")
            return dev.location_loaded()

        wait_for("dagster dev to load the code location", ready, timeout=180, interval=1)
    except BaseException as exc:
        tail = dev.log_tail()
        stop_process_group(proc)
        raise RuntimeError(f"{exc}\n--- dagster dev log ---\n{tail}") from exc
    return dev


# --- queries -----------------------------------------------------------------------------

LAUNCH_RUN = """
mutation($executionParams: ExecutionParams!) {
  launchRun(executionParams: $executionParams) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message stack }
    ... on RunConfigValidationInvalid { errors { message } }
    ... on InvalidSubsetError { message }
    ... on PipelineNotFoundError { message }
    ... on RunConflict { message }
  }
}
"""

RUN = """
query($runId: ID!) {
  runOrError(runId: $runId) {
    __typename
    ... on Run { runId status jobName tags { key value } }
  }
}
"""

RUNS_TAGGED = """
query($tags: [ExecutionTag!]) {
  runsOrError(filter: {tags: $tags}) {
    ... on Runs { results { runId status jobName tags { key value } } }
  }
}
"""

RUN_FAILURES = """
query($runId: ID!) {
  logsForRun(runId: $runId) {
    ... on EventConnection {
      events {
        __typename
        ... on MessageEvent { message }
        ... on ExecutionStepFailureEvent { error { message causes { message } } }
      }
    }
  }
}
"""

METADATA_FIELDS = """
metadataEntries {
  label
  ... on PathMetadataEntry { path }
  ... on TextMetadataEntry { text }
  ... on IntMetadataEntry { intValue }
  ... on FloatMetadataEntry { floatValue }
  ... on TableMetadataEntry { table { records } }
}
"""

ASSET_EVENTS = f"""
query($path: [String!]!) {{
  assetOrError(assetKey: {{path: $path}}) {{
    __typename
    ... on Asset {{
      assetMaterializations(limit: 100) {{ runId partition timestamp {METADATA_FIELDS} }}
      assetObservations(limit: 100) {{ runId partition timestamp {METADATA_FIELDS} }}
    }}
  }}
}}
"""

CHECK_EXECUTIONS = f"""
query($path: [String!]!, $name: String!) {{
  assetCheckExecutions(assetKey: {{path: $path}}, checkName: $name, limit: 20) {{
    runId status
    evaluation {{ success {METADATA_FIELDS} }}
  }}
}}
"""

SENSOR_TICKS = """
query($selector: SensorSelector!) {
  sensorOrError(sensorSelector: $selector) {
    __typename
    ... on Sensor { sensorState { status ticks(limit: 5) { status timestamp skipReason } } }
  }
}
"""

WORKSPACE = """
query {
  workspaceOrError {
    ... on Workspace {
      locationEntries {
        name
        loadStatus
        locationOrLoadError { __typename ... on PythonError { message } }
      }
    }
  }
}
"""

LAUNCH_BACKFILL = """
mutation($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message stack }
    ... on PartitionSetNotFoundError { message }
    ... on InvalidStepError { invalidStepKey }
    ... on InvalidOutputError { invalidOutputName }
    ... on UnauthorizedError { message }
  }
}
"""

BACKFILL = """
query($id: String!) {
  partitionBackfillOrError(backfillId: $id) {
    __typename
    ... on PartitionBackfill {
      id status
      runs { runId status tags { key value } }
      error { message }
    }
    ... on PythonError { message }
  }
}
"""
