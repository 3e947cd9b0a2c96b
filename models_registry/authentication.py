"""Bearer-key authentication (spec §2): keys from the config, the environment and the database.

`check_authorization` is the one place a header becomes a principal. The accounting middleware
(logs.middleware) calls it before the view, to apply the key's limits, and leaves the result on
the request; DRF's `ApiKeyAuthentication` then reuses it instead of asking the database again.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import SAFE_METHODS, BasePermission

from hypnos_site.errors import DATABASE_ERRORS
from models_registry.live_pool import pool
from models_registry.models import ApiKey, hash_key, split_models

MISSING = "Missing API key. Send it as `Authorization: Bearer <key>` (server.api_keys)."
UNKNOWN = "Invalid API key. Check the key you sent in `Authorization: Bearer <key>`."
DB_KEYS_TTL_SECS = 2.0


@dataclass(frozen=True)
class ApiPrincipal:
    """Who is calling: the key's label (never the key), its rights and its limits."""

    label: str
    admin: bool
    requests_per_minute: int | None = None
    max_concurrent: int | None = None
    tokens_per_day: int | None = None
    # Model ids or aliases the key may use; empty = every model.
    models: tuple[str, ...] = ()

    @property
    def limited(self) -> bool:
        return bool(self.requests_per_minute or self.max_concurrent or self.tokens_per_day)

    def may_use(self, model: str) -> bool:
        """Whether the key may call `model` (an id or an alias, matched through the pool)."""
        if not self.models:
            return True
        return bool(_model_names(model) & set().union(*(_model_names(m) for m in self.models)))


def _model_names(name: str) -> set[str]:
    """`name` with the id and aliases of the pool's model it names, if any."""
    return pool.names(name)


