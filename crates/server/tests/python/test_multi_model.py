"""Several models in one `kiln serve`: `--model ALIAS=PATH` repeated, `model` picking one,
`/v1/models` listing them, loading on first use, and unloading the least recently used idle
model under `--models-memory-mb` without losing a request.

The two tiny models' answers are checked against transformers' greedy tokens
(crates/models/tests/fixtures/*/reference.json, scripts/reference/make_model_fixtures.py): each
choice's log-probability tokens are the reference ids' texts, as `/detokenize` spells each. The
default model's answer through the several-model server equals the one-model session server's.
"""

import concurrent.futures
import json
import threading
import time
import urllib.request

import openai
import pytest

from conftest import API_KEY, ROOT, KilnServer, post, sdk_client

FIXTURES = ROOT / "crates" / "models" / "tests" / "fixtures"
TINY = {"qwen": FIXTURES / "qwen3-tiny", "llama": FIXTURES / "llama-tiny"}


def reference(alias):
    """The first transformers case of a tiny model: its prompt ids and greedy ids."""
    case = json.loads((TINY[alias] / "reference.json").read_text())["cases"][0]
    return case["prompt_ids"], case["greedy"]


def token_texts(server, alias, ids):
    """Each id's text as the server's log-probabilities spell it (`/detokenize` of the one id)."""
    texts = []
    for i in ids:
        status, body = post(server, "/detokenize", {"model": alias, "tokens": [i]})
        assert status == 200, body
        texts.append(body["content"])
    return texts


