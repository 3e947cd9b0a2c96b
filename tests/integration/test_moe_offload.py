"""MoE offload (spec §6). On the real SmolLM2, a dense model, POST /v1/models/{id}/moe-offload
is accepted, shown and ignored. No Mixture-of-Experts model ships with the project, so a tiny one
(2 layers of 4 experts, random weights, 300 kB) is written here with the `gguf` package: llama.cpp
loads and runs it like any llama MoE, which is what the planner, the route and the tensor
buffer-type overrides (set through llama-cpp-python's ctypes params) are checked against.
"""

from __future__ import annotations

import ctypes
import re
import threading
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest

from hypnos_site.config import ModelConfig
from inference.engines.base import ChatWork
from inference.engines.llama import LlamaEngine
from inference.engines.llama_offload import ExpertOffloadModel, expert_pattern
from inference.worker import Worker
from memory.planner import footprint_from_gguf
from tests.conftest import PARIS_MESSAGES
from tests.integration.conftest import post_json, read_in_background, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
SMOL = "smollm2-135m"
URL = f"/v1/models/{SMOL}/moe-offload"


@pytest.fixture
def smol_worker(settings, serve) -> Worker:
    return serve(settings.HYPNOS.model_copy(update={"models": settings.HYPNOS.models[:1]}))


async def memory_row(api) -> dict:
    status = (await api.get("/v1/memory/status")).json()
    return next(m for m in status["models"] if m["id"] == SMOL)


async def test_a_dense_model_accepts_the_mode_and_ignores_it(api, smol_worker):
    before = await memory_row(api)
    assert before["moe_offload"] == "off" and before["expert_bytes"] == 0
    assert before["current_tier"] == "tier1_gpu_vram" and before["placement"]["cpu_expert_layers"] == 0
    response = await post_json(api, URL, {"mode": "auto"})
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["model"] == SMOL and body["moe_offload"] == "auto" and body["applies"] == "now"
    # Ignored: the idle dense model keeps its place (no experts to move, nothing to reload).
    assert body["placement"] == before["placement"]
    after = await memory_row(api)
    assert after["moe_offload"] == "auto" and after["expert_bytes"] == 0
    assert after["current_tier"] == "tier1_gpu_vram" and after["placement"]["cpu_expert_layers"] == 0
    answer = await post_json(api, "/v1/chat/completions", {"model": SMOL, "messages": PARIS_MESSAGES, "max_tokens": 4})
    assert answer.status_code == 200 and answer.json()["hypnos_telemetry"]["previous_tier"] == "tier1_gpu_vram"


async def test_a_busy_model_takes_the_mode_at_its_next_load(api, smol_worker, settings):
    long = [{"role": "user", "content": "Count from one to one hundred in words."}]
    stream = await post_json(api, "/v1/chat/completions", {"model": SMOL, "messages": long, "stream": True})
    reading, chunks = read_in_background(stream)
    try:
        assert await wait_until(lambda: smol_worker.tiers.entries[SMOL].leases > 0, timeout=30)
        body = (await post_json(api, URL, {"mode": "on"})).json()
        assert body["applies"] == "next_load" and body["moe_offload"] == "on"
    finally:
        reading.cancel()
    assert (await memory_row(api))["moe_offload"] == "on"


