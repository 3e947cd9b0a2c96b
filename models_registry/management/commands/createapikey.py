from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from models_registry.models import ApiKey


class Command(BaseCommand):
    help = "Create an API key, store its hash and print the key once."

    def add_arguments(self, parser):  # type: ignore[no-untyped-def]
        parser.add_argument("label")
        parser.add_argument("--admin", action="store_true", help="may change the model pool")
        parser.add_argument("--requests-per-minute", type=int)
        parser.add_argument("--max-concurrent", type=int)
        parser.add_argument("--tokens-per-day", type=int)
        parser.add_argument("--models", default="", help="comma-separated model ids or aliases; default: every model")

    def handle(self, label, admin, requests_per_minute, max_concurrent, tokens_per_day, models, **_):  # type: ignore[no-untyped-def]
        if ApiKey.objects.filter(label=label).exists():
            raise CommandError(f"a key labelled {label!r} exists already")
        _record, key = ApiKey.create_key(
            label,
            admin=admin,
            requests_per_minute=requests_per_minute,
            max_concurrent=max_concurrent,
            tokens_per_day=tokens_per_day,
            allowed_models=models,
        )
        self.stdout.write(key)
