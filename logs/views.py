"""/v1/logs* (spec §15): read, clear and set the level of the request log. These routes are not
inference calls, so polling them is never logged itself.

The records hold other callers' prompts and answers, so a key that is not an admin key reads
only the records of its own label, and only admin keys clear the log or change its level (with
no key configured the API is open, as everywhere).

/v1/documents/{id}/pictures* and DELETE /v1/documents/{id} (spec §12) serve the picture store
(logs.pictures) the same way: a key sees the documents it converted, admin keys see all. Neither
kind of route needs the inference worker, so both answer during startup staging.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from asgiref.sync import sync_to_async
from django.db.models import QuerySet
from django.http import HttpResponse, JsonResponse
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request

from hypnos_site.errors import InvalidRequest, NotFound
from logs import pictures
from logs.models import RequestLogEntry
from logs.store import LogQuery, capacity, levels, settled
from models_registry.api_view import APIView
from models_registry.authentication import ApiPrincipal, IsAdminKey, IsAdminKeyForChanges, is_admin


def visible_entries(request: Request) -> QuerySet[RequestLogEntry]:
    """Every record for admin keys (and the open API); the key's own records for the others."""
    if is_admin(request.auth):
        return RequestLogEntry.objects.all()
    return RequestLogEntry.objects.filter(key_label=request.auth.label)


class RequestLogView(APIView):
    permission_classes = [IsAdminKeyForChanges]

    async def get(self, request: Request) -> JsonResponse:
        query = LogQuery.from_params(request.query_params)
        await settled()
        entries = visible_entries(request)
        records = [entry.as_record() async for entry in query.apply(entries)]
        return JsonResponse(
            {"level": await levels.get(), "capacity": capacity(), "stored": await entries.acount(), "records": records}
        )

    async def delete(self, request: Request) -> JsonResponse:
        await settled()
        await RequestLogEntry.objects.all().adelete()
        return JsonResponse({"cleared": True})


class RequestLogRecordView(APIView):
    async def get(self, request: Request, request_id: str) -> JsonResponse:
        # Another key's record answers like a missing one: its id says nothing to this key.
        await settled()
        entry = await visible_entries(request).filter(request_id=request_id).afirst()
        if entry is None:
            raise NotFound(f"No request log record has the id {request_id!r}; it may have left the ring buffer.")
        return JsonResponse(entry.as_record())


class RequestLogLevelView(APIView):
    permission_classes = [IsAdminKey]

    async def post(self, request: Request) -> JsonResponse:
        level = request.data.get("level") if isinstance(request.data, dict) else None
        if not isinstance(level, str):
            raise InvalidRequest('The body must be {"level": "off|error|warn|info|debug|trace"}.', param="level")
        await levels.set(level)
        return JsonResponse({"level": level})


def principal(request: Request) -> ApiPrincipal | None:
    """The caller: ApiKeyAuthentication, the only authentication class, leaves its principal in
    request.auth, or None when no key is configured."""
    return cast(ApiPrincipal | None, request.auth)


class WrittenByTheView(DefaultContentNegotiation):
    """The document views write their answers themselves (JSON, or a picture's bytes for
    `?format=image`), so DRF has no renderer to choose. Its own choice reads `format` as its URL
    format override and raises Django's Http404 for a value no renderer has (`?format=png`),
    which left the views as a 500."""

    def select_renderer(
        self, request: Request, renderers: Iterable[BaseRenderer], format_suffix: str | None = None
    ) -> tuple[BaseRenderer, str]:
        renderer = next(iter(renderers))
        return renderer, str(renderer.media_type)


class DocumentPicturesView(APIView):
    content_negotiation_class = WrittenByTheView

    async def get(self, request: Request, document_id: str) -> JsonResponse:
        return JsonResponse(await sync_to_async(pictures.list_pictures)(document_id, principal(request)))


class DocumentPictureView(APIView):
    content_negotiation_class = WrittenByTheView

    async def get(self, request: Request, document_id: str, index: int) -> HttpResponse:
        form = request.query_params.get("format") or "json"
        if form not in ("json", "image"):
            raise InvalidRequest(
                f"format must be image (the bare image) or json (the record), not {form!r}.", param="format"
            )
        picture = await sync_to_async(pictures.find_picture)(document_id, index, principal(request))
        if form == "image":
            response = HttpResponse(await sync_to_async(pictures.read_image)(picture), content_type=picture.mime)
            response["Cache-Control"] = "private, no-store"
            return response
        return JsonResponse(await sync_to_async(pictures.picture_record)(picture, with_image=True))


class DocumentView(APIView):
    content_negotiation_class = WrittenByTheView

    async def delete(self, request: Request, document_id: str) -> JsonResponse:
        await sync_to_async(pictures.delete_document)(document_id, principal(request))
        return JsonResponse({"object": "document.deleted", "id": document_id, "deleted": True})
