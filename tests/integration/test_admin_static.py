"""The admin is styled in both deployments (its static files are served by the web process,
no collectstatic needed), its index links to Hypnos's own pages, and the request log's list
fits a normal screen."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from django.contrib.auth.models import User
from django.test import AsyncClient, Client

from logs.models import RequestLogEntry

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("operator", "op@example.com", "secret"))
    return client


async def test_it_serves_the_admin_css_with_its_content_type():
    response = await AsyncClient().get("/static/admin/css/base.css")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/css")
    body = b"".join([chunk async for chunk in response.streaming_content])
    assert b"--body-bg" in body and len(body) == int(response["Content-Length"])


def test_it_answers_a_conditional_request_with_304():
    client = Client()
    etag = client.get("/static/admin/css/base.css")["ETag"]
    assert client.get("/static/admin/css/base.css", headers={"if-none-match": etag}).status_code == 304


def test_an_unknown_static_file_is_a_404():
    assert Client().get("/static/admin/css/no-such-file.css").status_code == 404


def test_the_admin_pages_link_their_stylesheets_and_they_are_served(operator):
    page = operator.get("/admin/")
    assert page.status_code == 200
    html = page.content.decode()
    assert '<link rel="stylesheet" href="/static/admin/css/base.css">' in html
    assert operator.get("/static/admin/css/dashboard.css").status_code == 200


def test_the_admin_index_links_the_playground_catalog_keys_and_request_log(operator):
    html = operator.get("/admin/").content.decode()
    for link in (
        'href="/"',
        'href="/admin/catalog/"',
        'href="/admin/models_registry/apikey/"',
        'href="/admin/logs/requestlogentry/"',
        'href="/docs"',
    ):
        assert link in html, link


def test_the_request_log_list_shows_few_columns_and_cuts_long_text(operator):
    RequestLogEntry.objects.create(
        request_id="req-" + "a" * 32,
        route="/v1/chat/completions",
        method="POST",
        status=500,
        started_at=datetime.now(UTC),
        duration_ms=1234.5,
        model="a-model-with-a-very-long-identifier-that-goes-on:Q4_K_M",
        tokens_in=31,
        tokens_out=58,
        error="the engine failed " * 20,
        level="error",
    )
    html = operator.get("/admin/logs/requestlogentry/").content.decode()
    columns = re.findall(r'<th scope="col" class="(?:sortable )?column-(\w+)', html)
    assert columns == ["started", "call", "status", "short_model", "tokens", "duration", "short_error"]
    assert 'id="nav-sidebar"' not in html
    assert "POST /v1/chat/completions" in html and "31 / 58" in html and "1234" in html
    assert "the engine failed " * 20 not in html and "\u2026" in html
