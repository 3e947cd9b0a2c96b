from django.urls import path

from logs import views

urlpatterns = [
    path("logs", views.RequestLogView.as_view()),
    path("logs/level", views.RequestLogLevelView.as_view()),
    path("logs/<str:request_id>", views.RequestLogRecordView.as_view()),
]
