"""A random-weight model that stable-diffusion.cpp loads, for the diffusion engine's tests.

Plumbing, not a trained model: every weight is seeded random noise, so the pictures are noise
too. No text-to-image weights ship on any registry these machines reach, so the tests build one
of an architecture stable-diffusion.cpp accepts, as small as its loader allows.

stable-diffusion.cpp fixes most architectures' shapes in code (SD 1.x is ~1B parameters, SD3
24 blocks at least, CLIP and T5 encoders whole). FLUX.2 klein is the smallest it accepts: its
DiT reads depth, width and head size from the tensors (flux.hpp), its Qwen3 text encoder reads
layers, width, feed-forward size and vocabulary from them (llm.hpp), and TAESD for FLUX.2
(taef2, tae.hpp) stands in for the VAE. What the code still fixes: a head is 128 wide (the
rope axes sum to 128), the encoder's attention has 32 query and 8 key/value heads of 128, and
the vocabulary must cover the Qwen2 tokenizer's ids (151,668 with the chat markers).

Three safetensors files, the way FLUX.2 klein ships (a bare diffusion model, a text encoder
and a VAE), ~25 MB together, written tensor by tensor in chunks so memory stays low:

- `tiny-flux2-klein.safetensors`: the DiT, hidden 128 (one head), 1 double- and 1 single-stream
  block, FLUX.2's shared modulation, no biases; 128 latent channels in and out (patch 1);
- `tiny-qwen3.safetensors`: one Qwen3 layer, hidden 64, feed-forward 128, Hugging Face names
  (`model.layers.0...`); with fewer layers than klein reads from (9, 18, 27), stable-diffusion.cpp
  takes the final norm's output, so the DiT's context is 64 wide;
- `tiny-taef2.safetensors`: TAESD's encoder and decoder, 64 channels, 32 latent channels, the
  group-norm mid blocks of taef2.

Weights are drawn from numpy's PCG64 seeded with (seed, crc32 of the tensor's name), so the same
seed gives the same bytes, whatever order the tensors are written in."""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Shapes of the random model (see the module docstring for what stable-diffusion.cpp fixes).
DIT_HIDDEN = 128
HEAD_DIM = 128
LATENT_CHANNELS = 128
DIT_MLP = 3 * DIT_HIDDEN
LLM_HIDDEN = 64
LLM_FEED_FORWARD = 128
LLM_VOCAB = 151936
LLM_QUERY_WIDTH = 32 * 128
LLM_KV_WIDTH = 8 * 128
TAE_CHANNELS = 64
TAE_LATENT = 32

# Rows of a tensor drawn and written at once: the largest tensor (the 151936 x 64 embedding)
# then never sits in memory whole.
CHUNK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: its name, its shape (outermost first, as PyTorch orders it), its
    dtype and how its random values are drawn (`std` 0: all `fill`)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "F16"
    std: float = 0.0
    fill: float = 0.0


@dataclass(frozen=True)
class TinyDiffusionModel:
    """The paths of a built random model (plumbing, not a trained model): `weights` the DiT
    (a model block's weights_path), `text_encoder` the Qwen3 encoder ([models.image]
    text_encoders.llm), `vae` the taef2 autoencoder (aux_path)."""

    weights: Path
    text_encoder: Path
    vae: Path

    @property
    def files(self) -> list[Path]:
        return [self.weights, self.text_encoder, self.vae]


def _linear(name: str, out_features: int, in_features: int) -> TensorSpec:
    return TensorSpec(f"{name}.weight", (out_features, in_features), std=in_features**-0.5)


def _norm(name: str, width: int, key: str = "weight") -> TensorSpec:
    return TensorSpec(f"{name}.{key}", (width,), dtype="F32", std=0.02, fill=1.0)


def _conv(name: str, out_channels: int, in_channels: int, kernel: int, bias: bool = True) -> list[TensorSpec]:
    # sd.cpp keeps conv kernels in f16 and conv biases in f32 whatever the file holds.
    fan_in = in_channels * kernel * kernel
    # 1/sqrt(fan_in): He's sqrt(2) more saturates the random decoder's output (a flat picture),
    # half of it darkens it to near black.
    found = [TensorSpec(f"{name}.weight", (out_channels, in_channels, kernel, kernel), std=fan_in**-0.5)]
    if bias:
        found.append(TensorSpec(f"{name}.bias", (out_channels,), dtype="F32", std=0.01))
    return found


