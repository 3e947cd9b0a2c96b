"""`hypnos run <model>`: a chat in the terminal, streamed from POST /v1/chat/completions.

One line is one user turn; the conversation's history goes with every turn. `/bye` or EOF
(Ctrl-D) ends it, `/clear` forgets it. Ctrl-C while an answer streams stops that answer (the
connection closes, the server stops at its next token) and the turn is dropped. With a prompt on
the command line the model answers once and the command exits. The answer goes to stdout,
everything else (thoughts, the prompt marker, --verbose figures) to stderr, so that
`hypnos run model "..." > answer.txt` keeps only the answer."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

from hypnos_cli.client import CliError, Server
from hypnos_cli.output import note

PROMPT = ">>> "
HELP = "/bye or Ctrl-D ends the chat, /clear forgets the conversation, Ctrl-C stops an answer"
DIM, RESET = "\033[2m", "\033[0m"


def sse_payloads(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The JSON payloads of an SSE stream up to `[DONE]`; an error chunk (spec §4: a failure
    after the stream started) becomes a CliError with its message."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        payload = json.loads(data)
        if "error" in payload:
            error = payload["error"]
            raise CliError(error.get("message", str(error)) if isinstance(error, dict) else str(error))
        yield payload


class Chat:
    """One conversation with one model."""

    def __init__(self, server: Server, args: argparse.Namespace):
        self.server = server
        self.model = args.model
        self.verbose = args.verbose
        self.system = [{"role": "system", "content": args.system}] if args.system else []
        self.messages: list[dict[str, Any]] = list(self.system)
        self.options = {
            name: value
            for name, value in (("temperature", args.temperature), ("max_tokens", args.max_tokens), ("seed", args.seed))
            if value is not None
        }

    def clear(self) -> None:
        self.messages = list(self.system)

    def say(self, text: str) -> str:
        """Send one user turn, print the answer as it streams, keep both in the history."""
        body = {"model": self.model, "messages": [*self.messages, {"role": "user", "content": text}], "stream": True}
        answer: list[str] = []
        last: dict[str, Any] = {}
        thinking = False
        try:
            with self.server.stream("POST", "/v1/chat/completions", {**body, **self.options}) as lines:
                for chunk in sse_payloads(lines):
                    last = chunk
                    delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
                    if delta.get("reasoning_content"):
                        thinking = True
                        _thought(delta["reasoning_content"])
                    if delta.get("content"):
                        if thinking:
                            _thought("\n")
                            thinking = False
                        answer.append(delta["content"])
                        sys.stdout.write(delta["content"])
                        sys.stdout.flush()
        finally:
            # The answer's line ends even when the stream does not (an error chunk, Ctrl-C).
            if answer:
                sys.stdout.write("\n")
                sys.stdout.flush()
        if self.verbose:
            _figures(last)
        whole = "".join(answer)
        # Only the answer goes back into the history, never the thoughts (spec §17).
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": whole}]
        return whole


def _thought(text: str) -> None:
    tty = sys.stderr.isatty()
    sys.stderr.write(f"{DIM}{text}{RESET}" if tty else text)
    sys.stderr.flush()


def _figures(chunk: dict[str, Any]) -> None:
    usage = chunk.get("usage") or {}
    engine = (chunk.get("hypnos_telemetry") or {}).get("engine") or {}
    rate = engine.get("decode_tokens_per_s")
    figures = [
        f"{usage.get('prompt_tokens', '?')} prompt tokens",
        f"{usage.get('completion_tokens', '?')} answer tokens",
    ]
    if rate:
        figures.append(f"{rate:.1f} tokens/s")
    note(", ".join(figures))


def turns() -> Iterator[str]:
    """The user's lines: with a prompt marker and line editing on a terminal, else stdin's lines."""
    if not sys.stdin.isatty():
        for line in sys.stdin:
            yield line.rstrip("\n")
        return
    try:
        import readline  # noqa: F401  (gives input() line editing and history)
    except ImportError:
        pass
    while True:
        try:
            yield input(PROMPT)
        except EOFError:
            print(file=sys.stderr)
            return
        except KeyboardInterrupt:
            note("\n" + HELP)


def do_run(server: Server, args: argparse.Namespace) -> int:
    chat = Chat(server, args)
    if args.prompt:
        chat.say(" ".join(args.prompt))
        return 0
    # The model's name is checked before the first line is typed, not after.
    found = server.get(f"/v1/models/{quote(args.model, safe='')}")
    if sys.stdin.isatty():
        note(f"chatting with {found.get('id', args.model)}; {HELP}")
    failed = False
    for text in turns():
        command = text.strip()
        if not command:
            continue
        if command == "/bye":
            break
        if command == "/clear":
            chat.clear()
            note("the conversation is forgotten")
            continue
        if command.startswith("/") and " " not in command:
            note(f"unknown command {command}; {HELP}")
            continue
        try:
            chat.say(text)
        except KeyboardInterrupt:
            note("(stopped; this turn is dropped)")
        except CliError as error:
            # The chat goes on (the next turn may work); the exit status still tells a script.
            failed = True
            note(f"hypnos: {error}")
    return 1 if failed else 0
