"""Thin routes of the Ollama API (issue 17): parse the body, call one serving function, return
JSON or NDJSON. Every error, the parser's and the key check's included, answers in Ollama's
shape (`{"error": "<message>"}` with the status) through render.ollama_error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.request import Request

from hypnos_site import __version__
from hypnos_site.errors import MethodNotAllowed, NotFound, as_hypnos_error
from inference.transport.runtime import get_client
from inference.web.common.context import RequestContext
from inference.web.common.protocol import parse_body
from inference.web.common.render import ollama_error
from inference.web.ollama import serving as ollama
from inference.web.ollama import serving_models as ollama_models
from inference.web.ollama import serving_pull
from inference.web.ollama.protocol import (
    ChatRequest,
    DeleteRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    PullRequest,
    ShowRequest,
)
from models_registry.api_view import APIView
from models_registry.authentication import IsAdminKey, is_admin

# The Ollama release whose API these routes follow; clients gate features on it (structured
# outputs, tools, think).
OLLAMA_VERSION = "0.12.6"
F = TypeVar("F", bound=Callable[..., Any])


class OllamaView(APIView):
    # The request log's middleware answers a key's refusals (403, 429) in the route's own
    # shape when its view names one.
    error_response = staticmethod(ollama_error)

    def handle_exception(self, exc: Exception) -> HttpResponseBase:
        request = getattr(self, "request", None)
        record = getattr(getattr(request, "_request", None), "hypnos_call", None)
        return ollama_error(as_hypnos_error(exc, self), record)


def _context(request: Request) -> RequestContext:
    return RequestContext.of(request._request)


class TagsView(OllamaView):
    async def get(self, request: Request) -> JsonResponse:
        return JsonResponse(await ollama_models.list_tags(get_client()))


class PsView(OllamaView):
    async def get(self, request: Request) -> JsonResponse:
        return JsonResponse(await ollama_models.list_running(get_client()))


class ShowView(OllamaView):
    async def post(self, request: Request) -> JsonResponse:
        body = parse_body(ShowRequest, request.data)
        return JsonResponse(await ollama_models.show(get_client(), body.model, admin=is_admin(request.auth)))


class ChatView(OllamaView):
    async def post(self, request: Request) -> HttpResponseBase:
        body = parse_body(ChatRequest, request.data)
        return await ollama.create_chat(get_client(), body, _context(request), admin=is_admin(request.auth))


class GenerateView(OllamaView):
    async def post(self, request: Request) -> HttpResponseBase:
        body = parse_body(GenerateRequest, request.data)
        return await ollama.create_generate(get_client(), body, _context(request), admin=is_admin(request.auth))


class EmbedView(OllamaView):
    async def post(self, request: Request) -> JsonResponse:
        body = parse_body(EmbedRequest, request.data)
        return await ollama.create_embed(get_client(), body, _context(request), admin=is_admin(request.auth))


class EmbeddingsView(OllamaView):
    async def post(self, request: Request) -> JsonResponse:
        body = parse_body(EmbeddingsRequest, request.data)
        return await ollama.create_embeddings(get_client(), body, _context(request), admin=is_admin(request.auth))


class PullView(OllamaView):
    """Writes models_dir and changes the pool: admin keys only, as POST /v1/models."""

    permission_classes = [IsAdminKey]

    async def post(self, request: Request) -> HttpResponseBase:
        return await serving_pull.pull(get_client(), parse_body(PullRequest, request.data))


class DeleteView(OllamaView):
    """Changes the pool and removes files: admin keys only, as DELETE /v1/models/{id}."""

    permission_classes = [IsAdminKey]

    async def delete(self, request: Request) -> HttpResponseBase:
        return await serving_pull.delete(get_client(), parse_body(DeleteRequest, request.data))


class UnknownView(OllamaView):
    """Any other /api path (create, copy, push, blobs...): Ollama's 404 shape, never HTML."""

    def _not_found(self, request: Request, *args: Any, **kwargs: Any) -> None:
        raise NotFound(f"{request.method} {request.path} is not served here.")

    get = post = put = patch = delete = head = _not_found


def _ollama_shaped(view: F) -> F:
    """A function view whose middleware refusals (a foreign Origin's 403) are in Ollama's shape,
    as OllamaView's are (hypnos_site.errors.refusal reads the attribute)."""
    view.error_response = ollama_error  # type: ignore[attr-defined]
    return view


# Not DRF views, so Django's CSRF check would answer another method with its HTML 403.
@_ollama_shaped
@csrf_exempt
async def version(request: HttpRequest) -> HttpResponseBase:
    """GET /api/version, open like /health: what clients probe before anything else."""
    if request.method not in ("GET", "HEAD"):
        return ollama_error(MethodNotAllowed(f'Method "{request.method}" not allowed.'))
    return JsonResponse({"version": OLLAMA_VERSION, "hypnos_version": __version__})


@_ollama_shaped
@csrf_exempt
async def root(request: HttpRequest) -> HttpResponseBase:
    """HEAD / and GET /: Ollama's liveness answer (the web playground takes GET / later)."""
    if request.method not in ("GET", "HEAD"):
        return ollama_error(MethodNotAllowed(f'Method "{request.method}" not allowed.'))
    return HttpResponse(
        b"" if request.method == "HEAD" else b"Ollama is running", content_type="text/plain; charset=utf-8"
    )
