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


@dataclass(frozen=True)
class Footprint:
    """What a model needs, from its files: weights per layer, KV per token, workspace."""

    layer_bytes: tuple[int, ...]
    # Tensors outside the repeating layers (embeddings, output head, norms).
    other_bytes: int
    kv_bytes_per_token: int
    workspace_bytes: int
    trained_context_len: int = 0

    @property
    def n_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def weights_bytes(self) -> int:
        return sum(self.layer_bytes) + self.other_bytes

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
    other = 0
    for tensor in info.tensors:
        match = _LAYER.match(tensor.name)
        if match:
            layers[int(match.group(1))] = layers.get(int(match.group(1)), 0) + tensor.n_bytes
        else:
            other += tensor.n_bytes
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
    )


def footprint_from_files(paths: list[Path], workspace_bytes: int) -> Footprint:
    """Engines without layers (ONNX, CTranslate2, ...): the files plus a measured workspace."""
    return Footprint(
        layer_bytes=(),
        other_bytes=sum(p.stat().st_size for p in paths),
        kv_bytes_per_token=0,
        workspace_bytes=workspace_bytes,
    )


def plan_placement(fp: Footprint, context_len: int, free_tier1: int, min_gpu_layer_ratio: float) -> Placement | None:
    """The placement that puts the most layers in tier 1 within `free_tier1` bytes: whole when it
    fits, else the first k layers (with their KV) down to `min_gpu_layer_ratio` of them, the rest
    served from tier 2. None when not even that fits."""
    if fp.resident_bytes(context_len) <= free_tier1:
        return Placement(
            primary_tier=MemoryTier.TIER1,
            gpu_layers=fp.n_layers,
            vram_weight_bytes=fp.weights_bytes,
            vram_kv_and_workspace_bytes=fp.kv_bytes(context_len) + fp.workspace_bytes,
            allocated_context_len=context_len,
        )
    if not fp.n_layers:
        return None
    floor = max(1, math.ceil(min_gpu_layer_ratio * fp.n_layers))
    for k in range(fp.n_layers - 1, floor - 1, -1):
        vram_weights = sum(fp.layer_bytes[:k])
        vram_kv = fp.kv_bytes(context_len, k) + fp.workspace_bytes
        if vram_weights + vram_kv <= free_tier1:
            return Placement(
                primary_tier=MemoryTier.TIER1,
                gpu_layers=k,
                pinned_ram_layers=fp.n_layers - k,
                vram_weight_bytes=vram_weights,
                vram_kv_and_workspace_bytes=vram_kv,
                pinned_ram_bytes=fp.weights_bytes - vram_weights + fp.kv_bytes(context_len) - fp.kv_bytes(context_len, k),
                allocated_context_len=context_len,
            )
    return None


def warm_placement(fp: Footprint) -> Placement:
    """Tier 2: every layer's weights in worker-owned host memory, no context."""
    return Placement(
        primary_tier=MemoryTier.TIER2,
        pinned_ram_layers=fp.n_layers,
        pinned_ram_bytes=fp.weights_bytes,
    )


def cold_placement(fp: Footprint) -> Placement:
    return Placement.on_disk(fp.n_layers)
