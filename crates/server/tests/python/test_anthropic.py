"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) through
`kiln serve`, driven by the official `anthropic` SDK with strict response validation: every
reply and every streamed event is parsed into the SDK's pydantic models, and every error comes
back as the SDK's typed exception with Anthropic's body, `{"type": "error", "error": {"type",
"message"}}`.

The reference is kiln's own OpenAI chat endpoint: the Messages API renders the same
conversation through the same template, so its greedy text, prompt tokens and output tokens
equal `/v1/chat/completions`' for the same turns. Streams must carry what the SDK's
`messages.stream` accumulator needs: named SSE events (the SDK skips an event without an
`event:` line), `message_start` first, each block's start / deltas / stop by `index`,
`message_delta` with the stop reason and the output tokens, `message_stop` last.

The default model (SmolLM2-135M-Instruct) knows no tools and never thinks: tool use is forced
(`tool_choice` `tool` or `any`, kiln's generic JSON format held to the schema by a grammar,
checked with `jsonschema`), and `thinking` is accepted and changes nothing. Sampling is greedy
(`temperature` is no argument of this SDK's `messages.create`, so it goes in `extra_body`).

Usage follows Anthropic's meaning: `input_tokens` are the prompt tokens computed, and those
kiln's prefix cache already held are `cache_read_input_tokens` (the prompt is their sum, which
is what the comparisons with chat completions' `prompt_tokens` use).

The SDK (2.x) sends the key as `Authorization: Bearer`, and older clients and curl as
`x-api-key`: both are tested.
"""

import json
import re
import urllib.request

import anthropic
import jsonschema
import pytest

from conftest import API_KEY, ROOT, KilnServer, post

MODEL = "kiln"
MAX_TOKENS = 32
TOOL_TOKENS = 120  # a forced call in the generic format, pretty-printed as its prompt's example
GREEDY = {"temperature": 0}
SYSTEM = "You are a helpful assistant. Answer in one sentence."
QUESTION = "What is the capital of France?"
ASK = [{"role": "user", "content": QUESTION}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER},
    {"name": "get_time", "description": "The local time in a city.", "input_schema": TIME},
]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}


def prompt_tokens(usage):
    """The whole prompt: computed plus read from the prefix cache."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CHOICES = {
    "tool": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    "any": {"type": "any"},
}


def make_client(server, key=API_KEY):
    return anthropic.Anthropic(
        base_url=server.url, api_key=key, max_retries=0, timeout=120, _strict_response_validation=True
    )


@pytest.fixture(scope="module")
def claude(server):
    return make_client(server)


def create(claude, messages=ASK, **kw):
    """A greedy `messages.create` (`extra_body` merged over the greedy temperature)."""
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw["extra_body"] = {**GREEDY, **kw.get("extra_body", {})}
    return claude.messages.create(model=MODEL, messages=messages, **kw)


