"""The stateful runner's checkpoints and savepoints: the pending checkpoint's id and location,
the once-per-interval preparation of keyed state, and writing a snapshot's `_metadata` (a
checkpoint, a savepoint of the latest checkpoint, one written from rows)."""

import dataclasses
import logging
import time
from collections.abc import Mapping

from pyspark.sql import DataFrame

from checkpoint_storage import CheckpointMetadata, CommitStateUnknownError
from checkpoint_storage.exceptions import CheckpointAlreadyExistsError
from checkpoint_storage.spi import (
    JOB_NAME_STATE,
    SOURCE_POSITION_STATE,
    STATISTICS_STATE,
    CheckpointProperties,
    CheckpointStorageLocation,
    CompletedCheckpoint,
    CompletedCheckpointStorageLocation,
    compute_checkpoint_statistics,
    encode_checkpoint_statistics,
    store_checkpoint_metadata,
)
from pipelines._positions import SourcePosition
from pipelines._restore_checks import MissingStateError
from pipelines._results import CheckpointSummary

__all__ = ["CheckpointWriting"]

# The runner's logger: users configure the runner's logging by this one name.
logger = logging.getLogger("pipelines.runner")


class CheckpointWriting:
    """``StatefulRunner``'s checkpoint and savepoint writing (pipelines.runner). It works on
    the runner's state: ``pipeline``, ``stages``, ``job_id``, ``access``, ``store``,
    ``_kinds``, ``_coordinate``, ``_fault``, ``_restore``, and the interval state set up in
    its ``__init__`` (``_pending``, ``_last_checkpoint_id``, ``_interval_prepared``,
    ``_full_snapshot_due``, ``_interval_started``, ``_last_publication``)."""

    def next_checkpoint_id(self) -> int:
        """Above every id this runner used or sees in storage: like Flink's counter, an id
        is never reused, not even that of a checkpoint that failed and was disposed."""
        ids = [c.checkpoint_id for c in self.store.all()]
        self._last_checkpoint_id = max(
            [*(i + 1 for i in ids), self._last_checkpoint_id + 1, self.access.next_checkpoint_id()]
        )
        return self._last_checkpoint_id

    def _pending_location(self) -> tuple[int, CheckpointStorageLocation]:
        """The id and location of the next checkpoint, allocated on first use."""
        if self._pending is None:
            self._coordinate()
            checkpoint_id = self.next_checkpoint_id()
            self._pending = (checkpoint_id,
                             self.access.initialize_location_for_checkpoint(checkpoint_id))
        return self._pending

    def _prepare_interval(self, states: dict) -> list[str]:
        """Once per checkpoint interval, before its first write: rescale keyed state to this
        runner's parallelism, and snapshot the ranges that are due (every range after a
        restore of a savepoint or a NO_CLAIM restore, so that the next checkpoint references
        no file of the restored snapshot). Returns notes on local stores rebuilt meanwhile."""
        writing = [k for k in self._kinds.values() if k.writes_between_checkpoints]
        if self._interval_prepared or not writing:
            return []
        self._pending_location()
        full = self._full_snapshot_due or self.store.requires_full_checkpoint()
        notes = []
        for kind in writing:
            states[kind.stage.name], prepared = kind.prepare(
                states[kind.stage.name], self._pending_location, full=full)
            notes += prepared
        self._interval_prepared = True
        self._full_snapshot_due = False
        return notes

    def checkpoint(
        self, states: dict[str, DataFrame], position: SourcePosition
    ) -> CheckpointSummary:
        batch_ms = (None if self._interval_started is None
                    else (time.monotonic() - self._interval_started) * 1000)
        self._prepare_interval(states)
        checkpoint_id, location = self._pending_location()
        self._pending = None
        summary, completed, metadata = self._snapshot(
            states, position, checkpoint_id, location, CheckpointProperties.for_checkpoint(),
            batch_ms,
        )
        self.store.add_checkpoint(CompletedCheckpoint(completed, metadata))
        self._interval_prepared = False
        if self._interval_started is not None:
            self._interval_started = time.monotonic()
        return summary

    def take_savepoint(
        self, target_directory: str | None = None, *, restore_from: str | None = None
    ) -> CheckpointSummary:
        """Write a self-contained savepoint of the latest completed checkpoint (or of
        ``restore_from``): the state is restored on the executors and written straight into
        the savepoint directory through the savepoint location's reference."""
        if restore_from is not None:
            source = self.access.resolve_checkpoint(restore_from)
            metadata = source.load_metadata()
        else:
            latest = self.store.latest()
            if latest is None:
                raise MissingStateError(
                    f"no completed checkpoint in {self.access.checkpoints_directory} to take a "
                    "savepoint of: run the pipeline first"
                )
            metadata = latest.metadata
        states = self._restore(metadata)
        try:
            return self.savepoint(states, SourcePosition.of(metadata), metadata.checkpoint_id,
                                  target_directory)
        finally:
            for state in states.values():
                state.unpersist()

    def write_savepoint(self, rows: Mapping[str, DataFrame], position: SourcePosition,
                        target_directory: str | None = None) -> CheckpointSummary:
        """Write a self-contained savepoint whose state is ``rows`` (per stage name; a stage
        not given holds no rows) at ``position``, like a savepoint taken of a run that built
        that state (Flink's State Processor API). Keyed stages' rows are routed by key group
        into the savepoint directory, then written as full snapshots there."""
        unknown = [name for name in rows if name not in self._kinds]
        if unknown:
            raise ValueError(f"pipeline {self.pipeline.name} has no stage(s) {unknown} (its "
                             f"stages: {[stage.name for stage in self.stages]})")
        self._coordinate()
        checkpoint_id = self.next_checkpoint_id()
        location = self.access.initialize_location_for_savepoint(checkpoint_id, target_directory)
        states = {stage.name: self._kinds[stage.name].empty() for stage in self.stages}
        try:
            try:
                for name, frame in rows.items():
                    states[name] = self._kinds[name].bootstrap(
                        frame, states[name], lambda: (checkpoint_id, location))
            except BaseException:
                location.dispose_on_failure()
                raise
            # The routed rows, superseded by the full snapshots the savepoint references.
            loaded = [handle for state in states.values()
                      for chain in getattr(state, "chains", ()) for handle in chain.changes]
            summary, _, _ = self._snapshot(
                states, position, checkpoint_id, location, CheckpointProperties.for_savepoint())
        finally:
            for state in states.values():
                state.unpersist()
        for handle in loaded:
            try:
                handle.discard_state()
            except OSError as exc:  # an unreferenced file left in the savepoint directory
                logger.warning("could not remove %s: %s", handle, exc)
        return summary

    def savepoint(
        self,
        states: dict[str, DataFrame],
        position: SourcePosition,
        checkpoint_id: int,
        target_directory: str | None = None,
    ) -> CheckpointSummary:
        self._coordinate()
        location = self.access.initialize_location_for_savepoint(checkpoint_id, target_directory)
        summary, _, _ = self._snapshot(
            states, position, checkpoint_id, location, CheckpointProperties.for_savepoint()
        )
        return summary

    def _snapshot(
        self,
        states: dict[str, DataFrame],
        position: SourcePosition,
        checkpoint_id: int,
        location: CheckpointStorageLocation,
        properties: CheckpointProperties,
        batch_ms: float | None = None,
    ) -> tuple[CheckpointSummary, CompletedCheckpointStorageLocation, CheckpointMetadata]:
        master = {
            SOURCE_POSITION_STATE: position.to_bytes(),
            JOB_NAME_STATE: self.pipeline.name.encode(),
        }
        operator_states = []
        state_rows, expired_rows, parts = {}, {}, {}
        writing = time.monotonic()
        try:
            for stage in self.stages:
                snapshot = self._kinds[stage.name].snapshot(
                    states[stage.name], checkpoint_id, location,
                    savepoint=properties.is_savepoint())
                operator_states.append(snapshot.operator_state)
                master.update(snapshot.master_states)
                state_rows[stage.name] = snapshot.rows
                expired_rows[stage.name] = snapshot.expired_rows
                parts[stage.name] = snapshot.parts
            metadata = CheckpointMetadata(
                checkpoint_id,
                tuple(operator_states),
                master,
                properties,
                self.job_id,
                int(time.time() * 1000),
            )
            # New files: those no retained checkpoint references (a savepoint's are all new).
            previous = ([] if properties.is_savepoint()
                        else [c.metadata for c in self.store.all()])
            statistics = compute_checkpoint_statistics(
                metadata, previous, stages=parts,
                durations_ms={"batch": batch_ms,
                              "state_write": (time.monotonic() - writing) * 1000},
                previous_publication=self._last_publication)
            metadata = dataclasses.replace(metadata, master_states={
                **master, STATISTICS_STATE: encode_checkpoint_statistics(statistics)})
            self._fault("before_metadata", checkpoint_id=checkpoint_id)
            publishing = time.monotonic()
            out = location.create_metadata_output_stream()
            store_checkpoint_metadata(metadata, out)
        except BaseException:
            location.dispose_on_failure()
            raise
        try:
            completed = out.close_and_finalize_checkpoint()
        except (CheckpointAlreadyExistsError, CommitStateUnknownError):
            raise  # the files may belong to a committed checkpoint: keep them
        except BaseException:
            location.dispose_on_failure()
            raise
        published_ms = round((time.monotonic() - publishing) * 1000, 1)
        self._last_publication = {"checkpoint_id": checkpoint_id, "ms": published_ms}
        statistics["durations_ms"]["metadata_publication"] = published_ms
        handles = metadata.all_handles()
        files = [h for h in handles if hasattr(h, "path")]
        summary = CheckpointSummary(
            checkpoint_id,
            completed.external_pointer,
            position,
            properties.is_savepoint(),
            metadata.state_size,
            len(files),
            len(handles) - len(files),
            state_rows,
            expired_rows,
            statistics,
        )
        logger.info("completed %s %s at %s", "savepoint" if summary.savepoint else "checkpoint",
                    summary.pointer, position)
        return summary, completed, metadata
