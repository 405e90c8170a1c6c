"""Structured output ends on its own (issue #44, item 6), on the default model.

Every schema of structured_schemas_more.json (16: arrays of objects, unbounded numbers, long
strings under maxLength, enums, optional fields, nested arrays, maps) is asked for greedy and
sampled (temperature 1, two seeds; three with KILN_ENDS_ALL), with `max_tokens` far above what any answer needs, and
`response_format: json_object` likewise. Every output must end with `finish_reason: "stop"`
(never `length`: no endless whitespace, digits or items) and validate (`jsonschema`). The 23
schemas of structured_schemas.json are held to the same in test_structured_output.py (which
runs them anyway); KILN_ENDS_ALL=1 adds them here too, for a measurement over all 40 cases.

The server is the suite's shared one (JSON whitespace bounded, the default); set
KILN_JSON_WHITESPACE=free (or compact) to run the same requests on a server started with
`--json-whitespace` so, which is how docs/structured-output.md measured the free mode.
"""

import concurrent.futures
import json
import os
import pathlib
import time

import jsonschema
import pytest

from conftest import API_KEY, KilnServer

HERE = pathlib.Path(__file__).resolve().parent
BASE = json.loads((HERE / "structured_schemas.json").read_text())
MORE = json.loads((HERE / "structured_schemas_more.json").read_text())
SCHEMAS = (BASE if os.environ.get("KILN_ENDS_ALL") else []) + MORE
# The longest valid answer here is about 250 tokens (the recipe); four times that is room
# enough that only an output that would not end reaches it.
MAX_TOKENS = 1000
SEEDS = (1, 2, 3) if os.environ.get("KILN_ENDS_ALL") else (1, 2)  # two keep CI near a minute
RUNS = [{"temperature": 0.0}] + [{"temperature": 1.0, "seed": s} for s in SEEDS]


@pytest.fixture(scope="module")
def ends_client(request):
    from openai import OpenAI

    mode = os.environ.get("KILN_JSON_WHITESPACE")
    if mode:
        own = KilnServer("--api-key", API_KEY, "--max-batch", "8", "--json-whitespace", mode)
        request.addfinalizer(own.stop)
        url = own.url
    else:
        url = request.getfixturevalue("server").url
    return OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)


def test_the_extra_schemas_are_schemas_and_there_are_enough():
    assert len(MORE) >= 12
    assert not {c["name"] for c in MORE} & {c["name"] for c in BASE}
    for case in MORE:
        jsonschema.validators.validator_for(case["schema"]).check_schema(case["schema"])


def test_every_json_output_ends_with_stop_and_validates(ends_client):
    cases = [(c["name"], c["prompt"], c["schema"]) for c in SCHEMAS]
    cases.append(("json_object", "Describe a cat (name, age, colour).", None))

    def job(name, prompt, schema, run):
        if schema is None:
            response_format = {"type": "json_object"}
        else:
            response_format = {
                "type": "json_schema",
                "json_schema": {"name": name, "schema": schema, "strict": True},
            }

        def call():
            reply = ends_client.chat.completions.create(
                model="kiln",
                messages=[{"role": "user", "content": prompt + " Answer in JSON."}],
                max_tokens=MAX_TOKENS,
                response_format=response_format,
                **run,
            )
            return name, schema, run, reply.choices[0], reply.usage.completion_tokens

        return call

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda j: j(), [job(*c, r) for c in cases for r in RUNS]))
    seconds = time.monotonic() - started

    stopped, cut, invalid = [], [], []
    for name, schema, run, choice, tokens in results:
        text = choice.message.content
        if choice.finish_reason != "stop":
            cut.append((name, run, choice.finish_reason, tokens, text[-80:]))
            continue
        stopped.append(name)
        try:
            value = json.loads(text)
            if schema is None:
                assert isinstance(value, dict)
            else:
                jsonschema.validate(value, schema)
        except Exception as e:  # noqa: BLE001: every failure is reported together below
            invalid.append((name, run, repr(e)[:200], text[:200]))
    summary = (
        f"{len(stopped)} of {len(results)} outputs ended with stop, {len(cut)} did not, "
        f"{len(invalid)} of the ended ones invalid ({seconds:.0f} s)"
    )
    print(summary)
    assert not cut and not invalid, (summary, cut, invalid)
