"""Ollama's API (`/api/chat`, `/api/generate`, `/api/embed`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version`) driven by the official `ollama` Python client (0.6.3), on the default model
(SmolLM2-135M-Instruct: its chat template knows no tools, and it never thinks).

The client parses every answer into its pydantic models (`ChatResponse`, `ListResponse`, ...), so
a field of the wrong type or a missing required one (`message`, `models`, `embeddings`,
`model_info`) fails the call; its `ResponseError` carries the status and the `error` string of
Ollama's `{"error": "..."}`. Greedy answers equal kiln's OpenAI routes' for the same request
(`/v1/chat/completions` for chat and templated generate, `/v1/completions` for raw generate,
`/v1/embeddings` for embed), and `prompt_eval_count` equals their `usage.prompt_tokens`.
Streams are NDJSON (one object a line, Ollama's default when `stream` is absent); only the last
object is `done`, with the reason and the counts. `keep_alive: 0` unloads the model once the
answer is sent, and the next request loads it again (its own server, so as not to disturb the
shared one); an unknown name is 404 on a server of two models (one of one model answers to any
name).

The client has no `version()` method: `/api/version` is read through its HTTP client.
"""

import json
import re
import time
import urllib.request

import jsonschema
import ollama
import pytest

from conftest import API_KEY, ROOT, KilnServer, post, sdk_client

GREEDY = {"num_predict": 32, "temperature": 0}
SYSTEM = "You are a helpful assistant. Answer in one sentence."
QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
RAW_PROMPT = "The three primary colours are"
JSON_TOKENS = 400  # far above what the JSON answers need (test_structured_output.py's budget)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "celsius": {"type": "integer", "minimum": -50, "maximum": 60},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "celsius", "sunny"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city."}},
                "required": ["city"],
            },
        },
    }
]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TINY_QWEN = ROOT / "crates" / "models" / "tests" / "fixtures" / "qwen3-tiny"
DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


def ollama_client(server, **kw):
    """The official client for `server`, with the suite's key unless `headers` says otherwise."""
    kw.setdefault("headers", AUTH)
    return ollama.Client(host=server.url, timeout=120, **kw)


@pytest.fixture(scope="module")
def oc(server):
    return ollama_client(server)


@pytest.fixture(scope="module")
def name(oc):
    """The served model's name, as `/api/tags` lists it."""
    return oc.list().models[0].model


@pytest.fixture(scope="module")
def greedy_chat(oc, name):
    """The greedy non-streamed answer to MESSAGES."""
    return oc.chat(name, messages=MESSAGES, options=GREEDY)


def openai_chat(server, name, messages, max_tokens=GREEDY["num_predict"], **kw):
    return sdk_client(server).chat.completions.create(
        model=name, messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )


def check_final(r):
    """The counts and timings of a last (`done`) answer."""
    assert r.done is True, r
    assert r.done_reason in ("stop", "length"), r
    assert r.prompt_eval_count > 0 and r.eval_count > 0, r
    for field in DURATIONS:
        value = getattr(r, field)
        assert isinstance(value, int) and value >= 0, (field, r)
    assert r.total_duration > 0, r
    assert r.created_at, r


# --- Models: /api/version, /api/tags, /api/show, /api/ps -------------------------------------


def test_version(oc):
    r = oc._client.get("/api/version")  # the client has no version() of its own
    assert r.status_code == 200, r.text
    version = r.json()["version"]
    assert isinstance(version, str) and re.match(r"^\d+\.\d+\.\d+", version), version


def test_tags_list_the_served_model(oc, server):
    models = oc.list().models
    assert len(models) == 1, models
    [m] = models
    assert m.model == [x.id for x in sdk_client(server).models.list()][0]
    assert m.size > 0
    assert isinstance(m.digest, str) and m.digest
    assert m.modified_at is not None
    assert m.details.format == "gguf"
    assert m.details.family
    assert m.details.quantization_level == "Q4_1"


def test_show_has_details_template_capabilities_and_model_info(oc, name):
    r = oc.show(name)
    assert r.details.format == "gguf" and r.details.family
    assert r.details.quantization_level == "Q4_1"
    # The model's chat template (SmolLM2's is ChatML).
    assert isinstance(r.template, str) and "im_start" in r.template, r.template
    assert "completion" in r.capabilities, r.capabilities
    assert not {"thinking", "vision"} & set(r.capabilities), r.capabilities
    context = [k for k in r.modelinfo if k.endswith(".context_length")]
    assert context, r.modelinfo
    assert isinstance(r.modelinfo[context[0]], int) and r.modelinfo[context[0]] > 0


