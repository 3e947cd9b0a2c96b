"""The pieces of the wire models every API surface shares: the strict base model, the request
body parser that renders pydantic errors in the spec's shape, and the shapes two surfaces read alike
(a function tool, the thinking budgets, an embedding input)."""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hypnos_site.errors import InvalidRequest


class _Wire(BaseModel):
    # Unknown fields are ignored (spec §1); a wrong JSON type is a 400, not a coercion (compat.md).
    model_config = ConfigDict(extra="ignore", strict=True)


# Thought-token budgets of reasoning_effort (spec §7.1); "minimal" is read as "low".
THINKING_BUDGETS = {"minimal": 512, "low": 512, "medium": 2048, "high": 6144}


class FunctionDefinition(_Wire):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Wire):
    type: Literal["function"]
    function: FunctionDefinition


M = TypeVar("M", bound=BaseModel)


def lone_surrogate_at(data: Any, path: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    """Where a string of the body holds a lone UTF-16 surrogate (the JSON escape \\ud800 parses
    into one; it is no character and cannot be encoded as UTF-8 for an engine), or None."""
    stack = [(path, data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return where
        elif isinstance(value, dict):
            stack += [((*where, str(key)), item) for key, item in value.items()]
            stack += [(where, key) for key in value if isinstance(key, str)]
        elif isinstance(value, list):
            stack += [((*where, str(i)), item) for i, item in enumerate(value)]
    return None


_SURROGATE = re.compile(r"[\ud800-\udfff]")


# The names pydantic gives the members of a union in an error's location: `input: str | list[str]`
# given 5 fails at ("input", "str") and ("input", "list[str]"); the client's field is `input`.
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "none", "any"})


def union_tag(part: str | int) -> bool:
    """Whether a part of a pydantic error location names a union member or a validator, not a
    field of the body (field names are snake_case; a member is a type or a model class)."""
    if isinstance(part, int):
        return False
    return (
        part.startswith(("function-", "tagged-union["))
        or "[" in part
        or part.lower() in _TYPE_NAMES
        or part[:1].isupper()
    )


def parse_body(model: type[M], data: Any) -> M:
    """Validate a request body; the first problem becomes a 400 naming the field."""
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    where = lone_surrogate_at(data)
    if where is not None:
        param = ".".join(where) or None
        raise InvalidRequest(
            f"Invalid value for {param}: the string holds a lone UTF-16 surrogate "
            "(an unpaired \\ud800-\\udfff escape), which is not a character.",
            param=param,
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"] if not union_tag(p)) or None
        raise InvalidRequest(f"Invalid value for {param or 'the body'}: {err['msg']}", param=param) from exc


def input_texts(value: str | list[str]) -> list[str]:
    """An embedding request's `input` as a list, refused when it or one of its strings is empty."""
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise InvalidRequest("input must not be empty", param="input")
    for index, text in enumerate(texts):
        if not text:
            raise InvalidRequest(f"input[{index}] is an empty string", param="input")
    return texts


def body_object(data: object) -> dict:
    """A body that must be a JSON object (a 400 otherwise), before any field is read."""
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return data
