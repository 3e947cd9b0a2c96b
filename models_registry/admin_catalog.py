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

from hypnos_site.errors import HypnosError
from models_registry.catalog import catalog_path, describe, load_catalog
from models_registry.live_pool import pool


def catalog_view(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        _change_pool(request)
        return HttpResponseRedirect(request.path)
    context: dict[str, Any] = {**admin.site.each_context(request), "title": "Model catalog"}
    path = catalog_path(settings.HYPNOS)
    if path.exists():
        live = settings.HYPNOS.model_copy(update={"models": pool.models()})
        context["catalog"] = describe(live, load_catalog(path))
        context["pool"] = pool.models()
    return TemplateResponse(request, "admin/models_registry/catalog.html", context)


def _change_pool(request: HttpRequest) -> None:
    action, target = request.POST.get("action"), request.POST.get("target", "")
    try:
        if action == "add":
            result = async_to_sync(pool.add_model)({"catalog": target})
        elif action == "remove":
            result = async_to_sync(pool.remove_model)(target, 120)
        else:
            messages.error(request, f"Unknown action {action!r}.")
            return
    except HypnosError as exc:
        messages.error(request, exc.message)
        return
    kept = "" if result["persisted"] else " (not persisted: it lasts until the next restart)"
    messages.success(request, f"{result['model']}: {result['action']}{kept}.")
