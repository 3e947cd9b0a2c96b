"""Thin `/v1` routes: parse the body, call one serving function, return JSON or a stream."""

from __future__ import annotations

from typing import cast

from asgiref.sync import sync_to_async
from django.http import JsonResponse, StreamingHttpResponse
from rest_framework.parsers import BaseParser
from rest_framework.request import Request

from hypnos_site.errors import EngineTimeout, InvalidRequest
from inference.jobs.feed import dispatch
from inference.transport.runtime import get_client
from inference.web.common import catalog as models
from inference.web.common import latency, pool
from inference.web.common.context import RequestContext
from inference.web.common.parsers import JSONParser, MultiPartParser
from inference.web.common.protocol import body_object, parse_body
from inference.web.openai import serving_advisor as advisor
from inference.web.openai import serving_audio as audio
from inference.web.openai import serving_chat as chat
from inference.web.openai import serving_completions as completions
from inference.web.openai import serving_documents as documents
from inference.web.openai import serving_embeddings as embeddings
from inference.web.openai import serving_entities as entities
from inference.web.openai import serving_images as images
from inference.web.openai import serving_responses as responses
from inference.web.openai.protocol import (
    AdvisorRequest,
    BatchCreateRequest,
    ChatCompletionRequest,
    CompletionRequest,
    InternalSetRequest,
    KvParkRequest,
    MemoryTierRequest,
    MoeOffloadRequest,
    ResponsesRequest,
)
from inference.web.openai.protocol_media import EmbeddingRequest, EntityRequest, SpeechRequest
from logs import batches, files
from models_registry.api_view import APIView
from models_registry.authentication import ApiPrincipal, IsAdminKey, IsAdminKeyForChanges, is_admin


class ChatCompletionsView(APIView):
    async def post(self, request: Request) -> object:
        body = parse_body(ChatCompletionRequest, request.data)
        return await chat.create_chat_completion(get_client(), body, RequestContext.of(request._request))


class ModelListView(APIView):
    permission_classes = [IsAdminKeyForChanges]

    async def get(self, request: Request) -> JsonResponse:
        return JsonResponse(await models.list_models(get_client()))

    async def head(self, request: Request) -> JsonResponse:
        return JsonResponse(await models.list_models(get_client()))

    async def post(self, request: Request) -> JsonResponse:
        """Adds a model to the running pool (spec §6)."""
        return JsonResponse(await pool.add_model(get_client(), body_object(request.data)), status=201)


class ModelCatalogView(APIView):
    async def get(self, request: Request) -> JsonResponse:
        # Off the event loop: the catalog reads the GGUF headers of the downloaded weights.
        modality = request.query_params.get("modality")
        return JsonResponse(await sync_to_async(models.catalog)(modality, admin=is_admin(request.auth)))


class AdvisorView(APIView):
    """POST /v1/advisor (spec §6): open during startup staging, like the catalog."""

    async def post(self, request: Request) -> JsonResponse:
        return JsonResponse(advisor.advise(parse_body(AdvisorRequest, request.data)))


class ModelView(APIView):
    permission_classes = [IsAdminKeyForChanges]

    async def get(self, request: Request, model_id: str) -> JsonResponse:
        return JsonResponse(await models.get_model(get_client(), model_id))

    async def put(self, request: Request, model_id: str) -> JsonResponse:
        return JsonResponse(await pool.replace_model(get_client(), model_id, body_object(request.data)))

    async def delete(self, request: Request, model_id: str) -> JsonResponse:
        drain_secs = request.query_params.get("drain_secs", 120)
        return JsonResponse(await pool.remove_model(get_client(), model_id, drain_secs))


class ModelFilesView(APIView):
    async def get(self, request: Request, model_id: str) -> JsonResponse:
        return JsonResponse(await models.model_files(get_client(), model_id, admin=is_admin(request.auth)))


class ModelEnableView(APIView):
    """POST /v1/models/{id}/enable and /disable (spec §6)."""

    permission_classes = [IsAdminKey]

    enable = True

    async def post(self, request: Request, model_id: str) -> JsonResponse:
        return JsonResponse(await models.set_enabled(get_client(), model_id, self.enable))


class ModelMoeOffloadView(APIView):
    """POST /v1/models/{id}/moe-offload (spec §6)."""

    permission_classes = [IsAdminKey]

    async def post(self, request: Request, model_id: str) -> JsonResponse:
        body = parse_body(MoeOffloadRequest, request.data)
        return JsonResponse(await get_client().control("moe_offload", {"model": model_id, "mode": body.mode}))


class ModelOptionsView(APIView):
    """GET/POST/DELETE /v1/models/{id}/options (compat.md): reading is open, changes need an admin key."""

    permission_classes = [IsAdminKeyForChanges]

    async def get(self, request: Request, model_id: str) -> JsonResponse:
        return JsonResponse(await pool.get_options(get_client(), model_id))

    async def post(self, request: Request, model_id: str) -> JsonResponse:
        return JsonResponse(await pool.set_options(get_client(), model_id, body_object(request.data)))

    async def delete(self, request: Request, model_id: str) -> JsonResponse:
        return JsonResponse(await pool.set_options(get_client(), model_id, None))


