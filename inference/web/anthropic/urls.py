"""Anthropic's Messages API on /v1 (issue 17): routes before inference.web.openai.urls, whose last pattern
answers every other /v1 path with a 404."""

from django.urls import path

from inference.web.anthropic import views as anthropic_views

urlpatterns = [
    path("messages", anthropic_views.MessagesView.as_view()),
    path("messages/count_tokens", anthropic_views.CountTokensView.as_view()),
]
