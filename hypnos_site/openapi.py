"""GET /v1/openapi.json: an OpenAPI 3.1 description of every route, generated at the first call
from the URL table (Django's resolver, walked in the order it matches) and the pydantic protocol
models the views parse their bodies with; and GET /docs, Swagger UI (vendored in
static/docs/swagger-ui/) rendering it.

Both are open, like /health: they describe the routes and hold nothing of the server's state, and
the docs page has to read the schema before its user has typed a key. What the generator cannot
read from the URL table, which protocol model a view parses and which media types it streams, is
the `BODIES` table below; a route missing from it is still described, with an object body.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.urls import URLPattern, URLResolver, get_resolver
from django.urls.resolvers import RoutePattern
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import AllowAny
from rest_framework.request import Request

from hypnos_site import __version__, metrics
from inference.web.anthropic import protocol as protocol_anthropic
from inference.web.anthropic import views as anthropic_views
from inference.web.lemonade import protocol as protocol_lemonade
from inference.web.lemonade import views as lemonade_views
from inference.web.ollama import protocol as protocol_ollama
from inference.web.ollama import views as ollama_views
from inference.web.openai import protocol, protocol_media
from inference.web.openai import views as inference_views
from logs import views as log_views
from models_registry import key_views
from models_registry.api_view import APIView

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"
JSON = "application/json"
MULTIPART = "multipart/form-data"
# The routes a client may call without a key whatever the configuration (spec §2: /health and
# /ready; /metrics unless the operator closes it), and these two.
OPEN_PATHS = ("/health", "/ready", "/metrics", "/v1/openapi.json", "/docs", "/")
# The pages for browsers: the playground (which answers Ollama's clients in plain text) and /docs.
PAGES = {"/": ("text/html", "text/plain"), "/docs": ("text/html",)}
# The route families, in the order the docs page shows them.
TAGS = {
    "Hypnos": "The OpenAI-compatible routes and Hypnos's extensions (spec).",
    "Anthropic": "Anthropic's Messages API (compat.md).",
    "Lemonade": "Lemonade's routes: its lifecycle ones and every /v1 route again under /api/v1 (compat.md).",
    "Ollama": "Ollama's API (compat.md).",
    "Server": "Health, readiness, metrics and the pages for browsers.",
}
BODY_METHODS = ("post", "put", "patch", "delete")
METHODS = ("get", "head", "post", "put", "patch", "delete")
_PARAMETER = re.compile(r"<(?:(?P<converter>[^>:]+):)?(?P<name>\w+)>")
# Path parameters that are not strings in the schema, by the class of their converter.
_PARAMETER_CONVERTERS = {"IntConverter": "integer"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The error envelope of every Hypnos, OpenAI and Lemonade route (spec §4)."""

    error: ErrorDetail


class OllamaErrorResponse(BaseModel):
    """Ollama's error shape, on /api/* (compat.md)."""

    error: str


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error shape, on /v1/messages (compat.md)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


@dataclass(frozen=True)
class Body:
    """What a view reads and answers, beyond its methods and path: the protocol model of its
    body (None: any JSON object), the media types it reads, the media types of its answer."""

    model: type[BaseModel] | None = None
    reads: tuple[str, ...] = (JSON,)
    answers: tuple[str, ...] = (JSON,)
    # Said on the 200 of a route whose answer is a stream when the body asks for one.
    streams: str = ""
    # The file parts of its multipart form, beside the model's fields.
    files: tuple[str, ...] = ()


_SSE_WHEN_STREAM = "With `stream: true`, server-sent events (`data: {json}` lines, then `data: [DONE]`)."
_NDJSON_WHEN_STREAM = "Streams one JSON object a line (`application/x-ndjson`) unless `stream` is false."

