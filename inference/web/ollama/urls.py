"""The Ollama API on /api (issue 17), on the same port as /v1; included last, at the root.
/api/v1 is Lemonade's and resolves before this."""

from django.urls import path, re_path

from inference.web.ollama import views as views

urlpatterns = [
    path("", views.root),
    path("api/version", views.version),
    path("api/tags", views.TagsView.as_view()),
    path("api/ps", views.PsView.as_view()),
    path("api/show", views.ShowView.as_view()),
    path("api/chat", views.ChatView.as_view()),
    path("api/generate", views.GenerateView.as_view()),
    path("api/embed", views.EmbedView.as_view()),
    path("api/embeddings", views.EmbeddingsView.as_view()),
    path("api/pull", views.PullView.as_view()),
    path("api/delete", views.DeleteView.as_view()),
    re_path(r"^api/", views.UnknownView.as_view()),
]
