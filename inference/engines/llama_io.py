"""What goes into the llama.cpp engine and what comes out of it: OpenAI messages as chat
templates expect them, JSON grammars, the answer's delivery (held while it may be a tool call),
OpenAI logprobs from the logits, and llama.cpp's allocation failures as a typed error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp.llama_grammar import JSON_GBNF

from hypnos_site.config import LimitsConfig
from hypnos_site.errors import DeviceOutOfMemory, InvalidRequest
from inference.engines.base import DeltaSink
from inference.engines.thinking import ThinkBlock
from inference.transport.tools import may_become_call
from inference.web.common.grammar_limits import check_schema


class AnswerOutput:
    """Passes answer text on as it comes, except while it may still turn out to be a tool call
    (or surely is one): that text is held until the end, then parsed. Thoughts are never held:
    they come first and are no call."""

    def __init__(self, on_delta: DeltaSink, hold: bool, forced: bool, thoughts: ThinkBlock | None = None):
        self.on_delta = on_delta
        self.holding = hold
        self.forced = forced
        self.held: list[str] = []
        self.held_logprobs: list[dict[str, Any]] = []
        self.thoughts = thoughts

    def think(self, text: str) -> None:
        if text:
            self.on_delta(text, None, True)

    def emit(self, text: str, logprobs: list[dict[str, Any]] | None) -> None:
        if self.holding:
            self.held.append(text)
            self.held_logprobs += logprobs or []
            if self.forced or may_become_call("".join(self.held)):
                return
            self.holding = False
            text, logprobs = self.held_text(), self.held_logprobs or logprobs
            self.held = []
        if text or logprobs:
            self.on_delta(text, logprobs)

    def held_text(self) -> str:
        return "".join(self.held)

    def release(self, content: str) -> None:
        """At the end: the answer text that was held (calls removed)."""
        if self.holding and content:
            self.on_delta(content, None)
        self.held = []


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI history as chat templates expect it: tool-call arguments as objects, not the JSON
    strings OpenAI sends (templates render them with `tojson`, which would encode them twice)."""
    message = dict(message)
    if message.get("content") is None:
        message["content"] = ""
    calls = []
    for call in message.get("tool_calls") or []:
        function = dict(call.get("function", {}))
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass
        calls.append({**call, "function": function})
    if calls:
        message["tool_calls"] = calls
    return message


def json_grammar(
    schema: dict[str, Any] | None, vocab: Any, limits: LimitsConfig, param: str = "response_format"
) -> llama_cpp.LlamaGrammar | None:
    """The grammar of a JSON schema ({}: any JSON), checked against the grammar limits (the web
    process checked it too; this is the last line) and parsed once by libllama itself: a grammar
    libllama refuses gives a NULL sampler, which llama-cpp-python would add to the chain and
    crash on at the first token."""
    if schema is None:
        return None
    if not schema:
        return llama_cpp.LlamaGrammar.from_string(JSON_GBNF, verbose=False)
    try:
        gbnf = check_schema(schema, limits, param)
    except RecursionError:
        raise InvalidRequest("The JSON schema nests too deeply to be used as a grammar.", param=param) from None
    assert gbnf is not None, "the worker has llama-cpp-python's grammar converter"
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, gbnf.encode("utf-8"), b"root")
    if not sampler:
        raise InvalidRequest(
            f"The JSON schema of {param} cannot be used as a grammar: libllama refuses the "
            "grammar it converts to (too many repetitions or rules).",
            param=param,
        )
    llama_cpp.llama_sampler_free(sampler)
    return llama_cpp.LlamaGrammar.from_string(gbnf, verbose=False)


def token_logprobs(llm: llama_cpp.Llama, token: int, piece: bytes, top: int, index: int = -1) -> list[dict[str, Any]]:
    """OpenAI's logprobs entry for the token just sampled, from the logits it was sampled from
    (still in the context: the next evaluation has not run yet)."""
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, index), shape=(llm.n_vocab(),))
    logprobs = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
    entry: dict[str, Any] = {
        "token": piece.decode("utf-8", errors="replace"),
        "logprob": float(logprobs[token]),
        "bytes": list(piece),
        "top_logprobs": [],
    }
    if top:
        best = np.argpartition(-logprobs, top)[:top]
        for alt in best[np.argsort(-logprobs[best])]:
            alt_piece = llm.detokenize([int(alt)], special=False)
            entry["top_logprobs"].append(
                {
                    "token": alt_piece.decode("utf-8", errors="replace"),
                    "logprob": float(logprobs[alt]),
                    "bytes": list(alt_piece),
                }
            )
    return [entry]


def oom_as_typed(tokens: Iterator[int]) -> Iterator[int]:
    """llama_decode returns -2/-3 when it cannot allocate its buffers: a device out of memory."""
    try:
        yield from tokens
    except RuntimeError as exc:
        if "llama_decode returned -2" in str(exc) or "llama_decode returned -3" in str(exc):
            raise DeviceOutOfMemory(f"the engine ran out of memory: {exc}") from exc
        raise
