"""`POST /v1/embeddings` driven by the official OpenAI Python SDK with strict response validation.

The default model (SmolLM2-135M-Instruct, a decoder LM with no sentence-transformers files) pools
by the last token. That the vectors equal transformers' pooled `last_hidden_state` is
crates/engine/tests/embeddings.rs's job (the tiny fixtures, f32, 1e-4); here: the wire format
(float and base64 agree, OpenAI's shape), `dimensions`, list and token-id inputs, usage, 400s
naming the field, and generation running beside embeddings.
"""

import base64
import concurrent.futures
import math
import struct

import openai
import pytest

from conftest import API_KEY
from conftest import post as post_json

D_MODEL = 576  # SmolLM2-135M's hidden size
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


def post(server, path, body):
    return post_json(server, path, body, headers=AUTH)


def tokens(server, text):
    status, body = post(server, "/tokenize", {"content": text})
    assert status == 200, body
    return body["tokens"]


def norm(v):
    return math.sqrt(sum(x * x for x in v))


def f32(v):
    """`v` rounded to f32, as the server's JSON numbers (f32's shortest decimal) stand for."""
    return list(struct.unpack(f"<{len(v)}f", struct.pack(f"<{len(v)}f", *v)))


def max_diff(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def embed(client, input, **kw):
    return client.embeddings.create(model="kiln", input=input, **kw)


def test_float_and_base64_agree_and_are_normalised(client, stream_client, server):
    floats = embed(client, "The capital of France is Paris.", encoding_format="float")
    assert floats.object == "list" and floats.model
    [item] = floats.data
    assert item.object == "embedding" and item.index == 0
    v = item.embedding
    assert len(v) == D_MODEL
    assert abs(norm(v) - 1.0) < 1e-5
    # With no format given the SDK asks for base64 and decodes it itself. It validates the
    # body before decoding, against `embedding: List[float]`, so strict validation refuses every
    # base64 answer (OpenAI's own too): the base64 cases use the non-strict client.
    default = embed(stream_client, "The capital of France is Paris.")
    assert default.data[0].embedding == f32(v)
    b64 = embed(stream_client, "The capital of France is Paris.", encoding_format="base64")
    data = base64.b64decode(b64.data[0].embedding)
    assert len(data) == 4 * D_MODEL
    assert list(struct.unpack(f"<{D_MODEL}f", data)) == f32(v)
    # On the wire: little-endian f32, standard base64.
    status, raw = post(
        server,
        "/v1/embeddings",
        {"input": "The capital of France is Paris.", "encoding_format": "base64"},
    )
    assert status == 200, raw
    assert raw["data"][0]["embedding"] == b64.data[0].embedding
    assert raw["usage"]["prompt_tokens"] == len(tokens(server, "The capital of France is Paris."))


def test_dimensions_truncate_and_renormalise(client):
    full = embed(client, "kiln embeds text", encoding_format="float").data[0].embedding
    for n in [1, 64, D_MODEL]:
        cut = embed(client, "kiln embeds text", dimensions=n, encoding_format="float").data[0].embedding
        assert len(cut) == n
        assert abs(norm(cut) - 1.0) < 1e-5
        scale = norm(full[:n])
        assert max_diff(cut, [x / scale for x in full[:n]]) < 1e-6


def test_a_list_gives_one_embedding_per_input_in_order(client, server):
    texts = ["one", "a longer sentence about the weather in Paris", "two words", "x"]
    before = server.metrics()
    batched = embed(client, texts, encoding_format="float")
    after = server.metrics()
    # /metrics counts the request, its inputs and their tokens (usage's count).
    assert after["kiln_embedding_requests_total"] - before["kiln_embedding_requests_total"] == 1
    assert after["kiln_embedding_inputs_total"] - before["kiln_embedding_inputs_total"] == 4
    assert after["kiln_embedding_tokens_total"] - before["kiln_embedding_tokens_total"] \
        == batched.usage.prompt_tokens
    assert after["kiln_embedding_requests_waiting"] == 0
    assert [d.index for d in batched.data] == [0, 1, 2, 3]
    for text, item in zip(texts, batched.data):
        alone = embed(client, text, encoding_format="float").data[0].embedding
        # Packed together or alone, the same vectors (the quantized products may round apart).
        assert max_diff(item.embedding, alone) < 1e-3, text
    # Different inputs, different vectors.
    assert max_diff(batched.data[0].embedding, batched.data[3].embedding) > 1e-2


def test_token_ids_equal_the_text_and_usage_counts_them(client, server):
    texts = ["hello world", "embeddings from a decoder model"]
    ids = [tokens(server, t) for t in texts]
    by_text = embed(client, texts, encoding_format="float")
    by_ids = embed(client, ids, encoding_format="float")
    for a, b in zip(by_text.data, by_ids.data):
        assert max_diff(a.embedding, b.embedding) == 0.0
    one = embed(client, ids[0], encoding_format="float")
    assert max_diff(one.data[0].embedding, by_text.data[0].embedding) < 1e-3
    n = sum(len(i) for i in ids)
    assert by_text.usage.prompt_tokens == n and by_text.usage.total_tokens == n
    assert by_ids.usage.prompt_tokens == n and by_ids.usage.total_tokens == n
    assert one.usage.prompt_tokens == len(ids[0])


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({}, "input"),
        ({"input": 7}, "input"),
        ({"input": [49152]}, "input"),  # one past SmolLM2's vocabulary
        ({"input": ["a", 1]}, "input"),
        ({"input": ["x"] * 257}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "dimensions": D_MODEL + 1}, "dimensions"),
        ({"input": "hi", "dimensions": "many"}, "dimensions"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    status, answer = post(server, "/v1/embeddings", {"model": "kiln", **body})
    assert status == 400, answer
    assert answer["error"]["param"].startswith(param), answer


def test_the_sdk_raises_bad_request_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        embed(client, "hi", dimensions=D_MODEL + 1)
    assert e.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as e:
        embed(client, "")
    assert e.value.body["param"] == "input"


def test_generation_beside_embeddings_completes(client, server):
    prompts = [f"Count from {i} to {i + 20}:" for i in range(4)]
    texts = [f"sentence number {i} about embeddings and caches" for i in range(64)]

    def generate(prompt):
        return client.completions.create(model="kiln", prompt=prompt, max_tokens=48, temperature=0)

    def embeddings(_):
        return embed(client, texts, encoding_format="float")

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        generating = [pool.submit(generate, p) for p in prompts]
        embedding = [pool.submit(embeddings, i) for i in range(4)]
        done = [f.result(timeout=300) for f in generating]
        vectors = [f.result(timeout=300) for f in embedding]
    assert all(c.choices[0].text for c in done)
    assert all(len(v.data) == 64 for v in vectors)
    # Embeddings leave nothing in the engine's cache.
    metrics = server.wait_idle()
    assert metrics["kiln_kv_cache_blocks_used"] == 0
