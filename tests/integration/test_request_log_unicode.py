"""A lone surrogate a client sends (JSON's "\\ud800") is a 400, and the call is still in the
request log: the stored strings are made encodable first (SQLite and PostgreSQL refuse them)."""

from __future__ import annotations

import pytest

from logs.store import storable
from tests.integration.test_keys_and_log import ADMIN, bearer, logged, with_keys

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_lone_surrogate_becomes_the_replacement_character() -> None:
    assert storable({"model": "x\ud800y", "parts": ["\udfff", 3]}) == {"model": "x\ufffdy", "parts": ["\ufffd", 3]}
    assert storable("caf\u00e9 \U0001f600") == "caf\u00e9 \U0001f600"


async def test_a_call_naming_a_lone_surrogate_model_is_refused_and_logged(api, settings) -> None:
    with_keys(settings)
    response = await api.post(
        "/v1/completions",
        data=b'{"model": "\\ud800", "prompt": "a"}',
        content_type="application/json",
        headers=bearer(ADMIN),
    )
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    [record] = (await logged(api, 1))["records"]
    assert record["id"] == response["x-request-id"] and record["status"] == 400
