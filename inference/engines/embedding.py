"""Sentence embeddings from a GGUF encoder (BERT family) through llama-cpp-python.

The model moves through the tiers exactly like a chat model (the same warm copy, footprint from
the GGUF header, load and cool); only the context is created in embedding mode."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import llama_cpp
import numpy as np

from hypnos_site.errors import Cancelled, ContextLengthExceeded, InvalidRequest
from inference.engines.llama import LlamaEngine


class LlamaEmbeddingEngine(LlamaEngine):
    """A GGUF embedding model (mean or CLS pooling, as its GGUF says); vectors L2-normalized."""

    def _context_options(self, context_len: int) -> dict[str, Any]:
        # An encoder sees a whole input in one batch: the batch is the context.
        return {"embedding": True, "n_batch": context_len, "n_ubatch": context_len}

    def _ready(self, llm: llama_cpp.Llama) -> None:
        """Nothing to prepare: no chat template, no slots."""

    def embed(self, inputs: list[str] | list[list[int]], cancel: threading.Event) -> tuple[list[np.ndarray], int]:
        llm = self._llm
        assert llm is not None, "embed on an unloaded engine"
        items: Sequence[str | list[int]] = inputs
        sequences = [_token_ids(llm, index, item) for index, item in enumerate(items)]
        n_ctx = llm.n_ctx()
        for index, tokens in enumerate(sequences):
            if len(tokens) > n_ctx:
                raise ContextLengthExceeded(
                    f"Input {index} is {len(tokens)} tokens but the model's context is {n_ctx} tokens.", param="input"
                )
        vectors = []
        for tokens in sequences:
            if cancel.is_set():
                raise Cancelled("the request was cancelled")
            vector = _pooled(llm, tokens)
            norm = np.linalg.norm(vector)
            vectors.append((vector / norm if norm > 0 else vector).astype(np.float32))
        return vectors, sum(len(tokens) for tokens in sequences)


def _token_ids(llm: llama_cpp.Llama, index: int, item: str | list[int]) -> list[int]:
    """A text tokenized as llama-cpp-python's `embed` does it (special tokens added: [CLS] ...
    [SEP] for BERT), or token ids as given, refused when one is outside the vocabulary."""
    if isinstance(item, str):
        tokens = llm.tokenize(item.encode("utf-8"))
        if not tokens:
            raise InvalidRequest(f"input[{index}] gives no tokens", param="input")
        return tokens
    n_vocab = llm.n_vocab()
    if max(item) >= n_vocab:
        raise InvalidRequest(
            f"input[{index}] holds the token id {max(item)}, outside the model's vocabulary (0 to {n_vocab - 1})",
            param="input",
        )
    return item


def _pooled(llm: llama_cpp.Llama, tokens: list[int]) -> np.ndarray:
    """The pooled embedding of one token sequence, evaluated alone: what `Llama.embed` does for
    one input, taking ids instead of a text (no detokenize and retokenize round trip). Alone,
    because a batch does not give bit for bit the vectors of single calls (evaluated together,
    the matrix kernels' blocking changes the last bits)."""
    batch, ctx = llm._batch, llm._ctx
    batch.reset()
    # Every token an output, as `Llama.embed` marks them (llama.cpp otherwise warns per input).
    batch.add_sequence(tokens, 0, True)
    ctx.kv_cache_clear()
    try:
        ctx.decode(batch)
        pointer = llama_cpp.llama_get_embeddings_seq(ctx.ctx, 0)
        if not pointer:
            raise RuntimeError("the GGUF pools no sentence embedding (pooling type none)")
        return np.array(pointer[: llm.n_embd()], dtype=np.float64)
    finally:
        batch.reset()
        ctx.kv_cache_clear()
