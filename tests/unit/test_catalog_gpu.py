"""The catalog's GPU lineup (models.catalog.toml, gpu = true): every entry makes a config block the
server accepts for its engine, names its files where the hub serves them, and gives the advisor
what it needs to plan it while nothing is on disk."""

from __future__ import annotations

import tomllib
import typing
from collections import defaultdict
from pathlib import PurePosixPath

import pytest

from hypnos_site.config import BASE_DIR, HypnosConfig, Modality, ModelConfig, ServerConfig
from models_registry.advisor import bits_per_weight, variant_footprint
from models_registry.catalog import CatalogEntry, CatalogVariant, config_block, describe, load_catalog

CATALOG = load_catalog(BASE_DIR / "models.catalog.toml")
GPU = [e for e in CATALOG.models if e.gpu]
VARIANTS = [(e, v) for e in CATALOG.models for v in e.variants]


def block_of(entry: CatalogEntry, variant: CatalogVariant) -> ModelConfig:
    [block] = tomllib.loads(config_block(entry, variant))["models"]
    return ModelConfig.model_validate(block)


def spec(entry: CatalogEntry, variant: CatalogVariant) -> str:
    return f"{entry.id}:{variant.quant}"


def test_the_gpu_lineup_covers_every_need_but_documents():
    served = {e.modality for e in GPU} | {m for e in GPU for m in e.additional_modalities}
    assert served == set(typing.get_args(Modality)) - {"document_conversion"}
    # Every GPU file comes from a hub (the machines the suite runs on reach none).
    assert all(f.repo is not None for e in GPU for v in e.variants for f in v.files)


@pytest.mark.parametrize(("entry", "variant"), VARIANTS, ids=[spec(e, v) for e, v in VARIANTS])
def test_every_variant_makes_a_model_block_of_its_engine(entry, variant):
    block = block_of(entry, variant)
    assert (block.id, block.modality, block.engine) == (entry.id, entry.modality, entry.engine)
    assert [v.default for v in entry.variants].count(True) == 1
    if entry.engine == "ggml_llama":
        assert block.arch.architecture == entry.architecture in CATALOG.tested_architectures


def test_two_entries_never_write_the_same_file_from_different_sources():
    sources: dict[str, set[tuple[str | None, str | None, str | None]]] = defaultdict(set)
    for _, variant in VARIANTS:
        for f in variant.files:
            sources[f.local].add((f.repo, f.remote, f.package))
    assert {local: found for local, found in sources.items() if len(found) > 1} == {}


@pytest.mark.parametrize("model_id", ["gemma3-4b", "gemma3-12b", "gemma3-27b", "qwen2.5-vl-7b"])
def test_a_vision_model_carries_its_projector_and_chats(model_id):
    entry = next(e for e in CATALOG.models if e.id == model_id)
    [variant] = entry.variants
    weights, projector = variant.files
    assert (weights.role, projector.role) == ("weights", "aux") and projector.repo == weights.repo
    assert projector.remote.startswith("mmproj-")
    block = block_of(entry, variant)
    assert block.aux_path == projector.local and block.modalities[:2] == ["vision", "text_generation"]


@pytest.mark.parametrize("model_id", ["whisper-small", "whisper-medium", "whisper-large-v3", "whisper-large-v3-turbo"])
def test_a_whisper_model_is_a_ctranslate2_folder_fetched_file_by_file(model_id):
    entry = next(e for e in CATALOG.models if e.id == model_id)
    [variant] = entry.variants
    block = block_of(entry, variant)
    names = {PurePosixPath(f.local).name for f in variant.files}
    assert {PurePosixPath(f.local).parent.as_posix() for f in variant.files} == {block.weights_path}
    large = "large" in model_id
    vocabulary = {"preprocessor_config.json", "vocabulary.json"} if large else {"vocabulary.txt"}
    assert names == {"model.bin", "config.json", "tokenizer.json"} | vocabulary


def test_kokoro_is_one_folder_with_its_graph_and_voices():
    entry = next(e for e in CATALOG.models if e.id == "kokoro-82m")
    [variant] = entry.variants
    graph, voices = variant.files
    block = block_of(entry, variant)
    # inference/engines/speech.py: one kokoro*.onnx and a voices*.bin beside it.
    assert block.weights_path == graph.local and PurePosixPath(voices.local).parent == PurePosixPath(graph.local).parent
    assert PurePosixPath(graph.local).name.startswith("kokoro") and PurePosixPath(voices.local).name.startswith(
        "voices"
    )
    assert (block.engine, block.modality) == ("onnx_runtime", "text_to_speech")


def test_the_image_models_write_their_image_settings_into_the_block():
    turbo = block_of(*next((e, e.variants[0]) for e in CATALOG.models if e.id == "sd-turbo"))
    assert turbo.image is not None and (turbo.image.steps, turbo.image.cfg_scale) == (4, 1.0)
    assert turbo.image_capabilities == []
    entry = next(e for e in CATALOG.models if e.id == "flux2-klein-4b")
    [variant] = entry.variants
    klein = block_of(entry, variant)
    roles = {f.role: f.local for f in variant.files}
    assert klein.aux_path == roles["aux"] and klein.image is not None
    assert klein.image.text_encoders == {"llm": roles["text_encoder"]} and klein.image_capabilities == ["edit"]


@pytest.mark.parametrize(("entry", "variant"), [(e, v) for e in GPU for v in e.variants])
def test_the_advisor_plans_every_gpu_variant_from_the_catalog_alone(entry, variant, tmp_path):
    fp = variant_footprint(entry, variant, tmp_path, "other")
    weights = next(f for f in variant.files if f.role == "weights")
    assert variant.estimate is not None and variant.estimate.params
    if weights.size is None:
        # Until the file is on disk its bytes are the parameters at the quantization's bits.
        bits = bits_per_weight(variant.quant)
        assert bits is not None and fp.weights_bytes >= round(variant.estimate.params * bits / 8)
    if entry.engine == "ggml_llama":
        # A layered model: the layers are what is left of the weights beside the embeddings and head.
        assert fp.n_layers == variant.estimate.num_layers and min(fp.layer_bytes) > 0
        assert fp.kv_bytes_per_token > 0 and fp.trained_context_len >= variant.context_len


@pytest.mark.parametrize(("model_id", "quant"), [("whisper-large-v3", "fp16"), ("gliner-medium-v2.1", "fp32")])
def test_a_configured_catalog_block_names_its_variant(model_id, quant, tmp_path):
    # The block's weights_path is a folder (Whisper) or a path inside one (GLiNER), not a file name.
    entry = next(e for e in CATALOG.models if e.id == model_id)
    variant = next(v for v in entry.variants if v.quant == quant)
    config = HypnosConfig(server=ServerConfig(models_dir=str(tmp_path)), models=[block_of(entry, variant)])
    [row] = [r for r in describe(config, CATALOG)["data"] if r["id"] == model_id]
    assert row["configured"] is True and row["configured_quant"] == quant


@pytest.mark.parametrize(("entry", "variant"), VARIANTS, ids=[spec(e, v) for e, v in VARIANTS])
def test_every_variant_is_named_by_its_id_and_quant(entry, variant):
    """`<id>:<quant>` (./run.sh models, POST /v1/models, Ollama's pull) finds exactly it."""
    from inference.web.common.pulls import catalog_variant

    assert catalog_variant(CATALOG, spec(entry, variant)) == (entry, variant)
