from django.contrib import admin
from django.urls import include, path

from hypnos_site import openapi, playground
from hypnos_site.metrics import metrics_view
from inference.web.common import views
from inference.web.openai import views as openai_views
from models_registry.admin_catalog import catalog_view

urlpatterns = [
    path("health", views.health),
    path("ready", views.ready),
    # The API's OpenAPI schema, generated from this table, and Swagger UI on it (open, like /health).
    path("v1/openapi.json", openapi.OpenApiView.as_view(), name="openapi-schema"),
    path("docs", openapi.docs_view, name="api-docs"),
    # Before the admin's own routes, whose catch-all would answer this path.
    path("admin/catalog/", admin.site.admin_view(catalog_view), name="admin-catalog"),
    path("admin/", admin.site.urls),
    path("metrics", metrics_view),
    # Before inference.web.openai.urls, whose last pattern answers every other /v1 path with a 404.
    path("v1/", include("logs.urls")),
    # The API keys (`hypnos keys`).
    path("v1/", include("models_registry.urls")),
    path("api/v1/", include("logs.urls")),
    path("v1/", include("inference.web.anthropic.urls")),
    path("v1/", include("inference.web.openai.urls")),
    # Lemonade clients talk to /api/v1 (compat.md): its lifecycle routes, then every /v1 route.
    path("api/v1/", include("inference.web.lemonade.urls")),
    path("api/v1/", include("inference.web.anthropic.urls")),
    path("internal/set", openai_views.InternalSetView.as_view()),
    path("api/v1/", include("inference.web.openai.urls")),
    # The web playground for browsers (text/html); before Ollama's routes, whose GET and HEAD /
    # it still answers for every other client (hypnos_site/playground.py).
    path("", playground.index, name="playground"),
    # Ollama clients talk to /api/<verb> (and HEAD /).
    path("", include("inference.web.ollama.urls")),
]

handler404 = "inference.web.common.views.handler404"
handler500 = "inference.web.common.views.handler500"
