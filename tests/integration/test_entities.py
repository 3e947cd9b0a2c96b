"""POST /v1/entities on the chat models of the lineup (spec §13): the real Qwen2.5-Coder 0.5B and
1.5B extract the spec's example with a JSON-schema grammar over the labels, and the server finds
every returned span in the text. Bad input is a 400 naming the field, before any model runs."""

from __future__ import annotations

import pytest

from tests.integration.conftest import post_json, with_limits

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/v1/entities"
SPEC_INPUT = ["Mario Rossi works in Milan for Ferrari.", "Tim Cook announced the iPhone 17 in Cupertino."]
SPEC_LABELS = ["person", "city", "company", "product"]
SPEC_ANSWER = [
    [("Mario Rossi", "person"), ("Milan", "city"), ("Ferrari", "company")],
    [("Tim Cook", "person"), ("iPhone 17", "product"), ("Cupertino", "city")],
]


async def extract(api, model: str, texts, labels, **extra) -> dict:
    response = await post_json(api, URL, {"model": model, "input": texts, "labels": labels, **extra})
    assert response.status_code == 200, response.content
    return response.json()


def found(body: dict) -> list[list[tuple[str, str]]]:
    return [[(e["text"], e["label"]) for e in item["entities"]] for item in body["data"]]


def assert_offsets_slice(body: dict, texts: list[str]) -> None:
    for item in body["data"]:
        text = texts[item["index"]]
        for entity in item["entities"]:
            assert text[entity["start"] : entity["end"]] == entity["text"]
            assert 0.5 <= entity["score"] <= 1.0


