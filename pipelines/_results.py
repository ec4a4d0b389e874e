"""What the stateful runner reports and raises: a completed checkpoint's summary, a
partition's result, and the errors of a stage or of a batch list that changed."""

from dataclasses import dataclass, field

from checkpoint_storage.spi import format_size
from pipelines._positions import SourcePosition

__all__ = [
    "BatchListChangedError",
    "CheckpointSummary",
    "PartitionResult",
    "StageError",
    "error_line",
]


class BatchListChangedError(RuntimeError):
    """A partition's batch list no longer starts with the batches a checkpoint applied: some
    vanished or were reordered after the checkpoint was taken."""


class StageError(RuntimeError):
    """A stage failed on a batch, in the driver or in a Spark Python worker. Its message is one
    line: pipeline, stage, partition and batch (its number, from 1, and id), then the original
    error's own last line (``ValueError: ...``; a worker's Python exception without Spark's
    Java traces). The original, with its full traceback, is ``__cause__``; ``batch_index``
    counts from 0."""

    def __init__(self, message: str, *, pipeline: str | None = None, stage: str | None = None,
                 partition: str | None = None, batch_index: int | None = None,
                 batch_id: str | None = None) -> None:
        super().__init__(message)
        self.pipeline, self.stage, self.partition = pipeline, stage, partition
        self.batch_index, self.batch_id = batch_index, batch_id


_TRACEBACK = "Traceback (most recent call last):"
_PY4J_CALL = "An error occurred while calling "


def error_line(error: BaseException) -> str:
    """The one line that says what ``error`` is: ``Type: message`` (its first line). For an
    error of a Spark Python worker (PySpark's ``PythonException``, or a Py4J error carrying
    the worker's traceback among Java frames), the worker's own exception line."""
    text = str(error)
    if _TRACEBACK in text:
        # The last traceback is the exception raised last; its frames are indented, its
        # exception line is not.
        for line in text.rsplit(_TRACEBACK, 1)[1].splitlines()[1:]:
            if line.strip() and not line[0].isspace():
                return line.removesuffix(" SQLSTATE: 38000").strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and lines[0].startswith(_PY4J_CALL):
        # Py4J: "An error occurred while calling o42.x." then ": java.lang.Error: ..."
        return next((line.lstrip(": ") for line in lines[1:]), lines[0])
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


@dataclass(frozen=True)
class CheckpointSummary:
    """A checkpoint (or savepoint) the runner completed: its id and pointer, the position its
    state is at, its state size in bytes, the state files it wrote and the states it kept
    inline in `_metadata`, and its rows per stage."""

    checkpoint_id: int
    pointer: str
    position: SourcePosition
    savepoint: bool
    state_bytes: int
    files_written: int
    inline_states: int
    state_rows: dict[str, int]
    """Live rows per stage: a keyed stage's expired rows (kept until a full snapshot drops
    them) are in ``expired_rows``, not here."""
    expired_rows: dict[str, int | None] = field(default_factory=dict)
    """Rows per stage that the TTL had expired, not dropped yet (0 for a DataFrame stage;
    None: not known, a keyed state restored from a checkpoint that did not record it)."""
    statistics: dict | None = None
    """Its statistics (``checkpoint_storage.spi.checkpoint_statistics``): what `_metadata`
    recorded, with the `_metadata` publication's duration that only the runner knows."""


@dataclass
class PartitionResult:
    """What running one partition did: the snapshot it restored from (None: empty state),
    the batches it applied, its last checkpoint and every checkpoint it took, the rows each
    stage (and the source) handled, and how long it took in seconds."""

    partition: str
    restored_from: str | None
    batches_applied: int
    checkpoint: CheckpointSummary
    checkpoints_taken: list[CheckpointSummary] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0
    rewound: str | None = None
    """For the first partition of a run that started before the pipeline's head: "rewound
    from end of X to end of Y; the head is kept at <pointer>"."""


def _checkpoint_line(summary: CheckpointSummary) -> str:
    return (
        f"{summary.position.partition}: checkpoint {summary.checkpoint_id} at {summary.position} "
        f"({format_size(summary.state_bytes)}, {summary.files_written} files)"
    )
