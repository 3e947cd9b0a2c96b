"""Anthropic's Messages API on /v1 (issue 17): routes before inference.urls, whose last pattern
answers every other /v1 path with a 404."""

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
