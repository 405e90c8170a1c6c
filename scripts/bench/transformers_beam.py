#!/usr/bin/env python3
"""transformers' beam search on SmolLM2-135M-Instruct (the GGUF dequantized to f32, CPU, 2
threads): the side of docs/benchmarks.md's beam-search comparison with `kiln generate
--num-beams N --dtype f32`. Prints one line: N new tokens in S seconds (EOS off, every
hypothesis runs to the budget; one 8-token warm-up first).

    python3 scripts/bench/transformers_beam.py BEAMS [NEW_TOKENS] [GGUF]

Needs torch, transformers, gguf. The GGUF defaults to kiln's model cache
(~/.cache/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf).
"""
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

beams = int(sys.argv[1])
new_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 64
gguf = sys.argv[3] if len(sys.argv) > 3 else os.path.expanduser(
    "~/.cache/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf"
)
torch.set_num_threads(2)
folder, name = os.path.split(gguf)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
model.generation_config = GenerationConfig()  # no processors from the checkpoint
prompt = torch.tensor([[504, 3575, 282, 4649, 314]])  # "The capital of France is"


def run(n):
    return model.generate(
        prompt, num_beams=beams, do_sample=False, max_new_tokens=n, min_new_tokens=n,
        eos_token_id=None, pad_token_id=2,
    )


with torch.no_grad():
    run(8)
    start = time.perf_counter()
    out = run(new_tokens)
    seconds = time.perf_counter() - start
generated = out.shape[1] - prompt.shape[1]
print(f"transformers, {beams} beams: {generated} tokens in {seconds:.2f} s = {generated / seconds:.1f} tok/s")
