"""Footprints read from model files, and the placement planner (spec §18 LayerPlacementPlan)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from memory.gguf import GgufInfo, read_gguf
from memory.tiers import MemoryTier, Placement

KV_BYTES_PER_ELEMENT = 2  # f16 KV cache, llama.cpp's default
LOGITS_BATCH = 512  # llama.cpp's default n_batch: logits and activations are sized for it
_LAYER = re.compile(r"^blk\.(\d+)\.")
# A Mixture-of-Experts layer's routed experts, as llama.cpp's own `--override-tensor` examples
# name them (ffn_up_exps, ffn_gate_exps, ffn_down_exps, ffn_gate_up_exps); the shared experts
# (`ffn_*_shexp`) run for every token and stay with their layer.
EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_[a-z_]*_exps\.")
MOE_OFFLOAD_MODES: tuple[str, ...] = ("off", "auto", "on")


@dataclass(frozen=True)
class Footprint:
    """What a model needs, from its files: weights per layer, KV per token, workspace."""

    layer_bytes: tuple[int, ...]
    # Tensors outside the repeating layers (embeddings, output head, norms).
    other_bytes: int
    kv_bytes_per_token: int
    workspace_bytes: int
    trained_context_len: int = 0
    # Per layer, the bytes of its routed experts (part of `layer_bytes`); empty for dense models.
    layer_expert_bytes: tuple[int, ...] = ()

    @property
    def n_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def weights_bytes(self) -> int:
        return sum(self.layer_bytes) + self.other_bytes

    @property
    def expert_bytes(self) -> int:
        """All the routed experts' bytes (0 for a dense model)."""
        return sum(self.layer_expert_bytes)

    def host_expert_bytes(self, gpu_layers: int, cpu_expert_layers: int) -> int:
        """Expert bytes of the GPU layers among the last `cpu_expert_layers`: what MoE offload
        keeps in host memory (layers past `gpu_layers` are in host memory whole anyway)."""
        first = max(self.n_layers - cpu_expert_layers, 0)
        return sum(self.layer_expert_bytes[first:gpu_layers])

    def kv_bytes(self, context_len: int, layers: int | None = None) -> int:
        """KV cache for `context_len` tokens over `layers` layers (all of them by default)."""
        if not self.n_layers:
            return 0
        share = (self.n_layers if layers is None else layers) / self.n_layers
        return int(self.kv_bytes_per_token * context_len * share)

    def resident_bytes(self, context_len: int) -> int:
        return self.weights_bytes + self.kv_bytes(context_len) + self.workspace_bytes


def footprint_from_gguf(path: str | Path) -> Footprint:
    return footprint_from_info(read_gguf(path))


def footprint_from_info(info: GgufInfo) -> Footprint:
    layers: dict[int, int] = {}
    experts: dict[int, int] = {}
    other = 0
    for tensor in info.tensors:
        match = _LAYER.match(tensor.name)
        if match:
            layers[int(match.group(1))] = layers.get(int(match.group(1)), 0) + tensor.n_bytes
        else:
            other += tensor.n_bytes
        expert = EXPERT_TENSOR.match(tensor.name)
        if expert:
            experts[int(expert.group(1))] = experts.get(int(expert.group(1)), 0) + tensor.n_bytes
    n_layers = info.arch_int("block_count") or len(layers)
    heads = info.arch_int("attention.head_count") or 1
    kv_heads = info.arch_int("attention.head_count_kv") or heads
    head_k = info.arch_int("attention.key_length") or info.arch_int("embedding_length") // heads
    head_v = info.arch_int("attention.value_length") or head_k
    embd = info.arch_int("embedding_length")
    vocab = info.arch_int("vocab_size") or info.array_lengths.get("tokenizer.ggml.tokens", 0)
    # llama.cpp's compute buffer is dominated by one batch of f32 logits; calibrated on SmolLM2
    # (estimate 100.5 MiB, llama.cpp reports 99.4 MiB at n_batch 512).
    workspace = LOGITS_BATCH * 4 * (vocab + 4 * embd)
    return Footprint(
        layer_bytes=tuple(layers.get(i, 0) for i in range(n_layers)),
        other_bytes=other,
        kv_bytes_per_token=n_layers * kv_heads * (head_k + head_v) * KV_BYTES_PER_ELEMENT,
        workspace_bytes=workspace,
        trained_context_len=info.arch_int("context_length"),
        layer_expert_bytes=tuple(experts.get(i, 0) for i in range(n_layers)) if experts else (),
    )


