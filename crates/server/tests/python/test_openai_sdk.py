"""`kiln serve` driven by the official OpenAI Python SDK, with strict response validation.

Every response is parsed into the SDK's pydantic models (`_strict_response_validation=True`),
every error comes back as the SDK's typed exception, and greedy answers equal the CLI's.
"""

import concurrent.futures
import json
import math
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest
from openai import OpenAI

from conftest import API_KEY, KilnServer, kiln

QUESTION = "What is the capital of France?"


def chat(client, content=QUESTION, **kw):
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(
        model="kiln", messages=[{"role": "user", "content": content}], **kw
    )


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def raw(server, method, path, body=None, headers=None):
    """(status, headers, body text) of a plain HTTP request."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method=method)
    if data is not None:
        # urllib would declare a form; the server takes JSON bodies only.
        request.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        request.add_header(k, v)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def test_models_list(client):
    models = client.models.list()
    assert len(models.data) == 1
    assert models.data[0].id == "SmolLM2-135M-Instruct.Q4_1"
    assert models.data[0].owned_by == "kiln"


def test_greedy_chat_equals_kiln_chat(client):
    reply = chat(client, max_tokens=32)
    cli = kiln("chat", QUESTION, "--temperature", "0", "--max-tokens", "32")
    assert reply.choices[0].message.content == cli.removesuffix("\n")
    assert reply.choices[0].message.role == "assistant"
    assert reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")


def test_greedy_completion_equals_kiln_generate(client):
    prompt = "Once upon a time, in a small village,"
    done = client.completions.create(model="kiln", prompt=prompt, max_tokens=24, temperature=0)
    cli = json.loads(kiln("generate", prompt, "--temperature", "0", "-n", "24", "--json", "-q"))
    assert done.choices[0].text == cli["text"]
    assert done.usage.prompt_tokens == len(cli["prompt_tokens"])
    assert done.usage.completion_tokens == len(cli["tokens"])
    assert done.choices[0].finish_reason == cli["finish_reason"].replace("eos", "stop")


def test_content_parts_equal_a_string(client):
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    a = chat(client).choices[0].message.content
    b = chat(client, content=parts).choices[0].message.content
    assert a == b


def test_streaming_chat_equals_the_whole_reply(client):
    whole = chat(client).choices[0].message.content
    chunks = list(chat(client, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices for c in chunks), "no usage chunk unless asked for"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_stream_usage_only_when_asked(client):
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    whole = chat(client)
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens


def test_streaming_completions(client, stream_client):
    prompt = "The three primary colours are"
    whole = client.completions.create(model="kiln", prompt=prompt, max_tokens=16, temperature=0)
    chunks = list(
        stream_client.completions.create(model="kiln", prompt=prompt, max_tokens=16, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n_choices(client):
    reply = chat(client, n=3, temperature=1.0, seed=7, max_tokens=16)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in reply.choices)
    streamed = list(chat(client, n=3, temperature=1.0, seed=7, max_tokens=16, stream=True))
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in reply.choices]


def test_completions_with_several_prompts_and_n(client):
    done = client.completions.create(
        model="kiln", prompt=["Paris is", "Rome is"], n=2, max_tokens=8, temperature=0
    )
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    # Greedy: both choices of one prompt agree, and each equals the prompt alone.
    assert done.choices[0].text == done.choices[1].text
    alone = client.completions.create(model="kiln", prompt="Rome is", max_tokens=8, temperature=0)
    assert done.choices[2].text == alone.choices[0].text


def test_token_id_prompts(client, server):
    ids = json.loads(raw(server, "POST", "/tokenize", {"content": "Paris is"}, headers=AUTH)[2])["tokens"]
    by_ids = client.completions.create(model="kiln", prompt=ids, max_tokens=8, temperature=0)
    by_text = client.completions.create(model="kiln", prompt="Paris is", max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="kiln", prompt=[ids[0], 10**9], max_tokens=1)
    assert err.value.param == "prompt" and "vocabulary" in err.value.message


def test_seed_reproduces(client):
    a = chat(client, temperature=1.0, seed=1234, max_tokens=24).choices[0].message.content
    b = chat(client, temperature=1.0, seed=1234, max_tokens=24).choices[0].message.content
    assert a == b


def test_stop_strings(client):
    prompt = "Paris is the capital of France. Berlin is the capital of"
    free = client.completions.create(model="kiln", prompt=prompt, max_tokens=24, temperature=0)
    text = free.choices[0].text
    stop = ". "
    assert stop in text, f"the reference output has no {stop!r}: {text!r}"
    stopped = client.completions.create(model="kiln", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    one = client.completions.create(model="kiln", prompt=prompt, max_tokens=24, temperature=0, stop=stop)
    assert one.choices[0].text == stopped.choices[0].text


def test_length_and_ignore_eos(client):
    done = client.completions.create(
        model="kiln", prompt="Hi", max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.usage.completion_tokens == 40
    assert done.choices[0].finish_reason == "length"


def test_chat_logprobs(client):
    reply = chat(client, logprobs=True, top_logprobs=3, max_tokens=12)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0
        assert sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1 + 1e-4
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    streamed = list(chat(client, logprobs=True, top_logprobs=3, max_tokens=12, stream=True))
    stream_entries = [e for c in streamed for e in ((c.choices[0].logprobs and c.choices[0].logprobs.content) or [])]
    assert [e.token for e in stream_entries] == [e.token for e in content]
    assert [e.logprob for e in stream_entries] == pytest.approx([e.logprob for e in content])


def test_completion_logprobs(client):
    done = client.completions.create(model="kiln", prompt="Paris is the capital of", max_tokens=8, temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == done.usage.completion_tokens == len(lp.token_logprobs)
    assert "".join(lp.tokens) == done.choices[0].text
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    assert all(b >= a for a, b in zip(lp.text_offset, lp.text_offset[1:]))


def test_chat_template_kwargs_reach_the_template(client):
    # SmolLM2's template has no `enable_thinking`: the reply is the same; a variable kiln sets
    # itself is refused, naming the field (crates/models' tokenizers tests render Qwen3's
    # switch against transformers).
    plain = chat(client, max_tokens=16)
    switched = chat(client, max_tokens=16, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert switched.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, extra_body={"chat_template_kwargs": {"messages": []}})
    assert err.value.param == "chat_template_kwargs"


def test_unknown_fields_and_nulls_are_ignored(client):
    reply = chat(client, stop=None, user="someone", extra_body={"unknown_field": {"x": 1}, "logprobs": None})
    assert reply.choices[0].message.content


def test_invalid_values_are_400_naming_the_field(client):
    for kw, field in [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 1000}, "n"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"extra_body": {"top_k": -3}}, "top_k"),
        # A wrong type, not only a wrong value.
        ({"max_tokens": "ten"}, "max_tokens"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            chat(client, **kw)
        assert err.value.status_code == 400
        assert err.value.param == field, (kw, err.value.body)
        assert err.value.type == "invalid_request_error"


def test_a_prompt_longer_than_the_context_is_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="kiln", prompt="hello " * 9000, max_tokens=4)
    assert "context" in err.value.message


def test_a_wrong_or_missing_key_is_401(server):
    bad = OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.models.list()
    assert err.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        chat(bad)
    status, _, body = raw(server, "GET", "/v1/models")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    # Every route that computes needs the key; /health and /metrics stay open.
    assert raw(server, "POST", "/tokenize", {"content": "Hello"})[0] == 401
    assert raw(server, "POST", "/detokenize", {"tokens": [1]})[0] == 401
    assert raw(server, "GET", "/health")[0] == 200
    assert raw(server, "GET", "/metrics")[0] == 200
    # The scheme in any case, spaces around the token ignored (RFC 9110).
    for value in [f"bearer {API_KEY}", f"BEARER   {API_KEY} "]:
        assert raw(server, "GET", "/v1/models", headers={"Authorization": value})[0] == 200, value


def test_unknown_routes_are_404(client, server):
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    status, _, body = raw(server, "GET", "/nowhere")
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"
    status, _, body = raw(server, "GET", "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 405 and "error" in json.loads(body)


def test_an_oversized_body_is_413(client):
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="kiln", prompt="x" * 1_200_000, max_tokens=1)
    assert err.value.status_code == 413
    assert "bytes" in err.value.message


def test_malformed_json_gets_the_openai_shape(server):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    for body in [b"{not json", b"[1, 2]", b'{"messages": "hi"}', b""]:
        status, h, text = raw(server, "POST", "/v1/chat/completions", body, headers)
        assert status == 400, (body, text)
        assert h["content-type"].startswith("application/json")
        error = json.loads(text)["error"]
        assert error["type"] == "invalid_request_error" and error["message"]


def test_cors_preflight_mirrors_the_sdk_headers(server):
    status, headers, _ = raw(
        server,
        "OPTIONS",
        "/v1/chat/completions",
        headers={
            "Origin": "http://localhost:3000",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os, x-stainless-arch",
        },
    )
    assert status == 200
    headers = {k.lower(): v for k, v in headers.items()}
    assert headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "x-stainless-os" in headers["access-control-allow-headers"]


def test_tokenize_and_detokenize(server):
    status, _, body = raw(server, "POST", "/tokenize", {"content": "Hello world"}, headers=AUTH)
    tokens = json.loads(body)["tokens"]
    assert status == 200 and len(tokens) >= 2
    status, _, body = raw(server, "POST", "/detokenize", {"tokens": tokens}, headers=AUTH)
    assert json.loads(body)["content"].endswith("Hello world")
    status, _, body = raw(server, "POST", "/detokenize", {"tokens": [10**9]}, headers=AUTH)
    assert status == 400


def test_a_dropped_stream_is_cancelled_and_frees_its_cache(stream_client, server):
    before = server.metrics()
    stream = stream_client.completions.create(
        model="kiln", prompt="Count:", max_tokens=2000, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    after = server.wait_idle()
    assert after["kiln_requests_running"] == 0
    assert after["kiln_kv_cache_blocks_used"] == 0
    cancelled = 'kiln_requests_finished_total{reason="cancelled"}'
    assert after[cancelled] == before[cancelled] + 1
    assert after["kiln_generation_tokens_total"] - before["kiln_generation_tokens_total"] < 1000


def test_metrics_count_what_ran(client, server):
    before = server.metrics()
    done = client.completions.create(model="kiln", prompt="One, two,", max_tokens=6, temperature=0)
    after = server.wait_idle()
    assert after["kiln_generation_tokens_total"] - before["kiln_generation_tokens_total"] == done.usage.completion_tokens
    assert after["kiln_prompt_tokens_total"] - before["kiln_prompt_tokens_total"] == done.usage.prompt_tokens
    assert after["kiln_time_to_first_token_seconds_count"] == before["kiln_time_to_first_token_seconds_count"] + 1
    assert after["kiln_max_batch"] == 8
    blocks = after["kiln_kv_cache_blocks_free"] + after["kiln_kv_cache_blocks_cached"]
    assert blocks == after["kiln_kv_cache_blocks_total"] > 0


def test_a_full_queue_is_503_and_the_rest_finish():
    s = KilnServer("--max-batch", "1", "--max-queue", "1")
    try:
        c = OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120, _strict_response_validation=True)

        def one(_):
            try:
                r = c.completions.create(model="kiln", prompt="Tell me", max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
                return r.usage.completion_tokens
            except openai.InternalServerError as e:
                assert e.status_code == 503
                assert e.code == "queue_full"
                return "refused"

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(one, range(6)))
        assert "refused" in results, results
        assert results.count(48) >= 2, results
        assert set(results) <= {48, "refused"}
        m = s.wait_idle()
        assert m["kiln_requests_rejected_total"] == results.count("refused")
    finally:
        assert s.stop() == 0


def test_sigterm_finishes_running_work_then_exits_0():
    s = KilnServer("--shutdown-grace", "30")
    c = OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120, _strict_response_validation=True)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            c.completions.create, model="kiln", prompt="Hi", max_tokens=64, temperature=0, extra_body={"ignore_eos": True}
        )
        deadline = time.time() + 30
        while s.metrics()["kiln_requests_running"] == 0 and time.time() < deadline:
            time.sleep(0.02)
        s.proc.send_signal(signal.SIGTERM)
        assert running.result().usage.completion_tokens == 64
    assert s.proc.wait(60) == 0


def test_a_stream_past_the_grace_period_ends_with_an_error_event():
    s = KilnServer("--shutdown-grace", "0.5")
    # Not strict: streamed completions chunks carry finish_reason null (see `stream_client`).
    c = OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
    stream = c.completions.create(
        model="kiln", prompt="Hi", max_tokens=4000, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    with pytest.raises(openai.APIError) as err:
        for i, _ in enumerate(stream):
            if i == 3:
                s.proc.send_signal(signal.SIGINT)
    assert "shut down" in str(err.value)
    assert s.proc.wait(60) == 0
