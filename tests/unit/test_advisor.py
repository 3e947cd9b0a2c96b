"""The lineup advisor (spec §6 POST /v1/advisor), table-tested on the real catalog's estimates and
on small synthetic catalogs (no model file, no Django request)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from hypnos_site.config import BASE_DIR, DEFAULT_MODELS, HardwareConfig, HypnosConfig, ModelConfig
from models_registry.advisor import NoLineup, bits_per_weight, recommend
from models_registry.catalog import Catalog, config_block, load_catalog
from models_registry.machine import GIB, Machine, derive_budgets, resolve_machine
from models_registry.management.commands.advise import byte_size

MIB = 1 << 20
CATALOG = load_catalog(BASE_DIR / "models.catalog.toml")
GPU_24G = Machine(vram_bytes=24 * GIB, ram_bytes=64 * GIB, unified_memory=False)
LAPTOP = Machine(vram_bytes=0, ram_bytes=16 * GIB, unified_memory=False)


@pytest.fixture
def no_files(tmp_path: Path) -> Path:
    """An empty models_dir: every footprint comes from the catalog's estimates."""
    return tmp_path


def by_id(advice: Any) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in advice.as_dict()["models"]}


def config_of(advice: Any) -> HypnosConfig:
    return HypnosConfig.model_validate(tomllib.loads(advice.config))


def entry_of(model_id: str) -> Any:
    return next(e for e in CATALOG.models if e.id == model_id)


def assert_fits(advice: Any) -> None:
    """Every model's tier 1 share together within tier 1, the interactive ones resident there."""
    answer = advice.as_dict()
    assert sum(m.tier1_bytes for m in advice.plan.models) <= advice.budgets.tier1_bytes
    assert answer["interactive_coresident"] is True
    assert answer["interactive_bytes"] == sum(
        m["resident_bytes"]
        for m, planned in zip(answer["models"], advice.plan.models, strict=True)
        if planned.interactive
    )
    assert answer["interactive_bytes"] <= answer["budgets"]["tier1_bytes"]


def test_a_24_gib_gpu_gets_the_largest_gpu_chat_model_with_whisper_and_kokoro(no_files):
    advice = recommend(CATALOG, ["chat", "voice", "documents"], GPU_24G, no_files)
    answer = advice.as_dict()
    models = by_id(advice)
    assert answer["specs"] == ["qwen3-32b:Q4_K_M", "whisper-large-v3-turbo:fp16", "kokoro-82m:fp32", "docling:fp32"]
    # The GPU lineup has no document converter: the CPU lineup's docling converts documents.
    assert [model_id for model_id in models if not entry_of(model_id).gpu] == ["docling"]
    assert models["docling"]["serves"] == ["documents"] and models["docling"]["priority"] == "low"
    assert models["qwen3-32b"]["serves"] == ["chat", "voice"] and models["qwen3-32b"]["context_len"] == 8192
    assert models["whisper-large-v3-turbo"]["serves"] == ["voice"] and models["kokoro-82m"]["serves"] == ["voice"]
    assert all(m["initial_tier"] == "tier1_gpu_vram" and not m["runs_on_cpu"] for m in models.values())
    assert answer["budgets"] == {"tier1_bytes": 24 * GIB - 512 * MIB, "tier2_bytes": 32 * GIB, "unified_memory": False}
    assert_fits(advice)
    assert answer["warnings"] == []
    config = config_of(advice)
    chat_ = next(m for m in config.models if m.id == "qwen3-32b")
    assert chat_.speech_to_text_model == "whisper-large-v3-turbo" and chat_.priority == "high"
    # A text chat model batches concurrent clients as llama-server's default does; the rest run one slot.
    assert chat_.slots == models["qwen3-32b"]["slots"] == 4
    assert {m.slots for m in config.models if m.id != "qwen3-32b"} == {1}
    assert (
        next(m for m in config.models if m.id == "whisper-large-v3-turbo").weights_path
        == "faster-whisper-large-v3-turbo"
    )
    assert config.hardware == HardwareConfig()  # a real GPU: the server measures it