def test_ps_lists_the_loaded_model(oc, name):
    running = oc.ps().models
    assert [m.model for m in running] == [name], running
    assert running[0].size > 0
    # keep_alive as a duration string and as -1 (forever) is accepted and unloads nothing.
    for keep_alive in ("10m", -1):
        r = oc.chat(name, messages=MESSAGES, options={"num_predict": 2, "temperature": 0},
                    keep_alive=keep_alive)
        assert r.done, r
        assert [m.model for m in oc.ps().models] == [name]


# --- /api/chat -------------------------------------------------------------------------------


def test_chat_equals_the_openai_answer(greedy_chat, server, name):
    r = greedy_chat
    assert r.model == name
    assert r.message.role == "assistant"
    assert r.message.content, r
    assert not r.message.tool_calls and not r.message.thinking, r
    check_final(r)
    ref = openai_chat(server, name, MESSAGES)
    assert r.message.content == ref.choices[0].message.content
    assert r.done_reason == ref.choices[0].finish_reason
    assert r.prompt_eval_count == ref.usage.prompt_tokens
    assert r.eval_count == ref.usage.completion_tokens


def test_streamed_chat_joins_to_the_same_answer(oc, name, greedy_chat):
    chunks = list(oc.chat(name, messages=MESSAGES, options=GREEDY, stream=True))
    assert len(chunks) > 1
    for c in chunks[:-1]:
        assert c.done is False and c.done_reason is None and c.eval_count is None, c
        assert c.message.role == "assistant" and c.model == name, c
    check_final(chunks[-1])
    assert "".join(c.message.content or "" for c in chunks) == greedy_chat.message.content
    assert chunks[-1].prompt_eval_count == greedy_chat.prompt_eval_count
    assert chunks[-1].eval_count == greedy_chat.eval_count
    assert chunks[-1].done_reason == greedy_chat.done_reason


