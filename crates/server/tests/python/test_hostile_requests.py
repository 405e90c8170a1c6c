"""Hostile and careless requests against `kiln serve` (issue #43): each is refused with a 4xx
naming the problem, or runs without freezing anyone else. A "victim" (a short completion from
another client) is timed alone and while the hostile request runs; it must stay within 3x, or,
where the hostile request shares the batch's steps with it, within 1.5x of its latency beside
as many rows of plain requests (below).

Connection-level attacks (slow headers, stalled bodies, connection limits) are in
test_hostile_connections.py.
"""

import concurrent.futures
import json
import signal
import statistics
import threading
import time
import urllib.error
import urllib.request

import pytest

from conftest import KilnServer, post

# A victim's latency under attack may be this many times its latency alone (the bar),
# with this much added for the scheduler's granularity (one step of the batch it joins).
VICTIM_FACTOR = 3.0
VICTIM_SLACK_S = 0.05
# A request that holds its share of the batch (4 rows of 8) makes every step the victim shares
# with it a 5-row step. On 2 cores that costs 2.5x a 1-row step with AVX-512 VNNI and 2.9x with
# AVX2 on the same Xeon (`kiln bench --batch-sizes 1,4,5`), more where the 2 vCPUs are one SMT
# core: a CI machine read a victim at 200 ms under 4 beams against 28 ms alone. So the victim
# may also take this many times its latency beside 4 plain requests (one row each): what the
# batch itself costs on this machine, not what the hostile request's shape adds to it.
SHARED_FACTOR = 1.5
SHARED_ROWS = 4


@pytest.fixture(scope="module")
def server():
    """No API key (so the Host check is on), 8 rows of batch: 4 for any one request."""
    s = KilnServer("--max-batch", "8")
    yield s
    assert s.stop() == 0, "".join(s.log)


def victim(server):
    """Seconds for a short greedy completion (4 tokens)."""
    start = time.perf_counter()
    status, body = post(
        server,
        "/v1/completions",
        {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    )
    assert status == 200, body
    return time.perf_counter() - start


def victim_alone(server, rounds=5):
    victim(server)  # warm
    return statistics.median(victim(server) for _ in range(rounds))


def victim_during(server, *hostile, rounds=5):
    """The victim's median latency while every `hostile()` runs (each started first, and given
    time to be admitted: as many requests running as there are calls), and their results."""
    with concurrent.futures.ThreadPoolExecutor(len(hostile)) as pool:
        running = [pool.submit(call) for call in hostile]
        deadline = time.time() + 30
        while server.metrics()["kiln_requests_running"] < len(hostile) and time.time() < deadline:
            if any(r.done() for r in running):
                break
            time.sleep(0.01)
        times = [victim(server) for _ in range(rounds)]
        assert not any(r.done() for r in running), "a hostile request ended before the victims were timed"
        return statistics.median(times), [r.result() for r in running]


def victim_beside_plain_requests(server):
    """The victim's median latency beside `SHARED_ROWS` plain greedy completions, each one row
    of the batch and long enough to outlast the victims."""

    def plain():
        return post(
            server,
            "/v1/completions",
            {"prompt": "Tell me a story", "max_tokens": 96, "temperature": 0, "ignore_eos": True},
        )

    during, results = victim_during(server, *[plain] * SHARED_ROWS)
    for status, body in results:
        assert status == 200, body
    return during


def assert_victim_holds(alone, during, what, shared=None):
    """`during` within `VICTIM_FACTOR` of `alone`, or, with `shared` (the victim's latency
    beside plain requests of the rows the hostile one holds), within `SHARED_FACTOR` of that."""
    bound = VICTIM_FACTOR * alone
    if shared is not None:
        bound = max(bound, SHARED_FACTOR * shared)
    bound += VICTIM_SLACK_S
    beside = "" if shared is None else f", {shared * 1e3:.0f} ms beside {SHARED_ROWS} plain requests"
    print(f"{what}: victim {during * 1e3:.0f} ms under attack, {alone * 1e3:.0f} ms alone{beside}")
    assert during <= bound, (
        f"{what}: victim {during:.3f} s, alone {alone:.3f} s{beside} (bound {bound:.3f} s)"
    )


def test_beam_searches_that_can_never_fit_are_refused_at_once(server):
    start = time.perf_counter()
    status, body = post(
        server,
        "/v1/completions",
        {"prompt": ["Tell me"] * 16, "num_beams": 64, "max_tokens": 64},
    )
    assert status == 400, body
    assert body["error"]["param"] == "num_beams"
    assert "sequences" in body["error"]["message"]
    assert time.perf_counter() - start < 5
    # 5 beams are more rows than one request may hold beside others (4 of 8).
    status, body = post(server, "/v1/completions", {"prompt": "Tell me", "num_beams": 5, "max_tokens": 8})
    assert status == 400, body
    assert "rows" in body["error"]["message"], body


def test_a_large_beam_search_leaves_room_for_others(server):
    alone = victim_alone(server)
    during, [(status, body)] = victim_during(
        server,
        lambda: post(
            server,
            "/v1/completions",
            {"prompt": ["Tell me a story", "Once upon a time"] * 2, "num_beams": 4, "max_tokens": 48, "ignore_eos": True},
        ),
    )
    assert status == 200, body
    assert len(body["choices"]) == 4
    assert_victim_holds(alone, during, "4 prompts x 4 beams", victim_beside_plain_requests(server))


def test_many_choices_with_long_stop_strings_leave_room_for_others(server):
    alone = victim_alone(server)
    stops = [f"{i:03d}" + "never appears " * 18 for i in range(16)]
    assert sum(len(s) for s in stops) <= 4096
    during, [(status, body)] = victim_during(
        server,
        lambda: post(
            server,
            "/v1/completions",
            {"prompt": "Count:", "n": 16, "max_tokens": 48, "stop": stops, "ignore_eos": True, "temperature": 1.0},
        ),
    )
    assert status == 200, body
    assert len(body["choices"]) == 16
    assert_victim_holds(alone, during, "n=16 with 16 stop strings", victim_beside_plain_requests(server))


def test_stop_strings_beyond_their_byte_budget_are_refused(server):
    status, body = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "stop": ["x" * 5000]})
    assert status == 400, body
    assert body["error"]["param"] == "stop"
    status, body = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "stop": ["x"] * 17})
    assert status == 400, body


