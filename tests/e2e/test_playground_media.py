"""The playground's media panels (issue 19) in headless Chromium against the embedded server and
its real models: a DCGAN face generated, shown with its seed and upscaled by Real-ESRGAN; a PDF's
pages appearing one by one as the SSE stream delivers them, with a picture from the store; a
voice turn spoken into Chromium's fake microphone (a WAV of the server's own speech) that comes
back as audio. Every wait is for a condition, bounded generously for a slow, loaded machine."""

from __future__ import annotations

import io
import re
import time
import wave
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from tests import documents
from tests.e2e.conftest import Server
from tests.e2e.playground import SLOW_MS, browser_page, open_panel, screenshot

# Each test loads the models of its panel (docling, or Whisper, the chat model and Piper) on a
# machine that may be busy: more than the suite's 240 s per test.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
GAN = "dcgan-faces"
# A document's first page waits for docling to load; every scanned page is OCR'd (~2 s each).
CONVERSION_MS = 300_000
QUESTION = "Hello world. The weather is nice today."
QUESTION_WORDS = {"hello", "world", "weather", "nice", "today"}
WORKFLOW = "playground-voice"  # voice.js WORKFLOW


def expect(target: Any) -> Any:
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(target)


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def padded_wav(wav: bytes, path: Path, before_secs: float = 0.5, after_secs: float = 1.5) -> float:
    """`wav` with silence around it, written to `path` for the fake microphone, which loops its
    file: the silence keeps the recording's start and end out of the words. Answers its length
    in seconds."""
    with wave.open(io.BytesIO(wav)) as source:
        params = source.getparams()
        frames = source.readframes(params.nframes)
    frame_bytes = params.sampwidth * params.nchannels
    silence = [b"\0" * frame_bytes * int(params.framerate * secs) for secs in (before_secs, after_secs)]
    with wave.open(str(path), "wb") as target:
        target.setparams(params)
        target.writeframes(silence[0] + frames + silence[1])
    return (len(frames) + len(silence[0]) + len(silence[1])) / frame_bytes / params.framerate


def test_an_image_is_generated_shown_with_its_seed_and_upscaled(embedded: Server, artifacts: Path, tmp_path: Path):
    expected = httpx.post(
        f"{embedded.base_url}/v1/images/generations",
        json={"model": GAN, "prompt": "a face", "size": "64x64", "seed": 7},
        timeout=SLOW_MS / 1000,
    )
    assert expected.status_code == 200, expected.text
    with browser_page(embedded.base_url) as page:
        panel = open_panel(page, embedded.base_url, "images")
        generate = panel.locator("form[data-op=generate]")
        generate.get_by_label("Model").select_option(GAN)
        expect(generate.locator(".img-hint")).to_contain_text("does not read the prompt")
        generate.get_by_label("Prompt").fill("a face")
        generate.get_by_label("Size").select_option("64x64")
        generate.get_by_label("Seed").fill("7")
        generate.get_by_label("Seed").press("Enter")  # the keyboard submits the form
        face = panel.locator(".img-item").filter(has=page.locator(".img-seed[data-seed='7']"))
        expect(face).to_have_count(1)
        expect(face.locator(".img-seed")).to_have_text("seed 7")
        expect(face.locator("img")).to_have_js_property("naturalWidth", 64)
        # The page shows the server's image for that seed, byte for byte.
        source = face.locator("img").get_attribute("src") or ""
        assert source == f"data:image/png;base64,{expected.json()['data'][0]['b64_json']}"

        face.get_by_role("button", name="Upscale the image with seed 7").click()
        bigger = panel.locator(".img-item").filter(has_text="upscaled 2x by realesrgan-x4 from seed 7")
        expect(bigger.locator("img")).to_have_js_property("naturalWidth", 128)
        expect(panel.locator(".img-item")).to_have_count(2)
        expect(panel.locator("p.status")).to_contain_text("Upscaling: done")

        # An uploaded picture, upscaled 3x.
        Image.new("RGB", (40, 30), (200, 120, 40)).save(tmp_path / "upload.png")
        upscale = panel.locator("form[data-op=upscale]")
        upscale.get_by_label("Image to upscale").set_input_files(tmp_path / "upload.png")
        upscale.get_by_label("Factor").select_option("3")
        upscale.get_by_role("button", name="Upscale", exact=True).click()
        uploaded = panel.locator(".img-item").filter(has_text="upscaled 3x by realesrgan-x4")
        expect(uploaded.locator("img")).to_have_js_property("naturalWidth", 120)
        expect(uploaded.locator(".img-seed")).to_have_count(0)
        screenshot(page, artifacts, "images")


