from django.apps import AppConfig


class LogsConfig(AppConfig):
    name = "logs"
    verbose_name = "Request log"
    default_auto_field = "django.db.models.BigAutoField"
