"""llama.cpp through llama-cpp-python: GGUF chat models with the template the GGUF carries."""

from __future__ import annotations

import codecs
import json
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import llama_cpp
import llama_cpp._internals as internals
from llama_cpp import llama_types
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from hypnos_site.config import ENGINE_SAMPLING_DEFAULTS, LimitsConfig, ModelConfig
from hypnos_site.errors import ContextLengthExceeded, InvalidRequest, ModelNotAvailable
from inference.engines.base import ChatResult, ChatWork, DeltaSink, Engine, LoadPhases, PreparedPrompt
from inference.engines.llama_io import AnswerOutput, json_grammar, oom_as_typed, template_message, token_logprobs
from inference.engines.llama_offload import ExpertOffloadModel, expert_pattern
from inference.engines.llama_sampling import Llama
from inference.engines.llama_slots import SlotJob, SlotScheduler, seq_state, set_seq_state
from inference.engines.text import StopMatcher
from inference.engines.thinking import FORCED_CLOSE, OPEN, ThinkBlock
from inference.engines.vision import Projector
from inference.transport.tools import call_schema, forced_tools, parse_tool_calls
from memory.gguf import read_gguf
from memory.kv_park import ParkedSlot, ParkedState
from memory.planner import Footprint, footprint_from_info

# Sampling defaults when the request leaves a value out (llama.cpp's own defaults).
DEFAULT_SAMPLING = {key: ENGINE_SAMPLING_DEFAULTS[key] for key in ("temperature", "top_p", "top_k")}


class _TimedContext(internals.LlamaContext):
    """llama-cpp-python builds the model and then the context inside one constructor; this
    subclass (installed below) times the context part, so loads report both phases."""

    timing = threading.local()

    def __init__(self, *args: Any, **kwargs: Any):
        started = time.perf_counter()
        if "params" in kwargs:
            # llama-cpp-python turns flash attention off unless asked; llama.cpp's own default
            # (llama-server's too) is auto: on wherever the device runs it. On this CPU it
            # decodes SmolLM2 ~5% faster (154 vs 147 tok/s, interleaved runs, 2 threads).
            kwargs["params"].flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
        sequences = getattr(_TimedContext.timing, "sequences", 1)
        if sequences > 1 and "params" in kwargs:
            # llama-cpp-python exposes no n_seq_max: slots need one KV sequence each.
            kwargs["params"].n_seq_max = sequences
            kwargs["params"].kv_unified = True
        super().__init__(*args, **kwargs)
        _TimedContext.timing.ms = (time.perf_counter() - started) * 1000


internals.LlamaContext = _TimedContext  # type: ignore[misc]
internals.LlamaModel = ExpertOffloadModel  # type: ignore[misc]


