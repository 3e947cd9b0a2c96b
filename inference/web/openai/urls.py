from django.urls import path, re_path

from inference.web.common.views import UnknownRouteView
from inference.web.openai import views

urlpatterns = [
    path("chat/completions", views.ChatCompletionsView.as_view()),
    path("completions", views.CompletionsView.as_view()),
    path("responses", views.ResponsesView.as_view()),
    path("models", views.ModelListView.as_view()),
    path("models/catalog", views.ModelCatalogView.as_view()),
    path("advisor", views.AdvisorView.as_view()),
    path("models/<path:model_id>/files", views.ModelFilesView.as_view()),
    path("models/<path:model_id>/options", views.ModelOptionsView.as_view()),
    path("models/<path:model_id>/enable", views.ModelEnableView.as_view(enable=True)),
    path("models/<path:model_id>/disable", views.ModelEnableView.as_view(enable=False)),
    path("models/<path:model_id>/moe-offload", views.ModelMoeOffloadView.as_view()),
    path("models/<path:model_id>", views.ModelView.as_view()),
    path("memory/status", views.MemoryStatusView.as_view()),
    path("memory/tier", views.MemoryTierView.as_view()),
    path("memory/kv-park", views.KvParkView.as_view()),
    path("embeddings", views.EmbeddingsView.as_view()),
    path("audio/transcriptions", views.AudioTranscriptionsView.as_view()),
    path("audio/speech", views.AudioSpeechView.as_view()),
    path("documents/convert", views.DocumentConvertView.as_view()),
    path("entities", views.EntitiesView.as_view()),
    path("images/generations", views.ImagesView.as_view()),
    path("images/edits", views.ImageFormView.as_view(op="edit")),
    path("images/variations", views.ImageFormView.as_view(op="variation")),
    path("images/upscale", views.ImageUpscaleView.as_view()),
    path("files", views.FilesView.as_view()),
    path("files/<str:file_id>", views.FileView.as_view()),
    path("files/<str:file_id>/content", views.FileContentView.as_view()),
    path("batches", views.BatchesView.as_view()),
    path("batches/<str:batch_id>", views.BatchView.as_view()),
    path("batches/<str:batch_id>/cancel", views.BatchCancelView.as_view()),
    re_path(r"^.*$", UnknownRouteView.as_view()),
]
