#!/usr/bin/env python3
"""Beam-search references: what Hugging Face transformers' `generate(num_beams=N, do_sample=False)` returns.

Writes beam_reference.json in these fixture folders under crates/models/tests/fixtures/:
  gpt2-tiny/beam_reference.json   8 cases over the first 3 prompts of gpt2-tiny/reference.json
  llama-tiny/beam_reference.json  8 cases over the first 3 prompts of llama-tiny/reference.json
  smollm2/beam_reference.json     6 cases for SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to f32 by
                                  transformers) over the first two plain and first two chat prompts of
                                  smollm2/reference.json's greedy_cases, EOS [2] (<|im_end|>)
  <family>-tiny/beam_reference.json  3 cases over the first 3 prompts of each other family fixture
                                  (FAMILY_FIXTURES), each EOS picked from the model's own beams (auto_eos)

Each case runs, on CPU in f32 with the model in eval mode,
    model.generate(prompt, num_beams=N, do_sample=False, length_penalty=LP, early_stopping=ES,
                   num_return_sequences=R, max_new_tokens=M, eos_token_id=EOS, pad_token_id=EOS[0],
                   return_dict_in_generate=True, output_scores=True)
with the model's generation_config replaced by a fresh GenerationConfig, so nothing from a checkpoint's
generation_config.json (repetition penalty, min length, ...) can add a logits processor; the script asserts
that the processor list transformers builds is empty. The tiny models are random, so the EOS ids are tokens
the model itself picks early (positions 1-7) for that prompt, so that some beams end by EOS: for gpt2-tiny
from its greedy continuation in reference.json, for llama-tiny (whose beams leave the greedy path at once)
from the beams found without that EOS.

For each returned sequence, best first as transformers orders them: the generated tokens without padding and
without the final EOS, whether it ended by EOS, and `sequences_scores` (a float). The real generated length of
sequence i is `(beam_indices[i] != -1).sum()`; what follows is padding. The script checks that every score
equals the sum of the chosen tokens' log-softmax (recomputed with one plain forward over prompt + tokens,
EOS included) divided by (generated length, EOS included) ** length_penalty, within 1e-4.
`score_margin` is the smallest gap between consecutive returned scores (null with one output): how close
the returned order is to a tie.

What transformers 5.24's `_beam_search` does (generation/utils.py), which these cases pin down:
  * step 1 expands beam 0 only (the other beams start at -1e9); each step takes the top
    K = max(2, 1 + len(EOS)) * num_beams of the num_beams * vocab accumulated log-probs (torch.topk);
    running beams are ranked by raw summed log-prob, the length penalty only scores finished hypotheses;
  * of those K, only the first num_beams may become finished hypotheses (an EOS candidate ranked below
    num_beams is dropped); the next running beams are the best num_beams non-finishing of the K;
  * a hypothesis finished by EOS has length = generated tokens including the EOS; reaching
    max_new_tokens also finishes the top num_beams candidates (length max_new_tokens, no EOS);
    an EOS as the very first token is allowed (empty `tokens`);
  * the finished set keeps the best num_beams by penalized score (topk over old + new);
  * early_stopping=True stops once num_beams hypotheses are finished; False stops once all num_beams
    slots are finished and best running sum / (tokens generated so far) ** length_penalty cannot beat
    the worst finished score (then it also stops adding hypotheses); "never" does the same with
    max_new_tokens as the length when length_penalty > 0, and is identical to False when it is <= 0.

Needs (pip): torch, transformers, tokenizers, safetensors, gguf, numpy, accelerate (transformers needs it to
load a GGUF); it imports the JSON writer and versions() of make_gguf_fixtures.py. Generated with
transformers 5.24.0, torch 2.15.0. Run from the repository root:

    python3 scripts/reference/make_beam_fixtures.py                  # every model
    python3 scripts/reference/make_beam_fixtures.py --only llama-tiny
    python3 scripts/reference/make_beam_fixtures.py --gguf path/to/SmolLM2-135M-Instruct.Q4_1.gguf

The SmolLM2 GGUF path defaults to $KILN_SMOLLM2_GGUF, else kiln's model cache ($KILN_HOME/models or
~/.cache/kiln/models), as in make_gguf_fixtures.py.
"""
import argparse
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_gguf_fixtures import DEFAULT_GGUF, ROOT, versions, write_json  # noqa: E402

