"""The web pages in a real browser: Debian's chromium, headless, driven by playwright, against the service on a
real socket (uvicorn on 127.0.0.1, in a thread) with a seeded store.

Every page renders, every link answers, the pictures load, the search form works without script, a running job's
page follows its progress and stops reloading when it ends, a server that requires the read token is read with
it as the password the browser asks for, and no page logs a console error or fails a request. Chromium runs
with a fresh profile and flags that keep it from connecting anywhere but the test's server (tests address
loopback only). Screenshots of every page go to ``$REMAT_UI_SCREENSHOTS`` when set (look at them when changing
a page), else to the test's temporary directory.

Skipped, with the reason, where chromium or playwright is missing; failed under ``CI=true`` (.ci/run installs
chromium). Never ``playwright install``: the browser is the system's.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from remat.client.job_state import JobState
from remat.service import jobs, migrate
from remat.service.api import app as app_module
from remat.service.db import Database
from remat.service.ui.links import key_url
from tests.conftest import require_service
from tests.utils.live_service import live_database_url, live_service
from tests.utils.ui_seed import Seeded, seed_jobs, seed_keys

CHROMIUM = Path(os.environ.get("REMAT_TEST_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
READ_TOKEN = "browser-read-token"
WAIT_MS = 30_000
"""How long an expected change may take to show: a running job's page reloads every 2 s, and a reload on a
loaded machine may take several more."""
STEP_MS = 30_000
"""How long one action or check may wait for the page: playwright's default. These tests check what the pages
do, not how fast: a shorter limit made them fail when the machine was busy (5 s, the first page of a fresh
browser, once in CI while three test processes ran torch), and a page that works never waits for it."""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Chromium, headless, with a fresh profile (playwright's ``launch`` gives each browser a new temporary
    ``--user-data-dir``) and the flags above."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        require_service("playwright", False, f"{exc} (uv sync installs it)")
    require_service("chromium", CHROMIUM.is_file(), f"{CHROMIUM} is missing (apt-get install chromium)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS)
        yield launched
        launched.close()


@dataclass
class Site:
    url: str
    db: Database
    seeded: Seeded


def _site(directory: Path, **settings: Any) -> Iterator[Site]:
    db = Database(live_database_url(directory))
    migrate.upgrade(db)
    seeded = seed_jobs(db, into=seed_keys(db, 12))
    # The pages need no model zoo: skip the start-up preload of its names, which imports torch for seconds of
    # this process's CPU while the browser runs.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(app_module, "_load_zoo_names", lambda serving: None)
        with live_service(directory, **settings) as url:
            yield Site(url=url, db=db, seeded=seeded)
    db.dispose()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    yield from _site(tmp_path_factory.mktemp("ui-browser"))


@dataclass
class Watched:
    """A page and what went wrong on it: console errors, uncaught exceptions, failed requests."""

    page: Any
    problems: list[str] = field(default_factory=list)
    screenshots: Path = Path()

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(self.screenshots / f"{name}.png"), full_page=True)


def _watch(context: Any, screenshots: Path) -> Watched:
    context.set_default_timeout(STEP_MS)
    page = context.new_page()
    watched = Watched(page=page, screenshots=screenshots)
    page.on("console", lambda m: watched.problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: watched.problems.append(f"page error: {e}"))
    # (A navigation aborts what the page it leaves was still loading, its icon say: that is no failure.)
    page.on("requestfailed", lambda r: watched.problems.append(f"request failed: {r.url} {r.failure}")
            if "ERR_ABORTED" not in (r.failure or "") else None)
    page.on("response", lambda r: watched.problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
    return watched


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    where = Path(os.environ["REMAT_UI_SCREENSHOTS"]) if os.environ.get("REMAT_UI_SCREENSHOTS") else tmp_path
    where.mkdir(parents=True, exist_ok=True)
    return where


@pytest.fixture
def watched(browser: Any, screenshots: Path) -> Iterator[Watched]:
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    watched = _watch(context, screenshots)
    yield watched
    context.close()
    assert not watched.problems, "\n".join(watched.problems)


# NOTE [ reading after a click ] A click on a link returns once the navigation starts, not once the next page
# is there: counting rows right after it read the page being left (0 jobs where 8 are listed, once in CI).
# Every click that navigates waits for the next page's load (``expect_navigation``) before anything is read.


def _images_loaded(page: Any) -> list[bool]:
    """Whether each picture of the page loaded and decoded (after the page's load event)."""
    page.wait_for_load_state("load")
    return page.eval_on_selector_all("img", "imgs => imgs.map(i => i.complete && i.naturalWidth > 0)")


def test_every_page_renders_and_every_link_answers(watched: Watched, site: Site) -> None:
    page = watched.page
    page.goto(site.url + "/")
    with page.expect_navigation():  # NOTE [ reading after a click ]
        page.click("text=The plan cache")
    assert page.locator("h1").inner_text() == "Architectures"
    assert page.locator("#architectures tbody tr").count() == 12
    watched.shot("architectures")

    seen: set[str] = set()
    pages = ["/ui/", "/ui/jobs", "/ui/zoo", f"/ui/zoo/{site.seeded.batch_id}", key_url(site.seeded.keys[0])]
    for path in pages:
        page.goto(site.url + path)
        for href in page.eval_on_selector_all("a[href^='/ui']", "links => links.map(a => a.getAttribute('href'))"):
            target = href.split("#")[0]
            if target not in seen:
                seen.add(target)
                response = page.request.get(site.url + target)
                assert response.status == 200, (path, target, response.status)
    assert len(seen) > 30


def test_a_key_page_shows_its_plans_pictures_stages_and_lines(watched: Watched, site: Site) -> None:
    page = watched.page
    page.goto(site.url + "/ui/")
    first = page.locator("#architectures tbody tr").first
    model = first.locator("a.key").inner_text()
    with page.expect_navigation():
        first.locator("a.key").click()
    assert model in page.locator("h1").inner_text()
    assert page.locator("#plans tbody tr").count() >= 7
    assert page.locator("#pictures img").count() == 2 and all(_images_loaded(page))
    assert page.locator("#stages tbody tr").count() > 0
    assert "remat.client.fetch_and_apply(model, (2, 3, 64, 64)" in page.locator("#fetch").inner_text()
    watched.shot("key")
    with page.expect_navigation():
        page.locator("#plans tbody tr", has_text="chen-sqrt").locator("a", has_text="show").click()
    assert "algorithm=chen-sqrt" in page.url
    assert "chen-sqrt" in page.locator("#pictures img").first.get_attribute("src")
    assert all(_images_loaded(page)) and "--algorithm chen-sqrt" in page.locator("#fetch").inner_text()
    page.locator("#pictures figure").first.screenshot(path=str(watched.screenshots / "timeline.png"))


def test_the_search_form_filters_without_script(watched: Watched, site: Site) -> None:
    page = watched.page
    page.goto(site.url + "/ui/")
    page.fill("#q", "resnet")
    page.press("#q", "Enter")
    page.wait_for_url(re.compile(r".*\?q=resnet"))
    names = page.locator("#architectures a.key").all_inner_texts()
    assert names and all("resnet" in name for name in names) and len(names) < 12
    page.fill("#q", "no-such-model")
    with page.expect_navigation():
        page.click("button[type=submit]")
    assert "No stored key matches" in page.locator("#architectures").inner_text()


def test_jobs_and_batches_show_state_progress_and_reasons(watched: Watched, site: Site) -> None:
    page = watched.page
    page.goto(site.url + "/ui/")
    with page.expect_navigation():
        page.click("nav >> text=Jobs")
    assert page.locator("#jobs tbody tr").count() == 8
    assert "RuntimeError: out of memory" in page.locator("#jobs").inner_text()
    watched.shot("jobs")
    with page.expect_navigation():
        page.click("nav >> text=Zoo batches")
    with page.expect_navigation():
        page.locator("#batches a").first.click()
    assert "2 of 4 finished" in page.locator("#batch-progress").inner_text()
    watched.shot("zoo-batch")
    with page.expect_navigation():
        page.locator("#models tr", has_text="mobilenet_v3_small").locator("a").click()
    assert "out of memory" in page.locator("#job-error").inner_text()
    page.goto(site.url + f"/ui/jobs/{site.seeded.jobs['succeeded'].id}")
    with page.expect_navigation():
        page.locator("dd a[href^='/ui/plans/']").click()
    assert page.locator("#plans").is_visible()


def test_a_running_jobs_page_follows_its_progress_and_stops_when_it_ends(watched: Watched, site: Site) -> None:
    from playwright.sync_api import expect

    page = watched.page
    job = site.seeded.jobs[JobState.RUNNING.value]
    page.goto(site.url + f"/ui/jobs/{job.id}")
    expect(page.locator("#job-progress")).to_contain_text("40%")
    with site.db.write_session() as session:
        jobs.update_job(session=session, job_id=job.id, progress=0.75, message="measuring cubic")
    expect(page.locator("#job-progress")).to_contain_text("75%", timeout=WAIT_MS)
    expect(page.locator("#job-message")).to_have_text("measuring cubic")
    watched.shot("job-running")
    with site.db.write_session() as session:
        jobs.update_job(session=session, job_id=job.id, state=JobState.FAILED, error="killed by the OOM killer")
    expect(page.locator("#job-state")).to_have_text("failed", timeout=WAIT_MS)
    expect(page.locator("#job-error")).to_have_text("killed by the OOM killer")
    loads: list[str] = []
    page.on("load", lambda: loads.append(page.url))
    time.sleep(2.2)  # longer than one reload period: a finished job's page stays put
    assert not loads


def test_a_server_that_requires_the_read_token_is_read_with_it(browser: Any, screenshots: Path,
                                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    for site in _site(tmp_path_factory.mktemp("ui-browser-token"), read_token_required=True,
                      read_token=READ_TOKEN):
        anonymous = browser.new_context()  # (a navigation without credentials ends in the browser's auth error)
        refused = anonymous.request.get(site.url + "/ui/")
        assert refused.status == 401 and refused.headers["www-authenticate"].startswith("Basic")
        anonymous.close()
        context = browser.new_context(http_credentials={"username": "me", "password": READ_TOKEN})
        watched = _watch(context, screenshots)
        watched.page.goto(site.url + key_url(site.seeded.keys[0]))
        assert all(_images_loaded(watched.page)) and watched.page.locator("#plans tbody tr").count() >= 7
        assert 'os.environ["REMAT_READ_TOKEN"]' in watched.page.locator("#fetch").inner_text()
        context.close()
        assert not watched.problems, "\n".join(watched.problems)


def test_names_of_close_plans_on_a_picture_cover_no_other_name_and_stay_in_the_plot(watched: Watched) -> None:
    from remat.service.ui.svg import Figure

    # Six planners a few pixels apart, as ResNet-18's trade picture had them, and one name at the plot's corner.
    figure = Figure(title="close plans", x_label="activation peak (MiB)", y_label="overhead (%)",
                    x_range=(0.0, 17.0), y_range=(0.0, 35.0))
    plans = {"chen-greedy": (5.8, 30.0), "uniform": (6.2, 25.5), "chen-sqrt": (6.35, 26.0), "cubic": (7.0, 24.0),
             "acg": (6.7, 23.0), "linear, nested": (6.35, 25.0), "a-very-long-planner-name": (16.9, 34.9)}
    figure.points([x for x, _ in plans.values()], [y for _, y in plans.values()], colour="#888",
                  names=list(plans))
    page = watched.page
    page.set_content(f"<!doctype html><html><body style='margin:0'>{figure.svg()}</body></html>")
    # The browser's own measure of every text drawn (its font, not the builder's estimate of it).
    boxes = page.eval_on_selector_all("svg text", """texts => texts.map(t => {
        const b = t.getBBox(); return [t.textContent, b.x, b.y, b.x + b.width, b.y + b.height]; })""")
    names = {name: box for name, *box in boxes if name in plans}
    assert set(names) == set(plans), boxes
    plot = (figure.left, figure.top, figure.width - figure.right, figure.height - figure.bottom)
    for name, (x0, y0, x1, y1) in names.items():
        assert plot[0] <= x0 and x1 <= plot[2] and plot[1] <= y0 and y1 <= plot[3], (name, (x0, y0, x1, y1), plot)
    for first, a in names.items():
        for second, b in names.items():
            if first < second:
                assert not (a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]), (first, a, second, b)
    watched.shot("close-plans")
