"""How fast the ``checkpoints`` command answers: start-up plus a small local job directory.

Usage::

    .venv/bin/python benchmarks/cli_startup.py [--runs N]

Runs each command ``--runs`` times (default 10) as a new process, as an operator's shell
does, and prints the median wall time, absolute and as a ratio to ``python -c pass`` (the
interpreter's own start-up on this machine): ``checkpoints --help``, ``list``, ``latest`` and
``inspect`` of a job directory with two small completed checkpoints, and shell completion
(a TAB after ``list DIR/``). Target: each under 0.3 s. Completion of ``read --stage`` (which
loads the read plugin, and with it pyspark) is printed without a target.

The command is the ``checkpoints`` script next to the interpreter (else ``python -m
checkpoint_storage.cli``), run with this checkout first on ``PYTHONPATH``. The load average is
printed with the figures: on a loaded machine every start-up is slower, the baseline too;
the CPU time (user + system) of each run, also printed, depends less on the load.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _common import targets_line

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGET_SECONDS = 0.3
JOB_ID = "c" * 32


@dataclass
class Row:
    workload: str
    median: float
    ratio: float
    cpu: float
    ok: bool | None
    backend: str = "local"


def make_job_directory(base: Path) -> Path:
    """``base/<job>`` with two completed checkpoints of one stage (a state file each and a
    pipeline name), written through the library's public API."""
    from checkpoint_storage import (
        JOB_NAME_STATE,
        CheckpointedStateScope,
        CheckpointMetadata,
        CheckpointProperties,
        FileSystemCheckpointStorage,
        JobID,
        OperatorState,
        OperatorSubtaskState,
        store_checkpoint_metadata,
    )

    storage = FileSystemCheckpointStorage(str(base), file_state_size_threshold=1024)
    access = storage.create_checkpoint_storage(JobID(JOB_ID))
    access.initialize_base_locations()
    for checkpoint_id in (1, 2):
        location = access.initialize_location_for_checkpoint(checkpoint_id)
        with location.create_checkpoint_state_output_stream(
            CheckpointedStateScope.EXCLUSIVE
        ) as out:
            out.write(os.urandom(4096))
            handle = out.close_and_get_handle()
        metadata = CheckpointMetadata(
            checkpoint_id,
            (OperatorState("dedupe", 1, 8, {0: OperatorSubtaskState((handle,))}),),
            {JOB_NAME_STATE: b"benchmark"},
            CheckpointProperties.for_checkpoint(),
            access.job_id,
            int(time.time() * 1000),
        )
        out = location.create_metadata_output_stream()
        store_checkpoint_metadata(metadata, out)
        out.close_and_finalize_checkpoint()
    return base / JOB_ID


def command() -> list[str]:
    script = Path(sys.executable).parent / "checkpoints"
    return [str(script)] if script.exists() else [sys.executable, "-m", "checkpoint_storage.cli"]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def median_seconds(argv: list[str], env: dict, runs: int) -> tuple[float, float]:
    """Median wall time and median CPU time (user + system) of ``runs`` runs of ``argv``."""
    times, cpu = [], []
    for _ in range(runs):
        cpu_before, start = _children_cpu(), time.perf_counter()
        ran = subprocess.run(argv, env=env, capture_output=True, timeout=120)
        times.append(time.perf_counter() - start)
        cpu.append(_children_cpu() - cpu_before)
        if ran.returncode != 0:
            sys.exit(f"{' '.join(argv)} exited {ran.returncode}: {ran.stderr.decode()[-500:]}")
    return statistics.median(times), statistics.median(cpu)


def completion_env(env: dict, words: str) -> dict:
    return {
        **env,
        "_CHECKPOINTS_COMPLETE": "complete_bash",
        "COMP_WORDS": words,
        "COMP_CWORD": str(len(words.split(" ")) - 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = command()
    with tempfile.TemporaryDirectory() as tmp:
        job = make_job_directory(Path(tmp) / "checkpoints")
        pointer = f"{job}/chk-2"
        baseline, baseline_cpu = median_seconds([sys.executable, "-c", "pass"], env, args.runs)
        cases = [
            ("checkpoints --help", [*cmd, "--help"], env, True),
            ("checkpoints list JOB", [*cmd, "list", str(job)], env, True),
            ("checkpoints latest JOB", [*cmd, "latest", str(job)], env, True),
            ("checkpoints inspect POINTER", [*cmd, "inspect", pointer], env, True),
            (
                "completion: list DIR/<TAB>",
                cmd,
                completion_env(env, f"checkpoints list {Path(tmp)}/checkpoints/"),
                True,
            ),
            (
                "completion: read POINTER --stage <TAB>",
                cmd,
                completion_env(env, f"checkpoints read {pointer} --stage "),
                False,
            ),
        ]
        rows = []
        for name, argv, case_env, targeted in cases:
            median, cpu = median_seconds(argv, case_env, args.runs)
            ok = median < TARGET_SECONDS if targeted else None
            rows.append(Row(name, median, median / baseline, cpu, ok))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{platform.python_implementation()} {platform.python_version()}, "
          f"{os.cpu_count()} cores, load average {load}; median of {args.runs} runs each")
    print(f"python -c pass: {baseline:.3f} s, {baseline_cpu:.3f} s CPU (the ratio's baseline)\n")
    width = max(len(r.workload) for r in rows)
    print(f"{'command':<{width}}  {'median':>8}  {'ratio':>6}  {'CPU':>8}  target (wall time)")
    for r in rows:
        verdict = "-" if r.ok is None else ("ok" if r.ok else "MISSED")
        target = "" if r.ok is None else f"< {TARGET_SECONDS} s "
        print(f"{r.workload:<{width}}  {r.median:>6.3f} s  {r.ratio:>5.1f}x  {r.cpu:>6.3f} s  "
              f"{target}{verdict}")
    print(targets_line(rows))


if __name__ == "__main__":
    main()
