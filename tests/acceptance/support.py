"""Helpers shared by the acceptance tests and their fixtures (tests/acceptance/conftest.py):
the small inputs, the environment the pipelines run in, and readers of what runs left."""

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

# The small input of the click_events generator for every run here.
SMALL_LANDING = {"batches_per_day": 3, "events_per_batch": 200, "users": 20, "seed": 7}
# The small input of each page_views hour (``pipelines.examples.page_views.land_hour``).
SMALL_HOUR = {"batches": 2, "views_per_batch": 100, "users": 10, "pages": 5, "seed": 7}


@dataclass(frozen=True)
class PipelineEnv:
    bucket: str
    checkpoint_dir: str
    savepoint_dir: str
    storage_options: dict
    landing_dir: str
    report_dir: str
    page_views_dir: str
    artifacts: Path


def user_activity_config(restore_from: str | None = None) -> dict:
    config = {} if restore_from is None else {"restore_from": restore_from}
    return {
        "ops": {
            "click_events": {"config": SMALL_LANDING},
            "user_activity": {"config": config},
        }
    }


def tags_of(run: dict) -> dict[str, str]:
    return {t["key"]: t["value"] for t in run["tags"]}


def read_report(report_dir: str, partition: str) -> pd.DataFrame:
    frame = pd.read_parquet(f"{report_dir}/report_date={partition}")
    return frame.sort_values(list(frame.columns)).reset_index(drop=True)


def state_frames(runner) -> dict[str, pd.DataFrame]:
    latest = runner.access.latest_completed_checkpoint()
    assert latest is not None
    states = runner.restore_states(latest.load_metadata())
    frames = {}
    for name, state in states.items():
        frame = state.toPandas()
        frames[name] = frame.sort_values(list(frame.columns)).reset_index(drop=True)
        state.unpersist()
    return frames
