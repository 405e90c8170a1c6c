"""The Responses API (`/v1/responses`) through `kiln serve` with the official OpenAI SDK (strict
response validation), on the default model (SmolLM2-135M-Instruct).

A response is a chat turn by another name: `instructions` are the system message and `input`
(a string, or a list of items) the conversation, so every greedy answer must equal kiln's own
`/v1/chat/completions` answer for the same conversation, with the same token counts. Stored
responses (`store`, on by default) chain through `previous_response_id` (the earlier turns'
input and output, but not their `instructions`, as OpenAI does), come back from
`GET /v1/responses/{id}` and its `input_items`, and go with `DELETE`. Streams must arrive in
OpenAI's event order, `sequence_number` counting from 0, and the SDK's own helper
(`responses.stream`) must rebuild the same response from them.

The small model cannot choose tools reliably, so function calls are forced (`tool_choice`
`required` or a named function: the grammar makes every call valid under its schema, which
`jsonschema` checks), and their results go back as `function_call_output` items, with
`previous_response_id` or with the call itself in `input`; the answer after them is asked for
with `tool_choice: none` (with `auto`, the generic tool format may call again).
"""

import json
import time
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from conftest import ROOT, KilnServer, sdk_client

MAX = 48
INSTRUCTIONS = "You are a terse assistant. Answer in one sentence."
QUESTION = "What is the capital of France?"
ASK = "What is the weather in Paris?"
RESULT = "18 degrees and sunny"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": WEATHER,
        "strict": True,
    }
]
# The same tool as /v1/chat/completions takes it.
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER},
    }
]
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "country": {"type": "string", "enum": ["France", "Norway", "Peru"]},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}
CITY_FORMAT = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
CITY_QUESTION = "Which city is the capital of France, and in which country is it? Answer in JSON."


class City(pydantic.BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    country: Literal["France", "Norway", "Peru"]


def respond(client, **kw):
    """A greedy response of at most MAX tokens (unless `kw` says otherwise)."""
    kw.setdefault("model", "kiln")
    kw.setdefault("max_output_tokens", MAX)
    kw.setdefault("temperature", 0)
    return client.responses.create(**kw)


def chat(client, messages, max_tokens=MAX, **kw):
    """kiln's greedy chat completion of `messages`: the reference answer."""
    return client.chat.completions.create(
        model="kiln", messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )


def check_response(r, max_tokens=MAX):
    """The fields every finished response has: its id, status and usage."""
    assert r.object == "response"
    assert r.id.startswith("resp_") and len(r.id) > len("resp_"), r.id
    assert r.error is None
    assert abs(time.time() - r.created_at) < 600, r.created_at
    if r.status == "completed":
        assert r.incomplete_details is None, r
    else:
        assert r.status == "incomplete", r
        assert r.incomplete_details.reason == "max_output_tokens", r
        assert r.usage.output_tokens == max_tokens, r.usage
    usage = r.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= max_tokens, usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens, usage
    cached = usage.input_tokens_details.cached_tokens
    assert isinstance(cached, int) and 0 <= cached <= usage.input_tokens, usage
    assert usage.output_tokens_details.reasoning_tokens == 0, usage


def message_text(r):
    """The text of a response whose whole output is one assistant message of one text part."""
    assert len(r.output) == 1, r.output
    item = r.output[0]
    assert item.type == "message" and item.role == "assistant", item
    assert item.id, item
    assert item.status == ("completed" if r.status == "completed" else "incomplete"), item
    assert len(item.content) == 1, item.content
    part = item.content[0]
    assert part.type == "output_text" and part.annotations == [], part
    assert r.output_text == part.text
    return part.text


def check_like_chat(r, reference, max_tokens=MAX):
    """`r` answers as the chat completion `reference` did: same text, tokens and ending."""
    check_response(r, max_tokens)
    choice = reference.choices[0]
    assert message_text(r) == choice.message.content
    assert r.usage.input_tokens == reference.usage.prompt_tokens
    assert r.usage.output_tokens == reference.usage.completion_tokens
    assert r.status == {"stop": "completed", "length": "incomplete"}[choice.finish_reason]


def forced_call(client, **kw):
    """A response forced to call get_weather once: (the response, its call)."""
    kw.setdefault("tool_choice", "required")
    r = respond(client, input=ASK, tools=TOOLS, parallel_tool_calls=False, max_output_tokens=64, **kw)
    check_response(r, 64)
    assert r.status == "completed", r
    assert [item.type for item in r.output] == ["function_call"], r.output
    call = r.output[0]
    check_call(call)
    assert r.output_text == ""
    return r, call


def check_call(call):
    assert call.name == "get_weather", call
    assert call.call_id.startswith("call_") and len(call.call_id) > len("call_"), call
    assert call.id, call
    assert call.status == "completed", call
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER)
    return arguments


