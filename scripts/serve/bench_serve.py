#!/usr/bin/env python3
"""One load cell against an OpenAI-compatible server: `requests` streamed completions at a
fixed concurrency, every one generating exactly `max_tokens` (`ignore_eos`, which kiln,
llama-server and vLLM accept), timed by the client.

Prints one JSON object: output tokens/s over the cell's wall time, time to first token
(p50/p99, ms) and inter-token latency (p50/p99 over every gap between consecutive streamed
chunks, ms). `cargo xtask bench-serve` runs it against kiln and llama-server, interleaved.
"""

import argparse
import asyncio
import json
import time

from openai import AsyncOpenAI

# Prompts of a few dozen to a few hundred tokens, reused round-robin.
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


async def one(client, prompt, max_tokens, ttfts, gaps):
    start = time.perf_counter()
    last = None
    chunks = 0
    stream = await client.completions.create(
        model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if not chunk.choices or not chunk.choices[0].text:
            continue
        now = time.perf_counter()
        if last is None:
            ttfts.append(now - start)
        else:
            gaps.append(now - last)
        last = now
        chunks += 1
    return chunks


async def cell(url, concurrency, requests, max_tokens):
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    ttfts, gaps = [], []
    queue = list(range(requests))

    async def worker():
        while queue:
            i = queue.pop()
            await one(client, PROMPTS[i % len(PROMPTS)], max_tokens, ttfts, gaps)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return {
        "concurrency": concurrency,
        "requests": requests,
        "max_tokens": max_tokens,
        "output_tokens_per_s": requests * max_tokens / wall,
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
