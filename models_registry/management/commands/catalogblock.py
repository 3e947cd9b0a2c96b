from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from models_registry.catalog import UnknownSpec, catalog_path, config_block, find_variant, load_catalog


class Command(BaseCommand):
    help = "Print the [[models]] block of a catalog entry: <id> or <id>:<quant> (its default variant without one)."

    def add_arguments(self, parser):  # type: ignore[no-untyped-def]
        parser.add_argument("spec")

    def handle(self, spec, **_):  # type: ignore[no-untyped-def]
        catalog = load_catalog(catalog_path(settings.HYPNOS))
        try:
            entry, variant = find_variant(catalog, spec)
        except UnknownSpec as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(config_block(entry, variant), ending="")
