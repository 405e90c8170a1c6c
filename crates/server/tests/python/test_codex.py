"""OpenAI's Codex CLI (`codex exec`, npm package `@openai/codex`) against `kiln serve` over the
Responses API, through one tool round trip: Codex asks kiln, kiln streams back a
`function_call` of Codex's shell tool (`exec_command`), Codex runs the command and sends the
whole conversation again with the call and its `function_call_output` (Codex sends
`store: false` and never `previous_response_id`), and kiln streams its answer to that.

Nothing is installed at test time. The codex to run is `$KILN_CODEX` (the `codex` launcher, the
native binary, or the folder npm installed it in), else `target/codex/node_modules/.bin/codex` in
this checkout (`cargo xtask test` installs it there with npm when npm is on the machine:
`npm install --prefix target/codex @openai/codex@0.171.0`); without one (or without node for
the npm launcher) the test is skipped.

Codex gets its own `CODEX_HOME` (a temporary folder): a `kiln` model provider
(`wire_api = "responses"`), no approvals and Codex's read-only sandbox (the model's commands are
sampled text: they run in a temporary folder, in a non-login shell, and can write nothing), no
update check or analytics, and short instructions (`model_instructions_file`) in place of
Codex's own. With its defaults Codex's first request does not fit the default model: its
instructions and tools (a `namespace` of sub-agent functions, which kiln offers, and the hosted
`web_search`, which it does not) come to 9,696 tokens of an 8,192-token context, and kiln
answers 400 `context_length_exceeded`, which Codex reports as its context being full. Features that
add tools the model does not need (sub-agents, goals, image viewing, `request_user_input`, web
search) are off, and so are the skills and environment blocks, so Codex declares two function
tools (`exec_command`, `write_stdin`) and the first request is ~1,030 tokens.

A logging proxy between Codex and kiln keeps each request and answer, so the test can check the
second request's `function_call_output` (kiln's own log names no endpoint and no input items);
kiln's log must show a finished `resp_` response for each of the requests.

The default model (SmolLM2-135M-Instruct) almost never stops calling tools once a tool result
is in its context (greedy: never; sampled, as Codex asks, since it sends no `temperature`: about
one answer in ten), so Codex would loop until the context is full. The test therefore passes
when the round trip is done and Codex has acted on kiln's answer to the second request: either
it ended the turn on its own (a text answer) with exit code 0, or it ran the call that answer
made and sent its output back in a third request, after which the test stops Codex. A run
whose first answer is text (no tool call), or that hangs (a sampled call may run on for
thousands of tokens), or whose calls ran no shell command (all of them `write_stdin`), is tried
again, within `BUDGET_S`; the test fails unless one run passes.
"""

import http.client
import http.server
import json
import os
import pathlib
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse

import pytest

from conftest import API_KEY, ROOT, KilnServer

ATTEMPTS = 5
BUDGET_S = 240.0
# The longest one `codex exec` run may take.
RUN_S = 45.0
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Run the shell command: echo hello"
# The generic tool format's own JSON shapes, as kiln writes the turns into the prompt.
INSTRUCTIONS = """You run shell commands for the user with the exec_command tool, once per request.
After the tool_response, you answer with "response".

Example:
User: Run ./date.sh
Assistant: {"tool_call": {"name": "exec_command", "arguments": {"cmd": "./date.sh"}}}
User: {"tool_response": {"tool": "exec_command", "content": "Monday"}}
Assistant: {"response": "It printed Monday."}
"""


def find_codex() -> list[str] | None:
    """The command line that runs codex, or None."""
    given = os.environ.get("KILN_CODEX")
    candidates = []
    if given:
        p = pathlib.Path(given)
        candidates += [p, p / "node_modules" / ".bin" / "codex", p / "bin" / "codex.js"]
    candidates.append(ROOT / "target" / "codex" / "node_modules" / ".bin" / "codex")
    for c in candidates:
        if not c.is_file():
            continue
        if c.resolve().suffix == ".js":
            node = shutil.which("node")
            return [node, str(c.resolve())] if node else None
        return [str(c)]
    return None


