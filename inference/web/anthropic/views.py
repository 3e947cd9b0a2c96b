"""Thin routes of Anthropic's Messages API (issue 17): every error, DRF's own included (a bad
key's 401, a body that does not parse, a wrong method), in Anthropic's envelope."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.http import JsonResponse
from rest_framework.request import Request

from hypnos_site.errors import as_hypnos_error
from inference.transport.runtime import get_client
from inference.web.anthropic import serving as anthropic
from inference.web.anthropic.protocol import MessageCountTokensParams, MessageCreateParams
from inference.web.common.context import RequestContext
from inference.web.common.protocol import parse_body
from inference.web.common.render import anthropic_error
from models_registry.api_view import APIView


def anthropic_exception_handler(exc: Exception, context: dict[str, Any]) -> JsonResponse:
    """The views' EXCEPTION_HANDLER: the typed error in Anthropic's envelope, noted in the call's record."""
    request = context.get("request")
    record = getattr(getattr(request, "_request", None), "hypnos_call", None)
    return anthropic_error(as_hypnos_error(exc, context.get("view")), record)


class AnthropicView(APIView):
    # The request log's middleware answers a key's refusals (403, 429) in the route's own
    # shape when its view names one.
    error_response = staticmethod(anthropic_error)

    def get_exception_handler(self) -> Callable[[Exception, dict[str, Any]], JsonResponse]:
        return anthropic_exception_handler

    def perform_content_negotiation(self, request: Request, force: bool = False) -> Any:
        # JSON or an event stream whatever Accept asks (some clients ask for text/event-stream).
        return super().perform_content_negotiation(request, force=True)


class MessagesView(AnthropicView):
    async def post(self, request: Request) -> object:
        body = parse_body(MessageCreateParams, request.data)
        return await anthropic.create_message(get_client(), body, RequestContext.of(request._request))


class CountTokensView(AnthropicView):
    async def post(self, request: Request) -> object:
        body = parse_body(MessageCountTokensParams, request.data)
        return await anthropic.count_tokens(get_client(), body, RequestContext.of(request._request))
