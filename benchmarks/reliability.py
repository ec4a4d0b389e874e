"""The reliability suite's long run (issue 7): one line per scenario with trials, failures
and a figure.

Usage::

    .venv/bin/python benchmarks/reliability.py [--trials 200] [--only NAME ...]

Scenarios come from ``tests/reliability/scenarios_*.py``: each module lists them in
``SCENARIOS`` (name -> function), or else every public function named ``scenario_*`` is
one. A scenario function takes the trial count and returns ``(trials, failures, figure)``;
it may run fewer or more trials than asked when its unit of work differs (e.g. one Spark
run kills several task attempts), and says so in its figure. A module that is missing or
fails to import is skipped with a printed note, so the runner works whatever has landed.

Exit status: 0 when every scenario ran without failures, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIO_DIR = ROOT / "tests" / "reliability"
KNOWN_MODULES = ("scenarios_crash", "scenarios_fs", "scenarios_net")


def _load(name: str):
    path = SCENARIO_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def discover() -> tuple[list[tuple[str, str, object]], list[str]]:
    """(module, scenario name, function) of every scenario found, and notes on skipped
    modules."""
    for path in (ROOT, SCENARIO_DIR):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    names = list(KNOWN_MODULES) + sorted(
        p.stem for p in SCENARIO_DIR.glob("scenarios_*.py") if p.stem not in KNOWN_MODULES
    )
    scenarios, notes = [], []
    for name in names:
        if not (SCENARIO_DIR / f"{name}.py").exists():
            notes.append(f"note: {name}.py not present, skipped")
            continue
        try:
            module = _load(name)
        except Exception as exc:  # noqa: BLE001 - another helper's module: note it, go on
            notes.append(f"note: {name}.py failed to import ({type(exc).__name__}: {exc}), skipped")
            continue
        table = getattr(module, "SCENARIOS", None)
        if table is None:
            table = {
                attr.removeprefix("scenario_"): getattr(module, attr)
                for attr in sorted(dir(module))
                if attr.startswith("scenario_") and callable(getattr(module, attr))
            }
        if not table:
            notes.append(f"note: {name}.py defines no scenarios, skipped")
        scenarios += [(name, scenario, function) for scenario, function in dict(table).items()]
    return scenarios, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200, help="trials per scenario")
    parser.add_argument("--only", nargs="*", default=None, help="scenario names to run")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error("--trials must be >= 1")
    for name, value in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ.setdefault(name, value)  # moto's test credentials, never real ones
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    logging.getLogger("checkpoint_storage").setLevel(logging.ERROR)

    scenarios, notes = discover()
    for note in notes:
        print(note, flush=True)
    all_ok = True
    for module, scenario, function in scenarios:
        if args.only and scenario not in args.only:
            continue
        started = time.monotonic()
        try:
            trials, failures, figure = function(args.trials)
        except Exception as exc:  # noqa: BLE001 - a crashed scenario is a failed one
            traceback.print_exc()
            trials, failures, figure = 0, 1, f"scenario raised {type(exc).__name__}: {exc}"
        seconds = time.monotonic() - started
        all_ok &= failures == 0
        print(
            f"{module}.{scenario}: trials={trials} failures={failures} "
            f"figure: {figure} ({seconds:.0f} s)",
            flush=True,
        )
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