EVERY_NEED = ["chat", "vision", "voice", "embeddings", "images", "entities"]


def test_a_24_gib_gpu_serves_every_need_from_the_gpu_lineup(no_files):
    advice = recommend(CATALOG, EVERY_NEED, GPU_24G, no_files)
    answer = advice.as_dict()
    models = by_id(advice)
    assert all(entry_of(model_id).gpu for model_id in models) and answer["warnings"] == []
    # One Gemma 3 27B chats and sees; the rest of tier 1 holds the speech and embedding models.
    assert models["gemma3-27b"]["serves"] == ["chat", "vision", "voice"]
    assert {n for m in models.values() for n in m["serves"]} == set(EVERY_NEED)
    assert {m["id"] for m in answer["models"] if m["initial_tier"] == "tier1_gpu_vram"} == {
        "gemma3-27b",
        "qwen3-embedding-0.6b",
        "whisper-small",
        "kokoro-82m",
    }
    # The image and entity models wait in tier 2 (FLUX.2 klein's 15 GiB do not fit beside them).
    assert models["flux2-klein-4b"]["serves"] == ["images"] and models["gliner-large-v2.1"]["serves"] == ["entities"]
    assert_fits(advice)
    config = config_of(advice)
    gemma = next(m for m in config.models if m.id == "gemma3-27b")
    assert gemma.aux_path == "mmproj-gemma-3-27b-it-f16.gguf" and gemma.modalities[:2] == ["vision", "text_generation"]
    assert gemma.slots == 1  # a projector serves images on one slot (ModelConfig's rule)
    flux = next(m for m in config.models if m.id == "flux2-klein-4b")
    assert (
        flux.image is not None
        and flux.image.edit
        and flux.image.text_encoders == {"llm": "flux2-klein-4b/qwen_3_4b.safetensors"}
    )


def test_an_80_gib_gpu_runs_a_70b_chat_model_beside_a_vision_model(no_files):
    machine = Machine(vram_bytes=80 * GIB, ram_bytes=256 * GIB, unified_memory=False)
    advice = recommend(CATALOG, EVERY_NEED, machine, no_files)
    models = by_id(advice)
    assert all(entry_of(model_id).gpu for model_id in models) and advice.warnings == []
    assert models["llama3.3-70b"]["serves"] == ["chat", "voice"] and models["gemma3-27b"]["serves"] == ["vision"]
    assert models["whisper-large-v3"]["serves"] == ["voice"]
    # The 70B model's GGUF size is listed (42.5 GB); every interactive model stays whole in tier 1.
    assert models["llama3.3-70b"]["weights_bytes"] == 42520398816
    assert models["llama3.3-70b"]["gpu_layers"] == models["llama3.3-70b"]["num_layers"] == 80
    assert_fits(advice)


@pytest.mark.parametrize(
    "machine",
    [LAPTOP, Machine(vram_bytes=0, ram_bytes=256 * GIB, unified_memory=False)],
    ids=["laptop", "no-gpu-256g"],
)
def test_a_machine_without_a_gpu_is_never_offered_the_gpu_lineup(no_files, machine):
    advice = recommend(CATALOG, EVERY_NEED, machine, no_files)
    models = by_id(advice)
    assert not any(entry_of(model_id).gpu for model_id in models)
    assert set(models) == {"qwen2.5-coder-1.5b", "all-minilm-l6-v2", "whisper-tiny.en", "piper-joe", "dcgan-faces"}
    assert advice.warnings == [
        "vision: vision: its catalog models are for a machine with a GPU; the lineup leaves it out.",
    ]


