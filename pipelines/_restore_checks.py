"""What a restore checks before any Spark work: that a snapshot exists, fits the partition to
run and may be claimed, and which stages' state files do not verify; with the errors that say
what to do instead."""

from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa

from checkpoint_storage import (
    CheckpointMetadata,
    CheckpointNotFoundError,
    CheckpointStorage,
    InvalidCheckpointError,
    RestoreMode,
    VerificationProblem,
)
from checkpoint_storage.spi import (
    STATE_SCHEMA_PREFIX,
    CompletedCheckpointStorageLocation,
    StreamStateHandle,
)
from pipelines._positions import SourcePosition, job_id_for
from pipelines._spec import PartitionOrder, StatefulPipeline

__all__ = [
    "ClaimRefusedError",
    "CorruptStateError",
    "DamagedState",
    "MissingStateError",
    "NonRestoredStateError",
    "check_claim",
    "check_non_restored_state",
    "check_restore_from",
    "damaged_state",
    "evolved_keyed_stages",
]


class MissingStateError(LookupError):
    """No snapshot holds the state a partition needs to start from."""


class ClaimRefusedError(ValueError):
    """A CLAIM restore of a checkpoint that lies outside the pipeline's own job directory."""


def check_claim(
    access, location: CompletedCheckpointStorageLocation, metadata: CheckpointMetadata,
    mode: RestoreMode,
) -> None:
    """Refuse (``ClaimRefusedError``) a CLAIM of a checkpoint outside ``access``'s job
    directory. CLAIM hands the snapshot to this job's retention, which deletes it and its
    shared files once subsumed: state that the job owning that directory still lists and
    references (its retained checkpoints, later increments), and which this job's
    checkpoints could not reference (their paths must stay inside this job directory). A
    savepoint is self-contained and owned by no job: it may be claimed from anywhere."""
    if RestoreMode(mode) is not RestoreMode.CLAIM or metadata.properties.is_savepoint():
        return
    pointer = location.external_pointer.rstrip("/")
    own = (access.checkpoints_directory or "").rstrip("/")
    if own and pointer.rsplit("/", 1)[0] == own:
        return
    raise ClaimRefusedError(
        f"restore_from {pointer} in CLAIM mode: the checkpoint is not in this pipeline's job "
        f"directory {own or '(none configured)'}, so it belongs to another job (another "
        "pipeline, or another checkpoint directory), whose checkpoints may still reference its "
        "files; claiming it would let this pipeline's retention delete them. Nothing was run: "
        "use NO_CLAIM (restore_mode RestoreMode.NO_CLAIM), which copies the state into this "
        "pipeline's own checkpoints and never deletes the snapshot"
    )


class NonRestoredStateError(ValueError):
    """A snapshot holds the state of stages the pipeline no longer has, and the restore does
    not allow leaving it behind (Flink's ``allowNonRestoredState``)."""


def check_non_restored_state(metadata: CheckpointMetadata, pipeline: StatefulPipeline,
                             pointer: str, allow: bool) -> list[str]:
    """The stages of the snapshot at ``pointer`` that ``pipeline`` no longer has: refused
    (``NonRestoredStateError``) unless ``allow``, when their state is left behind."""
    names = {stage.name for stage in pipeline.stages}
    gone = sorted(op.operator_id for op in metadata.operator_states
                  if op.operator_id not in names)
    if gone and not allow:
        raise NonRestoredStateError(
            f"{pointer} holds the state of stage(s) {gone}, which pipeline {pipeline.name} no "
            f"longer has (its stages: {sorted(names)}). Nothing was run. Restore with "
            "allow_non_restored_state=True to leave that state behind (the next checkpoints "
            "no longer hold it), or add the stage(s) back")
    return gone


def evolved_keyed_stages(metadata: CheckpointMetadata, pipeline: StatefulPipeline) -> list[str]:
    """The keyed stages whose state schema in ``metadata`` is not the stage's (their files
    are converted as they are read)."""
    evolved = []
    for stage in pipeline.keyed_stages:
        stored = metadata.master_states.get(STATE_SCHEMA_PREFIX + stage.name)
        if stored is not None and not pa.ipc.read_schema(pa.py_buffer(stored)).equals(
                stage.state_schema, check_metadata=False):
            evolved.append(stage.name)
    return evolved


