"""The Ollama API's model side (issue 17): `name:tag` resolution, GET /api/tags, GET /api/ps and
POST /api/show, from the pool, the worker's status and the weights' GGUF headers.

Ollama lists the models it can chat or embed with, so /api/tags and /api/ps show the pool's
text generation, vision and embedding models; the speech, image and document models stay on
/v1. A name resolves as Ollama's `:latest` convention does: an id or alias as it is (ids may
hold colons), `<id>:latest` for the model itself, and `<id>:<quant>` when the model's weights
are that quantization (`smollm2-135m:q4_1`).
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from gguf.constants import LlamaFileType

from hypnos_site.config import ModelConfig
from hypnos_site.errors import ModelNotAvailable, OllamaModelNotFound
from inference.transport.client import InferenceClient
from inference.web.common.catalog import shown_path
from inference.web.common.pool import pool
from memory.gguf import GgufError, read_gguf

OLLAMA_MODALITIES = ("text_generation", "vision", "embeddings")
# Ollama's expiry of a model kept forever (keep_alive -1): now plus the longest Go duration.
FOREVER = timedelta(microseconds=(2**63 - 1) // 1000)
TIER1 = "tier1_gpu_vram"


@dataclass(frozen=True)
class WeightsFacts:
    """What the Ollama routes tell of a model's weights file: its size and time, and the GGUF
    header's metadata when it is one (empty otherwise)."""

    size: int = 0
    modified: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def quantization(self) -> str:
        """The file type as llama.cpp names it (Q4_1, Q4_K_M, F16), "" when unknown."""
        file_type = self.metadata.get("general.file_type")
        if not isinstance(file_type, int):
            return ""
        try:
            return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            return ""

    def arch_value(self, key: str) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}")


def weights_facts(model: ModelConfig) -> WeightsFacts:
    """The model's weights as they are on disk now (a GGUF header is read once per version of
    the file: memory.gguf.read_gguf); empty facts for a file that is missing. Reads the file:
    call it off the event loop."""
    path = settings.HYPNOS.weights_file(model)
    try:
        stat = path.stat()
    except OSError:
        return WeightsFacts()
    size = stat.st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    aux = settings.HYPNOS.aux_file(model)
    extra = aux.stat().st_size if aux is not None and aux.is_file() else 0
    metadata: dict[str, Any] = {}
    if path.suffix == ".gguf":
        try:
            metadata = read_gguf(path).metadata
        except (GgufError, OSError):
            metadata = {}
    return WeightsFacts(size + extra, stat.st_mtime_ns / 1e9, metadata)


# -- names -------------------------------------------------------------------------------------


def served(model: ModelConfig) -> bool:
    """Whether the Ollama API lists the model (it chats or embeds)."""
    return model.modality in OLLAMA_MODALITIES


def tagged(model: ModelConfig) -> str:
    """The model's Ollama name: `<id>:latest` (an id with a tag of its own stays as it is)."""
    return model.id if ":" in model.id else f"{model.id}:latest"


def _match(name: str, models: list[ModelConfig]) -> ModelConfig | None:
    exact = next((m for m in models if name in (m.id, *m.aliases)), None)
    if exact is not None:
        return exact
    base, colon, tag = name.rpartition(":")
    if not colon or not base or not tag:
        return None
    model = next((m for m in models if base in (m.id, *m.aliases)), None)
    if model is None:
        return None
    if tag == "latest" or tag.lower() == weights_facts(model).quantization.lower():
        return model
    return None


async def find_model(client: InferenceClient, name: str) -> ModelConfig:
    """The pool's model `name` stands for under Ollama's naming; 404 `model 'x' not found`.
    The pool is refreshed once when the name is unknown (a model another web process added)."""
    await pool.ensure(client)
    model = await asyncio.to_thread(_match, name, pool.models())
    if model is None:
        pool.invalidate()
        await pool.ensure(client)
        model = await asyncio.to_thread(_match, name, pool.models())
    if model is None:
        raise OllamaModelNotFound(name)
    return model


# -- descriptions ------------------------------------------------------------------------------


def timestamp(at: datetime | float) -> str:
    """RFC 3339 in UTC, as Ollama's clients parse it."""
    when = at if isinstance(at, datetime) else datetime.fromtimestamp(at, UTC)
    return when.astimezone(UTC).isoformat().replace("+00:00", "Z")


def digest(model: ModelConfig, facts: WeightsFacts) -> str:
    """The weights' sha256 when the block names it; else a digest of the model's id, file
    name, size and mtime (hashing gigabytes per listing is not affordable), which changes when
    the file does."""
    if model.sha256:
        return model.sha256
    key = f"{model.id}\0{Path(model.weights_path).name}\0{facts.size}\0{facts.modified}"
    return hashlib.sha256(key.encode()).hexdigest()


def details(model: ModelConfig, facts: WeightsFacts) -> dict[str, Any]:
    family = facts.architecture or model.arch.architecture or ""
    return {
        "parent_model": "",
        "format": "gguf" if model.weights_path.endswith(".gguf") else model.engine,
        "family": family,
        "families": [family] if family else None,
        "parameter_size": str(facts.metadata.get("general.size_label", "")),
        "quantization_level": facts.quantization,
    }