def stream(claude, messages=ASK, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    return claude.messages.stream(model=MODEL, messages=messages, extra_body=GREEDY, **kw)


def text_of(message):
    assert [b.type for b in message.content] == ["text"], message
    return message.content[0].text


@pytest.fixture(scope="module")
def greedy(claude):
    """The greedy reply to SYSTEM and QUESTION, the reference of several tests."""
    return create(claude, system=SYSTEM)


@pytest.fixture(scope="module")
def forced(claude):
    """The greedy reply to WEATHER_ASK with TOOLS under each of CHOICES, made once each."""
    done = {}

    def get(kind):
        if kind not in done:
            done[kind] = create(
                claude, WEATHER_ASK, tools=TOOLS, tool_choice=CHOICES[kind], max_tokens=TOOL_TOKENS
            )
        return done[kind]

    return get


def test_a_message_comes_back_in_anthropic_shape(claude, greedy):
    assert greedy.type == "message"
    assert greedy.role == "assistant"
    assert greedy.id.startswith("msg_") and len(greedy.id) > len("msg_")
    assert text_of(greedy)
    assert greedy.stop_reason in ("end_turn", "max_tokens")
    assert greedy.stop_sequence is None
    assert prompt_tokens(greedy.usage) > 0 and greedy.usage.output_tokens > 0
    again = create(claude, system=SYSTEM)
    assert text_of(again) == text_of(greedy)
    assert again.id != greedy.id
    # The same prompt again: kiln's prefix cache holds its whole pages, read not computed.
    assert again.usage.cache_read_input_tokens > 0
    assert prompt_tokens(again.usage) == prompt_tokens(greedy.usage)


def test_greedy_text_equals_the_chat_endpoints(greedy, client):
    """The same turns through `/v1/chat/completions`: the same prompt, the same tokens."""
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, *ASK],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = chat.choices[0]
    assert text_of(greedy) == choice.message.content
    assert prompt_tokens(greedy.usage) == chat.usage.prompt_tokens
    assert greedy.usage.output_tokens == chat.usage.completion_tokens
    assert greedy.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[choice.finish_reason]


def test_max_tokens_cuts_the_answer(claude, greedy):
    cut = create(claude, system=SYSTEM, max_tokens=3)
    assert cut.stop_reason == "max_tokens"
    assert cut.usage.output_tokens == 3
    assert text_of(greedy).startswith(text_of(cut))


def test_a_stop_sequence_ends_the_answer_before_it(claude, greedy):
    text = text_of(greedy)
    words = re.findall(r"[A-Za-z]{3,}", text)
    assert len(words) >= 3, text
    # A word from the middle on whose first occurrence is not at the very start.
    middle = len(words) // 2
    word = next(w for w in words[middle:] + words[:middle] if text.find(w) > 0)
    stopped = create(claude, system=SYSTEM, stop_sequences=["zzzz-never", word])
    assert stopped.stop_reason == "stop_sequence", stopped
    assert stopped.stop_sequence == word
    assert text_of(stopped) == text[: text.find(word)]
    assert stopped.usage.output_tokens <= greedy.usage.output_tokens


def test_text_blocks_equal_the_string_forms(claude, greedy, client):
    blocks = create(
        claude,
        [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
        system=[{"type": "text", "text": SYSTEM}],
    )
    assert text_of(blocks) == text_of(greedy)
    assert prompt_tokens(blocks.usage) == prompt_tokens(greedy.usage)
    # Several blocks join as the chat endpoint joins text parts.
    system = ["You are a helpful assistant. ", "Answer in one sentence."]
    question = ["What is the capital ", "of France?"]
    several = create(
        claude,
        [{"role": "user", "content": [{"type": "text", "text": t} for t in question]}],
        system=[{"type": "text", "text": t} for t in system],
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": [{"type": "text", "text": t} for t in system]},
            {"role": "user", "content": [{"type": "text", "text": t} for t in question]},
        ],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert text_of(several) == chat.choices[0].message.content
    assert prompt_tokens(several.usage) == chat.usage.prompt_tokens


def test_streamed_text_equals_the_message(claude, greedy):
    with stream(claude, system=SYSTEM) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) >= 1
    assert "".join(pieces) == text_of(greedy)
    assert text_of(final) == text_of(greedy)
    assert final.id.startswith("msg_")
    assert final.stop_reason == greedy.stop_reason
    assert prompt_tokens(final.usage) == prompt_tokens(greedy.usage)
    assert final.usage.output_tokens == greedy.usage.output_tokens