@pytest.mark.parametrize("model", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
async def test_the_specs_example_comes_back_right(api, model):
    body = await extract(api, model, SPEC_INPUT, SPEC_LABELS, threshold=0.5, flat=True)
    assert body["object"] == "list" and body["model"] == model
    assert [item["object"] for item in body["data"]] == ["entities", "entities"]
    assert [item["index"] for item in body["data"]] == [0, 1]
    assert found(body) == SPEC_ANSWER
    assert_offsets_slice(body, SPEC_INPUT)
    mario = body["data"][0]["entities"][0]
    assert (mario["start"], mario["end"]) == (0, 11)
    assert body["usage"] == {"texts": 2, "characters": sum(len(t) for t in SPEC_INPUT)}
    telemetry = body["hypnos_telemetry"]
    assert telemetry["placement"]["primary_tier"] == "tier1_gpu_vram"
    assert telemetry["inference_latency_ms"] > 0
    assert telemetry["engine"]["texts_per_s"] > 0


async def test_a_string_input_and_offsets_after_emoji_and_combining_marks(api):
    text = "🎉🎉 Cafe\u0301 news: Mario Rossi moved to Milan."
    body = await extract(api, "qwen2.5-coder-0.5b", text, ["person", "city"])
    assert found(body) == [[("Mario Rossi", "person"), ("Milan", "city")]]
    mario = body["data"][0]["entities"][0]
    # Two astral characters and a combining mark before the name: 15 scalar values, not the
    # 17 UTF-16 units a JavaScript string would count, nor the 22 UTF-8 bytes.
    assert mario["start"] == text.index("Mario") == 15
    assert len(text[:15].encode("utf-16-le")) // 2 == 17 and len(text[:15].encode()) == 22
    assert_offsets_slice(body, [text])


async def test_each_mention_of_a_repeated_entity_gets_its_own_offsets(api):
    text = "Milan beat Rome, and Milan celebrated."
    body = await extract(api, "qwen2.5-coder-0.5b", text, ["city"])
    milans = [e for e in body["data"][0]["entities"] if e["text"] == "Milan"]
    assert [(e["start"], e["end"]) for e in milans] == [(0, 5), (21, 26)]
    assert_offsets_slice(body, [text])


async def test_a_blank_text_has_no_entities(api):
    body = await extract(api, "qwen2.5-coder-0.5b", ["", "   "], ["person"])
    assert [item["entities"] for item in body["data"]] == [[], []]


async def test_the_threshold_is_the_lowest_score_kept(api):
    """Greedy decoding gives the same scores every time: a threshold between the lowest and the
    highest keeps exactly the entities scoring at least that much."""
    everything = (await extract(api, "qwen2.5-coder-0.5b", SPEC_INPUT[1], SPEC_LABELS, threshold=0.0))["data"][0]
    scores = sorted(e["score"] for e in everything["entities"])
    assert len(scores) >= 2 and scores[0] < scores[-1], scores
    cut = scores[-1]
    kept = (await extract(api, "qwen2.5-coder-0.5b", SPEC_INPUT[1], SPEC_LABELS, threshold=cut))["data"][0]
    assert kept["entities"] == [e for e in everything["entities"] if e["score"] >= cut]
    assert 1 <= len(kept["entities"]) < len(everything["entities"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "Mario lives in Milan."}, "labels"),
        ({"input": "Mario lives in Milan.", "labels": []}, "labels"),
        ({"input": "Mario lives in Milan.", "labels": ["person", ""]}, "labels"),
        ({"input": "Mario lives in Milan.", "labels": ["person", "  "]}, "labels"),
        ({"input": "Mario lives in Milan.", "labels": ["person", "person"]}, "labels"),
        ({"input": "Mario lives in Milan.", "labels": ["per\nson"]}, "labels"),
        ({"input": "Mario lives in Milan.", "labels": ["x" * 101]}, "labels"),
        ({"input": "Mario lives in Milan.", "labels": [f"label {i}" for i in range(65)]}, "labels"),
        ({"input": "Mario lives in Milan.", "labels": "person"}, "labels"),
        ({"input": "Mario lives in Milan.", "labels": [7]}, "labels.0"),
        ({"input": 42, "labels": ["person"]}, "input"),
        ({"input": ["ok", 42], "labels": ["person"]}, "input"),
        ({"input": [], "labels": ["person"]}, "input"),
        ({"labels": ["person"]}, "input"),
        ({"input": "Mario", "labels": ["person"], "threshold": 1.5}, "threshold"),
        ({"input": "Mario", "labels": ["person"], "threshold": "high"}, "threshold"),
        ({"input": "Mario", "labels": ["person"], "flat": "yes"}, "flat"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(api, worker, body, param):
    response = await post_json(api, URL, {"model": "qwen2.5-coder-0.5b", **body})
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    # The field itself, never a union member's tag ("input.str", issue 34 item 6).
    assert error["param"] == param
    assert worker.tiers.leases("qwen2.5-coder-0.5b") == 0


async def test_input_above_max_prompt_chars_is_a_400(api, settings):
    with_limits(settings, max_prompt_chars=50)
    response = await post_json(
        api, URL, {"model": "qwen2.5-coder-0.5b", "input": ["a" * 30, "b" * 30], "labels": ["x"]}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "input"


@pytest.mark.parametrize("model", ["smollm2-135m", "whisper-tiny.en", "all-minilm-l6-v2"])
async def test_a_model_without_entity_extraction_is_a_400_naming_model(api, worker, model):
    response = await post_json(api, URL, {"model": model, "input": "Mario lives in Milan.", "labels": ["person"]})
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == "model"
    assert "entity_extraction" in error["message"]
    assert worker.tiers.leases(model) == 0


async def test_an_unknown_model_is_a_404(api):
    response = await post_json(api, URL, {"model": "no-such-model", "input": "Mario", "labels": ["person"]})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


async def test_the_chat_models_list_entity_extraction_among_their_modalities(api):
    status = (await api.get("/v1/memory/status")).json()
    modalities = {m["id"]: m["modalities"] for m in status["models"]}
    assert "entity_extraction" in modalities["qwen2.5-coder-0.5b"]
    assert "entity_extraction" not in modalities["smollm2-135m"]
