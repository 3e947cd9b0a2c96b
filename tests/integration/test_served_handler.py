"""The ASGI application daphne serves (hypnos_site.handler.PooledASGIHandler), driven over
httpx's ASGI transport: the security middlewares' hooks and DRF's `initial` run on the event
loop, with the same headers and refusals as Django's own classes give (the rest of the suite
goes through Django's test client, which loads Django's classes)."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

import httpx
import pytest
from asgiref import sync

from hypnos_site.handler import get_asgi_application
from hypnos_site.inline_middleware import CsrfViewMiddleware, SecurityMiddleware, XFrameOptionsMiddleware
from logs.store import settled

pytestmark = pytest.mark.django_db(transaction=True)
CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


@pytest.fixture
async def served(worker) -> AsyncIterator[httpx.AsyncClient]:  # type: ignore[no-untyped-def]
    transport = httpx.ASGITransport(app=get_asgi_application())
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        yield client
    await settled()


@pytest.fixture
def hops(monkeypatch) -> Counter[str]:  # type: ignore[no-untyped-def]
    """Every sync_to_async call made while the test runs, by the function it runs."""
    seen: Counter[str] = Counter()
    call = sync.SyncToAsync.__call__

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen[getattr(self.func, "__qualname__", repr(self.func))] += 1
        return call(self, *args, **kwargs)

    monkeypatch.setattr(sync.SyncToAsync, "__call__", counted)
    return seen


def test_the_handler_loads_the_inline_subclasses_where_settings_name_djangos():
    from django.conf import settings

    assert "django.middleware.security.SecurityMiddleware" in settings.MIDDLEWARE
    # Each middleware sits inside Django's convert_exception_to_response wrapper (__wrapped__).
    chain, found = get_asgi_application()._middleware_chain, []
    while chain is not None:
        chain = getattr(chain, "__wrapped__", chain)
        found.append(type(chain))
        chain = getattr(chain, "get_response", None)
    assert {SecurityMiddleware, XFrameOptionsMiddleware, CsrfViewMiddleware} <= set(found)


async def test_a_chat_call_makes_no_thread_hop_for_middleware_key_or_drf(served, hops):
    from models_registry.authentication import db_keys_present

    assert (await served.post("/v1/chat/completions", json=CHAT)).status_code == 200
    # Whether the database holds keys is read on a thread and kept for DB_KEYS_TTL_SECS.
    await sync.sync_to_async(db_keys_present)()
    hops.clear()
    response = await served.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] is not None
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["x-frame-options"] == "DENY"
    assert response.headers["referrer-policy"] == "same-origin"
    hopped = {name for name in hops if "Middleware" in name or name in ("APIView.initial", "request_key_check")}
    assert hopped == set(), hops


async def test_a_key_only_the_database_knows_is_still_checked_and_refused(served, hops, settings):
    from models_registry.authentication import db_keys_present
    from models_registry.models import ApiKey

    await sync.sync_to_async(ApiKey.create_key)(label="db-key")
    db_keys_present.invalidate()
    try:
        missing = await served.post("/v1/chat/completions", json=CHAT)
        assert missing.status_code == 401
        wrong = await served.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer sk-nope"})
        assert wrong.status_code == 401
        assert wrong.json()["error"]["code"] == "invalid_api_key"
        assert hops["request_key_check"] >= 1  # the database was asked, on a thread
    finally:
        # The next test's server must not go on believing keys exist (the answer is kept 2 s).
        await sync.sync_to_async(lambda: ApiKey.objects.all().delete())()
        db_keys_present.invalidate()


async def test_the_admin_still_refuses_a_post_without_its_csrf_token(served):
    response = await served.post("/admin/login/", data={"username": "x", "password": "y"})
    assert response.status_code == 403
    assert "CSRF" in response.text
