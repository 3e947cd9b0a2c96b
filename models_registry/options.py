"""Per-model options (compat.md: GET/POST/DELETE /v1/models/{id}/options): the model's knobs in
three layers, built-in defaults < the model's config block < saved options, the last one kept in
the database (ModelOptions) and applied at every start."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from hypnos_site.config import ENGINE_SAMPLING_DEFAULTS, ModelConfig, SamplingDefaults
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


def merge(saved: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`changes` over `saved`: a null removes its key; an unknown key is refused."""
    changes = translated(changes)
    unknown = sorted(set(changes) - set(OPTION_KEYS))
    if unknown:
        raise PoolCheckFailed([f"unknown option {key!r} (options: {', '.join(OPTION_KEYS)})" for key in unknown])
    merged = {**saved, **changes}
    return {key: value for key, value in merged.items() if value is not None}


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
        "saved": saved,
        "effective": effective,
        # Lemonade's: the context a load now would allocate.
        "resolved_ctx_size": effective["context_len"],
    }


def reloads(old: ModelConfig, new: ModelConfig) -> bool:
    """Whether running `new` in place of `old` needs the model loaded again."""
    light = {"sampling", "priority", "initial_tier"}
    return old.model_dump(exclude=light) != new.model_dump(exclude=light)
