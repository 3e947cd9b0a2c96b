"""The admin's catalog page: an operator sees the tested models and changes the running pool."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client

from inference.worker import Worker
from models_registry.models import ModelOverlay

pytestmark = pytest.mark.django_db(transaction=True)
SMOL, QWEN = "smollm2-135m", "qwen2.5-coder-0.5b"


@pytest.fixture
def pool(settings, serve) -> Worker:
    settings.HYPNOS = settings.HYPNOS.model_copy(update={"models": settings.HYPNOS.models[:1]})
    return serve(settings.HYPNOS)


@pytest.fixture
def operator() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("operator", "op@example.com", "secret"))
    return client


def test_it_lists_the_catalog_with_what_is_on_disk_and_in_the_pool(operator, pool):
    page = operator.get("/admin/catalog/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "Qwen2.5-Coder 0.5B Instruct" in html and "Add to the pool" in html and "Remove from the pool" in html
    overlay = operator.get("/admin/models_registry/modeloverlay/")
    assert overlay.status_code == 200 and "/admin/catalog/" in overlay.content.decode()


def test_it_adds_a_variant_to_the_running_pool_and_removes_a_model(operator, pool):
    added = operator.post("/admin/catalog/", {"action": "add", "target": f"{QWEN}:Q4_K_M"}, follow=True)
    # The admin capitalizes its messages.
    assert f"{QWEN}: added.".capitalize() in added.content.decode()
    assert QWEN in pool.models and ModelOverlay.objects.get(model_id=QWEN).source == f"{QWEN}:Q4_K_M"
    removed = operator.post("/admin/catalog/", {"action": "remove", "target": QWEN}, follow=True)
    assert f"{QWEN}: removed.".capitalize() in removed.content.decode()
    assert QWEN not in pool.models and not ModelOverlay.objects.exists()


def test_a_refused_change_is_shown_as_an_error(operator, pool):
    refused = operator.post("/admin/catalog/", {"action": "add", "target": SMOL}, follow=True)
    assert "is already taken by the model" in refused.content.decode()
    assert list(pool.models) == [SMOL]


def test_it_is_for_staff_only(pool):
    assert Client().get("/admin/catalog/").status_code == 302
