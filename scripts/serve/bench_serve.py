#!/usr/bin/env python3
"""One load cell against an OpenAI-compatible server: `requests` streamed completions at a
fixed concurrency, every one generating exactly `max_tokens` (`ignore_eos`, which kiln,
llama-server and vLLM accept), timed by the client.

Every prompt starts with its request's number, so no two requests share more than a few
tokens of prefix: llama-server reuses a slot's cached prompt by default and kiln has no prefix
cache yet, and a benchmark that repeats prompts would time the cache, not the prefill.

Prints one JSON object: output tokens/s over the cell's wall time, time to first token
(p50/p99, ms) and inter-token latency (p50/p99 over every gap between consecutive streamed
chunks, ms). `cargo xtask bench-serve` runs it against kiln and llama-server, interleaved.
"""

import argparse
import asyncio
import json
import time

from openai import AsyncOpenAI

# Prompts of about 20 to 100 tokens, reused round-robin (each behind its own request number).
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain, step by step, how a bill becomes a law in a parliamentary democracy, naming the "
    "readings, the committee stage, the role of the second chamber and the final assent, and "
    "say where a bill most often fails and why.",
    "List ten animals that live in the Arctic and one fact about each.",
    "Describe the water cycle: evaporation from oceans and lakes, transpiration from plants, "
    "condensation into clouds, precipitation as rain and snow, collection in rivers and "
    "groundwater, and how long a molecule of water might spend in each stage. Then explain how "
    "a warmer climate changes the cycle, with examples from floods and droughts.",
]


def percentile(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def one(client, prompt, max_tokens, ttfts, gaps, errors):
    start = time.perf_counter()
    last = None
    chunks = 0
    finished = False
    try:
        stream = await client.completions.create(
            model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )
    except Exception as e:  # noqa: BLE001 - counted and reported, not fatal
        errors.append(repr(e))
        return 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason == "length":
            finished = True
        if not chunk.choices or not chunk.choices[0].text:
            continue
        now = time.perf_counter()
        if last is None:
            ttfts.append(now - start)
        else:
            gaps.append(now - last)
        last = now
        chunks += 1
    # ignore_eos: a request that ran to its length generated exactly max_tokens, whether or
    # not a chunk carried text for each.
    return max_tokens if finished else chunks


async def cell(url, concurrency, requests, max_tokens):
    # Retries cover a keep-alive connection the server closed just as a request went out; a
    # retried request's TTFT counts from its first attempt.
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=2, timeout=3600)
    ttfts, gaps, errors = [], [], []
    tokens = 0
    queue = list(range(requests))

    async def worker():
        nonlocal tokens
        while queue:
            i = queue.pop()
            prompt = f"Request {i}. " + PROMPTS[i % len(PROMPTS)]
            # Await first: `tokens += await ...` reads `tokens` before the await and loses
            # what the other workers added meanwhile.
            generated = await one(client, prompt, max_tokens, ttfts, gaps, errors)
            tokens += generated

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return {
        "concurrency": concurrency,
        "requests": requests,
        "max_tokens": max_tokens,
        "output_tokens_per_s": tokens / wall,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "ttft_p50_ms": percentile(ttfts, 0.5) * 1e3,
        "ttft_p99_ms": percentile(ttfts, 0.99) * 1e3,
        "itl_p50_ms": percentile(gaps, 0.5) * 1e3,
        "itl_p99_ms": percentile(gaps, 0.99) * 1e3,
        "wall_s": wall,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", required=True)
    ap.add_argument("--concurrency", type=int, required=True)
    ap.add_argument("--requests", type=int, required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(cell(args.url, args.concurrency, args.requests, args.max_tokens))))


if __name__ == "__main__":
    main()