BODIES: dict[object, Body] = {
    inference_views.ChatCompletionsView: Body(
        protocol.ChatCompletionRequest, answers=(JSON, SSE), streams=_SSE_WHEN_STREAM
    ),
    inference_views.CompletionsView: Body(protocol.CompletionRequest, answers=(JSON, SSE), streams=_SSE_WHEN_STREAM),
    inference_views.ResponsesView: Body(
        protocol.ResponsesRequest,
        answers=(JSON, SSE),
        streams="With `stream: true`, server-sent events named by `event:` lines (OpenAI's Responses events).",
    ),
    inference_views.AdvisorView: Body(protocol.AdvisorRequest),
    inference_views.ModelMoeOffloadView: Body(protocol.MoeOffloadRequest),
    inference_views.MemoryTierView: Body(protocol.MemoryTierRequest),
    inference_views.KvParkView: Body(protocol.KvParkRequest),
    inference_views.EmbeddingsView: Body(protocol_media.EmbeddingRequest),
    inference_views.EntitiesView: Body(protocol_media.EntityRequest),
    inference_views.ImagesView: Body(protocol_media.ImageGenerationRequest),
    inference_views.ImageFormView: Body(protocol_media.ImageGenerationRequest, reads=(MULTIPART,), files=("image",)),
    inference_views.ImageUpscaleView: Body(protocol_media.ImageUpscaleRequest),
    inference_views.AudioTranscriptionsView: Body(
        protocol_media.TranscriptionRequest,
        reads=(MULTIPART, JSON),
        files=("file",),
        answers=(JSON, "text/plain", SSE),
        streams="With `stream: true`, server-sent events of the transcript as it is made.",
    ),
    inference_views.AudioSpeechView: Body(
        protocol_media.SpeechRequest,
        answers=("audio/wav", "audio/pcm", SSE),
        streams="With `stream: true` the audio arrives in chunks as it is synthesized (a chunked body); "
        'with `stream_format: "sse"` as server-sent events of base64 audio.',
    ),
    inference_views.DocumentConvertView: Body(
        protocol_media.DocumentConvertRequest,
        reads=(MULTIPART, JSON),
        files=("file",),
        answers=(JSON, SSE),
        streams="With `stream: true`, server-sent events: one per page as it is converted, then the document.",
    ),
    inference_views.FilesView: Body(protocol_media.FileUploadRequest, reads=(MULTIPART,), files=("file",)),
    inference_views.BatchesView: Body(protocol.BatchCreateRequest),
    inference_views.FileContentView: Body(answers=("application/octet-stream",)),
    lemonade_views.LemonadeLoadView: Body(protocol_lemonade.LemonadeLoadRequest),
    lemonade_views.LemonadePullView: Body(
        protocol_lemonade.LemonadePullRequest,
        answers=(JSON, SSE),
        streams="With `stream: true`, server-sent events `progress` (per file), then `complete` or `error`.",
    ),
    inference_views.InternalSetView: Body(protocol.InternalSetRequest),
    anthropic_views.MessagesView: Body(
        protocol_anthropic.MessageCreateParams,
        answers=(JSON, SSE),
        streams="With `stream: true`, Anthropic's server-sent events (`message_start` ... `message_stop`).",
    ),
    anthropic_views.CountTokensView: Body(protocol_anthropic.MessageCountTokensParams),
    ollama_views.ShowView: Body(protocol_ollama.ShowRequest),
    ollama_views.ChatView: Body(protocol_ollama.ChatRequest, answers=(JSON, NDJSON), streams=_NDJSON_WHEN_STREAM),
    ollama_views.GenerateView: Body(
        protocol_ollama.GenerateRequest, answers=(JSON, NDJSON), streams=_NDJSON_WHEN_STREAM
    ),
    ollama_views.EmbedView: Body(protocol_ollama.EmbedRequest),
    ollama_views.EmbeddingsView: Body(protocol_ollama.EmbeddingsRequest),
    ollama_views.PullView: Body(protocol_ollama.PullRequest, answers=(JSON, NDJSON), streams=_NDJSON_WHEN_STREAM),
    ollama_views.DeleteView: Body(protocol_ollama.DeleteRequest),
    key_views.KeyListView: Body(key_views.ApiKeyCreateRequest),
    log_views.DocumentPictureView: Body(answers=("image/png", "image/jpeg", "image/webp")),
    metrics.metrics_view: Body(answers=("text/plain",)),
}


