"""The house rules of the code's layout: modules small enough to do one job, the runner's
surface kept when its module was split (issue 28), and Arrow's memory measured one way."""

import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("checkpoint_storage", "pipelines", "resources", "sensors")
MAX_LINES = 1000


def test_no_module_is_over_a_thousand_lines():
    """A module past 1,000 lines does several jobs: split it by job (as pipelines/runner.py
    was, into _restore, _checkpointing and _results) rather than grow it."""
    long = {
        str(path.relative_to(ROOT)): lines
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }

    assert {} == long


def test_arrow_memory_is_measured_through_the_one_pool_that_outlives_its_buffers():
    """A proxy memory pool is made in one place, ``counting_pool`` (tests/pipelines/support.py),
    which keeps every proxy for the process's life: a proxy made elsewhere was freed at its
    test's end while a buffer it allocated lived on, and the buffer's later free crashed CI's
    test process (SIGSEGV)."""
    allowed = {ROOT / "tests/pipelines/support.py", Path(__file__).resolve()}
    makers = sorted(
        str(path.relative_to(ROOT))
        for top in (*PACKAGES, "tests", "benchmarks", "scripts")
        for path in (ROOT / top).rglob("*.py")
        if path not in allowed and "proxy_memory_pool(" in path.read_text())

    assert [] == makers


# StatefulRunner's public methods, as users call them: (name, kind, default) per parameter.
RUNNER_METHODS = {
    "checkpoint": [("states", "POSITIONAL_OR_KEYWORD", None),
                   ("position", "POSITIONAL_OR_KEYWORD", None)],
    "latest_position": [],
    "newest_verified_checkpoint": [],
    "next_checkpoint_id": [],
    "restore_advice": [("damaged_pointer", "POSITIONAL_OR_KEYWORD", None),
                       ("problems", "POSITIONAL_OR_KEYWORD", None)],
    "restored_row_counts": [("metadata", "POSITIONAL_OR_KEYWORD", None),
                            ("pointer", "POSITIONAL_OR_KEYWORD", None)],
    "restore_states": [("metadata", "POSITIONAL_OR_KEYWORD", None),
                       ("parallelism", "POSITIONAL_OR_KEYWORD", "None"),
                       ("include_expired", "KEYWORD_ONLY", "False")],
    "run": [("partitions", "POSITIONAL_OR_KEYWORD", None),
            ("restore_from", "KEYWORD_ONLY", "None"),
            ("restore_mode", "KEYWORD_ONLY", "<RestoreMode.NO_CLAIM: 'NO_CLAIM'>"),
            ("on_partition_done", "KEYWORD_ONLY", "None"),
            ("on_progress", "KEYWORD_ONLY", "None"),
            ("allow_non_restored_state", "KEYWORD_ONLY", "False")],
    "savepoint": [("states", "POSITIONAL_OR_KEYWORD", None),
                  ("position", "POSITIONAL_OR_KEYWORD", None),
                  ("checkpoint_id", "POSITIONAL_OR_KEYWORD", None),
                  ("target_directory", "POSITIONAL_OR_KEYWORD", "None")],
    "take_savepoint": [("target_directory", "POSITIONAL_OR_KEYWORD", "None"),
                       ("restore_from", "KEYWORD_ONLY", "None")],
    "write_savepoint": [("rows", "POSITIONAL_OR_KEYWORD", None),
                        ("position", "POSITIONAL_OR_KEYWORD", None),
                        ("target_directory", "POSITIONAL_OR_KEYWORD", "None")],
}

# Names other modules, tests and benchmarks import from pipelines.runner beyond its __all__.
RUNNER_NAMES_BEYOND_ALL = ["error_line"]


def _parameters(function) -> list[tuple]:
    return [(p.name, p.kind.name, None if p.default is p.empty else repr(p.default))
            for p in list(inspect.signature(function).parameters.values())[1:]]


def test_the_runner_keeps_its_public_methods_and_names():
    """StatefulRunner's public methods (wherever they are defined) take the parameters they
    took before the split, its ``store`` is a property, and pipelines.runner still exports
    every name it did."""
    import pipelines.runner as runner

    methods = {name: _parameters(getattr(runner.StatefulRunner, name))
               for name in dir(runner.StatefulRunner)
               if not name.startswith("_") and name != "store"}
    missing = [name for name in [*runner.__all__, *RUNNER_NAMES_BEYOND_ALL]
               if not hasattr(runner, name)]

    assert (RUNNER_METHODS, True, []) == (
        methods, isinstance(vars(runner.StatefulRunner)["store"], property), missing)
