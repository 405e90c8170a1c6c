"""Fixtures for the `kiln serve` suite: servers started from the built binary on free ports.

The binary is $KILN_BIN (default: target/release/kiln of this checkout); the model is the
embedded default (SmolLM2-135M-Instruct), fetched into kiln's cache on first use.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[4]
KILN = os.environ.get("KILN_BIN", str(ROOT / "target" / "release" / "kiln"))
API_KEY = "sk-kiln-test"


class KilnServer:
    """A `kiln serve` process on a free port, its stderr kept for assertions."""

    def __init__(self, *args: str):
        self.args = [KILN, "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "NO_COLOR": "1"},
        )
        self.log: list[str] = []
        self.url = None
        found = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"listening on (http://\S+)", line)
                if m and self.url is None:
                    self.url = m.group(1)
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(120) or self.url is None:
            self.stop()
            raise RuntimeError("kiln serve did not start:\n" + "".join(self.log))
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except Exception:
                if self.proc.poll() is not None:
                    raise RuntimeError("kiln serve exited:\n" + "".join(self.log))
                time.sleep(0.2)
        else:
            raise RuntimeError("kiln serve never became healthy:\n" + "".join(self.log))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {name{labels}: value}."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Metrics once nothing runs, waits or holds KV blocks (or the last reading)."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            idle = (
                m["kiln_requests_running"] == 0
                and m["kiln_requests_waiting"] == 0
                and m["kiln_kv_cache_blocks_used"] == 0
            )
            if idle or time.time() > deadline:
                return m
            time.sleep(0.1)

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def post(server, path, body, headers=None, timeout=120):
    """(status, parsed JSON body) of a POST of `body` (bytes, or a value sent as JSON)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method="POST")
    request.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        request.add_header(k, v)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def sdk_client(server, strict=True):
    """The official SDK's client for `server` (with the suite's key), validating strictly."""
    from openai import OpenAI

    return OpenAI(
        base_url=server.url + "/v1",
        api_key=API_KEY,
        max_retries=0,
        timeout=120,
        _strict_response_validation=strict,
    )


@pytest.fixture(scope="session")
def server():
    """The shared server: an API key, CORS on, a 1 MB body limit."""
    s = KilnServer("--api-key", API_KEY, "--cors", "--max-body-bytes", "1000000", "--max-batch", "8")
    yield s
    code = s.stop()
    assert code == 0, "".join(s.log)


@pytest.fixture(scope="session")
def client(server):
    return sdk_client(server)


@pytest.fixture(scope="session")
def stream_client(server):
    """For streamed /v1/completions: the SDK's legacy `Completion` model declares
    `finish_reason` non-null, but OpenAI's own streams (and kiln's, and vLLM's) send null until
    the last chunk, so strict validation would refuse every chunk but the last."""
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def kiln(*args: str) -> str:
    """Runs the kiln CLI and returns its stdout."""
    out = subprocess.run([KILN, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout
