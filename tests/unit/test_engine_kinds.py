"""The engine kinds on the wire are spec §18's EngineKind values plus `ncnn`, and docs/engines.md
says so (issue 34 item 6: `ncnn` appeared on the wire outside the spec's list, unexplained)."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from django.conf import settings

from hypnos_site.config import EngineKind

# Spec §18 (../shared/spec/hypnos-api.md, checked against it below where the checkout has it).
SPEC_KINDS = {"ggml_llama", "ggml_whisper", "ggml_diffusion", "onnx_runtime", "docling", "gliner"}
SPEC = Path(settings.BASE_DIR).parent / "shared" / "spec" / "hypnos-api.md"
EXTENDED = {"ncnn"}


def test_the_engine_kinds_are_the_specs_and_ncnn():
    assert set(typing.get_args(EngineKind)) == SPEC_KINDS | EXTENDED
    if SPEC.is_file():
        line = next(line for line in SPEC.read_text().splitlines() if line.startswith("EngineKind:"))
        assert set(re.findall(r'"([a-z_]+)"', line)) == SPEC_KINDS, line


def test_the_readme_explains_the_extension():
    readme = (Path(settings.BASE_DIR) / "docs/engines.md").read_text()
    paragraph = readme[readme.index("plus one more: `ncnn`") - 200 :][:800]
    assert "EngineKind" in paragraph and "onnx_runtime" in paragraph
