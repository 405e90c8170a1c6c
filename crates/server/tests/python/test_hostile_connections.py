"""Hostile connections against `kiln serve` (issue #43, slow clients and shutdown), over raw
sockets: half-sent heads and bodies are closed after their timeouts (and the log says so),
stalled sockets do not slow other clients, `--max-connections` holds new clients back until a
slot frees, an over-limit body sent in full gets a readable 413, and a stop takes one grace
period (a second signal: none).

Request-level attacks are in test_hostile_requests.py.
"""

import concurrent.futures
import json
import signal
import socket
import statistics
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from conftest import KilnServer

# As in test_hostile_requests.py: a victim's latency under attack may be this many times its
# latency alone, with this much added for the scheduler's granularity.
VICTIM_FACTOR = 3.0
VICTIM_SLACK_S = 0.05


@pytest.fixture(scope="module")
def strict():
    """Short timeouts and a 1 MB body limit."""
    s = KilnServer("--header-timeout", "1", "--body-timeout", "2", "--max-body-bytes", "1000000")
    yield s
    assert s.stop() == 0, "".join(s.log)


def address(server):
    url = urllib.parse.urlparse(server.url)
    return url.hostname, url.port


def connect(server, timeout=10.0):
    return socket.create_connection(address(server), timeout=timeout)


def head(server, method, path, *fields):
    host, port = address(server)
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", *fields]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def post_head(server, length, *fields):
    return head(
        server, "POST", "/v1/completions", "Content-Type: application/json", f"Content-Length: {length}", *fields
    )


def read_response(sock):
    """(status, JSON body) of one response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    top, body = data.split(b"\r\n\r\n", 1)
    lines = top.decode().split("\r\n")
    status = int(lines[0].split()[1])
    fields = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(fields["content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed in the middle of the body"
        body += chunk
    return status, json.loads(body[:length])


def seconds_until_closed(sock, limit=15.0):
    """Seconds until the server closes `sock` (EOF or reset)."""
    start = time.perf_counter()
    sock.settimeout(limit)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.perf_counter() - start


def wait_for_log(server, *words, timeout=5.0):
    """The first log line holding every one of `words`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for line in list(server.log):
            if all(w in line for w in words):
                return line
        time.sleep(0.05)
    raise AssertionError(f"no log line with {words}:\n" + "".join(server.log))


