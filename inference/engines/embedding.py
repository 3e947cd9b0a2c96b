"""Sentence embeddings from a GGUF encoder (BERT family) through llama-cpp-python.

The model moves through the tiers exactly like a chat model (the same warm copy, footprint from
the GGUF header, load and cool); only the context is created in embedding mode."""

from __future__ import annotations

import threading
from typing import Any

import llama_cpp
import numpy as np

from hypnos_site.errors import Cancelled, ContextLengthExceeded
from inference.engines.llama import LlamaEngine


class LlamaEmbeddingEngine(LlamaEngine):
    """A GGUF embedding model (mean or CLS pooling, as its GGUF says); vectors L2-normalized."""

    def _context_options(self, context_len: int) -> dict[str, Any]:
        # An encoder sees a whole input in one batch: the batch is the context.
        return {"embedding": True, "n_batch": context_len, "n_ubatch": context_len}

    def _ready(self, llm: llama_cpp.Llama) -> None:
        """Nothing to prepare: no chat template, no slots."""

    def embed(self, texts: list[str], cancel: threading.Event) -> tuple[list[np.ndarray], int]:
        llm = self._llm
        assert llm is not None, "embed on an unloaded engine"
        counts = [len(llm.tokenize(text.encode("utf-8"))) for text in texts]
        n_ctx = llm.n_ctx()
        for index, count in enumerate(counts):
            if count > n_ctx:
                raise ContextLengthExceeded(
                    f"Input {index} is {count} tokens but the model's context is {n_ctx} tokens.", param="input"
                )
        vectors = []
        for text in texts:
            if cancel.is_set():
                raise Cancelled("the request was cancelled")
            # One evaluation per input: a batch gives bit for bit the vectors of single calls
            # (evaluated together, the matrix kernels' blocking changes the last bits).
            vector = np.asarray(llm.embed(text, normalize=False, truncate=False), dtype=np.float64)
            norm = np.linalg.norm(vector)
            vectors.append((vector / norm if norm > 0 else vector).astype(np.float32))
        return vectors, sum(counts)