class LlamaEngine(Engine):
    """One `llama_cpp.Llama` per model, mapped from the worker's warm copy of the GGUF; chat
    prompts are rendered with the GGUF's own template."""

    def __init__(self, model: ModelConfig, weights: Path, n_threads: int | None, aux: Path | None = None):
        super().__init__(model, weights, n_threads, aux)
        self._llm: llama_cpp.Llama | None = None
        # The multimodal projector (aux) bound to the loaded model: image parts (vision.py).
        self._projector: Projector | None = None
        self._formatter: Jinja2ChatFormatter | None = None
        self._scheduler: SlotScheduler | None = None
        self.max_concurrency = model.slots
        self._footprint: Footprint | None = None
        self._metadata: dict[str, object] = {}
        # When the single-slot context's conversation was last served (KV idle timeout).
        self._used_at = time.monotonic()
        # The tool router's own sequence (its few-shot prompt, the same every time), set aside
        # between routing passes on the single-slot context (_KeptSequence).
        self._router_kv: _KeptSequence | None = None

    @property
    def loaded(self) -> bool:
        return self._llm is not None

    @property
    def context_len(self) -> int:
        return self._llm.n_ctx() if self._llm else 0

    @property
    def trained_context_len(self) -> int:
        return self.footprint().trained_context_len

    def footprint(self) -> Footprint:
        if self._footprint is None:
            try:
                info = read_gguf(self.weights)
            except (OSError, ValueError, KeyError) as exc:
                raise ModelNotAvailable(
                    f"model {self.model.id!r}: {self.weights} is not a readable GGUF: {exc}"
                ) from exc
            self._metadata = info.metadata
            footprint = footprint_from_info(info)
            if self.aux is not None:
                # The projector's weights live beside the model's on the same device.
                footprint = replace(footprint, other_bytes=footprint.other_bytes + self.aux.stat().st_size)
            self._footprint = footprint
        return self._footprint

    def warm(self) -> float:
        return self._hold(self.weights)

    def load(self, context_len: int, gpu_layers: int) -> LoadPhases:
        started = time.perf_counter()
        mode = "mmap" if self._warm is not None else "read"
        self.warm()
        assert self._warm is not None
        _TimedContext.timing.sequences = self.model.slots
        ExpertOffloadModel.request(self._host_expert_patterns())
        try:
            llm = Llama(
                model_path=self._warm.path,
                n_ctx=context_len,
                n_threads=self.n_threads,
                n_threads_batch=self.n_threads,
                n_gpu_layers=llama_gpu_layers(gpu_layers, self.footprint().n_layers),
                verbose=False,
                **self._context_options(context_len),
            )
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelNotAvailable(f"model {self.model.id!r} could not be loaded from {self.weights}: {exc}") from exc
        finally:
            _TimedContext.timing.sequences = 1
            ExpertOffloadModel.request([])
        context_ms = getattr(_TimedContext.timing, "ms", 0.0)
        self._llm = llm
        self._ready(llm)
        projector_ms = self._load_projector(llm, gpu_layers)
        total_ms = (time.perf_counter() - started) * 1000
        return LoadPhases(
            load_mode=mode,
            weights_ms=total_ms - context_ms - projector_ms,
            context_ms=context_ms,
            total_ms=total_ms,
            projector_ms=projector_ms,
        )

    def _load_projector(self, llm: llama_cpp.Llama, gpu_layers: int) -> float:
        """Bind the model block's projector (aux_path) to the loaded model; the milliseconds it took."""
        if self.aux is None:
            return 0.0
        started = time.perf_counter()
        try:
            self._projector = Projector(self.aux, llm, self.n_threads, use_gpu=gpu_layers != 0)
        except ModelNotAvailable as exc:
            self.unload()
            raise ModelNotAvailable(f"model {self.model.id!r}: {exc.message}") from exc
        return (time.perf_counter() - started) * 1000

    def _host_expert_patterns(self) -> list[str]:
        """MoE offload: the expert tensors of the last `cpu_expert_layers` layers stay in host
        memory (nothing for a dense model)."""
        fp = self.footprint()
        if not self.cpu_expert_layers or not fp.expert_bytes:
            return []
        return [expert_pattern(range(max(fp.n_layers - self.cpu_expert_layers, 0), fp.n_layers))]

    def _context_options(self, context_len: int) -> dict[str, Any]:
        """Extra `llama_cpp.Llama` arguments of this engine's mode (none for chat)."""
        return {}

    def _ready(self, llm: llama_cpp.Llama) -> None:
        """Set up what serving needs once the context exists: slots and the chat template."""
        if self.model.slots > 1:
            self._scheduler = SlotScheduler(llm, self.model.slots)
        self._formatter = self._chat_formatter(llm)

    def kv_layout(self) -> tuple[Any, ...] | None:
        if self._llm is None:
            return None
        weights = self.weights.stat()
        return (self.context_len, self.model.slots, str(self.weights), weights.st_size, weights.st_mtime_ns)

    def park(self) -> ParkedState | None:
        llm = self._llm
        if llm is None:
            return None
        if self._scheduler is not None:
            slots = self._scheduler.park()
        else:
            data = seq_state(llm.ctx, 0) if llm.n_tokens else None
            tokens = tuple(int(t) for t in llm._input_ids[: llm.n_tokens])
            slots = (ParkedSlot(0, tokens, data, self._used_at),) if data is not None else ()
        layout = self.kv_layout()
        assert layout is not None
        return ParkedState(layout=layout, slots=slots) if slots else None

    def restore(self, state: ParkedState) -> int:
        llm = self._llm
        assert llm is not None
        if self._scheduler is not None:
            return self._scheduler.restore(state.slots)
        [slot] = state.slots
        if not set_seq_state(llm.ctx, 0, slot.data):
            return 0
        n = len(slot.tokens)
        llm.input_ids[:n] = slot.tokens
        llm.n_tokens = n
        self._used_at = slot.used_at
        # The logits of the last token are not part of the state: generate() re-evaluates it.
        llm._requires_eval = True
        return n

    def empty_idle_slots(self, idle_secs: float) -> int:
        llm = self._llm
        if llm is None:
            return 0
        if self._scheduler is not None:
            return self._scheduler.empty_idle(idle_secs)
        if not llm.n_tokens or time.monotonic() - self._used_at < idle_secs:
            return 0
        dropped = llm.n_tokens
        llama_cpp.llama_memory_seq_rm(llm._ctx.memory, 0, 0, -1)
        llm.reset()
        return dropped

    def unload(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler = None
        if self._projector is not None:
            self._projector.close()
            self._projector = None
        if self._llm is not None:
            self._llm.close()
        self._llm = None
        self._formatter = None
        self._router_kv = None

    def cool(self) -> None:
        self.unload()
        self._release([self.weights])

    def capabilities(self) -> set[str]:
        self.footprint()
        template = str(self._metadata.get("tokenizer.chat_template", ""))
        found = set()
        if "tools" in template:
            found.add("tools")
        if self.thinking_format() is not None:
            found.add("thinking")
        if self.aux is not None:
            found.add("vision")
        return found

    def thinking_format(self) -> str | None:
        """The model block's `thinking`, else `think_tags` when the chat template writes <think>."""
        self.footprint()
        template = str(self._metadata.get("tokenizer.chat_template", ""))
        return self.model.thinking or ("think_tags" if OPEN in template else None)

    def prepare_chat(self, work: ChatWork, limits: LimitsConfig) -> ChatWork:
        llm = self._llm
        assert llm is not None, "prepare_chat on an unloaded engine"
        plan = self._prompt(llm, work, limits)
        if work.images:
            # The projector tokenises the images with the text and checks the context (vision.py).
            return work.model_copy(update={"prepared": PreparedPrompt(None, plan)})
        try:
            text = plan.prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(
                f"The prompt is not valid Unicode: {exc.reason} at character {exc.start}.", param=work.prompt_param
            ) from exc
        # Tokenised once: the prefill reuses these tokens.
        tokens = llm.tokenize(text, add_bos=plan.add_bos, special=plan.special)
        if not tokens:
            raise InvalidRequest("The prompt is empty.", param=work.prompt_param)
        return work.model_copy(update={"prepared": PreparedPrompt(tokens, plan)})

    def check_context(self, work: ChatWork) -> None:
        tokens = work.prepared.tokens if work.prepared is not None else None
        n_ctx = self.context_len
        if tokens is not None and len(tokens) >= n_ctx:
            raise ContextLengthExceeded(
                f"The prompt is {len(tokens)} tokens but the model's context is {n_ctx} tokens "
                f"(the model supports at most {self.trained_context_len or n_ctx}); send a shorter prompt"
                + (" or a larger num_ctx." if n_ctx < self.trained_context_len else "."),
                param=work.prompt_param,
            )

    def count_prompt(self, work: ChatWork) -> int:
        if not work.images:
            return super().count_prompt(work)
        assert work.prepared is not None
        return self._vision().count(work.prepared.plan.prompt, work.images)

    def chat(self, work: ChatWork, cancel: threading.Event, on_delta: DeltaSink) -> ChatResult:
        llm = self._llm
        assert llm is not None, "chat on an unloaded engine"
        if work.prepared is None:
            work = self.prepare_chat(work, LimitsConfig())
            self.check_context(work)
        assert work.prepared is not None
        plan: _PromptPlan = work.prepared.plan
        images_started = time.perf_counter()
        if work.images:
            tokens = self._image_prompt(llm, plan.prompt, work.images)
        else:
            assert work.prepared.tokens is not None
            tokens = work.prepared.tokens
        images_ms = (time.perf_counter() - images_started) * 1000 if work.images else 0.0
        n_ctx = llm.n_ctx()
        thoughts = self._think_block(plan, work)
        output = AnswerOutput(
            on_delta, hold=plan.tool_names is not None, forced=plan.forced_prefix is not None, thoughts=thoughts
        )
        # A forced close of the thinking block takes a few tokens of context too.
        room = n_ctx - len(tokens) - (len(self._close_tokens(llm)) if thoughts else 0)
        result = self._decode(llm, tokens, work, plan.grammar, max(min(work.max_tokens, room), 1), cancel, output)
        # The projector's image evaluation is part of the prefill.
        result.prefill_ms += images_ms
        result.ttft_ms += images_ms
        if plan.tool_names is not None:
            text = (plan.forced_prefix or "") + output.held_text()
            content, calls = parse_tool_calls(text, plan.tool_names)
            if calls:
                result.tool_calls = [call.as_openai(i) for i, call in enumerate(calls)]
                result.finish_reason = "tool_calls"
                output.release(content)
            else:
                output.release(output.held_text())
        return result

    def _decode(
        self,
        llm: llama_cpp.Llama,
        tokens: list[int],
        work: ChatWork,
        grammar: llama_cpp.LlamaGrammar | None,
        max_tokens: int,
        cancel: threading.Event,
        output: AnswerOutput,
    ) -> ChatResult:
        """Generate on this engine's one context, or through its slot scheduler."""
        seed = work.seed if work.seed is not None else random.randrange(2**31)
        if self._scheduler is not None and output.thoughts is not None:
            return self._scheduled_thinking(llm, tokens, work, grammar, max_tokens, cancel, output, seed)
        if self._scheduler is not None:
            llm.set_seed(seed)
            sampler = llm._init_sampler(
                top_k=_pick(work.top_k, "top_k"),
                top_p=_pick(work.top_p, "top_p"),
                temp=_pick(work.temperature, "temperature"),
                repeat_penalty=work.repeat_penalty,
                frequency_penalty=work.frequency_penalty,
                presence_penalty=work.presence_penalty,
                grammar=grammar,
            )
            top = work.top_logprobs

            def emit(text: str, token: int, index: int) -> None:
                piece = llm.detokenize([token], special=False) if token >= 0 else b""
                logprobs = token_logprobs(llm, token, piece, top, index) if top is not None and token >= 0 else None
                output.emit(text, logprobs)

            job = SlotJob(
                tokens=tokens,
                sampler=sampler,
                stops=StopMatcher(work.stop),
                max_tokens=max_tokens,
                cancel=cancel,
                emit=emit,
                reuse_prefix=work.seed is None,
                background=work.background,
            )
            return self._scheduler.run(job)
        if work.seed is not None and not work.images:
            # A reused prefix re-evaluates only the tail, whose logits differ in the last bits
            # from a whole-prompt evaluation; a seeded run must not depend on the previous one.
            llm.reset()
        # A prompt with images was evaluated just now, whole, by the projector.
        cached = 0 if work.images else self._cached_prefix(tokens)
        llm.set_seed(seed)
        try:
            return self._generate(llm, tokens, cached, work, grammar, max_tokens, cancel, output)
        finally:
            self._used_at = time.monotonic()

    def _scheduled_thinking(
        self,
        llm: llama_cpp.Llama,
        tokens: list[int],
        work: ChatWork,
        grammar: llama_cpp.LlamaGrammar | None,
        max_tokens: int,
        cancel: threading.Event,
        output: AnswerOutput,
        seed: int,
    ) -> ChatResult:
        """A thinking request on the slot scheduler, in legs: when the block must be closed the
        leg ends, and the next starts from the context plus the closing tag (the slot keeps the
        shared prefix, so only the new tokens are evaluated). Stop strings apply to the answer."""
        assert self._scheduler is not None and output.thoughts is not None
        thoughts, stops, top = output.thoughts, StopMatcher(work.stop), work.top_logprobs
        context, legs = list(tokens), list[ChatResult]()
        while True:
            leg = _Leg(cancel)

            def emit(text: str, token: int, index: int, leg: _Leg = leg) -> None:
                if token >= 0:
                    context.append(token)
                if leg.stopped:
                    return
                piece = llm.detokenize([token], special=False) if token >= 0 else b""
                logprobs = token_logprobs(llm, token, piece, top, index) if top is not None and token >= 0 else None
                routed = thoughts.feed(text, tokens=1 if token >= 0 else 0)
                output.think(routed.reasoning)
                content, leg.stopped = stops.feed(routed.content)
                output.emit(content, logprobs if content else None)
                leg.close = leg.close or routed.close
                if leg.stopped or leg.close:
                    leg.set()

            llm.set_seed(seed)
            sampler = llm._init_sampler(
                top_k=_pick(work.top_k, "top_k"),
                top_p=_pick(work.top_p, "top_p"),
                temp=_pick(work.temperature, "temperature"),
                repeat_penalty=work.repeat_penalty,
                frequency_penalty=work.frequency_penalty,
                presence_penalty=work.presence_penalty,
                grammar=grammar,
            )
            produced = sum(r.completion_tokens for r in legs)
            legs.append(
                self._scheduler.run(
                    SlotJob(
                        tokens=list(context),
                        sampler=sampler,
                        stops=StopMatcher([]),
                        max_tokens=max_tokens - produced,
                        cancel=leg,
                        emit=emit,
                        reuse_prefix=work.seed is None,
                        background=work.background,
                    )
                )
            )
            produced += legs[-1].completion_tokens
            # A model that ends its turn inside its thoughts still owes the answer.
            ended_in_block = legs[-1].finish_reason == "stop" and thoughts.in_block
            if cancel.is_set() or leg.stopped or produced >= max_tokens or not (leg.close or ended_in_block):
                break
            context.extend(self._close_tokens(llm))
            thoughts.forced_close()
        if not leg.stopped:
            tail = thoughts.flush()
            output.think(tail.reasoning)
            output.emit(stops.feed(tail.content)[0] + stops.flush(), None)
        first = legs[0]
        finish = (
            "cancelled"
            if cancel.is_set()
            else "stop"
            if leg.stopped
            else "length"
            if produced >= max_tokens
            else legs[-1].finish_reason
        )
        return replace(
            first,
            finish_reason=finish,
            completion_tokens=produced,
            decode_ms=first.decode_ms + sum(r.prefill_ms + r.decode_ms for r in legs[1:]),
            concurrent_slots=max(r.concurrent_slots for r in legs),
            stop_sequence=stops.matched,
        )

    def _prompt(self, llm: llama_cpp.Llama, work: ChatWork, limits: LimitsConfig) -> _PromptPlan:
        """The prompt text, the grammar and the tool handling of one request."""
        schema = work.json_schema
        vocab = llm._model.vocab
        if work.raw_prompt is not None:
            return _PromptPlan(
                work.raw_prompt,
                add_bos=True,
                special=False,
                grammar=json_grammar(schema, vocab, limits, work.schema_param),
            )
        assert self._formatter is not None
        messages = [template_message(m) for m in work.messages]
        tools = work.tools if work.tools and work.tool_choice != "none" else None
        # After a tool result the small models answer well only without the tools in view
        # (offered again, they call the same tool again): render the follow-up without them.
        if tools and messages[-1]["role"] == "tool":
            tools = None
        # Thinking needs free text: not under a JSON grammar, nor when the answer must be a call.
        think = work.think and schema is None and (not tools or work.tool_choice == "auto")
        try:
            # Templates of thinking families (Qwen3, ...) open or close the block by this flag.
            prompt = self._formatter(
                messages=_chat_messages(messages), tools=_chat_tools(tools), enable_thinking=think
            ).prompt
        except Exception as exc:  # jinja2 raises whatever the template's raise_exception says
            raise InvalidRequest(f"the model's chat template rejected the messages: {exc}", param="messages") from exc
        prompt = self._thinking_prompt(prompt, think)
        if not tools:
            return _PromptPlan(prompt, grammar=json_grammar(schema, vocab, limits, work.schema_param))
        names = {t["function"]["name"] for t in tools}
        choice = work.tool_choice
        if choice == "auto" and self.model.tool_router:
            routed = self._route(llm, work.messages, tools)
            if routed is None:
                return self._prompt(llm, work.model_copy(update={"tool_choice": "none"}), limits)
            choice = routed
        if choice == "auto":
            return _PromptPlan(prompt, tool_names=names)
        # "required" or a named function: the answer starts as a call and a grammar keeps it one.
        prefix = "<tool_call>\n"
        return _PromptPlan(
            prompt + prefix,
            tool_names=names,
            forced_prefix=prefix,
            grammar=json_grammar(call_schema(forced_tools(tools, choice)), vocab, limits, "tools"),
        )

    def _thinking_prompt(self, prompt: str, think: bool) -> str:
        """Open the thinking block when the request thinks; close at once one the template
        opened when it does not (spec §7.1: reasoning_effort "none")."""
        if self.thinking_format() is None:
            return prompt
        opened = prompt.rstrip().endswith(OPEN)
        if think and not opened:
            return prompt + OPEN + "\n"
        if not think and opened:
            return prompt.rstrip() + "\n" + FORCED_CLOSE
        return prompt

    def _think_block(self, plan: _PromptPlan, work: ChatWork) -> ThinkBlock | None:
        """What follows the generation through the thinking block (None: the model has no
        thinking format, or a grammar shapes the whole answer)."""
        if self.thinking_format() is None or plan.grammar is not None or work.raw_prompt is not None:
            return None
        thinking = plan.prompt.rstrip().endswith(OPEN)
        return ThinkBlock(thinking, work.thinking_budget if thinking else None)

    def _close_tokens(self, llm: llama_cpp.Llama) -> list[int]:
        return llm.tokenize(FORCED_CLOSE.encode("utf-8"), add_bos=False, special=True)

    def _image_prompt(self, llm: llama_cpp.Llama, prompt: str, images: list[bytes]) -> list[int]:
        """Evaluate a prompt with images through the projector; its tokens as the context holds them."""
        return self._vision().evaluate(llm, prompt, images)

    def _vision(self) -> Projector:
        if self._projector is None:
            raise InvalidRequest(
                f"The model {self.model.id!r} does not serve vision (no projector, aux_path), "
                "so it cannot take image_url parts.",
                param="messages",
            )
        return self._projector

    def _route(
        self, llm: llama_cpp.Llama, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> dict[str, str] | None:
        """Ask the model, constrained to answer a tool name or `none`, whether the last user turn
        needs a tool: the named call to force, or None to answer without tools."""
        request = next((str(m.get("content") or "") for m in reversed(messages) if m["role"] == "user"), "")
        listing = "\n".join(f"- {t['function']['name']}: {t['function'].get('description') or ''}" for t in tools)
        names = [t["function"]["name"] for t in tools]
        grammar = llama_cpp.LlamaGrammar.from_string(
            "root ::= " + " | ".join(json.dumps(n) for n in ["none", *names]), verbose=False
        )
        assert self._formatter is not None
        prompt = self._formatter(
            messages=_chat_messages(
                [*ROUTER_SHOTS, {"role": "user", "content": f"Functions:\n{listing}\nRequest: {request}"}]
            )
        ).prompt
        tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
        answer: list[str] = []
        # The slot scheduler runs the pass in a slot of its own; on the single context, the
        # conversation's KV is set aside for it and put back after.
        conversation = _KeptSequence.take(llm) if self._scheduler is None else None
        if conversation is not None and self._router_kv is not None:
            self._router_kv.put(llm)
        try:
            self._decode(
                llm,
                tokens,
                ChatWork(messages=[], max_tokens=16, temperature=0.0),
                grammar,
                16,
                threading.Event(),
                AnswerOutput(lambda text, _logprobs, _reasoning=False: answer.append(text), hold=False, forced=False),
            )
        finally:
            if conversation is not None:
                self._router_kv = _KeptSequence.take(llm)
                conversation.put(llm)
        decision = "".join(answer).strip()
        return {"name": decision} if decision in names else None

    def _generate(
        self,
        llm: llama_cpp.Llama,
        tokens: list[int],
        cached: int,
        work: ChatWork,
        grammar: llama_cpp.LlamaGrammar | None,
        max_tokens: int,
        cancel: threading.Event,
        output: AnswerOutput,
    ) -> ChatResult:
        stops = StopMatcher(work.stop)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        vocab = llm._model.vocab
        finish, produced, first_at, hit_stop = "length", 0, None, False
        started = time.perf_counter()
        thoughts = output.thoughts
        # The context so far: generation restarts from it (re-evaluating nothing but what is
        # new) after the server wrote the end of a thinking block into it.
        context = list(tokens)
        # A prompt with images was evaluated by the projector, its placeholders are not tokens.
        if not work.images:
            for _ in oom_as_typed(_prefill(llm, context, cancel)):
                pass
            if cancel.is_set():
                waited = (time.perf_counter() - started) * 1000
                return ChatResult("cancelled", len(tokens), 0, cached, waited, 0.0, waited)
        while True:
            generator = llm.generate(
                context,
                temp=_pick(work.temperature, "temperature"),
                top_p=_pick(work.top_p, "top_p"),
                top_k=_pick(work.top_k, "top_k"),
                repeat_penalty=work.repeat_penalty,
                frequency_penalty=work.frequency_penalty,
                presence_penalty=work.presence_penalty,
                grammar=grammar,
            )
            close = False
            try:
                for token in oom_as_typed(generator):
                    first_at = first_at or time.perf_counter()
                    if llama_cpp.llama_vocab_is_eog(vocab, token):
                        # A model that ends its turn inside its thoughts still owes the answer.
                        close = thoughts is not None and thoughts.in_block
                        finish = "stop"
                        break
                    produced += 1
                    context.append(token)
                    piece = llm.detokenize([token], special=False)
                    logprobs = (
                        token_logprobs(llm, token, piece, work.top_logprobs) if work.top_logprobs is not None else None
                    )
                    text = decoder.decode(piece)
                    if thoughts is not None:
                        routed = thoughts.feed(text)
                        output.think(routed.reasoning)
                        text, close = routed.content, routed.close
                        logprobs = logprobs if text else None
                    text, hit_stop = stops.feed(text)
                    output.emit(text, logprobs)
                    if hit_stop:
                        finish, close = "stop", False
                        break
                    if cancel.is_set():
                        finish, close = "cancelled", False
                        break
                    if produced >= max_tokens:
                        close = False
                        break
                    if close:
                        break
            finally:
                generator.close()
            if not close or thoughts is None:
                break
            finish = "length"
            context += self._close_tokens(llm)
            thoughts.forced_close()
        if thoughts is not None and not hit_stop:
            tail = thoughts.flush()
            output.think(tail.reasoning)
            output.emit(stops.feed(tail.content)[0], None)
        # After a stop string the matcher holds nothing; otherwise release what it held back.
        output.emit(stops.flush() + decoder.decode(b"", final=True), None)
        ended = time.perf_counter()
        first_at = first_at or ended
        return ChatResult(
            finish_reason=finish,
            prompt_tokens=len(tokens),
            completion_tokens=produced,
            cached_tokens=cached,
            prefill_ms=(first_at - started) * 1000,
            decode_ms=(ended - first_at) * 1000,
            ttft_ms=(first_at - started) * 1000,
            stop_sequence=stops.matched,
        )

    def _cached_prefix(self, tokens: list[int]) -> int:
        """Prompt tokens whose KV the context still holds from the previous request."""
        llm = self._llm
        assert llm is not None
        same = 0
        for a, b in zip(llm._input_ids[: llm.n_tokens], tokens, strict=False):
            if a != b:
                break
            same += 1
        # llama-cpp-python re-evaluates the last prompt token to refresh the logits.
        return min(same, len(tokens) - 1)

    def _chat_formatter(self, llm: llama_cpp.Llama) -> Jinja2ChatFormatter:
        template = llm.metadata.get("tokenizer.chat_template")
        if not template:
            raise ModelNotAvailable(f"model {self.model.id!r} has no chat template in its GGUF")
        model = llm._model
        eos, bos = llm.token_eos(), llm.token_bos()
        return Jinja2ChatFormatter(
            template=template,
            eos_token=model.token_get_text(eos) if eos != -1 else "",
            bos_token=model.token_get_text(bos) if bos != -1 else "",
            stop_token_ids=[eos],
        )


# llama_cpp types the chat formatter's messages and tools as its OpenAI TypedDicts, but the
# Jinja templates take any dicts, and ours carry keys those TypedDicts do not declare.
def llama_gpu_layers(gpu_layers: int, n_layers: int) -> int:
    """llama.cpp's n_gpu_layers for a placement of `gpu_layers` of `n_layers` repeating layers
    in tier 1. llama.cpp counts the output head as one more layer and offloads it first (layers
    from n_layers + 1 - n_gpu_layers up), so the model's own layer count would leave layer 0 in
    host memory: a whole placement is -1 (everything). A partial one is passed as planned."""
    return -1 if n_layers and gpu_layers >= n_layers else gpu_layers


def _chat_messages(messages: list[dict[str, Any]]) -> list[llama_types.ChatCompletionRequestMessage]:
    return cast(list[llama_types.ChatCompletionRequestMessage], messages)


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[llama_types.ChatCompletionTool] | None:
    return cast(list[llama_types.ChatCompletionTool] | None, tools)


def _prefill(llm: llama_cpp.Llama, tokens: list[int], cancel: threading.Event) -> Iterator[int]:
    """Evaluate the prompt's uncached tokens a batch at a time, looking at `cancel` between
    batches, up to the last batch, which llm.generate then evaluates itself (it finds the rest
    cached). llama-cpp-python's generate evaluates the whole prompt in one call that nothing
    stops: a long prompt held the model for minutes after its client had gone. The batches are
    the ones generate's own eval would make, so the logits are the same bits as before."""
    same = 0
    for a, b in zip(llm._input_ids[: llm.n_tokens], tokens[:-1], strict=False):
        if a != b:
            break
        same += 1
    full = (len(tokens) - same - 1) // llm.n_batch
    if full == 0:
        return
    llm.n_tokens = same
    for start in range(same, same + full * llm.n_batch, llm.n_batch):
        if cancel.is_set():
            return
        llm.eval(tokens[start : start + llm.n_batch])
        yield start


@dataclass(frozen=True)
class _KeptSequence:
    """The single-slot context's sequence 0 (its KV cells and tokens) set aside, so that the
    tool router's pass does not evict the conversation: without it, a tool_choice "auto" call
    evaluated the router's prompt and then the whole conversation again (3-4x a forced call's
    time); with it, the conversation's prefix is reused as a forced call's is, and the router's
    few-shot prefix is reused from its previous pass."""

    data: bytes | None
    tokens: tuple[int, ...]

    @classmethod
    def take(cls, llm: llama_cpp.Llama) -> _KeptSequence:
        """Copy sequence 0 out and leave the context empty."""
        kept = cls(
            seq_state(llm.ctx, 0) if llm.n_tokens else None, tuple(int(t) for t in llm._input_ids[: llm.n_tokens])
        )
        llama_cpp.llama_memory_seq_rm(llm._ctx.memory, 0, 0, -1)
        llm.n_tokens = 0
        return kept

    def put(self, llm: llama_cpp.Llama) -> None:
        """Replace sequence 0 with this one (an empty context when llama.cpp refuses it)."""
        llama_cpp.llama_memory_seq_rm(llm._ctx.memory, 0, 0, -1)
        llm.n_tokens = 0
        if self.data is not None and set_seq_state(llm.ctx, 0, self.data):
            llm.input_ids[: len(self.tokens)] = self.tokens
            llm.n_tokens = len(self.tokens)


# The router's instructions and generic examples, each carrying its own function list, so the
# model learns the task and not the tools (measured: 10 of 10 right on Qwen2.5-Coder-1.5B).
ROUTER_SHOTS: list[dict[str, str]] = [
    {
        "role": "system",
        "content": "You decide whether a user request needs one of the listed functions. Reply with "
        "the function name, or none when the request can be answered from general knowledge, writing, jokes, math "
        "or code.",
    },
    {
        "role": "user",
        "content": "Functions:\n- send_email: Send an email to someone\n- search_flights: Find flights "
        "between two cities\nRequest: Email Anna that I will be late",
    },
    {"role": "assistant", "content": "send_email"},
    {
        "role": "user",
        "content": "Functions:\n- send_email: Send an email to someone\n- search_flights: Find flights "
        "between two cities\nRequest: Write a short poem about the sea",
    },
    {"role": "assistant", "content": "none"},
    {
        "role": "user",
        "content": "Functions:\n- get_stock_price: Current price of a stock\n- set_timer: Start a "
        "timer\nRequest: How much is Apple trading at right now?",
    },
    {"role": "assistant", "content": "get_stock_price"},
    {
        "role": "user",
        "content": "Functions:\n- get_stock_price: Current price of a stock\n- set_timer: Start a "
        "timer\nRequest: What is 17 times 3?",
    },
    {"role": "assistant", "content": "none"},
    {
        "role": "user",
        "content": "Functions:\n- search_flights: Find flights between two cities\n- set_timer: Start a "
        "timer\nRequest: Remind me in ten minutes",
    },
    {"role": "assistant", "content": "set_timer"},
    {
        "role": "user",
        "content": "Functions:\n- search_flights: Find flights between two cities\n- send_email: Send an "
        "email to someone\nRequest: Who painted the Mona Lisa?",
    },
    {"role": "assistant", "content": "none"},
]


@dataclass
class _PromptPlan:
    prompt: str
    add_bos: bool = False
    special: bool = True
    grammar: llama_cpp.LlamaGrammar | None = None
    # Declared tool names when the output may hold calls; the text the answer was started with.
    tool_names: set[str] | None = None
    forced_prefix: str | None = None


class _Leg(threading.Event):
    """The cancel flag of one leg of a scheduled thinking request: set by the leg itself (to
    close the thinking block, or at a stop string) or by the request's own flag."""

    def __init__(self, request_cancel: threading.Event):
        super().__init__()
        self.request_cancel = request_cancel
        self.close = False
        self.stopped = False

    def is_set(self) -> bool:
        return super().is_set() or self.request_cancel.is_set()


def _pick(value: Any, name: str) -> Any:
    return DEFAULT_SAMPLING[name] if value is None else value