class CorruptStateError(MissingStateError):
    """A snapshot's state files do not verify (corrupt, missing or unreadable) and no verified
    copy of that state is at hand: the message names the files and the way out."""


@dataclass(frozen=True)
class DamagedState:
    """The state of one stage's subtask whose files do not verify: a keyed stage's key group
    range (``key_groups``, e.g. "0-7"; its operator index is ``subtask``), or a DataFrame
    stage's snapshot part (``key_groups`` None)."""

    stage: str
    subtask: int
    key_groups: str | None
    problems: tuple[VerificationProblem, ...]

    @property
    def keyed(self) -> bool:
        return self.key_groups is not None

    def __str__(self) -> str:
        where = (f"stage {self.stage} key groups {self.key_groups}" if self.keyed
                 else f"stage {self.stage} subtask {self.subtask}")
        return f"{where}: " + "; ".join(f"{p.path} ({p.kind})" for p in self.problems)


def _handle_key(handle: StreamStateHandle) -> tuple:
    """What identifies a handle's bytes across checkpoints (as verification reads them once)."""
    return (type(handle).__name__, getattr(handle, "path", None),
            getattr(handle, "start_position", None), handle.state_size,
            getattr(handle, "checksum", None))


def damaged_state(
    metadata: CheckpointMetadata, problems: Sequence[VerificationProblem]
) -> list[DamagedState]:
    """Which stages' subtasks (keyed ranges) of ``metadata`` hold the handles of ``problems``
    (from ``verify_checkpoint`` or ``verify_state_handles``)."""
    by_key = {_handle_key(p.handle): p for p in problems if p.handle is not None}
    damaged = []
    for operator in metadata.operator_states:
        for subtask, state in sorted(operator.subtask_states.items()):
            found = tuple(by_key[_handle_key(h)] for h in state.handles
                          if _handle_key(h) in by_key)
            if found:
                damaged.append(DamagedState(operator.operator_id, subtask,
                                            state.properties.get("keyed.key_groups"), found))
    return damaged


def _starts_after(order: PartitionOrder, partition: str) -> str:
    previous = order.previous(partition)
    return "empty state" if previous is None else f"the end of {previous}"


def _does_not_fit_message(
    pointer: str, position: SourcePosition, partition: str, order: PartitionOrder
) -> str:
    return (
        f"{pointer} holds the state at {position}, but processing {partition} starts from "
        f"{_starts_after(order, partition)} (or from within {partition}): choose a snapshot "
        "that fits, or a range that starts right after it"
    )


def check_restore_from(
    storage: CheckpointStorage, pointer: str, partition: str, pipeline: StatefulPipeline,
    mode: RestoreMode | str = RestoreMode.NO_CLAIM, *, allow_non_restored_state: bool = False,
) -> SourcePosition:
    """The position ``pointer`` (a checkpoint or savepoint) holds, once it is known to exist,
    to validate and to fit ``partition``; ``MissingStateError`` with a clear message
    otherwise, ``ClaimRefusedError`` for a CLAIM (``mode``) that ``check_claim`` refuses,
    ``NonRestoredStateError`` for state of stages the pipeline no longer has (unless
    ``allow_non_restored_state``).
    Storage only (reads one `_metadata`): run it before any Spark work."""
    partition = pipeline.order.check(partition)
    access = storage.create_checkpoint_storage(job_id_for(pipeline.name))
    try:
        location = access.resolve_checkpoint(pointer)
        metadata = location.load_metadata()
        position = SourcePosition.of(metadata)
    except CheckpointNotFoundError as exc:
        raise MissingStateError(
            f"restore_from {pointer} does not exist (no completed `_metadata` there: {exc}): "
            "name a savepoint or checkpoint directory that holds a `_metadata`, e.g. from "
            "`checkpoints list <savepoint_dir>` (scheduled ones are in <savepoint_dir>/scheduled)"
        ) from exc
    except InvalidCheckpointError as exc:
        raise MissingStateError(f"restore_from {pointer} is not a usable snapshot: {exc}") from exc
    if not position.fits(partition, pipeline.order):
        raise MissingStateError(
            _does_not_fit_message(location.external_pointer, position, partition, pipeline.order)
        )
    check_claim(access, location, metadata, RestoreMode(mode))
    check_non_restored_state(metadata, pipeline, location.external_pointer,
                             allow_non_restored_state)
    return position
