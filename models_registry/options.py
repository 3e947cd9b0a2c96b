"""Per-model options (compat.md: GET/POST/DELETE /v1/models/{id}/options): the model's knobs in
three layers, built-in defaults < the model's config block < saved options, the last one kept in
the database (ModelOptions) and applied at every start."""

from __future__ import annotations

import json
from functools import cache
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError

from hypnos_site.config import ENGINE_SAMPLING_DEFAULTS, HypnosConfig, ModelConfig, SamplingDefaults
from memory.gguf import GgufError, read_gguf
from models_registry.pool import PoolCheckFailed

# The knobs of the model block an option can set; changing one but priority or initial_tier
# reloads the model (after a drain, as a replacement does).
KNOBS = ("context_len", "slots", "priority", "initial_tier")
SAMPLING = tuple(SamplingDefaults.model_fields)
OPTION_KEYS = KNOBS + SAMPLING


# Lemonade's names for the knobs (its clients send them); a ctx_size of -1 asks for the default.
ALIASES = {"ctx_size": "context_len"}


def translated(changes: dict[str, Any]) -> dict[str, Any]:
    """`changes` with Lemonade's names as Hypnos's; both names for one knob must agree."""
    out = dict(changes)
    for alias, key in ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if value == -1:
            value = None
        if key in out and out[key] != value:
            raise PoolCheckFailed([f"{alias} ({value}) and {key} ({out[key]}) disagree; send one of them"])
        out[key] = value
    return out


def lemonade_view(options: dict[str, Any]) -> dict[str, Any]:
    """Saved options as Lemonade's recipe_options: Hypnos's names plus its own (ctx_size)."""
    named = {alias: options[key] for alias, key in ALIASES.items() if key in options}
    return options | named


def defaults_layer() -> dict[str, Any]:
    knobs = {key: ModelConfig.model_fields[key].default for key in KNOBS}
    return knobs | dict(ENGINE_SAMPLING_DEFAULTS)


def config_layer(model: ModelConfig) -> dict[str, Any]:
    """What the model's block sets itself."""
    knobs = {key: getattr(model, key) for key in KNOBS if key in model.model_fields_set}
    return knobs | model.sampling.model_dump(exclude_none=True)


@cache
def _adapter(key: str) -> TypeAdapter[Any]:
    """The option's type with its bounds, as the model block's field declares it."""
    field = ModelConfig.model_fields[key] if key in KNOBS else SamplingDefaults.model_fields[key]
    return TypeAdapter(Annotated[field.annotation, field])  # type: ignore[arg-type]  # a type built at run time


def checked(key: str, value: Any) -> Any:
    """An option's value as JSON typed it, within its bounds (strict: "2048" is not a context
    length; it was once saved as the string and shown so everywhere); PoolCheckFailed else."""
    if value is None:
        return None
    try:
        return _adapter(key).dump_python(_adapter(key).validate_json(json.dumps(value), strict=True), mode="json")
    except ValidationError as exc:
        raise PoolCheckFailed([f"{key}: {err['msg']} (got {value!r})" for err in exc.errors()]) from None


def merge(saved: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`changes` over `saved`: a null removes its key; an unknown key or a value of the wrong
    type or out of bounds is refused."""
    changes = translated(changes)
    unknown = sorted(set(changes) - set(OPTION_KEYS))
    if unknown:
        raise PoolCheckFailed([f"unknown option {key!r} (options: {', '.join(OPTION_KEYS)})" for key in unknown])
    changes = {key: checked(key, value) for key, value in changes.items()}
    merged = {**saved, **changes}
    return {key: value for key, value in merged.items() if value is not None}


def trained_context_len(config: HypnosConfig, model: ModelConfig) -> int | None:
    """The context a llama.cpp model was trained for: its [models.arch], else its GGUF's
    header (None for other engines, or a file that cannot be read)."""
    if model.arch.context_length:
        return model.arch.context_length
    if model.engine != "ggml_llama":
        return None
    try:
        return read_gguf(config.weights_file(model)).arch_int("context_length") or None
    except (GgufError, OSError):
        return None


def check_context(saved: dict[str, Any], trained: int | None) -> None:
    """A saved context_len no larger than the model was trained for (PoolCheckFailed)."""
    context = saved.get("context_len")
    if trained and context and context > trained:
        raise PoolCheckFailed([f"context_len: {context} is more than the {trained} tokens the model was trained for"])


def apply(model: ModelConfig, saved: dict[str, Any]) -> ModelConfig:
    """The model its block describes with the saved options on top; PoolCheckFailed when a
    value does not validate."""
    if not saved:
        return model
    sampling = model.sampling.model_dump() | {k: v for k, v in saved.items() if k in SAMPLING}
    knobs = {k: v for k, v in saved.items() if k in KNOBS}
    try:
        return ModelConfig.model_validate(model.model_dump() | knobs | {"sampling": sampling})
    except ValidationError as exc:
        raise PoolCheckFailed([f"{err['loc'][-1]}: {err['msg']}" for err in exc.errors()]) from exc


def layers(model: ModelConfig, saved: dict[str, Any]) -> dict[str, Any]:
    """The answer of GET /v1/models/{id}/options."""
    config = config_layer(model)
    effective = defaults_layer() | config | saved
    return {
        "model": model.id,
        "defaults": defaults_layer(),
        "config": config,
        # Lemonade's clients read its own name beside Hypnos's (recipe_options.ctx_size).
        "saved": lemonade_view(saved),
        "effective": lemonade_view(effective),
        # Lemonade's: the context a load now would allocate.
        "resolved_ctx_size": effective["context_len"],
    }


def reloads(old: ModelConfig, new: ModelConfig) -> bool:
    """Whether running `new` in place of `old` needs the model loaded again."""
    light = {"sampling", "priority", "initial_tier"}
    return old.model_dump(exclude=light) != new.model_dump(exclude=light)
