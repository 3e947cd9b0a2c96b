"""/v1/logs* (spec §15): read, clear and set the level of the request log. These routes are not
inference calls, so polling them is never logged itself."""

from __future__ import annotations

from adrf.views import APIView
from django.http import JsonResponse
from rest_framework.request import Request

from inference.errors import InvalidRequest, NotFound
from logs.models import RequestLogEntry
from logs.store import LogQuery, capacity, levels


class RequestLogView(APIView):
    async def get(self, request: Request) -> JsonResponse:
        query = LogQuery.from_params(request.query_params)
        records = [entry.as_record() async for entry in query.apply(RequestLogEntry.objects.all())]
        return JsonResponse({"level": await levels.get(), "capacity": capacity(),
                             "stored": await RequestLogEntry.objects.acount(), "records": records})

    async def delete(self, request: Request) -> JsonResponse:
        await RequestLogEntry.objects.all().adelete()
        return JsonResponse({"cleared": True})


class RequestLogRecordView(APIView):
    async def get(self, request: Request, request_id: str) -> JsonResponse:
        entry = await RequestLogEntry.objects.filter(request_id=request_id).afirst()
        if entry is None:
            raise NotFound(f"No request log record has the id {request_id!r}; it may have left the ring buffer.")
        return JsonResponse(entry.as_record())


class RequestLogLevelView(APIView):
    async def post(self, request: Request) -> JsonResponse:
        level = request.data.get("level") if isinstance(request.data, dict) else None
        if not isinstance(level, str):
            raise InvalidRequest("The body must be {\"level\": \"off|error|warn|info|debug|trace\"}.", param="level")
        await levels.set(level)
        return JsonResponse({"level": level})
