"""Who owns a checkpoint and when it is discarded: job statuses, retention policies and
restore modes (Flink's CheckpointRetentionPolicy, CheckpointProperties and RestoreMode)."""

import enum

__all__ = ["CheckpointRetentionPolicy", "JobStatus", "RestoreMode"]


class JobStatus(enum.Enum):
    """How a job ended, as far as its checkpoints are concerned."""

    FINISHED = "FINISHED"
    CANCELED = "CANCELED"
    FAILED = "FAILED"
    SUSPENDED = "SUSPENDED"

    def is_globally_terminal(self) -> bool:
        """A suspended job will be resumed (e.g. after a failover): it keeps everything."""
        return self is not JobStatus.SUSPENDED


class CheckpointRetentionPolicy(enum.Enum):
    """What happens to a job's retained checkpoints when the job terminates.

    Flink's discard matrix (True = discard):

    ====================================  ========  ========  =========  ======  =========
    policy                                subsumed  finished  cancelled  failed  suspended
    ====================================  ========  ========  =========  ======  =========
    NEVER_RETAIN_AFTER_TERMINATION        yes       yes       yes        yes     yes
    RETAIN_ON_FAILURE                     yes       yes       yes        no      no
    RETAIN_ON_CANCELLATION                yes       yes       no         no      no
    ====================================  ========  ========  =========  ======  =========

    Savepoints and snapshots restored in NO_CLAIM mode are owned by the user: never discarded.
    """

    NEVER_RETAIN_AFTER_TERMINATION = "NEVER_RETAIN_AFTER_TERMINATION"
    RETAIN_ON_FAILURE = "RETAIN_ON_FAILURE"
    RETAIN_ON_CANCELLATION = "RETAIN_ON_CANCELLATION"

    def discard_on_subsumed(self) -> bool:
        return True

    def discard_on(self, status: JobStatus) -> bool:
        """Whether a retained checkpoint is discarded when the job ends with ``status``."""
        return status in _DISCARDED_ON[self]


_DISCARDED_ON = {
    CheckpointRetentionPolicy.NEVER_RETAIN_AFTER_TERMINATION: frozenset(JobStatus),
    CheckpointRetentionPolicy.RETAIN_ON_FAILURE: frozenset(
        {JobStatus.FINISHED, JobStatus.CANCELED}
    ),
    CheckpointRetentionPolicy.RETAIN_ON_CANCELLATION: frozenset({JobStatus.FINISHED}),
}


class RestoreMode(enum.Enum):
    """Who owns a snapshot a job restores from.

    - ``NO_CLAIM`` (default): the snapshot stays the user's. This job never deletes its files,
      and its first checkpoint must not reference the snapshot's shared state (a full
      checkpoint).
    - ``CLAIM``: the job takes ownership and deletes the snapshot once it is subsumed.
    """

    CLAIM = "CLAIM"
    NO_CLAIM = "NO_CLAIM"

    @classmethod
    def default(cls) -> "RestoreMode":
        return cls.NO_CLAIM
