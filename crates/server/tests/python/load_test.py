#!/usr/bin/env python3
"""Load and fault test for `kiln serve`, driven by the official OpenAI SDK (AsyncOpenAI).

Sends REQUESTS requests of mixed lengths (chat and completions, streamed and not, greedy and
sampled) at a fixed concurrency, drops DROP of the streams mid-way from the client side, and
fires a burst past `--max-queue` halfway. Then checks, as the serving issue asks:
- every request that was neither dropped nor refused finished with a complete, schema-valid
  answer (the SDK validates strictly; finish_reason is stop or length);
- every greedy answer equals the same request run alone;
- `/metrics` shows 0 running, 0 waiting and every KV block free;
- the server's RSS after the run is within 10 % of its RSS after the first 100 requests;
- the process is still up.

The full run (the issue's numbers, a few minutes on 2 cores):
    python3 crates/server/tests/python/load_test.py --requests 1000 --concurrency 32
The test suite runs a small version (`test_load.py`).
"""

import argparse
import asyncio
import random
import sys
import time

import openai
from openai import AsyncOpenAI

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child in two sentences.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish, French and German.",
    "Give me a name for a friendly robot.",
    "What is 17 times 23? Show your working.",
    "Summarise the plot of Romeo and Juliet in one paragraph. Mention the families, the balcony, "
    "the secret wedding, Tybalt's death, the exile to Mantua, the sleeping potion and the tomb, "
    "and say what the play suggests about haste and hatred.",
    "Describe a walk through a forest in autumn: the colours of the leaves, the smell of the damp "
    "earth, the sound of birds and wind, the light through the branches, and how it feels to be "
    "there alone in the early morning before anyone else is awake.",
    "Once upon a time, in a small village at the edge of a great forest,",
    "The three laws of thermodynamics are",
]
MAX_TOKENS = [8, 16, 32, 64]


class Stats:
    def __init__(self):
        self.finished = 0
        self.dropped = 0
        self.refused = 0
        self.failures: list[str] = []
        self.greedy: dict[tuple, set[str]] = {}


