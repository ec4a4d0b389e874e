"""Well-known master state names: a convention between the code that writes checkpoints and
the tools that read them.

The library stores master states (``CheckpointMetadata.master_states``) as opaque bytes and
depends on none of these names. A writer that follows the convention makes its checkpoints
readable by any tool: the ``checkpoints`` command shows them decoded (``list``: the job's name
and each checkpoint's source position; ``inspect``: every master state).
"""

__all__ = [
    "JOB_NAME_STATE",
    "SOURCE_POSITION_STATE",
    "STATE_FORMAT_PREFIX",
    "STATE_SCHEMA_PREFIX",
    "STATISTICS_STATE",
    "json_object_state",
]

import json

JOB_NAME_STATE = "pipeline-name"
"""UTF-8 text: the name of the job (pipeline) that wrote the checkpoint."""

SOURCE_POSITION_STATE = "source-position"
"""A JSON object: how far the job's input has been applied to the state,
``{"partition": str, "batches": int, "complete": bool, "digest": str}`` (``digest``
optional): the first ``batches`` batches of ``partition``, all of them once ``complete``."""

STATE_SCHEMA_PREFIX = "state-schema/"
"""``state-schema/<stage>``: the Arrow schema of a stage's state, as the bytes of
``pyarrow.Schema.serialize()`` (an Arrow IPC schema message)."""

STATE_FORMAT_PREFIX = "state-format/"
"""``state-format/<stage>``: UTF-8 text naming how a stage's state is stored (absent: the
writer's default), so that a reader picks the right decoder."""

STATISTICS_STATE = "checkpoint-statistics"
"""A JSON object: the checkpoint's statistics (bytes written against referenced, files new
and reused, rows, durations; per stage and in total), as ``compute_checkpoint_statistics``
makes them. Absent in checkpoints written before it: ``checkpoint_statistics`` derives what
the handles tell."""


def json_object_state(data: bytes | None, required: set[str] = frozenset()) -> dict | None:
    """A master state that holds a JSON object (``SOURCE_POSITION_STATE``,
    ``STATISTICS_STATE``) decoded; None when absent, not JSON or not an object with the
    ``required`` keys: a tool shows what it cannot read as unknown rather than failing."""
    if data is None:
        return None
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(value, dict) or not required <= set(value):
        return None
    return value
