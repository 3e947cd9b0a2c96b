"""A llama-architecture GGUF with random weights, written with the `gguf` package and numpy.

No real model fits what may be carried to the device machine (the lineup's smallest GGUF is
~90 MiB, the 1.5B chat model 1.1 GB), and the GPU check needs bytes NVML can see beside the CUDA
context; a generated model is as large as asked, in seconds. llama.cpp loads it like any llama
and answers deterministically under greedy sampling, which is all the checks need: the same
answer after a KV park and restore, on a partial placement, from llama-server. The end-of-text
logit is held at 0, below the best random one, so answers always run to max_tokens.

    python3 -m bench.gpu.model OUT.gguf --mib 1024
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

SPECIAL = ["<unk>", "<s>", "</s>"]
BYTES = [f"<0x{i:02X}>" for i in range(256)]
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@dataclass(frozen=True)
class Shape:
    layers: int
    embd: int
    ff: int
    heads: int
    kv_heads: int
    vocab: int
    f16: bool = True
    context: int = 4096

    @property
    def head_dim(self) -> int:
        return self.embd // self.heads

    def layer_params(self) -> int:
        kv = self.kv_heads * self.head_dim
        return 2 * self.embd * self.embd + 2 * self.embd * kv + 3 * self.embd * self.ff + 2 * self.embd

    def bytes(self) -> int:
        params = self.layers * self.layer_params() + 2 * self.vocab * self.embd + self.embd
        return params * (2 if self.f16 else 4)


# The CPU rehearsal's model: a few hundred kB, loads in milliseconds.
TINY = Shape(layers=2, embd=64, ff=128, heads=4, kv_heads=2, vocab=300, f16=False, context=512)


def shape_for(mib: int, embd: int = 2048, ff: int = 5632, vocab: int = 32000) -> Shape:
    """A model of about `mib` MiB (f16): as many 2048-wide layers as fit beside a 32k-token
    vocabulary (whose input embedding llama.cpp keeps in host memory, and whose output head goes
    to the GPU with the first offloaded layer), at least 4 so a partial placement has layers to
    split."""
    base = Shape(layers=0, embd=embd, ff=ff, heads=16, kv_heads=4, vocab=vocab)
    per_layer = base.layer_params() * 2
    layers = max(4, (mib * 2**20 - base.bytes()) // per_layer)
    return Shape(layers=int(layers), embd=embd, ff=ff, heads=16, kv_heads=4, vocab=vocab)


def tokens(vocab: int) -> list[str]:
    """Special and byte tokens (any text tokenises), then filler words up to `vocab`."""
    fillers = ["\u2581", "a", "b", "c"] + [f"\u2581w{i}" for i in range(vocab)]
    return (SPECIAL + BYTES + fillers)[: max(vocab, len(SPECIAL) + len(BYTES) + 4)]


def write_model(path: Path, shape: Shape, seed: int = 0) -> Path:
    """Write the model to `path`; weights ~ N(0, 1/fan_in), so activations stay near 1 in f16."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    dtype = np.float16 if shape.f16 else np.float32
    vocab = tokens(shape.vocab)

    def weights(rows: int, cols: int) -> np.ndarray:
        # gguf's numpy shapes are (rows = output, cols = input): the fan-in is the last axis.
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(dtype)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("hypnos-gpu-check random llama")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.embd)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ff)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(1 if shape.f16 else 0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab)
    writer.add_token_scores([0.0] * len(vocab))
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(vocab) - 259))  # unknown, control, byte, normal
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(TEMPLATE)
    output = weights(len(vocab), shape.embd)
    output[2] = 0  # the end-of-text logit stays 0, below the best random one
    writer.add_tensor("token_embd.weight", weights(len(vocab), shape.embd))
    writer.add_tensor("output_norm.weight", np.ones(shape.embd, dtype=np.float32))
    writer.add_tensor("output.weight", output)
    kv = shape.kv_heads * shape.head_dim
    for i in range(shape.layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(shape.embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weights(shape.embd, shape.embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weights(kv, shape.embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weights(kv, shape.embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weights(shape.embd, shape.embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(shape.embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weights(shape.ff, shape.embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weights(shape.ff, shape.embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weights(shape.embd, shape.ff))
    path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--mib", type=int, default=0, help="about this many MiB (f16); 0: the tiny CPU model")
    args = parser.parse_args(argv)
    shape = shape_for(args.mib) if args.mib else TINY
    write_model(args.out, shape)
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.1f} MiB, {shape}")


if __name__ == "__main__":
    main()
