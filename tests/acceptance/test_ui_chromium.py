"""The UI in a real browser (issues 6 and 29): headless Chromium (Debian's ``chromium``
package, driven by Playwright with ``executable_path``, never ``playwright install``) opens the
``user_activity`` asset page of the session's ``dagster dev`` at 1280 px and shows the
checkpoint metadata and statistics (and their plots) of a materialization, the ``retained``
table (checkpoints and savepoints with their positions and pointers) of the newest event
with every column and pointer on screen, and says of each event whether it is a
materialization, a savepoint or a retention tick; screenshots are saved under ``test-artifacts/``.

It skips, with the reason, only when ``/usr/bin/chromium`` is missing (scripts/test installs
it with apt-get when it can) or the ``playwright`` package is not installed.
"""

import contextlib
import os
import re
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
# Issue 29: the asset page must be readable on a 1280 px wide screen.
VIEWPORT = {"width": 1280, "height": 1000}
# Dagster's community sign-up dialog opens over the page on a first visit from localhost:
# marked as seen, as its Skip button does.
NO_COMMUNITY_DIALOG = "localStorage.setItem('communityNux', JSON.stringify('1'))"
RETAINED_COLUMNS = ["id", "kind", "position", "size", "written", "files", "age", "pointer"]
# What each event on the state asset says first (its ``event`` metadata and description).
EVENT_DESCRIPTIONS = {
    "materialization": "Materialization of partition ",
    "savepoint": "Savepoint (",
    "retention tick": "Retention tick: ",
}


def _chromium_or_skip() -> str:
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(
            f"{CHROMIUM} is missing: Debian's chromium package could not be installed "
            "(scripts/test runs `apt-get install -y chromium` when it can)"
        )
    pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    return CHROMIUM


