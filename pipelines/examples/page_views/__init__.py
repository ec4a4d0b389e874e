"""The page-views example: hourly partitions, sessions that close after inactivity (a keyed
stage with an event-time timer), and a running count per page; landing, state and sinks on
any fsspec URL. See ``pipeline.py``."""

from pipelines.examples.page_views.pipeline import (
    CLOSED_SESSION_SCHEMA,
    HOURLY_PARTITIONS,
    NAME,
    PAGE_VIEW_SCHEMA,
    SESSION_GAP,
    SESSION_KEYED_STATE_SCHEMA,
    SESSIONS_KEYED,
    STAGES,
    VIEW_LATENESS,
    close_sessions,
    land_hour,
    page_counts,
    page_views_definitions,
    page_views_pipeline,
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
