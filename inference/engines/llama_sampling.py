"""Grammar-constrained sampling the way llama.cpp's own server does it (common/sampling.cpp,
`common_sampler_sample`): the sampler chain picks a token from the model's logits as they are,
the grammar checks that one token, and only a token the grammar refuses costs the grammar's pass
over the whole vocabulary, after which the chain picks again from what the grammar allows.

llama-cpp-python puts the grammar inside the chain instead, so every token pays that pass: on a
151,936-token vocabulary (Qwen2.5) it took about as long as the model's own evaluation of the
token on two CPU cores (bench/grammar.py measures both orders side by side). The answer does not
change: a greedy pick the grammar accepts is also the best token the grammar allows, and a
sample is drawn from the same distribution (one the grammar refuses is drawn again from the
allowed ones, which is the masked distribution)."""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp
import llama_cpp._internals as internals
import numpy as np


class GrammarSampler:
    """A sampler chain (its grammar left out) and the grammar, checked token by token. Used
    where llama-cpp-python uses its LlamaSampler: `sample(ctx, idx)` returns the token and
    accepts it into both; `close()` frees both."""

    def __init__(self, llm: llama_cpp.Llama, chain: internals.LlamaSampler, grammar: llama_cpp.LlamaGrammar):
        self.chain = chain
        self.grammar = llama_cpp.llama_sampler_init_grammar(
            llm._model.vocab, grammar._grammar.encode("utf-8"), grammar._root.encode("utf-8")
        )
        if not self.grammar:  # json_grammar checked it first: libllama parses it the same way
            chain.close()
            raise ValueError("libllama refused the grammar")
        self.n_vocab = llm.n_vocab()
        # The candidates: every token with its logit, refilled before each pass of the chain
        # (the chain sorts and truncates them in place).
        self._data = (llama_cpp.llama_token_data * self.n_vocab)()
        self._view = np.ctypeslib.as_array(self._data)
        self._ids = np.arange(self.n_vocab, dtype=np.intc)
        self._candidates = llama_cpp.llama_token_data_array(data=self._data, size=0, selected=-1, sorted=False)
        self._one = (llama_cpp.llama_token_data * 1)()
        self._picked = llama_cpp.llama_token_data_array(data=self._one, size=1, selected=-1, sorted=False)
        # Tokens the grammar refused, each picked again from what it allows (for the tests).
        self.refused = 0

    def sample(self, ctx: internals.LlamaContext, idx: int = -1) -> int:
        logits = llama_cpp.llama_get_logits_ith(ctx.ctx, idx)
        token = self._pick(logits, with_grammar=False)
        if not self._allows(token):
            self.refused += 1
            token = self._pick(logits, with_grammar=True)
        llama_cpp.llama_sampler_accept(self.grammar, token)
        llama_cpp.llama_sampler_accept(self.chain.sampler, token)
        return token

    def _pick(self, logits: Any, with_grammar: bool) -> int:
        self._view["id"] = self._ids
        self._view["logit"] = np.ctypeslib.as_array(logits, shape=(self.n_vocab,))
        self._view["p"] = 0.0
        candidates = self._candidates
        candidates.size, candidates.selected, candidates.sorted = self.n_vocab, -1, False
        if with_grammar:
            llama_cpp.llama_sampler_apply(self.grammar, ctypes.byref(candidates))
        llama_cpp.llama_sampler_apply(self.chain.sampler, ctypes.byref(candidates))
        return int(self._data[candidates.selected].id)

    def _allows(self, token: int) -> bool:
        self._one[0] = llama_cpp.llama_token_data(token, 0.0, 0.0)
        self._picked.size, self._picked.selected, self._picked.sorted = 1, -1, False
        llama_cpp.llama_sampler_apply(self.grammar, ctypes.byref(self._picked))
        return bool(self._one[0].logit != float("-inf"))

    def close(self) -> None:
        if self.grammar:
            llama_cpp.llama_sampler_free(self.grammar)
            self.grammar = None
        self.chain.close()

    def __del__(self) -> None:
        self.close()


class Llama(llama_cpp.Llama):  # type: ignore[misc]
    """llama_cpp.Llama whose sampler chains check a grammar lazily (GrammarSampler): its own
    generate() and the slot scheduler's jobs (inference/engines/llama_slots.py) both get their
    samplers from `_init_sampler`."""

    def _init_sampler(self, *args: Any, grammar: llama_cpp.LlamaGrammar | None = None, **kwargs: Any) -> Any:
        chain = super()._init_sampler(*args, **kwargs)
        return chain if grammar is None else GrammarSampler(self, chain, grammar)