async def test_an_unknown_mode_is_422_and_an_unknown_model_404(api, smol_worker):
    unknown = await post_json(api, URL, {"mode": "sometimes"})
    assert unknown.status_code == 422
    error = unknown.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "mode" and "sometimes" in error["message"]
    missing = await post_json(api, "/v1/models/nope/moe-offload", {"mode": "auto"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "model_not_found"
    assert (await post_json(api, URL, {})).status_code == 400
    assert (await memory_row(api))["moe_offload"] == "off"


def greedy_tokens(llm: llama_cpp.Llama, n: int) -> list[int]:
    tokens = llm.tokenize(b"The capital of France is", add_bos=True)
    out = []
    for token in llm.generate(tokens, temp=0.0, top_k=1):
        out.append(token)
        if len(out) == n:
            break
    return out


def test_a_model_loads_with_host_memory_overrides_and_answers_the_same(settings):
    """SmolLM2 has no experts, so the override names its last layer's dense FFN tensors: llama.cpp
    must report them overridden to the CPU buffer type, and the answer must not change."""
    weights = settings.HYPNOS.weights_file(settings.HYPNOS.models[0])
    assert LlamaEngine(settings.HYPNOS.models[0], weights, 2).footprint().expert_bytes == 0
    messages: list[bytes] = []

    @llama_cpp.llama_log_callback
    def capture(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        messages.append(text)

    plain = llama_cpp.Llama(model_path=str(weights), n_ctx=256, n_threads=2, verbose=False)
    expected = greedy_tokens(plain, 8)
    plain.close()
    llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
    ExpertOffloadModel.request([r"^blk\.29\.ffn_(up|down|gate)\.weight"])
    try:
        overridden = llama_cpp.Llama(model_path=str(weights), n_ctx=256, n_threads=2, verbose=False)
    finally:
        ExpertOffloadModel.request([])
        llama_cpp.llama_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))
    try:
        log = b"".join(messages).decode(errors="replace")
        moved = sorted(line.split()[1] for line in log.splitlines() if "buffer type overridden to CPU" in line)
        assert moved == ["blk.29.ffn_down.weight", "blk.29.ffn_gate.weight", "blk.29.ffn_up.weight"], log[-2000:]
        assert greedy_tokens(overridden, 8) == expected
    finally:
        overridden.close()


def test_the_expert_pattern_names_only_the_routed_experts_of_its_layers():
    pattern = re.compile(expert_pattern(range(46, 48)))
    assert pattern.search("blk.46.ffn_up_exps.weight") and pattern.search("blk.47.ffn_gate_up_exps.weight")
    assert not pattern.search("blk.45.ffn_down_exps.weight") and not pattern.search("blk.146.ffn_up_exps.weight")
    assert not pattern.search("blk.47.ffn_up_shexp.weight") and not pattern.search("blk.47.attn_q.weight")


# -- a tiny Mixture-of-Experts model -----------------------------------------------------------

MOE = "tiny-moe"
EXPERT_BYTES_PER_LAYER = 3 * 4 * 64 * 32 * 4  # gate, up, down x 4 experts x 64 x 32 x f32


def write_tiny_moe(path: Path, n_layers: int = 2, n_embd: int = 32, n_ff: int = 64, n_expert: int = 4) -> Path:
    """A llama-architecture MoE GGUF with a byte-level vocabulary and random f32 weights."""
    rng = np.random.default_rng(0)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + ["\u2581", "a", "b", "c"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_rope_dimension_count(n_embd // 4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_expert_count(n_expert)
    writer.add_expert_used_count(2)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * 4)  # unknown, control, byte, normal
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    output = weights(len(tokens), n_embd)
    output[2] = 0.0  # the end-of-text logit stays 0, below the best random one: answers run to max_tokens
    writer.add_tensor("token_embd.weight", weights(len(tokens), n_embd))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", output)
    for i in range(n_layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", weights(n_expert, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_gate_exps.weight", weights(n_expert, n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up_exps.weight", weights(n_expert, n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down_exps.weight", weights(n_expert, n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    return write_tiny_moe(tmp_path_factory.mktemp("moe") / "tiny-moe.gguf")


def moe_config(weights: Path) -> ModelConfig:
    return ModelConfig(
        id=MOE,
        modality="text_generation",
        engine="ggml_llama",
        weights_path=str(weights),
        context_len=512,
        initial_tier="tier1_gpu_vram",
    )


def answer(engine: LlamaEngine) -> str:
    parts: list[str] = []
    work = ChatWork(messages=[{"role": "user", "content": "abc"}], max_tokens=8, temperature=0.0)
    engine.chat(work, threading.Event(), lambda text, _: parts.append(text))
    return "".join(parts)


def test_the_experts_of_the_offloaded_layers_load_into_host_memory_and_the_answer_stays(tiny_moe):
    engine = LlamaEngine(moe_config(tiny_moe), tiny_moe, 2)
    assert engine.footprint().layer_expert_bytes == (EXPERT_BYTES_PER_LAYER,) * 2
    engine.load(512, 2)
    expected = answer(engine)
    engine.unload()
    messages: list[bytes] = []

    @llama_cpp.llama_log_callback
    def capture(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        messages.append(text)

    engine.cpu_expert_layers = 1  # the last layer's experts
    llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
    try:
        engine.load(512, 2)
    finally:
        llama_cpp.llama_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))
    try:
        log = b"".join(messages).decode(errors="replace")
        moved = sorted(line.split()[1] for line in log.splitlines() if "buffer type overridden to CPU" in line)
        assert moved == ["blk.1.ffn_down_exps.weight", "blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight"]
        assert answer(engine) == expected and len(expected) > 0
    finally:
        engine.cool()


@pytest.fixture
def moe_worker(settings, serve, tiny_moe) -> Worker:
    """The tiny MoE alone, with a tier-1 budget one byte short of holding it whole at 512 tokens."""
    budget = footprint_from_gguf(tiny_moe).resident_bytes(512) - 1
    config = settings.HYPNOS.model_copy(
        update={
            "models": [moe_config(tiny_moe)],
            "hardware": settings.HYPNOS.hardware.model_copy(update={"simulated_vram_bytes": budget}),
        }
    )
    return serve(config)


async def moe_turn(api) -> dict:
    body = {"model": MOE, "messages": [{"role": "user", "content": "abc"}], "max_tokens": 8, "temperature": 0}
    response = await post_json(api, "/v1/chat/completions", body)
    assert response.status_code == 200, response.content
    return response.json()


async def test_auto_moves_one_layers_experts_instead_of_splitting_the_layers(api, moe_worker):
    row = (await api.get("/v1/memory/status")).json()["models"][0]
    assert row["expert_bytes"] == 2 * EXPERT_BYTES_PER_LAYER and row["moe_offload"] == "off"
    # Off: one byte short means a layer split.
    assert (row["placement"]["gpu_layers"], row["placement"]["cpu_expert_layers"]) == (1, 0)
    split = await moe_turn(api)

    body = (await post_json(api, f"/v1/models/{MOE}/moe-offload", {"mode": "auto"})).json()
    assert body["applies"] == "now" and body["placement"]["primary_tier"] == "tier2_pinned_ram"
    offloaded = await moe_turn(api)
    telemetry = offloaded["hypnos_telemetry"]
    assert telemetry["previous_tier"] == "tier2_pinned_ram"
    placement = telemetry["placement"]
    assert (placement["gpu_layers"], placement["pinned_ram_layers"], placement["cpu_expert_layers"]) == (2, 0, 1)
    assert placement["pinned_ram_bytes"] == EXPERT_BYTES_PER_LAYER
    assert offloaded["choices"][0]["message"]["content"] == split["choices"][0]["message"]["content"]

    await post_json(api, f"/v1/models/{MOE}/moe-offload", {"mode": "on"})
    placement = (await moe_turn(api))["hypnos_telemetry"]["placement"]
    assert placement["cpu_expert_layers"] == 2 and placement["pinned_ram_bytes"] == 2 * EXPERT_BYTES_PER_LAYER
    row = (await api.get("/v1/memory/status")).json()["models"][0]
    assert row["moe_offload"] == "on" and row["placement"]["cpu_expert_layers"] == 2
