"""POST /v1/entities on the `gliner` engine through the in-process worker. No GLiNER weights are
reachable from these machines, so the models are GLiNER-shaped ONNX graphs with known scores
built by tests/gliner_graph.py (plumbing, not trained models): every span and score the route
returns is checked against the graph's own scoring function, through the same tokenizer, prompt,
label families, windows and tiers a real export goes through."""

from __future__ import annotations

from pathlib import Path

import pytest

from hypnos_site.config import ModelConfig
from inference.transport.entities import select_spans
from inference.worker import Worker
from tests import gliner_graph as graph
from tests.integration.conftest import post_json

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/v1/entities"
SPAN, TOKEN = "gliner-plumbing-span", "gliner-plumbing-token"


@pytest.fixture(scope="module")
def gliner_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gliner")
    return {
        SPAN: graph.build_gliner_model(root / "span", head="span"),
        TOKEN: graph.build_gliner_model(root / "token", head="token"),
        # A short window (12 words) so a plain sentence already spans several windows.
        "gliner-plumbing-short": graph.build_gliner_model(root / "short", head="span", max_len=12, max_width=4),
    }


@pytest.fixture
def gliner(settings, serve, gliner_folders) -> Worker:
    models = [
        ModelConfig(id=name, modality="entity_extraction", engine="gliner", weights_path=str(folder))
        for name, folder in gliner_folders.items()
    ]
    chat = next(m for m in settings.HYPNOS.models if m.id == "smollm2-135m")
    return serve(settings.HYPNOS.model_copy(update={"models": [chat, *models]}))


def expected(text: str, labels: list[str], head: str = "span", threshold: float = 0.5, flat: bool = True, **kw):
    candidates = (graph.span_candidates if head == "span" else graph.token_candidates)(text, labels, threshold, **kw)
    return [
        (text[s.start : s.end], s.label, s.start, s.end, pytest.approx(s.score, abs=1e-6))
        for s in select_spans(candidates, flat)
    ]


async def extract(api, model: str, texts, labels, **extra) -> dict:
    response = await post_json(api, URL, {"model": model, "input": texts, "labels": labels, **extra})
    assert response.status_code == 200, response.content
    return response.json()


def spans(item: dict) -> list[tuple]:
    return [(e["text"], e["label"], e["start"], e["end"], e["score"]) for e in item["entities"]]


@pytest.mark.parametrize(("model", "head"), [(SPAN, "span"), (TOKEN, "token")])
async def test_the_specs_example_on_both_heads(api, gliner, model, head):
    texts = [graph.MARIO, graph.TIM]
    body = await extract(api, model, texts, graph.LABELS, threshold=0.5, flat=True)
    assert [spans(item) for item in body["data"]] == [expected(t, graph.LABELS, head) for t in texts]
    assert [(e["text"], e["label"]) for e in body["data"][0]["entities"]] == [
        ("Mario Rossi", "person"),
        ("Milan", "city"),
        ("Ferrari", "company"),
    ]
    assert [(e["text"], e["label"]) for e in body["data"][1]["entities"]] == [
        ("Tim Cook", "person"),
        ("iPhone 17", "product"),
        ("Cupertino", "city"),
    ]
    assert body["usage"] == {"texts": 2, "characters": len(graph.MARIO) + len(graph.TIM)}
    telemetry = body["hypnos_telemetry"]
    assert telemetry["placement"]["primary_tier"] == "tier1_gpu_vram"
    assert telemetry["previous_tier"] in ("tier3_nvme_ssd", "tier1_gpu_vram")
    assert gliner.tiers.leases(model) == 0


async def test_nested_spans_when_flat_is_false(api, gliner):
    flat = await extract(api, SPAN, graph.ANNA, graph.LABELS, flat=True)
    nested = await extract(api, SPAN, graph.ANNA, graph.LABELS, flat=False)
    assert spans(flat["data"][0]) == expected(graph.ANNA, graph.LABELS, flat=True)
    assert spans(nested["data"][0]) == expected(graph.ANNA, graph.LABELS, flat=False)
    assert ("Milan", "city") in [(e["text"], e["label"]) for e in nested["data"][0]["entities"]]
    assert ("Milan", "city") not in [(e["text"], e["label"]) for e in flat["data"][0]["entities"]]


async def test_the_threshold_is_the_lowest_score_kept(api, gliner):
    body = await extract(api, SPAN, graph.MARIO, graph.LABELS, threshold=0.95)
    assert spans(body["data"][0]) == expected(graph.MARIO, graph.LABELS, threshold=0.95)
    assert [e["text"] for e in body["data"][0]["entities"]] == ["Mario Rossi"]


async def test_more_than_eight_labels_run_in_families(api, gliner):
    # The spec's labels after eight others: they fall in the second family of the prompt.
    labels = [*graph.DISTRACTORS, *graph.LABELS]
    body = await extract(api, SPAN, [graph.MARIO, graph.TIM], labels)
    assert [spans(item) for item in body["data"]] == [expected(t, labels) for t in (graph.MARIO, graph.TIM)]
    assert len(body["data"][1]["entities"]) == 3


async def test_a_text_longer_than_a_window_is_merged_back(api, gliner):
    text = " ".join([graph.MARIO, graph.TIM, graph.LUCA, graph.MARIO])
    body = await extract(api, "gliner-plumbing-short", text, [*graph.LABELS, "organisation"])
    got = spans(body["data"][0])
    assert got == expected(text, [*graph.LABELS, "organisation"], max_width=4)
    assert [e[0] for e in got].count("Mario Rossi") == 2
    for entity in body["data"][0]["entities"]:
        assert text[entity["start"] : entity["end"]] == entity["text"]


async def test_offsets_count_characters_after_emoji_and_combining_marks(api, gliner):
    text = "🎉🎉 Cafe\u0301 — " + graph.MARIO
    body = await extract(api, SPAN, text, graph.LABELS)
    (item,) = body["data"]
    assert spans(item) == expected(text, graph.LABELS)
    mario = item["entities"][0]
    assert mario["text"] == "Mario Rossi" and mario["start"] == text.index("Mario") == 11


async def test_an_empty_text_has_no_entities(api, gliner):
    body = await extract(api, SPAN, ["", "   ", graph.LUCA], ["person"])
    assert [len(item["entities"]) for item in body["data"]] == [0, 0, 1]


async def test_the_model_moves_through_the_tiers_like_every_model(api, gliner):
    await extract(api, SPAN, graph.MARIO, graph.LABELS)
    status = (await api.get("/v1/memory/status")).json()
    row = next(m for m in status["models"] if m["id"] == SPAN)
    assert row["modality"] == "entity_extraction" and row["engine"] == "gliner"
    assert row["current_tier"] == "tier1_gpu_vram"
    moved = await post_json(api, "/v1/memory/tier", {"model": SPAN, "target_tier": "tier3_nvme_ssd"})
    assert moved.status_code == 200, moved.content
    again = await extract(api, SPAN, graph.MARIO, graph.LABELS)
    assert again["hypnos_telemetry"]["previous_tier"] == "tier3_nvme_ssd"
    assert again["hypnos_telemetry"]["tier_switch_latency_ms"] > 0
    assert spans(again["data"][0]) == expected(graph.MARIO, graph.LABELS)
    listed = (await api.get("/v1/models")).json()["data"]
    assert next(m for m in listed if m["id"] == SPAN)["modality"] == "entity_extraction"


async def test_a_gliner_model_refuses_other_routes(api, gliner):
    response = await post_json(
        api, "/v1/chat/completions", {"model": SPAN, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "model"
