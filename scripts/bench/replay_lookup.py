#!/usr/bin/env python3
"""Replays greedy outputs through prompt-lookup draft policies, priced by a table of forward costs.

Greedy speculative decoding yields exactly the plain greedy tokens, so how a draft policy would
fare on a prompt set follows from those tokens alone: which drafts the lookup proposes, how many
stand, how many rows each verification forward has. Pricing each forward by a measured table
(milliseconds for a forward of 1, 2, 3, ... rows at batch 1) turns that into the speed-up over
plain decoding, without the run-to-run noise of timing the runs themselves. The table comes from
timing forwards in the engine (docs/benchmarks.md, speculative decoding); the outputs from

    kiln generate --prompts-file benches/prompts/grounded.jsonl --max-batch 1 --temperature 0 \
        --json > outputs.jsonl

Usage: replay_lookup.py outputs.jsonl [--table 4.16,5.1,5.9,6.88,8.84,9.87,11.2,12.1]

The policies mirror kiln's `Speculation::draft` (crates/engine/src/speculate.rs): the most recent
earlier occurrence of the longest suffix of n tokens, n from `max_ngram` down to `min_ngram`, and
then a draft length of K (fixed), one more than the last check accepted (the acceptance rule), or
at most n (the match-length rule, kiln's default for prompt lookup).
"""

import argparse
import json


def longest_match(context, min_ngram, max_ngram):
    """(n, index of the continuation) of the most recent earlier occurrence of the longest suffix."""
    length = len(context)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        tail = context[length - n :]
        for start in range(length - n - 1, -1, -1):
            if context[start : start + n] == tail:
                return n, start + n
    return None


def replay(records, table, k, min_ngram, max_ngram, rule):
    """Speed-up over plain decoding, tokens per forward and acceptance for one policy."""

    def cost(rows):
        extra = table[-1] - table[-2]
        return table[rows - 1] if rows <= len(table) else table[-1] + extra * (rows - len(table))

    spec_ms = plain_ms = 0.0
    forwards = tokens = drafted = accepted = 0
    for record in records:
        # The prompt's forward yields the first token; decoding starts after it.
        context = list(record["prompt_tokens"]) + record["tokens"][:1]
        output = record["tokens"][1:]
        plain_ms += cost(1) * len(output)
        done, last_accepted = 0, k
        while done < len(output):
            found = longest_match(context, min_ngram, max_ngram)
            draft = []
            if found:
                n, at = found
                limit = {"fixed": k, "acceptance": min(k, last_accepted + 1), "match": min(k, n)}[rule]
                draft = context[at : at + limit]
            stood = 0
            while stood < len(draft) and done + stood < len(output) and draft[stood] == output[done + stood]:
                stood += 1
            taken = min(stood + 1, len(output) - done)
            context += output[done : done + taken]
            done += taken
            spec_ms += cost(1 + len(draft))
            forwards += 1
            tokens += taken
            drafted += len(draft)
            accepted += stood
            if draft:
                last_accepted = stood
    return plain_ms / spec_ms, tokens / forwards, accepted / max(drafted, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("outputs", help="kiln generate --json output of the prompt set (greedy)")
    parser.add_argument(
        "--table",
        default="4.16,5.1,5.9,6.88,8.84,9.87,11.2,12.1",
        help="ms per forward of 1, 2, ... rows (default: the AMD EPYC VM, SmolLM2 Q4_1, 2026-11-26)",
    )
    args = parser.parse_args()
    table = [float(x) for x in args.table.split(",")]
    with open(args.outputs) as f:
        records = [json.loads(line) for line in f if line.strip()]
    print("rule        K  n-grams  speed-up  tokens/forward  acceptance")
    for rule in ("acceptance", "match", "fixed"):
        for k in (2, 3, 4):
            for min_ngram, max_ngram in ((1, 3), (2, 3), (1, 8)):
                speedup, per_forward, rate = replay(records, table, k, min_ngram, max_ngram, rule)
                print(f"{rule:<10} {k:>2}  {min_ngram}-{max_ngram:<5}  {speedup:8.3f}  {per_forward:14.2f}  {rate:10.0%}")


if __name__ == "__main__":
    main()
