"""Thinking blocks (spec §7.1): the text a model writes between `<think>` and `</think>` is its
thoughts (reasoning_content), the rest is the answer; the server closes the block itself when the
request's budget is spent or thinking is off.

Plain text in, plain text out: the engine feeds every decoded piece and injects the closing tag
when `feed` asks for it, so the same rules hold on every generation path.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
# What the server writes into the context to end a block: the tag and the blank line the
# families that think this way put before the answer.
FORCED_CLOSE = CLOSE + "\n\n"
FORMATS = ("think_tags",)


@dataclass
class Routed:
    """One piece of generated text, split: thoughts, answer, and whether the block must be closed
    now (the engine then writes FORCED_CLOSE into the context)."""

    reasoning: str = ""
    content: str = ""
    close: bool = False


class ThinkBlock:
    """Follows one generation through an optional `<think>` block.

    `thinking` means the prompt already opened the block; `budget` bounds the thought tokens
    (None: only max_tokens does). With thinking off, a block the model opens anyway at the start
    of its answer is closed at once, so no thoughts and no tags reach the client."""

    def __init__(self, thinking: bool, budget: int | None):
        self.thinking = thinking
        self.budget = budget
        self.in_block = thinking
        self.thought_tokens = 0
        # The answer has started (after that, a `<think>` is just text).
        self.answering = False
        self.pending = ""

    def feed(self, text: str, tokens: int = 1) -> Routed:
        """Route the text of `tokens` newly generated tokens."""
        if self.in_block:
            self.thought_tokens += tokens
        self.pending += text
        routed = Routed()
        while self.pending:
            if self.in_block:
                if not self._take_thoughts(routed):
                    break
            elif not self._take_answer(routed):
                break
        if self.in_block and self.budget is not None and self.thought_tokens >= self.budget:
            routed.close = True
        return routed

    def flush(self) -> Routed:
        """The end of generation: whatever was held back as a possible tag is plain text."""
        text, self.pending = self.pending, ""
        return Routed(reasoning=text) if self.in_block else Routed(content=text)

    def forced_close(self) -> None:
        """The engine wrote FORCED_CLOSE: what follows is the answer."""
        self.pending = ""
        self.in_block = False

    def _take_thoughts(self, routed: Routed) -> bool:
        at = self.pending.find(CLOSE)
        if at >= 0:
            routed.reasoning += self.pending[:at]
            self.pending = self.pending[at + len(CLOSE) :].lstrip("\n")
            self.in_block = False
            return True
        keep = _partial_suffix(self.pending, CLOSE)
        routed.reasoning += self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return False

    def _take_answer(self, routed: Routed) -> bool:
        if self.answering:
            routed.content += self.pending
            self.pending = ""
            return False
        stripped = self.pending.lstrip()
        if stripped.startswith(OPEN):
            # The model opened a block although thinking is off: it is closed at once.
            self.pending = stripped[len(OPEN) :]
            self.in_block = True
            if not self.thinking:
                routed.close = True
                self.pending = ""
            return not routed.close
        if stripped and not OPEN.startswith(stripped):
            self.answering = True
            routed.content += self.pending
            self.pending = ""
        return False


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
