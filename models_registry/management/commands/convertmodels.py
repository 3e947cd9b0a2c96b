from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from models_registry.packaged import PackageMissing, convert_packaged_models


class Command(BaseCommand):
    help = (
        "Convert the configured packaged models to the format their weights_path names, once per "
        "machine: Hugging Face BERT folders (package_path) to GGUF, a torch.save DCGAN generator "
        "(package_path ending in .tar, .pt or .pth) to ONNX."
    )

    def handle(self, *args, **options):  # type: ignore[no-untyped-def]
        try:
            converted = convert_packaged_models(settings.HYPNOS)
        except PackageMissing as exc:
            raise CommandError(str(exc)) from exc
        for model_id, dest, wrote in converted:
            self.stdout.write(f"{model_id}: {dest} ({'converted' if wrote else 'already there'})")
