"""Reasoning output: `<think>…</think>` in `message.reasoning_content` / `delta.reasoning_content`.

The default model does not think on its own, so the tests make it: a regular expression
(kiln's structured output) forces an output of the shape a Qwen3 or DeepSeek-R1 model writes,
`<think>\\n…\\n</think>\\n\\n…`. The expected split is the one vLLM's and llama.cpp's reasoning
parsers give: the text between the tags (trimmed) is the reasoning, the rest (leading
whitespace dropped) is the answer.
"""

import re

import pytest

from conftest import API_KEY, KilnServer, sdk_client

THINKING = r"<think>\n[a-z]{2,8}( [a-z]{2,8}){1,5}\n</think>\n\n[A-Z][a-z]{2,8}( [a-z]{2,8}){1,4}\."
SHAPE = re.compile(r"<think>\n(?P<reasoning>[^\n]*)\n</think>\n\n(?P<answer>.*)", re.S)
MESSAGES = [{"role": "user", "content": "Think first, then tell me a colour."}]


@pytest.fixture(scope="module")
def servers():
    separate = KilnServer("--reasoning-format", "separate", "--api-key", API_KEY)
    plain = KilnServer("--api-key", API_KEY)  # auto: SmolLM2's template has no <think>
    yield separate, plain
    separate.stop()
    plain.stop()


def ask(client, **kwargs):
    return client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=80,
        extra_body={"regex": THINKING},
        **kwargs,
    )


@pytest.mark.parametrize("seed", [None, 3])
def test_reasoning_is_split_from_the_answer(servers, seed):
    separate, plain = servers
    sampling = {"temperature": 1.0, "seed": seed} if seed is not None else {"temperature": 0}
    whole = ask(sdk_client(plain), **sampling).choices[0].message
    # Without the split the tags stay in the content, and no reasoning field is sent.
    m = SHAPE.fullmatch(whole.content)
    assert m, whole.content
    assert getattr(whole, "reasoning_content", None) is None
    split = ask(sdk_client(separate), **sampling).choices[0]
    assert split.finish_reason == "stop"
    assert split.message.reasoning_content == m["reasoning"].strip()
    assert split.message.content == m["answer"]


def test_streamed_reasoning_arrives_in_its_own_deltas(servers):
    separate, _ = servers
    whole = ask(sdk_client(separate), temperature=0).choices[0].message
    reasoning, content = "", ""
    for chunk in ask(sdk_client(separate, strict=False), temperature=0, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            # No tag ever reaches either field, however the tokens cut it.
            assert "think>" not in (getattr(delta, "reasoning_content", None) or "")
            assert "think>" not in (delta.content or "")
    assert reasoning == whole.reasoning_content
    assert content == whole.content


def test_an_answer_cut_inside_its_reasoning_has_no_content(servers):
    separate, _ = servers
    choice = sdk_client(separate).chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=14,
        temperature=0,
        extra_body={"regex": r"<think>\nwell[a-z]{40,60}\n</think>\n\nYes\."},
    ).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None
    assert choice.message.reasoning_content
