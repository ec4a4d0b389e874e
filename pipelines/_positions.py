"""Source positions: how far a pipeline's input has been applied to a snapshot of its state
(``SourcePosition``, recorded in every `_metadata`), and what positions make a checkpoint worth
keeping beyond the newest ones (the head, partition ends: ``position_retention``)."""

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from checkpoint_storage import CheckpointMetadata, InvalidCheckpointError, JobID
from checkpoint_storage.spi import SOURCE_POSITION_STATE, AlsoRetained, CompletedCheckpoint
from pipelines._spec import PartitionOrder, StatefulPipeline

__all__ = [
    "SourcePosition",
    "batches_digest",
    "head_of",
    "job_id_for",
    "partition_ends",
    "position_retention",
]


def job_id_for(pipeline_name: str) -> JobID:
    """A stable job id per pipeline, so that every run of it shares one checkpoint directory
    and recovery finds the previous runs' checkpoints."""
    return JobID.from_hex(hashlib.sha256(pipeline_name.encode()).hexdigest()[:32])


def batches_digest(batches: Sequence[str]) -> str:
    """A digest of an ordered list of batch ids: a position records the one of the batches it
    applied, so a restart can tell that the list it sees now starts with the same batches."""
    return hashlib.sha256(json.dumps(list(batches)).encode()).hexdigest()[:32]


@dataclass(frozen=True, order=True)
class SourcePosition:
    """How far the input has been applied to the state: the first ``batches`` batches of
    ``partition`` (and every earlier partition); ``complete`` once all of its batches are.
    ``digest`` identifies the batches applied (``batches_digest``); positions written before
    it existed have none."""

    partition: str
    batches: int
    complete: bool
    digest: str | None = field(default=None, compare=False)

    def to_bytes(self) -> bytes:
        raw = {"partition": self.partition, "batches": self.batches, "complete": self.complete}
        if self.digest is not None:
            raw["digest"] = self.digest
        return json.dumps(raw, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "SourcePosition":
        try:
            raw = json.loads(data)
            digest = raw.get("digest")
            position = cls(
                str(raw["partition"]),
                int(raw["batches"]),
                bool(raw["complete"]),
                None if digest is None else str(digest),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidCheckpointError(f"malformed source position {data[:100]!r}") from exc
        if position.batches < 0:
            raise InvalidCheckpointError(f"malformed source position {data[:100]!r}")
        return position

    @classmethod
    def of(cls, metadata: CheckpointMetadata) -> "SourcePosition":
        data = metadata.master_states.get(SOURCE_POSITION_STATE)
        if data is None:
            raise InvalidCheckpointError(
                f"checkpoint {metadata.checkpoint_id} has no source position: it was not "
                "written by a pipeline"
            )
        return cls.from_bytes(data)

    def fits(self, partition: str, order: PartitionOrder) -> bool:
        """Whether this state is where processing ``partition`` can start: after the whole
        previous partition, or part-way into ``partition``."""
        if self.partition == partition:
            return not self.complete
        return self.complete and self.partition == order.previous(partition)

    def __str__(self) -> str:
        if self.complete:
            return f"end of {self.partition}"
        return f"{self.partition} after batch {self.batches}"


def _position_key(position: SourcePosition, order: PartitionOrder) -> tuple | None:
    """How far ``position`` is, comparable across positions (partition order, then the end
    of a partition after any batch count inside it); None for a partition the pipeline no
    longer has."""
    rank = order.rank(position.partition)
    return None if rank is None else (rank, position.complete, position.batches)


def _positioned(checkpoints: Sequence[CompletedCheckpoint], order: PartitionOrder
                ) -> list[tuple[tuple, CompletedCheckpoint]]:
    """The regular checkpoints with their position key, those of pipelines' positions only."""
    found = []
    for checkpoint in checkpoints:
        if checkpoint.is_savepoint():
            continue
        try:
            key = _position_key(SourcePosition.of(checkpoint.metadata), order)
        except InvalidCheckpointError:
            continue
        if key is not None:
            found.append((key, checkpoint))
    return found


def head_of(checkpoints: Sequence[CompletedCheckpoint], order: PartitionOrder
            ) -> CompletedCheckpoint | None:
    """The pipeline's head: the checkpoint of the furthest position (the newest of those
    there), which need not be the newest checkpoint after a rewind."""
    positioned = _positioned(checkpoints, order)
    if not positioned:
        return None
    return max(positioned, key=lambda p: (p[0], p[1].checkpoint_id))[1]


def partition_ends(checkpoints: Sequence[CompletedCheckpoint], order: PartitionOrder,
                   count: int) -> dict[str, CompletedCheckpoint]:
    """The newest checkpoint at the end of each of the last ``count`` partitions up to the
    head (the head's own partition if it is complete there), by partition; partitions with no
    such checkpoint are left out."""
    head = head_of(checkpoints, order)
    if head is None or count <= 0:
        return {}
    position = SourcePosition.of(head.metadata)
    partition = position.partition if position.complete else order.previous(position.partition)
    window = []
    while partition is not None and len(window) < count:
        window.append(partition)
        partition = order.previous(partition)
    ends: dict[str, CompletedCheckpoint] = {}
    for _, checkpoint in _positioned(checkpoints, order):
        at = SourcePosition.of(checkpoint.metadata)
        if at.complete and at.partition in window:
            newest = ends.get(at.partition)
            if newest is None or checkpoint.checkpoint_id > newest.checkpoint_id:
                ends[at.partition] = checkpoint
    return ends


def position_retention(pipeline: StatefulPipeline) -> AlsoRetained:
    """The pipeline's retention rule on top of its newest ``max_retained_checkpoints``: the
    head (a rewind writes newer ids at earlier positions, which must not subsume the only
    checkpoint of the furthest one) and the ends of its last ``retain_partition_ends``
    partitions (time travel)."""
    order, count = pipeline.order, pipeline.retain_partition_ends

    def also_retained(checkpoints: Sequence[CompletedCheckpoint]) -> set[int]:
        head = head_of(checkpoints, order)
        kept = {c.checkpoint_id for c in partition_ends(checkpoints, order, count).values()}
        return kept | ({head.checkpoint_id} if head is not None else set())

    return also_retained