def victim(server):
    """Seconds for a short greedy completion (4 tokens)."""
    start = time.perf_counter()
    request = urllib.request.Request(
        server.url + "/v1/completions",
        data=json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200
        r.read()
    return time.perf_counter() - start


def running(server, n=1, timeout=30.0):
    deadline = time.time() + timeout
    while server.metrics()["kiln_requests_running"] < n:
        assert time.time() < deadline, "the request never started"
        time.sleep(0.02)


def test_a_half_sent_head_is_closed_after_the_header_timeout(strict):
    with connect(strict) as s:
        s.sendall(head(strict, "POST", "/v1/completions", "Content-Type: appl")[:-4])
        took = seconds_until_closed(s)
        peer = "%s:%d" % s.getsockname()
    assert 0.8 <= took <= 3.0, took
    wait_for_log(strict, "no complete request head within 1 s (--header-timeout)", peer)


def test_a_stalled_body_gets_408_after_the_body_timeout(strict):
    with connect(strict) as s:
        start = time.perf_counter()
        s.sendall(post_head(strict, 100) + b'{"prompt": ')
        status, body = read_response(s)
        took = time.perf_counter() - start
        peer = "%s:%d" % s.getsockname()
    assert status == 408, body
    assert body["error"]["code"] == "body_timeout"
    assert 1.8 <= took <= 4.0, took
    wait_for_log(strict, "did not arrive within 2 s (--body-timeout)", peer)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_over_limit_body_sent_in_full_gets_a_readable_413(strict, chunked):
    body = b'{"prompt": "' + b"x" * (9 << 20) + b'"}'
    with connect(strict) as s:
        if chunked:
            s.sendall(head(strict, "POST", "/v1/completions", "Content-Type: application/json",
                           "Transfer-Encoding: chunked"))
            for i in range(0, len(body), 1 << 16):
                part = body[i : i + (1 << 16)]
                s.sendall(b"%x\r\n%s\r\n" % (len(part), part))
            s.sendall(b"0\r\n\r\n")
        else:
            # The whole body, as a client does that writes before it reads: no broken pipe.
            s.sendall(post_head(strict, len(body)) + body)
        status, answer = read_response(s)
    assert status == 413, answer
    assert "--max-body-bytes" in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"


def test_an_over_limit_body_behind_expect_continue_is_refused_before_it_is_sent(strict):
    with connect(strict) as s:
        s.sendall(post_head(strict, 9 << 20, "Expect: 100-continue"))
        status, answer = read_response(s)
    assert status == 413, answer


def test_stalled_sockets_do_not_slow_other_clients():
    s = KilnServer("--max-batch", "8")
    stalled = []
    try:
        victim(s)  # warm
        alone = statistics.median(victim(s) for _ in range(5))
        for i in range(32):
            c = connect(s)
            if i % 2:
                c.sendall(head(s, "POST", "/v1/completions", "Content-Type: application/json")[:-20])
            else:
                c.sendall(post_head(s, 1000) + b'{"prompt": "Hel')
            stalled.append(c)
        time.sleep(0.2)
        during = statistics.median(victim(s) for _ in range(5))
        bound = VICTIM_FACTOR * alone + VICTIM_SLACK_S
        assert during <= bound, f"victim {during:.3f} s with 32 stalled sockets, alone {alone:.3f} s"
        # Still stalled (the default timeouts are 10 s and 60 s), not closed early.
        for c in stalled:
            c.setblocking(False)
            with pytest.raises(BlockingIOError):
                c.recv(1)
    finally:
        for c in stalled:
            c.close()
        assert s.stop() == 0, "".join(s.log)


def test_max_connections_holds_new_clients_until_a_slot_frees():
    s = KilnServer("--max-connections", "4", "--header-timeout", "2")
    stalled = []
    try:
        for _ in range(4):
            c = connect(s)
            c.sendall(head(s, "GET", "/health")[:-6])
            stalled.append(c)
        wait_for_log(s, "--max-connections limit")
        with connect(s) as fifth:
            fifth.sendall(head(s, "GET", "/health"))
            fifth.settimeout(1.0)
            with pytest.raises(socket.timeout):
                fifth.recv(1)
            # Served once the stalled ones time out (2 s after they were accepted).
            fifth.settimeout(10.0)
            start = time.perf_counter()
            status, body = read_response(fifth)
            assert status == 200, body
            assert time.perf_counter() - start < 4.0
        for c in stalled:
            assert seconds_until_closed(c, 1.0) < 1.0
        assert sum("--max-connections limit" in line for line in s.log) == 1, "".join(s.log)
    finally:
        for c in stalled:
            c.close()
        assert s.stop() == 0, "".join(s.log)


def stream_long(server):
    """Streams a long completion until the server ends it; returns the raw bytes received."""
    with connect(server, timeout=60) as s:
        payload = json.dumps(
            {"prompt": "Hi", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
        ).encode()
        s.sendall(post_head(server, len(payload)) + payload)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except OSError:
            pass
        return got


def test_a_second_signal_stops_at_once():
    s = KilnServer("--shutdown-grace", "30")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stream = pool.submit(stream_long, s)
        running(s)
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert s.proc.poll() is None, "stopped before the grace period was over"
        start = time.perf_counter()
        s.proc.send_signal(signal.SIGINT)
        code = s.proc.wait(10)
        took = time.perf_counter() - start
        stream.result(10)
    assert code == 130, "".join(s.log)
    assert took < 3.0, took
    wait_for_log(s, "second signal")


def test_one_signal_stops_within_one_grace_period():
    grace = 3.0
    s = KilnServer("--shutdown-grace", str(grace))
    stalled = None
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            long = pool.submit(stream_long, s)
            running(s)
            # A slow upload holds its connection open past the grace period.
            stalled = connect(s)
            stalled.sendall(post_head(s, 1000) + b'{"prompt": ')
            short = pool.submit(
                lambda: json.loads(
                    urllib.request.urlopen(
                        urllib.request.Request(
                            s.url + "/v1/completions",
                            data=json.dumps({"prompt": "Hi", "max_tokens": 16, "ignore_eos": True}).encode(),
                            headers={"Content-Type": "application/json"},
                        ),
                        timeout=60,
                    ).read()
                )
            )
            running(s, 2)
            start = time.perf_counter()
            s.proc.send_signal(signal.SIGINT)
            assert short.result(30)["usage"]["completion_tokens"] == 16
            code = s.proc.wait(30)
            took = time.perf_counter() - start
            assert b"shut down" in long.result(10)
        assert code == 0, "".join(s.log)
        # One grace period (plus a moment to write the cut-off answers), not two.
        assert grace - 0.5 <= took <= grace + 1.5, took
    finally:
        if stalled:
            stalled.close()
        s.stop()
