from __future__ import annotations

from django.core.management.base import BaseCommand

from logs.pictures import expire


class Command(BaseCommand):
    help = (
        "Delete the picture store's expired documents and their files now. The server does this by "
        "itself on every use of the store; this is for a server left idle, or from cron."
    )

    def handle(self, **_):  # type: ignore[no-untyped-def]
        self.stdout.write(f"{expire()} expired documents deleted")