@dataclass(frozen=True)
class Route:
    """One entry of the URL table: its OpenAPI path, the view, and the converters of its
    parameters (name -> (converter name, its regex))."""

    path: str
    view: Callable[..., Any]
    parameters: dict[str, tuple[str, str]]

    @property
    def view_class(self) -> type | None:
        return getattr(self.view, "view_class", None) or getattr(self.view, "cls", None)

    @property
    def methods(self) -> list[str]:
        """The methods a class-based view defines; a function view is a GET (HEAD with it)."""
        cls = self.view_class
        if cls is None:
            return ["get"]
        return [method for method in METHODS if method in vars_of(cls)]


def vars_of(cls: type) -> set[str]:
    """The names defined on a view class or on its bases below Django's and DRF's own views
    (whose `options` and `http_method_not_allowed` every view has)."""
    names: set[str] = set()
    for base in cls.__mro__:
        if base.__module__.startswith(("django.", "rest_framework.", "adrf.")) or base is object:
            continue
        names.update(vars(base))
    return names


def url_routes(patterns: list[Any] | None = None, prefix: str = "") -> Iterator[Route]:
    """The routes of the URL table in the order the resolver tries them, their prefixes joined;
    the admin's pages and the catch-all regular expressions (a 404 in the family's shape) are
    not routes of the API."""
    for entry in get_resolver().url_patterns if patterns is None else patterns:
        if not isinstance(entry.pattern, RoutePattern):
            continue
        route = prefix + str(entry.pattern)
        if route.startswith("admin/"):
            continue
        if isinstance(entry, URLResolver):
            yield from url_routes(entry.url_patterns, route)
        elif isinstance(entry, URLPattern):
            parameters = {
                name: (_PARAMETER_CONVERTERS.get(type(converter).__name__, "string"), converter.regex)
                for name, converter in entry.pattern.converters.items()
            }
            yield Route("/" + _PARAMETER.sub(r"{\g<name>}", route), entry.callback, parameters)


@functools.cache
def _document() -> dict[str, Any]:
    """Paths and components; the per-request `servers` entry is added by the view."""
    routes: dict[str, Route] = {}
    for route in url_routes():
        routes.setdefault(route.path, route)  # the first one matches; a later twin never does
    models = {body.model for body in BODIES.values() if body.model is not None}
    models |= {ErrorResponse, OllamaErrorResponse, AnthropicErrorResponse}
    ordered = sorted(models, key=lambda model: (model.__module__, model.__qualname__))
    refs, definitions = models_json_schema(
        [(model, "validation") for model in ordered], ref_template="#/components/schemas/{model}"
    )
    schema_refs = {model: refs[(model, "validation")] for model in ordered}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Hypnos",
            "version": __version__,
            "description": "The Hypnos HTTP API: OpenAI-compatible routes on /v1 with Hypnos's extensions, "
            "Lemonade's on /api/v1, Ollama's on /api and Anthropic's Messages API on /v1/messages. "
            "Generated from the server's URL table and protocol models.",
        },
        "tags": [{"name": name, "description": description} for name, description in TAGS.items()],
        "paths": {path: _path_item(route, schema_refs) for path, route in routes.items()},
        "components": {
            "schemas": definitions.get("$defs", {}),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "An API key (spec §2)."},
                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
        # A key is needed only when the server has keys configured: none is an alternative.
        "security": [{"bearer": []}, {"x-api-key": []}, {}],
    }