def greedy(server, alias, prompt, max_tokens, stream=False):
    """A greedy completion's log-probability tokens (all streamed chunks' together)."""
    body = {"model": alias, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": stream}
    if not stream:
        status, answer = post(server, "/v1/completions", body)
        assert status == 200, answer
        return answer["choices"][0]["logprobs"]["tokens"]
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    tokens = []
    with urllib.request.urlopen(request, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[len("data: "):])["choices"][0]
                if choice["logprobs"]:  # the last chunk, with the finish reason, has none
                    tokens += choice["logprobs"]["tokens"]
    return tokens


def expected(server, alias):
    prompt, ids = reference(alias)
    return prompt, token_texts(server, alias, ids)


@pytest.fixture(scope="module")
def trio():
    """The default model and the two tiny ones; only the first loads at start."""
    s = KilnServer("--model", "smol=default", "--model", f"qwen={TINY['qwen']}",
                   "--model", f"llama={TINY['llama']}", "--max-batch", "4", "--kv-cache-mb", "16")
    yield s
    assert s.stop() == 0, "".join(s.log)


def listed(server):
    with urllib.request.urlopen(server.url + "/v1/models", timeout=10) as r:
        return {m["id"]: m for m in json.load(r)["data"]}


def test_models_are_listed_and_load_on_first_use(trio):
    client = sdk_client(trio)
    models = {m.id: m for m in client.models.list()}
    assert list(models) == ["smol", "qwen", "llama"]
    states = {m: models[m].model_extra["status"] for m in models}
    assert states["smol"] == "loaded"
    # The tiny models load when a request names them (an earlier test may have loaded one).
    metrics = trio.metrics()
    loads = {m: metrics[f'kiln_model_loads_total{{model="{m}"}}'] for m in models}
    assert loads["smol"] == 1
    for alias in ("qwen", "llama"):
        assert (states[alias] == "unloaded") == (loads[alias] == 0)
        prompt, want = expected(trio, alias)
        assert greedy(trio, alias, prompt, len(want)) == want
        assert listed(trio)[alias]["status"] == "loaded"
        assert listed(trio)[alias]["max_model_len"] > 0
    # The SDK's own model field picks the model too.
    done = client.completions.create(model="qwen", prompt=reference("qwen")[0], max_tokens=3,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert done.model == "qwen"
    assert "loaded qwen in" in "".join(trio.log)


def test_an_unknown_model_is_404_and_no_model_means_the_first(trio):
    client = sdk_client(trio)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    assert e.value.body["param"] == "model"
    assert "smol, qwen, llama" in e.value.body["message"]
    status, body = post(trio, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert status == 200, body
    assert body["model"] == "smol"
    # A huge name is not echoed whole.
    status, body = post(trio, "/v1/embeddings", {"model": "m" * 100_000, "input": "Hi"})
    assert status == 404, body
    assert len(body["error"]["message"]) < 300


def test_two_models_answer_correctly_and_in_parallel(trio, server):
    """A long answer of the default model runs while the tiny models answer several requests
    each: they finish before it does (its engine thread does not hold theirs up), and every
    answer is the right one."""
    ask = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 480,
           "temperature": 0, "ignore_eos": True}
    alone = post(server, "/v1/completions", ask, headers={"Authorization": f"Bearer {API_KEY}"})
    assert alone[0] == 200, alone
    wants = {alias: expected(trio, alias) for alias in TINY}
    ended = {}

    def long_answer():
        status, body = post(trio, "/v1/completions", {**ask, "model": "smol"})
        ended["smol"] = time.monotonic()
        return status, body

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(long_answer)
        time.sleep(0.5)
        tiny_done = []
        for round_ in range(3):
            for alias, (prompt, want) in wants.items():
                assert greedy(trio, alias, prompt, len(want), stream=round_ == 1) == want
                tiny_done.append(time.monotonic())
        status, body = running.result()
    assert status == 200, body
    assert body["choices"][0]["text"] == alone[1]["choices"][0]["text"]
    assert max(tiny_done) < ended["smol"], "the tiny models waited for the long answer"


def test_a_model_that_fails_to_load_is_503_and_the_others_go_on(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    s = KilnServer("--model", f"qwen={TINY['qwen']}", "--model", f"broken={broken}")
    try:
        for _ in range(2):  # and again: a failed load is retried, not remembered
            status, body = post(s, "/v1/completions", {"model": "broken", "prompt": "Hi", "max_tokens": 2})
            assert status == 503, body
            assert body["error"]["code"] == "model_unavailable"
            assert "broken" in body["error"]["message"]
        prompt, want = expected(s, "qwen")
        assert greedy(s, "qwen", prompt, len(want)) == want
        assert listed(s)["broken"]["status"] == "unloaded"
    finally:
        assert s.stop() == 0, "".join(s.log)


def test_unloading_under_a_tight_budget_loses_no_request():
    """Room for one tiny model at a time: requests alternating between the two, from six
    clients at once, make the server unload one to load the other again and again. Every
    request answers the reference, and the loaded models never hold more than the budget."""
    budget_mb = 6  # each tiny model holds ~4.6 MiB: 4 MiB of KV cache and its weights
    s = KilnServer("--model", f"qwen={TINY['qwen']}", "--model", f"llama={TINY['llama']}",
                   "--kv-cache-mb", "4", "--models-memory-mb", str(budget_mb), "--max-batch", "4")
    try:
        wants = {alias: expected(s, alias) for alias in TINY}
        over = []
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                m = s.metrics()
                held = sum(m[f'kiln_model_memory_bytes{{model="{a}"}}'] for a in TINY
                           if m[f'kiln_model_loaded{{model="{a}"}}'] == 1)
                if held > budget_mb << 20:
                    over.append(held)
                time.sleep(0.01)

        def one(i):
            alias = list(TINY)[i % 2]
            prompt, want = wants[alias]
            return alias, greedy(s, alias, prompt, len(want), stream=i % 3 == 0) == want

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                results = list(pool.map(one, range(36)))
        finally:
            stop.set()
            watcher.join()
        assert all(ok for _, ok in results), results
        assert not over, f"the loaded models held {max(over)} bytes, over {budget_mb} MiB"
        m = s.metrics()
        for alias in TINY:
            assert m[f'kiln_model_unloads_total{{model="{alias}"}}'] + m[f'kiln_model_loaded{{model="{alias}"}}'] \
                == m[f'kiln_model_loads_total{{model="{alias}"}}']
        assert sum(m[f'kiln_model_unloads_total{{model="{a}"}}'] for a in TINY) >= 1
        assert "to make room for" in "".join(s.log)
    finally:
        assert s.stop() == 0, "".join(s.log)


def test_a_model_running_a_request_is_not_unloaded_and_a_load_that_cannot_wait_is_503():
    """Room for one model: while the default model streams a long answer, a request for a tiny
    model waits `--models-room-wait` (1 s) for room, then gets 503 `model_busy`; the stream goes
    on to its end, whole. Once the default model is idle, the tiny one loads in its place."""
    # 16 MiB of KV cache each (room for a 500-token answer of the default model): the default
    # model holds ~109 MiB, the tiny one ~17 MiB.
    s = KilnServer("--model", "smol=default", "--model", f"qwen={TINY['qwen']}", "--kv-cache-mb", "16",
                   "--models-memory-mb", "115", "--models-room-wait", "1")
    try:
        # Long enough (several seconds on 2 cores) to outlast the 1 s wait with room to spare.
        ask = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 500, "temperature": 0,
               "ignore_eos": True}
        status, alone = post(s, "/v1/completions", ask)
        assert status == 200, alone
        assert alone["usage"]["completion_tokens"] == 500  # not cut short by the cache
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(post, s, "/v1/completions", ask)
            time.sleep(0.3)
            started = time.monotonic()
            status, body = post(s, "/v1/completions", {"model": "qwen", "prompt": [1, 2], "max_tokens": 2})
            waited = time.monotonic() - started
            assert status == 503, body
            assert body["error"]["code"] == "model_busy", body
            assert 0.9 < waited < 10, waited
            # The default model was still running when the tiny one gave up waiting.
            assert not running.done()
            status, answer = running.result()
        assert status == 200, answer
        assert answer["choices"][0]["text"] == alone["choices"][0]["text"]
        prompt, want = expected(s, "qwen")
        assert greedy(s, "qwen", prompt, len(want)) == want
        assert listed(s)["smol"]["status"] == "unloaded"
    finally:
        assert s.stop() == 0, "".join(s.log)
