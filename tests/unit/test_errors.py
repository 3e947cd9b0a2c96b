from __future__ import annotations

import json

from hypnos_site.errors import AuthenticationError, ModelBusy, ModelNotAvailable, ModelNotFound
from inference.transport import wire


def test_an_error_crosses_the_transport_with_its_class():
    event = wire.encode_event(wire.Error.of(ModelNotFound("no such model", param="model")))
    again = wire.decode_event(json.loads(json.dumps(event))).exception()
    assert type(again) is ModelNotFound
    assert again.body() == {
        "error": {"message": "no such model", "type": "model_not_found", "param": "model", "code": "model_not_found"}
    }


def test_an_unknown_error_class_becomes_a_server_error():
    again = wire.decode_event({"kind": "error", "error_class": "Nope", "message": "x"}).exception()
    assert again.status == 500 and again.type == "server_error"


def test_the_spec_statuses_and_headers():
    assert ModelBusy("x").status == 429
    assert ModelNotAvailable("x").response()["Retry-After"] == "5"
    auth = AuthenticationError("x").response()
    assert auth.status_code == 401
    assert auth["WWW-Authenticate"] == 'Bearer realm="hypnos"'
    assert json.loads(auth.content)["error"]["code"] == "invalid_api_key"
