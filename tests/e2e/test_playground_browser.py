"""The web playground at / in a real browser (issue 19): headless Chromium on the shared embedded
server, the page's own scripts calling the API. Every step waits for a condition the page shows
(Playwright's expect, bounded by SLOW_MS for a loaded 2-core machine), never for a fixed time.
Screenshots of each panel land in the artifacts folder (tests/e2e/playground.py)."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import pytest

from tests.e2e.playground import SLOW_MS, browser_page, open_panel, screenshot, show_panel

# Each test loads the models of its panel and waits on a few of their answers, each bounded by
# SLOW_MS on a machine that may be busy: more than the suite's 240 s per test.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

CHAT_MODEL = "smollm2-135m"
TOOL_MODEL = "qwen2.5-coder-0.5b"  # the tool tests' model (tests/e2e/test_chat_features.py)
ENTITY_MODEL = "qwen2.5-coder-0.5b"
KEY = "pg-browser-test-key"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def expect(target: Any) -> Any:
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(target)


def memory_model(base_url: str, model: str) -> dict[str, Any]:
    status = httpx.get(f"{base_url}/v1/memory/status", timeout=30).json()
    return next(m for m in status["models"] if m["id"] == model)


def log_record(base_url: str, request_id: str) -> dict[str, Any] | None:
    answer = httpx.get(f"{base_url}/v1/logs/{request_id}", timeout=30)
    return answer.json() if answer.status_code == 200 else None


def wait_until(condition, what: str, timeout: float = SLOW_MS / 1000) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def move(base_url: str, model: str, tier: str) -> None:
    body = {"model": model, "target_tier": tier}
    answer = httpx.post(f"{base_url}/v1/memory/tier", json=body, timeout=SLOW_MS / 1000)
    assert answer.status_code == 200, answer.text


def test_it_serves_the_page_to_browsers_and_ollamas_answer_to_everyone_else(embedded):
    page = httpx.get(f"{embedded.base_url}/", headers={"Accept": "text/html,*/*;q=0.8"}, timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "Hypnos playground" in page.text and "Accept" in page.headers["vary"]
    script = re.search(r'<script type="module" src="([^"]+)"', page.text)
    assert script is not None
    served = httpx.get(f"{embedded.base_url}{script.group(1)}", timeout=30)
    assert served.status_code == 200 and "javascript" in served.headers["content-type"]
    probe = httpx.get(f"{embedded.base_url}/", headers={"Accept": "*/*"}, timeout=30)
    assert probe.text == "Ollama is running"
    head = httpx.head(f"{embedded.base_url}/", timeout=30)
    assert head.status_code == 200 and head.content == b""


def test_a_chat_streams_tokens_into_the_page_and_stop_ends_the_generation(embedded, artifacts):
    with browser_page(embedded.base_url, local_storage={"hypnos.key": KEY}) as page:
        sent: list[tuple[str, str | None]] = []
        page.on("request", lambda request: sent.append((request.url, request.headers.get("authorization"))))
        panel = open_panel(page, embedded.base_url, "chat")
        expect(panel).to_have_attribute("data-available", "true")
        panel.get_by_label("Model", exact=True).select_option(CHAT_MODEL)
        panel.get_by_text("Sampling, tools and attachment").click()
        panel.get_by_label("Temperature").fill("0")
        panel.get_by_label("Max tokens").fill("2000")
        panel.get_by_label("Message").fill("Write a long story about a dragon.")
        panel.get_by_role("button", name="Send").click()

        answer = panel.locator("article.message.assistant").last
        text = answer.locator(".answer-text")
        # Tokens arrive while the answer is still streaming: some text, then more, and the
        # panel still streaming after both.
        expect(text).to_have_text(re.compile(r"\S"))
        first = len(text.inner_text())
        expect(text).to_have_text(re.compile(rf"^[\s\S]{{{first + 40},}}$"))
        expect(panel).to_have_attribute("data-state", "streaming")

        panel.get_by_role("button", name="Stop").click()
        expect(panel).to_have_attribute("data-state", "idle")
        expect(panel.get_by_role("status")).to_have_text("stopped")
        expect(answer).to_have_attribute("data-finish", "stopped")
        expect(panel.get_by_role("button", name="Send")).to_be_enabled()
        expect(panel.get_by_role("button", name="Stop")).to_be_disabled()
        stopped_at = text.inner_text()
        screenshot(page, artifacts, "chat-stopped")
        request_id = answer.locator('dd[data-field="request"]').inner_text()
        # The server cancelled: the model's lease is released, and the request's log record,
        # written when the stream ended, counts far fewer than the 2000 tokens asked for.
        wait_until(lambda: memory_model(embedded.base_url, CHAT_MODEL)["active_leases"] == 0, "the lease's release")
        wait_until(lambda: log_record(embedded.base_url, request_id) is not None, "the request's log record")
        record = log_record(embedded.base_url, request_id)
        assert record is not None and record["finish_reason"] == "cancelled" and record["tokens_out"] < 2000
        assert text.inner_text() == stopped_at
        assert len(stopped_at) > first

        api_calls = [(url, auth) for url, auth in sent if "/v1/" in url]
        assert api_calls and all(auth == f"Bearer {KEY}" for _, auth in api_calls)
        assert not any(KEY in url for url, _ in sent)


def test_an_answer_shows_its_telemetry_strip(embedded, artifacts):
    with browser_page(embedded.base_url) as page:
        panel = open_panel(page, embedded.base_url, "chat")
        panel.get_by_label("Model", exact=True).select_option(CHAT_MODEL)
        panel.get_by_label("System prompt").fill("You are terse.")
        panel.get_by_text("Sampling, tools and attachment").click()
        panel.get_by_label("Max tokens").fill("24")
        panel.get_by_label("Seed").fill("7")
        panel.get_by_label("Message").fill("What is the capital of France?")
        panel.get_by_label("Message").press("Control+Enter")

        answer = panel.locator("article.message.assistant").last
        expect(answer).to_have_attribute("data-finish", re.compile("stop|length"))
        strip = answer.get_by_label("Telemetry of this answer")
        # Where the model was when the request came: VRAM, unless a test before this one moved it.
        expect(strip.locator('dd[data-field="previous tier"]')).to_have_text(re.compile("^(VRAM|RAM|disk)$"))
        expect(strip.locator('dd[data-field="ttft"]')).to_have_text(re.compile(r"\d+ (ms|s)"))
        expect(strip.locator('dd[data-field="tokens/s"]')).to_have_text(re.compile(r"\d"))
        expect(strip.locator('dd[data-field="request"]')).to_have_text(re.compile(r"^req-[0-9a-f]{32}$"))
        expect(answer.locator(".answer-text")).to_have_text(re.compile(r"\S"))
        screenshot(page, artifacts, "chat")


def test_a_tool_call_and_a_json_mode_answer_show_in_the_chat(embedded, artifacts):
    with browser_page(embedded.base_url) as page:
        panel = open_panel(page, embedded.base_url, "chat")
        panel.get_by_label("Model", exact=True).select_option(TOOL_MODEL)
        panel.get_by_text("Sampling, tools and attachment").click()
        panel.get_by_label("Temperature").fill("0")
        panel.get_by_label("Tools (JSON array of OpenAI function tools)").fill(json.dumps([WEATHER]))
        panel.get_by_label("Message").fill("What's the weather in Paris?")
        panel.get_by_role("button", name="Send").click()
        answer = panel.locator("article.message.assistant").last
        expect(answer).to_have_attribute("data-finish", "tool_calls")
        call = answer.get_by_label("Tool calls").locator(".tool-call")
        expect(call).to_have_count(1)
        expect(call).to_contain_text("get_weather(")
        assert json.loads(call.locator("code").nth(1).inner_text()) == {"city": "Paris"}
        screenshot(page, artifacts, "chat-tools")

        panel.get_by_role("button", name="New conversation").click()
        panel.get_by_label("Tools (JSON array of OpenAI function tools)").fill("")
        panel.get_by_label("Model", exact=True).select_option(CHAT_MODEL)
        panel.get_by_label("Max tokens").fill("60")
        panel.get_by_label("JSON mode (response_format json_object)").check()
        panel.get_by_label("Message").fill("What is the capital of France? Answer in JSON.")
        panel.get_by_role("button", name="Send").click()
        answer = panel.locator("article.message.assistant").last
        expect(answer).to_have_attribute("data-finish", re.compile("^(stop|length)$"))
        expect(answer.locator(".answer-text")).to_have_text(re.compile(r"^\s*\{"))
        screenshot(page, artifacts, "chat-json")


def test_entity_spans_are_highlighted_by_label_with_their_scores(embedded, artifacts):
    with browser_page(embedded.base_url) as page:
        panel = open_panel(page, embedded.base_url, "entities")
        expect(panel).to_have_attribute("data-available", "true")
        panel.get_by_label("Model", exact=True).select_option(ENTITY_MODEL)
        panel.get_by_label("Text", exact=True).fill("Mario Rossi works in Milan for Ferrari.")
        panel.get_by_label("Labels (comma-separated, any phrases)").fill("person, city, company")
        panel.get_by_role("button", name="Extract").click()

        marks = panel.locator("mark.entity")
        expect(marks.first).to_be_visible()
        expect(panel.get_by_role("status")).to_have_text(re.compile(r"^\d+ spans? found$"))
        found = marks.evaluate_all("ms => ms.map(m => [m.firstChild.textContent, m.dataset.label, m.dataset.score])")
        assert found, "no span highlighted"
        for span_text, label, score in found:
            assert label in {"person", "city", "company"}
            assert span_text and span_text in "Mario Rossi works in Milan for Ferrari."
            assert 0 <= float(score) <= 1
        # Each label has its own colour.
        hues = marks.evaluate_all("ms => ms.map(m => [m.dataset.label, getComputedStyle(m).backgroundColor])")
        assert len({label for label, _ in hues}) == len({colour for _, colour in hues})
        screenshot(page, artifacts, "entities")


def test_the_tier_view_shows_a_model_a_request_in_another_panel_loads_and_the_one_it_evicts(embedded, artifacts):
    # From a known start, whatever the tests before this one did: the entity model on disk, the
    # chat model in VRAM, and tier 1 capped at one model (Lemonade's max_loaded_models), so the
    # entity model's load evicts the chat model.
    move(embedded.base_url, ENTITY_MODEL, "tier3_nvme_ssd")
    move(embedded.base_url, CHAT_MODEL, "tier1_gpu_vram")
    set_max_loaded_models(embedded.base_url, 1)
    try:
        tier_view_through_a_load(embedded.base_url, artifacts)
    finally:
        set_max_loaded_models(embedded.base_url, None)


def set_max_loaded_models(base_url: str, count: int | None) -> None:
    answer = httpx.post(f"{base_url}/internal/set", json={"max_loaded_models": count}, timeout=30)
    assert answer.status_code == 200 and answer.json()["max_loaded_models"] == count, answer.text


def tier_view_through_a_load(base_url: str, artifacts: Any) -> None:
    with browser_page(base_url) as page:
        tiers = open_panel(page, base_url, "tiers")
        disk = tiers.locator('.tier-column[data-tier="tier3_nvme_ssd"]')
        vram = tiers.locator('.tier-column[data-tier="tier1_gpu_vram"]')
        expect(tiers.locator(f'.tier-column [data-model="{CHAT_MODEL}"]')).to_be_visible()
        expect(disk.locator(f'[data-model="{ENTITY_MODEL}"]')).to_be_visible()

        # A request from the entities panel loads the model ...
        entities = show_panel(page, "entities")
        entities.get_by_label("Model", exact=True).select_option(ENTITY_MODEL)
        entities.get_by_role("button", name="Extract").click()
        expect(entities.get_by_role("status")).to_have_text(re.compile(r"spans? found"))

        # ... and the tier view draws it in VRAM, marked as moved from disk.
        show_panel(page, "tiers")
        card = vram.locator(f'[data-model="{ENTITY_MODEL}"]')
        expect(card).to_be_visible()
        expect(card.locator(".moved-note")).to_have_text("moved here from disk")
        expect(disk.locator(f'[data-model="{ENTITY_MODEL}"]')).to_have_count(0)
        # The model it evicted left VRAM, and the evictions list says why and for whom.
        expect(vram.locator(f'[data-model="{CHAT_MODEL}"]')).to_have_count(0)
        evicted = tiers.locator(f'.evictions li[data-model="{CHAT_MODEL}"]').first
        expect(evicted).to_contain_text(f"for {ENTITY_MODEL}: max_loaded_models")
        expect(tiers.locator('[data-budget="tier1_gpu_vram"] [role="meter"]')).to_have_attribute(
            "aria-valuenow", re.compile(r"^[1-9]\d*$")
        )
        screenshot(page, artifacts, "tiers")

        # Moved by hand: demote to RAM with the button (no keys here, so no admin key needed).
        card.get_by_role("button", name=f"Demote {ENTITY_MODEL} to RAM").click()
        ram_card = tiers.locator(f'.tier-column[data-tier="tier2_pinned_ram"] [data-model="{ENTITY_MODEL}"]')
        expect(ram_card).to_be_visible()
        assert memory_model(base_url, ENTITY_MODEL)["current_tier"] == "tier2_pinned_ram"


def test_the_tabs_work_from_the_keyboard_and_every_control_has_a_label(embedded, artifacts):
    with browser_page(embedded.base_url) as page:
        open_panel(page, embedded.base_url, "chat")
        page.get_by_role("tab", name="Chat").focus()
        page.keyboard.press("ArrowRight")
        focused = page.evaluate("[document.activeElement.getAttribute('aria-selected'), document.activeElement.id]")
        assert focused[0] == "true" and focused[1] != "tab-chat"
        for panel in ("chat", "entities", "tiers"):
            element = show_panel(page, panel)
            expect(element).to_have_attribute("data-available", "true")
            unlabelled = element.evaluate(
                """panel => [...document.querySelectorAll('input, select, textarea, button')]
                    .filter(c => !c.closest('[hidden]') && c.offsetParent !== null)
                    .filter(c => !(c.labels && c.labels.length) && !c.getAttribute('aria-label')
                                 && !(c.tagName === 'BUTTON' && c.textContent.trim()))
                    .map(c => c.outerHTML.slice(0, 120))"""
            )
            assert unlabelled == [], f"{panel}: controls without a label: {unlabelled}"
        screenshot(page, artifacts, "shell")


def test_the_page_calls_the_api_under_a_reverse_proxy_prefix(embedded, artifacts):
    # A proxy serving the server under /hypnos/, stripping the prefix: the page's API calls must
    # keep it (relative URLs), or they would miss the proxy.
    with browser_page(embedded.base_url) as page:
        proxied: list[str] = []

        def strip_prefix(route: Any) -> None:
            proxied.append(route.request.url)
            route.continue_(url=route.request.url.replace("/hypnos/", "/", 1))

        page.route(re.compile(r"^http://127\.0\.0\.1:\d+/hypnos/"), strip_prefix)
        page.goto(f"{embedded.base_url}/hypnos/#tiers")
        panel = page.locator("#panel-tiers")
        expect(panel).to_have_attribute("data-available", "true")
        expect(panel.locator(f'.tier-column [data-model="{CHAT_MODEL}"]')).to_be_visible()
        assert any(url.endswith("/hypnos/v1/memory/status") for url in proxied)


def test_the_admin_is_styled_under_daphne(embedded, artifacts):
    """/static/ answers under daphne (WhiteNoise, hypnos_site/static_files.py), so the admin's
    pages are drawn with Django's styles: the header painted, the login form laid out."""
    with browser_page(embedded.base_url) as page:
        failed: list[str] = []
        page.on("response", lambda response: failed.append(response.url) if response.status >= 400 else None)
        page.goto(f"{embedded.base_url}/admin/login/")
        header = page.locator("#header")
        expect(header).to_be_visible()
        # base.css paints the header (--header-bg); unstyled, it is transparent.
        background = header.evaluate("element => getComputedStyle(element).backgroundColor")
        assert background not in ("rgba(0, 0, 0, 0)", "transparent"), background
        # login.css centres the form in a box of fixed width; unstyled, it spans the page.
        width = page.locator("#container").evaluate("element => element.getBoundingClientRect().width")
        assert width < 1280 / 2, width
        assert not failed, failed
        screenshot(page, artifacts, "admin-login")
