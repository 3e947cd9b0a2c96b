from __future__ import annotations

from pathlib import Path

import pytest

from hypnos_site.config import DEFAULT_MODELS, ConfigError, load_config


def write(tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "hypnos.toml"
    path.write_text(text)
    return {"HYPNOS_CONFIG": str(path)}


def test_it_uses_the_spec_defaults_for_an_empty_file(tmp_path):
    config = load_config(write(tmp_path, ""))
    assert config.server.port == 9999
    assert config.limits.max_body_bytes == 256 << 20
    assert config.limits.max_tokens_cap == 8192
    assert config.limits.max_queue_per_model == 8
    assert config.limits.request_timeout_secs == 900
    assert config.models[0].id == "smollm2-135m"


def test_it_reads_the_file_and_lets_the_environment_win(tmp_path):
    env = write(tmp_path, '[server]\nport = 8000\napi_keys = ["a"]\n[limits]\nmax_tokens_cap = 100\n')
    config = load_config(env | {"HYPNOS_PORT": "8123", "HYPNOS_API_KEYS": "x, y"})
    assert config.server.port == 8123
    assert config.server.api_keys == ["x", "y"]
    assert config.limits.max_tokens_cap == 100


def test_it_names_the_bad_key(tmp_path):
    env = write(tmp_path, "[limits]\nmax_tokens_cap = -1\n")
    with pytest.raises(ConfigError, match="limits.max_tokens_cap"):
        load_config(env)


def test_it_refuses_unknown_keys(tmp_path):
    env = write(tmp_path, "[server]\nprot = 1\n")
    with pytest.raises(ConfigError, match="server.prot"):
        load_config(env)


def test_it_refuses_a_missing_explicit_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config({"HYPNOS_CONFIG": str(tmp_path / "nope.toml")})


def test_it_refuses_an_alias_used_twice(tmp_path):
    block = (
        '[[models]]\nid = "{id}"\nmodality = "text_generation"\nengine = "ggml_llama"\n'
        'weights_path = "a.gguf"\naliases = ["same"]\n'
    )
    env = write(tmp_path, block.format(id="a") + block.format(id="b"))
    with pytest.raises(ConfigError, match="same"):
        load_config(env)


def test_the_example_config_is_valid():
    example = Path(__file__).resolve().parents[2] / "hypnos.example.toml"
    config = load_config({"HYPNOS_CONFIG": str(example)})
    assert config.server.port == 9999
    assert [m.id for m in config.models] == [
        "smollm2-135m",
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-1.5b",
        "all-minilm-l6-v2",
        "whisper-tiny.en",
        "piper-joe",
        "docling",
        "dcgan-faces",
        "realesrgan-x4",
    ]
    assert config.models == DEFAULT_MODELS
