"""Tool calling through `kiln serve` with the official OpenAI SDK (strict response validation)
and the `openai-agents` SDK as a real client, on the default model (SmolLM2-135M-Instruct, whose
chat template knows no tools: kiln's generic JSON format).

The small model cannot choose tools reliably, so the tests force the choice (`tool_choice`
`required` or a named function): the grammar then makes every call name an offered function
with arguments valid under its schema, which the tests check with `jsonschema`. Streamed calls
must arrive as OpenAI streams them: per call a first delta with `index`, `id`, `type` and the
name, then the arguments in pieces, and `finish_reason: tool_calls` at the end.
"""

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pytest

MAX_TOKENS = 120
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
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The local time in a city.", "parameters": TIME},
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_call(call, name=None):
    assert call.type == "function"
    assert call.id.startswith("call_") and len(call.id) > len("call_")
    assert call.function.name in SCHEMAS
    if name is not None:
        assert call.function.name == name
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_required_calls_come_back_typed(client):
    reply = client.chat.completions.create(
        model="kiln",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.role == "assistant"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])


def test_a_named_function_is_the_one_called(client):
    name = "get_time"
    reply = client.chat.completions.create(
        model="kiln",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": name}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        check_call(call, name)


def test_streamed_calls_arrive_name_first_then_arguments_in_pieces(client):
    stream = client.chat.completions.create(
        model="kiln",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    calls = {}
    finish = []
    argument_pieces = 0
    for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                finish.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:
                    # The first piece of a call: its id, type and name.
                    assert delta.id and delta.id.startswith("call_"), delta
                    assert delta.type == "function", delta
                    assert delta.function.name == "get_weather", delta
                    calls[delta.index] = {"id": delta.id, "arguments": delta.function.arguments or ""}
                else:
                    assert delta.id is None and delta.function.name is None, delta
                    calls[delta.index]["arguments"] += delta.function.arguments
                    argument_pieces += 1
    assert finish == ["tool_calls"]
    assert calls and sorted(calls) == list(range(len(calls)))
    assert argument_pieces >= len(calls)
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), WEATHER)


def test_tool_choice_none_answers_in_text(client):
    reply = client.chat.completions.create(
        model="kiln", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=16, temperature=0
    )
    choice = reply.choices[0]
    assert choice.message.tool_calls is None
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_auto_is_free_to_answer_in_text_or_calls(client):
    reply = client.chat.completions.create(
        model="kiln", messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0
    )
    choice = reply.choices[0]
    if choice.finish_reason == "tool_calls":
        for call in choice.message.tool_calls:
            check_call(call)
    else:
        assert choice.finish_reason in ("stop", "length")
        assert choice.message.tool_calls is None
        assert isinstance(choice.message.content, str)


def test_a_finished_tool_round_trips_through_the_template(client):
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 22 C"},
    ]
    reply = client.chat.completions.create(
        model="kiln",
        messages=history,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    check_call(reply.choices[0].message.tool_calls[0], "get_time")


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {}}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_tool_fields_are_400s_naming_them(client, fields, param):
    body = {"tools": TOOLS, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="kiln", messages=ASK, max_tokens=4, **body)
    assert caught.value.body["param"] == param, caught.value.body


def test_bad_arguments_in_history_are_a_400(client):
    history = ASK + [
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{oops"}}],
        }
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="kiln", messages=history, tools=TOOLS, max_tokens=4)
    assert caught.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


def test_an_agent_runs_a_multi_step_tool_loop(server):
    """openai-agents' chat-completions model drives the loop: two forced tool calls, each
    tool's result sent back through the template, then the run finishes with the last
    result as its output."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        ToolsToFinalOutputResult,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    from conftest import API_KEY

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}, step {len(calls)}"

    def finish_after_two(context, results):
        # Keep looping (the model sees each result) until the tool has run twice.
        if len(calls) >= 2:
            return ToolsToFinalOutputResult(is_final_output=True, final_output=results[-1].output)
        return ToolsToFinalOutputResult(is_final_output=False)

    client = AsyncOpenAI(
        base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120,
        _strict_response_validation=True,
    )
    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model="kiln", openai_client=client),
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=MAX_TOKENS
        ),
        reset_tool_choice=False,
        tool_use_behavior=finish_after_two,
    )
    result = asyncio.run(
        Runner.run(agent, "What is the weather in Paris?", max_turns=4, run_config=RunConfig(tracing_disabled=True))
    )
    assert len(calls) == 2, calls
    assert all(c in ("Paris", "Oslo", "Lima") for c in calls)
    assert result.final_output == f"sunny in {calls[1]}, step 2"
    # The second model call saw the first tool's result.
    sent = [item for item in result.to_input_list() if item.get("type") == "function_call_output"]
    assert [item["output"] for item in sent] == [f"sunny in {calls[0]}, step 1", f"sunny in {calls[1]}, step 2"]
