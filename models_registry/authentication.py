"""Bearer-key authentication (spec §2): keys from the config, the environment and the database."""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass

from django.conf import settings
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import BasePermission

from models_registry.models import ApiKey, hash_key

MISSING = "Missing API key. Send it as `Authorization: Bearer <key>` (server.api_keys)."
UNKNOWN = "Invalid API key. Check the key you sent in `Authorization: Bearer <key>`."
DB_KEYS_TTL_SECS = 2.0


@dataclass(frozen=True)
class ApiPrincipal:
    label: str
    admin: bool
    requests_per_minute: int | None = None
    max_concurrent: int | None = None
    tokens_per_day: int | None = None


def _config_principals() -> list[tuple[str, ApiPrincipal]]:
    server = settings.HYPNOS.server
    found = [
        (key, ApiPrincipal(label="key-" + hashlib.sha256(key.encode()).hexdigest()[:8], admin=True))
        for key in server.api_keys
    ]
    for entry in server.keys:
        label = entry.label or "key-" + hashlib.sha256(entry.key.encode()).hexdigest()[:8]
        found.append(
            (
                entry.key,
                ApiPrincipal(
                    label=label,
                    admin=entry.admin,
                    requests_per_minute=entry.requests_per_minute,
                    max_concurrent=entry.max_concurrent,
                    tokens_per_day=entry.tokens_per_day,
                ),
            )
        )
    return found


class _DbKeyPresence:
    """Whether the database holds any active key, re-read at most every few seconds."""

    def __init__(self) -> None:
        self._checked_at = float("-inf")
        self._present = False

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self._checked_at > DB_KEYS_TTL_SECS:
            self._present = ApiKey.objects.filter(active=True).exists()
            self._checked_at = now
        return self._present

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


def principal_for(key: str) -> ApiPrincipal | None:
    match = None
    for configured, principal in _config_principals():
        # Compare every configured key, so the time taken does not tell which one was close.
        if hmac.compare_digest(configured.encode(), key.encode()):
            match = principal
    if match:
        return match
    record = ApiKey.objects.filter(key_hash=hash_key(key), active=True).first()
    if record is None:
        return None
    return ApiPrincipal(
        label=record.label,
        admin=record.admin,
        requests_per_minute=record.requests_per_minute,
        max_concurrent=record.max_concurrent,
        tokens_per_day=record.tokens_per_day,
    )


class ApiKeyAuthentication(BaseAuthentication):
    def authenticate(self, request):  # type: ignore[no-untyped-def]
        if not keys_required():
            return None
        token = bearer_token(request.META.get("HTTP_AUTHORIZATION", ""))
        if token is None:
            raise exceptions.NotAuthenticated(MISSING)
        principal = principal_for(token)
        if principal is None:
            raise exceptions.AuthenticationFailed(UNKNOWN)
        return principal, principal

    def authenticate_header(self, request) -> str:  # type: ignore[no-untyped-def]
        return 'Bearer realm="hypnos"'


class HasApiKeyWhenRequired(BasePermission):
    """Authentication already refused bad keys; nothing more to check for ordinary routes."""

    def has_permission(self, request, view) -> bool:  # type: ignore[no-untyped-def]
        return True


class IsAdminKey(BasePermission):
    """Changing the model pool needs an admin key when keys are configured (spec §2)."""

    message = "This route changes the model pool and needs an admin key."

    def has_permission(self, request, view) -> bool:  # type: ignore[no-untyped-def]
        return request.auth is None or bool(request.auth.admin)
