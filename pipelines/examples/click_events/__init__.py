"""The click-events example: see ``pipeline.py``.

The Dagster side (``pipeline.py``) is imported on first use: Spark's Python workers import this
package to run the stages' functions, and need neither Dagster nor its ~0.4 s of imports and
~100 MiB per worker."""

from checkpoint_storage.spi import lazy_names
from pipelines.examples.click_events.events import EVENT_ARROW_SCHEMA, generate_day
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

# The Dagster side, imported when first asked for.
__getattr__, __dir__ = lazy_names(__name__, globals(), dict.fromkeys(
    ["DAILY_PARTITIONS", "FIRST_PARTITION", "NAME", "LandingConfig", "click_events_asset",
     "click_events_definitions", "click_events_pipeline", "report_columns"],
    "pipelines.examples.click_events.pipeline"))
