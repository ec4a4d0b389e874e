"""The page-views example: hourly partitions, sessions that expire after inactivity, and a
running count per page; landing, state and sinks on any fsspec URL. See ``pipeline.py``."""

from pipelines.examples.page_views.pipeline import (
    HOURLY_PARTITIONS,
    NAME,
    PAGE_VIEW_SCHEMA,
    SESSION_GAP,
    STAGES,
    land_hour,
    page_counts,
    page_views_definitions,
    page_views_pipeline,
    sessions,
)

__all__ = [
    "HOURLY_PARTITIONS",
    "NAME",
    "PAGE_VIEW_SCHEMA",
    "SESSION_GAP",
    "STAGES",
    "land_hour",
    "page_counts",
    "page_views_definitions",
    "page_views_pipeline",
    "sessions",
]
