#!/usr/bin/env python3
"""Embedding references: the final hidden states of transformers' AutoModel, pooled and normalised.

Writes embedding_reference.json in these fixture folders under crates/models/tests/fixtures/:
  qwen3-tiny/embedding_reference.json
  llama-tiny/embedding_reference.json

For each input (token ids: one of a single token, several of different lengths) it runs, on CPU in
f32 with the model in eval mode, each input ALONE (batch of one, no padding, no attention mask):
    out = AutoModel.from_pretrained(folder, dtype=torch.float32)(input_ids=ids[None])
    h = out.last_hidden_state[0]          # [seq_len, d_model], after the model's final norm
and records
    last: h[-1] / ||h[-1]||               # Qwen3-Embedding's (sentence-transformers' lasttoken) pooling
    mean: h.mean(0) / ||h.mean(0)||       # sentence-transformers' pooling_mode_mean_tokens
as lists of floats. `last_hidden_state` is the output of the final norm (Qwen3Model / LlamaModel apply
`self.norm` before returning it), which is what kiln's `CausalLm::hidden_states` returns.

kiln's test (crates/engine/tests/embeddings.rs) embeds the same inputs packed together in one forward
and one at a time, and compares with these within 1e-4.

Needs (pip): torch, transformers, safetensors. Generated with transformers 5.24.0, torch 2.15.0. Run from
the repository root:

    python3 scripts/reference/make_embedding_fixtures.py
"""
import json
import os

import torch
import transformers
from transformers import AutoModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "crates", "models", "tests", "fixtures")

# Token ids inside every fixture's vocabulary (the smallest is 387): one single token, and several
# lengths so a packed batch mixes them.
INPUTS = [
    [5],
    [12, 40, 7, 99, 3],
    [200, 17, 8],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
    [300, 301],
]


def normalised(v):
    return (v / v.norm()).tolist()


def reference(name):
    folder = os.path.join(FIXTURES, name)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    cases = []
    with torch.no_grad():
        for ids in INPUTS:
            out = model(input_ids=torch.tensor([ids]))
            h = out.last_hidden_state[0].to(torch.float32)
            cases.append({"input": ids, "last": normalised(h[-1]), "mean": normalised(h.mean(0))})
    return {
        "generator": "scripts/reference/make_embedding_fixtures.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "note": "AutoModel(...).last_hidden_state of each input alone, f32; last token and mean over tokens, "
        "each L2-normalised",
        "d_model": model.config.hidden_size,
        "cases": cases,
    }


def main():
    for name in ["qwen3-tiny", "llama-tiny"]:
        path = os.path.join(FIXTURES, name, "embedding_reference.json")
        with open(path, "w") as f:
            json.dump(reference(name), f, indent=1)
            f.write("\n")
        print("wrote", os.path.relpath(path, ROOT))


if __name__ == "__main__":
    main()
