"""GET/POST /v1/keys and DELETE /v1/keys/{label or id}: the API keys over HTTP, for `hypnos keys`
(issue 17), admin keys only. The database's keys are made and revoked here (as
`manage.py createapikey` and the admin make them: the key is shown once, at creation, and only
its SHA-256 is stored); the config's keys (server.api_keys, [[server.keys]], HYPNOS_API_KEYS)
are listed, never shown, and changed only in the config. A revoked key stays listed, inactive,
so that its label still names it in the request log."""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.db import IntegrityError, transaction
from django.http import JsonResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from rest_framework.request import Request

from hypnos_site.errors import HypnosError, InvalidRequest, NotFound
from models_registry.api_view import APIView
from models_registry.authentication import IsAdminKey, _config_principals, db_keys_present, keys_required
from models_registry.models import ApiKey

FIRST_KEY = (
    "This is the server's first API key: from now on every /v1 request needs a key, and only "
    "admin keys change the server."
)


class LabelTaken(HypnosError):
    status = 409
    type = "invalid_request_error"
    code = "label_taken"


class ApiKeyCreateRequest(BaseModel):
    # A wrong JSON type is a 400, not a coercion; unknown fields are ignored (spec §1).
    model_config = ConfigDict(extra="ignore", strict=True)

    label: str = Field(min_length=1, max_length=100)
    admin: bool = False
    requests_per_minute: int | None = Field(default=None, ge=1)
    max_concurrent: int | None = Field(default=None, ge=1)
    tokens_per_day: int | None = Field(default=None, ge=1)
    # Model ids or aliases the key may use; empty = every model.
    models: list[str] = []


def _parse(data: object) -> ApiKeyCreateRequest:
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        return ApiKeyCreateRequest.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise InvalidRequest(f"Invalid value for {param or 'the body'}: {err['msg']}", param=param) from exc


def listed_keys() -> list[dict[str, object]]:
    """The config's keys (labels and rights, never the keys), then the database's."""
    found: list[dict[str, object]] = [
        {
            "id": None,
            "label": principal.label,
            "key_prefix": None,
            "admin": principal.admin,
            "active": True,
            "requests_per_minute": principal.requests_per_minute,
            "max_concurrent": principal.max_concurrent,
            "tokens_per_day": principal.tokens_per_day,
            "models": list(principal.models),
            "created": None,
            "source": "config",
        }
        for _key, principal in _config_principals()
    ]
    return found + [record.as_record() for record in ApiKey.objects.all()]


def do_create_key(body: ApiKeyCreateRequest) -> dict[str, object]:
    """A new database key: its record with the key in clear, the only time it is."""
    was_open = not keys_required()
    if was_open and not body.admin:
        # Once a key exists every call needs one: a first key that is not an admin key would
        # leave nobody able to change the server (or make the next key) over HTTP.
        raise InvalidRequest(
            "This server has no API key yet: the first one must be an admin key (admin: true).", param="admin"
        )
    if body.label in {principal.label for _key, principal in _config_principals()}:
        raise LabelTaken(f"The label {body.label!r} names a key of the config file; choose another.", param="label")
    try:
        with transaction.atomic():
            record, key = ApiKey.create_key(
                body.label,
                admin=body.admin,
                requests_per_minute=body.requests_per_minute,
                max_concurrent=body.max_concurrent,
                tokens_per_day=body.tokens_per_day,
                allowed_models=",".join(body.models),
            )
    except IntegrityError as exc:
        raise LabelTaken(
            f"A key labelled {body.label!r} exists already (a revoked key keeps its label).", param="label"
        ) from exc
    db_keys_present.invalidate()
    created = {**record.as_record(), "key": key}
    return {**created, "warning": FIRST_KEY} if was_open else created


def do_revoke_key(name: str) -> dict[str, object]:
    """Deactivate the database key labelled `name` (or whose id it is): 401 from its next call."""
    record = ApiKey.objects.filter(label=name).first()
    if record is None and name.isdigit():
        record = ApiKey.objects.filter(pk=int(name)).first()
    if record is None:
        if name in {principal.label for _key, principal in _config_principals()}:
            raise InvalidRequest(
                f"The key {name!r} comes from the config file (server.api_keys or [[server.keys]]); remove it there.",
                param="key",
            )
        raise NotFound(f"No API key is labelled {name!r} (GET /v1/keys lists them).")
    record.active = False
    record.save(update_fields=["active"])
    db_keys_present.invalidate()
    return record.as_record()


class KeyListView(APIView):
    permission_classes = [IsAdminKey]

    async def get(self, request: Request) -> JsonResponse:
        return JsonResponse({"object": "list", "data": await sync_to_async(listed_keys)()})

    async def post(self, request: Request) -> JsonResponse:
        return JsonResponse(await sync_to_async(do_create_key)(_parse(request.data)), status=201)


class KeyView(APIView):
    permission_classes = [IsAdminKey]

    async def delete(self, request: Request, key: str) -> JsonResponse:
        return JsonResponse(await sync_to_async(do_revoke_key)(key))
