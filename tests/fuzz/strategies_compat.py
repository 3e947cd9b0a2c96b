"""Hypothesis strategies for the compatibility APIs' bodies: Ollama's /api routes
(inference/web/ollama/protocol.py) and Anthropic's Messages API (inference/web/anthropic/protocol.py),
built like strategies.py builds the /v1 ones (a valid shape from the wire model, with the fields
that keep it cheap or reach the interesting refusals drawn from the lists below), then mutated
by the route fuzzer.

A pull or a delete may change models_dir, so their names are ones that resolve to nothing, to
files already there, or to the victim (whose weights the chat model shares, so no file goes);
DOWNLOAD_TRAP stands in for the pull route's download during the run and reports any call.
"""

from __future__ import annotations

import base64
import threading
from typing import Any

from hypothesis import strategies as st
from pydantic import BaseModel

from inference.web.anthropic.protocol import MessageCountTokensParams, MessageCreateParams, ToolParam
from inference.web.lemonade.protocol import LemonadePullRequest
from inference.web.ollama.protocol import (
    ChatRequest,
    DeleteRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    Options,
    PullRequest,
    ShowRequest,
)
from tests.fuzz.strategies import (
    CHAT,
    DOCLING,
    EMBED,
    ENTITIES,
    PNG,
    STT,
    TTS,
    VICTIM,
    WORDS,
    image_bytes,
    image_urls,
    json_schemas,
    model_names,
    small_json,
    wire_body,
)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# -- Ollama -------------------------------------------------------------------------------------


def ollama_names(*preferred: str) -> st.SearchStrategy[str]:
    """Mostly a model the route serves (as it is, `:latest`, its quant as the tag), then tags
    that resolve to nothing or to a model of another modality, then model_names' odd ones."""
    served = [*preferred, *(f"{name}:latest" for name in preferred)]
    if CHAT in preferred:
        served += [f"{CHAT}:q4_1", f"{CHAT}:Q4_1"]
    odd = st.sampled_from(
        [
            f"{CHAT}:q8_0",
            f"{CHAT}:",
            f"{CHAT}:latest:latest",
            ":latest",
            "nope:latest",
            "library/" + CHAT,
            "registry.ollama.ai/library/nope:latest",
            f"{STT}:latest",
            TTS,
            DOCLING,
            ENTITIES,
            "gpt-4o-mini:latest",
            "a" * 600,
        ]
    )
    return st.one_of(*[st.sampled_from(served)] * 3, odd, model_names)


# keep_alive: Go durations, seconds as numbers or strings, forever (-1), now (0), and what must
# be a 400 (no unit, an unknown unit, not finite, beyond any clock).
keep_alives = st.one_of(
    st.none(),
    st.none(),
    st.sampled_from(["5m", "1h30m", "1.5h", "300ms", "30s", "-1", -1, "-1m", 0, "0", "0s", 30, 2.5, "+5m"]),
    st.sampled_from(
        ["", " ", "m", "5x", "5 m", "1e309", "inf", "nan", "-inf", "9999999999h", "1µs", "٣s", 1e308, 10**30, True, []]
    ),
)
thinks = st.sampled_from([None, None, None, True, False, "low", "medium", "high", "max", "", 1])
ollama_formats = st.one_of(st.sampled_from(["", "json", "xml", None, {}]), json_schemas)
ollama_images = st.one_of(
    st.none(),
    st.just([]),
    st.lists(
        st.one_of(
            image_bytes.map(_b64),
            st.sampled_from(["", "!!!", "AAAA", "data:image/png;base64," + _b64(PNG), "A" * 90_000]),
        ),
        min_size=1,
        max_size=2,
    ),
)
ollama_tool_calls = st.lists(
    st.fixed_dictionaries(
        {
            "function": st.fixed_dictionaries(
                {"name": st.sampled_from(["get_weather", ""])},
                optional={"arguments": st.one_of(st.just({"city": "Paris"}), st.just('{"city": "Paris"}'), small_json)},
            )
        },
        optional={"id": st.sampled_from(["call_1", ""])},
    ),
    max_size=1,
)
ollama_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "user", "user", "system", "assistant", "tool", "developer", ""])},
        optional={
            "content": st.one_of(WORDS, WORDS, st.none(), st.just("<__media__>")),
            "images": ollama_images,
            "tool_calls": ollama_tool_calls,
            "thinking": WORDS,
            "tool_name": st.just("get_weather"),
        },
    ),
    max_size=3,
)
OLLAMA_OVERRIDES: dict[str, st.SearchStrategy[Any]] = {
    # -2 and -1: until the model stops (capped by the fuzz config's max_tokens_cap).
    "Options.num_predict": st.sampled_from([-2, -1, 0, 1, 2, 3, 10**6]),
    "ShowRequest.model": ollama_names(CHAT, EMBED, VICTIM, STT),
    "ShowRequest.name": ollama_names(CHAT, EMBED, VICTIM, STT),
    "EmbedRequest.input": st.one_of(WORDS, st.lists(WORDS, max_size=3), st.sampled_from(["", [], [""], ["Hi", ""]])),
    "EmbedRequest.dimensions": st.sampled_from([1, 8, 384, 385, 0, -1, 10**9]),
    "EmbeddingsRequest.prompt": st.one_of(WORDS, st.just("")),
    "GenerateRequest.prompt": st.one_of(WORDS, WORDS, st.just(""), st.just("<__media__>")),
    "GenerateRequest.system": WORDS,
    "GenerateRequest.template": st.sampled_from([None, None, None, "", "{{ .Prompt }}"]),
    "GenerateRequest.suffix": st.sampled_from([None, None, "", " end"]),
    "GenerateRequest.context": st.sampled_from([None, None, [], [1, 2, 3]]),
    "GenerateRequest.images": ollama_images,
    "ChatRequest.messages": ollama_messages,
}
ollama_options = wire_body(Options, OLLAMA_OVERRIDES)
SERVES = ((ChatRequest, CHAT), (GenerateRequest, CHAT), (EmbedRequest, EMBED), (EmbeddingsRequest, EMBED))
for _model, _serves in SERVES:
    OLLAMA_OVERRIDES |= {
        f"{_model.__name__}.model": ollama_names(_serves),
        f"{_model.__name__}.name": ollama_names(_serves),
        f"{_model.__name__}.options": ollama_options,
        f"{_model.__name__}.keep_alive": keep_alives,
    }