def _path_item(route: Route, refs: dict[type[BaseModel], dict[str, Any]]) -> dict[str, Any]:
    body = BODIES.get(route.view_class or route.view, Body())
    item: dict[str, Any] = {}
    if route.parameters:
        item["parameters"] = [
            {
                "name": name,
                "in": "path",
                "required": True,
                "schema": {"type": kind} if kind == "integer" else {"type": "string", "pattern": f"^{regex}$"},
            }
            for name, (kind, regex) in route.parameters.items()
        ]
    for method in route.methods:
        item[method] = _operation(route, method, body, refs)
    return item


def _operation(route: Route, method: str, body: Body, refs: dict[type[BaseModel], dict[str, Any]]) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "operationId": re.sub(r"\W+", "_", f"{method}{route.path}").strip("_") or method,
        "tags": [_family(route.path)],
        "responses": {
            "200": _success(route, body),
            "default": {
                "description": "An error, in the route family's shape (spec §4).",
                "content": {JSON: {"schema": refs[_error_model(route.path)]}},
            },
        },
    }
    description = _description(route)
    if description:
        operation["description"] = description
    if route.path in OPEN_PATHS:
        operation["security"] = []
    if method in BODY_METHODS and (body.model is not None or method != "delete"):
        schema = refs[body.model] if body.model is not None else {"type": "object"}
        operation["requestBody"] = {
            "required": method != "delete",
            "content": {media_type: {"schema": _with_files(schema, body, media_type)} for media_type in body.reads},
        }
    return operation


def _with_files(schema: dict[str, Any], body: Body, media_type: str) -> dict[str, Any]:
    if media_type != MULTIPART or not body.files:
        return schema
    upload = {"type": "string", "contentMediaType": "application/octet-stream"}
    parts = {"type": "object", "properties": {name: upload for name in body.files}, "required": list(body.files)}
    return {"allOf": [schema, parts]}


def _success(route: Route, body: Body) -> dict[str, Any]:
    answers = PAGES.get(route.path, body.answers)
    content: dict[str, Any] = {}
    for media_type in answers:
        if media_type == JSON:
            content[media_type] = {"schema": {"type": "object"}}
        else:
            content[media_type] = {"schema": {"type": "string", "format": "binary"}}
    return {"description": body.streams or "Success.", "content": content}


def _error_model(path: str) -> type[BaseModel]:
    if path.startswith("/v1/messages"):
        return AnthropicErrorResponse
    if path.startswith("/api/") and not path.startswith("/api/v1/"):
        return OllamaErrorResponse
    return ErrorResponse


def _family(path: str) -> str:
    if path.startswith("/v1/messages"):
        return "Anthropic"
    if path.startswith(("/api/v1/", "/internal/")):
        return "Lemonade"
    if path.startswith("/api/"):
        return "Ollama"
    if path.startswith("/v1/"):
        return "Hypnos"
    return "Server"


def _description(route: Route) -> str:
    """The first paragraph of the view's docstring, when it has one."""
    doc = ((route.view_class or route.view).__doc__ or "").strip()
    return " ".join(doc.split("\n\n")[0].split())


def schema(script_name: str = "") -> dict[str, Any]:
    """The OpenAPI document, its server the script prefix the request came through."""
    return {**_document(), "servers": [{"url": script_name or "/"}]}


class OpenApiView(APIView):
    """This document: OpenAPI 3.1, generated from the server's URL table and protocol models.
    Open like /health, whatever keys are configured."""

    authentication_classes: list[type[BaseAuthentication]] = []
    permission_classes = [AllowAny]

    async def get(self, request: Request) -> JsonResponse:
        # Off the event loop: the first call builds the document (a quarter of a second).
        return JsonResponse(await asyncio.to_thread(schema, request.META.get("SCRIPT_NAME", "")))


async def docs_view(request: HttpRequest) -> HttpResponse:
    return render(request, "docs/index.html")
