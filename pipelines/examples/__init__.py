"""Pipelines built on the public API only (``pipelines``, ``sensors``, ``resources``):

- ``click_events``: daily partitions, deduplication and per-user activity, a daily report.
- ``page_views``: hourly partitions, page-view sessions that expire after inactivity; landing,
  state and sink on any fsspec URL (S3 in its test).
"""