for _model in (ChatRequest, GenerateRequest):
    OLLAMA_OVERRIDES |= {f"{_model.__name__}.format": ollama_formats, f"{_model.__name__}.think": thinks}

# What a pull may name: catalog ids and tags that are not in the catalog (a 404 before any byte)
# and the served models whose files are in models_dir already (nothing to download).
pull_names = st.sampled_from(
    [
        CHAT,
        f"{CHAT}:latest",
        f"{CHAT}:q4_1",
        f"{CHAT}:Q4_1",
        f"{EMBED}:latest",
        f"{CHAT}:q9_9",
        "nope",
        "nope:latest",
        ":",
        "",
        ":latest",
        "library/nope",
        "../nope",
        "hf.co/nope/nope:Q4_K_M",
        "a" * 600,
    ]
)
# What a delete may name: the victim, and names that resolve to no model; never a model the
# other routes need.
delete_names = st.sampled_from(
    [VICTIM, f"{VICTIM}:latest", f"{VICTIM}:q4_1", "nope", "nope:latest", "", ":", f"{VICTIM}:q8_0"]
)
OLLAMA_OVERRIDES |= {
    "PullRequest.model": pull_names,
    "PullRequest.name": pull_names,
    "DeleteRequest.model": delete_names,
    "DeleteRequest.name": delete_names,
}


def _named(model: type[BaseModel]) -> st.SearchStrategy[dict[str, Any]]:
    """A body of `model` that names its model (both fields are optional on the wire, one is
    needed): mostly as `model`, sometimes only as `name` (Ollama's older clients), rarely not."""
    names = OLLAMA_OVERRIDES[f"{model.__name__}.model"]
    return st.builds(
        lambda body, name, key: (
            {k: v for k, v in body.items() if k not in ("model", "name")} | {key: name} if key else body
        ),
        wire_body(model, OLLAMA_OVERRIDES),
        names,
        st.sampled_from(["model"] * 8 + ["name", None]),
    )


ollama_chat_body = _named(ChatRequest)
ollama_generate_body = _named(GenerateRequest)
ollama_embed_body = _named(EmbedRequest)
ollama_embeddings_body = _named(EmbeddingsRequest)
ollama_show_body = _named(ShowRequest)
ollama_pull_body = _named(PullRequest)
lemonade_pull_body = wire_body(LemonadePullRequest, {"LemonadePullRequest.model_name": pull_names})
ollama_delete_body = _named(DeleteRequest)
ollama_unknown_paths = st.sampled_from(
    ["api/create", "api/copy", "api/push", "api/blobs/sha256:00", "api/", "api/%00", "api/chat/x", "api/tags/"]
)


