"""POST /v1/embeddings on the real all-MiniLM-L6-v2, converted to GGUF at set-up and served by
llama.cpp in the in-process worker."""

from __future__ import annotations

import base64
import math
from pathlib import Path

import numpy as np
import pytest

from models_registry.hf_to_gguf import read_safetensors
from models_registry.packaged import package_files
from tests.integration.conftest import post_json

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/v1/embeddings"
MODEL = "all-minilm-l6-v2"
SENTENCES = ["A man is eating food.", "Someone is having a meal.", "The stock market crashed today."]


async def embed(api, inputs, **extra) -> dict:
    response = await post_json(api, URL, {"model": MODEL, "input": inputs, **extra})
    assert response.status_code == 200, response.content
    return response.json()


def vectors(body: dict) -> np.ndarray:
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float64)


async def test_a_string_gets_one_normalized_vector_with_usage_and_telemetry(api):
    body = await embed(api, "A man is eating food.")
    assert body["object"] == "list" and body["model"] == MODEL
    (item,) = body["data"]
    assert item["object"] == "embedding" and item["index"] == 0
    assert len(item["embedding"]) == 384
    assert math.isclose(np.linalg.norm(item["embedding"]), 1.0, abs_tol=1e-5)
    # [CLS] a man is eating food . [SEP]
    assert body["usage"] == {"prompt_tokens": 8, "total_tokens": 8}
    telemetry = body["hypnos_telemetry"]
    assert telemetry["placement"]["primary_tier"] == "tier1_gpu_vram"
    assert telemetry["placement"]["gpu_layers"] == 6
    assert telemetry["inference_latency_ms"] > 0