def status_error(call):
    """The 4xx error `call` raises."""
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    assert 400 <= caught.value.status_code < 500, caught.value
    return caught.value


# --- One response --------------------------------------------------------------------------


def test_a_response_is_one_assistant_message(client):
    r = respond(client, input=QUESTION, instructions=INSTRUCTIONS)
    check_response(r)
    assert message_text(r)
    # The request's settings come back in the response, with OpenAI's defaults for the rest.
    assert r.instructions == INSTRUCTIONS
    assert r.max_output_tokens == MAX
    assert r.temperature == 0
    assert r.previous_response_id is None
    assert r.tools == [] and r.tool_choice == "auto" and r.parallel_tool_calls is True


@pytest.mark.parametrize("instructions", [INSTRUCTIONS, None], ids=["instructions", "none"])
def test_greedy_output_equals_chat_completions(client, instructions):
    system = [{"role": "system", "content": instructions}] if instructions else []
    reference = chat(client, system + [{"role": "user", "content": QUESTION}])
    kw = {"instructions": instructions} if instructions else {}
    check_like_chat(respond(client, input=QUESTION, **kw), reference)


@pytest.mark.parametrize(
    "items",
    [
        [{"role": "user", "content": QUESTION}],
        [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        [
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is the capital "},
                    {"type": "input_text", "text": "of France?"},
                ],
            }
        ],
    ],
    ids=["easy", "typed", "two-parts"],
)
def test_input_items_equal_the_string(client, items):
    text = respond(client, input=QUESTION, instructions=INSTRUCTIONS)
    listed = respond(client, input=items, instructions=INSTRUCTIONS)
    check_response(listed)
    assert message_text(listed) == message_text(text)
    assert listed.usage.input_tokens == text.usage.input_tokens


