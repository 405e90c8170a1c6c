#!/usr/bin/env python3
"""One load cell against an OpenAI-compatible server: `requests` streamed completions at a
fixed concurrency, every one generating exactly `max_tokens` (`ignore_eos`, which kiln,
llama-server and vLLM accept), timed by the client.

Every prompt starts with its request's number, so no two requests share more than a few
tokens of prefix: both servers reuse cached prompts by default, and a benchmark that repeats
prompts would time the cache, not the prefill. With `--shared-prefix N` every prompt instead
starts with the same system prompt of about N tokens (then its number and question): the
scenario prefix caching is for.

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


# Sentences for the shared system prompt, repeated to length.
RULES = [
    "You are a careful assistant for a travel agency.",
    "Answer in plain English, in at most three sentences, and never invent prices.",
    "When a customer names a city, mention one museum, one park and one local dish there.",
    "If a question is about visas, say that the embassy has the final word.",
    "Prefer trains to flights for trips under six hundred kilometres.",
]


def system_prompt(tokens):
    """About `tokens` tokens of instructions (English runs near four characters a token)."""
    text, i = "", 0
    while len(text) < tokens * 4:
        text += f"Rule {i + 1}: {RULES[i % len(RULES)]} "
        i += 1
    return text


def percentile(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def one(client, prompt, max_tokens, ttfts, gaps, errors, prompt_lengths):
    start = time.perf_counter()
    last = None
    chunks = 0
    finished = False
    try:
        stream = await client.completions.create(
            model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    except Exception as e:  # noqa: BLE001 - counted and reported, not fatal
        errors.append(repr(e))
        return 0
    async for chunk in stream:
        if chunk.usage is not None:
            prompt_lengths.append(chunk.usage.prompt_tokens)
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


async def cell(url, concurrency, requests, max_tokens, shared_prefix):
    # Retries cover a keep-alive connection the server closed just as a request went out; a
    # retried request's TTFT counts from its first attempt.
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=2, timeout=3600)
    ttfts, gaps, errors, prompt_lengths = [], [], [], []
    tokens = 0
    system = system_prompt(shared_prefix) if shared_prefix else ""
    queue = list(range(requests))

    async def worker():
        nonlocal tokens
        while queue:
            i = queue.pop()
            prompt = system + f"Request {i}. " + PROMPTS[i % len(PROMPTS)]
            # Await first: `tokens += await ...` reads `tokens` before the await and loses
            # what the other workers added meanwhile.
            generated = await one(client, prompt, max_tokens, ttfts, gaps, errors, prompt_lengths)
            tokens += generated

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return {
        "concurrency": concurrency,
        "requests": requests,
        "max_tokens": max_tokens,
        "shared_prefix": shared_prefix,
        "prompt_tokens_p50": percentile(prompt_lengths, 0.5),
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
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens of one system prompt every request starts with")
    args = ap.parse_args()
    result = cell(args.url, args.concurrency, args.requests, args.max_tokens, args.shared_prefix)
    print(json.dumps(asyncio.run(result)))


if __name__ == "__main__":
    main()