def test_a_laptop_without_gpu_gets_tier_1_in_host_memory_and_a_config_that_says_so(no_files):
    advice = recommend(CATALOG, ["chat", "voice", "embeddings"], LAPTOP, no_files)
    answer = advice.as_dict()
    assert answer["budgets"] == {"tier1_bytes": 4 * GIB, "tier2_bytes": 8 * GIB, "unified_memory": False}
    models = by_id(advice)
    assert set(models) == {"qwen2.5-coder-1.5b", "whisper-tiny.en", "piper-joe", "all-minilm-l6-v2"}
    assert all(m["runs_on_cpu"] for m in models.values())
    assert answer["interactive_coresident"] is True and answer["warnings"] == []
    config = config_of(advice)
    assert config.hardware.simulated_vram_bytes == 4 * GIB
    assert next(m for m in config.models if m.id == "all-minilm-l6-v2").aliases == ["text-embedding-3-small"]


def test_a_machine_too_small_for_any_chat_model_gets_no_lineup(no_files):
    with pytest.raises(NoLineup, match="text_generation needs a model, and the smallest, smollm2-135m:Q4_1"):
        recommend(CATALOG, ["chat"], Machine(vram_bytes=0, ram_bytes=256 * MIB, unified_memory=False), no_files)


def test_needs_that_only_gpu_models_serve_get_no_lineup_without_a_gpu(no_files):
    with pytest.raises(NoLineup, match="No catalog model serves any of the needs"):
        recommend(CATALOG, ["vision"], LAPTOP, no_files)


def test_a_laptop_converts_documents_and_makes_images_with_the_default_lineups_models(no_files):
    advice = recommend(CATALOG, ["documents", "images"], LAPTOP, no_files)
    # The upscaler (realesrgan-x4) is an image model too, but makes no image of its own.
    assert advice.as_dict()["specs"] == ["docling:fp32", "dcgan-faces:fp32"] and advice.warnings == []
    docling, dcgan = config_of(advice).models
    assert (docling.engine, docling.weights_path) == ("docling", "rapidocr-pp-ocrv4")
    assert docling.package == "rapidocr-onnxruntime"
    assert dcgan.image_capabilities == ["ignores_prompt"]


def test_a_gpu_gets_the_gpu_image_model_and_docling(no_files):
    advice = recommend(CATALOG, ["documents", "images"], GPU_24G, no_files)
    assert advice.as_dict()["specs"] == ["flux2-klein-4b:bf16", "docling:fp32"] and advice.warnings == []


def test_an_upscaler_alone_serves_no_images_need(no_files):
    upscaler_only = CATALOG.model_copy(update={"models": [e for e in CATALOG.models if e.id == "realesrgan-x4"]})
    with pytest.raises(NoLineup, match="No catalog model serves any of the needs"):
        recommend(upscaler_only, ["images"], LAPTOP, no_files)


def test_entities_go_to_the_lineups_chat_model_rather_than_a_gliner_download(no_files):
    # On a CPU box Qwen2.5-Coder extracts entities (additional_modalities) and outweighs GLiNER,
    # whose files the box is not likely to have: one model serves both needs.
    machine = LAPTOP
    advice = recommend(CATALOG, ["chat", "entities"], machine, no_files)
    assert advice.as_dict()["specs"] == ["qwen2.5-coder-1.5b:Q4_K_M"]
    assert by_id(advice)["qwen2.5-coder-1.5b"]["serves"] == ["chat", "entities"]
    assert advice.warnings == []
    [model] = config_of(advice).models
    assert model.additional_modalities == ["entity_extraction"]
    alone = recommend(CATALOG, ["entities"], machine, no_files)
    assert alone.as_dict()["specs"] == ["qwen2.5-coder-1.5b:Q4_K_M"]


def test_a_gpu_extracts_entities_with_the_gpu_lineups_gliner(no_files):
    advice = recommend(CATALOG, ["chat", "entities"], GPU_24G, no_files)
    models = by_id(advice)
    assert models["gliner-large-v2.1"]["serves"] == ["entities"] and models["qwen3-32b"]["serves"] == ["chat"]
    [block] = [m for m in config_of(advice).models if m.id == "gliner-large-v2.1"]
    assert (block.engine, block.weights_path) == ("gliner", "gliner_large-v2.1/onnx/model_int8.onnx")


