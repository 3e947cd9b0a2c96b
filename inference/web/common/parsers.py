"""Body parsers of the /v1 routes (DRF parser classes): JSON with a nesting limit, and multipart
whose failures say what was wrong. Both raise ParseError, which errors.exception_handler renders
as a 400 invalid_request_error in the spec's envelope.

A route that reads JSON reads it whatever the body's label: no Content-Type (litellm's Ollama
providers), or curl's default `-d` label application/x-www-form-urlencoded (Ollama's own
quick-start), as Ollama does; middleware.BrowserGuardMiddleware labels such a body JSON before
anything reads it, and what does not parse is the JSON parser's 400. A web page cannot use that
to post cross-site: its request carries an Origin header, which the same middleware refuses
unless the origin is allowed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.core.exceptions import SuspiciousOperation, TooManyFieldsSent, TooManyFilesSent
from django.http.multipartparser import MultiPartParserError
from rest_framework import parsers
from rest_framework.exceptions import ParseError
from rest_framework.settings import api_settings
from rest_framework.utils import json

from hypnos_site.json_bodies import too_many_values

# No OpenAI request nests deeper than a dozen levels (a tool's JSON schema is the deepest); 64
# leaves room for any real schema and refuses what exists only to exhaust the stack.
MAX_JSON_DEPTH = 64


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, with bodies nested deeper than MAX_JSON_DEPTH refused (400).

    The json module's C scanner recurses once per level, so 100,000 nested brackets raised
    RecursionError (a 500). Here that is caught while parsing, and what parsed is walked once,
    without recursion, so nothing downstream (pydantic, the request log, grammar building)
    meets a structure deeper than the limit."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None) -> Any:
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        raw = stream.read() if stream is not None else b""
        too_many = too_many_values(raw)
        if too_many:
            raise ParseError(too_many)
        try:
            text = raw.decode(encoding)
        except (LookupError, UnicodeDecodeError) as exc:
            raise ParseError(f"The body is not valid {encoding} text: {exc}") from exc
        parse_constant = json.strict_constant if api_settings.STRICT_JSON else None
        try:
            data = json.loads(text, parse_constant=parse_constant)
        except RecursionError as exc:
            raise ParseError(_too_deep()) from exc
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from exc
        # At most one level per bracket: most bodies are cleared without walking them.
        if text.count("[") + text.count("{") > MAX_JSON_DEPTH and json_depth(data) > MAX_JSON_DEPTH:
            raise ParseError(_too_deep())
        return data


def json_depth(data: Any) -> int:
    """How deeply `data` nests lists and objects (a scalar is 0, `[]` is 1), without recursion;
    stops counting once past MAX_JSON_DEPTH."""
    deepest = 0
    pending = [(data, 1)]
    while pending:
        value, depth = pending.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            break
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _too_deep() -> str:
    return f"The JSON body nests deeper than {MAX_JSON_DEPTH} levels."


class MultiPartParser(parsers.MultiPartParser):
    """DRF's multipart parser; a body it cannot split (no boundary, a truncated part) or one
    past Django's field and file counts (DATA_UPLOAD_MAX_NUMBER_FIELDS / _FILES, which raise
    SuspiciousOperation: a 500 through DRF) is a 400 naming the problem, in the envelope."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None) -> Any:
        try:
            return super().parse(stream, media_type, parser_context)
        except ParseError as exc:
            raise ParseError(f"The multipart/form-data body could not be read: {_reason(exc)}") from exc
        except (MultiPartParserError, SuspiciousOperation) as exc:
            raise ParseError(f"The multipart/form-data body could not be read: {multipart_problem(exc)}") from exc


def multipart_problem(exc: Exception) -> str:
    """What was wrong with a multipart body Django refused, in the client's words."""
    if isinstance(exc, TooManyFieldsSent):
        return f"it has more than {settings.DATA_UPLOAD_MAX_NUMBER_FIELDS} fields."
    if isinstance(exc, TooManyFilesSent):
        return f"it has more than {settings.DATA_UPLOAD_MAX_NUMBER_FILES} files."
    return str(exc)


def _reason(exc: ParseError) -> str:
    return str(exc.detail).removeprefix("Multipart form parse error - ")


def reads_json(parser_classes: list[type[parsers.BaseParser]]) -> bool:
    """Whether a route with these parsers takes a JSON body (then of any label)."""
    return any(issubclass(parser, parsers.JSONParser) for parser in parser_classes)
