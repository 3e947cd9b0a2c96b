"""Lemonade's lifecycle routes under /api/v1 (compat.md); its other routes are the /v1 ones."""

from django.urls import path

from inference.web.lemonade import views

urlpatterns = [
    path("health", views.LemonadeHealthView.as_view()),
    path("load", views.LemonadeLoadView.as_view()),
    path("unload", views.LemonadeUnloadView.as_view()),
    path("stats", views.LemonadeStatsView.as_view()),
    path("pull", views.LemonadePullView.as_view()),
    path("delete", views.LemonadeDeleteView.as_view()),
]
