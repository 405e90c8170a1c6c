#!/usr/bin/env python3
"""The twin of `kiln bench` in Hugging Face transformers (PyTorch), for `cargo xtask bench
--compare transformers`: the same matrix, the same synthetic prompts, the same phases.

For each cell: `batch` prompts of `prompt_len` tokens in one forward (prefill) into a static
cache, then `new_tokens - 1` greedy decode steps of one token per sequence, each timed. One
warm-up run (the whole prefill, 8 new tokens), then `repeats` timed runs; medians. Peak memory:
the process's resident set high-water mark (reset per cell through /proc/self/clear_refs) on
cpu; on cuda the caching allocator's peak reserved memory (`torch.cuda.max_memory_reserved`,
emptied before each cell), the twin of the reserved bytes kiln reads from cubecl.

With `--compile` the decode steps run through `torch.compile(mode="reduce-overhead")` (CUDA
graphs) over the same static cache, reused across a cell's runs; the prefill stays eager. This is
the compiled static-cache baseline of transformers' own performance docs.

Prints one JSON object (the same fields as kiln's) to stdout; progress goes to stderr.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    StaticCache,
)

LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def llama3(hidden, layers, heads, kv_heads, head_dim, ff, factor, tied):
    return LlamaConfig(vocab_size=128256, hidden_size=hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       intermediate_size=ff, max_position_embeddings=131072, rms_norm_eps=1e-5,
                       rope_theta=500000.0, rope_scaling={**LLAMA3_ROPE, "factor": factor},
                       tie_word_embeddings=tied, bos_token_id=128000, eos_token_id=128001)


SHAPES = {
    "llama-3.2-1b": lambda: llama3(2048, 16, 32, 8, 64, 8192, 32.0, True),
    "llama-3.1-8b": lambda: llama3(4096, 32, 32, 8, 128, 14336, 8.0, False),
    "gpt2": lambda: GPT2Config(n_embd=768, n_layer=12, n_head=12),
    "gpt2-xl": lambda: GPT2Config(n_embd=1600, n_layer=48, n_head=25),
}

# Decode steps of the warm-up run (kiln's `Cell::WARM_UP_NEW_TOKENS`).
WARM_UP_NEW_TOKENS = 8

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def load(args, dtype, device):
    if args.shape:
        config = SHAPES[args.shape]()
        torch.manual_seed(0)
        cls = GPT2LMHeadModel if isinstance(config, GPT2Config) else LlamaForCausalLM
        with torch.device(device):
            model = cls(config).to(dtype)
        return model, f"{args.shape} (random weights)"
    path = args.model
    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path) or ".", gguf_file=os.path.basename(path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device), path


def synthetic(batch, length, vocab):
    """kiln_engine::bench::synthetic_prompts."""
    return [[(i * 7919 + p * 104_729 + 13) % vocab for i in range(length)] for p in range(batch)]


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_cell(model, prompt_len, batch, new_tokens, device, decode=None, cache=None):
    """One run: prefill then greedy decode steps. `decode` replaces the model's forward for
    the decode steps (a compiled one); `cache` is a static cache to reset and reuse."""
    vocab = model.config.vocab_size
    ids = torch.tensor(synthetic(batch, prompt_len, vocab), device=device)
    if cache is None:
        cache = StaticCache(config=model.config, max_cache_len=prompt_len + new_tokens)
    else:
        cache.reset()
    decode = decode or model
    sync(device)
    start = time.perf_counter()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True,
                cache_position=torch.arange(prompt_len, device=device), logits_to_keep=1)
    token = out.logits[:, -1, :].argmax(-1, keepdim=True)
    sync(device)
    prefill = time.perf_counter() - start
    steps = []
    for step in range(1, new_tokens):
        step_start = time.perf_counter()
        position = torch.tensor([prompt_len + step - 1], device=device)
        out = decode(input_ids=token, past_key_values=cache, use_cache=True,
                     cache_position=position)
        token = out.logits[:, -1, :].argmax(-1, keepdim=True)
        sync(device)
        steps.append(time.perf_counter() - step_start)
    return prefill, steps


def quantile(values, q):
    """Nearest rank, as kiln_engine::bench::quantile."""
    if not values:
        return 0.0
    s = sorted(values)
    rank = max(1, min(len(s), math.ceil(q * len(s))))
    return s[rank - 1]


def peak_memory(device):
    if device == "cuda":
        return torch.cuda.max_memory_reserved()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def reset_peak(device):
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    else:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model")
    parser.add_argument("--shape", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-lens", default="128,512")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--compile", action="store_true",
                        help="decode through torch.compile(mode='reduce-overhead') (CUDA graphs)")
    args = parser.parse_args()
    if bool(args.model) == bool(args.shape):
        parser.error("give --model or --shape")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    torch.set_grad_enabled(False)
    model, name = load(args, dtype, args.device)
    model.eval()
    decode = (torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
              if args.compile else None)
    cells = []
    for prompt_len in [int(x) for x in args.prompt_lens.split(",")]:
        for batch in [int(x) for x in args.batch_sizes.split(",")]:
            reset_peak(args.device)
            runs = []
            # A compiled decode keeps one cache per cell (its graphs hold its tensors).
            cache = (StaticCache(config=model.config, max_cache_len=prompt_len + args.new_tokens)
                     if args.compile else None)
            for run in range(args.repeats + 1):
                # The warm-up decodes only WARM_UP_NEW_TOKENS, as kiln's (`Cell::warm_up`).
                new_tokens = min(args.new_tokens, WARM_UP_NEW_TOKENS) if run == 0 else args.new_tokens
                prefill, steps = run_cell(model, prompt_len, batch, new_tokens, args.device,
                                          decode, cache)
                if run > 0:
                    runs.append((prefill, steps))
            med = statistics.median
            cell = {
                "prompt_len": prompt_len,
                "batch": batch,
                "prefill_tokens_per_s": med(batch * prompt_len / p for p, _ in runs),
                "decode_tokens_per_s": med(batch * len(s) / sum(s) for _, s in runs),
                # One forward prefills the whole batch: every sequence's first token comes at
                # its end.
                "time_to_first_token_ms": med(p * 1e3 for p, _ in runs),
                "itl_p50_ms": med(quantile(s, 0.5) * 1e3 for _, s in runs),
                "itl_p99_ms": med(quantile(s, 0.99) * 1e3 for _, s in runs),
                "peak_memory_bytes": peak_memory(args.device),
            }
            print(f"transformers: prompt {prompt_len}, batch {batch}: "
                  f"prefill {cell['prefill_tokens_per_s']:.1f} tok/s, "
                  f"decode {cell['decode_tokens_per_s']:.1f} tok/s", file=sys.stderr)
            cells.append(cell)
    print(json.dumps({
        "model": name,
        "engine": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}"
                  + (", torch.compile reduce-overhead decode" if args.compile else ", eager"),
        "device": args.device,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "cells": cells,
    }))


if __name__ == "__main__":
    main()