GENERATOR = "scripts/reference/make_beam_fixtures.py"
SEMANTICS = (
    "transformers generate(num_beams, do_sample=False, no logits processors): score = sum of the tokens' "
    "log-softmax / len**length_penalty, len counts the final EOS; tokens exclude that EOS and padding"
)
SCORE_TOL = 1e-4

# (prompt index into reference.json's cases, num_beams, length_penalty, early_stopping,
#  num_return_sequences, max_new_tokens, EOS ids)
# gpt2-tiny greedy: p0 [186, 282, 311, 150, 311, ...], p1 [311 x 8, 354, ...], p2 [88, 371, 311, 88, 88, 264, 367, ...]
GPT2_CASES = [
    (0, 2, 1.0, False, 1, 8, [150]),
    (1, 3, 0.0, True, 2, 8, [311]),
    (2, 4, 2.0, "never", 4, 10, [264]),
    (0, 4, -0.5, False, 3, 8, [150, 311]),
    (1, 3, 1.0, "never", 3, 6, [311]),  # differs from early_stopping=True
    (2, 2, 0.0, "never", 2, 10, [264, 367]),  # "never" with length_penalty <= 0 is False
    (0, 4, 1.0, True, 1, 10, [150, 311]),  # differs from early_stopping=False and "never"
    (2, 3, 2.0, False, 2, 7, [264]),  # differs from early_stopping="never"
]
# llama-tiny greedy: p0 [622, 220, 236, 637, 345, 51, ...], p1 [62, 27, 107, 365, 283, 240, ...],
# p2 [591, 630, 625, 495, 299, 350, ...]; its beams leave the greedy path, so most EOS ids come from the beams:
# p0 b2 [609, 328, 401, 96, ...], p0 b4 [609, 630, 51, 92, 148, 24, ...], p1 [62, 28, 24, 3, 416, ...],
# p2 b2 [553 or 591, 630, 625, ...], p2 b3/b4 [192, 570, 570, ...]
LLAMA_CASES = [
    (0, 2, 1.0, False, 1, 8, [96]),
    (1, 3, 0.0, True, 2, 8, [3]),
    (2, 2, 2.0, "never", 2, 8, [625, 630]),  # early_stopping=False would stop at length 2
    (0, 4, -0.5, False, 3, 8, [92, 24]),
    (1, 3, 1.0, "never", 3, 6, [3]),
    (2, 2, 0.0, "never", 2, 10, [495, 299]),  # "never" with length_penalty <= 0 is False
    (0, 4, 1.0, True, 4, 10, [51]),  # differs from early_stopping=False in its last two outputs
    (2, 2, 2.0, False, 2, 8, [625]),  # differs from early_stopping="never" (longer outputs)
]

# smollm2 greedy_cases: 0, 1 plain ("The capital of France is", "def fibonacci(n):"), 3, 4 chat
SMOL_EOS = [2]
SMOL_CASES = [
    (0, 2, 1.0, False, 1, 16, SMOL_EOS),
    (1, 4, 1.0, False, 4, 16, SMOL_EOS),
    (4, 4, 1.0, False, 2, 16, SMOL_EOS),
    (4, 2, 0.5, False, 2, 16, SMOL_EOS),
    (3, 2, 1.0, True, 1, 16, SMOL_EOS),
    (3, 4, 1.0, "never", 4, 16, SMOL_EOS),
]


def fresh_generation_config(model):
    """Drop whatever generation_config.json the checkpoint brought: generate() fills unset fields from it."""
    model.generation_config = GenerationConfig()


def checked_processors(model):
    """Wraps model._get_logits_processor to assert it builds no processor."""
    original = model._get_logits_processor

    def wrapper(*args, **kwargs):
        processors = original(*args, **kwargs)
        assert len(processors) == 0, f"unexpected logits processors: {processors}"
        return processors

    model._get_logits_processor = wrapper


