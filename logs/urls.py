from django.urls import path, register_converter

from logs import views
from logs.pictures import DOCUMENT_ID_PATTERN


class DocumentIdConverter:
    """A picture store id, exactly: anything else (`documents/convert`, `..`) is not this app's
    route and falls through to inference.web.openai.urls."""

    regex = DOCUMENT_ID_PATTERN

    def to_python(self, value: str) -> str:
        return value

    def to_url(self, value: str) -> str:
        return value


register_converter(DocumentIdConverter, "document_id")

urlpatterns = [
    path("logs", views.RequestLogView.as_view()),
    path("logs/level", views.RequestLogLevelView.as_view()),
    path("logs/<str:request_id>", views.RequestLogRecordView.as_view()),
    path("documents/<document_id:document_id>", views.DocumentView.as_view()),
    path("documents/<document_id:document_id>/pictures", views.DocumentPicturesView.as_view()),
    path("documents/<document_id:document_id>/pictures/<int:index>", views.DocumentPictureView.as_view()),
]
