"""The grammar checked token by token (inference/engines/llama_sampling.py) on the real SmolLM2:
greedy, it writes exactly what llama-cpp-python's sampler with the grammar inside its chain
writes, the refused picks included; sampled, every answer is one the grammar allows."""

from __future__ import annotations

import json
from collections.abc import Iterator

import llama_cpp
import pytest
from llama_cpp.llama_grammar import json_schema_to_gbnf

from hypnos_site.config import get_config
from inference.engines.llama_sampling import GrammarSampler, Llama

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "kind": {"enum": ["capital", "port", "village"]}},
    "required": ["city", "kind"],
    "additionalProperties": False,
}
PROMPT = (
    "<|im_start|>user\nName a French city and what kind of place it is, as JSON.<|im_end|>\n<|im_start|>assistant\n"
)
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def llm() -> Iterator[Llama]:
    config = get_config()
    model = next(m for m in config.models if m.id == "smollm2-135m")
    llm = Llama(model_path=str(config.weights_file(model)), n_ctx=512, n_threads=2, verbose=False)
    yield llm
    llm.close()


def grammar() -> llama_cpp.LlamaGrammar:
    gbnf = json_schema_to_gbnf(json.dumps(SCHEMA))
    return llama_cpp.LlamaGrammar.from_string(gbnf, verbose=False)


def write(llm: Llama, sampler: object) -> str:
    """The answer `sampler` writes after PROMPT, to the end of the turn or MAX_TOKENS."""
    llm.reset()
    llm.eval(llm.tokenize(PROMPT.encode(), special=True))
    out: list[int] = []
    for _ in range(MAX_TOKENS):
        token = sampler.sample(llm._ctx, -1)  # type: ignore[attr-defined]
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
            break
        out.append(token)
        llm.eval([token])
    sampler.close()  # type: ignore[attr-defined]
    return llm.detokenize(out).decode()


def test_greedy_it_writes_what_the_grammar_in_the_chain_writes(llm: Llama) -> None:
    in_chain = llama_cpp.Llama._init_sampler(llm, temp=0.0, grammar=grammar())
    assert not isinstance(in_chain, GrammarSampler)
    expected = write(llm, in_chain)
    checked = llm._init_sampler(temp=0.0, grammar=grammar())
    assert isinstance(checked, GrammarSampler)
    assert write(llm, checked) == expected
    # The free pick was refused at least once (SmolLM2 would not start with "{" on its own),
    # and was picked again from what the grammar allows.
    assert checked.refused > 0
    answer = json.loads(expected)
    assert set(answer) == {"city", "kind"} and answer["kind"] in ("capital", "port", "village")


def test_sampled_answers_are_all_ones_the_grammar_allows(llm: Llama) -> None:
    answers = set()
    for seed in range(4):
        llm.set_seed(seed)
        text = write(llm, llm._init_sampler(temp=1.2, top_k=200, top_p=1.0, min_p=0.0, grammar=grammar()))
        # An answer cut at MAX_TOKENS is a prefix of one the grammar allows; a finished one parses.
        assert text.startswith("{")
        if text.rstrip().endswith("}"):
            answer = json.loads(text)
            assert answer["kind"] in ("capital", "port", "village")
            answers.add(text)
    assert len(answers) >= 2  # sampled: the seeds wrote different answers, and finished them


def test_without_a_grammar_the_chain_is_llama_cpp_pythons_own(llm: Llama) -> None:
    sampler = llm._init_sampler(temp=0.0)
    assert isinstance(sampler, llama_cpp._internals.LlamaSampler)
    sampler.close()