@torch.no_grad()
def recomputed_score(model, prompt, generated, length_penalty):
    """Sum of the generated tokens' log-softmax from one forward over prompt + generated, length-penalized."""
    ids = torch.tensor([prompt + generated])
    logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    n = len(prompt)
    total = sum(float(logprobs[n - 1 + j, t]) for j, t in enumerate(generated))
    return total / (len(generated) ** length_penalty)


@torch.no_grad()
def run_case(model, name, prompt, num_beams, length_penalty, early_stopping, n_return, max_new, eos):
    input_ids = torch.tensor([prompt])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        num_beams=num_beams,
        do_sample=False,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        num_return_sequences=n_return,
        max_new_tokens=max_new,
        eos_token_id=list(eos),
        pad_token_id=eos[0],
        return_dict_in_generate=True,
        output_scores=True,
    )
    assert out.sequences.shape[0] == n_return
    outputs, worst = [], 0.0
    for i in range(n_return):
        length = int((out.beam_indices[i] != -1).sum())
        generated = out.sequences[i, len(prompt) : len(prompt) + length].tolist()
        assert len(generated) == length and 1 <= length <= max_new
        assert out.sequences[i, : len(prompt)].tolist() == prompt
        ended = generated[-1] in eos
        score = float(out.sequences_scores[i])
        check = recomputed_score(model, prompt, generated, length_penalty)
        worst = max(worst, abs(score - check))
        assert abs(score - check) < SCORE_TOL, f"{name} output {i}: score {score} vs recomputed {check}"
        outputs.append({"tokens": generated[:-1] if ended else generated, "eos": ended, "score": score})
    scores = [o["score"] for o in outputs]
    assert scores == sorted(scores, reverse=True), f"{name}: outputs not best first"
    margin = min((a - b for a, b in zip(scores, scores[1:])), default=None)
    case = {
        "name": name,
        "prompt_ids": prompt,
        "num_beams": num_beams,
        "length_penalty": length_penalty,
        "early_stopping": early_stopping,
        "num_return_sequences": n_return,
        "max_new_tokens": max_new,
        "eos_token_ids": list(eos),
        "outputs": outputs,
        "score_margin": margin,
    }
    return case, worst


def es_name(early_stopping):
    return {False: "esF", True: "esT", "never": "esNever"}[early_stopping]


def run_model(model, label, prompts, table, out_path, note):
    model.eval()
    fresh_generation_config(model)
    checked_processors(model)
    cases, worst = [], 0.0
    for p, beams, lp, es, n_return, max_new, eos in table:
        name = f"p{p}_b{beams}_lp{lp:g}_{es_name(es)}_r{n_return}_m{max_new}_eos{len(eos)}"
        case, err = run_case(model, name, prompts[p], beams, lp, es, n_return, max_new, eos)
        cases.append(case)
        worst = max(worst, err)
        summary = ", ".join(f"{len(o['tokens'])}{'+EOS' if o['eos'] else ''} {o['score']:.4f}" for o in case["outputs"])
        print(f"{label} {name}: {summary}", file=sys.stderr)
    n_out = sum(len(c["outputs"]) for c in cases)
    n_eos = sum(o["eos"] for c in cases for o in c["outputs"])
    print(f"{label}: {len(cases)} cases, {n_out} outputs, {n_eos} end by EOS, max |score - recomputed| {worst:.2e}", file=sys.stderr)
    assert n_eos > 0, f"{label}: no output ends by EOS"
    write_json(
        out_path,
        {"generator": GENERATOR, "versions": versions(), "semantics": SEMANTICS, "note": note, "cases": cases},
    )
    return cases


def load_reference_prompts(folder, key="cases"):
    with open(os.path.join(ROOT, folder, "reference.json")) as f:
        return [c["prompt_ids"] for c in json.load(f)[key]]