class Proxy:
    """Forwards every request to `upstream` unchanged and streams the answer back as it comes,
    keeping each exchange (method, path, headers, body; then status, answer, done) in
    `exchanges`."""

    def __init__(self, upstream: str):
        target = urllib.parse.urlsplit(upstream)
        self.exchanges: list[dict] = []
        exchanges = self.exchanges

        class Handler(http.server.BaseHTTPRequestHandler):
            # HTTP/1.0: an answer ends when its connection closes, so an event stream passes on
            # as it comes without being re-chunked.
            protocol_version = "HTTP/1.0"

            def forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                record = {
                    "method": self.command,
                    "path": self.path,
                    "headers": dict(self.headers.items()),
                    "body": body,
                    "answer": b"",
                    "done": False,
                }
                exchanges.append(record)
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=300)
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("host", "connection", "accept-encoding")
                }
                try:
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    answer = conn.getresponse()
                    record["status"] = answer.status
                    self.send_response(answer.status)
                    for k, v in answer.getheaders():
                        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(k, v)
                    self.end_headers()
                    while chunk := answer.read1(65536):
                        record["answer"] += chunk
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except OSError as e:
                    record["error"] = repr(e)
                finally:
                    conn.close()
                    record["done"] = True

            do_GET = do_POST = do_DELETE = forward

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def write_config(home: pathlib.Path, base_url: str):
    home.mkdir(parents=True, exist_ok=True)
    instructions = home / "instructions.md"
    instructions.write_text(INSTRUCTIONS)
    (home / "config.toml").write_text(
        f"""model = "{MODEL}"
model_provider = "kiln"
model_context_window = 8192
model_instructions_file = "{instructions}"
approval_policy = "never"
sandbox_mode = "read-only"
allow_login_shell = false
check_for_update_on_startup = false
web_search = "disabled"
include_permissions_instructions = false
include_environment_context = false

[model_providers.kiln]
name = "kiln"
base_url = "{base_url}/v1"
env_key = "KILN_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0

[features]
multi_agent = false
goals = false
view_image = false

[skills.bundled]
enabled = false

[tools.experimental_request_user_input]
enabled = false

[analytics]
enabled = false
"""
    )


def completed_output(answer: bytes) -> list[dict] | None:
    """The output items of an event stream's `response.completed` event (None without one)."""
    for line in answer.decode(errors="replace").splitlines():
        if line.startswith("data:"):
            event = json.loads(line[5:])
            if event.get("type") == "response.completed":
                return event["response"]["output"]
    return None


class Run:
    """What the exchanges of one `codex exec` run show."""

    def __init__(self, exchanges: list[dict]):
        self.lines: list[str] = []
        self.refused: list[str] = []
        # Per finished /v1/responses exchange: its input's function_call_output call ids and
        # the calls of its answer.
        self.turns: list[tuple[set[str], set[str]]] = []
        for x in exchanges:
            if not x["done"]:
                continue
            path = urllib.parse.urlsplit(x["path"]).path
            if (x["method"], path) != ("POST", "/v1/responses"):
                self.lines.append(f"{x['method']} {x['path']} -> {x.get('status')}")
                continue
            body = json.loads(x["body"])
            items = body.get("input", [])
            outputs = {i["call_id"] for i in items if i.get("type") == "function_call_output"}
            output = completed_output(x["answer"]) if x.get("status") == 200 else None
            if output is None:
                self.refused.append(f"{x.get('status')} {x['answer'][:500]!r} {x.get('error', '')}")
                shown = x["answer"][:300]
            else:
                shown = [
                    (i["type"], i.get("name") or i.get("content", [{}])[0].get("text", "")[:60],
                     i.get("arguments", "")[:60])
                    for i in output
                ]
                calls = {i["call_id"] for i in output if i.get("type") == "function_call"}
                self.turns.append((outputs, calls))
            self.lines.append(
                f"POST {path} input {[i.get('type') for i in items]} -> {x.get('status')} {shown}"
            )

    def second(self) -> int | None:
        """The index (in `turns`) of the first answered request that carries the output of a
        call an earlier answer made: the round trip's second request."""
        for k, (outputs, _) in enumerate(self.turns):
            if any(outputs & calls for _, calls in self.turns[:k]):
                return k
        return None

    def acted_on_second(self) -> bool:
        """Whether a later request carries the output of a call made by the second answer."""
        k = self.second()
        if k is None or not self.turns[k][1]:
            return False
        return any(outputs & self.turns[k][1] for outputs, _ in self.turns[k + 1 :])

    def __str__(self):
        return "\n".join(self.lines)


