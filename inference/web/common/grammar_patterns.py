"""Whether llama.cpp's grammar sampler would stall on a schema `pattern` (grammar_limits.py
walks a schema; this reads one of its patterns): the pattern read the way llama-cpp-python's
converter reads it, and the parse stacks and parses of the grammar it builds counted the way
libllama's sampler walks them, without expanding a repetition (every pattern tried is checked in
0.1-50 ms).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

# What libllama's sampler does with a pattern's grammar: it keeps one stack for every place the
# next character may go, and for every token it rejects it walks every parse of the token's
# characters (llama_grammar_reject_candidates keeps no memo). A repeated part that can match
# nothing ((a?){n}, (a*){n}, ((a?)?){n}, (a|b?){n}, a?a?a?...) leaves a stack in each copy, so
# two characters have some n^2/2 parses; overlapping alternatives ((x|x|x)) multiply theirs copy
# by copy. Measured on llama-cpp-python 0.3.36 with SmolLM2-135M's 49152-token vocabulary, one
# sampling step over the whole vocabulary beside a running test suite (best of 3-5 runs near the
# bounds; a plain string pattern, ^[a-z]{1,20}$ or ^.{0,100}$, takes 10-30 ms):
#   ^(a?){n}$             n=10: 20 ms, 25: 45 ms, 30: 71 ms, 50: 0.29 s, 100: 6.7 s, 150: > 30 s
#   ^(.?){n}$             n=3: 27 ms, 4: 54 ms, 6: 0.15 s, 10: 1.1 s, 20: 6.9 s
#   ^(a|b?){n}$           n=10: 61 ms, 20: 0.44 s, 40: 10 s
#   ^(x|...|x)+$, x=[a-z] 3 alternatives: 17 ms, 4: 60 ms, 6: 0.98 s, 8: 13 s
#   ^([ -~]|[ -~]){0,n}$  n=8: 0.46 s, 30: > 40 s (three alternatives: n=5: 0.83 s, 10: 23 s)
#   ^(w1|...|wn)$         n=100 words: 75 ms, 1000: 0.73 s (a stack for each word at the start)
# Hence three bounds on the grammar the converter builds. Stacks alive at one point:
PATTERN_MAX_STACKS = 256
# Parses of two characters that a third goes on from (16 is (.?){4} or four overlapping
# alternatives, past 50 ms; the ordinary patterns tried, dates to IPv4 and e-mail, have 1-4):
PATTERN_MAX_PARSES = 12
# A bounded repetition of a part two characters parse in p ways, c times: p^c parses (a token
# longer than the run is rejected only after all of them). The worst shapes these three let
# through, (..?){4}, ([ -~][ -~]|[ -~][ -~]){0,4}, ([ -~]|[ -~]|[ -~])?[ -~]?[ -~]?, measured
# 50-70 ms; none of the ordinary ones tried is near them.
PATTERN_MAX_RUN_PARSES = 16


@functools.lru_cache(maxsize=256)
def pattern_stall(pattern: str) -> str | None:
    """Why llama.cpp's sampler would stall on the grammar the converter builds for an anchored
    pattern that compiles (PATTERN_MAX_STACKS, PATTERN_MAX_PARSES, PATTERN_MAX_RUN_PARSES), or
    None; None too for what the converter itself refuses (check_schema says why). Cached: a
    pattern under a $ref is walked wherever the $ref is used."""
    try:
        tree = _pattern_tree(pattern)
    except (ValueError, IndexError):
        return None
    try:
        _Parses(tree).check()
    except _Stall as stall:
        return str(stall)
    return None


_MAX_CHAR = 0x10FFFF
_Ranges = tuple[tuple[int, int], ...]
# The escapes that stand for classes (libllama refuses them today, but not for ever).
_CLASS_ESCAPES: dict[str, _Ranges] = {
    "d": ((48, 57),),
    "w": ((48, 57), (65, 90), (95, 95), (97, 122)),
    "s": ((9, 13), (32, 32)),
}
# The converter's `.`: any character but a line break.
_DOT: _Ranges = ((0, 9), (11, 12), (14, _MAX_CHAR))
_QUANTIFIERS = {"*": (0, None), "+": (1, None), "?": (0, 1)}


@dataclass(eq=False)
class _Char:
    """One character of the grammar, where a parse stack waits."""

    ranges: _Ranges


@dataclass(eq=False)
class _Group:
    """A sequence ("seq"), alternatives ("alt"), or `items[0]` repeated low..high times ("rep")."""

    kind: str
    items: list[_Char | _Group] = field(default_factory=list)
    low: int = 1
    high: int | None = 1


def _pattern_tree(pattern: str) -> _Group:
    """The pattern as the converter reads it (llama_grammar._visit_pattern): groups,
    alternatives, `.`, classes, escapes and quantifiers, each quantifier on the unit before it."""
    text, i = pattern[1:-1], 0
    groups = [_Group("alt", [_Group("seq")])]
    while i < len(text):
        c, seq = text[i], groups[-1].items[-1]
        assert isinstance(seq, _Group)
        if c == "(":
            groups.append(_Group("alt", [_Group("seq")]))
            seq.items.append(groups[-1])
        elif c == ")":
            groups.pop()
        elif c == "|":
            groups[-1].items.append(_Group("seq"))
        elif c in _QUANTIFIERS:
            seq.items[-1] = _Group("rep", [seq.items[-1]], *_QUANTIFIERS[c])
        elif c == "{":
            end = text.index("}", i)
            low, comma, high = text[i + 1 : end].partition(",")
            bounds = (int(low or 0), int(high) if high.strip() else None) if comma else (int(low), int(low))
            seq.items[-1] = _Group("rep", [seq.items[-1]], *bounds)
            i = end
        elif c == "[":
            end = i + 1
            while text[end] != "]":
                end += 2 if text[end] == "\\" else 1
            seq.items.append(_Char(_bracket(text[i + 1 : end])))
            i = end
        else:
            escaped = c == "\\" and i + 1 < len(text)
            i += escaped
            seq.items.append(_Char(_DOT if c == "." else _escape(text[i]) if escaped else ((ord(c), ord(c)),)))
        i += 1
    return groups[0]


def _bracket(body: str) -> _Ranges:
    negated = body.startswith("^")
    chars = body[negated:]
    ranges: list[tuple[int, int]] = []
    i = 0
    while i < len(chars):
        if chars[i] == "\\" and i + 1 < len(chars):
            ranges.extend(_escape(chars[i + 1]))
            i += 2
        elif i + 2 < len(chars) and chars[i + 1] == "-":
            ranges.append((ord(chars[i]), ord(chars[i + 2])))
            i += 3
        else:
            ranges.append((ord(chars[i]), ord(chars[i])))
            i += 1
    return _complement(tuple(ranges)) if negated else tuple(ranges)


def _escape(c: str) -> _Ranges:
    if c.lower() in _CLASS_ESCAPES:
        ranges = _CLASS_ESCAPES[c.lower()]
        return _complement(ranges) if c.isupper() else ranges
    code = {"n": 10, "t": 9, "r": 13}.get(c, ord(c))
    return ((code, code),)


def _complement(ranges: _Ranges) -> _Ranges:
    out, low = [], 0
    for lo, hi in sorted(ranges):
        if lo > low:
            out.append((low, lo - 1))
        low = max(low, hi + 1)
    return (*out, (low, _MAX_CHAR)) if low <= _MAX_CHAR else tuple(out)


class _Stall(Exception):
    pass


_Stacks = dict[_Char, int]  # a stack per place the next character may go, and per copy


def _add(into: _Stacks, more: _Stacks, times: int = 1) -> _Stacks:
    for char, n in more.items():
        into[char] = into.get(char, 0) + n * times
    return into


def _most_on_one_character(weighted: list[tuple[_Ranges, int]]) -> int:
    events: dict[int, int] = {}
    for ranges, n in weighted:
        for lo, hi in ranges:
            events[lo] = events.get(lo, 0) + n
            events[hi + 1] = events.get(hi + 1, 0) - n
    best = level = 0
    for at in sorted(events):
        level += events[at]
        best = max(best, level)
    return best


def _union(stacks: _Stacks) -> _Ranges:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(r for char in stacks for r in char.ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)


class _Parses:
    """Where the parse stacks of a pattern's grammar go after each character, counted as libllama
    counts them: a bounded copy of a repeated part is a stack of its own, the iterations of an
    unbounded loop are one (its stack dedupe folds them). Only the first copy of a repetition is
    followed, with what follows any copy (an upper bound), so nothing is expanded."""

    def __init__(self, tree: _Group):
        self.nullables: dict[int, bool] = {}
        self.firsts: dict[int, _Stacks] = {}
        self.runs: list[_Group] = []
        quote, anything = _Char(((34, 34),)), _Char(((0, _MAX_CHAR),))
        # After the closing quote the JSON goes on: a parse that reaches it stays alive.
        self.follow: dict[_Char, _Stacks] = {quote: {anything: 1}, anything: {}}
        self.start = self.bounded(_add(dict(self.first(tree)), {quote: 1} if self.nullable(tree) else {}))
        self.visit(tree, {quote: 1}, self.follow)

    def check(self) -> None:
        """Raise _Stall past PATTERN_MAX_PARSES or PATTERN_MAX_RUN_PARSES (PATTERN_MAX_STACKS is
        checked as the stacks are counted)."""
        points = {id(stacks): stacks for stacks in [self.start, *self.follow.values()]}
        for stacks in points.values():
            if self.most_parses(stacks, self.follow) > PATTERN_MAX_PARSES:
                parses = self.parses(stacks, 2, self.follow)
                if parses > PATTERN_MAX_PARSES:
                    raise _Stall(
                        f"whose grammar has {parses} parses of two characters (above {PATTERN_MAX_PARSES}): "
                        "llama.cpp's sampler would walk them all for every token (a repeated part that can "
                        "match nothing, or alternatives that overlap)"
                    )
        for run in self.runs:
            self.check_run(run)

    def check_run(self, run: _Group) -> None:
        """The parses of two characters inside the run (from one copy to the next, not out of
        it), multiplied copy by copy."""
        kid, inside = run.items[0], dict[_Char, _Stacks]()
        self.visit(kid, dict(self.first(kid)), inside)
        first = self.first(kid)
        ways = self.parses(first, 2, inside) if self.most_parses(first, inside) > 1 else 1
        copies = self.copies(run)
        if ways > 1 and ways**copies > PATTERN_MAX_RUN_PARSES:
            raise _Stall(
                f"which repeats {copies} times a part that two characters parse in {ways} ways "
                f"({ways}^{copies} parses, above {PATTERN_MAX_RUN_PARSES}): llama.cpp's sampler would "
                "walk them all for every token longer than the run"
            )

    def nullable(self, node: _Char | _Group) -> bool:
        """Whether `node` can match nothing."""
        if isinstance(node, _Char):
            return False
        if id(node) not in self.nullables:
            kids = [self.nullable(kid) for kid in node.items]
            self.nullables[id(node)] = all(kids) if node.kind == "seq" else any(kids) or node.low == 0
        return self.nullables[id(node)]

    def copies(self, rep: _Group) -> int:
        return rep.high if rep.high is not None else rep.low + 1

    def first(self, node: _Char | _Group) -> _Stacks:
        """The stacks at the start of `node`."""
        if isinstance(node, _Char):
            return {node: 1}
        if id(node) not in self.firsts:
            out: _Stacks = {}
            if node.kind != "rep":
                for kid in node.items:
                    _add(out, self.first(kid))
                    if node.kind == "seq" and not self.nullable(kid):
                        break
            elif self.copies(node):
                # Every copy of a part that can match nothing starts at once.
                kid = node.items[0]
                _add(out, self.first(kid), self.copies(node) if self.nullable(kid) else 1)
            self.firsts[id(node)] = self.bounded(out)
        return self.firsts[id(node)]

    def visit(self, node: _Char | _Group, after: _Stacks, follow: dict[_Char, _Stacks]) -> None:
        """Record in `follow` the stacks after each character of `node`, given those after its end."""
        if isinstance(node, _Char):
            follow[node] = after
        elif node.kind == "alt":
            for kid in node.items:
                self.visit(kid, after, follow)
        elif node.kind == "seq":
            for kid in reversed(node.items):
                self.visit(kid, after, follow)
                after = self.bounded(_add(dict(self.first(kid)), after if self.nullable(kid) else {}))
        elif self.copies(node):
            kid, more = node.items[0], self.copies(node) - 1
            if node.high is not None and more and not self.nullable(kid) and follow is self.follow:
                self.runs.append(node)
            again = more if self.nullable(kid) else min(more, 1)
            self.visit(kid, self.bounded(_add(_add({}, self.first(kid), again), after)), follow)

    def bounded(self, stacks: _Stacks) -> _Stacks:
        alive = sum(stacks.values())
        if alive > PATTERN_MAX_STACKS:
            raise _Stall(
                f"whose grammar keeps {alive} parse stacks alive at one point (above {PATTERN_MAX_STACKS}): "
                "llama.cpp's sampler would walk each for every token"
            )
        return stacks

    def most_parses(self, stacks: _Stacks, follow: dict[_Char, _Stacks]) -> int:
        """A quick upper bound of parses(stacks, 2, follow): every stack and every next one."""
        return sum(n * sum(follow[char].values()) for char, n in stacks.items())

    def parses(self, stacks: _Stacks, depth: int, follow: dict[_Char, _Stacks]) -> int:
        """The most parses a string of `depth` characters has from `stacks`, counting those a
        next character goes on from."""
        edges = {lo for char in stacks for lo, _ in char.ranges} | {hi + 1 for char in stacks for _, hi in char.ranges}
        best = 0
        for at in edges:
            taking = [(char, n) for char, n in stacks.items() if any(lo <= at <= hi for lo, hi in char.ranges)]
            if depth == 1:
                best = max(best, _most_on_one_character([(_union(follow[char]), n) for char, n in taking]))
            elif taking:
                after: _Stacks = {}
                for char, n in taking:
                    _add(after, follow[char], n)
                best = max(best, self.parses(after, depth - 1, follow))
        return best
