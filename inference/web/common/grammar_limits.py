"""The JSON schemas a request asks a grammar for (`response_format`, `text.format`, the tools of a
forced call), checked before llama.cpp sees them.

llama-cpp-python turns a schema into GBNF text (`llama_cpp.llama_grammar.json_schema_to_gbnf`)
and libllama parses and runs that text. Neither bounds anything. Measured on llama-cpp-python
0.3.36: `maxLength: 1001` (or maxItems) makes libllama refuse the grammar ("exceeds sane
defaults"), its sampler comes back NULL and llama-cpp-python adds it to the chain anyway: the
process segfaults at the first token; near 16000-20000 nested groups libllama's parser itself
overflows the stack; `minLength: 1e9` builds a billion-item rule in Python until the kernel
kills the process. So a schema is walked first, against `limits.max_grammar_repetition`
(min/max length and items, pattern {n,m}, the counts of alternatives and enum values),
`limits.max_grammar_properties` (one object's), `limits.max_grammar_depth` (nesting, `$ref`s
followed) and a budget of sub-schemas, then converted with llama-cpp-python's own converter and
its GBNF measured against `limits.max_grammar_bytes`; the worker finally has libllama parse it
(llama_io.json_grammar). A `pattern` passes all of these and can still stall libllama's sampler
for minutes a token (`^(a?){1000}$`, issue 35), so the walk also reads each pattern the way the
converter does and bounds the parse stacks and parses of its grammar (grammar_patterns.pattern_stall). Whatever
the converter refuses (an unanchored pattern, an unresolvable `$ref`, an unknown type) is a 400
naming the request field, never a 500.

This module runs in the web process too, which must not load libllama: the converter is pure
Python and is loaded from llama-cpp-python's file without importing the `llama_cpp` package.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypnos_site.config import LimitsConfig
from hypnos_site.errors import InvalidRequest
from inference.transport.tools import call_schema, forced_tools
from inference.web.common.grammar_patterns import pattern_stall

KNOWN_TYPES = {"string", "number", "integer", "boolean", "null", "object", "array"}
COUNTS = ("minLength", "maxLength", "minItems", "maxItems")
# Keys whose value is one sub-schema, a list of them, or a map of them.
ONE_SCHEMA = ("items", "additionalProperties", "not", "contains", "if", "then", "else")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
# What each sub-schema costs at least in GBNF bytes: the budget of sub-schemas a schema may expand
# to (each $ref followed where it is used) is max_grammar_bytes over this.
BYTES_PER_SUBSCHEMA = 8
# A regex quantifier {n}, {n,} or {n,m}.
_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def check_schema(schema: dict[str, Any], limits: LimitsConfig, param: str) -> str | None:
    """Check a schema against the grammar limits and return its GBNF text (None when the
    converter is not installed here: the worker checks again). 400 naming `param` otherwise."""
    if not schema:
        return None
    _Walk(schema, limits, param).schema(schema, 0, frozenset(), "schema")
    convert = _converter()
    if convert is None:
        return None
    try:
        gbnf = convert(json.dumps(schema))
    except RecursionError:
        raise _refused(param, "it nests too deeply for the grammar converter") from None
    except (AssertionError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise _refused(param, f"llama.cpp's grammar converter refuses it: {exc or type(exc).__name__}") from exc
    size = len(gbnf.encode("utf-8"))
    if size > limits.max_grammar_bytes:
        raise _refused(
            param, f"its grammar is {size} bytes, above limits.max_grammar_bytes ({limits.max_grammar_bytes})"
        )
    nesting = gbnf_nesting(gbnf)
    if nesting > limits.max_grammar_repetition + limits.max_grammar_depth:
        raise _refused(
            param,
            f"its grammar nests {nesting} groups deep, above limits.max_grammar_repetition + limits.max_grammar_depth",
        )
    return gbnf


def check_tools(
    tools: list[dict[str, Any]], choice: str | dict[str, Any], limits: LimitsConfig, param: str = "tools"
) -> None:
    """`tools` as the worker gets them (OpenAI's `{"type": "function", "function": {...}}`). Every
    tool's `parameters` is walked against the limits (a dangling $ref, an unknown type or a huge
    count is wrong whatever tool_choice says); when the answer must be a call ("required", or a
    named function) the schema the grammar is built from is converted and measured too."""
    for index, tool in enumerate(tools):
        parameters = tool["function"].get("parameters")
        if parameters:
            _Walk(parameters, limits, param).schema(parameters, 0, frozenset(), f"tool {index}'s parameters")
    if choice in ("auto", "none") or not tools:
        return
    check_schema(call_schema(forced_tools(tools, choice)), limits, param)


def gbnf_nesting(gbnf: str) -> int:
    """The deepest nesting of parenthesised groups in GBNF text (what libllama's parser and
    matcher recurse on), outside literals and character classes."""
    deepest = depth = 0
    i, n = 0, len(gbnf)
    while i < n:
        c = gbnf[i]
        if c in '"[':
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and gbnf[i] != close:
                i += 2 if gbnf[i] == "\\" else 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        elif c == "\n":
            depth = 0
        i += 1
    return deepest


def _refused(param: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"The JSON schema of {param} cannot be used as a grammar: {why}.", param=param)


class _Walk:
    """One pass over a schema, following each $ref where it is used (not into a cycle)."""

    def __init__(self, root: dict[str, Any], limits: LimitsConfig, param: str):
        self.root = root
        self.limits = limits
        self.param = param
        self.budget = max(limits.max_grammar_bytes // BYTES_PER_SUBSCHEMA, 1)
        self.check_refs(root)

    def bad(self, where: str, why: str) -> InvalidRequest:
        return _refused(self.param, f"{where} {why}")

    def count(self, where: str, key: str, value: Any) -> None:
        limit = self.limits.max_grammar_repetition
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise self.bad(where, f"has {key} {json.dumps(value)}, not a non-negative integer")
        if value > limit:
            raise self.bad(where, f"asks for {key} {value}, above limits.max_grammar_repetition ({limit})")

    def schema(self, node: Any, depth: int, refs: frozenset[str], where: str) -> None:
        if not isinstance(node, dict):
            raise self.bad(where, f"is {json.dumps(node)[:40]}, not a schema object")
        if depth > self.limits.max_grammar_depth:
            raise self.bad(
                where, f"nests more than limits.max_grammar_depth ({self.limits.max_grammar_depth}) schemas deep"
            )
        self.budget -= 1
        if self.budget < 0:
            raise self.bad(
                "the schema",
                f"expands to too many sub-schemas for limits.max_grammar_bytes ({self.limits.max_grammar_bytes})",
            )
        self.keywords(node, where)
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref not in refs:
                self.schema(self.resolve(ref), depth + 1, refs | {ref}, ref)
            return
        for key in ONE_SCHEMA:
            value = node.get(key)
            if isinstance(value, dict):
                self.schema(value, depth + 1, refs, f"{where}.{key}")
            elif key == "items" and isinstance(value, list):
                self.schemas(value, depth, refs, f"{where}.{key}")
        for key in SCHEMA_LISTS:
            if key in node:
                self.schemas(node[key], depth, refs, f"{where}.{key}")
        properties = node.get("properties", {})
        if not isinstance(properties, dict):
            raise self.bad(f"{where}.properties", "is not an object")
        if len(properties) > self.limits.max_grammar_properties:
            raise self.bad(
                where,
                f"has {len(properties)} properties, above limits.max_grammar_properties "
                f"({self.limits.max_grammar_properties})",
            )
        for name, value in properties.items():
            self.schema(value, depth + 1, refs, f"{where}.properties.{name}")

    def schemas(self, value: Any, depth: int, refs: frozenset[str], where: str) -> None:
        if not isinstance(value, list) or not value:
            raise self.bad(where, "is not a non-empty list of schemas")
        self.count(where, "alternatives (their count)", len(value))
        for index, item in enumerate(value):
            self.schema(item, depth + 1, refs, f"{where}.{index}")

    def keywords(self, node: dict[str, Any], where: str) -> None:
        kind = node.get("type")
        for name in kind if isinstance(kind, list) else [kind]:
            if name is not None and (not isinstance(name, str) or name not in KNOWN_TYPES):
                raise self.bad(where, f"has type {json.dumps(name)[:40]}, not one of {', '.join(sorted(KNOWN_TYPES))}")
        for key in COUNTS:
            if key in node:
                self.count(where, key, node[key])
        for low, high in (("minLength", "maxLength"), ("minItems", "maxItems")):
            if isinstance(node.get(low), int) and isinstance(node.get(high), int) and node[low] > node[high]:
                raise self.bad(where, f"has {low} above {high}")
        if "enum" in node:
            if not isinstance(node["enum"], list) or not node["enum"]:
                raise self.bad(where, "has an enum that is not a non-empty list")
            self.count(where, "enum values (their count)", len(node["enum"]))
        if "pattern" in node:
            self.pattern(node["pattern"], where)

    def pattern(self, pattern: Any, where: str) -> None:
        if not isinstance(pattern, str):
            raise self.bad(where, "has a pattern that is not a string")
        if not (pattern.startswith("^") and pattern.endswith("$")):
            raise self.bad(
                where,
                f"has the pattern {pattern[:60]!r}, which is not anchored: llama.cpp's grammars "
                "take only patterns that start with ^ and end with $",
            )
        # Nesting first: Python's own regex parser recurses once per group, and 500 nested ones
        # raised RecursionError here (a 500 on every route that takes a schema).
        self.pattern_nesting(pattern, where)
        try:
            re.compile(pattern)
        except (re.error, RecursionError) as exc:
            raise self.bad(where, f"has the pattern {pattern[:60]!r}, not a regular expression: {exc}") from None
        for match in _QUANTIFIER.finditer(pattern):
            for bound in match.groups():
                if bound:
                    self.count(where, "a pattern repetition", int(bound))
        stall = pattern_stall(pattern)
        if stall:
            raise self.bad(where, f"has the pattern {pattern[:60]!r}, {stall}")

    def pattern_nesting(self, pattern: str, where: str) -> None:
        depth = deepest = 0
        escaped = False
        for c in pattern:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == "(":
                depth += 1
                deepest = max(deepest, depth)
            elif c == ")":
                depth -= 1
        if deepest > self.limits.max_grammar_depth:
            raise self.bad(
                where,
                f"has a pattern that nests {deepest} groups, above limits.max_grammar_depth "
                f"({self.limits.max_grammar_depth})",
            )

    def check_refs(self, root: Any) -> None:
        """Every $ref anywhere in the schema must resolve, as the converter resolves them all."""
        stack = [root]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                ref = node.get("$ref")
                if ref is not None:
                    self.resolve(ref)
                else:
                    stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)

    def resolve(self, ref: Any) -> Any:
        """The sub-schema a local reference ("#/$defs/x") names; 400 for any other."""
        if ref == "#":
            return self.root
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise self.bad(
                "the schema", f"has the $ref {json.dumps(ref)[:80]}: only local references (#/...) are resolved"
            )
        target: Any = self.root
        for part in ref[2:].split("/"):
            if not isinstance(target, dict) or part not in target:
                raise self.bad("the schema", f"has the $ref {ref[:80]!r}, which names nothing in it")
            target = target[part]
        return target


@functools.cache
def _converter() -> Callable[[str], str] | None:
    """llama-cpp-python's json_schema_to_gbnf: from the loaded package in the worker, else from
    its file (pure Python, standard library only), so the web process never loads libllama."""
    loaded = sys.modules.get("llama_cpp.llama_grammar")
    if loaded is not None:
        return loaded.json_schema_to_gbnf  # type: ignore[no-any-return]
    package = importlib.util.find_spec("llama_cpp")  # a top-level name: found, not imported
    if package is None or not package.submodule_search_locations:
        return None
    path = Path(list(package.submodule_search_locations)[0]) / "llama_grammar.py"
    spec = importlib.util.spec_from_file_location("hypnos_gbnf_converter", path)
    if spec is None or spec.loader is None or not path.is_file():
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.json_schema_to_gbnf  # type: ignore[no-any-return]
