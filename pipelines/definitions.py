"""The code location: ``workspace.yaml`` and ``[tool.dagster]`` both load this module."""

import dagster as dg

from pipelines.assets import (
    checkpoint_integrity,
    click_events,
    default_resources,
    user_activity,
)

daily_pipeline = dg.define_asset_job(
    "daily_pipeline",
    # The stateful asset reports each partition as it completes (not through outputs), so a
    # check in the same run would count as skipped: it runs in its own job instead.
    selection=dg.AssetSelection.assets(click_events, user_activity).without_checks(),
    description="Land a day's click events, then advance the stateful user_activity state "
    "through it (checkpointing) and write the day's report.",
)

checkpoint_integrity_job = dg.define_asset_job(
    "checkpoint_integrity_job",
    selection=dg.AssetSelection.checks(checkpoint_integrity),
    description="Verify that the latest completed checkpoint validates and restores.",
)

defs = dg.Definitions(
    assets=[click_events, user_activity],
    asset_checks=[checkpoint_integrity],
    jobs=[daily_pipeline, checkpoint_integrity_job],
    resources=default_resources(),
    # One process (and one Spark session) per run, not one per step.
    executor=dg.in_process_executor,
)