class DownloadTrap:
    """Stands in for the download of the pull route (ollama_pull.fetch) during the fuzz run: a
    pull may install packages with pip and write models_dir, so a fuzz case must never start
    one. Each call is noted (the route fuzzer reports it) and fails as a refused download."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._labels: list[str] = []

    def __call__(self, planned: list[Any], *args: Any, **kwargs: Any) -> None:
        from models_registry.downloads import DownloadError

        with self._lock:
            self._labels += [item.label for item in planned]
        raise DownloadError("the fuzz run downloads nothing")

    def take(self) -> list[str]:
        """The files whose download was asked for since the last call."""
        with self._lock:
            labels, self._labels = self._labels, []
        return labels


DOWNLOAD_TRAP = DownloadTrap()


# -- Anthropic ----------------------------------------------------------------------------------

text_blocks = st.fixed_dictionaries({"type": st.just("text"), "text": WORDS})
image_blocks = st.fixed_dictionaries(
    {
        "type": st.just("image"),
        "source": st.one_of(
            st.fixed_dictionaries(
                {
                    "type": st.just("base64"),
                    "media_type": st.sampled_from(["image/png", "image/jpeg", "image/gif", "image/webp", "image/bmp"]),
                    "data": st.one_of(image_bytes.map(_b64), st.sampled_from(["", "!!!", "data:image/png;base64,A"])),
                }
            ),
            st.fixed_dictionaries({"type": st.just("url"), "url": image_urls}),
            st.fixed_dictionaries({"type": st.sampled_from(["file", "text", ""]), "file_id": st.just("file_1")}),
        ),
    }
)
content_blocks = st.one_of(
    text_blocks,
    text_blocks,
    image_blocks,
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": st.sampled_from(["toolu_1", ""]),
            "name": st.sampled_from(["get_weather", ""]),
            "input": st.one_of(st.just({"city": "Paris"}), small_json),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": st.sampled_from(["toolu_1", ""])},
        optional={
            "content": st.one_of(WORDS, st.lists(st.one_of(text_blocks, image_blocks), max_size=2)),
            "is_error": st.booleans(),
        },
    ),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": WORDS}, optional={"signature": WORDS}),
    st.fixed_dictionaries({"type": st.just("redacted_thinking"), "data": WORDS}),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["document", "search_result", "server_tool_use", "nope", ""]), "text": WORDS}
    ),
)


def _turn(roles: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {
            "role": st.sampled_from(roles),
            "content": st.one_of(WORDS, WORDS, WORDS, st.lists(content_blocks, min_size=1, max_size=3), st.just([])),
        }
    )


# Mostly a conversation that ends with a user turn (what the route serves), else any turns.
anthropic_messages = st.one_of(
    *[
        st.builds(
            lambda turns, last: [*turns, last], st.lists(_turn(["user", "assistant"]), max_size=2), _turn(["user"])
        )
    ]
    * 4,
    st.lists(_turn(["user", "assistant", "system", ""]), max_size=3),
)
ANTHROPIC_OVERRIDES: dict[str, st.SearchStrategy[Any]] = {
    "ToolParam.name": st.sampled_from(["get_weather"] * 6 + ["bad name", "", "x" * 129, "\u00e9"]),
    "ToolParam.input_schema": json_schemas,
}
anthropic_tools = st.lists(
    st.one_of(
        *[wire_body(ToolParam, ANTHROPIC_OVERRIDES)] * 4,
        st.sampled_from(
            [
                {"type": "web_search_20250305", "name": "web_search", "max_uses": 1},
                {"type": "bash_20250124", "name": "bash"},
            ]
        ),
    ),
    max_size=2,
)
for _model in (MessageCreateParams, MessageCountTokensParams):
    ANTHROPIC_OVERRIDES |= {
        f"{_model.__name__}.model": st.one_of(
            st.sampled_from([CHAT, CHAT, CHAT, "gpt-4o-mini", VICTIM]),
            st.sampled_from(["claude-sonnet-4-5", "claude-3-5-haiku-latest", EMBED, STT, DOCLING, f"{CHAT}:latest"]),
            model_names,
        ),
        f"{_model.__name__}.messages": anthropic_messages,
        f"{_model.__name__}.system": st.one_of(
            WORDS, st.lists(text_blocks, max_size=2), st.just(""), st.lists(image_blocks, max_size=1)
        ),
        f"{_model.__name__}.tools": anthropic_tools,
        f"{_model.__name__}.tool_choice": st.one_of(
            st.sampled_from(
                [
                    {"type": "auto"},
                    {"type": "any"},
                    {"type": "none"},
                    {"type": "tool", "name": "get_weather"},
                    {"type": "tool", "name": "nope"},
                    {"type": "required"},
                    {"type": "auto", "disable_parallel_tool_use": True},
                    "auto",
                ]
            ),
            small_json,
        ),
        f"{_model.__name__}.thinking": st.one_of(
            st.sampled_from([{"type": "disabled"}, {"type": "adaptive"}, {"type": "enabled"}, {"type": "on"}]),
            st.fixed_dictionaries(
                {"type": st.just("enabled"), "budget_tokens": st.sampled_from([1, 2, 1024, 0, -1, 10**12])}
            ),
        ),
        f"{_model.__name__}.output_config": st.one_of(
            st.fixed_dictionaries(
                {"format": st.fixed_dictionaries({"type": st.just("json_schema"), "schema": json_schemas})}
            ),
            st.sampled_from([{}, {"effort": "high"}, {"format": {"type": "json_object"}}, {"format": None}]),
        ),
    }
ANTHROPIC_OVERRIDES["MessageCreateParams.stop_sequences"] = st.lists(WORDS, max_size=3)

message_body = wire_body(MessageCreateParams, ANTHROPIC_OVERRIDES)
count_tokens_body = wire_body(MessageCountTokensParams, ANTHROPIC_OVERRIDES)
