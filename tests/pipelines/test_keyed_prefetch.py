"""prefetch_local_stores on real Spark (local[2]): local stores rebuilt on the driver ahead
of a restart are used by its first batch when they hold the restored checkpoint's chains,
and never otherwise (another checkpoint's, a prefetch cut short, a chain that does not
read)."""

import sys

import pytest
from pyspark import cloudpickle

from checkpoint_storage import FileSystemCheckpointStorage
from pipelines import FullSnapshotPolicy, StatefulRunner, prefetch_local_stores
from pipelines.keyed._store import ArrowKeyedStateStore
from pipelines.keyed._store_directory import stored_version
from tests.pipelines.support import expected, state_of, storage_of, totals_pipeline

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _pipeline(tmp_path):
    # no full snapshot within the test: the first batch of a restart applies to the chain
    return totals_pipeline(tmp_path, full_snapshot=FullSnapshotPolicy(every=100))


def _restart(spark, tmp_path, pipeline, local: str, partition: str) -> list[str]:
    """A new runner on ``local`` processing ``partition``; its progress lines."""
    runner = StatefulRunner(spark, storage_of(tmp_path), pipeline,
                            keyed_local_dir=str(tmp_path / local))
    lines = []
    runner.run([partition], on_progress=lines.append)
    assert expected(["p1", partition]) == state_of(runner)
    return lines


def _rebuilt(lines: list[str]) -> list[str]:
    return [line for line in lines if "rebuilt" in line and "totals:" in line]


@pytest.mark.timeout(300)
def test_stores_prefetched_for_the_restored_checkpoint_are_used(spark, tmp_path):
    """After p1, a prefetch into an empty local directory builds both ranges' stores; a
    restart on that directory runs p2 without rebuilding any, and the state is exact."""
    pipeline = _pipeline(tmp_path)
    StatefulRunner(spark, storage_of(tmp_path), pipeline,
                   keyed_local_dir=str(tmp_path / "run")).run(["p1"])

    prefetch = prefetch_local_stores(storage_of(tmp_path), pipeline,
                                     local_dir=str(tmp_path / "restart"))
    outcomes = prefetch.wait(timeout=120)

    assert ["built", "built"] == [p.outcome for p in outcomes]
    assert all(p.directory.is_relative_to(tmp_path / "restart") for p in outcomes)
    assert [] == _rebuilt(_restart(spark, tmp_path, pipeline, "restart", "p2"))


@pytest.mark.timeout(300)
def test_a_store_prefetched_for_another_checkpoint_is_rebuilt_not_used(spark, tmp_path):
    """Stores prefetched after p1, then p2 committed by a runner elsewhere: a restart on the
    prefetched directory for p3 finds stores of an older checkpoint and rebuilds them."""
    pipeline = _pipeline(tmp_path)
    StatefulRunner(spark, storage_of(tmp_path), pipeline,
                   keyed_local_dir=str(tmp_path / "run")).run(["p1"])
    prefetch_local_stores(storage_of(tmp_path), pipeline,
                          local_dir=str(tmp_path / "restart")).wait(timeout=120)
    StatefulRunner(spark, storage_of(tmp_path), pipeline,
                   keyed_local_dir=str(tmp_path / "run")).run(["p2"])

    runner = StatefulRunner(spark, storage_of(tmp_path), pipeline,
                            keyed_local_dir=str(tmp_path / "restart"))
    lines = []
    runner.run(["p3"], on_progress=lines.append)

    assert expected(["p1", "p2", "p3"]) == state_of(runner)
    assert "totals: rebuilt 2 local store(s) from the checkpoint" in _rebuilt(lines)[0]


@pytest.mark.timeout(300)
def test_a_prefetch_cut_short_leaves_no_store_that_is_used(spark, tmp_path, monkeypatch):
    """A prefetch that dies before a store's manifest names the checkpoint's version (the
    manifest is written last; here it fails there) reports it, and the restart rebuilds both
    stores instead of using what was left."""
    pipeline = _pipeline(tmp_path)
    StatefulRunner(spark, storage_of(tmp_path), pipeline,
                   keyed_local_dir=str(tmp_path / "run")).run(["p1"])
    write_manifest = ArrowKeyedStateStore._write_manifest

    def crash_before_the_version(store):
        if store._version is not None:
            raise OSError("injected: the driver died before the manifest was replaced")
        write_manifest(store)

    # the driver's process only: the restart's tasks run in Spark's Python workers
    monkeypatch.setattr(ArrowKeyedStateStore, "_write_manifest", crash_before_the_version)
    outcomes = prefetch_local_stores(storage_of(tmp_path), pipeline,
                                     local_dir=str(tmp_path / "restart")).wait(timeout=120)
    monkeypatch.undo()

    assert ["failed", "failed"] == [p.outcome for p in outcomes]
    assert all("injected" in p.error for p in outcomes)
    assert all(p.directory.exists() and stored_version(p.directory) is None for p in outcomes)
    assert "totals: rebuilt 2 local store(s) from the checkpoint" in _rebuilt(
        _restart(spark, tmp_path, pipeline, "restart", "p2"))[0]