def footprint_from_files(paths: list[Path], workspace_bytes: int) -> Footprint:
    """Engines without layers (ONNX, CTranslate2, ...): the files plus a measured workspace."""
    return Footprint(
        layer_bytes=(),
        other_bytes=sum(p.stat().st_size for p in paths),
        kv_bytes_per_token=0,
        workspace_bytes=workspace_bytes,
    )


def plan_placement(
    fp: Footprint, context_len: int, free_tier1: int, min_gpu_layer_ratio: float, moe_offload: str = "off"
) -> Placement | None:
    """The placement that puts the most of the model in tier 1 within `free_tier1` bytes: whole
    when it fits, else the first k layers (with their KV) down to `min_gpu_layer_ratio` of them,
    the rest served from tier 2. None when not even that fits.

    `moe_offload` (spec §6; a dense model ignores it): "on" keeps every layer's routed experts
    in tier 2; "auto", when the model does not fit whole, keeps the experts of as few layers as
    needed (counted from the last) in tier 2 before any layer split, and splits with every
    layer's experts there when even that does not fit."""
    n = fp.n_layers
    moe = moe_offload if fp.expert_bytes else "off"
    offloaded = n if moe == "on" else 0
    candidates = [offloaded, *(range(1, n + 1) if moe == "auto" else ())]
    for cpu_expert_layers in candidates:
        placement = _placement(fp, context_len, n, cpu_expert_layers)
        if _tier1_bytes(placement) <= free_tier1:
            return placement
    if not n:
        return None
    if moe == "auto":
        offloaded = n
    floor = max(1, math.ceil(min_gpu_layer_ratio * n))
    for k in range(n - 1, floor - 1, -1):
        placement = _placement(fp, context_len, k, offloaded)
        if _tier1_bytes(placement) <= free_tier1:
            return placement
    return None


def _placement(fp: Footprint, context_len: int, gpu_layers: int, cpu_expert_layers: int) -> Placement:
    """Tier 1 holding the first `gpu_layers` layers (and, with all of them, the tensors outside
    the layers), minus the experts MoE offload keeps in tier 2; tier 2 holding the rest."""
    n = fp.n_layers
    in_layers = fp.weights_bytes if gpu_layers == n else sum(fp.layer_bytes[:gpu_layers])
    vram_weights = in_layers - fp.host_expert_bytes(gpu_layers, cpu_expert_layers)
    host_kv = fp.kv_bytes(context_len) - fp.kv_bytes(context_len, gpu_layers)
    return Placement(
        primary_tier=MemoryTier.TIER1,
        gpu_layers=gpu_layers,
        pinned_ram_layers=n - gpu_layers,
        vram_weight_bytes=vram_weights,
        vram_kv_and_workspace_bytes=fp.kv_bytes(context_len, gpu_layers) + fp.workspace_bytes,
        pinned_ram_bytes=fp.weights_bytes - vram_weights + host_kv,
        allocated_context_len=context_len,
        cpu_expert_layers=cpu_expert_layers,
    )


def _tier1_bytes(placement: Placement) -> int:
    return placement.vram_weight_bytes + placement.vram_kv_and_workspace_bytes


def warm_placement(fp: Footprint) -> Placement:
    """Tier 2: every layer's weights in worker-owned host memory, no context."""
    return Placement(
        primary_tier=MemoryTier.TIER2,
        pinned_ram_layers=fp.n_layers,
        pinned_ram_bytes=fp.weights_bytes,
    )


def cold_placement(fp: Footprint) -> Placement:
    return Placement.on_disk(fp.n_layers)
