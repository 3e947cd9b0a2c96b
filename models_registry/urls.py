"""The key routes on /v1 (issue 17), included before inference.web.openai.urls, whose last pattern answers
every other /v1 path with a 404."""

from django.urls import path

from models_registry import key_views

urlpatterns = [
    path("keys", key_views.KeyListView.as_view()),
    path("keys/<str:key>", key_views.KeyView.as_view()),
]