@pytest.mark.timeout(300)
def test_a_chain_that_does_not_read_leaves_the_local_store_as_it_was(spark, tmp_path):
    """A change file of the checkpoint truncated: the prefetch of its range fails naming the
    file and leaves the range's existing store (an older state) untouched: nothing is
    removed for state that cannot be read."""
    pipeline = _pipeline(tmp_path)
    runner = StatefulRunner(spark, storage_of(tmp_path), pipeline,
                            keyed_local_dir=str(tmp_path / "run"))
    runner.run(["p1"])
    before = prefetch_local_stores(storage_of(tmp_path), pipeline,
                                   local_dir=str(tmp_path / "restart")).wait(timeout=120)
    versions = {p.directory: stored_version(p.directory) for p in before}
    runner.run(["p2"])
    chains = runner._kinds["totals"].restore(
        runner.store.all()[-1].metadata).chains  # the chains of p2's checkpoint
    damaged = chains[0].changes[-1]
    with open(damaged.path, "r+b") as file:
        file.truncate(damaged.state_size // 2)

    after = prefetch_local_stores(storage_of(tmp_path), pipeline,
                                  local_dir=str(tmp_path / "restart")).wait(timeout=120)

    assert ["failed", "built"] == [p.outcome for p in after]
    assert damaged.path in after[0].error
    assert versions[after[0].directory] == stored_version(after[0].directory)


@pytest.mark.timeout(300)
def test_stores_that_hold_the_checkpoint_already_are_left_as_they_are(spark, tmp_path):
    """On the directory of the run that wrote the checkpoint, the stores the tasks left hold
    its chains: the prefetch finds them where the tasks keep them and rewrites nothing."""
    pipeline = _pipeline(tmp_path)
    StatefulRunner(spark, storage_of(tmp_path), pipeline,
                   keyed_local_dir=str(tmp_path / "local")).run(["p1"])
    stores = sorted(p for p in (tmp_path / "local").glob("pipelines-keyed/*/totals/*")
                    if p.is_dir())
    manifests = [(p / "MANIFEST.json").stat().st_mtime_ns for p in stores]

    outcomes = prefetch_local_stores(storage_of(tmp_path), pipeline,
                                     local_dir=str(tmp_path / "local")).wait(timeout=120)

    assert ["present", "present"] == [p.outcome for p in outcomes]
    assert stores == [p.directory for p in outcomes]
    assert manifests == [(p / "MANIFEST.json").stat().st_mtime_ns for p in stores]


def test_without_a_checkpoint_there_is_nothing_to_prefetch(tmp_path):
    prefetch = prefetch_local_stores(storage_of(tmp_path), _pipeline(tmp_path),
                                     local_dir=str(tmp_path / "local"))

    assert [] == prefetch.wait(timeout=60)
    assert (None, None) == (prefetch.checkpoint, prefetch.error)
    assert not (tmp_path / "local").exists()


class _UnreachableStorage(FileSystemCheckpointStorage):
    """Real storage whose job directory cannot be listed (e.g. the network is down)."""

    def create_checkpoint_storage(self, job_id):
        raise OSError("injected: the checkpoint directory cannot be listed")


@pytest.mark.timeout(60)
def test_a_checkpoint_that_cannot_be_read_is_left_to_the_runner(tmp_path):
    """The caller (the Dagster asset, before its SparkSession) never fails for a prefetch:
    the error is kept and logged, and the runner meets it (and reports it) itself."""
    prefetch = prefetch_local_stores(_UnreachableStorage(str(tmp_path / "checkpoints")),
                                     _pipeline(tmp_path), local_dir=str(tmp_path / "local"))

    assert [] == prefetch.wait(timeout=60)
    assert "injected" in prefetch.error


def _resident_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


@pytest.mark.timeout(60)
def test_the_ranges_are_built_one_after_another(tmp_path):
    """Two ranges' rebuilds never run at once (their peaks would add up): a job that waits
    up to 5 s for the other to start sees it only after it ended."""
    import threading

    from pipelines.local_recovery import LocalStorePrefetch

    running, seen = [], []
    other_started = threading.Event()

    def job(name):
        def build():
            running.append(name)
            seen.append(len(running))
            if len(running) == 1:
                other_started.wait(5)  # the other range, if it runs at the same time
            else:
                other_started.set()
            running.remove(name)
            return name
        return build

    prefetch = LocalStorePrefetch(lambda: ("checkpoint", [job("a"), job("b")]))

    assert ["a", "b"] == prefetch.wait(timeout=30)
    assert [1, 1] == seen


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_memory_the_rebuilds_freed_is_handed_back(tmp_path):
    """The driver rebuilds no more stores once the prefetch ended: what its rebuilds
    allocated (here 400 MiB of Arrow buffers in 1 MiB pieces, freed) is returned to the
    operating system, not kept by Arrow's allocator for the rest of the run."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from pipelines.local_recovery import LocalStorePrefetch

    def rebuild():
        ones = pa.array(np.ones(1 << 17))
        pieces = [pc.add(ones, i) for i in range(400)]  # 1 MiB each, in Arrow's pool
        del pieces
        return "built"

    before = _resident_mib()
    prefetch = LocalStorePrefetch(lambda: ("checkpoint", [rebuild, rebuild]))

    assert ["built", "built"] == prefetch.wait(timeout=30)
    assert _resident_mib() - before < 100
