"""Local recovery ahead of a restart: the local stores of the keyed stages, brought to the
pipeline's latest checkpoint on this machine in the background, while the JVM starts
(Flink's task-local recovery, docs/design.md 7.13).

A restart's first batch finds no local store (or a stale one) and each range's task rebuilds
its store from the checkpoint chain first: at the end of a long chain that is most of the
restart after the SparkSession. When the executors share the driver's disk (a ``local[*]``
master), the driver can do that work before Spark is up: ``prefetch_local_stores`` reads the
latest completed checkpoint and rebuilds each range's store, as the task would, where the
task will look for it (``store_directory``), marked with the chains' version. A task uses a
store only when its version is the task's chains' (``chain_version``) and its files verify,
so a store built for another checkpoint (the run restored an older one, rescaled, or a
writer committed meanwhile), or cut short by a crash (the manifest naming the version is
written last), is rebuilt by the task as before, never used.
"""

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from checkpoint_storage import CheckpointMetadata, CheckpointStorage
from checkpoint_storage.spi import STATE_FORMAT_PREFIX
from pipelines._positions import job_id_for
from pipelines._restore_checks import evolved_keyed_stages
from pipelines._spec import StatefulPipeline
from pipelines.keyed._chain import CHAIN_FORMAT, chains_from_operator_state
from pipelines.keyed._key_groups import KeyGroupRange, compute_key_group_range_for_operator_index
from pipelines.keyed._layout import KeyedStateLayout
from pipelines.keyed._local_stores import prebuild_local_store, store_directory
from pipelines.keyed._memory import release_arrow_memory
from pipelines.keyed._task import chain_version
from pipelines.warm_up import hold_until

