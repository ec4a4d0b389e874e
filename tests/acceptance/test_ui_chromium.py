"""The UI in a real browser (issue 6): headless Chromium (Debian's ``chromium`` package,
driven by Playwright with ``executable_path``, never ``playwright install``) opens the
``user_activity`` asset page of the session's ``dagster dev`` and shows the checkpoint
metadata of a materialization, and the ``retained`` table (checkpoints and savepoints with
their positions and pointers) of the newest event; screenshots are saved under
``test-artifacts/``.

It skips, with the reason, only when ``/usr/bin/chromium`` is missing (scripts/test installs
it with apt-get when it can) or the ``playwright`` package is not installed.
"""

import contextlib
import os
import shutil
from pathlib import Path

import pytest

from pipelines.examples.click_events import FIRST_PARTITION
from tests.acceptance.dagster_process import DagsterDev, metadata
from tests.acceptance.support import user_activity_config

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
# Chromium as root, headless, on a machine without outside network: no sandbox, no GPU, and
# no background connections (refused here, they would slow every page down).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def _chromium_or_skip() -> str:
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(
            f"{CHROMIUM} is missing: Debian's chromium package could not be installed "
            "(scripts/test runs `apt-get install -y chromium` when it can)"
        )
    pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    return CHROMIUM


@contextlib.contextmanager
def asset_events_page(dagster_dev: DagsterDev, profile: Path, wait_for: list[str], screenshot):
    """Headless Chromium on user_activity's Events tab (the newest event selected, its
    metadata beside the list), once every text of ``wait_for`` shows; a screenshot either way."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # A fresh profile directory per test (Playwright wants it as user_data_dir).
        browser = p.chromium.launch_persistent_context(
            str(profile),
            executable_path=_chromium_or_skip(),
            args=CHROMIUM_ARGS,
            headless=True,
            viewport={"width": 1600, "height": 1200},
        )
        try:
            page = browser.new_page()
            page.goto(f"{dagster_dev.url}/assets/user_activity?view=events", timeout=60_000)
            try:
                first, *rest = wait_for
                page.get_by_text(first, exact=True).first.wait_for(timeout=90_000)
                for text in rest:
                    page.get_by_text(text).first.wait_for(timeout=30_000)
            finally:
                page.screenshot(path=str(screenshot), full_page=True)
            yield page
        finally:
            browser.close()


@pytest.fixture(scope="module")
def materialized(dagster_dev: DagsterDev) -> dict:
    """A user_activity materialization with its checkpoint metadata: the end-to-end test's,
    or one made here when this test runs alone."""
    events = [e for e in dagster_dev.materializations() if "checkpoint_pointer" in metadata(e)]
    if not events:
        run_id = dagster_dev.launch_run(
            "user_activity_job", user_activity_config(), {"dagster/partition": FIRST_PARTITION}
        )
        run = dagster_dev.wait_for_run(run_id, 300)
        assert "SUCCESS" == run["status"], dagster_dev.run_errors(run_id)
        events = dagster_dev.materializations()
    latest = max(events, key=lambda e: float(e["timestamp"]))
    return metadata(latest) | {"partition": latest["partition"]}


@pytest.mark.timeout(300)
def test_asset_page_shows_checkpoint_metadata(
    dagster_dev: DagsterDev, materialized: dict, artifacts_dir: Path, tmp_path
):
    _chromium_or_skip()
    pointer = str(materialized["checkpoint_pointer"])
    screenshot = artifacts_dir / "user_activity_asset_page.png"
    waits = ["checkpoint_pointer", pointer]
    with asset_events_page(dagster_dev, tmp_path / "chromium-profile", waits, screenshot) as page:
        text = page.inner_text("body")
    for label in ("checkpoint_pointer", "state_bytes", "source_position"):
        assert label in text, f"{label} not on the asset page (see {screenshot})"
    assert pointer in text
    assert str(materialized["source_position"]) in text
    assert screenshot.stat().st_size > 10_000
    shutil.copy(dagster_dev.log_path, artifacts_dir / "dagster-dev.log")


def newest_retained(dagster_dev: DagsterDev) -> list[dict]:
    """The rows of the ``retained`` table on the newest event of user_activity (a
    materialization, or a savepoint's or retention's observation)."""
    events = dagster_dev.materializations() + dagster_dev.observations()
    with_table = [e for e in events if "retained" in metadata(e)]
    return metadata(max(with_table, key=lambda e: float(e["timestamp"])))["retained"]


@pytest.mark.timeout(300)
def test_asset_page_shows_what_is_retained(
    dagster_dev: DagsterDev, materialized: dict, artifacts_dir: Path, tmp_path
):
    """The events tab opens on the newest event, whose retained table shows every retained
    checkpoint and savepoint: id, kind, decoded position and pointer."""
    _chromium_or_skip()
    rows = newest_retained(dagster_dev)
    assert rows, "the newest event has an empty retained table"
    screenshot = artifacts_dir / "user_activity_retained.png"
    waits = ["retained", rows[-1]["pointer"]]
    with asset_events_page(dagster_dev, tmp_path / "chromium-profile", waits, screenshot) as page:
        # One line per table row: its cells, tab-separated, as the browser renders them.
        lines = page.inner_text("body").splitlines()
    table = [line.split("\t") for line in lines if "\t" in line]
    for row in rows:
        expected = [str(row["id"]), row["kind"], row["partition"], str(row["batches"])]
        shown = [cells[:4] for cells in table if row["pointer"] in cells]
        assert [expected] == shown, f"{row} not shown (see {screenshot})"