def test_a_documents_pages_appear_one_by_one_with_pictures_from_the_store(
    embedded: Server, artifacts: Path, tmp_path: Path
):
    scans = documents.scanned_pages_pdf(tmp_path / "scans.pdf", 3)
    report = documents.multipage_pdf(tmp_path / "report.pdf")
    with browser_page(embedded.base_url) as page:
        panel = open_panel(page, embedded.base_url, "documents")
        pages = panel.locator(".doc-page")
        expect(panel.locator(".doc-pages")).to_be_attached()  # the module has mounted
        # Each change of the page list, as the page's own scripts see it: the number of pages
        # after every DOM mutation of the list.
        page.evaluate(
            """() => {
                const list = document.querySelector("#panel-documents .doc-pages");
                window.pageCounts = [];
                new MutationObserver(() => window.pageCounts.push(list.children.length))
                    .observe(list, { childList: true });
            }"""
        )
        panel.get_by_label("Document").set_input_files(scans)
        panel.get_by_role("button", name="Convert").click()
        expect(panel.locator(".doc-pages")).to_have_attribute("data-done", "true", timeout=CONVERSION_MS)
        # The list grew page by page: one page shown while the others were still converting
        # (each scanned page is OCR'd for a second or two, so their events arrive apart).
        counts = [n for n in page.evaluate("window.pageCounts") if n]
        assert counts[0] < 3 and counts[-1] == 3 and counts == sorted(counts), counts
        assert pages.evaluate_all("items => items.map(item => item.dataset.page)") == ["1", "2", "3"]
        for number in (1, 2, 3):
            expect(pages.nth(number - 1).locator(".doc-markdown")).to_contain_text(
                re.compile(rf"Scanned page {number}", re.I)
            )
        expect(panel.locator(".doc-status")).to_have_text("Done: 3 pages.")
        screenshot(page, artifacts, "documents-scans")

        panel.get_by_label("Document").set_input_files(report)
        panel.get_by_role("button", name="Convert").click()
        expect(panel.locator(".doc-pages")).to_have_attribute("data-done", "true", timeout=CONVERSION_MS)
        expect(pages).to_have_count(3)
        expect(pages.first.locator(".doc-markdown")).to_contain_text(documents.TITLE)
        picture = pages.nth(1).locator(".doc-picture img")
        expect(picture).to_have_count(1)
        assert picture.evaluate("image => image.decode().then(() => image.naturalWidth)") > 0
        assert (picture.get_attribute("src") or "").startswith("data:image/png;base64,")
        expect(panel.locator(".doc-summary")).to_contain_text("pictures are kept until")
        screenshot(page, artifacts, "documents")


def test_a_voice_turn_from_the_fake_microphone_is_answered_aloud(embedded: Server, artifacts: Path, tmp_path: Path):
    speech = httpx.post(
        f"{embedded.base_url}/v1/audio/speech",
        json={"model": "tts-1", "input": QUESTION, "response_format": "wav"},
        timeout=SLOW_MS / 1000,
    )
    assert speech.status_code == 200 and speech.headers["content-type"] == "audio/wav", speech.text
    clip_secs = padded_wav(speech.content, tmp_path / "question.wav")
    with browser_page(embedded.base_url, fake_audio=tmp_path / "question.wav") as page:
        panel = open_panel(page, embedded.base_url, "voice")
        panel.get_by_label("Chat model").select_option("smollm2-135m")
        record = panel.locator("button.voice-record")
        expect(record).to_have_text("Record")
        record.click()
        expect(record).to_have_attribute("aria-pressed", "true")
        # The fake microphone starts its file when the capture opens: a recording as long as
        # the file holds the whole question, and stops in the trailing silence.
        page.wait_for_function(
            """seconds => Number(document.querySelector("#panel-voice .voice-level").dataset.seconds) >= seconds""",
            arg=clip_secs - 0.5,
            timeout=SLOW_MS,
        )
        record.press("Enter")  # "Stop and send", from the keyboard
        status = panel.locator(".voice-status")
        expect(status).to_have_text(re.compile(r"Done\.|failed"), timeout=2 * SLOW_MS)
        assert status.inner_text() == "Done.", status.inner_text()

        heard = panel.locator(".voice-transcript").inner_text()
        assert len(words(heard) & QUESTION_WORDS) >= 3, heard
        assert panel.locator(".voice-answer").inner_text().strip()
        player = panel.locator("audio.voice-audio")
        assert (player.get_attribute("src") or "").startswith("blob:")
        page.wait_for_function(
            """() => { const audio = document.querySelector("#panel-voice audio");
                       return audio.readyState >= 1 && audio.duration > 0; }"""
        )
        steps = panel.locator(".voice-timings dd").evaluate_all("items => items.map(item => item.dataset.step)")
        assert steps == ["transcribe", "answer", "speak", "total"]
        screenshot(page, artifacts, "voice")

    # The three requests were one declared workflow, closed by the speech request.
    deadline = time.monotonic() + SLOW_MS / 1000
    while True:
        latency = httpx.get(f"{embedded.base_url}/v1/memory/status", timeout=30).json()["latency"]
        if WORKFLOW in latency["workflows"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert latency["workflows"][WORKFLOW]["count"] >= 1, latency["workflows"]


def test_every_control_of_the_media_panels_has_a_label(embedded: Server):
    with browser_page(embedded.base_url) as page:
        for name, root in (("images", ".img-panel"), ("documents", ".doc-panel"), ("voice", ".voice-panel")):
            panel = open_panel(page, embedded.base_url, name)
            expect(panel.locator(root)).to_be_attached()  # the module has mounted
            unlabelled = panel.locator("input, select, textarea, button").evaluate_all(
                """controls => controls
                    .filter(control => !(control.labels?.length || control.getAttribute("aria-label")
                                         || control.textContent.trim()))
                    .map(control => control.outerHTML)"""
            )
            assert unlabelled == [], (name, unlabelled)
