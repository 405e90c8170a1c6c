"""OpenAI's `logit_bias` on both completion endpoints, through the official SDK.

OpenAI's semantics (and vLLM's): `{"token id": bias}`, the bias in [-100, 100] added to that
token's logit before sampling; +100 all but forces the token, -100 all but bans it. The
expected outputs come from the unbiased runs: a forced token repeats; with the greedy token
banned, the greedy pick becomes the unbiased run's second most likely token.
"""


import openai
import pytest

from conftest import API_KEY
from conftest import post as post_json

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"


def post(server, path, body):
    return post_json(server, path, body, headers=AUTH)


def token_id(server, text):
    """The id of `text`, which must be one token."""
    status, body = post(server, "/tokenize", {"content": text, "add_special": False})
    assert status == 200, body
    assert len(body["tokens"]) == 1, (text, body)
    return body["tokens"][0]


def detokenize(server, ids):
    status, body = post(server, "/detokenize", {"tokens": ids})
    assert status == 200, body
    return body["content"]


def chat(client, **kw):
    kw.setdefault("max_tokens", 6)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(
        model="kiln", messages=[{"role": "user", "content": QUESTION}], **kw
    )


def complete(client, **kw):
    kw.setdefault("max_tokens", 6)
    kw.setdefault("temperature", 0)
    return client.completions.create(model="kiln", prompt=PROMPT, **kw)


def test_plus_100_forces_the_token_on_both_endpoints(client, stream_client, server):
    forced = token_id(server, " banana")
    expected = detokenize(server, [forced] * 6)
    assert expected == " banana" * 6
    bias = {str(forced): 100}

    done = complete(client, logit_bias=bias)
    assert done.choices[0].text == expected
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 6
    streamed = "".join(
        c.choices[0].text
        for c in stream_client.completions.create(
            model="kiln", prompt=PROMPT, max_tokens=6, temperature=0, logit_bias=bias, stream=True
        )
        if c.choices
    )
    assert streamed == expected

    reply = chat(client, logit_bias=bias)
    assert reply.choices[0].message.content == expected
    assert reply.usage.completion_tokens == 6
    pieces = [
        c.choices[0].delta.content or ""
        for c in chat(client, logit_bias=bias, stream=True)
        if c.choices
    ]
    assert "".join(pieces) == expected

    # Sampling (temperature 1, several choices) is forced the same way.
    sampled = complete(client, logit_bias=bias, temperature=1.0, seed=7, n=3)
    assert [c.text for c in sampled.choices] == [expected] * 3


def test_minus_100_bans_the_greedy_token(client, stream_client, server):
    # The unbiased greedy reply, with the two most likely tokens at its first position.
    plain = chat(client, max_tokens=1, logprobs=True, top_logprobs=2)
    first = plain.choices[0].logprobs.content[0]
    best, second = first.top_logprobs[0], first.top_logprobs[1]
    assert first.token == best.token
    bias = {str(token_id(server, best.token)): -100}
    reply = chat(client, max_tokens=1, logprobs=True, top_logprobs=2, logit_bias=bias)
    token = reply.choices[0].logprobs.content[0].token
    assert token != best.token
    assert token == second.token
    pieces = [
        c.choices[0].delta.content or ""
        for c in chat(client, max_tokens=1, logit_bias=bias, stream=True)
        if c.choices
    ]
    assert "".join(pieces) == reply.choices[0].message.content

    plain = complete(client, max_tokens=1, logprobs=2)
    top = plain.choices[0].logprobs.top_logprobs[0]
    ranked = sorted(top.items(), key=lambda kv: -kv[1])
    assert ranked[0][0] == plain.choices[0].text
    bias = {str(token_id(server, plain.choices[0].text)): -100}
    done = complete(client, max_tokens=1, logit_bias=bias)
    assert done.choices[0].text != plain.choices[0].text
    assert done.choices[0].text == ranked[1][0]
    streamed = "".join(
        c.choices[0].text
        for c in stream_client.completions.create(
            model="kiln", prompt=PROMPT, max_tokens=1, temperature=0, logit_bias=bias, stream=True
        )
        if c.choices
    )
    assert streamed == done.choices[0].text


@pytest.mark.parametrize(
    "bias, needle",
    [
        ({"5": 101}, "101"),
        ({"5": -100.5}, "-100.5"),
        ({"abc": 1}, '"abc"'),
        ({"-3": 1}, '"-3"'),
        ({"1.5": 1}, '"1.5"'),
        ({"49152": 1}, "49152"),
        ({"4294967296": 1}, "4294967296"),
        ({str(i): 1 for i in range(1025)}, "1024"),
        ({"5": "ten"}, "logit_bias"),
        ([5, 1], "logit_bias"),
    ],
)
def test_bad_biases_are_400_naming_the_field(client, bias, needle):
    for call in (chat, complete):
        with pytest.raises(openai.BadRequestError) as err:
            call(client, logit_bias=bias)
        assert err.value.status_code == 400
        assert err.value.type == "invalid_request_error"
        assert (err.value.param or "").startswith("logit_bias"), err.value.body
        assert needle in err.value.message, err.value.body


def test_the_edges_and_null_are_accepted(client):
    plain = complete(client).choices[0].text
    assert complete(client, logit_bias={}).choices[0].text == plain
    assert complete(client, logit_bias=None).choices[0].text == plain
    edges = complete(client, logit_bias={"5": 100, "6": -100})
    assert edges.usage.completion_tokens == 6


def test_beam_search_refuses_a_bias(client):
    with pytest.raises(openai.BadRequestError) as err:
        complete(client, logit_bias={"5": 1}, extra_body={"num_beams": 2})
    assert err.value.param == "logit_bias"
    assert "beam search" in err.value.message
