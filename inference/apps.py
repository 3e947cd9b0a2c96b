from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "inference"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.conf import settings
        from PIL import Image

        # Every process (web, worker, Celery) refuses to decode images above the configured
        # pixel cap, whatever path reaches Pillow (it raises above twice this, warns above it).
        Image.MAX_IMAGE_PIXELS = settings.HYPNOS.limits.max_image_pixels
