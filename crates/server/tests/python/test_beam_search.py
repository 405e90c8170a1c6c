"""Beam search through `/v1/completions`' extension fields (`num_beams`, `length_penalty`,
`early_stopping`; `n` hypotheses come back as the choices): on the exact path (`--dtype f32`)
the choices are transformers' hypotheses for SmolLM2 (crates/models/tests/fixtures/smollm2/
beam_reference.json, written by scripts/reference/make_beam_fixtures.py), and settings beam
search cannot take are a 400 naming their field."""

import json

import openai
import pytest
from openai import OpenAI

from conftest import ROOT, KilnServer

REFERENCE = ROOT / "crates/models/tests/fixtures/smollm2/beam_reference.json"


def detokenize(server, tokens):
    import urllib.request

    request = urllib.request.Request(
        server.url + "/detokenize",
        data=json.dumps({"tokens": tokens}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request) as response:
        return json.load(response)["content"]


def test_beam_search_returns_transformers_hypotheses():
    cases = json.loads(REFERENCE.read_text())["cases"]
    # Several hypotheses, one ended by EOS and some by length, `early_stopping="never"`.
    case = next(c for c in cases if c["early_stopping"] == "never")
    server = KilnServer("--dtype", "f32")
    try:
        client = OpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120,
            _strict_response_validation=True,
        )
        reply = client.completions.create(
            model="kiln",
            prompt=case["prompt_ids"],
            max_tokens=case["max_new_tokens"],
            n=case["num_return_sequences"],
            extra_body={
                "num_beams": case["num_beams"],
                "length_penalty": case["length_penalty"],
                "early_stopping": case["early_stopping"],
            },
        )
        expected = [
            (detokenize(server, o["tokens"]), "stop" if o["eos"] else "length")
            for o in case["outputs"]
        ]
        got = [(c.text, c.finish_reason) for c in reply.choices]
        assert got == expected
        assert [c.index for c in reply.choices] == list(range(len(expected)))
        assert reply.usage.completion_tokens == sum(len(o["tokens"]) for o in case["outputs"])
        assert server.wait_idle()["kiln_requests_running"] == 0
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"num_beams": 2, "n": 3}, "n"),
        ({"num_beams": 0}, "num_beams"),
        ({"num_beams": 2, "stream": True}, "stream"),
        ({"num_beams": 2, "logprobs": 1}, "logprobs"),
        ({"num_beams": 2, "stop": ["x"]}, "stop"),
        ({"num_beams": 2, "presence_penalty": 0.5}, "presence_penalty"),
        ({"num_beams": 2, "early_stopping": "sometimes"}, "early_stopping"),
        ({"length_penalty": 2.0}, "length_penalty"),
        ({"num_beams": 64, "max_tokens": 8000}, "max_tokens"),
    ],
)
def test_settings_beam_search_cannot_take_are_refused(client, fields, param):
    body = {"model": "kiln", "prompt": "Hello", "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/completions", body=body, cast_to=object)
    assert refused.value.param == param, refused.value.message
