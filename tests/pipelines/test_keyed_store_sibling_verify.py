"""The processes of one executor share the local store's verification (issue 28, growth): a
range's task runs in either Python worker, and each worker hashed (CRC-32) the segment the
other had just written (236 MB a range at 8M keys) in the first batches after the initial
state. The manifest now records the files its writer verified or wrote, by stat signature,
with its executor (parent process and boot id): a sibling takes them as verified while their
stat holds; another executor, a reboot, a changed file or an unhashed file is hashed.

The siblings are two subprocesses of this test process (same parent, as Spark's workers are
children of its Python daemon); each reports which files it hashed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.keyed import ArrowKeyedStateStore, _store_files, _store_verification
from tests.pipelines.support import ALL, LAYOUT, store_state

ROOT = Path(__file__).resolve().parents[2]
CLICKS = {f"user_{i}": 7_000_001 + 977 * i for i in range(200)}

# light on imports (pyarrow and the store): the test starts several of these
SIBLING = """
import datetime as dt, json, sys
from pathlib import Path
import pyarrow as pa
from pipelines.keyed import _store, _store_files, _store_verification
from pipelines.keyed._key_groups import KeyGroupRange
from pipelines.keyed._layout import KeyedStateLayout

directory, action, clicks = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
schema = pa.schema([("user", pa.string()), ("clicks", pa.int64()),
                    ("seen", pa.timestamp("us", "UTC"))])
layout, every = KeyedStateLayout(("user",), schema, 8), KeyGroupRange(0, 7)
t0 = dt.datetime(2026, 3, 10, tzinfo=dt.UTC)


def table(model):
    keys = sorted(model)
    return pa.table({"user": keys, "clicks": [model[k] for k in keys],
                     "seen": [t0 + dt.timedelta(seconds=model[k]) for k in keys]}, schema=schema)


no_keys = pa.table({"user": pa.array([], pa.string())})
hashed = []
real = _store_files._file_checksum
_store_files._file_checksum = lambda path: hashed.append(path.name.split("-")[0]) or real(path)
if action == "another-executor":  # another parent, or the same after a reboot
    # both: the store records it in the manifests it writes, the check compares with it
    _store_files._executor_identity = _store_verification._executor_identity = (
        lambda: "another-boot-id/4242/17")
try:
    store = _store.ArrowKeyedStateStore(directory, layout, every,
                                        verify=action != "unverified")
    if action == "write":
        store.load(table(clicks), version="v1")
        store.apply(table({"user_0": 5}), no_keys, version="v2")
    elif action == "unverified":
        store.apply(table({"user_1": 6}), no_keys, version="v3")
except _store.LocalStoreError as exc:
    print(json.dumps({"error": str(exc), "hashed": hashed}))
    sys.exit()
rows = store.get(pa.table({"user": sorted(clicks)})).to_pydict()
print(json.dumps({"hashed": hashed, "state": dict(zip(rows["user"], rows["clicks"])),
                  "version": store.version}))
"""


def sibling(directory: Path, action: str) -> dict:
    """Run ``action`` on the store in a new child process of this one; what it reported."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", SIBLING, str(directory), action,
                           json.dumps(CLICKS)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def written(tmp_path) -> Path:
    """A store (a segment and a run) written by a child process of this one."""
    assert sibling(tmp_path / "store", "write")["hashed"] == []
    return tmp_path / "store"


@pytest.mark.timeout(120)
def test_a_sibling_takes_the_files_its_sibling_wrote_as_verified(written):
    reopened = sibling(written, "open")

    assert reopened == {"hashed": [], "state": CLICKS | {"user_0": 5}, "version": "v2"}


@pytest.mark.timeout(120)
def test_another_executor_or_a_reboot_hashes_every_file(written):
    """A child of another parent, or of this one after a reboot (another executor identity),
    and this process (the siblings' parent, not their sibling) each hash both files."""
    assert sorted(sibling(written, "another-executor")["hashed"]) == ["run", "segment"]
    hashed = []
    real = _store_files._file_checksum
    _store_verification._VERIFIED.clear()
    try:
        _store_files._file_checksum = lambda path: (hashed.append(path.name.split("-")[0])
                                                    or real(path))
        store = ArrowKeyedStateStore(written, LAYOUT, ALL)
    finally:
        _store_files._file_checksum = real
    assert (sorted(hashed), store_state(store)) == (["run", "segment"],
                                                    CLICKS | {"user_0": 5})


@pytest.mark.timeout(120)
def test_a_file_changed_after_its_sibling_wrote_it_is_hashed_and_refused(written):
    """Damage in place (same inode and size) after the sibling's write: the stat signature
    (here its mtime, set apart explicitly: the ctime's clock is coarse) no longer matches the
    claim, so the file is hashed and refused."""
    segment = next(written.glob("segment-*.arrow"))
    data = bytearray(segment.read_bytes())
    at = data.find(CLICKS["user_7"].to_bytes(8, "little", signed=True))
    data[at] ^= 1
    before = segment.stat()
    segment.write_bytes(bytes(data))
    os.utime(segment, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))

    reopened = sibling(written, "open")

    assert reopened["hashed"] == ["segment"]
    assert f"{segment} is damaged" in reopened["error"]


@pytest.mark.timeout(120)
def test_a_file_its_writer_did_not_hash_is_not_claimed(written):
    """A sibling that opened the store without verifying (``verify=False``) and wrote to it
    claims only its own new run: the next sibling hashes the segment and the first run, not
    the new one."""
    assert sibling(written, "unverified")["hashed"] == []
    assert len(list(written.glob("run-*.arrow"))) == 2

    reopened = sibling(written, "open")

    assert sorted(reopened["hashed"]) == ["run", "segment"]
    assert reopened["state"] == CLICKS | {"user_0": 5, "user_1": 6}
