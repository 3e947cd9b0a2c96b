from __future__ import annotations

import os
import tomllib
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from pydantic import ValidationError

from models_registry.catalog import UnknownSpec, catalog_path, find_variant, load_catalog
from models_registry.downloads import DownloadError, fetch, hub_endpoint, plan


class Command(BaseCommand):
    help = (
        "Download catalog variants into models_dir: <id> or <id>:<quant> (the default variant without "
        "one), resuming interrupted downloads. HF_ENDPOINT sets the hub, HF_TOKEN the token for gated files."
    )
    requires_system_checks: list[str] = []

    def add_arguments(self, parser):  # type: ignore[no-untyped-def]
        parser.add_argument("specs", nargs="+", metavar="spec")
        parser.add_argument("--token", default=None, help="Hugging Face token (default: $HF_TOKEN)")
        parser.add_argument("--models-dir", type=Path, default=None, help="default: the config's models_dir")
        parser.add_argument("--catalog", type=Path, default=None, help="default: models.catalog.toml by the config")

    def handle(self, specs, token, models_dir, catalog, **_):  # type: ignore[no-untyped-def]
        config = settings.HYPNOS
        models_dir = (models_dir or config.models_dir).expanduser()
        path = catalog or catalog_path(config)
        try:
            loaded = load_catalog(path)
        except (OSError, tomllib.TOMLDecodeError, ValidationError) as exc:
            raise CommandError(f"{path}: {exc}".replace("\n", " ")) from exc
        try:
            planned = [item for spec in specs for item in plan(*find_variant(loaded, spec), models_dir)]
            fetched = fetch(planned, models_dir, hub=hub_endpoint(), token=token or os.environ.get("HF_TOKEN"))
        except (UnknownSpec, DownloadError, OSError) as exc:
            raise CommandError(str(exc)) from exc
        except KeyboardInterrupt:
            raise CommandError("interrupted; run the same command again to resume") from None
        for item, action in fetched:
            self.stdout.write(f"{item.label}: {item.dest} ({action})")
        self.stdout.write("`manage.py catalogblock <spec>` prints the [[models]] block that runs a variant")
