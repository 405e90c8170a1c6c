"""`kiln serve` on each model family's tiny fixture, HF folders and llama.cpp GGUFs alike.

Each server gives the CLI's greedy answers: a completion equals `kiln generate`'s text and
token counts, and (for a model with a chat template) a chat reply equals `kiln chat`'s. No
family has code of its own in the server or the engine; this checks they need none.
"""

import json

import pytest
from openai import OpenAI

from conftest import ROOT, KilnServer, kiln

FIXTURES = ROOT / "crates" / "models" / "tests" / "fixtures"

# (model path under the fixtures, whether it has a chat template). mistral-tiny has no
# tokenizer, which the server needs.
MODELS = [
    ("qwen2-tiny", True),
    ("gguf/qwen3-tiny.q8_0.gguf", True),
    ("gemma2-tiny", True),
    ("gguf/gemma2-tiny.q8_0.gguf", True),
    ("gemma3-mm-tiny", True),
    ("phi3-tiny", True),
    ("gguf/phi3-tiny.q8_0.gguf", True),
    ("gpt-bigcode-tiny", False),
    ("gguf/gpt-bigcode-tiny.f32.gguf", False),
    ("llama2-tiny", True),
]


@pytest.mark.parametrize("name,chat", MODELS, ids=[m[0] for m in MODELS])
def test_each_family_serves_what_the_cli_generates(name, chat):
    model = str(FIXTURES / name)
    server = KilnServer("--model", model, "--max-batch", "4")
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60,
                        _strict_response_validation=True)
        prompt = [5, 17, 42, 8, 23]
        done = client.completions.create(model="kiln", prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
        cli = json.loads(kiln("generate", "--token-ids", "5,17,42,8,23", "--model", model, "--temperature", "0",
                              "-n", "12", "--ignore-eos", "--json", "-q"))
        assert done.usage.completion_tokens == len(cli["tokens"]) == 12
        # The server's text skips special tokens (as vLLM's does); `kiln generate` writes them
        # out, and a random tiny model may emit SentencePiece's `<unk>`.
        assert done.choices[0].text == cli["text"].replace("<unk>", "")
        if chat:
            reply = client.chat.completions.create(
                model="kiln", messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=12,
                temperature=0)
            said = kiln("chat", "Tell me a story", "--model", model, "--temperature", "0", "--max-tokens", "12")
            assert reply.choices[0].message.content == said.removesuffix("\n")
    finally:
        assert server.stop() == 0, "".join(server.log)
