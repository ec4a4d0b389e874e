"""A keyed batch's task, sent to its ranges' Spark tasks as a local property of the job rather
than in the UDF's closure (issue 28, the steady batch's wall; docs/design.md 7.18).

In the closure, the task (it changes every batch: chains, checkpoint id, clock) made the
ranges' UDF new every batch, 30-45 py4j round trips to wrap it; as a property, the UDF is
made once per stage and the task is one round trip (``SparkContext.setLocalProperty``, which
Spark hands to the Python worker in its ``TaskContext``). A property belongs to the driver's
thread, not to a plan: a recomputation of a batch's ranges in a later job of the thread would
find a later batch's task, or none. So each batch has a random token, put in its plan as a
literal column beside the routed rows, and in the property beside the task: a range's task
that finds another token, or no property, fails without running anything.
"""

import base64
import secrets
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import SparkContext, TaskContext, cloudpickle

from pipelines.keyed._executor import _run_partition
from pipelines.keyed._task import KeyedStageTask

__all__: list[str] = []

BATCH_TOKEN = "_batch_token"
"""The column of a batch's routed rows that holds its token (the plan's literal)."""
_PREFIX = "pipelines.keyed.task."


def task_property(stage: str) -> str:
    """The local property that carries a batch of keyed stage ``stage`` to its ranges."""
    return _PREFIX + stage


def new_token() -> str:
    """A batch's token. Text, not a number: Spark's generated code holds a numeric literal in
    its source, so a new number each batch compiled new classes (Janino, then the JIT) at
    every batch, where a string literal is a reference of the generated code, and the code
    of one batch is reused by the next (``tests/pipelines/test_keyed_batch_cost.py``)."""
    return secrets.token_hex(8)


def set_task(context: SparkContext, task: KeyedStageTask, token: str) -> None:
    """Make ``task`` (with ``token``) the batch of its stage for the jobs of this thread."""
    encoded = base64.b64encode(cloudpickle.dumps(task)).decode("ascii")
    context.setLocalProperty(task_property(task.stage.name), f"{token}:{encoded}")


def clear_task(context: SparkContext, stage: str) -> None:
    """Forget the batch of ``stage`` in this thread: later jobs do not carry it, and a
    recomputation of its ranges fails (nothing reads a released batch)."""
    context.setLocalProperty(task_property(stage), None)


def _task_of_job(stage: str) -> tuple[str, KeyedStageTask]:
    context = TaskContext.get()
    value = None if context is None else context.getLocalProperty(task_property(stage))
    if not value:
        raise RuntimeError(
            f"keyed stage {stage}: a range's Spark task found no batch to run (local property "
            f"{task_property(stage)} unset): its rows were computed again after the batch "
            "was released, or in another thread than the one that applied it; read a batch's "
            "output before KeyedBatch.release(), in the thread that applied it")
    token, _, encoded = value.partition(":")
    return token, cloudpickle.loads(base64.b64decode(encoded))


def _run_batch_range(stage: str, batches: Iterator[pa.RecordBatch]
                     ) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body of a batch's ranges: ``_run_partition`` with the task of the job's
    local property, once the rows' token says they are that batch's."""
    token, task = _task_of_job(stage)

    def checked() -> Iterator[pa.RecordBatch]:
        for batch in batches:
            if not batch.num_rows:
                continue
            tokens = pc.unique(batch.column(BATCH_TOKEN)).to_pylist()
            if tokens != [token]:
                raise RuntimeError(
                    f"keyed stage {stage}: a range's Spark task got rows of batch token(s) "
                    f"{tokens}, its job's batch is {token}: rows of an earlier batch were "
                    "computed again after a later batch of the stage started in this thread; "
                    "nothing was written. Read a batch's output before applying the next one")
            yield batch.drop_columns([BATCH_TOKEN])

    yield from _run_partition(task, checked())
