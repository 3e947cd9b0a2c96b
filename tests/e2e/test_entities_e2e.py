"""POST /v1/entities against real servers, embedded and distributed (daphne + runinference over
Redis and PostgreSQL): the spec's example on the real Qwen2.5-Coder-0.5B (the 1.5B gives the same
answer, tests/integration/test_entities.py; the smaller one keeps each server's memory down), the typed entities
event across the channel layer, and a refusal before any model runs."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.e2e
SPEC_INPUT = ["Mario Rossi works in Milan for Ferrari.", "Tim Cook announced the iPhone 17 in Cupertino."]
SPEC_LABELS = ["person", "city", "company", "product"]


def test_the_specs_example_from_a_running_server(server):
    body = {"model": "qwen2.5-coder-0.5b", "input": SPEC_INPUT, "labels": SPEC_LABELS, "threshold": 0.5}
    response = httpx.post(f"{server.base_url}/v1/entities", json=body, timeout=300)
    assert response.status_code == 200, response.text
    answer = response.json()
    found = [[(e["text"], e["label"], e["start"], e["end"]) for e in item["entities"]] for item in answer["data"]]
    assert found == [
        [("Mario Rossi", "person", 0, 11), ("Milan", "city", 21, 26), ("Ferrari", "company", 31, 38)],
        [("Tim Cook", "person", 0, 8), ("iPhone 17", "product", 23, 32), ("Cupertino", "city", 36, 45)],
    ]
    assert all(0.5 <= e["score"] <= 1 for item in answer["data"] for e in item["entities"])
    # The spec's example says 86; the two texts hold 39 + 46 characters.
    assert answer["usage"] == {"texts": 2, "characters": 85}
    assert answer["hypnos_telemetry"]["placement"]["primary_tier"] == "tier1_gpu_vram"
    assert response.headers["x-request-id"].startswith("req-")


def test_a_model_without_entity_extraction_is_refused_with_400(server):
    body = {"model": "smollm2-135m", "input": "Mario Rossi works in Milan.", "labels": ["person"]}
    response = httpx.post(f"{server.base_url}/v1/entities", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "model"
