"""What every text-generating surface shares around a worker call: the sampling defaults a
model gives, the max_tokens cap, the grammar checks before any work, and the last call's figures
(Lemonade's /stats)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from pydantic import BaseModel

from hypnos_site.config import ENGINE_SAMPLING_DEFAULTS, ModelConfig
from inference.transport.wire import Done, Usage
from inference.web.common.grammar_limits import check_schema, check_tools

DEFAULT_MAX_TOKENS = ENGINE_SAMPLING_DEFAULTS["max_tokens"]


def model_defaults(body: BaseModel, model: ModelConfig, *names: str) -> dict[str, Any]:
    """Each named sampling field: the request's when it sent one, else the model's default
    ([models.sampling], or its saved options) when it has one, else the request's own default."""
    sent = body.model_fields_set
    picked = {}
    for name in names:
        default = getattr(model.sampling, name)
        picked[name] = getattr(body, name) if name in sent or default is None else default
    return picked


def capped_max_tokens(requested: int | None, model: ModelConfig) -> int:
    """The request's max_tokens, else the model's default, clamped to limits.max_tokens_cap."""
    return int(min(requested or model.sampling.max_tokens or DEFAULT_MAX_TOKENS, settings.HYPNOS.limits.max_tokens_cap))


def check_grammars(
    schema: dict[str, Any] | None,
    schema_param: str,
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any],
) -> None:
    """The JSON schemas a grammar will be built from, against the grammar limits, before any
    worker work: a schema libllama would crash on, or that its converter refuses, is a 400."""
    limits = settings.HYPNOS.limits
    if schema is not None:
        check_schema(schema, limits, schema_param)
    if tools:
        check_tools(tools, tool_choice, limits)


# The figures of the last finished request, for Lemonade's GET /api/v1/stats (this web
# process's; zeros before its first), and the prompt tokens served from the cache since it started.
last_stats: dict[str, Any] = {
    "input_tokens": 0,
    "output_tokens": 0,
    "time_to_first_token": 0.0,
    "tokens_per_second": 0.0,
    "cache_tokens": 0,
    "cache_tokens_total": 0,
}


def record_stats(done: Done) -> None:
    usage, engine = done.usage or Usage(), done.telemetry.get("engine") or {}
    last_stats.update(
        {
            "input_tokens": usage.prompt_tokens,
            "output_tokens": usage.completion_tokens,
            "time_to_first_token": round(engine.get("ttft_ms", 0.0) / 1000, 4),
            "tokens_per_second": engine.get("decode_tokens_per_s", 0.0),
            "cache_tokens": usage.cached_tokens,
            "cache_tokens_total": last_stats["cache_tokens_total"] + usage.cached_tokens,
        }
    )
