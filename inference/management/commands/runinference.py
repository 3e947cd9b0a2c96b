"""`manage.py runinference`: the inference worker of the distributed deployment."""

from __future__ import annotations

import asyncio
import logging
import signal

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.management.base import BaseCommand

from inference.worker import Worker
from inference.worker.channel_server import ChannelServer
from models_registry.overlay import with_overlay

log = logging.getLogger(__name__)


class Command(BaseCommand):
    help = "Run the inference worker: hold the engines and serve requests from the channel layer."

    def handle(self, *args, **options):  # type: ignore[no-untyped-def]
        asyncio.run(self._main())

    async def _main(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        # The pool: the config file's models with the run-time changes kept in the database.
        worker = Worker(await sync_to_async(with_overlay)(settings.HYPNOS))
        worker.start()
        server = ChannelServer(worker, get_channel_layer())
        try:
            await server.serve(stop)
        finally:
            log.info("inference worker stopping")
            await loop.run_in_executor(None, worker.shutdown)
