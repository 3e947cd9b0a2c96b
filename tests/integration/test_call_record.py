"""The call's structured record (logs.record.CallRecord): filled by the serving code from the
worker's typed events, read by the accounting middleware for the log, the charge and the metric
families of spec §16, with real engines (SmolLM2, Piper, Whisper)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

import hypnos_site.metrics as metrics_module
import logs.capture as capture_module
import logs.middleware as middleware_module
from logs.store import levels
from tests.conftest import PARIS_MESSAGES
from tests.integration.conftest import post_json, read_sse
from tests.integration.test_keys_and_log import log_records, scrape, with_keys

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/v1/chat/completions"
CHAT = {"model": "smollm2-135m", "messages": PARIS_MESSAGES, "max_tokens": 3, "temperature": 0}
ADMIN = "sk-admin-test"
SMOL = (("model", "smollm2-135m"),)
AUTH = {"authorization": f"Bearer {ADMIN}"}


@pytest.fixture(autouse=True)
def fresh_counters(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(metrics_module, "_memory_counters", metrics_module.MemoryCounters())
    levels.reset()
    yield
    levels.reset()


async def test_it_counts_prefix_cache_reuse_and_request_latency_as_histograms(api, settings):
    with_keys(settings)
    answers = [(await post_json(api, URL, CHAT, **AUTH)).json() for _ in range(2)]
    cached = [a["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for a in answers]
    # The same prompt twice: the second reuses the first's prefix from the slot's cache.
    assert cached[1] > 0
    samples = await scrape(api, **AUTH)
    hits = samples.get("hypnos_prefix_cache_hits_total", {}).get(SMOL, 0)
    assert hits == sum(1 for c in cached if c)
    assert samples.get("hypnos_prefix_cache_misses_total", {}).get(SMOL, 0) == 2 - hits
    assert samples["hypnos_prefix_cache_tokens_reused_total"][SMOL] == sum(cached)
    route = (("route", URL),)
    assert samples["hypnos_request_e2e_ms_count"][route] == 2
    rows = samples["hypnos_request_e2e_ms_bucket"].items()
    buckets = sorted((float(dict(labels)["le"]), value) for labels, value in rows if dict(labels)["route"] == URL)
    # Cumulative buckets up to +Inf: what histogram_quantile needs for a p95.
    assert buckets[-1] == (float("inf"), 2) and len(buckets) > 10
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:], strict=False))
    assert samples["hypnos_chat_ttft_ms_bucket"][(("le", "+Inf"), ("model", "smollm2-135m"))] == 2


async def test_a_streamed_chat_is_logged_from_its_record_not_its_bytes(api, settings, monkeypatch):
    with_keys(settings)
    await post_json(api, "/v1/logs/level", {"level": "debug"}, **AUTH)
    # Parsing a response for usage would go through json_body; with the record nothing does.
    parsed: list[bytes] = []
    monkeypatch.setattr(middleware_module, "json_body", lambda raw: parsed.append(raw) or capture_module.json_body(raw))
    response = await post_json(api, URL, CHAT | {"stream": True, "stream_options": {"include_usage": True}}, **AUTH)
    events = await read_sse(response)
    usage = events[-2]["usage"]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert not [raw for raw in parsed if b"chat.completion" in raw]
    record = (await log_records(api))["records"][0]
    assert (record["tokens_in"], record["tokens_out"]) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert record["finish_reason"] == "length" and record["stream"] is True
    assert record["output"] == text and record["model"] == "smollm2-135m"


async def test_speech_and_transcription_feed_their_real_time_factors(api, settings):
    with_keys(settings)
    speech = await post_json(api, "/v1/audio/speech", {"model": "piper-joe", "input": "The capital is Paris."}, **AUTH)
    assert speech.status_code == 200
    form = {"model": "whisper-tiny.en", "file": SimpleUploadedFile("speech.wav", speech.content, "audio/wav")}
    transcript = await api.post("/v1/audio/transcriptions", form, headers=AUTH)
    # What the metrics need is a transcription (Whisper tiny.en mishears Piper's sampled speech
    # now and then: the word-for-word round trip is test_audio.py's, with its allowance).
    assert transcript.status_code == 200 and transcript.json()["text"].strip()
    samples = await scrape(api, **AUTH)
    tts, stt = (("model", "piper-joe"),), (("model", "whisper-tiny.en"),)
    assert samples["hypnos_tts_rtf_count"][tts] == 1 and samples["hypnos_tts_rtf_sum"][tts] > 0
    assert samples["hypnos_tts_ttfa_ms_count"][tts] == 1
    assert samples["hypnos_stt_rtf_count"][stt] == 1 and samples["hypnos_stt_rtf_sum"][stt] > 0
    assert float(speech["x-hypnos-rtf"]) == pytest.approx(samples["hypnos_tts_rtf_sum"][tts])