def dit_tensors() -> list[TensorSpec]:
    """FLUX.2 klein's DiT (flux.hpp with FLUX.2's parameters: patch 1, mlp ratio 3 with a gated
    SiLU, shared modulation, no biases), one double- and one single-stream block. Random
    weights: plumbing, not a trained model."""
    h, found = DIT_HIDDEN, []
    found.append(_linear("img_in", h, LATENT_CHANNELS))
    found.append(_linear("time_in.in_layer", h, 256))
    found.append(_linear("time_in.out_layer", h, h))
    found.append(_linear("txt_in", h, LLM_HIDDEN))
    for stream in ("img", "txt"):
        block = f"double_blocks.0.{stream}"
        found.append(_linear(f"{block}_attn.qkv", 3 * h, h))
        found.append(_norm(f"{block}_attn.norm.query_norm", HEAD_DIM, "scale"))
        found.append(_norm(f"{block}_attn.norm.key_norm", HEAD_DIM, "scale"))
        found.append(_linear(f"{block}_attn.proj", h, h))
        found.append(_linear(f"{block}_mlp.0", 2 * DIT_MLP, h))
        found.append(_linear(f"{block}_mlp.2", h, DIT_MLP))
    found.append(_linear("single_blocks.0.linear1", 3 * h + 2 * DIT_MLP, h))
    found.append(_linear("single_blocks.0.linear2", h, h + DIT_MLP))
    found.append(_norm("single_blocks.0.norm.query_norm", HEAD_DIM, "scale"))
    found.append(_norm("single_blocks.0.norm.key_norm", HEAD_DIM, "scale"))
    found.append(_linear("final_layer.linear", LATENT_CHANNELS, h))
    found.append(_linear("final_layer.adaLN_modulation.1", 2 * h, h))
    found.append(_linear("double_stream_modulation_img.lin", 6 * h, h))
    found.append(_linear("double_stream_modulation_txt.lin", 6 * h, h))
    found.append(_linear("single_stream_modulation.lin", 3 * h, h))
    return found


def text_encoder_tensors() -> list[TensorSpec]:
    """A one-layer Qwen3 (llm.hpp's QWEN3 arch) under Hugging Face names. Random weights:
    plumbing, not a trained model."""
    d, layer = LLM_HIDDEN, "model.layers.0"
    return [
        TensorSpec("model.embed_tokens.weight", (LLM_VOCAB, d), std=1.0),
        _norm(f"{layer}.input_layernorm", d),
        _linear(f"{layer}.self_attn.q_proj", LLM_QUERY_WIDTH, d),
        _linear(f"{layer}.self_attn.k_proj", LLM_KV_WIDTH, d),
        _linear(f"{layer}.self_attn.v_proj", LLM_KV_WIDTH, d),
        _linear(f"{layer}.self_attn.o_proj", d, LLM_QUERY_WIDTH),
        _norm(f"{layer}.self_attn.q_norm", HEAD_DIM),
        _norm(f"{layer}.self_attn.k_norm", HEAD_DIM),
        _norm(f"{layer}.post_attention_layernorm", d),
        _linear(f"{layer}.mlp.gate_proj", LLM_FEED_FORWARD, d),
        _linear(f"{layer}.mlp.up_proj", LLM_FEED_FORWARD, d),
        _linear(f"{layer}.mlp.down_proj", d, LLM_FEED_FORWARD),
        _norm("model.norm", d),
    ]