def tiny(folder, table, note):
    model = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, folder), dtype=torch.float32)
    prompts = load_reference_prompts(folder)[:3]
    return run_model(model, folder, prompts, table, os.path.join(ROOT, folder, "beam_reference.json"), note)


def smollm2(gguf_path):
    if not os.path.exists(gguf_path):
        sys.exit(f"SmolLM2 GGUF not found at {gguf_path} (see make_gguf_fixtures.py for how to get it)")
    folder, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    prompts = load_reference_prompts("smollm2", "greedy_cases")
    cases = run_model(
        model,
        "smollm2",
        prompts,
        SMOL_CASES,
        os.path.join(ROOT, "smollm2", "beam_reference.json"),
        f"{name} loaded by transformers (dequantized to f32); prompts p0, p1 plain, p3, p4 chat "
        "(indices into reference.json's greedy_cases); EOS <|im_end|>",
    )
    return cases


# The other families' fixtures: (prompt, num_beams, length_penalty, early_stopping,
# num_return_sequences, max_new_tokens); the EOS of each case is picked from the model's own
# beams (`auto_eos`), so that some hypotheses end by it and others run to the length limit.
FAMILY_FIXTURES = ["mistral-tiny", "qwen2-tiny", "qwen3-tiny", "gemma2-tiny", "gemma3-tiny", "phi3-tiny",
                   "gpt-bigcode-tiny", "llama2-tiny"]
FAMILY_CASES = [
    (0, 3, 1.0, False, 2, 8),
    (1, 2, 0.0, "never", 2, 8),
    (2, 3, 1.5, True, 2, 10),
]


@torch.no_grad()
def auto_eos(model, prompt, case):
    """An EOS some beams meet early: a token the beams found without any EOS take at their third or
    fourth step (the second-best beam's first), the first whose returned hypotheses are not within
    1e-3 of a tie (so that their order is not a matter of rounding)."""
    p, num_beams, lp, es, n_return, max_new = case
    out = model.generate(torch.tensor([prompt]), num_beams=num_beams, do_sample=False, max_new_tokens=max_new,
                         num_return_sequences=num_beams, eos_token_id=None, pad_token_id=0)
    candidates = [int(out[b, len(prompt) + k]) for k in (2, 3) for b in (1, 0, 2) if b < num_beams]
    for eos in dict.fromkeys(candidates):
        tried, _ = run_case(model, "auto", prompt, num_beams, lp, es, n_return, max_new, [eos])
        if tried["score_margin"] is None or tried["score_margin"] >= 1e-3:
            return [eos]
    sys.exit(f"no EOS candidate gives a clear order for case {case}")


def family(folder):
    model = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, folder), dtype=torch.float32)
    model.eval()
    fresh_generation_config(model)
    prompts = load_reference_prompts(folder)[:3]
    table = [(*case, auto_eos(model, prompts[case[0]], case)) for case in FAMILY_CASES]
    note = ("random tiny model, prompts p0..p2 of reference.json; each EOS is a token the beams found without "
            "EOS take early, chosen so that the returned order is not within 1e-3 of a tie")
    return run_model(model, folder, prompts, table, os.path.join(ROOT, folder, "beam_reference.json"), note)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["gpt2-tiny", "llama-tiny", "smollm2", "families"] + FAMILY_FIXTURES,
                        help="write one model's references (families: every fixture of FAMILY_FIXTURES)")
    parser.add_argument("--gguf", default=os.environ.get("KILN_SMOLLM2_GGUF", DEFAULT_GGUF), help="SmolLM2 GGUF path")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.use_deterministic_algorithms(True)
    note = "random tiny model, prompts p0..p2 of reference.json; EOS ids are tokens the model picks early for that prompt"
    if args.only in (None, "gpt2-tiny"):
        tiny("gpt2-tiny", GPT2_CASES, note)
    if args.only in (None, "llama-tiny"):
        tiny("llama-tiny", LLAMA_CASES, note)
    if args.only in (None, "smollm2"):
        smollm2(args.gguf)
    for folder in FAMILY_FIXTURES:
        if args.only in (None, "families", folder):
            family(folder)


if __name__ == "__main__":
    main()