def _listing(model: ModelConfig, facts: WeightsFacts) -> dict[str, Any]:
    name = tagged(model)
    return {
        "name": name,
        "model": name,
        "modified_at": timestamp(facts.modified or 0.0),
        "size": facts.size,
        "digest": digest(model, facts),
        "details": details(model, facts),
    }


async def _status(client: InferenceClient) -> dict[str, Any]:
    status = await client.status()
    if status is None:
        raise ModelNotAvailable("no inference worker is answering")
    pool.update(status)
    return status


async def list_tags(client: InferenceClient) -> dict[str, Any]:
    """GET /api/tags: every enabled chat and embedding model of the pool."""
    status = await _status(client)
    states = status["models"]
    models = [m for m in pool.models() if served(m) and states.get(m.id, {}).get("enabled", m.enabled)]
    facts = await asyncio.to_thread(lambda: [weights_facts(m) for m in models])
    return {"models": [_listing(m, f) for m, f in zip(models, facts, strict=True)]}


async def list_running(client: InferenceClient) -> dict[str, Any]:
    """GET /api/ps: the models in tier 1. `size` is every byte the placement holds (tier 1 and
    the layers or KV it keeps in tier 2), `size_vram` its tier-1 bytes on a GPU (0 on a machine
    without one, where tier 1 is a budget in RAM, as Ollama reports a CPU model). `expires_at`
    is when idle unload (keep_alive) will demote it, Ollama's "forever" when it will not (a
    model kept forever, or one serving now)."""
    status = await _status(client)
    simulated = bool(status.get("simulated", True))
    running = []
    for model in pool.models():
        state = status["models"].get(model.id, {})
        if not served(model) or state.get("current_tier") != TIER1:
            continue
        placement = state["placement"]
        vram = placement["vram_weight_bytes"] + placement["vram_kv_and_workspace_bytes"]
        facts = await asyncio.to_thread(weights_facts, model)
        running.append(
            {
                **_listing(model, facts),
                "size": vram + placement["pinned_ram_bytes"],
                "size_vram": 0 if simulated else vram,
                "expires_at": state.get("expires_at") or timestamp(datetime.now(UTC) + FOREVER),
                "context_length": placement["allocated_context_len"],
                "hypnos_placement": placement,
            }
        )
    return {"models": running}


def capabilities(model: ModelConfig, state: dict[str, Any]) -> list[str]:
    """Ollama's words for what the model serves: completion or embedding, and the engine's
    tools, thinking and vision."""
    if model.modality == "embeddings":
        return ["embedding"]
    engine = set(state.get("capabilities") or ())
    if "vision" in model.modalities:
        engine.add("vision")
    return ["completion", *(c for c in ("tools", "thinking", "vision") if c in engine)]


def _parameters(model: ModelConfig, context_len: int) -> list[tuple[str, Any]]:
    sampling = model.sampling
    found: list[tuple[str, Any]] = [("num_ctx", context_len)]
    for name in ("temperature", "top_p", "top_k", "repeat_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if value is not None:
            found.append((name, value))
    if sampling.max_tokens is not None:
        found.append(("num_predict", sampling.max_tokens))
    return found


async def show(client: InferenceClient, name: str, *, admin: bool) -> dict[str, Any]:
    """POST /api/show: a Modelfile-like description, the parameters, the chat template (the
    GGUF's Jinja, which is what Hypnos renders, not a Go template), the GGUF metadata as
    `model_info` and the capabilities."""
    model = await find_model(client, name)
    status = await _status(client)
    state = status["models"].get(model.id, {})
    facts = await asyncio.to_thread(weights_facts, model)
    context_len = state.get("placement", {}).get("allocated_context_len") or model.context_len
    parameters = _parameters(model, context_len)
    weights = shown_path(settings.HYPNOS.weights_file(model), admin)
    modelfile = [f"# Modelfile of {tagged(model)}, served by Hypnos", f"FROM {weights}"]
    aux = settings.HYPNOS.aux_file(model)
    if aux is not None:
        modelfile.append(f"ADAPTER {shown_path(aux, admin)}")
    modelfile += [f"PARAMETER {key} {value}" for key, value in parameters]
    info = {key: value for key, value in facts.metadata.items() if key != "tokenizer.chat_template"}
    architecture = facts.architecture or model.arch.architecture or model.engine
    info["general.architecture"] = architecture
    info.setdefault(f"{architecture}.context_length", model.arch.context_length or model.context_len)
    return {
        "license": str(facts.metadata.get("general.license", "")),
        "modelfile": "\n".join(modelfile) + "\n",
        "parameters": "\n".join(f"{key} {value}" for key, value in parameters),
        "template": str(facts.metadata.get("tokenizer.chat_template", "")),
        "details": details(model, facts),
        "model_info": info,
        "capabilities": capabilities(model, state),
        "modified_at": timestamp(facts.modified or 0.0),
    }
