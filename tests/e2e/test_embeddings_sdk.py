"""The official `openai` SDK's embeddings.create, unchanged, against both deployments."""

from __future__ import annotations

import math

import openai
import pytest

from tests.e2e.conftest import Server

pytestmark = pytest.mark.e2e
SENTENCES = ["A man is eating food.", "Someone is having a meal.", "The stock market crashed today."]


def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_embeddings_create_in_base64_and_float_give_the_same_vectors(server):
    client = sdk(server)
    # The SDK asks for base64 unless told otherwise, and decodes it itself.
    default = client.embeddings.create(model="text-embedding-3-small", input=SENTENCES)
    floats = client.embeddings.create(model="all-minilm-l6-v2", input=SENTENCES, encoding_format="float")
    assert [d.index for d in default.data] == [0, 1, 2]
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data]
    assert len(default.data[0].embedding) == 384
    assert math.isclose(math.fsum(x * x for x in default.data[0].embedding), 1.0, abs_tol=1e-5)
    assert default.usage.prompt_tokens == default.usage.total_tokens > 0
    assert floats.model_extra["hypnos_telemetry"]["placement"]["primary_tier"] == "tier1_gpu_vram"


def test_a_batch_gives_exactly_the_single_vectors(server):
    client = sdk(server)
    batch = client.embeddings.create(model="all-minilm-l6-v2", input=SENTENCES, encoding_format="float")
    for item, text in zip(batch.data, SENTENCES, strict=True):
        single = client.embeddings.create(model="all-minilm-l6-v2", input=text, encoding_format="float")
        assert single.data[0].embedding == item.embedding


def test_an_embedding_call_to_a_chat_model_is_the_sdks_bad_request(server):
    with pytest.raises(openai.BadRequestError):
        sdk(server).embeddings.create(model="smollm2-135m", input="hello")


def test_token_id_arrays_give_the_vectors_of_their_texts(server):
    """What LangChain's OpenAIEmbeddings sends by default: arrays of token ids, here all-MiniLM's
    own ([CLS] a man is eating food . [SEP], as its tokenizer.json gives them)."""
    client = sdk(server)
    ids = [101, 1037, 2158, 2003, 5983, 2833, 1012, 102]
    by_ids = client.embeddings.create(model="all-minilm-l6-v2", input=[ids, ids[:-1]])
    by_text = client.embeddings.create(model="all-minilm-l6-v2", input=SENTENCES[0])
    assert by_ids.data[0].embedding == by_text.data[0].embedding
    assert by_ids.data[1].embedding != by_text.data[0].embedding
    assert by_ids.usage.prompt_tokens == 15 and by_text.usage.prompt_tokens == 8
    with pytest.raises(openai.BadRequestError, match="outside the model's vocabulary"):
        client.embeddings.create(model="all-minilm-l6-v2", input=[[101, 30522, 102]])
