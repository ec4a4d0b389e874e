"""The stateful runner's restore: choosing the starting point of a run, restoring and
verifying a snapshot's states, repairing damaged keyed ranges from local stores, and the
advice on what to restore instead (retained checkpoints, savepoints)."""

import logging
import time
from collections.abc import Sequence

from pyspark.sql import DataFrame

from checkpoint_storage import (
    CheckpointMetadata,
    RestoreMode,
    VerificationProblem,
    url_to_fs,
)
from checkpoint_storage.spi import CompletedCheckpoint, format_size, verify_state_handles
from pipelines._positions import SourcePosition, batches_digest
from pipelines._restore_checks import (
    CorruptStateError,
    MissingStateError,
    _does_not_fit_message,
    _handle_key,
    check_claim,
    check_non_restored_state,
    damaged_state,
    evolved_keyed_stages,
)
from pipelines.state_reader import PipelineSnapshot, stored_row_count

__all__ = ["SCHEDULED_SAVEPOINTS", "Restoring"]

# The runner's logger: users configure the runner's logging by this one name.
logger = logging.getLogger("pipelines.runner")

# The subdirectory of the savepoint directory that scheduled savepoints go to (sensors/).
SCHEDULED_SAVEPOINTS = "scheduled"

# A snapshot whose state handles hold at most this many bytes is verified whole by replaying
# its chains in the driver (``Restoring.restored_row_counts``): one part at a time, each a
# few times its bytes in memory; a larger one by the executors.
DRIVER_REPLAY_BYTES = 32 * 2**20


