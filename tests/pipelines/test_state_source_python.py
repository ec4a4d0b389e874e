"""``register_checkpoint_source`` in a plain PySpark session whose workers would run another
Python (issue 29): a local session that names none gets the driver's interpreter for its
workers and reads the state; workers named by ``PYSPARK_PYTHON`` that cannot import the
source fail at registration with what to set, not with ``No module named 'pyarrow'``.

The other Python is a bare virtualenv (no pyarrow, no pyspark) of the same interpreter; each
session is a subprocess (one SparkContext per process), both run at once.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pipelines.support import small_click_events_checkpoint

DAY = "2026-10-01"
READ = """
import sys
from pyspark.sql import SparkSession
from pipelines import register_checkpoint_source

spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
try:
    register_checkpoint_source(spark)
except RuntimeError as exc:
    print("refused:", exc)
    sys.exit(3)
state = spark.read.format("checkpoint").option("stage", "user_activity").load(sys.argv[1])
print("rows:", state.count())
"""


@pytest.fixture(scope="module")
def pointer(spark, tmp_path_factory) -> str:
    return small_click_events_checkpoint(spark, tmp_path_factory.mktemp("state-source-python"), DAY)


@pytest.mark.timeout(600)
def test_plain_session_reads_or_says_what_to_set(pointer, tmp_path):
    bare = tmp_path / "bare"
    base = Path(sys.base_prefix) / "bin" / "python3"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(bare)], check=True)
    bare_python = str(bare / "bin" / "python3")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}  # fmt: skip
    # Nothing set: PySpark would start `python3` from the PATH, here the bare one.
    unset = env | {"PATH": f"{bare / 'bin'}{os.pathsep}{env['PATH']}"}
    named = env | {"PYSPARK_PYTHON": bare_python}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", READ, pointer], env=e, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        for e in (unset, named)
    ]
    (out_unset, _), (out_named, _) = (run.communicate(timeout=540) for run in runs)
    assert 0 == runs[0].returncode, out_unset
    assert "rows: 5" in out_unset.splitlines()
    assert 3 == runs[1].returncode, out_named
    refused = next(line for line in out_named.splitlines() if line.startswith("refused:"))
    # The bare Python has none of the packages the source needs (this one, pyarrow, fsspec):
    # which it misses first depends on how this package reaches the workers (PYTHONPATH or not
    # at all) and on the order of imports.
    assert re.search(rf"which run '{re.escape(bare_python)}' and cannot import it "
                     r"\(ModuleNotFoundError: No module named '[\w.]+'\)", refused), refused
    assert "Set PYSPARK_PYTHON, before the session starts, to a Python that has " in refused
    assert f"this driver runs {sys.executable}." in refused