def test_without_stream_the_answer_is_ndjson(server, name, greedy_chat):
    """On the wire `stream` absent means streaming: application/x-ndjson, one object a line
    (no blank lines: the client parses every line), the last one `done`."""
    body = {"model": name, "messages": MESSAGES, "options": GREEDY}
    request = urllib.request.Request(server.url + "/api/chat", data=json.dumps(body).encode(),
                                     headers={**AUTH, "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        assert r.headers["Content-Type"].startswith("application/x-ndjson"), r.headers
        lines = r.read().decode().split("\n")
    assert lines[-1] == "", lines  # each object ends with a newline
    objects = [json.loads(line) for line in lines[:-1]]
    assert [o["done"] for o in objects] == [False] * (len(objects) - 1) + [True]
    assert "".join(o["message"].get("content", "") for o in objects) == greedy_chat.message.content
    assert objects[-1]["done_reason"] == greedy_chat.done_reason
    # With stream false: one JSON object.
    status, answer = post(server, "/api/chat", {**body, "stream": False}, headers=AUTH)
    assert status == 200 and answer["done"] is True, answer
    assert answer["message"]["content"] == greedy_chat.message.content


def test_num_predict_ends_with_length(oc, name, greedy_chat):
    r = oc.chat(name, messages=MESSAGES, options={"num_predict": 3, "temperature": 0})
    assert r.done_reason == "length", r
    assert r.eval_count == 3
    assert greedy_chat.message.content.startswith(r.message.content), r


def test_a_stop_word_ends_the_answer_before_it(oc, name, greedy_chat):
    text = greedy_chat.message.content
    words = [w for w in re.findall(r"[A-Za-z]{3,}", text) if text.index(w) > 0]
    assert words, text
    word = words[0]
    r = oc.chat(name, messages=MESSAGES, options={**GREEDY, "stop": [word]})
    assert r.done_reason == "stop", r
    assert r.message.content == text[: text.index(word)], (word, r)
    assert word not in r.message.content


def test_a_seed_repeats_a_sampled_answer(oc, name):
    options = {"num_predict": 32, "temperature": 0.8, "seed": 1234}
    first = oc.chat(name, messages=MESSAGES, options=options)
    again = oc.chat(name, messages=MESSAGES, options=options)
    assert first.message.content and first.message.content == again.message.content


# --- /api/generate ---------------------------------------------------------------------------


def test_generate_renders_system_and_prompt_as_chat_does(oc, name, greedy_chat):
    """Ollama renders `system` + `prompt` as the messages [system, user] through the model's
    template: the same prompt, the same greedy answer as /api/chat."""
    r = oc.generate(name, QUESTION, system=SYSTEM, options=GREEDY)
    assert r.model == name
    assert r.response, r
    check_final(r)
    assert r.response == greedy_chat.message.content
    assert r.prompt_eval_count == greedy_chat.prompt_eval_count
    chunks = list(oc.generate(name, QUESTION, system=SYSTEM, options=GREEDY, stream=True))
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done
    check_final(chunks[-1])
    assert "".join(c.response or "" for c in chunks) == r.response


def test_raw_generate_continues_the_prompt_as_completions_does(oc, name, server):
    r = oc.generate(name, RAW_PROMPT, raw=True, options=GREEDY)
    check_final(r)
    assert r.response, r
    ref = sdk_client(server).completions.create(
        model=name, prompt=RAW_PROMPT, max_tokens=GREEDY["num_predict"], temperature=0
    )
    assert r.response == ref.choices[0].text
    assert r.prompt_eval_count == ref.usage.prompt_tokens
    assert r.done_reason == ref.choices[0].finish_reason
    chunks = list(oc.generate(name, RAW_PROMPT, raw=True, options=GREEDY, stream=True))
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done
    assert chunks[-1].eval_count == r.eval_count
    assert "".join(c.response or "" for c in chunks) == r.response


# --- format ----------------------------------------------------------------------------------


def test_format_json_gives_json(oc, name, server):
    messages = [{"role": "user", "content": "Give a cat's name and age as JSON."}]
    options = {"num_predict": JSON_TOKENS, "temperature": 0}
    r = oc.chat(name, messages=messages, options=options, format="json")
    assert r.done_reason == "stop", r
    assert isinstance(json.loads(r.message.content), dict), r.message.content
    ref = openai_chat(server, name, messages, max_tokens=JSON_TOKENS,
                      response_format={"type": "json_object"})
    assert r.message.content == ref.choices[0].message.content


def test_format_schema_gives_valid_json(oc, name, server):
    messages = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]
    options = {"num_predict": JSON_TOKENS, "temperature": 0}
    r = oc.chat(name, messages=messages, options=options, format=WEATHER)
    assert r.done_reason == "stop", r
    jsonschema.validate(json.loads(r.message.content), WEATHER)
    ref = openai_chat(server, name, messages, max_tokens=JSON_TOKENS,
                      response_format={"type": "json_schema",
                                       "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}})
    assert r.message.content == ref.choices[0].message.content
    # generate takes `format` too.
    g = oc.generate(name, "What is the weather in Paris? Answer in JSON.", options=options, format=WEATHER)
    jsonschema.validate(json.loads(g.response), WEATHER)


# --- /api/embed ------------------------------------------------------------------------------


@pytest.mark.parametrize("texts", ["hello", ["a", "b"]])
def test_embed_equals_openai_embeddings(oc, name, server, texts):
    r = oc.embed(name, input=texts)
    inputs = [texts] if isinstance(texts, str) else texts
    assert len(r.embeddings) == len(inputs)
    assert len({len(v) for v in r.embeddings}) == 1 and len(r.embeddings[0]) > 0
    assert all(isinstance(x, float) for v in r.embeddings for x in v)
    ref = sdk_client(server).embeddings.create(model=name, input=inputs, encoding_format="float")
    for got, want in zip(r.embeddings, [d.embedding for d in ref.data]):
        assert len(got) == len(want)
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5
    assert r.prompt_eval_count == ref.usage.prompt_tokens


# --- tools -----------------------------------------------------------------------------------


def test_a_tool_result_is_answered_with_text(oc, name):
    """A conversation with the assistant's call and the tool's result, the tools offered: the
    client sends the call as `{"function": {"name", "arguments": {...}}}` (no id), drops the
    assistant's empty content, and sends the result as `{"role": "tool", "tool_name"}`."""
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"celsius": 18, "sky": "sunny"}', "tool_name": "get_weather"},
    ]
    r = oc.chat(name, messages=messages, tools=TOOLS, options=GREEDY)
    assert r.message.role == "assistant"
    assert r.message.content, r
    check_final(r)


# --- errors ----------------------------------------------------------------------------------


def response_error(call):
    with pytest.raises(ollama.ResponseError) as e:
        call()
    # `error` is the string of {"error": "..."} (a dict there would come through as a dict).
    assert isinstance(e.value.error, str), e.value.error
    return e.value


@pytest.mark.parametrize(
    "options, field",
    [({"temperature": -1}, "temperature"), ({"num_predict": "x"}, "num_predict"),
     ({"stop": 5}, "stop")],
)
def test_bad_options_are_400_naming_them(oc, name, options, field):
    for call in (lambda: oc.chat(name, messages=MESSAGES, options=options),
                 lambda: oc.generate(name, QUESTION, options=options)):
        e = response_error(call)
        assert e.status_code == 400, e
        assert field in e.error, e


@pytest.mark.parametrize(
    "body",
    [{"messages": "hello"}, {"messages": [{"content": "hello"}]},
     {"messages": [{"role": "user", "content": 5}]}, {"messages": {"role": "user"}}],
)
def test_malformed_messages_are_400(server, name, body):
    """Shapes the client's own models refuse before sending, sent as they are."""
    status, answer = post(server, "/api/chat", {"model": name, "stream": False, **body}, headers=AUTH)
    assert status == 400, answer
    assert isinstance(answer["error"], str) and answer["error"], answer


def test_malformed_json_is_400(server):
    status, answer = post(server, "/api/chat", b"{not json", headers=AUTH)
    assert status == 400, answer
    assert isinstance(answer["error"], str), answer


def test_no_key_is_401(server, monkeypatch):
    monkeypatch.delenv("OLLAMA_API_KEY", raising=False)  # the client would send it
    keyless = ollama_client(server, headers={})
    for call in (keyless.list, lambda: keyless.chat("any", messages=MESSAGES, options=GREEDY)):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 401, e.value


@pytest.fixture(scope="module")
def pair():
    """The default model and a tiny one: a server of several models knows its names."""
    s = KilnServer("--api-key", API_KEY, "--model", "smol=default", "--model", f"qwen={TINY_QWEN}")
    yield s
    assert s.stop() == 0, "".join(s.log)


def test_an_unknown_model_is_404_naming_it(pair):
    c = ollama_client(pair)
    assert [m.model for m in c.list().models] == ["smol", "qwen"]
    assert [m.model for m in c.ps().models] == ["smol"]  # qwen loads on first use
    missing = "no-such-model"
    for call in (lambda: c.chat(missing, messages=MESSAGES, options=GREEDY),
                 lambda: c.chat(missing, messages=MESSAGES, options=GREEDY, stream=True).__next__(),
                 lambda: c.generate(missing, QUESTION, options=GREEDY),
                 lambda: c.embed(missing, input="hello"),
                 lambda: c.show(missing)):
        e = response_error(call)
        assert e.status_code == 404, e
        assert missing in e.error, e


# --- keep_alive ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def own():
    s = KilnServer("--api-key", API_KEY)
    yield s
    assert s.stop() == 0, "".join(s.log)


def test_keep_alive_zero_unloads_and_the_next_request_loads_again(own):
    c = ollama_client(own)
    name = c.list().models[0].model
    assert [m.model for m in c.ps().models] == [name]
    first = c.chat(name, messages=MESSAGES, options=GREEDY, keep_alive=0)  # sent as 0.0
    assert first.message.content, first
    check_final(first)
    deadline = time.time() + 30
    while name in [m.model for m in c.ps().models] or own.metrics()[f'kiln_model_unloads_total{{model="{name}"}}'] < 1:
        assert time.time() < deadline, "keep_alive 0 did not unload the model"
        time.sleep(0.1)
    m = own.metrics()
    assert m[f'kiln_model_loaded{{model="{name}"}}'] == 0
    assert m[f'kiln_model_unloads_total{{model="{name}"}}'] == 1
    # Still listed (it is served), only not running.
    assert [x.model for x in c.list().models] == [name]
    again = c.chat(name, messages=MESSAGES, options=GREEDY)
    assert again.message.content == first.message.content
    assert [x.model for x in c.ps().models] == [name]
    assert own.metrics()[f'kiln_model_loads_total{{model="{name}"}}'] == 2