class Restoring:
    """``StatefulRunner``'s restore (pipelines.runner). It works on the runner's state:
    ``pipeline``, ``stages``, ``order``, ``storage``, ``access``, ``store``, ``_kinds``,
    ``_pending_location``, and the restore state set up in its ``__init__`` (``_damaged``,
    ``_to_bootstrap``, ``_full_snapshot_due``, ``_allow_non_restored_state``,
    ``restore_verification``, ``_pending``)."""

    def restore_states(
        self, metadata: CheckpointMetadata, parallelism: int | None = None, *,
        include_expired: bool = False,
    ) -> dict[str, DataFrame]:
        """The stages' state DataFrames from a snapshot: the executors read and verify
        their handles through fsspec (inline handles carry their bytes). Any parallelism:
        one task per handle (a keyed stage: per key group range), then ``parallelism``
        partitions when given. A keyed stage's expired rows (not dropped yet) only with
        ``include_expired``."""
        return {stage.name: self._kinds[stage.name].restore_frame(
                    metadata, parallelism, include_expired=include_expired)
                for stage in self.stages}

    def restored_row_counts(self, metadata: CheckpointMetadata, pointer: str) -> dict[str, int]:
        """Each stage's rows in the snapshot at ``pointer`` (``metadata``, its `_metadata`) as
        a restore reads them, a keyed stage's expired rows not dropped yet included (what
        the snapshot records as ``rows``): every file read whole and verified (size, CRC-32),
        each keyed range's chain replayed. A state of at most ``DRIVER_REPLAY_BYTES`` is
        replayed here, in the driver, by the state reader (what ``checkpoints read`` and the
        ``checkpoint`` format run): in a fresh process a Spark restore of the click events'
        440 KiB cost four jobs and their first planning (docs/benchmarks.md, "cold_run: the
        check without Spark"). A larger one is restored by the executors (``restore_states``)."""
        if metadata.state_size > DRIVER_REPLAY_BYTES:
            states = self.restore_states(metadata, include_expired=True)
            counts = {name: state.count() for name, state in states.items()}
            for state in states.values():
                state.unpersist()
            return counts
        snapshot = PipelineSnapshot(pointer, metadata, self.storage.storage_options)
        held = set(snapshot.stages)
        counts = {}
        for stage in self.stages:
            if stage.name not in held:
                counts[stage.name] = 0  # as a restore of a stage added since: empty
                continue
            schema = snapshot.schema(stage.name)
            counts[stage.name] = sum(
                stored_row_count(part, schema, snapshot.storage_options)
                for part in snapshot.parts(stage.name))
        return counts

    def _restore(self, metadata: CheckpointMetadata, pointer: str | None = None) -> dict:
        """The stages' states from a snapshot: DataFrames read by the executors, and keyed
        stages' chains (their files are read when a task needs them), evolved into the
        stages' state schemas. A stage the snapshot lacks (added since) starts empty; one it
        has that the pipeline lacks is refused unless non-restored state is allowed."""
        pointer = pointer or f"checkpoint {metadata.checkpoint_id}"
        gone = check_non_restored_state(metadata, self.pipeline, pointer,
                                        self._allow_non_restored_state)
        if gone:
            logger.warning("pipeline %s: the state of stage(s) %s in %s is not restored "
                           "(allow_non_restored_state)", self.pipeline.name, gone, pointer)
        held = {op.operator_id for op in metadata.operator_states}
        states = {}
        for stage in self.stages:
            kind = self._kinds[stage.name]
            if stage.name in held:
                states[stage.name] = kind.restore(metadata)
            else:
                logger.info("pipeline %s: %s holds no state of stage %s (added since): it "
                            "starts %s", self.pipeline.name, pointer, stage.name,
                            "from its initial state" if stage.name in self.pipeline.initial_state
                            else "empty")
                states[stage.name] = kind.empty()
        return states

    def _restored(self, metadata: CheckpointMetadata, pointer: str) -> dict:
        """``_restore`` for a run: the stages the snapshot lacks that have an initial state
        are bootstrapped before the first batch; a stage whose state schema changed makes
        the first interval snapshot keyed state whole, so that no later checkpoint references
        a file written under the old schema."""
        states = self._restore(metadata, pointer)
        held = {op.operator_id for op in metadata.operator_states}
        self._to_bootstrap = [n for n in self.pipeline.initial_state if n not in held]
        ignored = [n for n in self.pipeline.initial_state if n in held]
        if ignored:
            logger.info("pipeline %s: initial_state of stage(s) %s ignored: %s holds their "
                        "state", self.pipeline.name, ignored, pointer)
        if evolved_keyed_stages(metadata, self.pipeline):
            self._full_snapshot_due = True
        return states

    def _starting_point(
        self, partition: str, restore_from: str | None, mode: RestoreMode
    ) -> tuple[str | None, dict[str, DataFrame], SourcePosition]:
        self._damaged = []
        self._to_bootstrap = []
        if restore_from is not None:
            location = self.access.resolve_checkpoint(restore_from)
            metadata = location.load_metadata()
            position = SourcePosition.of(metadata)
            if not position.fits(partition, self.order):
                raise MissingStateError(
                    _does_not_fit_message(location.external_pointer, position, partition,
                                          self.order)
                )
            check_claim(self.access, location, metadata, mode)
            check_non_restored_state(metadata, self.pipeline, location.external_pointer,
                                     self._allow_non_restored_state)
            self._verify_restored(location.external_pointer, metadata, partition)
            # Before the snapshot joins the store: state that does not fit is refused first.
            states = self._restored(metadata, location.external_pointer)
            checkpoint = self.store.restore(location, mode)
            # A claimed savepoint is deleted once subsumed, an unclaimed snapshot belongs to
            # someone else: keyed chains must not go on referencing their files.
            self._full_snapshot_due = (checkpoint.is_savepoint() or mode is RestoreMode.NO_CLAIM
                                       or bool(evolved_keyed_stages(metadata, self.pipeline)))
            return checkpoint.external_pointer, states, position
        for checkpoint in reversed(self.store.all()):
            position = SourcePosition.of(checkpoint.metadata)
            if position.fits(partition, self.order):
                self._verify_restored(checkpoint.external_pointer, checkpoint.metadata,
                                      partition)
                states = self._restored(checkpoint.metadata, checkpoint.external_pointer)
                return checkpoint.external_pointer, states, position
        if self.order.previous(partition) is None:
            fresh = {stage.name: self._kinds[stage.name].empty() for stage in self.stages}
            self._to_bootstrap = list(self.pipeline.initial_state)
            return None, fresh, SourcePosition(partition, 0, False, batches_digest([]))
        raise MissingStateError(self._missing_state_message(partition))

    def _verify_restored(self, pointer: str, metadata: CheckpointMetadata,
                         partition: str) -> None:
        """Read every state file of the snapshot about to be restored (size and CRC-32, on
        the driver, several at a time): a keyed range with a bad file is noted for repair from
        a local store (``_repair``); anything else bad fails here, before any Spark work,
        naming the newest retained checkpoint that verifies."""
        started = time.perf_counter()
        handles = metadata.all_handles()
        read, problems = verify_state_handles(handles)
        self.restore_verification = (len(handles), read, time.perf_counter() - started)
        logger.info("verified %d state handles (%s) of %s in %.2f s", len(handles),
                    format_size(read), pointer, self.restore_verification[2])
        self._damaged = damaged_state(metadata, problems)
        placed = {_handle_key(p.handle) for d in self._damaged for p in d.problems}
        stray = [p for p in problems if p.handle is None or _handle_key(p.handle) not in placed]
        dataframe = [d for d in self._damaged if not d.keyed]
        if stray or dataframe:
            bad = "; ".join([*map(str, dataframe), *(f"{p.path} ({p.kind})" for p in stray)])
            raise CorruptStateError(
                f"{pointer} cannot be restored: state files do not verify ({bad}). A "
                "DataFrame stage's snapshot is its only copy. "
                + self._restore_advice(partition, {_handle_key(p.handle) for p in problems
                                                   if p.handle is not None}))
        for damage in self._damaged:
            logger.warning("%s: %s does not verify; a new full snapshot of its range is written "
                           "from a local store before the first batch", pointer, damage)

    def _repair(self, states: dict, origin: str, partition: str) -> str:
        """Start new chains for the damaged keyed ranges from the local stores that hold their
        chains, before the first batch, so that no checkpoint of this run references a bad
        file; a range no local store holds fails the run with the way out."""
        _, location = self._pending_location()
        unserved = []
        for name in dict.fromkeys(d.stage for d in self._damaged):
            damaged = [d for d in self._damaged if d.stage == name]
            states[name], missing = self._kinds[name].repair(
                states[name], [d.subtask for d in damaged], self._pending_location)
            unserved += [d for d in damaged if d.subtask in missing]
        if unserved:
            # Nothing of this run is committed: the snapshots of the ranges that were served
            # are unreferenced shared files (collected as such), its directory goes now.
            location.dispose_on_failure()
            self._pending = None
            bad = {_handle_key(p.handle) for d in self._damaged for p in d.problems}
            raise CorruptStateError(
                f"{origin} cannot be restored: state files do not verify and no local store "
                "on the executors holds the state of their range to write a new full snapshot "
                f"from (a cold run, or the stores are elsewhere): {'; '.join(map(str, unserved))}. "
                + self._restore_advice(partition, bad))
        repaired = ", ".join(f"{d.stage} key groups {d.key_groups}" for d in self._damaged)
        self._damaged = []
        return (f"wrote new full snapshots of {repaired} from local stores: {origin} has state "
                "files that do not verify, which no later checkpoint references")

    def _restore_advice(self, partition: str, bad: set) -> str:
        """What to restore instead: the newest retained checkpoint whose files verify (and the
        partitions to run from it), else savepoints that fit ``partition``."""
        newest = self._newest_verified(bad)
        if newest is not None:
            pointer = newest.external_pointer
            position = SourcePosition.of(newest.metadata)
            if position.fits(partition, self.order):
                return (f"Restore the newest retained checkpoint that verifies ({position}): "
                        f"run {partition} with restore_from={pointer}")
            start = (self.order.following(position.partition) if position.complete
                     else position.partition)
            return (f"The newest retained checkpoint that verifies holds the state at "
                    f"{position}: run the partitions from {start} through {partition} with "
                    f"restore_from={pointer}")
        for pointer, metadata in sorted(self._savepoints(), key=lambda s: s[1].checkpoint_id,
                                        reverse=True):
            if verify_state_handles(metadata.all_handles())[1]:
                continue
            position = SourcePosition.of(metadata)
            start = (partition if position.fits(partition, self.order)
                     else self.order.following(position.partition) if position.complete
                     else position.partition)
            return (f"No retained checkpoint verifies; the newest savepoint that does holds "
                    f"the state at {position}: run the partitions from {start} through "
                    f"{partition} with restore_from={pointer}")
        return (f"No retained checkpoint or savepoint verifies: reprocess the partitions from "
                f"the first, {self.order.first}, through {partition} (that run starts from "
                "empty state), or restore_from a savepoint kept elsewhere and run the "
                "partitions after it")

    def _newest_verified(self, bad: set) -> CompletedCheckpoint | None:
        """The newest retained checkpoint none of whose files is in ``bad`` (handle keys) or
        fails to verify; a file shared by several checkpoints is read once."""
        bad, good = set(bad), set()
        for checkpoint in reversed(self.store.all()):
            handles = [h for h in checkpoint.metadata.all_handles()
                       if _handle_key(h) not in good]
            if any(_handle_key(h) in bad for h in handles):
                continue
            _, problems = verify_state_handles(handles)
            failed = {_handle_key(p.handle) for p in problems if p.handle is not None}
            if not problems:
                return checkpoint
            bad |= failed
            good |= {_handle_key(h) for h in handles} - failed
        return None

    def newest_verified_checkpoint(self) -> CompletedCheckpoint | None:
        """The newest retained checkpoint whose every state file verifies (reads them)."""
        return self._newest_verified(set())

    def restore_advice(self, damaged_pointer: str, problems: Sequence[VerificationProblem]
                       ) -> str:
        """What a run after the checkpoint at ``damaged_pointer`` does about ``problems`` (its
        files that do not verify), for reports such as the integrity check."""
        metadata = self.access.resolve_checkpoint(damaged_pointer).load_metadata()
        position = SourcePosition.of(metadata)
        partition = (self.order.following(position.partition) if position.complete
                     else position.partition) or position.partition
        damaged = damaged_state(metadata, problems)
        advice = self._restore_advice(partition, {_handle_key(p.handle) for p in problems
                                                  if p.handle is not None})
        if damaged and all(d.keyed for d in damaged):
            return ("The next run writes new full snapshots of "
                    + ", ".join(f"{d.stage} key groups {d.key_groups}" for d in damaged)
                    + " from local stores that hold their chains (warm executors) before its "
                    "first batch, so that no later checkpoint references these files; without "
                    f"one it fails before any batch. {advice}")
        return f"The next run from this checkpoint fails before any batch. {advice}"

    def _missing_state_message(self, partition: str) -> str:
        previous = self.order.previous(partition)
        retained = ", ".join(
            f"chk-{c.checkpoint_id} ({SourcePosition.of(c.metadata)})" for c in self.store.all()
        ) or "none"
        fitting = self._fitting_savepoints(partition)
        advice = (
            f"backfill from a savepoint with run config restore_from: {', '.join(fitting)}"
            if fitting
            else f"materialize {previous} first, or backfill from a savepoint taken at the end "
            f"of {previous} (run config restore_from)"
        )
        return (
            f"processing {partition} of pipeline {self.pipeline.name} needs the state after "
            f"{previous}, and no retained checkpoint holds it (retained: {retained}): {advice}"
        )

    def _fitting_savepoints(self, partition: str) -> list[str]:
        return [pointer for pointer, metadata in self._savepoints()
                if SourcePosition.of(metadata).fits(partition, self.order)]

    def _savepoints(self) -> list[tuple[str, CheckpointMetadata]]:
        """The pipeline's savepoints in the savepoint directory (and its scheduled/), sorted by
        pointer, with their `_metadata`; those that cannot be read are left out."""
        directory = self.storage.savepoint_directory
        if directory is None:
            return []
        fs, path = url_to_fs(directory, self.storage.storage_options)
        entries = []
        # Hand-made savepoints lie in the savepoint directory, scheduled ones in scheduled/.
        for folder in (path, f"{path.rstrip('/')}/{SCHEDULED_SAVEPOINTS}"):
            try:
                entries += fs.ls(folder, detail=False)
            except FileNotFoundError:
                continue
        found = []
        for entry in sorted(entries):
            pointer = fs.unstrip_protocol(entry) if "://" in directory else entry
            try:
                metadata = self.access.resolve_checkpoint(pointer).load_metadata()
                SourcePosition.of(metadata)
                found.append((pointer, metadata))
            except (OSError, ValueError) as exc:
                logger.debug("not a usable savepoint: %s (%s)", pointer, exc)
        return found