@contextlib.contextmanager
def asset_events_page(
    dagster_dev: DagsterDev,
    profile: Path,
    wait_for: list[str],
    screenshot,
    path: str = "user_activity?view=events",
):
    """Headless Chromium on user_activity's Events tab (the newest event selected, or the
    one ``path`` names, its metadata beside the list), once every text of ``wait_for`` shows;
    a screenshot either way."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # A fresh profile directory per test (Playwright wants it as user_data_dir).
        browser = p.chromium.launch_persistent_context(
            str(profile),
            executable_path=_chromium_or_skip(),
            args=CHROMIUM_ARGS,
            headless=True,
            viewport=VIEWPORT,
        )
        try:
            browser.add_init_script(NO_COMMUNITY_DIALOG)
            page = browser.new_page()
            page.goto(f"{dagster_dev.url}/assets/{path}", timeout=60_000)
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


# The checkpoint statistics each materialization records (issue 29), as numbers Dagster plots.
STATISTICS = ["bytes_written", "bytes_full", "files_new", "files_reused", "batch_ms",
              "state_write_ms", "metadata_publication_ms"]


@pytest.mark.timeout(300)
def test_asset_page_shows_checkpoint_statistics_and_their_plots(
    dagster_dev: DagsterDev, materialized: dict, artifacts_dir: Path, tmp_path
):
    """At 1280 px the newest materialization's panel lists its checkpoint statistics with the
    values recorded (bytes written of the full size, files new and reused, durations), the
    written bytes not above the full size; the Overview tab's Plots toggle charts them
    across materializations."""
    _chromium_or_skip()
    assert set(STATISTICS) <= set(materialized), sorted(materialized)
    assert 0 < materialized["bytes_written"] <= materialized["bytes_full"]
    screenshot = artifacts_dir / "user_activity_statistics.png"
    with asset_events_page(dagster_dev, tmp_path / "chromium-profile", STATISTICS,
                           screenshot) as page:  # fmt: skip
        shown = {}
        for label in STATISTICS:
            row = page.locator("tr", has=page.locator("td", has_text=re.compile(f"^{label}$")))
            shown[label] = row.first.locator("td").nth(1).inner_text().strip()
    for label in ("bytes_written", "bytes_full", "files_new", "files_reused"):
        assert shown[label].replace(",", "") == str(materialized[label]), (shown, screenshot)
    # The Overview tab's Metadata section: its Plots toggle charts each numeric entry.
    plots = artifacts_dir / "user_activity_statistics_plots.png"
    with asset_events_page(dagster_dev, tmp_path / "chromium-plots", ["Plots"], plots,
                           path="user_activity?view=overview") as page:  # fmt: skip
        page.get_by_text("Plots", exact=True).first.click()
        page.get_by_text("bytes_written", exact=True).first.wait_for(timeout=60_000)
        charts = page.locator("canvas").count()
        text = page.inner_text("body")
        page.screenshot(path=str(plots), full_page=True)
    assert all(label in text for label in STATISTICS), f"not all plotted (see {plots})"
    assert charts > 0, f"no chart drawn (see {plots})"


@pytest.fixture(scope="module")
def savepointed(dagster_dev: DagsterDev, materialized: dict) -> dict:
    """A savepoint's observation of user_activity: the end-to-end test's, or one taken here
    when this test runs alone."""
    events = [e for e in dagster_dev.observations() if "savepoint_pointer" in metadata(e)]
    if not events:
        run_id = dagster_dev.launch_run("user_activity_savepoint_job", {}, {})
        run = dagster_dev.wait_for_run(run_id, 300)
        assert "SUCCESS" == run["status"], dagster_dev.run_errors(run_id)
        events = [e for e in dagster_dev.observations() if "savepoint_pointer" in metadata(e)]
    return metadata(max(events, key=lambda e: float(e["timestamp"])))


def retained_tables(dagster_dev: DagsterDev) -> list[list[dict]]:
    """The ``retained`` tables of every event of user_activity (materializations, savepoints'
    and retention's observations)."""
    events = dagster_dev.materializations() + dagster_dev.observations()
    return [metadata(e)["retained"] for e in events if "retained" in metadata(e)]


def retained_table_element(page):
    """The ``retained`` table of the event shown (the innermost table with a pointer column:
    the metadata panel is a table too)."""
    tables = page.locator("table:not(:has(table))")
    return tables.filter(has=page.locator("th", has_text=re.compile("^pointer$"))).first


def shown_table(page) -> list[list[str]]:
    """The rows (header first) of the ``retained`` table on the page, each cell's text as
    the browser renders it."""
    return retained_table_element(page).evaluate(
        "t => [...t.querySelectorAll('tr')].map("
        "r => [...r.querySelectorAll('th, td')].map(c => c.innerText.trim()))"
    )


def on_screen(locator) -> str | None:
    """None when the element is drawn whole inside the viewport's width without scrolling
    sideways, not clipped or covered (what is at its left and right edges is the element
    itself) and its text fits it; else what is wrong."""
    return locator.evaluate(
        """(el, width) => {
            // Scrolled into view vertically only: a table wider than its panel scrolls
            // sideways, and what is out of sight then does not count as shown.
            el.scrollIntoView({block: 'center', inline: 'nearest'});
            for (let a = el.parentElement; a; a = a.parentElement) a.scrollLeft = 0;
            window.scrollTo(0, window.scrollY);
            const r = el.getBoundingClientRect();
            if (r.width === 0 || r.height === 0) return 'not drawn';
            if (r.left < 0 || r.right > width) return `outside the screen: ${r.left}-${r.right}`;
            const y = r.top + r.height / 2;
            for (const x of [r.left + 1, r.right - 1]) {
                const hit = document.elementFromPoint(x, y);
                if (!hit || !(el.contains(hit) || hit.contains(el)))
                    return `hidden at x=${x} by ${hit ? hit.outerHTML.slice(0, 80) : 'nothing'}`;
            }
            if (el.scrollWidth > el.clientWidth + 1) return 'its text overflows it';
            return null;
        }""",
        VIEWPORT["width"],
    )


@pytest.mark.timeout(600)
def test_asset_page_shows_what_is_retained(
    dagster_dev: DagsterDev, materialized: dict, savepointed: dict, artifacts_dir: Path, tmp_path
):
    """At 1280 px the events tab opens on the newest event, whose retained table shows every
    retained checkpoint and savepoint: id, kind, decoded position, size, files, age and the
    pointer last (relative to its directory), every cell drawn on screen without scrolling
    sideways once Dagster's navigation is hidden ("Hide navigation"). Beside the navigation
    the event panel leaves about 490 px for metadata values, less than a full S3 pointer of
    the test's buckets needs (``savepoint_pointer``, ``checkpoint_pointer``: about 555 px
    that cannot wrap), and the panel then scrolls sideways whatever the table."""
    _chromium_or_skip()
    screenshot = artifacts_dir / "user_activity_retained.png"
    savepoint_name = savepointed["savepoint_pointer"].rstrip("/").rsplit("/", 1)[-1]
    waits = ["retained", savepoint_name]
    with asset_events_page(dagster_dev, tmp_path / "chromium-profile", waits, screenshot) as page:
        page.get_by_text("Hide navigation", exact=True).click()
        page.get_by_text("Hide navigation", exact=True).wait_for(state="hidden", timeout=10_000)
        header, *rows = shown_table(page)
        cells = retained_table_element(page)
        problems = {
            text: on_screen(cell)
            for cell in cells.locator("th, td").all()
            if (text := cell.inner_text().strip())
        }
        page.screenshot(path=str(screenshot), full_page=True)
    assert RETAINED_COLUMNS == header, f"columns {header} (see {screenshot})"
    recorded = [[[str(r[c]) for c in RETAINED_COLUMNS] for r in t] for t in retained_tables(
        dagster_dev)]  # fmt: skip
    assert rows in recorded, f"the table shown is no event's retained table (see {screenshot})"
    assert savepoint_name in [r[-1] for r in rows if r[1] == "savepoint"], rows
    assert {} == {t: p for t, p in problems.items() if p}, f"not on screen (see {screenshot})"
    assert all(r[-1].startswith(("chk-", "savepoint-")) for r in rows), rows


@pytest.mark.timeout(600)
def test_each_event_says_what_it_is(
    dagster_dev: DagsterDev, materialized: dict, savepointed: dict, artifacts_dir: Path, tmp_path
):
    """Each event of the state asset says first whether it is a materialization, a savepoint
    or a retention tick: its description and its first metadata entry ``event``, in the
    event's panel (Dagster's event list shows only the time, the partition and an icon)."""
    _chromium_or_skip()
    events = dagster_dev.materializations() + dagster_dev.observations()
    newest = {}  # the newest event of each kind
    for event in sorted(events, key=lambda e: float(e["timestamp"])):
        newest[metadata(event).get("event")] = event
    assert {"materialization", "savepoint"} <= set(newest), sorted(map(str, newest))
    seen = {}
    for recorded, event in newest.items():
        screenshot = artifacts_dir / f"user_activity_event_{str(recorded).replace(' ', '_')}.png"
        # The events tab opens the event at ``time`` (what clicking it in the list does).
        path = f"user_activity?view=events&time={event['timestamp']}"
        with asset_events_page(dagster_dev, tmp_path / f"profile-{recorded}", ["event"],
                               screenshot, path=path) as page:  # fmt: skip
            row = page.locator("tr", has=page.locator("td", has_text=re.compile("^event$")))
            kind = row.first.locator("td").nth(1).inner_text().strip()
            description = page.get_by_text(re.compile("^(" + "|".join(
                re.escape(d) for d in EVENT_DESCRIPTIONS.values()) + ")")).first  # fmt: skip
            seen[recorded] = (kind, description.inner_text().strip(), on_screen(description))
    for recorded, (kind, description, problem) in seen.items():
        assert recorded == kind, seen
        assert description.startswith(EVENT_DESCRIPTIONS[kind]), seen
        assert problem is None, seen
