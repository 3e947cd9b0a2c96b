from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from models_registry.catalog import catalog_path, config_block, load_catalog


class Command(BaseCommand):
    help = "Print the [[models]] block of a catalog entry: <id> or <id>:<quant> (its default variant without one)."

    def add_arguments(self, parser):  # type: ignore[no-untyped-def]
        parser.add_argument("spec")

    def handle(self, spec, **_):  # type: ignore[no-untyped-def]
        catalog = load_catalog(catalog_path(settings.HYPNOS))
        entry = next((e for e in catalog.models if spec == e.id or spec.startswith(e.id + ":")), None)
        if entry is None:
            raise CommandError(f"{spec!r} is not in the catalog")
        quant = spec[len(entry.id) + 1:] if spec != entry.id else None
        variant = next((v for v in entry.variants if (v.quant == quant if quant else v.default)), None)
        if variant is None:
            raise CommandError(f"{entry.id} has no variant {quant!r}")
        self.stdout.write(config_block(entry, variant), ending="")
