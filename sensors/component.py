"""``StatefulPipelineComponent``: a stateful pipeline from a ``defs.yaml`` (Dagster's
components, the way dagster-dbt and dagster-sling offer theirs), giving exactly what
``pipeline_definitions`` gives for the same pipeline in Python.

Stages, the source and the sinks are named by import path, with parameters::

    type: sensors.StatefulPipelineComponent
    attributes:
      name: page_views
      partitions:
        hourly: {start_date: "2026-10-01-00:00", timezone: UTC}
      stages:
        - import: my_project.stages.STAGES        # a (Keyed)Stage, a list of them, or a factory
      source:
        import: pipelines.FileSource
        params:
          url: "{{ env('PAGE_VIEWS_DIR') }}/landing/hour={partition}"
          schema: "page_id string, user_id string, viewed_at timestamp"
      sinks:
        - import: pipelines.ParquetSink
          params: {name: sessions, stage: sessions, url: "{{ env('PAGE_VIEWS_DIR') }}/sessions"}
      checkpoint_interval: 2
      # keyed stages: max_parallelism, keyed_parallelism, full snapshot: {every, ratio,
      # min_bytes}

An import path is ``package.module.attribute`` (or ``package.module:attribute``). With
``params`` the imported object is called with them (a class or a factory); without, a class or
function is called with no arguments and anything else is used as it is. ``partitions`` takes
one of ``hourly``, ``daily``, ``weekly``, ``monthly`` (the arguments of Dagster's partitions
definitions) or ``static`` (the keys, in order).

``dg scaffold defs sensors.StatefulPipelineComponent <name>`` writes a ``defs.yaml`` to start
from.
"""

import importlib
from collections.abc import Sequence
from typing import Annotated, Any

import dagster as dg
from pydantic import Field

from pipelines import FullSnapshotPolicy, KeyedStage, Sink, Source, Stage, StatefulPipeline
from pipelines.keyed import DEFAULT_MAX_PARALLELISM
from sensors._definitions import pipeline_definitions

__all__ = ["ImportReference", "PartitionsSpec", "StatefulPipelineComponent"]


def _templated(context, value):
    """Render ``{{ ... }}`` templates anywhere inside ``value`` (nested params included)."""
    return context.resolve_value(value)


class ImportReference(dg.Model, dg.Resolvable):
    """An object named by import path, optionally called with ``params``."""

    import_: str = Field(alias="import")
    params: Annotated[dict[str, Any] | None, dg.Resolver(_templated)] = None

    def resolve(self) -> Any:
        module_name, sep, attribute = self.import_.partition(":")
        if not sep:
            module_name, _, attribute = self.import_.rpartition(".")
        if not module_name or not attribute:
            raise ValueError(f"import path {self.import_!r}: use package.module.attribute")
        try:
            target = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot import {self.import_!r}: {exc}") from exc
        if self.params is not None:
            return target(**self.params)
        return target() if callable(target) and isinstance(target, type) else target


class PartitionsSpec(dg.Model):
    """Exactly one of the fields."""

    hourly: dict[str, Any] | None = None
    daily: dict[str, Any] | None = None
    weekly: dict[str, Any] | None = None
    monthly: dict[str, Any] | None = None
    static: list[str] | None = None

    def resolve(self) -> dg.PartitionsDefinition:
        given = {k: v for k, v in self.model_dump().items() if v is not None}
        if len(given) != 1:
            raise ValueError(
                "partitions: give exactly one of hourly, daily, weekly, monthly, static; got "
                f"{sorted(given) or 'none'}"
            )
        kind, arguments = next(iter(given.items()))
        if kind == "static":
            return dg.StaticPartitionsDefinition(arguments)
        classes = {
            "hourly": dg.HourlyPartitionsDefinition,
            "daily": dg.DailyPartitionsDefinition,
            "weekly": dg.WeeklyPartitionsDefinition,
            "monthly": dg.MonthlyPartitionsDefinition,
        }
        return classes[kind](**arguments)