def test_without_a_chat_model_entities_go_to_gliner_planned_from_its_estimate(no_files):
    gliner_only = CATALOG.model_copy(update={"models": [e for e in CATALOG.models if e.engine == "gliner"]})
    advice = recommend(gliner_only, ["entities"], LAPTOP, no_files)
    # The catalog lists no file sizes: 289M params at 8 bits, plus the engine's 512 MiB workspace.
    # int8 and fp32 score alike (the same params); int8 leaves more of tier 1 free.
    [model] = advice.as_dict()["models"]
    assert (model["id"], model["quant"], model["serves"]) == ("gliner-multi-v2.1", "int8", ["entities"])
    assert model["weights_bytes"] == 289_000_000 and model["resident_bytes"] == 289_000_000 + 512 * MIB
    [block] = config_of(advice).models
    assert (block.engine, block.weights_path) == ("gliner", "gliner_multi-v2.1/onnx/model_int8.onnx")


def test_files_without_a_catalog_size_count_their_size_on_disk(tmp_path):
    gliner_only = CATALOG.model_copy(update={"models": [e for e in CATALOG.models if e.id == "gliner-small-v2.1"]})
    folder = tmp_path / "gliner_small-v2.1"
    (folder / "onnx").mkdir(parents=True)
    (folder / "onnx" / "model_int8.onnx").write_bytes(b"g" * 3000)
    (folder / "tokenizer.json").write_bytes(b"t" * 200)
    advice = recommend(gliner_only, ["entities"], LAPTOP, tmp_path)
    models = advice.as_dict()["models"]
    # The int8 graph's 3,000 bytes and the tokenizer's 200; the config, not on disk, counts nothing.
    assert [(m["quant"], m["weights_bytes"]) for m in models] == [("int8", 3200)]


