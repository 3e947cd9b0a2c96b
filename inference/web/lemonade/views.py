"""The views of Lemonade's lifecycle routes (urls.py)."""

from __future__ import annotations

from django.http import HttpResponseBase, JsonResponse
from rest_framework.request import Request

from inference.transport.runtime import get_client
from inference.web.common.protocol import body_object, parse_body
from inference.web.lemonade import serving as lemonade
from inference.web.lemonade.protocol import LemonadeLoadRequest, LemonadePullRequest
from models_registry.api_view import APIView
from models_registry.authentication import IsAdminKey, is_admin


class LemonadeHealthView(APIView):
    async def get(self, request: Request) -> JsonResponse:
        return JsonResponse(await lemonade.health(get_client(), admin=is_admin(request.auth)))


class LemonadeLoadView(APIView):
    permission_classes = [IsAdminKey]

    async def post(self, request: Request) -> JsonResponse:
        return JsonResponse(await lemonade.load(get_client(), parse_body(LemonadeLoadRequest, request.data)))


class LemonadeUnloadView(APIView):
    permission_classes = [IsAdminKey]

    async def post(self, request: Request) -> JsonResponse:
        return JsonResponse(await lemonade.unload(get_client(), body_object(request.data)))


class LemonadePullView(APIView):
    """Writes models_dir and changes the pool: admin keys only, as POST /v1/models."""

    permission_classes = [IsAdminKey]

    async def post(self, request: Request) -> HttpResponseBase:
        return await lemonade.pull(get_client(), parse_body(LemonadePullRequest, request.data))


class LemonadeDeleteView(APIView):
    """Changes the pool and removes files: admin keys only, as DELETE /v1/models/{id}."""

    permission_classes = [IsAdminKey]

    async def post(self, request: Request) -> JsonResponse:
        return JsonResponse(await lemonade.delete(get_client(), body_object(request.data)))


class LemonadeStatsView(APIView):
    async def get(self, request: Request) -> JsonResponse:
        return JsonResponse(lemonade.stats())