@pytest.fixture(scope="module")
def codex():
    cmd = find_codex()
    if cmd is None:
        pytest.skip(
            "no codex CLI: set KILN_CODEX to the codex binary or its npm folder, or run "
            "`npm install --prefix target/codex @openai/codex` (its launcher needs node)"
        )
    out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0 or not out.stdout.strip():
        pytest.skip(f"{cmd} --version failed: {out.stderr[-300:]}")
    return cmd


def stop(proc: subprocess.Popen) -> int:
    """Ends codex (and the processes it started) and returns its exit code."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def test_codex_exec_tool_round_trip(codex, tmp_path):
    server = KilnServer("--api-key", API_KEY)
    proxy = Proxy(server.url)
    try:
        home = tmp_path / "codex-home"
        write_config(home, proxy.url)
        env = {**os.environ, "CODEX_HOME": str(home), "KILN_API_KEY": API_KEY, "NO_COLOR": "1"}
        report = []
        start = time.monotonic()
        passed = False
        for attempt in range(ATTEMPTS):
            left = BUDGET_S - (time.monotonic() - start)
            if left < 20:
                break
            work = tmp_path / f"work{attempt}"
            work.mkdir()
            first, log_from = len(proxy.exchanges), len(server.log)
            out_path, err_path = tmp_path / f"out{attempt}.jsonl", tmp_path / f"err{attempt}.txt"
            with open(out_path, "w") as out, open(err_path, "w") as err:
                proc = subprocess.Popen(
                    [*codex, "exec", "--skip-git-repo-check", "--ephemeral", "--json",
                     "--color", "never", "-C", str(work), PROMPT],
                    cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                    start_new_session=True,
                )
                deadline = time.monotonic() + min(RUN_S, left)
                ended_by = "codex"
                while proc.poll() is None:
                    if Run(proxy.exchanges[first:]).acted_on_second():
                        ended_by = "test (codex ran the second answer's call)"
                        break
                    if time.monotonic() > deadline:
                        ended_by = "timeout"
                        break
                    time.sleep(0.2)
                # The exchanges still in flight when codex is stopped do not count.
                done = [dict(x) for x in proxy.exchanges[first:] if x["done"]]
                code = stop(proc)
            if ended_by == "codex":
                time.sleep(0.5)
                done = [dict(x) for x in proxy.exchanges[first:] if x["done"]]
            run = Run(done)
            finished = [l for l in server.log[log_from:] if "finished id=resp_" in l]
            events = [json.loads(l) for l in out_path.read_text().splitlines() if l.startswith("{")]
            commands = [
                (e["item"].get("command"), e["item"].get("exit_code"))
                for e in events
                if e.get("type") == "item.completed"
                and e["item"].get("type") == "command_execution"
            ]
            report.append(
                f"attempt {attempt}: ended by {ended_by}, codex exit {code}, "
                f"{len(run.turns)} answered requests, {len(finished)} finished responses in "
                f"kiln's log, second request {run.second()}\n{run}\ncommands run: {commands}\n"
                f"stderr tail: {err_path.read_text()[-800:]}"
            )
            # A request kiln refused, or an answer it cut short, is not the model's doing.
            assert not run.refused, "\n\n".join(report) + "\n" + "\n".join(run.refused)
            if ended_by == "codex":
                assert code == 0, "\n\n".join(report)
            second = run.second()
            # A run whose calls were all of Codex's other tool (`write_stdin`, which the sampled
            # model picks now and then) ran no command: the round trip asked for is the shell's,
            # so it is tried again, as a run whose first answer is text is.
            if second is None or not commands:
                continue
            assert len(finished) >= second + 1, "".join(server.log[log_from:])
            if ended_by == "codex" or run.acted_on_second():
                passed = True
                break
        print("\n\n".join(report))
        assert passed, "\n\n".join(report)
    finally:
        proxy.close()
        code = server.stop()
    assert code == 0, "".join(server.log)
