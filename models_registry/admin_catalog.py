"""The catalog page of the Django admin: the tested models, what of them is on disk and in the
pool, and buttons that add a variant to the running pool or take a model out (the same
operations as POST /v1/models and DELETE /v1/models/{id}, persisted in the overlay)."""

from __future__ import annotations

from typing import Any

from asgiref.sync import async_to_sync
from django.conf import settings
from django.contrib import admin, messages
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse

from inference.client import get_client
from inference.errors import HypnosError
from models_registry.catalog import catalog_path, describe, load_catalog


def catalog_view(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        _change_pool(request)
        return HttpResponseRedirect(request.path)
    context: dict[str, Any] = {**admin.site.each_context(request), "title": "Model catalog"}
    path = catalog_path(settings.HYPNOS)
    if path.exists():
        from inference.serving.pool import pool

        live = settings.HYPNOS.model_copy(update={"models": pool.models()})
        context["catalog"] = describe(live, load_catalog(path))
        context["pool"] = pool.models()
    return TemplateResponse(request, "admin/models_registry/catalog.html", context)


def _change_pool(request: HttpRequest) -> None:
    from inference.serving import pool as pool_serving

    action, target = request.POST.get("action"), request.POST.get("target", "")
    try:
        if action == "add":
            result = async_to_sync(pool_serving.add_model)(get_client(), {"catalog": target})
        elif action == "remove":
            result = async_to_sync(pool_serving.remove_model)(get_client(), target, 120)
        else:
            messages.error(request, f"Unknown action {action!r}.")
            return
    except HypnosError as exc:
        messages.error(request, exc.message)
        return
    kept = "" if result["persisted"] else " (not persisted: it lasts until the next restart)"
    messages.success(request, f"{result['model']}: {result['action']}{kept}.")
