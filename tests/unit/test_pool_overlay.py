"""The model pool overlay laid over the config file's models, and a block read as a model."""

from __future__ import annotations

import pytest

from hypnos_site.config import DEFAULT_MODELS
from models_registry.models import ModelOverlay
from models_registry.overlay import overlay_models
from models_registry.pool import PoolCheckFailed, model_from_block

BLOCK = '[[models]]\nid = "ignored"\nmodality = "text_generation"\nengine = "ggml_llama"\nweights_path = "x.gguf"\n'


def test_it_adds_replaces_and_removes_in_the_config_order():
    smol, qwen = DEFAULT_MODELS[0], DEFAULT_MODELS[1]
    rows = [
        ModelOverlay(model_id=qwen.id, action=ModelOverlay.REMOVED),
        ModelOverlay(model_id=smol.id, action=ModelOverlay.REPLACED, block=BLOCK),
        ModelOverlay(model_id="new", action=ModelOverlay.ADDED, block=BLOCK),
    ]
    models = overlay_models([smol, qwen], rows)
    assert [m.id for m in models] == [smol.id, "new"]
    assert models[0].weights_path == "x.gguf" and models[1].weights_path == "x.gguf"


def test_it_skips_a_row_that_no_longer_validates():
    broken = ModelOverlay(model_id="broken", action=ModelOverlay.ADDED, block="[[models]]\nid = 1\n")
    assert [m.id for m in overlay_models([DEFAULT_MODELS[0]], [broken])] == [DEFAULT_MODELS[0].id]


def test_a_block_takes_the_id_it_is_given():
    assert model_from_block(BLOCK, "chosen").id == "chosen"
    with pytest.raises(PoolCheckFailed) as failed:
        model_from_block(BLOCK.replace('"ggml_llama"', '"nope"'))
    assert any("models.engine" in reason for reason in failed.value.reasons)