class MemoryStatusView(APIView):
    async def get(self, request: Request) -> JsonResponse:
        status = await get_client().control("memory_status")
        status["latency"] = await latency.summary()
        return JsonResponse(models.hide_paths(status, is_admin(request.auth)))


class MemoryTierView(APIView):
    permission_classes = [IsAdminKey]

    async def post(self, request: Request) -> JsonResponse:
        """The move, answered when it is done; one that takes longer than
        limits.request_timeout_secs goes on in the worker and is a 202 that says where to look
        (a 504 here once meant nothing, as the model arrived in its tier a moment later)."""
        body = parse_body(MemoryTierRequest, request.data)
        try:
            return JsonResponse(await get_client().control("move", body.model_dump(exclude_none=True)))
        except EngineTimeout as exc:
            moving = {
                "model": body.model,
                "target_tier": body.target_tier,
                "status": "moving",
                "message": f"{exc.message} The move goes on; GET /v1/memory/status shows the model's "
                "current_tier when it is done.",
            }
            return JsonResponse(moving, status=202, headers={"Location": "/v1/memory/status"})


class CompletionsView(APIView):
    async def post(self, request: Request) -> object:
        body = parse_body(CompletionRequest, request.data)
        return await completions.create_completion(get_client(), body, RequestContext.of(request._request))


class ResponsesView(APIView):
    async def post(self, request: Request) -> object:
        body = parse_body(ResponsesRequest, request.data)
        return await responses.create_response(get_client(), body, RequestContext.of(request._request))


class EmbeddingsView(APIView):
    async def post(self, request: Request) -> object:
        body = parse_body(EmbeddingRequest, request.data)
        return await embeddings.create_embeddings(get_client(), body, RequestContext.of(request._request))


class ImagesView(APIView):
    """generations (JSON); edits and variations (multipart, what the OpenAI SDKs send)."""

    op = "generate"
    parser_classes: list[type[BaseParser]] = [JSONParser]

    async def post(self, request: Request) -> object:
        owner = getattr(request.auth, "label", None)
        return await images.create_images(
            get_client(), request.data, RequestContext.of(request._request), owner, self.op
        )


class ImageFormView(ImagesView):
    # No url-encoded forms: a web page may post one cross-site without a preflight.
    parser_classes: list[type[BaseParser]] = [MultiPartParser]


class ImageUpscaleView(APIView):
    parser_classes = [JSONParser]

    async def post(self, request: Request) -> object:
        owner = getattr(request.auth, "label", None)
        return await images.upscale_image(get_client(), request.data, RequestContext.of(request._request), owner)


class EntitiesView(APIView):
    async def post(self, request: Request) -> object:
        body = parse_body(EntityRequest, request.data)
        return await entities.extract_entities(get_client(), body, RequestContext.of(request._request))


class _AnyAccept:
    """Answers in the route's own media type whatever the Accept header asks (the SDKs ask for
    application/octet-stream on speech, text/plain on text transcripts)."""

    def perform_content_negotiation(self, request: Request, force: bool = False) -> object:
        return super().perform_content_negotiation(request, force=True)  # type: ignore[misc]


class AudioTranscriptionsView(_AnyAccept, APIView):
    # Multipart is what the OpenAI SDKs send; JSON with audio_bytes is accepted too (spec §9).
    # No url-encoded forms: a web page may post one cross-site without a preflight.
    parser_classes = [MultiPartParser, JSONParser]

    async def post(self, request: Request) -> object:
        body, audio_data = audio.transcription_request(request.data)
        return await audio.create_transcription(get_client(), body, audio_data, RequestContext.of(request._request))


class DocumentConvertView(_AnyAccept, APIView):
    # Multipart (the document as a part) or JSON (base64, a data: URI or a url); spec §12.
    parser_classes = [MultiPartParser, JSONParser]

    async def post(self, request: Request) -> object:
        owner = getattr(request.auth, "label", None)
        return await documents.convert_document(get_client(), request.data, RequestContext.of(request._request), owner)


class AudioSpeechView(_AnyAccept, APIView):
    async def post(self, request: Request) -> object:
        body = parse_body(SpeechRequest, request.data)
        return await audio.create_speech(get_client(), body, RequestContext.of(request._request))


class InternalSetView(APIView):
    """Lemonade's POST /internal/set: caps the models tier 1 may hold (admin keys only)."""

    permission_classes = [IsAdminKey]

    async def post(self, request: Request) -> JsonResponse:
        body = parse_body(InternalSetRequest, body_object(request.data))
        return JsonResponse(await get_client().control("set_limits", body.model_dump()))


