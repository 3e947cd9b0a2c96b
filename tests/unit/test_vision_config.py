"""The model block keys of vision and thinking: aux_path (the projector) and thinking."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hypnos_site.config import HypnosConfig, ModelConfig

BLOCK = {"id": "m", "modality": "text_generation", "engine": "ggml_llama", "weights_path": "m.gguf"}


def test_a_projector_adds_vision_to_the_modalities_and_resolves_under_models_dir():
    model = ModelConfig(**BLOCK, aux_path="mmproj.gguf", speech_to_text_model="w")
    assert model.modalities == ["text_generation", "vision", "speech_to_text"]
    config = HypnosConfig(server={"models_dir": "/srv/models"}, models=[model])
    assert str(config.aux_file(model)) == "/srv/models/mmproj.gguf"
    assert config.aux_file(ModelConfig(**BLOCK)) is None


def test_a_vision_model_also_serves_text():
    assert ModelConfig(**{**BLOCK, "modality": "vision"}, aux_path="p.gguf").modalities == ["vision", "text_generation"]


def test_a_projector_on_several_slots_is_a_config_error():
    with pytest.raises(ValidationError, match="slots = 1"):
        ModelConfig(**BLOCK, aux_path="mmproj.gguf", slots=2)


def test_thinking_takes_only_a_known_format():
    assert ModelConfig(**BLOCK, thinking="think_tags").thinking == "think_tags"
    with pytest.raises(ValidationError):
        ModelConfig(**BLOCK, thinking="harmony")
