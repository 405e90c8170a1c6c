#!/usr/bin/env python3
"""Reference distributions for kiln's sampling chain, from Hugging Face transformers.

For fixed logit vectors and settings, applies transformers' own processors in the order
generation uses (sequence bias, repetition penalty, temperature, top-k, top-p, min-p) and
records which tokens survive and their probabilities. kiln's `sampling` tests compare against
the JSON this writes: `cases` (the chain without a bias, `sampling_hf.rs`) and
`logit_bias_cases` (OpenAI's `logit_bias` as transformers' `SequenceBiasLogitsProcessor` with
one-token sequences, which adds the bias to the logit; `logit_bias_hf.rs`).

    python3 scripts/reference/sampling_reference.py > crates/core/tests/fixtures/sampling_hf.json
"""
import json
import sys

import torch
import transformers
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


def logit_vectors():
    gen = torch.Generator().manual_seed(1234)
    vectors = {
        "ramp": [float(i) * 0.25 - 3.0 for i in range(24)],
        "peaked": [8.0] + [0.5 * ((i * 7) % 11) - 2.0 for i in range(1, 32)],
    }
    for name, scale in (("normal_a", 1.0), ("normal_b", 2.5), ("normal_c", 0.4)):
        vectors[name] = (torch.randn(64, generator=gen) * scale).tolist()
    return vectors


CASES = [
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 5},
    {"temperature": 1.0, "top_k": 100},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 0.8, "top_p": 0.5},
    {"temperature": 1.0, "min_p": 0.05},
    {"temperature": 1.5, "min_p": 0.2},
    {"temperature": 0.9, "top_k": 10, "top_p": 0.8},
    {"temperature": 1.1, "top_k": 20, "top_p": 0.95, "min_p": 0.02},
    {"temperature": 1.0, "repetition_penalty": 1.3, "prompt": [0, 3, 5, 3, 17]},
    {"temperature": 0.6, "repetition_penalty": 0.8, "top_k": 8, "prompt": [1, 2, 20]},
    {"temperature": 1.0, "repetition_penalty": 2.0, "top_p": 0.7, "min_p": 0.1, "prompt": [4, 9, 11]},
]


# `logit_bias` as OpenAI spells it, token id -> bias; "argmax" is the raw logits' argmax (so
# -100 on it must change the greedy pick). Combined with the other settings so that the order
# matters: bias before the repetition penalty and the temperature, as transformers, vLLM and
# llama.cpp apply it.
LOGIT_BIAS_CASES = [
    {"logit_bias": {"3": 5.0, "10": -2.5}},
    {"logit_bias": {"0": 100.0}},
    {"logit_bias": {"argmax": -100.0}},
    {"logit_bias": {"argmax": -100.0, "5": 1.0}, "temperature": 0.7, "top_k": 5},
    {"logit_bias": {"2": 4.0, "20": 6.0}, "temperature": 1.3, "top_p": 0.8},
    {"logit_bias": {"3": 2.0, "5": -1.5}, "repetition_penalty": 1.3, "prompt": [0, 3, 5]},
    {"logit_bias": {"4": 7.5, "9": -0.5}, "repetition_penalty": 0.8, "temperature": 0.9,
     "min_p": 0.1, "prompt": [4, 9]},
    {"logit_bias": {"1": -100.0, "6": 100.0}, "temperature": 1.1, "top_k": 3},
]


def resolve_bias(case, logits):
    argmax = max(range(len(logits)), key=lambda i: (logits[i], -i))
    return {(argmax if k == "argmax" else int(k)): v for k, v in case["logit_bias"].items()}


def processors(case, vocab, bias=None):
    chain = []
    if bias:
        chain.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]))
    if case.get("repetition_penalty", 1.0) != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(case["repetition_penalty"]))
    if case.get("temperature", 1.0) != 1.0:
        chain.append(TemperatureLogitsWarper(case["temperature"]))
    top_k = case.get("top_k", 0)
    if top_k:
        chain.append(TopKLogitsWarper(min(top_k, vocab)))
    if case.get("top_p", 1.0) < 1.0:
        chain.append(TopPLogitsWarper(case["top_p"]))
    if case.get("min_p", 0.0) > 0.0:
        chain.append(MinPLogitsWarper(case["min_p"]))
    return LogitsProcessorList(chain)


def main():
    out = {
        "generator": "scripts/reference/sampling_reference.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "cases": [],
    }
    for name, logits in logit_vectors().items():
        vocab = len(logits)
        for case in CASES:
            prompt = [t for t in case.get("prompt", []) if t < vocab]
            scores = torch.tensor([logits], dtype=torch.float32)
            input_ids = torch.tensor([prompt if prompt else [0]], dtype=torch.long)
            if not prompt:
                # No repetition penalty in this case: input_ids are not read.
                input_ids = torch.tensor([[0]], dtype=torch.long)
            processed = processors(case, vocab)(input_ids, scores.clone())[0]
            probs = torch.softmax(processed, dim=-1)
            kept = [i for i in range(vocab) if processed[i].item() != float("-inf")]
            out["cases"].append(
                {
                    "logits_name": name,
                    "logits": logits,
                    "params": {k: v for k, v in case.items() if k != "prompt"},
                    "prompt": prompt,
                    "kept": kept,
                    "probs": [probs[i].item() for i in kept],
                    "greedy_after_penalty": int(
                        torch.argmax(
                            processors({"repetition_penalty": case.get("repetition_penalty", 1.0)}, vocab)(
                                input_ids, scores.clone()
                            )[0]
                        ).item()
                    ),
                }
            )
    out["logit_bias_cases"] = []
    for name, logits in logit_vectors().items():
        vocab = len(logits)
        for case in LOGIT_BIAS_CASES:
            bias = resolve_bias(case, logits)
            prompt = case.get("prompt", [])
            scores = torch.tensor([logits], dtype=torch.float32)
            input_ids = torch.tensor([prompt if prompt else [0]], dtype=torch.long)
            biased = processors({}, vocab, bias)(input_ids, scores.clone())[0]
            processed = processors(case, vocab, bias)(input_ids, scores.clone())[0]
            penalised = processors(
                {"repetition_penalty": case.get("repetition_penalty", 1.0)}, vocab, bias
            )(input_ids, scores.clone())[0]
            probs = torch.softmax(processed, dim=-1)
            kept = [i for i in range(vocab) if processed[i].item() != float("-inf")]
            out["logit_bias_cases"].append(
                {
                    "logits_name": name,
                    "logits": logits,
                    "logit_bias": [[t, b] for t, b in sorted(bias.items())],
                    "params": {k: v for k, v in case.items() if k not in ("prompt", "logit_bias")},
                    "prompt": prompt,
                    "biased": biased.tolist(),
                    "kept": kept,
                    "kept_logits": [processed[i].item() for i in kept],
                    "probs": [probs[i].item() for i in kept],
                    "greedy": int(torch.argmax(penalised).item()),
                }
            )
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
