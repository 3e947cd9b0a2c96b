"""The catalog's `problem` (downloaded weights of another architecture than listed) and the
config block of a variant with an aux file."""

from __future__ import annotations

import struct
import tomllib
from pathlib import Path

from hypnos_site.config import HypnosConfig, ModelConfig, ServerConfig
from models_registry.catalog import Catalog, config_block, describe


def tiny_gguf(path: Path, architecture: str) -> int:
    key, value = b"general.architecture", architecture.encode()
    data = (
        b"GGUF"
        + struct.pack("<IQQ", 3, 0, 1)
        + struct.pack("<Q", len(key))
        + key
        + struct.pack("<IQ", 8, len(value))
        + value
    )
    path.write_bytes(data)
    return len(data)


def catalog_of(architecture: str, size: int | None) -> Catalog:
    return Catalog.model_validate(
        {
            "catalog_version": 1,
            "tested_architectures": ["llama", "qwen2"],
            "models": [
                {
                    "id": "m",
                    "name": "M",
                    "publisher": "P",
                    "license": "mit",
                    "architecture": architecture,
                    "modality": "text_generation",
                    "engine": "ggml_llama",
                    "summary": "s",
                    "variants": [
                        {
                            "quant": "Q4_0",
                            "default": True,
                            "files": [
                                {
                                    "role": "weights",
                                    "repo": "org/m-GGUF",
                                    "remote": "m.gguf",
                                    "local": "m.gguf",
                                    "size": size,
                                }
                            ],
                        }
                    ],
                }
            ],
        }
    )


def test_weights_of_another_architecture_are_a_problem(tmp_path):
    size = tiny_gguf(tmp_path / "m.gguf", "qwen2")
    config = HypnosConfig(server=ServerConfig(models_dir=str(tmp_path)), models=[])
    [variant] = describe(config, catalog_of("llama", size))["data"][0]["variants"]
    assert variant["installed"] is True and variant["problem"] == "m.gguf reports the architecture 'qwen2', not 'llama'"
    [variant] = describe(config, catalog_of("qwen2", size))["data"][0]["variants"]
    assert "problem" not in variant


def test_weights_without_a_listed_size_are_installed_and_checked_all_the_same(tmp_path):
    tiny_gguf(tmp_path / "m.gguf", "qwen2")
    config = HypnosConfig(server=ServerConfig(models_dir=str(tmp_path)), models=[])
    [variant] = describe(config, catalog_of("llama", None))["data"][0]["variants"]
    assert (variant["installed"], variant["outdated"], variant["size_bytes"]) == (True, False, None)
    assert variant["problem"] == "m.gguf reports the architecture 'qwen2', not 'llama'"


def test_weights_not_yet_downloaded_are_no_problem(tmp_path):
    config = HypnosConfig(server=ServerConfig(models_dir=str(tmp_path)), models=[])
    [variant] = describe(config, catalog_of("llama", 10))["data"][0]["variants"]
    assert variant["installed"] is False and "problem" not in variant


def test_a_variant_with_an_aux_file_names_it_in_its_config_block():
    catalog = catalog_of("llama", 10)
    variant = catalog.models[0].variants[0]
    projector = variant.files[0].model_copy(update={"role": "aux", "remote": "mmproj.gguf", "local": "mmproj.gguf"})
    block = config_block(catalog.models[0], variant.model_copy(update={"files": [*variant.files, projector]}))
    model = ModelConfig.model_validate(tomllib.loads(block)["models"][0])
    assert model.aux_path == "mmproj.gguf" and model.weights_path == "m.gguf"
