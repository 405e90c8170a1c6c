#!/usr/bin/env python3
"""Chat templates with tools: what transformers' apply_chat_template renders (issue #44, item 1).

Writes crates/models/tests/fixtures/tool-templates/rendered.json: for each case, the template file
(copied beside it from llama.cpp's models/templates/), the BOS and EOS texts it is given, the
messages (an assistant turn with `tool_calls` whose `arguments` are a dict, as transformers passes
them to templates, and `role: tool` results), the tools (OpenAI function schemas), and the text

    tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)

renders. The tokenizer is the qwen2-tiny fixture's with `chat_template` replaced by the case's
template and its BOS/EOS texts set to the model's (the template only sees their text).

Templates: Qwen2.5-7B-Instruct (Hermes-style <tool_call> blocks), Llama-3.1-8B-Instruct (JSON
calls, tools in the first user message), Mistral-Nemo-Instruct-2407 ([TOOL_CALLS], 9-character
call ids).

    python3 scripts/reference/make_tool_template_fixtures.py
"""
import json
import pathlib

import transformers
from transformers import AutoTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "crates/models/tests/fixtures"
OUT = FIXTURES / "tool-templates"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city, today or in a few days (température in °C).",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city's name"},
                    "days": {"type": "integer", "description": "Days from today"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
]


def call(id_, name, arguments):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


ROUND_TRIP = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris in 3 days?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [call("call12345", "get_weather", {"city": "Paris", "days": 3})],
    },
    {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "sunny, 22 °C"},
    {"role": "assistant", "content": "It will be sunny and 22 °C in Paris."},
    {"role": "user", "content": "And the time there?"},
]

PARALLEL = [
    {"role": "user", "content": "Weather and time in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            call("callAAAAA", "get_weather", {"city": "Oslo"}),
            call("callBBBBB", "get_time", {"city": "Oslo"}),
        ],
    },
    {"role": "tool", "tool_call_id": "callAAAAA", "name": "get_weather", "content": "snow"},
    {"role": "tool", "tool_call_id": "callBBBBB", "name": "get_time", "content": "14:05"},
]

CASES = [
    # (name, template file, bos, eos, messages)
    ("qwen2.5 round trip", "qwen2.5.jinja", "", "<|im_end|>", ROUND_TRIP),
    ("qwen2.5 parallel calls", "qwen2.5.jinja", "", "<|im_end|>", PARALLEL),
    ("llama3.1 round trip", "llama3.1.jinja", "<|begin_of_text|>", "<|eot_id|>", ROUND_TRIP),
    ("mistral-nemo round trip", "mistral-nemo.jinja", "<s>", "</s>", ROUND_TRIP),
    ("mistral-nemo parallel calls", "mistral-nemo.jinja", "<s>", "</s>", PARALLEL),
]


def main():
    tokenizer = AutoTokenizer.from_pretrained(FIXTURES / "qwen2-tiny")
    cases = []
    for name, template, bos, eos, messages in CASES:
        tokenizer.chat_template = (OUT / template).read_text()
        # The template sees only these texts (transformers passes special_tokens_map).
        tokenizer.bos_token = bos or None
        tokenizer.eos_token = eos
        rendered = tokenizer.apply_chat_template(
            messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
        )
        cases.append(
            {
                "name": name,
                "template": template,
                "bos_token": bos,
                "eos_token": eos,
                "messages": messages,
                "tools": TOOLS,
                "rendered": rendered,
            }
        )
    body = {"generator": f"transformers {transformers.__version__}", "cases": cases}
    (OUT / "rendered.json").write_text(json.dumps(body, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
