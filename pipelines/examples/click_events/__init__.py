"""The click-events example: see ``pipeline.py``."""

from pipelines.examples.click_events.events import EVENT_ARROW_SCHEMA, generate_day
from pipelines.examples.click_events.pipeline import (
    DAILY_PARTITIONS,
    FIRST_PARTITION,
    NAME,
    LandingConfig,
    click_events_asset,
    click_events_definitions,
    click_events_pipeline,
    report_columns,
)
from pipelines.examples.click_events.stages import (
    KEYED_STAGES,
    SILENCE,
    SILENT_USERS_KEYED,
    STAGES,
)

__all__ = [
    "DAILY_PARTITIONS",
    "EVENT_ARROW_SCHEMA",
    "FIRST_PARTITION",
    "KEYED_STAGES",
    "NAME",
    "SILENCE",
    "SILENT_USERS_KEYED",
    "STAGES",
    "LandingConfig",
    "click_events_asset",
    "click_events_definitions",
    "click_events_pipeline",
    "generate_day",
    "report_columns",
]