def request_plan(i: int, drop_share: float, rng: random.Random) -> dict:
    prompt = PROMPTS[i % len(PROMPTS)]
    return {
        "chat": i % 2 == 0,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS[(i // 2) % len(MAX_TOKENS)],
        "greedy": i % 3 != 2,
        "seed": i,
        "stream": i % 4 < 2,
        "drop": rng.random() < drop_share,
    }


async def read_stream(stream, plan: dict, stats: Stats, piece) -> tuple | None:
    """The streamed text (`piece` of each choice chunk) and finish reason, or None when the plan
    drops the stream: it is closed at its third chunk."""
    text, reason, n = "", None, 0
    async for chunk in stream:
        n += 1
        if plan["drop"] and n == 3:
            await stream.close()
            stats.dropped += 1
            return None
        for c in chunk.choices:
            text += piece(c)
            reason = c.finish_reason or reason
    return text, reason


async def send(clients: tuple, plan: dict, stats: Stats, record: bool = True) -> str | None:
    """Runs one request; returns its text, or None when dropped or refused."""
    sampling = {"temperature": 0} if plan["greedy"] else {"temperature": 0.8, "top_p": 0.95, "seed": plan["seed"]}
    common = {"model": "kiln", "max_tokens": plan["max_tokens"], **sampling}
    client, stream_client = clients
    try:
        if plan["chat"]:
            messages = [{"role": "user", "content": plan["prompt"]}]
            if plan["stream"]:
                stream = await client.chat.completions.create(messages=messages, stream=True, **common)
                read = await read_stream(stream, plan, stats, lambda c: c.delta.content or "")
                if read is None:
                    return None
                text, reason = read
            else:
                reply = await client.chat.completions.create(messages=messages, **common)
                text, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
        else:
            if plan["stream"]:
                stream = await stream_client.completions.create(prompt=plan["prompt"], stream=True, **common)
                read = await read_stream(stream, plan, stats, lambda c: c.text)
                if read is None:
                    return None
                text, reason = read
            else:
                done = await client.completions.create(prompt=plan["prompt"], **common)
                text, reason = done.choices[0].text, done.choices[0].finish_reason
    except openai.InternalServerError as e:
        if e.status_code == 503:
            stats.refused += 1
            return None
        stats.failures.append(f"{plan}: {e!r}")
        return None
    except Exception as e:  # noqa: BLE001 - every failure is reported, none is fatal
        stats.failures.append(f"{plan}: {e!r}")
        return None
    if reason not in ("stop", "length") or text is None:
        stats.failures.append(f"{plan}: incomplete answer (finish_reason {reason!r})")
        return None
    if record:
        stats.finished += 1
        if plan["greedy"]:
            key = (plan["chat"], plan["prompt"], plan["max_tokens"])
            stats.greedy.setdefault(key, set()).add(text)
    return text


async def run(url: str, requests: int, concurrency: int, drop: float, burst: int, rss=None, seed=0) -> dict:
    """The load, the burst, then the checks' inputs: returns a report dict."""
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600,
                         _strict_response_validation=True)
    # Streamed /v1/completions chunks have finish_reason null until the last, as OpenAI's do,
    # which the SDK's legacy `Completion` model refuses under strict validation.
    stream_client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    clients = (client, stream_client)
    rng = random.Random(seed)
    stats = Stats()
    plans = [request_plan(i, drop, rng) for i in range(requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for p in plans:
        queue.put_nowait(p)
    done_count = 0
    rss_after_100 = None
    burst_sent = False
    started = time.time()

    async def worker():
        nonlocal done_count, rss_after_100, burst_sent
        while not queue.empty():
            plan = queue.get_nowait()
            await send(clients, plan, stats)
            done_count += 1
            if done_count == min(100, requests) and rss is not None:
                rss_after_100 = rss()
            if done_count >= requests // 2 and not burst_sent and burst > 0:
                burst_sent = True
                # Past the queue limit at once: some are refused with 503, the rest finish.
                burst_plans = [
                    {**request_plan(i, 0.0, rng), "stream": False, "greedy": True, "max_tokens": 64}
                    for i in range(burst)
                ]
                await asyncio.gather(*(send(clients, p, stats) for p in burst_plans))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.time() - started

    # Every greedy answer against the same request alone.
    mismatches = []
    for (chat, prompt, max_tokens), texts in stats.greedy.items():
        plan = {"chat": chat, "prompt": prompt, "max_tokens": max_tokens, "greedy": True, "seed": 0,
                "stream": False, "drop": False}
        alone = await send(clients, plan, Stats(), record=False)
        if texts != {alone}:
            mismatches.append({"request": (chat, prompt[:40], max_tokens), "batched": sorted(texts), "alone": alone})
    await client.close()
    await stream_client.close()
    return {
        "requests": requests,
        "concurrency": concurrency,
        "burst": burst,
        "finished": stats.finished,
        "dropped": stats.dropped,
        "refused": stats.refused,
        "failures": stats.failures,
        "greedy_checked": len(stats.greedy),
        "greedy_mismatches": mismatches,
        "rss_after_100": rss_after_100,
        "seconds": elapsed,
    }


def check(report: dict, metrics: dict, rss_end: int | None, alive: bool) -> list[str]:
    """The issue's conditions; returns what failed."""
    problems = []
    if report["failures"]:
        problems.append(f"{len(report['failures'])} requests failed: {report['failures'][:3]}")
    accounted = report["finished"] + report["dropped"] + report["refused"]
    if accounted != report["requests"] + report["burst"]:
        problems.append(f"{accounted} of {report['requests'] + report['burst']} requests accounted for")
    if report["burst"] and report["refused"] == 0:
        problems.append("the burst past --max-queue was not refused at all")
    if report["greedy_mismatches"]:
        problems.append(f"greedy answers differ from the same request alone: {report['greedy_mismatches'][:2]}")
    for name in ["kiln_requests_running", "kiln_requests_waiting", "kiln_kv_cache_blocks_used"]:
        if metrics.get(name) != 0:
            problems.append(f"{name} is {metrics.get(name)} after the run")
    if report["rss_after_100"] and rss_end and rss_end > 1.10 * report["rss_after_100"]:
        problems.append(f"RSS grew from {report['rss_after_100'] >> 20} MiB to {rss_end >> 20} MiB (over 10 %)")
    if not alive:
        problems.append("the server died")
    return problems


def main():
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from conftest import KilnServer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--drop", type=float, default=0.1, help="share of streams dropped mid-way")
    ap.add_argument("--max-queue", type=int, default=16)
    ap.add_argument("--burst", type=int, default=96, help="requests fired at once halfway")
    ap.add_argument("serve_args", nargs="*", help="more `kiln serve` flags (after --)")
    args = ap.parse_args()
    server = KilnServer("--max-batch", str(args.concurrency), "--max-queue", str(args.max_queue), *args.serve_args)
    try:
        report = asyncio.run(run(server.url, args.requests, args.concurrency, args.drop, args.burst, server.rss_bytes))
        metrics = server.wait_idle()
        rss_end = server.rss_bytes()
        alive = server.proc.poll() is None
        problems = check(report, metrics, rss_end, alive)
        summary = {k: v for k, v in report.items() if k not in ("failures", "greedy_mismatches")}
        summary["rss_end"] = rss_end
        print(summary)
        for p in problems:
            print("FAILED:", p)
        code = server.stop()
        if code != 0:
            print(f"FAILED: the server exited with {code}")
        sys.exit(1 if problems or code else 0)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