@pytest.mark.parametrize(
    ("machine", "tier1", "tier2"),
    [
        (Machine(24 * GIB, 64 * GIB, False), 24 * GIB - 512 * MIB, 32 * GIB),
        (Machine(0, 16 * GIB, False), 4 * GIB, 8 * GIB),
        # Little RAM: tier 1 and the warm budget share it.
        (Machine(0, 4 * GIB, False), 2 * GIB, 2 * GIB),
        # Metal's working set: two thirds up to 36 GiB, three quarters above; 4 GiB for the OS.
        (Machine(0, 32 * GIB, True), 32 * GIB * 2 // 3, 28 * GIB - 32 * GIB * 2 // 3),
        (Machine(0, 128 * GIB, True), 96 * GIB, 28 * GIB),
    ],
)
def test_the_budgets_are_the_servers(machine, tier1, tier2):
    budgets = derive_budgets(machine, HardwareConfig())
    assert (budgets.tier1_bytes, budgets.tier2_bytes) == (tier1, tier2)


def test_unified_memory_ignores_vram_and_writes_both_budgets(no_files):
    machine = resolve_machine(24 * GIB, 32 * GIB, True, HardwareConfig())
    assert machine == Machine(vram_bytes=0, ram_bytes=32 * GIB, unified_memory=True)
    advice = recommend(CATALOG, ["chat"], machine, no_files)
    hardware = config_of(advice).hardware
    assert hardware.simulated_vram_bytes == advice.budgets.tier1_bytes
    assert hardware.pinned_ram_budget_bytes == advice.budgets.tier2_bytes


def test_given_vram_means_a_discrete_gpu_unless_unified_is_said():
    assert resolve_machine(8 * GIB, 32 * GIB, None, HardwareConfig()).unified_memory is False


# -- the choice, on synthetic catalogs ----------------------------------------------------------


def entry(
    model_id: str,
    modality: str,
    params: int,
    weights: int,
    *,
    layers: int = 0,
    kv: int = 0,
    workspace: int = 0,
    context: int = 4096,
    engine: str = "ggml_llama",
    gpu: bool = False,
) -> dict[str, Any]:
    return {
        "id": model_id,
        "gpu": gpu,
        "name": model_id,
        "publisher": "test",
        "license": "mit",
        "architecture": "llama",
        "modality": modality,
        "engine": engine,
        "summary": "synthetic",
        "variants": [
            {
                "quant": "Q8_0",
                "default": True,
                "context_len": context,
                "estimate": {
                    "params": params,
                    "num_layers": layers,
                    "kv_bytes_per_token": kv,
                    "workspace_bytes": workspace,
                },
                "files": [
                    {"role": "weights", "package": f"{model_id}==1", "local": f"{model_id}.bin", "size": weights}
                ],
            }
        ],
    }


def catalog(*entries: dict[str, Any]) -> Catalog:
    return Catalog.model_validate({"catalog_version": 1, "tested_architectures": ["llama"], "models": list(entries)})


SPEECH = [
    entry("stt", "speech_to_text", 40_000_000, 300 * MIB, engine="ggml_whisper"),
    entry("tts", "text_to_speech", 80_000_000, 300 * MIB, engine="onnx_runtime"),
]
GPU_2G = Machine(vram_bytes=2 * GIB + 512 * MIB, ram_bytes=16 * GIB, unified_memory=False)  # tier 1: 2 GiB


def chat(model_id: str, params: int, mib: int, **kw: Any) -> dict[str, Any]:
    return entry(model_id, "text_generation", params, mib * MIB, layers=10, **kw)


def test_a_much_larger_chat_model_wins_over_keeping_the_voice_models_resident(no_files):
    # big (1.9 GiB) leaves no room for the speech models; small fits with them.
    advice = recommend(
        catalog(chat("big", 4_000_000_000, 1900), chat("small", 1_000_000_000, 1200), *SPEECH),
        ["voice"],
        GPU_2G,
        no_files,
    )
    models = by_id(advice)
    assert "big" in models and models["big"]["initial_tier"] == "tier1_gpu_vram"
    assert advice.plan.coresident is False
    assert any("do not fit tier 1 together" in w for w in advice.warnings)


def test_keeping_the_voice_models_resident_beats_a_slightly_larger_chat_model(no_files):
    advice = recommend(
        catalog(chat("big", 1_200_000_000, 1900), chat("small", 1_000_000_000, 1200), *SPEECH),
        ["voice"],
        GPU_2G,
        no_files,
    )
    assert set(by_id(advice)) == {"small", "stt", "tts"} and advice.plan.coresident is True


def test_a_chat_model_gets_8k_context_when_that_keeps_the_lineup_resident(no_files):
    # 32k tokens of 20 KB KV (640 MiB) do not fit beside the speech models; 8k (160 MiB) do.
    long = chat("long", 1_000_000_000, 900, kv=20 * 1024, context=32768)
    advice = recommend(catalog(long, *SPEECH), ["voice"], GPU_2G, no_files)
    models = by_id(advice)
    assert models["long"]["context_len"] == 8192 and advice.plan.coresident is True
    assert any(w.startswith("long: 8192 tokens of context") for w in advice.warnings)
    assert next(m for m in config_of(advice).models if m.id == "long").context_len == 8192


def test_a_chat_model_that_only_partly_fits_is_split_and_scored_down(no_files):
    # 10 layers of 250 MiB in a 2 GiB tier 1: 8 fit, worth 3B * 0.75 * 8/10 = 1.8B; a whole 1.4B
    # model with the resident bonus is worth 1.75B, so the split model wins, with a warning.
    advice = recommend(
        catalog(chat("huge", 3_000_000_000, 2500), chat("mid", 1_400_000_000, 1500)), ["chat"], GPU_2G, no_files
    )
    [model] = advice.as_dict()["models"]
    assert model["id"] == "huge" and (model["gpu_layers"], model["num_layers"]) == (8, 10)
    assert any("only 8 of 10 layers fit tier 1" in w for w in advice.warnings)
    # A model as large as the split one's worth goes whole instead.
    advice = recommend(
        catalog(chat("huge", 3_000_000_000, 2500), chat("mid", 1_900_000_000, 1500)), ["chat"], GPU_2G, no_files
    )
    assert advice.as_dict()["models"][0]["id"] == "mid"


def test_a_gpu_takes_its_lineups_model_and_the_cpu_entries_only_where_none_fits(no_files):
    advice = recommend(
        catalog(chat("gpu-small", 1_000_000_000, 500, gpu=True), chat("cpu", 1_500_000_000, 900)),
        ["chat"],
        GPU_2G,
        no_files,
    )
    assert advice.as_dict()["specs"] == ["gpu-small:Q8_0"]
    # 6000 MiB of layers: not even half of them fit the 2 GiB tier 1.
    advice = recommend(
        catalog(chat("gpu-huge", 9_000_000_000, 6000, gpu=True), chat("cpu", 1_500_000_000, 900)),
        ["chat"],
        GPU_2G,
        no_files,
    )
    assert advice.as_dict()["specs"] == ["cpu:Q8_0"]
    cpu_only = Machine(vram_bytes=0, ram_bytes=16 * GIB, unified_memory=False)
    advice = recommend(
        catalog(chat("gpu-small", 1_000_000_000, 500, gpu=True), chat("cpu", 1_500_000_000, 900)),
        ["chat"],
        cpu_only,
        no_files,
    )
    assert advice.as_dict()["specs"] == ["cpu:Q8_0"]


def test_weights_of_unknown_size_without_params_are_left_out_with_a_warning(no_files):
    unsized = entry("unsized", "text_generation", 1, 0, layers=4)
    unsized["variants"][0]["estimate"].pop("params")
    del unsized["variants"][0]["files"][0]["size"]
    advice = recommend(catalog(unsized, chat("sized", 1_000_000_000, 500)), ["chat"], GPU_2G, no_files)
    assert advice.as_dict()["specs"] == ["sized:Q8_0"]
    assert any(
        w.startswith("unsized:Q8_0: the weights are not on disk, the catalog lists no size") for w in advice.warnings
    )


def test_bits_per_weight_come_from_llama_cpp_and_plain_names():
    assert bits_per_weight("Q8_0") == 8.5 and bits_per_weight("Q4_1") == 5.0
    assert bits_per_weight("Q4_K_M") == 4.89 and bits_per_weight("fp16") == 16
    assert bits_per_weight("mystery") is None


@pytest.mark.parametrize(
    ("text", "size"),
    [("24G", 24 * GIB), ("512M", 512 * MIB), ("64GiB", 64 * GIB), ("1.5G", 3 * GIB // 2), ("25769803776", 24 * GIB)],
)
def test_the_command_reads_binary_sizes(text, size):
    assert byte_size(text) == size


# -- the catalog entries the advisor adds to --------------------------------------------------


@pytest.mark.parametrize("model_id", ["all-minilm-l6-v2", "whisper-tiny.en", "piper-joe"])
def test_the_catalog_block_runs_a_media_model_as_the_default_lineup_does(model_id):
    entry_ = next(e for e in CATALOG.models if e.id == model_id)
    [block] = tomllib.loads(config_block(entry_, entry_.variants[0]))["models"]
    built = ModelConfig.model_validate(block)
    default = next(m for m in DEFAULT_MODELS if m.id == model_id)
    keys = ("modality", "engine", "weights_path", "package", "package_path", "aliases")
    assert {k: getattr(built, k) for k in keys} == {k: getattr(default, k) for k in keys}


@pytest.mark.parametrize("model_id", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_the_catalog_block_of_a_qwen_model_extracts_entities_as_the_default_lineup_does(model_id):
    entry_ = next(e for e in CATALOG.models if e.id == model_id)
    [block] = tomllib.loads(config_block(entry_, entry_.variants[0]))["models"]
    built = ModelConfig.model_validate(block)
    default = next(m for m in DEFAULT_MODELS if m.id == model_id)
    keys = ("modality", "additional_modalities", "engine", "weights_path", "package", "package_parts", "sha256")
    assert {k: getattr(built, k) for k in keys} == {k: getattr(default, k) for k in keys}
    assert built.additional_modalities == ["entity_extraction"]
