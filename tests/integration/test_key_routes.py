"""GET/POST /v1/keys and DELETE /v1/keys/{label or id} (issue 17, `hypnos keys`) through the real
views and the database; no worker is needed. Personas: the config's admin key, a plain key."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from django.test import AsyncClient

from hypnos_site.config import KeyConfig
from logs.store import settled
from models_registry.authentication import db_keys_present
from tests.integration.conftest import post_json, with_server

pytestmark = pytest.mark.django_db(transaction=True)
ADMIN, PLAIN = "sk-keys-admin", "sk-keys-plain"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
async def api(settings: Any) -> AsyncIterator[AsyncClient]:
    """The config's admin key and a plain key labelled `plain`."""
    with_server(settings, api_keys=[ADMIN], keys=[KeyConfig(key=PLAIN, label="plain")])
    db_keys_present.invalidate()
    yield AsyncClient()
    await settled()
    # The database is emptied after the test: its keys must not seem present to the next one.
    db_keys_present.invalidate()


async def create(api: AsyncClient, body: dict[str, Any], key: str = ADMIN) -> Any:
    return await post_json(api, "/v1/keys", body, **bearer(key))


def error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.content
    return response.json()["error"]


async def test_it_creates_a_key_shown_once_and_lists_it_without_the_key(api):
    made = await create(api, {"label": "ci-bot", "requests_per_minute": 60, "models": ["smollm2-135m"]})
    assert made.status_code == 201
    created = made.json()
    key = created.pop("key")
    assert key.startswith("hyp_") and created["key_prefix"] == key[:12] and "warning" not in created
    assert (await api.get("/v1/logs", headers=bearer(key))).status_code == 200
    listed = (await api.get("/v1/keys", headers=bearer(ADMIN))).json()["data"]
    assert key not in str(listed) and ADMIN not in str(listed) and PLAIN not in str(listed)
    by_label = {k["label"]: k for k in listed}
    assert by_label["ci-bot"] == created
    assert by_label["ci-bot"] | {"created": None} == {
        "id": created["id"],
        "label": "ci-bot",
        "key_prefix": key[:12],
        "admin": False,
        "active": True,
        "requests_per_minute": 60,
        "max_concurrent": None,
        "tokens_per_day": None,
        "models": ["smollm2-135m"],
        "created": None,
        "source": "database",
    }
    assert by_label["plain"]["source"] == "config" and by_label["plain"]["admin"] is False


async def test_a_revoked_key_gets_401_and_stays_listed_inactive(api):
    key = (await create(api, {"label": "leaver", "admin": True})).json()["key"]
    revoked = await api.delete("/v1/keys/leaver", headers=bearer(ADMIN))
    assert revoked.status_code == 200 and revoked.json()["active"] is False
    assert error(await api.get("/v1/logs", headers=bearer(key)), 401)["code"] == "invalid_api_key"
    again = await api.delete(f"/v1/keys/{revoked.json()['id']}", headers=bearer(ADMIN))
    assert again.status_code == 200 and again.json()["label"] == "leaver"
    [listed] = [k for k in (await api.get("/v1/keys", headers=bearer(ADMIN))).json()["data"] if k["label"] == "leaver"]
    assert listed["active"] is False


async def test_a_plain_key_may_not_create_list_or_revoke_keys(api):
    for response in [
        await create(api, {"label": "sneaky", "admin": True}, key=PLAIN),
        await api.get("/v1/keys", headers=bearer(PLAIN)),
        await api.delete("/v1/keys/plain", headers=bearer(PLAIN)),
    ]:
        refused = error(response, 403)
        assert refused["type"] == "permission_denied" and "needs an admin key" in refused["message"]
    listed = (await api.get("/v1/keys", headers=bearer(ADMIN))).json()["data"]
    assert "sneaky" not in {k["label"] for k in listed}


async def test_it_refuses_a_taken_label_a_config_key_an_unknown_key_and_a_bad_body(api):
    assert (await create(api, {"label": "twice"})).status_code == 201
    assert error(await create(api, {"label": "twice"}), 409)["code"] == "label_taken"
    assert error(await create(api, {"label": "plain"}), 409)["param"] == "label"
    assert "config file" in error(await api.delete("/v1/keys/plain", headers=bearer(ADMIN)), 400)["message"]
    assert error(await api.delete("/v1/keys/nobody", headers=bearer(ADMIN)), 404)["type"] == "not_found"
    assert error(await create(api, {"label": "x", "admin": "yes"}), 400)["param"] == "admin"
    assert error(await create(api, {"label": ""}), 400)["param"] == "label"


async def test_the_first_key_of_an_open_server_is_an_admin_key_that_says_keys_are_required_now(api, settings):
    with_server(settings, api_keys=[], keys=[])
    assert error(await create(api, {"label": "first"}), 400)["param"] == "admin"
    made = (await create(api, {"label": "first", "admin": True})).json()
    assert "from now on every /v1 request needs a key" in made["warning"]
    assert error(await api.get("/v1/keys"), 401)["code"] == "invalid_api_key"
    assert (await api.get("/v1/keys", headers=bearer(made["key"]))).status_code == 200