def sse_events(server, body, headers):
    """[(event name, data)] of a raw streamed request, after checking its content type."""
    request = urllib.request.Request(
        server.url + "/v1/messages",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    events, name, data = [], None, []
    with urllib.request.urlopen(request, timeout=120) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream"), r.headers
        for raw in r:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event:"):
                name = line[len("event:"):].strip()
            elif line.startswith("data:"):
                data.append(line[len("data:"):].removeprefix(" "))
            elif not line and (name or data):
                events.append((name, json.loads("\n".join(data))))
                name, data = None, []
    return events


def test_stream_events_arrive_in_order(claude, greedy, server):
    events = list(create(claude, system=SYSTEM, stream=True))
    types = [e.type for e in events]  # the SDK drops `ping` events itself
    assert types[:2] == ["message_start", "content_block_start"], types
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"], types
    assert len(types) > 5 and set(types[2:-3]) == {"content_block_delta"}, types
    start = events[0].message
    assert start.id.startswith("msg_") and start.role == "assistant" and start.type == "message"
    assert start.content == [] and start.stop_reason is None
    assert prompt_tokens(start.usage) == prompt_tokens(greedy.usage)
    block = events[1]
    assert block.index == 0 and block.content_block.type == "text" and block.content_block.text == ""
    deltas = events[2:-3]
    assert all(d.index == 0 and d.delta.type == "text_delta" for d in deltas)
    assert "".join(d.delta.text for d in deltas) == text_of(greedy)
    assert events[-3].index == 0
    end = events[-2]
    assert end.delta.stop_reason == greedy.stop_reason and end.delta.stop_sequence is None
    assert end.usage.output_tokens == greedy.usage.output_tokens
    # On the wire: every event named as its data's type (pings included), an `x-api-key` key.
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "system": SYSTEM, "messages": ASK, "stream": True, **GREEDY}
    raw = sse_events(server, body, {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"})
    assert all(name == data["type"] for name, data in raw), raw
    assert [n for n, _ in raw if n != "ping"] == types


def check_call(block, name=None):
    assert block.type == "tool_use"
    assert block.id.startswith("toolu_") and len(block.id) > len("toolu_")
    assert block.name in SCHEMAS and (name is None or block.name == name)
    assert isinstance(block.input, dict)
    jsonschema.validate(block.input, SCHEMAS[block.name])


@pytest.mark.parametrize("kind", ["tool", "any"])
def test_a_forced_tool_call_round_trips(claude, forced, kind):
    reply = forced(kind)
    assert reply.stop_reason == "tool_use", reply
    calls = [b for b in reply.content if b.type == "tool_use"]
    assert calls and len(calls) == len(reply.content), reply
    for call in calls:
        check_call(call, "get_weather" if kind == "tool" else None)
    if kind == "tool":
        assert len(calls) == 1  # disable_parallel_tool_use
    assert len({c.id for c in calls}) == len(calls)
    # The SDK's own blocks back as the assistant turn, each call's result in the user turn.
    history = WEATHER_ASK + [
        {"role": "assistant", "content": reply.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": c.id, "content": "18 degrees and sunny"} for c in calls
            ],
        },
    ]
    answer = create(claude, history, tools=TOOLS, tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens"), answer
    assert text_of(answer)


def test_a_streamed_tool_call_arrives_as_input_json_deltas(claude, forced):
    with stream(
        claude, WEATHER_ASK, tools=TOOLS, tool_choice=CHOICES["tool"], max_tokens=TOOL_TOKENS
    ) as s:
        events = list(s)
        final = s.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert len(starts) == 1, events
    start = starts[0]
    assert start.index == 0
    assert start.content_block.type == "tool_use" and start.content_block.name == "get_weather"
    assert start.content_block.id.startswith("toolu_")
    assert start.content_block.input == {}
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert deltas and all(d.index == 0 and d.delta.type == "input_json_delta" for d in deltas)
    arguments = json.loads("".join(d.delta.partial_json for d in deltas))
    jsonschema.validate(arguments, WEATHER)
    assert [e.type for e in events if e.type in ("content_block_stop", "message_delta", "message_stop")] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert final.stop_reason == "tool_use"
    assert len(final.content) == 1
    check_call(final.content[0], "get_weather")
    assert final.content[0].id == start.content_block.id
    assert final.content[0].input == arguments == forced("tool").content[0].input


@pytest.mark.parametrize("with_tools", [False, True], ids=["plain", "tools"])
def test_count_tokens_equals_the_messages_input_tokens(claude, greedy, forced, with_tools):
    if with_tools:
        counted = claude.messages.count_tokens(
            model=MODEL, messages=WEATHER_ASK, tools=TOOLS, tool_choice=CHOICES["tool"]
        )
        assert counted.input_tokens == prompt_tokens(forced("tool").usage)
    else:
        counted = claude.messages.count_tokens(model=MODEL, messages=ASK, system=SYSTEM)
        assert counted.input_tokens == prompt_tokens(greedy.usage)


@pytest.mark.parametrize(
    "thinking",
    [{"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}, {"type": "disabled"}],
    ids=["enabled", "adaptive", "disabled"],
)
def test_thinking_is_accepted_and_changes_nothing(claude, greedy, thinking):
    """SmolLM2's template has no thinking switch: no thinking block, the same greedy text."""
    reply = create(claude, system=SYSTEM, thinking=thinking)
    assert text_of(reply) == text_of(greedy)


def error_body(caught, kind):
    body = caught.value.body
    assert body["type"] == "error", body
    assert body["error"]["type"] == kind, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return body["error"]["message"]


def test_a_wrong_key_is_a_401(server):
    with pytest.raises(anthropic.AuthenticationError) as caught:
        create(make_client(server, key="sk-wrong"), max_tokens=2)
    error_body(caught, "authentication_error")
    # The `x-api-key` header: the right key answers, a wrong one or none is a 401.
    body = {"model": MODEL, "max_tokens": 2, "messages": ASK, **GREEDY}
    version = {"anthropic-version": "2023-06-01"}
    status, reply = post(server, "/v1/messages", body, {"x-api-key": API_KEY, **version})
    assert status == 200 and reply["type"] == "message", reply
    for headers in ({"x-api-key": "sk-wrong", **version}, version):
        status, reply = post(server, "/v1/messages", body, headers)
        assert status == 401 and reply["type"] == "error", reply
        assert reply["error"]["type"] == "authentication_error", reply


@pytest.fixture(scope="module")
def pair():
    """Two models (a tiny one loaded at start, the default on first use): names are checked."""
    tiny = ROOT / "crates" / "models" / "tests" / "fixtures" / "llama-tiny"
    s = KilnServer("--model", f"tiny={tiny}", "--model", "smol=default")
    yield s
    assert s.stop() == 0, "".join(s.log)


def test_an_unknown_model_is_a_404(pair):
    with pytest.raises(anthropic.NotFoundError) as caught:
        make_client(pair).messages.create(model="claude-opus-4-1", max_tokens=2, messages=ASK)
    assert "claude-opus-4-1" in error_body(caught, "not_found_error")


@pytest.mark.parametrize(
    "fields",
    [
        # Not `0`: Anthropic's API takes `max_tokens: 0` (a prompt-cache warm-up, no output).
        {"max_tokens": -1},
        {"messages": [{"role": "tool", "content": "sunny"}]},
        {"messages": [{"role": "user", "content": [{"type": "bogus", "text": QUESTION}]}]},
    ],
    ids=["max_tokens", "role", "block_type"],
)
def test_bad_requests_are_400s_in_anthropic_shape(claude, fields):
    with pytest.raises(anthropic.BadRequestError) as caught:
        create(claude, **fields)
    error_body(caught, "invalid_request_error")


def test_a_result_for_an_unknown_tool_use_is_a_400_naming_it(claude):
    history = WEATHER_ASK + [
        {"role": "assistant", "content": "Let me look."},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope42", "content": "sunny"}]},
    ]
    with pytest.raises(anthropic.BadRequestError) as caught:
        create(claude, history, tools=TOOLS)
    assert "toolu_nope42" in error_body(caught, "invalid_request_error")