def test_huge_texts_are_refused_before_tokenizing_and_others_do_not_wait(server):
    huge = "lorem ipsum dolor sit amet " * 300_000  # 8.1 MB
    alone = victim_alone(server)
    before = server.rss_bytes()

    # Encoded once: the client's own JSON work would otherwise take the cores the server's
    # victim needs (2 here), and measure the test rather than the server.
    bodies = [
        (path, json.dumps(body).encode())
        for path, body in [
            ("/tokenize", {"content": huge[: 8_000_000]}),
            ("/v1/completions", {"prompt": huge[: 8_000_000], "max_tokens": 1}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge[: 8_000_000]}]}),
        ]
    ]

    def hostile():
        return [post(server, path, body) for path, body in bodies * 3]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        attacks = [pool.submit(hostile) for _ in range(2)]
        times = [victim(server) for _ in range(5)]
        for attack in attacks:
            for status, body in attack.result():
                assert status == 400, body
                assert "bytes of text" in body["error"]["message"], body
    assert_victim_holds(alone, statistics.median(times), "8 MB texts to tokenize")
    # Refused before tokenizing: the server did not take 600 MB for 1.7 M tokens. The bound
    # leaves room for what the allocator keeps of the 8 MB bodies it freed (glibc raises its
    # mmap threshold after a free, so later bodies come from, and stay in, per-thread arenas);
    # a CI run grew 106 MB with every body refused.
    assert server.rss_bytes() - before < 250 << 20


def test_detokenize_is_capped_at_the_context(server):
    status, body = post(server, "/detokenize", {"tokens": [1] * 1_000_000})
    assert status == 400, body
    assert body["error"]["param"] == "tokens"
    status, body = post(server, "/detokenize", {"tokens": [1, 2, 3]})
    assert status == 200, body


def test_unknown_fields_cost_memory_in_proportion(server):
    before = server.rss_bytes()
    body = b'{"prompt": "Hi", "max_tokens": 1, "padding": [' + b",".join([b"1"] * 3_500_000) + b"]}"
    assert len(body) < 8 << 20
    for _ in range(3):
        status, _ = post(server, "/v1/completions", body)
        assert status == 200
    # The audit measured +168 MiB for this body; parsing now keeps nothing of the field.
    assert server.rss_bytes() - before < 64 << 20


def test_more_choices_than_the_server_can_ever_hold_are_400_not_503():
    s = KilnServer("--max-batch", "2", "--max-queue", "2")
    try:
        status, body = post(s, "/v1/completions", {"prompt": "Hi", "n": 8, "max_tokens": 2})
        assert status == 400, body
        assert body["error"]["param"] == "n"
        assert "--max-batch + --max-queue" in body["error"]["message"]
    finally:
        assert s.stop() == 0


def test_only_json_bodies_are_served(server):
    request = urllib.request.Request(
        server.url + "/v1/completions",
        data=b'{"prompt": "Hi", "max_tokens": 1}',
        method="POST",
        headers={"Content-Type": "text/plain"},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 415
    assert "application/json" in json.loads(err.value.read())["error"]["message"]


def test_a_loopback_server_without_a_key_answers_only_loopback_names(server):
    status, body = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, headers={"Host": "attacker.example:8080"})
    assert status == 403, body
    assert "DNS rebinding" in body["error"]["message"]
    status, _ = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, headers={"Host": "localhost"})
    assert status == 200


def test_a_request_cut_off_by_shutdown_gets_503():
    s = KilnServer("--shutdown-grace", "0.5")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(
                post, s, "/v1/completions", {"prompt": "Hi", "max_tokens": 4000, "ignore_eos": True}
            )
            deadline = time.time() + 30
            while s.metrics()["kiln_requests_running"] == 0 and time.time() < deadline:
                time.sleep(0.02)
            s.proc.send_signal(signal.SIGINT)
            status, body = running.result()
        assert status == 503, body
        assert body["error"]["code"] == "shutting_down"
        assert s.proc.wait(60) == 0
    finally:
        s.stop()