async def test_a_batch_returns_exactly_the_vectors_of_the_single_calls(api):
    batch = await embed(api, SENTENCES)
    singles = [await embed(api, s) for s in SENTENCES]
    assert [d["index"] for d in batch["data"]] == [0, 1, 2]
    for item, single in zip(batch["data"], singles, strict=True):
        assert item["embedding"] == single["data"][0]["embedding"]
    assert batch["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)


async def test_the_vectors_carry_meaning(api):
    e = vectors(await embed(api, SENTENCES))
    # sentence-transformers gives 0.689 and 0.009 for these pairs.
    assert 0.66 < e[0] @ e[1] < 0.72
    assert abs(e[0] @ e[2]) < 0.05


async def test_base64_is_the_same_vectors_as_little_endian_float32(api):
    floats = await embed(api, SENTENCES[:2])
    encoded = await embed(api, SENTENCES[:2], encoding_format="base64")
    for as_float, as_base64 in zip(floats["data"], encoded["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(as_base64["embedding"]), dtype="<f4")
        assert decoded.tolist() == as_float["embedding"]


async def test_the_converted_gguf_matches_a_numpy_forward_pass_of_the_safetensors(api, settings):
    """The GGUF was written by our own converter; a plain BERT forward pass over the package's
    safetensors (f64, exact GELU, mean pooling) must give the same direction."""
    model = next(m for m in settings.HYPNOS.models if m.id == MODEL)
    folder = package_files(model)[0]
    served = vectors(await embed(api, SENTENCES[::2]))
    for text, vector in zip(SENTENCES[::2], served, strict=True):
        assert vector @ reference_embedding(folder, text) > 0.9999


async def test_empty_and_invalid_inputs_are_400(api):
    for bad, param in (([], "input"), ([""], "input"), (["a", 1], "input"), ("x", None)):
        body = {"model": MODEL, "input": bad} if param else {"model": MODEL, "input": bad, "encoding_format": "hex"}
        response = await post_json(api, URL, body)
        assert response.status_code == 400, bad
        assert response.json()["error"]["param"].startswith(param or "encoding_format")


async def test_an_input_longer_than_the_context_is_400(api):
    response = await post_json(api, URL, {"model": MODEL, "input": "word " * 600})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def token_ids(settings, text: str) -> list[int]:
    """`text` as all-MiniLM's own tokenizer (the package's tokenizer.json) gives it: [CLS] ... [SEP]."""
    from tokenizers import Tokenizer

    model = next(m for m in settings.HYPNOS.models if m.id == MODEL)
    tokenizer = Tokenizer.from_file(str(package_files(model)[0] / "tokenizer.json"))
    tokenizer.no_padding()
    return tokenizer.encode(text).ids


async def test_the_token_ids_of_a_text_give_exactly_its_vector_and_usage(api, settings):
    ids = [token_ids(settings, s) for s in SENTENCES]
    assert ids[0] == [101, 1037, 2158, 2003, 5983, 2833, 1012, 102]  # [CLS] a man is eating food . [SEP]
    as_texts = await embed(api, SENTENCES)
    as_ids = await embed(api, ids)
    assert [d["embedding"] for d in as_ids["data"]] == [d["embedding"] for d in as_texts["data"]]
    tokens = sum(map(len, ids))
    assert as_ids["usage"] == as_texts["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    # One array of ids is one input, as one string is.
    single = await embed(api, ids[0])
    assert single["data"][0]["embedding"] == as_texts["data"][0]["embedding"] and single["usage"]["prompt_tokens"] == 8


async def test_token_ids_are_taken_as_given_without_special_tokens_added(api):
    # Without [CLS] and [SEP] the same words are another sequence: another vector, fewer tokens.
    bare = await embed(api, [[1037, 2158, 2003, 5983, 2833, 1012]])
    framed = await embed(api, [[101, 1037, 2158, 2003, 5983, 2833, 1012, 102]])
    assert bare["usage"]["prompt_tokens"] == 6 and framed["usage"]["prompt_tokens"] == 8
    assert bare["data"][0]["embedding"] != framed["data"][0]["embedding"]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([[101, 30522, 102]], "input[0] holds the token id 30522, outside the model's vocabulary (0 to 30521)"),
        ([[101, 102], [101, 2**40]], "input[1] holds the token id 1099511627776"),
        ([101, -5, 102], "negative token id -5"),
        ([[]], "input[0] is an empty array of token ids"),
        (["A man.", 1012], "not an array mixing them"),
        ([[101, 102], "A man."], "not an array mixing them"),
        ([[101, 1.5]], "input[0] must be an array of token ids"),
    ],
)
async def test_token_ids_outside_the_vocabulary_empty_or_mixed_are_400_naming_input(api, bad, message):
    response = await post_json(api, URL, {"model": MODEL, "input": bad})
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "input"
    assert message in error["message"]


async def test_token_ids_longer_than_the_context_are_the_400_of_a_long_text(api):
    by_ids = await post_json(api, URL, {"model": MODEL, "input": [[101] + [2773] * 600 + [102]]})
    by_text = await post_json(api, URL, {"model": MODEL, "input": "word " * 600})
    assert by_ids.status_code == by_text.status_code == 400
    # "word " * 600 is [CLS] + 600 x "word" + [SEP], the same 602 tokens.
    assert by_ids.json()["error"] == by_text.json()["error"]
    assert by_ids.json()["error"]["code"] == "context_length_exceeded"
    assert "Input 0 is 602 tokens but the model's context is 512 tokens." in by_ids.json()["error"]["message"]


async def test_a_chat_model_is_refused_for_embeddings(api):
    response = await post_json(api, URL, {"model": "smollm2-135m", "input": "hello"})
    assert response.status_code == 400
    assert "embeddings" in response.json()["error"]["message"]


async def test_a_cold_model_reports_its_load_and_then_serves_from_tier_1(api):
    moved = await post_json(api, "/v1/memory/tier", {"model": MODEL, "target_tier": "tier3_nvme_ssd"})
    assert moved.status_code == 200
    cold = (await embed(api, "hello"))["hypnos_telemetry"]
    assert cold["previous_tier"] == "tier3_nvme_ssd"
    assert cold["tier_switch_latency_ms"] > 0
    assert cold["tier_switch_phases"]["load_mode"] == "read"
    warm = (await embed(api, "hello"))["hypnos_telemetry"]
    assert warm["previous_tier"] == "tier1_gpu_vram" and warm["tier_switch_latency_ms"] == 0


def reference_embedding(folder: Path, text: str) -> np.ndarray:
    """all-MiniLM-L6-v2 computed directly from its safetensors with numpy (BERT encoder, mean
    pooling, L2 normalization), tokenized by its own tokenizer.json."""
    from tokenizers import Tokenizer

    w = {k: np.asarray(v, dtype=np.float64) for k, v in read_safetensors(folder / "model.safetensors").items()}
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()
    ids = tokenizer.encode(text).ids
    n, heads, dim = len(ids), 12, 32

    def norm(x: np.ndarray, p: str) -> np.ndarray:
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-12) * w[p + ".weight"] + w[p + ".bias"]

    def linear(x: np.ndarray, p: str) -> np.ndarray:
        return x @ w[p + ".weight"].T + w[p + ".bias"]

    def split(x: np.ndarray) -> np.ndarray:
        return x.reshape(n, heads, dim).transpose(1, 0, 2)

    erf = np.vectorize(math.erf)
    x = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.position_embeddings.weight"][:n]
        + w["embeddings.token_type_embeddings.weight"][0]
    )
    x = norm(x, "embeddings.LayerNorm")
    for layer in range(6):
        p = f"encoder.layer.{layer}."
        q, k, v = (split(linear(x, p + f"attention.self.{name}")) for name in ("query", "key", "value"))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(dim)
        attn = np.exp(scores - scores.max(-1, keepdims=True))
        attn /= attn.sum(-1, keepdims=True)
        x = norm(
            x + linear((attn @ v).transpose(1, 0, 2).reshape(n, -1), p + "attention.output.dense"),
            p + "attention.output.LayerNorm",
        )
        hidden = linear(x, p + "intermediate.dense")
        hidden = 0.5 * hidden * (1 + erf(hidden / math.sqrt(2)))
        x = norm(x + linear(hidden, p + "output.dense"), p + "output.LayerNorm")
    pooled = x.mean(0)
    return pooled / np.linalg.norm(pooled)