def _tae_block(name: str, channels: int, group_norm: bool) -> list[TensorSpec]:
    found = [*_conv(f"{name}.conv.0", channels, channels, 3)]
    found += _conv(f"{name}.conv.2", channels, channels, 3)
    found += _conv(f"{name}.conv.4", channels, channels, 3)
    if group_norm:
        # taef2's mid blocks: a 1x1 conv to 4x the channels, GroupNorm(4), ReLU, a 1x1 conv back.
        found += _conv(f"{name}.pool.0", 4 * channels, channels, 1, bias=False)
        found.append(_norm(f"{name}.pool.1", 4 * channels))
        found.append(TensorSpec(f"{name}.pool.1.bias", (4 * channels,), dtype="F32"))
        found += _conv(f"{name}.pool.3", channels, 4 * channels, 1, bias=False)
    return found


def vae_tensors() -> list[TensorSpec]:
    """TAESD for FLUX.2 (tae.hpp's TinyEncoder/TinyDecoder with taef2's group-norm mid blocks),
    encoder and decoder. Random weights: plumbing, not a trained model."""
    c, found = TAE_CHANNELS, []
    # Encoder: conv, block, then three times (stride-2 conv, three blocks), conv to the latent.
    found += _conv("encoder.layers.0", c, 3, 3)
    found += _tae_block("encoder.layers.1", c, False)
    index = 2
    for stage in range(3):
        found += _conv(f"encoder.layers.{index}", c, c, 3, bias=False)
        for offset in range(1, 4):
            found += _tae_block(f"encoder.layers.{index + offset}", c, group_norm=stage == 2)
        index += 4
    found += _conv(f"encoder.layers.{index}", TAE_LATENT, c, 3)
    # Decoder: conv from the latent, ReLU (1), then three times (three blocks, upsample, conv),
    # a block and the conv to RGB; the mid blocks of the first stage carry the group norms.
    found += _conv("decoder.layers.0", c, TAE_LATENT, 3)
    index = 2
    for stage in range(3):
        for offset in range(3):
            found += _tae_block(f"decoder.layers.{index + offset}", c, group_norm=stage == 0)
        found += _conv(f"decoder.layers.{index + 4}", c, c, 3, bias=False)
        index += 5
    found += _tae_block(f"decoder.layers.{index}", c, False)
    found += _conv(f"decoder.layers.{index + 1}", 3, c, 3)
    return found


def _values(spec: TensorSpec, seed: int) -> Iterator[np.ndarray]:
    """The tensor's values in row chunks, as bytes of its dtype, drawn deterministically."""
    rng = np.random.Generator(np.random.PCG64([seed, zlib.crc32(spec.name.encode())]))
    dtype = np.float16 if spec.dtype == "F16" else np.float32
    total = int(np.prod(spec.shape))
    for start in range(0, total, CHUNK_ELEMENTS):
        count = min(CHUNK_ELEMENTS, total - start)
        chunk = (
            spec.fill + spec.std * rng.standard_normal(count, dtype=np.float32)
            if spec.std
            else np.full(count, spec.fill)
        )
        yield np.asarray(chunk, dtype=dtype)


def write_safetensors(path: Path, tensors: list[TensorSpec], seed: int) -> None:
    """Write `tensors` with random values to a safetensors file, chunk by chunk (the header
    first: its offsets are known from the shapes)."""
    header: dict[str, object] = {"__metadata__": {"note": "random weights: plumbing, not a trained model"}}
    offset = 0
    for spec in tensors:
        size = int(np.prod(spec.shape)) * (2 if spec.dtype == "F16" else 4)
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for spec in tensors:
            for chunk in _values(spec, seed):
                out.write(chunk.tobytes())
    partial.replace(path)


def build_tiny_diffusion_model(directory: Path, seed: int = 0) -> TinyDiffusionModel:
    """The random FLUX.2 klein-shaped model (plumbing, not a trained model) in `directory`,
    written unless its three files are already there (a file appears only once complete)."""
    directory.mkdir(parents=True, exist_ok=True)
    model = TinyDiffusionModel(
        weights=directory / "tiny-flux2-klein.safetensors",
        text_encoder=directory / "tiny-qwen3.safetensors",
        vae=directory / "tiny-taef2.safetensors",
    )
    for path, tensors in zip(model.files, (dit_tensors(), text_encoder_tensors(), vae_tensors()), strict=True):
        if not path.exists():
            write_safetensors(path, tensors, seed)
    return model
