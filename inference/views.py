"""Thin `/v1` routes: parse the body, call one serving function, return JSON or a stream."""

from __future__ import annotations

import time

from adrf.views import APIView
from django.http import HttpRequest, JsonResponse
from rest_framework.request import Request

from hypnos_site import __version__
from inference.client import get_client
from inference.errors import NotFound
from inference import latency
from inference.errors import InvalidRequest
from inference.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InternalSetRequest,
    KvParkRequest,
    MemoryTierRequest,
    ResponsesRequest,
    parse_body,
)
from inference.serving import chat, completions, lemonade, models, responses
from inference.serving.context import RequestContext
from models_registry.authentication import IsAdminKey

STARTED_AT = time.time()


class ChatCompletionsView(APIView):
    async def post(self, request: Request) -> object:
        body = parse_body(ChatCompletionRequest, request.data)
        return await chat.create_chat_completion(get_client(), body, RequestContext.of(request._request))


class ModelListView(APIView):
    async def get(self, request: Request) -> JsonResponse:
        return JsonResponse(await models.list_models(get_client()))

    async def head(self, request: Request) -> JsonResponse:
        return JsonResponse(await models.list_models(get_client()))


class ModelCatalogView(APIView):
    async def get(self, request: Request) -> JsonResponse:
        return JsonResponse(models.catalog(request.query_params.get("modality")))


class ModelView(APIView):
    async def get(self, request: Request, model_id: str) -> JsonResponse:
        return JsonResponse(await models.get_model(get_client(), model_id))


class ModelFilesView(APIView):
    async def get(self, request: Request, model_id: str) -> JsonResponse:
        return JsonResponse(models.model_files(model_id))


class ModelEnableView(APIView):
    """POST /v1/models/{id}/enable and /disable (spec §6)."""

    enable = True

    async def post(self, request: Request, model_id: str) -> JsonResponse:
        return JsonResponse(await models.set_enabled(get_client(), model_id, self.enable))


class MemoryStatusView(APIView):
    async def get(self, request: Request) -> JsonResponse:
        status = await get_client().control("memory_status")
        status["latency"] = {"routes": latency.routes.summary(), "workflows": latency.workflows.summary()}
        return JsonResponse(status)


class MemoryTierView(APIView):
    async def post(self, request: Request) -> JsonResponse:
        body = parse_body(MemoryTierRequest, request.data)
        return JsonResponse(await get_client().control("move", body.model_dump()))


class CompletionsView(APIView):
    async def post(self, request: Request) -> object:
        body = parse_body(CompletionRequest, request.data)
        return await completions.create_completion(get_client(), body, RequestContext.of(request._request))


class ResponsesView(APIView):
    async def post(self, request: Request) -> object:
        body = parse_body(ResponsesRequest, request.data)
        return await responses.create_response(get_client(), body, RequestContext.of(request._request))


class LemonadeHealthView(APIView):
    async def get(self, request: Request) -> JsonResponse:
        return JsonResponse(await lemonade.health(get_client()))


class LemonadeLoadView(APIView):
    async def post(self, request: Request) -> JsonResponse:
        return JsonResponse(await lemonade.load(get_client(), _object(request.data)))


class LemonadeUnloadView(APIView):
    async def post(self, request: Request) -> JsonResponse:
        return JsonResponse(await lemonade.unload(get_client(), _object(request.data)))


class LemonadeStatsView(APIView):
    async def get(self, request: Request) -> JsonResponse:
        return JsonResponse(lemonade.stats())


class InternalSetView(APIView):
    """Lemonade's POST /internal/set: caps the models tier 1 may hold (admin keys only)."""

    permission_classes = [IsAdminKey]

    async def post(self, request: Request) -> JsonResponse:
        body = parse_body(InternalSetRequest, _object(request.data))
        return JsonResponse(await get_client().control("set_limits", body.model_dump()))


def _object(data: object) -> dict:
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return data


class KvParkView(APIView):
    async def get(self, request: Request) -> JsonResponse:
        return JsonResponse(await get_client().control("kv_park", {}))

    async def post(self, request: Request) -> JsonResponse:
        body = parse_body(KvParkRequest, request.data)
        if body.enabled is None and body.max_bytes is None:
            raise InvalidRequest("Send enabled, max_bytes or both.")
        return JsonResponse(await get_client().control("kv_park", body.model_dump()))


class UnknownRouteView(APIView):
    """Any other /v1 path: an OpenAI-shaped 404, never HTML."""

    def _not_found(self, request: Request, *args: object, **kwargs: object) -> None:
        raise NotFound(f"Unknown route {request.method} {request.path}.")

    get = post = put = patch = delete = _not_found


async def health(request: HttpRequest) -> JsonResponse:
    return JsonResponse(
        {"status": "ok", "service": "hypnos", "version": __version__, "uptime_secs": int(time.time() - STARTED_AT)}
    )


async def ready(request: HttpRequest) -> JsonResponse:
    status = await get_client().status()
    if status is None:
        return JsonResponse({"ready": False, "reason": "no inference worker is answering"}, status=503)
    if not status["ready"]:
        return JsonResponse({"ready": False, "reason": "startup tier initialization in progress"}, status=503)
    return JsonResponse({"ready": True})


def handler404(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return NotFound(f"Unknown route {request.method} {request.path}.").response()


def handler500(request: HttpRequest) -> JsonResponse:
    from inference.errors import ServerError

    return ServerError("internal error").response()

