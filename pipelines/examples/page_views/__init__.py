"""The page-views example: hourly partitions, sessions that close after inactivity (a keyed
stage with an event-time timer), and a running count per page; landing, state and sinks on
any fsspec URL. See ``pipeline.py``."""

from checkpoint_storage.spi import lazy_names
from pipelines.examples.page_views.stages import (
    CLOSED_SESSION_SCHEMA,
    NAME,
    PAGE_VIEW_SCHEMA,
    SESSION_GAP,
    SESSION_KEYED_STATE_SCHEMA,
    SESSIONS_KEYED,
    STAGES,
    VIEW_LATENESS,
    close_sessions,
    page_counts,
    session_views,
)

__all__ = [
    "CLOSED_SESSION_SCHEMA",
    "HOURLY_PARTITIONS",
    "NAME",
    "PAGE_VIEW_SCHEMA",
    "SESSIONS_KEYED",
    "SESSION_GAP",
    "SESSION_KEYED_STATE_SCHEMA",
    "STAGES",
    "VIEW_LATENESS",
    "close_sessions",
    "land_hour",
    "page_counts",
    "page_views_definitions",
    "page_views_pipeline",
    "session_views",
]

# The Dagster side, imported when first asked for: Spark's Python workers import this package
# to run the stages' functions (``stages.py``) and need no Dagster.
__getattr__, __dir__ = lazy_names(__name__, globals(), dict.fromkeys(
    ["HOURLY_PARTITIONS", "land_hour", "page_views_definitions", "page_views_pipeline"],
    "pipelines.examples.page_views.pipeline"))