def _stages(references: Sequence[ImportReference]) -> list[Stage | KeyedStage]:
    stages: list[Stage | KeyedStage] = []
    for reference in references:
        value = reference.resolve()
        items = list(value) if isinstance(value, list | tuple) else [value]
        for item in items:
            if not isinstance(item, Stage | KeyedStage):
                raise TypeError(f"{reference.import_} gave {item!r}, not a pipelines.Stage or "
                                "pipelines.KeyedStage")
            stages.append(item)
    return stages


def _of_type(reference: ImportReference, kind: type, what: str):
    value = reference.resolve()
    if not isinstance(value, kind):
        raise TypeError(f"{what} {reference.import_} gave {value!r}, not a {kind.__name__}")
    return value


class StatefulPipelineScaffolder(dg.Scaffolder):
    """Writes a ``defs.yaml`` that loads and runs as it is (the page-views example's stages
    over hourly partitions under ``$PIPELINE_DATA_DIR/<name>``): replace the stages, source
    and sinks with your own."""

    def scaffold(self, request: dg.ScaffoldRequest) -> None:
        name = request.target_path.name.replace("-", "_").lower()
        base = f"{{{{ env('PIPELINE_DATA_DIR', '.data') }}}}/{name}"
        dg.scaffold_component(
            request,
            {
                "name": name,
                "partitions": {"hourly": {"start_date": "2026-10-01-00:00", "timezone": "UTC"}},
                "stages": [{"import": "pipelines.examples.page_views.STAGES"}],
                "source": {
                    "import": "pipelines.FileSource",
                    "params": {
                        "url": f"{base}/landing/hour={{partition}}",
                        "schema": "page_id string, user_id string, viewed_at timestamp",
                    },
                },
                "sinks": [
                    {
                        "import": "pipelines.ParquetSink",
                        "params": {"name": "sessions", "stage": "sessions",
                                   "url": f"{base}/sessions", "partition_column": "hour"},
                    }
                ],
                "checkpoint_interval": 2,
                "max_retained_checkpoints": 3,
            },
        )


class FullSnapshotSpec(dg.Model):
    """A keyed stage's full snapshot policy (``pipelines.FullSnapshotPolicy``)."""

    every: int | None = FullSnapshotPolicy.every
    ratio: float = FullSnapshotPolicy.ratio
    min_bytes: int = FullSnapshotPolicy.min_bytes
    small_every: int | None = FullSnapshotPolicy.small_every


@dg.scaffold_with(StatefulPipelineScaffolder)
class StatefulPipelineComponent(dg.Component, dg.Model, dg.Resolvable):
    """A stateful pipeline with Flink-style checkpoints: its state asset (and one asset per
    sink), the checkpoint_integrity check, the savepoint job and schedule, and the retention
    and recovery sensors, every name derived from ``name``."""

    name: str
    partitions: PartitionsSpec
    stages: list[ImportReference]
    source: ImportReference
    sinks: list[ImportReference] = []
    checkpoint_interval: int = 2
    max_retained_checkpoints: int = 3
    description: str | None = None
    savepoint_cron: str | None = None
    automation_status: str = "RUNNING"
    max_parallelism: int = DEFAULT_MAX_PARALLELISM
    keyed_parallelism: int | None = None
    full_snapshot: FullSnapshotSpec = FullSnapshotSpec()

    def pipeline(self) -> StatefulPipeline:
        return StatefulPipeline(
            name=self.name,
            stages=_stages(self.stages),
            source=_of_type(self.source, Source, "source"),
            partitions=self.partitions.resolve(),
            sinks=[_of_type(s, Sink, "sink") for s in self.sinks],
            checkpoint_interval=self.checkpoint_interval,
            max_retained_checkpoints=self.max_retained_checkpoints,
            description=self.description,
            max_parallelism=self.max_parallelism,
            keyed_parallelism=self.keyed_parallelism,
            full_snapshot=FullSnapshotPolicy(**self.full_snapshot.model_dump()),
        )

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        return pipeline_definitions(
            self.pipeline(),
            savepoint_cron=self.savepoint_cron,
            automation_status=self.automation_status,
        )