class KvParkView(APIView):
    permission_classes = [IsAdminKeyForChanges]

    async def get(self, request: Request) -> JsonResponse:
        return JsonResponse(await get_client().control("kv_park", {}))

    async def post(self, request: Request) -> JsonResponse:
        body = parse_body(KvParkRequest, request.data)
        if body.enabled is None and body.max_bytes is None:
            raise InvalidRequest("Send enabled, max_bytes or both.")
        return JsonResponse(await get_client().control("kv_park", body.model_dump()))


def caller(request: Request) -> ApiPrincipal | None:
    """The key that calls (ApiKeyAuthentication leaves it in request.auth), or None when no key
    is configured."""
    return cast(ApiPrincipal | None, request.auth)


class FilesView(APIView):
    """GET /v1/files lists the caller's files; POST uploads one (multipart: `file`, `purpose`).
    A key sees, reads and deletes only its own files (admin keys all): logs/files.py."""

    parser_classes: list[type[BaseParser]] = [MultiPartParser]

    async def get(self, request: Request) -> JsonResponse:
        params = request.query_params
        try:
            limit = int(params.get("limit", 10_000))
        except ValueError:
            raise InvalidRequest("limit must be an integer.", param="limit") from None
        listing = await sync_to_async(files.list_files)(
            caller(request),
            purpose=params.get("purpose"),
            limit=limit,
            after=params.get("after"),
            order=params.get("order", "desc"),
        )
        return JsonResponse(listing)

    async def post(self, request: Request) -> JsonResponse:
        form = request.data
        if not isinstance(form, dict):
            raise InvalidRequest("The body must be multipart/form-data with file and purpose.")
        upload = form.get("file")
        if upload is None or not hasattr(upload, "chunks"):
            raise InvalidRequest("file is required: the file to upload, as a multipart part.", param="file")
        purpose = form.get("purpose")
        if not isinstance(purpose, str) or not purpose:
            raise InvalidRequest("purpose is required (batch or user_data).", param="purpose")
        stored = await sync_to_async(files.store_upload, thread_sensitive=False)(
            upload.chunks(),
            size=upload.size,
            filename=upload.name or "upload.jsonl",
            purpose=purpose,
            owner=getattr(request.auth, "label", None),
        )
        return JsonResponse(stored)


class FileView(APIView):
    async def get(self, request: Request, file_id: str) -> JsonResponse:
        return JsonResponse(files.file_object(await sync_to_async(files.find_file)(file_id, caller(request))))

    async def delete(self, request: Request, file_id: str) -> JsonResponse:
        return JsonResponse(await sync_to_async(files.delete_file)(file_id, caller(request)))


class FileContentView(_AnyAccept, APIView):
    """The file's bytes as they were uploaded, streamed from disk."""

    async def get(self, request: Request, file_id: str) -> StreamingHttpResponse:
        row = await sync_to_async(files.find_file)(file_id, caller(request))
        path = await sync_to_async(files.content_path)(row)
        response = StreamingHttpResponse(files.read_chunks(path), content_type="application/octet-stream")
        response["Content-Length"] = str(row.bytes)
        response["Cache-Control"] = "private, no-store"
        return response


class BatchesView(APIView):
    """GET /v1/batches lists the caller's batches; POST creates one from an uploaded input file
    (every line checked first) and hands it to the job (inference/jobs/batches.py)."""

    parser_classes: list[type[BaseParser]] = [JSONParser]

    async def get(self, request: Request) -> JsonResponse:
        try:
            limit = int(request.query_params.get("limit", 20))
        except ValueError:
            raise InvalidRequest("limit must be an integer.", param="limit") from None
        listing = await sync_to_async(batches.list_batches)(
            caller(request), limit=limit, after=request.query_params.get("after")
        )
        return JsonResponse(listing)

    async def post(self, request: Request) -> JsonResponse:
        from inference.jobs.tasks import run_batch

        body = parse_body(BatchCreateRequest, request.data)
        batch = await sync_to_async(batches.create_batch, thread_sensitive=False)(
            caller(request),
            input_file_id=body.input_file_id,
            endpoint=body.endpoint,
            completion_window=body.completion_window,
            metadata=body.metadata,
        )
        try:
            await dispatch(run_batch, batch.id)
        except Exception as exc:
            await sync_to_async(batches.fail)(batch.id, str(exc))
            raise
        return JsonResponse(batches.batch_object(batch))


class BatchView(APIView):
    async def get(self, request: Request, batch_id: str) -> JsonResponse:
        return JsonResponse(batches.batch_object(await sync_to_async(batches.find_batch)(batch_id, caller(request))))


class BatchCancelView(APIView):
    async def post(self, request: Request, batch_id: str) -> JsonResponse:
        return JsonResponse(batches.batch_object(await sync_to_async(batches.cancel_batch)(batch_id, caller(request))))