__all__ = ["LocalStorePrefetch", "PrefetchedStore", "prefetch_local_stores"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefetchedStore:
    """What the prefetch did for one range: ``outcome`` is ``"built"``, ``"present"`` (the
    store held the checkpoint's state already), ``"busy"`` (a task held it) or ``"failed"``
    (``error`` says why; the task rebuilds the store, or fails, as it would have)."""

    stage: str
    key_groups: KeyGroupRange
    directory: Path
    outcome: str
    seconds: float
    error: str | None = None


class LocalStorePrefetch:
    """A prefetch running in a daemon thread: ``wait()`` for its ``PrefetchedStore``s. Nothing
    needs to wait for it: a task that reaches a store being built waits for its lock."""

    def __init__(self, plan) -> None:
        self.checkpoint: str | None = None
        """The checkpoint whose state is prefetched (None: none, or not read yet)."""
        self.error: str | None = None
        """Why nothing was prefetched (the checkpoint could not be read; logged)."""
        self._plan = plan
        self._results: list[PrefetchedStore] = []
        # the Python workers' warm-up forks them after the ranges' rebuilds, not beside them
        self._done = threading.Event()
        hold_until(self._done)
        self._thread = threading.Thread(target=self._run, name="local-store-prefetch",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._prefetch()
        finally:
            self._done.set()

    def _prefetch(self) -> None:
        try:
            self.checkpoint, jobs = self._plan()
        except Exception as exc:  # noqa: BLE001 - the runner reads it again, and says why
            self.error = f"{type(exc).__name__}: {exc}"
            logger.warning("local stores not prefetched: %s", self.error)
            return
        if not jobs:
            return
        # One range after another, in this thread (a range's Parquet decoding still runs in
        # Arrow's threads): two ranges in two threads took twice the memory at once (2.4 GiB
        # against 1.3 GiB for two 4M-row ranges), and more CPU, not less: their first touches
        # of fresh pages contend in the kernel (5.1 s system CPU against 1.1 s), where a range
        # built after another reuses the pages the first freed. Released once all are built,
        # in this thread: Arrow's allocator keeps freed pages per thread.
        for job in jobs:
            self._results.append(job())
        # the driver rebuilds no more stores: it would hold their high-water mark through
        # the whole run (a 4M-row range: 1.1 GiB resident after its rebuild, 0.17 GiB after)
        release_arrow_memory()

    def wait(self, timeout: float | None = None) -> list[PrefetchedStore]:
        """The ranges' outcomes once the prefetch is done (``TimeoutError`` after
        ``timeout`` seconds)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the local store prefetch of {self.checkpoint} is still running")
        return list(self._results)


def prefetch_local_stores(storage: CheckpointStorage, pipeline: StatefulPipeline, *,
                          local_dir: str | None = None,
                          parallelism: int | None = None) -> LocalStorePrefetch:
    """Start rebuilding, in the background, the local stores of ``pipeline``'s keyed stages
    from its latest completed checkpoint in ``storage``, where this machine's executors look
    for them: call it before the SparkSession starts, when the executors share this machine's
    disk (a ``local[*]`` master), with the runner's ``keyed_local_dir`` as ``local_dir``. The
    ranges are those of ``parallelism`` (default: the pipeline's ``keyed_parallelism``, else
    the checkpoint's). Reads only, and never raises: a checkpoint that cannot be read is
    left to the runner (``LocalStorePrefetch.error``), a range whose chain cannot be read to
    its task (``PrefetchedStore.error``); a stage whose state schema changed is skipped (its
    files are converted in a full snapshot first)."""
    job_id = job_id_for(pipeline.name)

    def plan() -> tuple[str | None, list]:
        latest = storage.create_checkpoint_storage(job_id).latest_completed_checkpoint()
        if latest is None:
            return None, []
        return latest.external_pointer, _jobs(latest.load_metadata(), pipeline, str(job_id),
                                              local_dir, parallelism)

    return LocalStorePrefetch(plan)


def _jobs(metadata: CheckpointMetadata, pipeline: StatefulPipeline, job_id: str,
          local_dir: str | None, parallelism: int | None) -> list:
    evolved = set(evolved_keyed_stages(metadata, pipeline))
    operators = {op.operator_id: op for op in metadata.operator_states}
    jobs = []
    for stage in pipeline.keyed_stages:
        operator = operators.get(stage.name)
        recorded = metadata.master_states.get(STATE_FORMAT_PREFIX + stage.name, b"")
        if (operator is None or recorded != CHAIN_FORMAT.encode() or stage.name in evolved
                or operator.max_parallelism != pipeline.max_parallelism):
            continue  # the runner restores it otherwise, or refuses it
        chains = chains_from_operator_state(operator)
        layout = KeyedStateLayout.of(stage, pipeline.max_parallelism)
        ranges = parallelism or pipeline.keyed_parallelism or len(chains)
        for index in range(ranges):
            key_groups = compute_key_group_range_for_operator_index(
                pipeline.max_parallelism, ranges, index)
            # the chains a task of this range is shipped, in the checkpoint's order
            sources = [c for c in chains if len(c.key_groups.intersection(key_groups))]
            directory = store_directory(local_dir, job_id, stage.name,
                                        pipeline.max_parallelism, key_groups)
            jobs.append(_Prebuild(stage.name, directory, layout, key_groups, sources,
                                  chain_version(key_groups, sources)))
    return jobs


@dataclass(frozen=True)
class _Prebuild:
    stage: str
    directory: Path
    layout: KeyedStateLayout
    key_groups: KeyGroupRange
    sources: list
    version: str

    def __call__(self) -> PrefetchedStore:
        started = time.perf_counter()
        try:
            outcome, error = prebuild_local_store(self.directory, self.layout, self.key_groups,
                                                  self.sources, self.version), None
        except Exception as exc:  # noqa: BLE001 - the task meets (and reports) it again
            outcome, error = "failed", f"{type(exc).__name__}: {exc}"
            logger.warning("keyed stage %s, key groups %s: local store not prefetched (its "
                           "task rebuilds it): %s", self.stage, self.key_groups, error)
        return PrefetchedStore(self.stage, self.key_groups, self.directory, outcome,
                               time.perf_counter() - started, error)
