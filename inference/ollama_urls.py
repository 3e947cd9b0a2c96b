"""The Ollama API on /api (issue 17), on the same port as /v1."""

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
