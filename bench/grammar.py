"""Grammar-constrained decoding: tokens/s with the grammar checked token by token (Hypnos's
inference/engines/llama_sampling.py, llama.cpp's own server order) against llama-cpp-python's
sampler with the grammar inside its chain (the baseline: every token pays a pass of the grammar
over the whole vocabulary), and free decoding with no grammar (the ceiling), in one run.

Each target writes the same greedy answer under the entity-extraction schema of
inference/worker/entities.py (the labels of spec §13's example) after the same prompt; the
targets take turns, round by round (the machine's load drifts), and the table shows the median
tokens/s and its ratio to the baseline. The two grammar targets must write the same text.

    .venv/bin/python bench/grammar.py --runs 3
    .venv/bin/python bench/grammar.py --model qwen2.5-coder-0.5b --tokens 96
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hypnos_site.settings")

import llama_cpp  # noqa: E402
from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # noqa: E402
from llama_cpp.llama_grammar import json_schema_to_gbnf  # noqa: E402

from hypnos_site.config import get_config  # noqa: E402
from inference.engines.llama_sampling import Llama  # noqa: E402
from inference.worker.entities import entity_schema, extraction_messages  # noqa: E402

TEXT = "Mario Rossi works in Milan for Ferrari. Tim Cook announced the iPhone 17 in Cupertino."
LABELS = ["person", "city", "company", "product"]
TARGETS = ("in-chain", "checked", "free")


def run(llm: Llama, tokens: list[int], target: str, max_tokens: int) -> tuple[float, int, str]:
    """One greedy answer after the prompt: tokens/s of its decode, its tokens and its text."""
    gbnf = json_schema_to_gbnf(json.dumps(entity_schema(LABELS)))
    grammar = llama_cpp.LlamaGrammar.from_string(gbnf, verbose=False)
    if target == "in-chain":
        sampler = llama_cpp.Llama._init_sampler(llm, temp=0.0, grammar=grammar)
    else:
        sampler = llm._init_sampler(temp=0.0, grammar=grammar if target == "checked" else None)
    llm.reset()
    llm.eval(tokens)
    out: list[int] = []
    started = time.perf_counter()
    for _ in range(max_tokens):
        token = sampler.sample(llm._ctx, -1)
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
            break
        out.append(token)
        llm.eval([token])
    elapsed = time.perf_counter() - started
    sampler.close()
    return len(out) / elapsed, len(out), llm.detokenize(out).decode(errors="replace")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="a chat model of the config (%(default)s)")
    parser.add_argument("--runs", type=int, default=3, help="measured rounds after one warm-up (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=128, help="most tokens an answer may take (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="engine threads (default: every core)")
    args = parser.parse_args()
    config = get_config()
    model = next(m for m in config.models if m.id == args.model)
    llm = Llama(
        model_path=str(config.weights_file(model)),
        n_ctx=2048,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    # The prompt in the model's own template, as the worker renders it.
    formatter = Jinja2ChatFormatter(template=llm.metadata["tokenizer.chat_template"], eos_token="", bos_token="")
    text = formatter(messages=extraction_messages(TEXT, LABELS)).prompt
    tokens = llm.tokenize(text.encode(), add_bos=False, special=True)
    rates: dict[str, list[float]] = {target: [] for target in TARGETS}
    answers: dict[str, str] = {}
    for round_ in range(args.runs + 1):
        for target in TARGETS:
            rate, count, answer = run(llm, tokens, target, args.tokens)
            answers[target] = answer
            if round_:  # the first round warms up
                rates[target].append(rate)
            print(f"round {round_} {target}: {count} tokens, {rate:.1f} tokens/s", file=sys.stderr)
    llm.close()
    baseline = statistics.median(rates["in-chain"])
    print(f"{args.model}, {args.threads} threads, prompt {len(tokens)} tokens, {args.runs} rounds (medians)")
    print(f"{'target':<10} {'tokens/s':>9} {'x in-chain':>11}")
    for target in TARGETS:
        median = statistics.median(rates[target])
        print(f"{target:<10} {median:>9.1f} {median / baseline:>11.2f}")
    same = answers["checked"] == answers["in-chain"]
    print(f"checked writes what in-chain writes: {'yes' if same else 'NO'}")
    print(f"answer: {answers['checked']}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
