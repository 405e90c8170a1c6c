#!/usr/bin/env python3
"""Writes an F16 GGUF file of a published Llama shape with random weights and SmolLM2's
tokenizer, for speed comparisons on sizes whose real weights cannot be downloaded here.

    python3 scripts/bench/make_shape_gguf.py --shape llama-3.2-1b --out target/shapes/llama-3.2-1b.F16.gguf

Then `target/llama.cpp/build/bin/llama-quantize IN.gguf OUT.gguf Q4_K_M` (after `cargo xtask
llama-cpp`) makes the file types users download. The tokenizer (vocabulary 49,152) comes
from SmolLM2's GGUF file in kiln's model cache, so both tools tokenize the same prompts; the
head is that vocabulary's, not the shape's own (128,256 for Llama 3). One random matrix per
distinct shape is shared by every layer: the speed is the same, the file is written in
minutes. Weights are N(0, 0.02), so activations stay in a realistic range.

Needs `pip install gguf numpy`.
"""

import argparse
import os
from pathlib import Path

import gguf
import numpy as np

SHAPES = {
    # layers, hidden, feed-forward, heads, KV heads, RoPE base, tied embeddings
    "llama-3.2-1b": (16, 2048, 8192, 32, 8, 500000.0, True),
    "llama-3.2-3b": (28, 3072, 8192, 24, 8, 500000.0, True),
    "llama-3.1-8b": (32, 4096, 14336, 32, 8, 500000.0, False),
}

SMOLLM2 = Path(
    os.environ.get("KILN_HOME", Path.home() / ".cache/kiln")
) / "models/SmolLM2-135M-Instruct.Q4_1.gguf"


def field_value(field):
    """A GGUFReader field as the Python value GGUFWriter takes."""
    kind = field.types[0]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    if kind == gguf.GGUFValueType.ARRAY:
        inner = field.types[1]
        if inner == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    return field.parts[field.data[0]].tolist()[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer-from", type=Path, default=SMOLLM2)
    args = parser.parse_args()

    layers, hidden, ff, heads, kv_heads, rope_base, tied = SHAPES[args.shape]
    head_dim = hidden // heads
    source = gguf.GGUFReader(args.tokenizer_from)
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)

    writer = gguf.GGUFWriter(args.out, "llama")
    writer.add_name(f"{args.shape} (random weights, SmolLM2 tokenizer)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_block_count(layers)
    writer.add_context_length(131072)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope_base)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            value = field_value(field)
            kind = field.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                writer.add_array(name, value)
            else:
                writer.add_key_value(name, value, kind)

    rng = np.random.default_rng(0)
    matrices = {}

    def random(rows, cols):
        # One matrix per shape, shared by every layer that has it.
        if (rows, cols) not in matrices:
            values = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
            matrices[(rows, cols)] = values.astype(np.float16)
        return matrices[(rows, cols)]

    ones = np.ones(hidden, dtype=np.float32)
    writer.add_tensor("token_embd.weight", random(vocab, hidden))
    for i in range(layers):
        block = f"blk.{i}"
        writer.add_tensor(f"{block}.attn_norm.weight", ones)
        writer.add_tensor(f"{block}.attn_q.weight", random(hidden, hidden))
        writer.add_tensor(f"{block}.attn_k.weight", random(kv_heads * head_dim, hidden))
        writer.add_tensor(f"{block}.attn_v.weight", random(kv_heads * head_dim, hidden))
        writer.add_tensor(f"{block}.attn_output.weight", random(hidden, hidden))
        writer.add_tensor(f"{block}.ffn_norm.weight", ones)
        writer.add_tensor(f"{block}.ffn_gate.weight", random(ff, hidden))
        writer.add_tensor(f"{block}.ffn_up.weight", random(ff, hidden))
        writer.add_tensor(f"{block}.ffn_down.weight", random(hidden, ff))
    writer.add_tensor("output_norm.weight", ones)
    if not tied:
        # Its own matrix: a shared one would be the embedding's bytes twice.
        values = rng.standard_normal((vocab, hidden), dtype=np.float32) * 0.02
        writer.add_tensor("output.weight", values.astype(np.float16))

    args.out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    print(args.out)


if __name__ == "__main__":
    main()
