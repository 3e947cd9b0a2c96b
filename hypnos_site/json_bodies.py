"""How much a JSON body may hold, counted on its text before anything is built (issue 35).

Both readers of a request's JSON use it: the routes' parser (inference/web/common/parsers.py, which answers
a 400) and the request log (logs/capture.json_body, which then logs no body), so a body past
the limits is never turned into Python objects, not even once.
"""

from __future__ import annotations

import re

# How many objects and arrays, and values of any kind, a body may hold (issue 35). Python takes
# 50-60 bytes for an empty dict or list where the text takes 3, and pydantic then builds a model
# or an error (about 1.2 KB) for each: 8 MiB of `{},` messages grew a process by 3.4 GB. Within
# these limits the worst body costs about 360 MB and 8 s of validation. A real one is far below:
# a long chat is hundreds of messages, tools' schemas a few thousand nodes, and token arrays for
# /v1/embeddings, the largest, are capped by OpenAI itself at 300,000 tokens a request.
MAX_JSON_CONTAINERS = 100_000
MAX_JSON_VALUES = 300_000
# A JSON string, escapes included; possessive, so a long one is one step, not a backtrack.
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')


def too_many_values(raw: bytes) -> str | None:
    """Why a JSON text holds more objects, arrays or values than a body may, counted on the text
    before anything is built (its strings set aside, so a brace in a prompt is not one); None
    when it is within both limits. Memory: one copy of the text at most."""
    if raw.count(b"{") + raw.count(b"[") <= MAX_JSON_CONTAINERS and raw.count(b",") < MAX_JSON_VALUES:
        return None  # most bodies: not even a copy
    bare = _STRING.sub(b"", raw)
    containers = bare.count(b"{") + bare.count(b"[")
    if containers > MAX_JSON_CONTAINERS:
        return f"The JSON body holds more than {MAX_JSON_CONTAINERS} objects and arrays."
    if bare.count(b",") + 1 > MAX_JSON_VALUES:
        return f"The JSON body holds more than {MAX_JSON_VALUES} values."
    return None
