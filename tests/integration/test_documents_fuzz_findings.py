"""What the route fuzzer (tests/fuzz) and its probes found on the document routes (spec §12), one
test per finding, through the real route, Celery (eager) and the docling engine: each was a 500
before its fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests import documents
from tests.integration.conftest import post_json
from tests.integration.test_documents import DOCLING, URL, upload

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    return documents.multipage_pdf(tmp_path_factory.mktemp("documents") / "report.pdf")


def refused(response: Any, status: int, param: str) -> str:
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param
    return str(body["error"]["message"])


async def test_a_format_the_picture_routes_do_not_know_is_a_400_not_a_500(api, report):
    # DRF read `format` as its URL format override and raised Django's Http404 for a value no
    # renderer had (`?format=png`), which the exception handler answered as a 500.
    body = (await upload(api, report, return_pictures="true")).json()
    picture = f"/v1/documents/{body['id']}/pictures/1"
    assert "format must be image" in refused(await api.get(picture + "?format=png"), 400, "format")
    assert (await api.get(picture + "?format=json")).json()["object"] == "document.picture"
    image = await api.get(picture + "?format=image", headers={"accept": "text/html"})
    assert image.status_code == 200 and image["content-type"] == "image/png"
    listed = await api.get(f"/v1/documents/{body['id']}/pictures?format=image")
    assert listed.status_code == 200 and [p["index"] for p in listed.json()["data"]] == [1]
    deleted = await api.delete(f"/v1/documents/{body['id']}?format=png")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True


@pytest.mark.parametrize(
    "url",
    [
        "http://[::1/report.pdf",  # an IPv6 literal without its closing bracket
        "http://127.0.0.1:99999/report.pdf",  # a port out of range
        "http://127.0.0.1:x/report.pdf",  # a port that is no number
        "http://" + "a" * 64 + ".example/report.pdf",  # a host label IDNA cannot encode
    ],
)
async def test_a_malformed_document_url_is_a_400_naming_url(api, url):
    # urlsplit's ValueError and the IDNA codec's UnicodeError left the route as 500s.
    assert "malformed" in refused(await post_json(api, URL, {"model": DOCLING, "url": url}), 400, "url")


async def test_an_unknown_format_query_on_any_route_is_a_404_in_the_envelope(api):
    for path in ("/v1/documents/%00/pictures/0?format=png", "/v1/models?format=xml", "/v1/no/such?format=png"):
        response = await api.get(path)
        assert response.status_code == 404, (path, response.content)
        assert response.json()["error"]["type"] in ("not_found", "invalid_request_error")


async def test_a_malformed_url_is_a_400_for_images_too(settings):
    from hypnos_site.errors import InvalidRequest
    from inference.web.common.image_input import ImagePolicy, fetch

    policy = ImagePolicy.from_limits(settings.HYPNOS.limits)
    for url in ("http://[::1/x.png", "http://host:99999/x.png", "http://" + "a" * 64 + ".com/x.png"):
        with pytest.raises(InvalidRequest, match="malformed") as refused:
            await fetch(url, policy)
        assert refused.value.param == "messages"