def default_label(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def _config_principals() -> list[tuple[str, ApiPrincipal]]:
    server = settings.HYPNOS.server
    found = [(key, ApiPrincipal(label=default_label(key), admin=True)) for key in server.api_keys]
    for entry in server.keys:
        found.append(
            (
                entry.key,
                ApiPrincipal(
                    label=entry.label or default_label(entry.key),
                    admin=entry.admin,
                    requests_per_minute=entry.requests_per_minute,
                    max_concurrent=entry.max_concurrent,
                    tokens_per_day=entry.tokens_per_day,
                    models=tuple(entry.models),
                ),
            )
        )
    return found


class _DbKeyPresence:
    """Whether the database holds any active key, re-read at most every few seconds."""

    def __init__(self) -> None:
        self._checked_at = float("-inf")
        self._present = False
        self._read = False

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self._checked_at > DB_KEYS_TTL_SECS:
            try:
                self._present = ApiKey.objects.filter(active=True).exists()
            except DATABASE_ERRORS:
                # The database is down. It held no key at its last look: a server without keys
                # stays open, as its requests need no key lookup (every call was a 503 in the
                # distributed deployment). Else the key's own lookup answers the 503.
                if self._read and not self._present:
                    return False
                raise
            self._checked_at, self._read = now, True
        return self._present

    def known(self) -> bool | None:
        """What the last read found while it is fresh, else None (no database access)."""
        return self._present if time.monotonic() - self._checked_at <= DB_KEYS_TTL_SECS else None

    def invalidate(self) -> None:
        self._checked_at = float("-inf")


db_keys_present = _DbKeyPresence()


def keys_required() -> bool:
    server = settings.HYPNOS.server
    return bool(server.api_keys or server.keys) or db_keys_present()


def bearer_token(header: str) -> str | None:
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _config_principal(key: str) -> ApiPrincipal | None:
    match = None
    for configured, principal in _config_principals():
        # Compare every configured key, so the time taken does not tell which one was close.
        if hmac.compare_digest(configured.encode(), key.encode()):
            match = principal
    return match


def principal_for(key: str) -> ApiPrincipal | None:
    match = _config_principal(key)
    if match:
        return match
    record = ApiKey.objects.filter(key_hash=hash_key(key), active=True).first()
    return _record_principal(record) if record is not None else None


def _record_principal(record: ApiKey) -> ApiPrincipal:
    """A database key's principal: its label, rights and limits."""
    return ApiPrincipal(
        label=record.label,
        admin=record.admin,
        requests_per_minute=record.requests_per_minute,
        max_concurrent=record.max_concurrent,
        tokens_per_day=record.tokens_per_day,
        models=split_models(record.allowed_models),
    )


@dataclass(frozen=True)
class KeyCheck:
    """The outcome of one Authorization header: whether keys are required at all, and the
    principal, or the 401 message when there is none."""

    required: bool
    principal: ApiPrincipal | None = None
    problem: str | None = None

    @property
    def refused(self) -> bool:
        return self.required and self.principal is None


def check_authorization(header: str) -> KeyCheck:
    """Resolve an Authorization header (reads the database: call it from a sync context)."""
    return _key_check(header, keys_required(), principal_for) or KeyCheck(required=True, problem=UNKNOWN)


def check_without_database(header: str) -> KeyCheck | None:
    """check_authorization's answer when it needs no database read (no key anywhere, a missing
    key, a configured key), else None: the caller runs check_authorization on a thread. Safe on
    the event loop; this is what keeps a thread hop off most requests."""
    in_database = db_keys_present.known()
    if in_database is None:
        return None
    server = settings.HYPNOS.server
    return _key_check(header, bool(server.api_keys or server.keys or in_database), _config_principal)


def _key_check(header: str, required: bool, find: Callable[[str], ApiPrincipal | None]) -> KeyCheck | None:
    """The header's KeyCheck, `find` resolving its token to a principal; None when `find` knows
    no such key."""
    if not required:
        return KeyCheck(required=False)
    token = bearer_token(header)
    if token is None:
        return KeyCheck(required=True, problem=MISSING)
    principal = find(token)
    return KeyCheck(required=True, principal=principal) if principal else None


def check_for_label(label: str | None) -> KeyCheck:
    """The KeyCheck of the key labelled `label` as it stands now (work a key left to run later,
    a batch's lines): its current rights and limits, or a 401's reason when it is gone or
    revoked. `None` is the open API's caller. Reads the database: call it from a sync context."""
    if not keys_required():
        return KeyCheck(required=False)
    gone = KeyCheck(required=True, problem="The key that created this work is no longer active.")
    if label is None:
        return gone
    for _, principal in _config_principals():
        if principal.label == label:
            return KeyCheck(required=True, principal=principal)
    record = ApiKey.objects.filter(label=label, active=True).first()
    if record is None:
        return gone
    return KeyCheck(required=True, principal=_record_principal(record))


def authorization_header(request: HttpRequest) -> str:
    """The request's key as an Authorization header: `Authorization`, else Anthropic's `x-api-key`."""
    header = request.META.get("HTTP_AUTHORIZATION", "")
    if not header and request.META.get("HTTP_X_API_KEY"):
        header = f"Bearer {request.META['HTTP_X_API_KEY']}"
    return header


async def arequest_key_check(request: HttpRequest) -> KeyCheck:
    """request_key_check from the event loop: on it when no database read is needed, else on a
    thread (sync_to_async)."""
    check = getattr(request, "hypnos_key_check", None) or check_without_database(authorization_header(request))
    if check is None:
        return await sync_to_async(request_key_check)(request)
    request.hypnos_key_check = check  # type: ignore[attr-defined]
    return check


def request_key_check(request: HttpRequest) -> KeyCheck:
    """The request's KeyCheck, computed once per request (sync context)."""
    check = getattr(request, "hypnos_key_check", None)
    if check is None:
        check = check_authorization(authorization_header(request))
        request.hypnos_key_check = check  # type: ignore[attr-defined]
    return check


class ApiKeyAuthentication(BaseAuthentication):
    def authenticate(self, request):  # type: ignore[no-untyped-def]
        check = request_key_check(request._request)
        if not check.required:
            return None
        if check.principal is None:
            if check.problem == MISSING:
                raise exceptions.NotAuthenticated(MISSING)
            raise exceptions.AuthenticationFailed(check.problem)
        return check.principal, check.principal

    def authenticate_header(self, request) -> str:  # type: ignore[no-untyped-def]
        return 'Bearer realm="hypnos"'


class HasApiKeyWhenRequired(BasePermission):
    """Authentication already refused bad keys; nothing more to check for ordinary routes."""

    def has_permission(self, request, view) -> bool:  # type: ignore[no-untyped-def]
        return True


def is_admin(principal: object) -> bool:
    """Whether the caller may change the server and see what only its operator should (other
    keys' records and labels, absolute paths). `None` is the open API (no key configured)."""
    return principal is None or (isinstance(principal, ApiPrincipal) and principal.admin)


ADMIN_ONLY = (
    "This route changes the server's state and needs an admin key: a server.api_keys entry, or a "
    "[[server.keys]] entry with admin = true."
)


class IsAdminKey(BasePermission):
    """Every route that changes the server's state (the pool, tiers, KV parking, MoE offload,
    enable/disable, options, the request log's level and contents, Lemonade's load/unload and
    /internal/set) needs an admin key when keys are configured (spec §2); with no key
    configured anywhere the API is open."""

    message = ADMIN_ONLY

    def has_permission(self, request, view) -> bool:  # type: ignore[no-untyped-def]
        if is_admin(request.auth):
            return True
        self.message = f"{ADMIN_ONLY} The key {request.auth.label!r} is not one."
        return False


class IsAdminKeyForChanges(IsAdminKey):
    """Reading is open to every key; POST, PUT, PATCH and DELETE change state (admin keys only)."""

    def has_permission(self, request, view) -> bool:  # type: ignore[no-untyped-def]
        return request.method in SAFE_METHODS or super().has_permission(request, view)