@pytest.mark.parametrize("role", ["system", "developer"])
def test_a_system_message_in_input_equals_instructions(client, role):
    text = respond(client, input=QUESTION, instructions=INSTRUCTIONS)
    listed = respond(client, input=[{"role": role, "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
    assert message_text(listed) == message_text(text)
    assert listed.usage.input_tokens == text.usage.input_tokens


def test_earlier_turns_in_input_equal_chat_completions(client):
    turns = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Nice to meet you, Ada."},
        {"role": "user", "content": "What is my name?"},
    ]
    check_like_chat(respond(client, input=turns), chat(client, turns))


def test_max_output_tokens_cuts_the_answer(client):
    r = respond(client, input=QUESTION, max_output_tokens=3)
    check_response(r, 3)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    check_like_chat(r, chat(client, [{"role": "user", "content": QUESTION}], max_tokens=3), 3)


# --- Stored responses ------------------------------------------------------------------------


def test_previous_response_id_continues_the_conversation(client):
    r1 = respond(client, input="My name is Ada.", instructions=INSTRUCTIONS)
    check_response(r1)
    first = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": r1.output_text}]
    ask = {"role": "user", "content": "What is my name?"}

    # The earlier instructions are not carried over: this turn's own go first.
    other = "Reply with the name only."
    r2 = respond(client, previous_response_id=r1.id, input="What is my name?", instructions=other)
    assert r2.previous_response_id == r1.id
    assert r2.instructions == other
    check_like_chat(r2, chat(client, [{"role": "system", "content": other}, *first, ask]))

    # Without instructions of its own, the turn has no system message at all.
    r3 = respond(client, previous_response_id=r1.id, input="What is my name?")
    assert r3.instructions is None
    check_like_chat(r3, chat(client, [*first, ask]))

    # The chain goes all the way back.
    r4 = respond(client, previous_response_id=r2.id, input="Thank you!")
    second = [*first, ask, {"role": "assistant", "content": r2.output_text}]
    check_like_chat(r4, chat(client, [*second, {"role": "user", "content": "Thank you!"}]))


def test_a_stored_response_comes_back(client):
    r = respond(client, input=QUESTION, instructions=INSTRUCTIONS)
    got = client.responses.retrieve(r.id)
    check_response(got)
    assert got.id == r.id and got.status == r.status
    assert got.created_at == r.created_at
    assert got.instructions == INSTRUCTIONS
    assert got.output_text == r.output_text
    assert [item.id for item in got.output] == [item.id for item in r.output]
    assert got.usage == r.usage


def user_text(item):
    assert item.type == "message" and item.role == "user", item
    assert item.id, item
    assert all(part.type == "input_text" for part in item.content), item
    return "".join(part.text for part in item.content)


def test_input_items_list_what_was_sent(client):
    r1 = respond(client, input="My name is Ada.", instructions=INSTRUCTIONS)
    page = client.responses.input_items.list(r1.id, order="asc")
    assert page.has_more is False
    # The instructions are no input item; the string is one user message.
    assert [user_text(item) for item in page.data] == ["My name is Ada."]

    r2 = respond(client, previous_response_id=r1.id, input=[{"role": "user", "content": "What is my name?"}])
    ascending = client.responses.input_items.list(r2.id, order="asc").data
    assert ascending and user_text(ascending[-1]) == "What is my name?"
    # Newest first unless asked otherwise, as OpenAI lists them.
    descending = client.responses.input_items.list(r2.id).data
    assert [item.id for item in descending] == [item.id for item in reversed(ascending)]
    assert len({item.id for item in ascending}) == len(ascending)


def test_a_deleted_response_is_gone(client):
    r = respond(client, input=QUESTION, max_output_tokens=4)
    raw = client.responses.with_raw_response.delete(r.id)
    assert raw.status_code == 200
    assert json.loads(raw.text) == {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    # The SDK's own call returns nothing.
    other = respond(client, input=QUESTION, max_output_tokens=4)
    assert client.responses.delete(other.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(other.id)


def test_an_unknown_previous_response_is_a_4xx_naming_it(client):
    missing = "resp_" + "0" * 48
    error = status_error(lambda: respond(client, previous_response_id=missing, input="Hi"))
    assert missing in error.message, error.body


def test_an_unstored_response_cannot_be_retrieved_or_continued(client):
    r = respond(client, input=QUESTION, store=False, max_output_tokens=4)
    check_response(r, 4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    error = status_error(lambda: respond(client, previous_response_id=r.id, input="And then?"))
    assert r.id in error.message, error.body


# --- Streams ---------------------------------------------------------------------------------


def check_text_stream(events, max_tokens=MAX):
    """Checks a streamed message's events, in OpenAI's order; returns (text, final response)."""
    numbers = [e.sequence_number for e in events]
    assert numbers[0] == 0 and all(a < b for a, b in zip(numbers, numbers[1:])), numbers
    types = [e.type for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    deltas = types[len(head) : -len(tail) - 1]
    assert types[: len(head)] == head, types
    assert types[-len(tail) - 1 : -1] == tail, types
    assert deltas and set(deltas) == {"response.output_text.delta"}, types
    created, in_progress, added, part_added = events[:4]
    text_done, part_done, item_done, last = events[-4:]

    assert created.response.status == "in_progress" and created.response.output == []
    assert in_progress.response.status == "in_progress"
    assert in_progress.response.id == created.response.id == last.response.id
    check_response(last.response, max_tokens)
    assert last.type == {"completed": "response.completed", "incomplete": "response.incomplete"}[last.response.status]

    # The item and its part open empty: the deltas fill them.
    item = added.item
    assert item.type == "message" and item.role == "assistant" and item.status == "in_progress", item
    assert item.content == [], item
    assert part_added.part.type == "output_text" and part_added.part.text == "", part_added
    for e in events[3:-2]:
        assert (e.item_id, e.output_index, e.content_index) == (item.id, 0, 0), e
    assert added.output_index == item_done.output_index == 0

    text = "".join(e.delta for e in events[len(head) : -len(tail) - 1])
    assert text_done.text == text
    assert part_done.part.type == "output_text" and part_done.part.text == text
    assert item_done.item.id == item.id and item_done.item.status == last.response.output[0].status
    assert item_done.item.content[0].text == text
    assert message_text(last.response) == text
    assert last.response.output[0].id == item.id
    return text, last.response


def test_a_stream_arrives_in_order_and_equals_the_answer(client):
    whole = respond(client, input=QUESTION, instructions=INSTRUCTIONS)
    with client.responses.stream(
        model="kiln", input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=MAX, temperature=0
    ) as stream:
        events = list(stream)
        text, final = check_text_stream(events)
        if final.status == "completed":
            assert stream.get_final_response().output_text == text
    assert text == whole.output_text
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    # A streamed response is stored like any other.
    assert client.responses.retrieve(final.id).output_text == text


def test_a_raw_stream_arrives_in_order(client):
    whole = respond(client, input=QUESTION)
    with client.responses.create(model="kiln", input=QUESTION, max_output_tokens=MAX, temperature=0, stream=True) as s:
        events = list(s)
    text, _ = check_text_stream(events)
    assert text == whole.output_text


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(client):
    with client.responses.create(model="kiln", input=QUESTION, max_output_tokens=3, temperature=0, stream=True) as s:
        events = list(s)
    text, final = check_text_stream(events, 3)
    assert events[-1].type == "response.incomplete"
    assert final.usage.output_tokens == 3
    assert text == respond(client, input=QUESTION, max_output_tokens=3).output_text


def test_a_streamed_structured_answer_is_parsed(client):
    with client.responses.stream(
        model="kiln", input=CITY_QUESTION, text_format=City, max_output_tokens=64, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    text, _ = check_text_stream(events, 64)
    assert events[-1].type == "response.completed"
    assert isinstance(final.output_parsed, City)
    assert final.output_parsed == City.model_validate_json(text)


# --- Function tools --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "name": "get_weather"}], ids=["required", "named"]
)
def test_a_forced_call_is_a_function_call_item(client, choice):
    r, _ = forced_call(client, tool_choice=choice)
    assert r.parallel_tool_calls is False
    assert [(t.type, t.name) for t in r.tools] == [("function", "get_weather")]
    if isinstance(choice, str):
        assert r.tool_choice == choice
    else:
        assert (r.tool_choice.type, r.tool_choice.name) == ("function", "get_weather")


def test_auto_answers_in_text_or_calls(client):
    r = respond(client, input=ASK, tools=TOOLS, max_output_tokens=64)
    check_response(r, 64)
    for item in r.output:
        if item.type == "function_call":
            check_call(item)
        else:
            assert item.type == "message", item
            assert all(part.type == "output_text" for part in item.content), item


def test_a_tool_result_round_trips(client):
    """The call's result, sent after it (through previous_response_id, or with the call in
    `input`), is answered as chat completions answers the same tool turns."""
    r1, call = forced_call(client)
    reference = chat(
        client,
        [
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": RESULT},
        ],
        tools=CHAT_TOOLS,
        tool_choice="none",
    )
    output = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    kw = {"tools": TOOLS, "tool_choice": "none"}

    chained = respond(client, previous_response_id=r1.id, input=[output], **kw)
    check_like_chat(chained, reference)
    assert chained.tool_choice == "none"

    # The call as the SDK gave it back (its id, status and all), then its result.
    resent = respond(client, input=[{"role": "user", "content": ASK}, *[i.to_dict() for i in r1.output], output], **kw)
    check_like_chat(resent, reference)

    # The call written by hand, with only the fields OpenAI requires.
    bare = {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}
    by_hand = respond(client, input=[{"role": "user", "content": ASK}, bare, output], **kw)
    check_like_chat(by_hand, reference)

    # The second turn's input items are the result (and whatever it followed).
    items = client.responses.input_items.list(chained.id, order="asc").data
    last = items[-1]
    assert last.type == "function_call_output" and last.call_id == call.call_id, last
    assert last.output == RESULT and last.id and last.status == "completed", last


def test_a_streamed_call_arrives_as_argument_deltas(client):
    _, whole = forced_call(client, tool_choice={"type": "function", "name": "get_weather"})
    with client.responses.stream(
        model="kiln",
        input=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=64,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    numbers = [e.sequence_number for e in events]
    assert numbers[0] == 0 and all(a < b for a, b in zip(numbers, numbers[1:])), numbers
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"], types
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    deltas = events[3:-3]
    assert deltas and {e.type for e in deltas} == {"response.function_call_arguments.delta"}, types

    added, arguments_done, item_done, completed = events[2], events[-3], events[-2], events[-1]
    item = added.item
    assert item.type == "function_call" and item.name == "get_weather" and item.status == "in_progress", item
    assert item.call_id.startswith("call_") and item.id, item
    assert item.arguments == "", item  # the deltas fill it
    for e in [*deltas, arguments_done]:
        assert (e.item_id, e.output_index) == (item.id, 0), e
    arguments = "".join(e.delta for e in deltas)
    assert arguments_done.arguments == arguments
    assert item_done.output_index == 0
    assert (item_done.item.id, item_done.item.call_id) == (item.id, item.call_id)
    assert item_done.item.arguments == arguments and item_done.item.status == "completed"
    jsonschema.validate(json.loads(arguments), WEATHER)

    check_response(completed.response, 64)
    assert completed.response.status == "completed"
    assert [(o.type, o.call_id, o.arguments) for o in completed.response.output] == [
        ("function_call", item.call_id, arguments)
    ]
    # The SDK parses a strict tool's arguments; greedy, they are the unstreamed call's.
    assert final.output[0].parsed_arguments == json.loads(arguments)
    assert json.loads(arguments) == json.loads(whole.arguments)


# --- Structured output -----------------------------------------------------------------------


def test_a_json_schema_text_format_holds(client):
    r = respond(client, input=CITY_QUESTION, text={"format": CITY_FORMAT}, max_output_tokens=64)
    check_response(r, 64)
    assert r.status == "completed", r
    jsonschema.validate(json.loads(message_text(r)), CITY)
    assert (r.text.format.type, r.text.format.name) == ("json_schema", "city")
    reference = chat(
        client,
        [{"role": "user", "content": CITY_QUESTION}],
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}},
    )
    check_like_chat(r, reference, 64)


def test_the_sdk_parses_a_pydantic_model(client):
    r = client.responses.parse(
        model="kiln", input=CITY_QUESTION, text_format=City, max_output_tokens=64, temperature=0
    )
    assert r.status == "completed", r
    assert isinstance(r.output_parsed, City)
    assert r.output_parsed == City.model_validate_json(r.output_text)


# --- Errors ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_models():
    """A server of two models: only there is a model name unknown (one model answers to any)."""
    tiny = ROOT / "crates" / "models" / "tests" / "fixtures" / "llama-tiny"
    s = KilnServer("--model", "smol=default", "--model", f"tiny={tiny}")
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_model_is_a_404(two_models, stream):
    client = sdk_client(two_models)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="gpt-4o", input="Hi", max_output_tokens=2, stream=stream)
    assert caught.value.body["code"] == "model_not_found", caught.value.body
    assert caught.value.body["param"] == "model", caught.value.body


def test_max_output_tokens_of_zero_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        respond(client, input="Hi", max_output_tokens=0)
    assert caught.value.body["param"] == "max_output_tokens", caught.value.body


def test_namespaced_functions_are_called_and_hosted_tools_are_not_offered(client):
    """What the Codex CLI declares by default: a `namespace` of functions and the hosted
    `web_search`. The namespace's functions are offered (a call names its namespace); a hosted
    tool kiln cannot run is echoed but not offered."""
    r = respond(
        client,
        input="What is the weather in Paris?",
        tools=[
            {"type": "web_search"},
            {
                "type": "namespace",
                "name": "weather_ns",
                "description": "Weather tools.",
                "tools": [{k: v for k, v in TOOLS[0].items() if k != "strict"}],
            },
        ],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=120,
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1, r.output
    assert calls[0].name == "get_weather" and calls[0].namespace == "weather_ns"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    assert [t.type for t in r.tools] == ["web_search", "namespace"]


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {
                "input": [
                    {"role": "user", "content": "Hi"},
                    {"type": "function_call_output", "call_id": "call_nope", "output": "x"},
                ]
            },
            "input",
        ),
        ({"input": [{"type": "no_such_item", "text": "Hi"}]}, "input"),
        ({"tools": [{"name": "get_weather"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strng"}}}}, "text"),
    ],
    ids=["unmatched-call-output", "unknown-item", "untyped-tool", "unknown-function", "bad-schema"],
)
def test_bad_fields_are_400s_naming_them(client, fields, param):
    fields = {"input": "Hi", **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        respond(client, max_output_tokens=4, **fields)
    assert (caught.value.body.get("param") or "").startswith(param), caught.value.body
