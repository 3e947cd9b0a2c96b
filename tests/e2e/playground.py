"""The browser of the playground's tests: Debian's Chromium (`/usr/bin/chromium`, installed by
`.ci/run` with apt) driven by Playwright for Python; Playwright's own browser download is not
used. Without Chromium or Playwright the tests skip, saying which is missing; under `CI` they fail,
like the services of tests/e2e/conftest.py.

    def test_it_does(embedded, artifacts):
        with browser_page(embedded.base_url) as page:
            page.goto(f"{embedded.base_url}/#chat")
            ...
            screenshot(page, artifacts, "chat")

Screenshots go to `$HYPNOS_TEST_ARTIFACTS` when it is set, else to a pytest temporary folder.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Page

CHROMIUM = Path(os.environ.get("HYPNOS_CHROMIUM", "/usr/bin/chromium"))
# The fake microphone and camera: no permission prompt, and a test tone (or the WAV given to
# browser_page) in place of a real device.
MEDIA_ARGS = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]
# What a step may take on a slow, loaded 2-core machine (a model load, a first token, an entity
# extraction: 9 s idle, 41 s measured beside other work): the tests wait for conditions with
# this bound, never for a fixed time.
SLOW_MS = 300_000


def require_browser() -> None:
    """Skip (fail under CI) when Playwright or Chromium is missing."""
    problem = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        problem = f"Playwright for Python is not installed ({exc}); it is in requirements/dev.txt"
    if problem is None and not os.access(CHROMIUM, os.X_OK):
        problem = f"Chromium is not at {CHROMIUM}; install it with `apt-get install -y chromium`"
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(problem)
        pytest.skip(problem)


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder screenshots are saved in: $HYPNOS_TEST_ARTIFACTS, else a temporary one. Being
    session-scoped, it is set up before a module's server: a browser test that asks for it skips
    (fails under CI) for a missing browser before any server starts."""
    require_browser()
    configured = os.environ.get("HYPNOS_TEST_ARTIFACTS")
    folder = Path(configured) if configured else tmp_path_factory.mktemp("browser-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextmanager
def browser_page(
    base_url: str,
    *,
    fake_audio: Path | None = None,
    local_storage: dict[str, str] | None = None,
    viewport: dict[str, int] | None = None,
    extra_args: list[str] | None = None,
) -> Iterator[Page]:
    """A page on headless Chromium, closed (browser and all) when the block ends.

    `fake_audio`: a WAV the fake microphone plays (`--use-file-for-fake-audio-capture`), looped.
    `local_storage`: items set on the server's origin before any page script runs (the API key,
    "hypnos.key"). `extra_args`: more Chromium switches."""
    require_browser()
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=SLOW_MS)

    args = [*MEDIA_ARGS, *(extra_args or [])]
    if fake_audio is not None:
        args.append(f"--use-file-for-fake-audio-capture={fake_audio}")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=args)
        try:
            context = browser.new_context(viewport=viewport or {"width": 1280, "height": 900})
            context.set_default_timeout(SLOW_MS)
            if local_storage:
                context.add_init_script(_local_storage_script(local_storage))
            page = context.new_page()
            # Shown with a failing test's captured output: what the page's scripts complained of.
            page.on("console", lambda message: print(f"browser console {message.type}: {message.text}"))
            page.on("pageerror", lambda error: print(f"browser page error: {error}"))
            yield page
            context.close()
        finally:
            browser.close()


def _local_storage_script(items: dict[str, str]) -> str:
    return "".join(f"window.localStorage.setItem({json.dumps(k)}, {json.dumps(v)});" for k, v in items.items())


def screenshot(page: Page, artifacts: Path, name: str, **options: Any) -> Path:
    """A full-page PNG named `playground-<name>.png` in `artifacts`; answers its path."""
    path = artifacts / f"playground-{re.sub(r'[^a-z0-9_-]+', '-', name.lower())}.png"
    page.screenshot(path=str(path), full_page=True, **options)
    return path


def open_panel(page: Page, base_url: str, panel: str) -> Any:
    """Load the playground on `panel` (its tab selected by the URL's fragment); answers the
    panel's element once its module has mounted."""
    page.goto(f"{base_url}/#{panel}")
    return show_panel(page, panel)


def show_panel(page: Page, panel: str) -> Any:
    """Select `panel`'s tab by clicking it; answers the panel's element once mounted."""
    from playwright.sync_api import expect

    tab = page.get_by_role("tab", name=re.compile(PANEL_TITLES.get(panel, panel), re.I))
    tab.click()
    expect(tab).to_have_attribute("aria-selected", "true")
    element = page.locator(f"#panel-{panel}")
    expect(element).to_have_attribute("data-available", re.compile("true|false"), timeout=SLOW_MS)
    return element


PANEL_TITLES = {
    "chat": "^chat$",
    "voice": "^voice$",
    "images": "^images$",
    "documents": "^documents$",
    "entities": "^entities$",
    "tiers": "^memory tiers$",
}
