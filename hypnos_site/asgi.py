"""ASGI entry point (daphne). In the embedded deployment the worker starts here, so the port
opens while the startup models are staged."""

from __future__ import annotations

import logging
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hypnos_site.settings")

from hypnos_site.handler import get_asgi_application  # noqa: E402

# Django's ASGI handler, its request threads pooled (hypnos_site/handler.py).
django_application = get_asgi_application()

from django.conf import settings  # noqa: E402

if settings.HYPNOS.server.deployment == "embedded":
    from inference.transport.runtime import runtime
    from models_registry.overlay import with_overlay

    # The pool: the config file's models with the run-time changes kept in the database.
    runtime.embedded_worker(with_overlay(settings.HYPNOS))

    from django.db import DatabaseError

    from inference.jobs.tasks import resume_unfinished_batches

    # The batches the last run of this server left unfinished (the distributed deployment's
    # Celery delivers an unfinished task again by itself).
    try:
        resume_unfinished_batches(eager=True)
    except DatabaseError as exc:  # no database yet: nothing to resume
        logging.getLogger("hypnos.batches").warning("unfinished batches not resumed: %s", exc)

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from inference.web.common.middleware import RealtimeOriginValidator  # noqa: E402
from inference.web.openai.realtime import websocket_urlpatterns  # noqa: E402

# WS /v1/realtime (realtime transcription) beside every HTTP route; its handshake passes the
# Host and Origin checks of the HTTP routes (a page may open a WebSocket to any origin).
application = ProtocolTypeRouter(
    {"http": django_application, "websocket": RealtimeOriginValidator(URLRouter(websocket_urlpatterns))}
)
