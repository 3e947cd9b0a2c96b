"""Every route that streams, through every refusal the spec names, with and without `stream`:
the worker refuses before it reports `started`, so the HTTP status and the error envelope are the
same both ways (issue 13). Real engines: SmolLM2 for the text routes, Piper for speech."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from hypnos_site.config import HypnosConfig
from inference.worker import Worker
from tests.integration.conftest import post_json, queue_filled

pytestmark = pytest.mark.django_db(transaction=True)
SMOL, PIPER, MINILM = "smollm2-135m", "piper-joe", "all-minilm-l6-v2"
OFF = {SMOL: "smollm2-off", PIPER: "piper-off"}
TOO_LONG = "hello " * 9500  # ~9500 tokens, beyond SmolLM2's trained 8192

ROUTES = {
    "chat": (
        "/v1/chat/completions",
        SMOL,
        lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 2},
    ),
    "completions": ("/v1/completions", SMOL, lambda text: {"prompt": text, "max_tokens": 2}),
    "responses": ("/v1/responses", SMOL, lambda text: {"input": text, "max_output_tokens": 2}),
    "speech": ("/v1/audio/speech", PIPER, lambda text: {"input": text, "voice": "alloy", "response_format": "wav"}),
}
# (status, type, code, param) of each refusal; `model` is filled per route.
REFUSALS = {
    "unknown_model": (404, "model_not_found", "model_not_found", "model"),
    "disabled_model": (404, "model_disabled", "model_disabled", "model"),
    "modality_mismatch": (400, "invalid_request_error", "invalid_request_error", "model"),
    "context_too_long": (400, "invalid_request_error", "context_length_exceeded", None),
    "invalid_parameter": (400, "invalid_request_error", "invalid_request_error", None),
    "insufficient_memory": (507, "insufficient_vram_or_ram", "insufficient_vram_or_ram", None),
    "model_busy": (429, "model_busy", "model_busy", None),
}
CONTEXT_PARAM = {"chat": "messages", "completions": "prompt", "responses": "input"}
INVALID = {
    "chat": ({"temperature": 9}, "temperature"),
    "completions": ({"top_p": 0}, "top_p"),
    "responses": ({"temperature": "hot"}, "temperature"),
    "speech": ({"speed": 9}, "speed"),
}


def lineup(config: HypnosConfig, **hardware: Any) -> HypnosConfig:
    """SmolLM2, Piper and MiniLM, and a disabled copy of the first two; `hardware` overrides."""
    base = {m.id: m for m in config.models}
    models = [base[SMOL], base[PIPER], base[MINILM]]
    models += [base[name].model_copy(update={"id": off, "aliases": [], "enabled": False}) for name, off in OFF.items()]
    return config.model_copy(update={"models": models, "hardware": config.hardware.model_copy(update=hardware)})


@pytest.fixture
def table_worker(settings, serve_shared) -> Iterator[Worker]:
    """The lineup's worker, shared by the module's tests: a refusal leaves it as it was."""
    yield serve_shared(lineup(settings.HYPNOS))


def request_for(route: str, refusal: str, worker: Worker) -> tuple[dict[str, Any], str | None]:
    """The body that meets `refusal` on `route`, and the param its error names."""
    _path, model, body_of = ROUTES[route]
    body = {"model": model, **body_of("Say hi.")}
    param = REFUSALS[refusal][3]
    if refusal == "unknown_model":
        body["model"] = "no-such-model"
    elif refusal == "disabled_model":
        body["model"] = OFF[model]
    elif refusal == "modality_mismatch":
        body["model"] = SMOL if route == "speech" else PIPER
    elif refusal == "context_too_long":
        body.update(body_of(TOO_LONG))
        param = CONTEXT_PARAM[route]
    elif refusal == "invalid_parameter":
        extra, param = INVALID[route]
        body.update(extra)
    return body, param


def assert_envelope(response: Any, status: int, kind: str, code: str, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, getattr(response, "content", b"")[:300])
    assert response["content-type"].startswith("application/json")
    assert re.fullmatch(r"req-[0-9a-f]{32}", response["x-request-id"])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == (kind, code, param), error
    return error


async def refused_both_ways(api: Any, route: str, body: dict[str, Any], expected: tuple, param: str | None) -> None:
    path = ROUTES[route][0]
    status, kind, code, _ = expected
    errors = []
    for stream in (False, True):
        response = await post_json(api, path, body | {"stream": stream})
        errors.append(assert_envelope(response, status, kind, code, param))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("refusal", ["unknown_model", "disabled_model", "modality_mismatch", "invalid_parameter"])
async def test_a_refusal_is_the_same_status_and_envelope_streamed_or_not(api, table_worker, route, refusal):
    body, param = request_for(route, refusal, table_worker)
    await refused_both_ways(api, route, body, REFUSALS[refusal], param)


@pytest.mark.parametrize("route", ["chat", "completions", "responses"])
async def test_a_prompt_beyond_the_context_is_the_same_400_streamed_or_not(api, table_worker, route):
    body, param = request_for(route, "context_too_long", table_worker)
    await refused_both_ways(api, route, body, REFUSALS["context_too_long"], param)


@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_full_queue_is_the_same_429_streamed_or_not(api, settings, table_worker, route):
    body, _ = request_for(route, "model_busy", table_worker)
    # As if limits.max_queue_per_model requests were queued or running on the model.
    with queue_filled(table_worker, ROUTES[route][1], settings.HYPNOS.limits.max_queue_per_model):
        await refused_both_ways(api, route, body, REFUSALS["model_busy"], None)


@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_model_beyond_the_memory_budget_is_the_same_507_streamed_or_not(api, settings, serve, route):
    # 1 MB of simulated VRAM and no partial placements: no model of the lineup fits.
    config = lineup(settings.HYPNOS, simulated_vram_bytes=1_000_000, min_gpu_layer_ratio=1.0)
    models = [m.model_copy(update={"initial_tier": "tier3_nvme_ssd"}) for m in config.models]
    worker = serve(config.model_copy(update={"models": models}))
    body, _ = request_for(route, "insufficient_memory", worker)
    await refused_both_ways(api, route, body, REFUSALS["insufficient_memory"], None)
    assert worker.models[ROUTES[route][1]].admitted == 0
