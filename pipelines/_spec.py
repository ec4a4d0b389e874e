"""The pipeline spec: what a stateful pipeline is, independent of how it runs.

A ``StatefulPipeline`` names its stages, its source, its partitions, its sinks, how often it
checkpoints and how many checkpoints it keeps. The runner executes it; the Dagster factory
(``sensors.pipeline_definitions``) turns it into assets, checks, jobs, schedules and sensors.
"""

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T
from pyspark.sql.pandas.types import to_arrow_schema

from pipelines._sinks import Sink
from pipelines._sources import Source
from pipelines.keyed import (
    DEFAULT_MAX_PARALLELISM,
    UPPER_BOUND_MAX_PARALLELISM,
    FullSnapshotPolicy,
    KeyedStage,
    check_evolution_spec,
)
from pipelines.keyed._stage import check_stage_name

if TYPE_CHECKING:  # executors unpickle stages through this package: they need no dagster
    import dagster as dg

__all__ = ["SOURCE", "PartitionOrder", "Stage", "StatefulPipeline"]

SOURCE = "source"
"""The name a stage's ``input`` gives to the pipeline's source."""

_NAME = re.compile(r"[a-z][a-z0-9_]{0,62}")


@dataclass(frozen=True)
class Stage:
    """A stateful step over DataFrames: ``apply(input, state) -> (new_state, output)``, where
    the new state has ``state_schema``. Its state is small enough to snapshot whole at every
    checkpoint (Flink's operator state). Input first, as a keyed stage's ``apply``, Spark's
    ``handleInputRows`` and Flink's ``processElement`` take it; a function whose first
    parameter is named ``state`` (the order before, ``(state, input)``) is refused.

    ``input`` names what the stage reads: ``SOURCE`` (the pipeline's source batches) or an
    earlier stage's name (that stage's output). ``None``: the previous stage's output, or the
    source for the first stage.

    ``renamed`` (old column name -> new) and ``defaults`` (added column -> value): how state
    restored from a snapshot written under an older ``state_schema`` evolves into this one
    (docs/pipelines.md, "Upgrading a pipeline").
    """

    name: str
    state_schema: T.StructType
    apply: Callable[[DataFrame, DataFrame], tuple[DataFrame, DataFrame]]
    input: str | None = None
    renamed: Mapping[str, str] = field(default_factory=dict, hash=False)
    defaults: Mapping[str, object] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        check_stage_name(self.name)
        if self.name == SOURCE:
            raise ValueError(f"a stage cannot be called {SOURCE!r}: that names the source")
        if not isinstance(self.state_schema, T.StructType):
            raise TypeError(f"stage {self.name}: state_schema must be a pyspark StructType")
        if not callable(self.apply):
            raise TypeError(f"stage {self.name}: apply must be callable")
        _refuse_state_first(f"stage {self.name}", self.apply)
        check_evolution_spec(self.renamed, self.defaults,
                             to_arrow_schema(self.state_schema, timezone="UTC"), (),
                             f"stage {self.name}")


_STATE_NAME = re.compile(r"(\w+_)?state")


def _refuse_state_first(where: str, apply: Callable) -> None:
    """Refuse an ``apply`` written for the old order, ``(state, input)``, as far as its
    parameter names tell (``state``, ``old_state``, ...; ``(s, i)`` cannot be told apart):
    called in the new order it would treat the batch as the state, silently."""
    try:
        parameters = inspect.signature(apply).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature to read (a builtin)
        return
    names = [p.name for p in parameters
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
    if len(names) == 2 and _STATE_NAME.fullmatch(names[0]) and not _STATE_NAME.fullmatch(
            names[1]):
        function = getattr(apply, "__name__", "apply")
        raise TypeError(
            f"{where}: {function}({names[0]}, {names[1]}, ...) takes the state first, but a "
            "stage's apply takes (input, state): input first, like a keyed stage's (the order "
            "changed; see the changelog). Swap its parameters: "
            f"def {function}({names[1]}, {names[0]}, ...)")


def static_partition_keys(partitions) -> tuple[str, ...] | None:
    """``partitions`` as static keys when they are a sequence of them (a list or a tuple of
    strings, given instead of a ``dg.StaticPartitionsDefinition``), else None. Unique and
    non-empty, or a ValueError."""
    # by type, not isinstance: Dagster's definitions are named tuples
    if type(partitions) not in (list, tuple):
        return None
    keys = tuple(partitions)
    if not keys or not all(isinstance(k, str) and k for k in keys):
        raise ValueError("partitions given as keys must be a non-empty list of non-empty "
                         f"strings, got {partitions!r}")
    if len(set(keys)) != len(keys):
        raise ValueError(f"partitions given as keys must be unique, got {partitions!r}")
    return keys


class PartitionOrder:
    """The order of a pipeline's partition keys: which key comes before which. Time windows
    (hourly, daily, weekly, ...) in time order; static partitions (a Dagster definition or a
    sequence of keys) in the declared order."""

    def __init__(self, partitions: "dg.PartitionsDefinition | Sequence[str]") -> None:
        keys = static_partition_keys(partitions)
        if keys is not None:  # no Dagster needed to order them
            self._static: list[str] | None = list(keys)
            self.partitions = partitions
            return
        import dagster as dg

        if isinstance(partitions, dg.TimeWindowPartitionsDefinition):
            self._static: list[str] | None = None
        elif isinstance(partitions, dg.StaticPartitionsDefinition):
            self._static = list(partitions.get_partition_keys())
        else:
            raise TypeError(
                "partitions must be time-window partitions (hourly, daily, weekly, monthly, "
                f"cron), static partitions or a list of keys, got {type(partitions).__name__}"
            )
        self.partitions = partitions

    def check(self, key: str) -> str:
        """``key`` if it is one of the pipeline's partitions, else a ValueError."""
        if self._static is not None:
            if key not in self._static:
                raise ValueError(f"{key!r} is not a partition of this pipeline: {self._static}")
            return key
        try:
            self.partitions.time_window_for_partition_key(key)
        except Exception as exc:  # Dagster raises several kinds for a key it cannot parse
            raise ValueError(f"{key!r} is not a partition key of this pipeline: {exc}") from exc
        return key

    @property
    def first(self) -> str:
        if self._static is not None:
            return self._static[0]
        return self.partitions.get_first_partition_key()

    def previous(self, key: str) -> str | None:
        """The partition before ``key``; None for the first."""
        self.check(key)
        if self._static is not None:
            index = self._static.index(key)
            return self._static[index - 1] if index else None
        if key == self.first:
            return None
        window = self.partitions.time_window_for_partition_key(key)
        previous = self.partitions.get_prev_partition_window(window.start)
        if previous is None:
            return None
        return self.partitions.get_partition_key_for_timestamp(previous.start.timestamp())

    def following(self, key: str) -> str | None:
        """The partition after ``key`` (it may not have ended yet); None after the last."""
        self.check(key)
        if self._static is not None:
            index = self._static.index(key)
            return self._static[index + 1] if index + 1 < len(self._static) else None
        window = self.partitions.time_window_for_partition_key(key)
        return self.partitions.get_partition_key_for_timestamp(window.end.timestamp())

    def rank(self, key: str) -> float | None:
        """A number that sorts ``key`` among the partitions (its index, or its window's start
        as a timestamp); None for a key that is not one of them (any more)."""
        try:
            self.check(key)
        except ValueError:
            return None
        if self._static is not None:
            return float(self._static.index(key))
        return self.partitions.time_window_for_partition_key(key).start.timestamp()

    def check_consecutive(self, keys: Sequence[str]) -> list[str]:
        keys = [self.check(k) for k in keys]
        for before, after in zip(keys, keys[1:], strict=False):
            if self.previous(after) != before:
                raise ValueError(
                    f"partitions must be consecutive, in order: {after} does not follow {before}"
                )
        return keys


@dataclass(frozen=True)
class StatefulPipeline:
    """A stateful pipeline: ``source`` batches flow through ``stages`` partition by partition;
    state is checkpointed every ``checkpoint_interval`` batches and at the end of each
    partition; ``max_retained_checkpoints`` completed checkpoints are kept; ``sinks`` write
    stage outputs (or state) per partition, idempotently.

    Retention keeps, besides the newest ``max_retained_checkpoints``: the head (the checkpoint
    of the furthest position, so that a rewind never loses it) and, with
    ``retain_partition_ends`` = K, the checkpoint at the end of each of the last K
    partitions up to the head (time travel: restore or backfill from any of them).

    ``partitions``: Dagster's time-window or static partitions, or static keys as a list of
    strings (the pipeline then runs without importing Dagster; ``partitions_def`` is the
    Dagster definition its assets are partitioned by).

    ``stages`` are DataFrame stages (``Stage``) and keyed stages (``KeyedStage``) in any mix.
    ``max_parallelism``: the number of key groups of every keyed stage (Flink's max
    parallelism), the most tasks a keyed stage can ever run on. It is fixed for the life of
    the pipeline's state: checkpoints record it, and state written with another cannot be
    restored. ``keyed_parallelism``: how many key group ranges (Spark tasks) keyed stages run
    on (None: Spark's default parallelism, at most ``max_parallelism``); change it between
    runs to rescale: restored state is redistributed first. ``full_snapshot``: when a keyed
    stage's chain of change files is replaced by a full snapshot of its range (after
    ``every`` change files, or when they outgrow ``ratio`` times the last snapshot).

    ``initial_state``: per stage name, the state its first run starts from instead of
    empty (a bootstrap, Flink's State Processor API): a DataFrame, a table name
    (``spark.table``) or a function ``spark -> DataFrame``, rows of the stage's state
    schema (a keyed stage's: one row per key). Used only when the pipeline has no snapshot
    to restore, or a restored one lacks the stage (a stage added since).

    ``name`` is stable and readable (lowercase letters, digits, ``_``): the job id (and so the
    checkpoint directory) derives from it, every `_metadata` records it, and every Dagster
    name of the pipeline starts with it. ``deps``: upstream Dagster assets (e.g. the asset
    that lands the source's files), run before the pipeline in its job.
    """

    name: str
    stages: Sequence[Stage | KeyedStage]
    source: Source
    partitions: "dg.PartitionsDefinition | Sequence[str]"
    sinks: Sequence[Sink] = ()
    checkpoint_interval: int = 2
    max_retained_checkpoints: int = 3
    retain_partition_ends: int = 0
    description: str | None = None
    deps: "Sequence[dg.AssetsDefinition]" = ()
    max_parallelism: int = DEFAULT_MAX_PARALLELISM
    keyed_parallelism: int | None = None
    full_snapshot: FullSnapshotPolicy = FullSnapshotPolicy()
    initial_state: "Mapping[str, DataFrame | str | Callable[[SparkSession], DataFrame]]" = field(
        default_factory=dict, compare=False, hash=False)
    order: PartitionOrder = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(
                f"pipeline name {self.name!r}: use lowercase letters, digits and '_', starting "
                "with a letter (Dagster names and the job id derive from it)"
            )
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "sinks", tuple(self.sinks))
        object.__setattr__(self, "deps", tuple(self.deps))
        if not self.stages:
            raise ValueError(f"pipeline {self.name}: at least one stage is needed")
        if not isinstance(self.source, Source):
            raise TypeError(f"pipeline {self.name}: source must be a pipelines.Source")
        for value, what in ((self.checkpoint_interval, "checkpoint_interval"),
                            (self.max_retained_checkpoints, "max_retained_checkpoints")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"pipeline {self.name}: {what} must be >= 1, got {value!r}")
        ends = self.retain_partition_ends
        if isinstance(ends, bool) or not isinstance(ends, int) or ends < 0:
            raise ValueError(
                f"pipeline {self.name}: retain_partition_ends must be an int >= 0 (0: keep no "
                f"partition ends beyond the retained checkpoints), got {ends!r}")
        if (isinstance(self.max_parallelism, bool) or not isinstance(self.max_parallelism, int)
                or not 1 <= self.max_parallelism <= UPPER_BOUND_MAX_PARALLELISM):
            raise ValueError(
                f"pipeline {self.name}: max_parallelism must be in [1, "
                f"{UPPER_BOUND_MAX_PARALLELISM}], got {self.max_parallelism!r}"
            )
        if self.keyed_parallelism is not None and (
                isinstance(self.keyed_parallelism, bool)
                or not isinstance(self.keyed_parallelism, int)
                or not 1 <= self.keyed_parallelism <= self.max_parallelism):
            raise ValueError(
                f"pipeline {self.name}: keyed_parallelism must be in [1, max_parallelism="
                f"{self.max_parallelism}] or None, got {self.keyed_parallelism!r}"
            )
        if not isinstance(self.full_snapshot, FullSnapshotPolicy):
            raise TypeError(f"pipeline {self.name}: full snapshot must be a "
                            "FullSnapshotPolicy")
        seen: list[str] = []
        for stage in self.stages:
            if not isinstance(stage, Stage | KeyedStage):
                raise TypeError(f"pipeline {self.name}: {stage!r} is not a Stage or KeyedStage")
            if stage.name in seen:
                raise ValueError(f"pipeline {self.name}: two stages are called {stage.name!r}")
            if stage.input not in (None, SOURCE, *seen):
                raise ValueError(
                    f"pipeline {self.name}: stage {stage.name!r} reads {stage.input!r}, which is "
                    f"neither {SOURCE!r} nor an earlier stage ({seen or 'none'})"
                )
            seen.append(stage.name)
        late_names: list[str] = []
        for stage in self.keyed_stages:
            late = stage.watermark.late_rows if stage.watermark is not None else None
            if late is not None and (late in seen or late in late_names):
                raise ValueError(
                    f"pipeline {self.name}: stage {stage.name!r} sends its late rows to "
                    f"{late!r}, which already names a stage or another stage's late rows; "
                    "give Watermark(late_rows=...) a name of its own")
            late_names += [late] if late is not None else []
        if not isinstance(self.initial_state, Mapping):
            raise TypeError(f"pipeline {self.name}: initial_state must map stage names to a "
                            "DataFrame, a table name or a function spark -> DataFrame")
        for stage_name, rows in self.initial_state.items():
            if stage_name not in seen:
                raise ValueError(f"pipeline {self.name}: initial_state names {stage_name!r}, "
                                 f"which is not one of its stages {seen}")
            if not isinstance(rows, DataFrame | str) and not callable(rows):
                raise TypeError(f"pipeline {self.name}: initial_state of {stage_name!r} must be "
                                "a DataFrame, a table name or a function spark -> DataFrame, "
                                f"got {type(rows).__name__}")
        late_outputs = self.late_outputs
        sink_names = set()
        for sink in self.sinks:
            if not isinstance(sink, Sink):
                raise TypeError(f"pipeline {self.name}: {sink!r} is not a pipelines.Sink")
            if sink.stage not in seen and sink.stage not in late_outputs:
                raise ValueError(
                    f"pipeline {self.name}: sink {sink.name!r} writes stage {sink.stage!r}, "
                    f"which is not one of its stages {seen}"
                    + (f" nor late-rows outputs {sorted(late_outputs)}" if late_outputs else "")
                )
            if sink.stage in late_outputs and sink.of != "output":
                raise ValueError(
                    f"pipeline {self.name}: sink {sink.name!r} writes the late rows "
                    f"{sink.stage!r} of stage {late_outputs[sink.stage]!r}, which have no "
                    "state: use of='output'")
            if sink.name in sink_names:
                raise ValueError(f"pipeline {self.name}: two sinks are called {sink.name!r}")
            sink_names.add(sink.name)
        keys = static_partition_keys(self.partitions)
        if keys is not None:
            object.__setattr__(self, "partitions", keys)
        object.__setattr__(self, "order", PartitionOrder(self.partitions))

    @cached_property
    def partitions_def(self) -> "dg.PartitionsDefinition":
        """The pipeline's partitions as Dagster's definition (static keys given as a sequence
        become a ``dg.StaticPartitionsDefinition``): what its assets are partitioned by."""
        if type(self.partitions) is tuple:
            import dagster as dg

            return dg.StaticPartitionsDefinition(list(self.partitions))
        return self.partitions

    def input_of(self, index: int) -> str:
        """What stage ``index`` reads: ``SOURCE`` or an earlier stage's name."""
        stage = self.stages[index]
        if stage.input is not None:
            return stage.input
        return SOURCE if index == 0 else self.stages[index - 1].name

    @property
    def late_outputs(self) -> dict[str, str]:
        """The late-rows outputs (``Watermark(late_rows=...)``): their names -> the stage
        whose late rows they are. A sink writes one as it writes a stage's output."""
        return {s.watermark.late_rows: s.name for s in self.keyed_stages
                if s.watermark is not None and s.watermark.late_rows is not None}

    @property
    def keyed_stages(self) -> tuple[KeyedStage, ...]:
        """The keyed stages, in order."""
        return tuple(s for s in self.stages if isinstance(s, KeyedStage))

    def stage(self, name: str) -> Stage | KeyedStage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"pipeline {self.name} has no stage {name!r}")
