#!/usr/bin/env python3
"""Tiny random GPT-2 and Llama checkpoints with Hugging Face transformers' outputs for them.

Writes crates/models/tests/fixtures/<name>/ for:
  gpt2-tiny          HF folder, vocab.json + merges.txt only (no tokenizer.json), f32
  gpt2-tiny-legacy   the same weights with keys lacking `transformer.` and old `attn.bias` buffers
  gpt2-tiny-lenient  `GPT2Config(vocab_size=512)` as test checkpoints write it: BOS/EOS keep
                     GPT-2's 50256, outside the vocabulary; no tokenizer (prompts are ids)
  llama-tiny         Llama-3.1 style: GQA (4 heads, 2 KV), llama3 rope scaling, untied head,
                     sharded safetensors + index, tokenizer.json, transformers-5 config keys
  llama-tiny-meta    the same weights as Meta's original format: params.json,
                     consolidated.00.pth (wq/wk in Meta's interleaved RoPE order), tokenizer.model
  llama-tiny-dcp     llama-tiny-meta's weights as torchtitan saves them: a torch.distributed.checkpoint
                     folder (`.metadata`, `__0_0.distcp`, keys under `model.`) with its params.json
                     and tokenizer.model (`--only dcp`, which reads llama-tiny-meta)
  dcp-chunks         small bf16 / f16 / f32 / 0-d tensors whose chunks tile them (split along rows,
                     along columns with a strided chunk, a 2x2 grid over two data files), as a
                     sharded save writes them, plus a bytes entry and two broken `.metadata`
                     variants; torch's own `dcp.load` reads it back (`--only dcp`)
  llama-tiny-tied    Llama-3.2 style: tied head, bf16 weights, transformers-4 config keys
  mistral-tiny       Mistral: Llama's architecture with `sliding_window` 5 (every layer attends
                     over the last 5 positions); no tokenizer (prompts are ids), eager attention
  qwen2-tiny         Qwen2.5 style: Q/K/V biases (random, not transformers' zero init), tied head,
                     rope_theta 1e6, `use_sliding_window` with window 5 from layer 1 of 2 (so one
                     layer slides and one does not), Qwen2's tokenizer.json layout (NFC, its split
                     regex, ChatML specials), eager attention
  qwen3-tiny         Qwen3 style: per-head q_norm/k_norm (random weights), head_dim 32 over hidden
                     64 with 4 heads (not hidden / heads), GQA 4/2, untied head, the same tokenizer;
                     yarn_reference.json: the same weights with YaRN RoPE scaling (factor 4 over 32)
  gemma2-tiny        Gemma 2: random (1 + w) norms around attention and MLP, GeGLU, head_dim 32 with
                     query_pre_attn_scalar 24, soft caps small enough to bend (attention 2, logits
                     3), window 5 on layers 0 and 2 of 3, tied head; a byte-level BPE tokenizer with
                     Gemma's special ids and chat template (not Gemma's SentencePiece vocabulary)
  gpt-bigcode-tiny   GPT-BigCode (SantaCoder/StarCoder): multi-query attention (4 query heads, one
                     key/value head) in a fused c_attn, nn.Linear layers, random biases and LayerNorm
                     weights, unscaled scores (scale_attn_weights false), tokenizer.json
  llama2-tiny        Llama 2 / Mistral 7B style: a SentencePiece tokenizer.model (BPE, byte fallback,
                     dummy prefix, digits split, `[INST]`/`[/INST]` control and `<tool>` user-defined
                     pieces; trained here on the corpus and around-the-world-ch1-2.txt), the
                     tokenizer.json transformers converts it to, Mistral's [INST] chat template,
                     GQA 4/2, rope_theta 10,000, untied head; its GGUF comes from
                     make_family_ggufs.py
  gemma3-tiny        Gemma 3 (text): as gemma2-tiny without soft caps, plus random (1 + w) q/k norms,
                     a local RoPE base (10,000) on the windowed layers and a global one (1e6, linear
                     scaling 2) on the full layer, GQA 4/2, untied head
and in each, reference.json (prompts, greedy continuations, versions) and logits.safetensors
(transformers' full f32 logits per prompt). Run from the repository root:

    python3 scripts/reference/make_model_fixtures.py            # every fixture
    python3 scripts/reference/make_model_fixtures.py --only gpt2-tiny-lenient
"""
import argparse
import base64
import json
import math
import os
import shutil
import sys

import tiktoken
import tokenizers
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GPTBigCodeConfig,
    GPTBigCodeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "crates", "models", "tests", "fixtures")
SEED = 20261121
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "Once upon a time there was a little kiln that baked bread and pots for the whole town.",
    "def add(a, b):\n    return a + b\n\nprint(add(12, 345))  # 357\n",
    "In 2024 the model read 1234567 tokens, then 89 more, then 0.5 of a token.",
    "Hello, world! How are you today? I'm fine, thanks; we'll see what they've done.",
    "Tell me a story about a dragon who learned to code in Rust and burn.",
    "Les enfants jouent dans le jardin. Über den Wolken muss die Freiheit grenzenlos sein.",
    "emoji: 🙂🚀 and symbols: <>, {}, [], (), ==, !=, ->, =>",
] * 20
PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was",
    "def add(a, b):\n    return",
    "In 2024 the model read 1234567",
    "Tell me a story about a dragon",
]
LLAMA3_SPECIALS_NAMED = {
    0: "<|begin_of_text|>",
    1: "<|end_of_text|>",
    4: "<|finetune_right_pad_id|>",
    5: "<|step_id|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    8: "<|eom_id|>",
    9: "<|eot_id|>",
    10: "<|python_tag|>",
}
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def llama3_special_tokens():
    """Meta's 256 Llama-3.1 special tokens, in id order after the base vocabulary."""
    names, reserved = [], 0
    for i in range(256):
        if i in LLAMA3_SPECIALS_NAMED:
            names.append(LLAMA3_SPECIALS_NAMED[i])
        else:
            names.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return names


def train_bpe(vocab_size, pre_tokenizer, specials):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=specials,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def byte_decoder():
    """GPT-2's bytes_to_unicode, inverted: byte-level characters back to bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=1, ensure_ascii=False)
        f.write("\n")


@torch.no_grad()
def greedy_with_cache(model, ids, steps=20):
    """The prompt's last-position logits, then `steps` greedy tokens with the KV cache and the
    top-1/top-2 logit margin at each step."""
    out = model(torch.tensor([ids]), use_cache=True)
    last = out.logits[0, -1].float()
    past, generated, margins = out.past_key_values, [], []
    next_logits = out.logits[0, -1]
    for _ in range(steps):
        top2 = torch.topk(next_logits.float(), 2).values
        margins.append(float(top2[0] - top2[1]))
        token = int(torch.argmax(next_logits))
        generated.append(token)
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past, next_logits = out.past_key_values, out.logits[0, -1]
    return last, generated, margins


@torch.no_grad()
def reference(model, tokenizer_ids, out_dir, note, extra=None):
    """Full logits for each prompt and a 20-token greedy continuation with the KV cache."""
    model.eval()
    logits, cases = {}, []
    for i, ids in enumerate(tokenizer_ids):
        input_ids = torch.tensor([ids])
        full = model(input_ids).logits[0].float()
        logits[f"prompt_{i}"] = full.contiguous()
        _, generated, margins = greedy_with_cache(model, ids)
        cases.append({"prompt_ids": ids, "greedy": generated, "min_greedy_margin": min(margins)})
    save_file(logits, os.path.join(out_dir, "logits.safetensors"))
    write_json(
        os.path.join(out_dir, "reference.json"),
        {
            "generator": "scripts/reference/make_model_fixtures.py",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "tokenizers": tokenizers.__version__,
            "note": note,
            "cases": cases,
            **(extra or {}),
        },
    )
    return min(c["min_greedy_margin"] for c in cases)


def fresh_dir(name):
    path = os.path.join(ROOT, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def gpt2():
    torch.manual_seed(SEED)
    tok = train_bpe(
        384,
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ["<|endoftext|>"],
    )
    eot = tok.token_to_id("<|endoftext|>")
    config = GPT2Config(
        vocab_size=tok.get_vocab_size(),
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        initializer_range=0.15,
        bos_token_id=eot,
        eos_token_id=eot,
    )
    model = GPT2LMHeadModel(config)
    out = fresh_dir("gpt2-tiny")
    model.save_pretrained(out, safe_serialization=True)
    tok.model.save(out)  # vocab.json + merges.txt
    ids = [tok.encode(p).ids for p in PROMPTS]
    margin = reference(model, ids, out, "GPT-2, vocab.json + merges.txt, f32, tied head")

    legacy = fresh_dir("gpt2-tiny-legacy")
    state = load_file(os.path.join(out, "model.safetensors"))
    old = {k.removeprefix("transformer."): v for k, v in state.items()}
    for layer in range(config.n_layer):
        old[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
    save_file(old, os.path.join(legacy, "model.safetensors"))
    shutil.copy(os.path.join(out, "config.json"), legacy)
    tok.save(os.path.join(legacy, "tokenizer.json"))
    for f in ("reference.json", "logits.safetensors"):
        shutil.copy(os.path.join(out, f), legacy)
    return margin


def bigcode():
    """GPT-BigCode: GPT-2's block with one key/value head, nn.Linear layers (transformers zero-
    initialises their biases and sets LayerNorm to 1/0, so both are randomized), and unscaled
    attention scores (`scale_attn_weights` false) to test that the scale is read."""
    torch.manual_seed(SEED + 31)
    tok = train_bpe(
        384,
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ["<|endoftext|>"],
    )
    eot = tok.token_to_id("<|endoftext|>")
    config = GPTBigCodeConfig(
        vocab_size=tok.get_vocab_size(),
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        multi_query=True,
        scale_attn_weights=False,
        initializer_range=0.1,
        bos_token_id=eot,
        eos_token_id=eot,
        attn_implementation="eager",
    )
    model = GPTBigCodeForCausalLM(config)
    for name, param in model.named_parameters():
        if name.endswith("bias") or ".ln_" in name:
            around = 1.0 if name.endswith(".weight") else 0.0
            param.copy_(torch.randn_like(param) * 0.2 + around)
    out = fresh_dir("gpt-bigcode-tiny")
    model.save_pretrained(out, safe_serialization=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    ids = [tok.encode(p).ids for p in PROMPTS]
    reloaded = GPTBigCodeForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    return reference(reloaded, ids, out, "GPT-BigCode: multi-query (4 query heads, 1 KV head), unscaled scores, random biases, f32")


def gpt2_lenient():
    """A config transformers loads although its special tokens cannot exist: GPT2Config's
    defaults keep bos/eos 50256 over a 512-token vocabulary. transformers runs it (the ids are
    never generated); the reference is its greedy continuation, checked against generate()."""
    torch.manual_seed(SEED)
    config = GPT2Config(vocab_size=512, n_positions=64, n_embd=32, n_layer=2, n_head=4, initializer_range=0.2)
    assert config.bos_token_id == 50256 and config.eos_token_id == 50256, "GPT2Config's defaults changed"
    model = GPT2LMHeadModel(config)
    out = fresh_dir("gpt2-tiny-lenient")
    model.save_pretrained(out, safe_serialization=True)
    prompts = [[17, 300, 5, 411, 98], [1, 2, 3], [500, 42, 7, 256, 128, 64]]
    margin = reference(model, prompts, out, "GPT-2 with GPT2Config's default bos/eos 50256 over vocab 512, f32, tied head")
    # transformers' own generate() loads the impossible EOS too and never stops on it.
    for ids in prompts:
        generated = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids):].tolist()
        cases = json.load(open(os.path.join(out, "reference.json")))["cases"]
        assert any(c["prompt_ids"] == ids and c["greedy"] == generated for c in cases), "generate() disagrees"
    return margin


def llama_tokenizer():
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok = train_bpe(384, pre, [])
    base = tok.get_vocab_size()
    specials = llama3_special_tokens()
    tok.add_special_tokens(specials)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", bos)]
    )
    return tok, base, specials


def llama_config(tok, tied, legacy_keys):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0 if not tied else 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        tie_word_embeddings=tied,
        initializer_range=0.15,
        bos_token_id=tok.token_to_id("<|begin_of_text|>"),
        eos_token_id=[tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")],
    )


def write_tokenizer_files(out, tok):
    tok.save(os.path.join(out, "tokenizer.json"))
    write_json(
        os.path.join(out, "tokenizer_config.json"),
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "add_bos_token": True,
            "chat_template": LLAMA3_CHAT_TEMPLATE,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )


def to_legacy_config(out):
    """Rewrites config.json as transformers 4.x wrote it (what checkpoints on the hub hold)."""
    path = os.path.join(out, "config.json")
    config = json.load(open(path))
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    config["torch_dtype"] = config.pop("dtype", "bfloat16")
    config["transformers_version"] = "4.45.0"
    write_json(path, config)


def meta_permute(w, n_heads):
    """HF rotate-half row order back to Meta's interleaved order (inverse of HF's converter)."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def write_meta(model, config, tok, base, specials, out):
    sd = model.state_dict()
    meta = {
        "tok_embeddings.weight": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
        "output.weight": sd["lm_head.weight"],
    }
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        meta[f"layers.{i}.attention.wq.weight"] = meta_permute(sd[p + "self_attn.q_proj.weight"], config.num_attention_heads)
        meta[f"layers.{i}.attention.wk.weight"] = meta_permute(sd[p + "self_attn.k_proj.weight"], config.num_key_value_heads)
        meta[f"layers.{i}.attention.wv.weight"] = sd[p + "self_attn.v_proj.weight"]
        meta[f"layers.{i}.attention.wo.weight"] = sd[p + "self_attn.o_proj.weight"]
        meta[f"layers.{i}.feed_forward.w1.weight"] = sd[p + "mlp.gate_proj.weight"]
        meta[f"layers.{i}.feed_forward.w2.weight"] = sd[p + "mlp.down_proj.weight"]
        meta[f"layers.{i}.feed_forward.w3.weight"] = sd[p + "mlp.up_proj.weight"]
        meta[f"layers.{i}.attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        meta[f"layers.{i}.ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
    torch.save({k: v.clone().contiguous() for k, v in meta.items()}, os.path.join(out, "consolidated.00.pth"))
    rope = config.rope_parameters
    write_json(
        os.path.join(out, "params.json"),
        {
            "dim": config.hidden_size,
            "n_layers": config.num_hidden_layers,
            "n_heads": config.num_attention_heads,
            "n_kv_heads": config.num_key_value_heads,
            "vocab_size": config.vocab_size,
            "ffn_dim_multiplier": 1.0,
            "multiple_of": 128,
            "norm_eps": config.rms_norm_eps,
            "rope_theta": rope["rope_theta"],
            "use_scaled_rope": True,
            "rope_scaling_factor": rope["factor"],
            "original_max_position_embeddings": rope["original_max_position_embeddings"],
            "max_seq_len": config.max_position_embeddings,
        },
    )
    # tiktoken format: base64 of the token's bytes, then its rank (= id), one per line.
    decode = byte_decoder()
    vocab = tok.get_vocab()
    ranks = {}
    with open(os.path.join(out, "tokenizer.model"), "w") as f:
        for token, rank in sorted(vocab.items(), key=lambda kv: kv[1]):
            if rank >= base:
                continue
            raw = bytes(decode[c] for c in token)
            ranks[raw] = rank
            f.write(f"{base64.b64encode(raw).decode()} {rank}\n")
    enc = tiktoken.Encoding(
        name="kiln-tiny",
        pat_str=LLAMA3_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={s: base + i for i, s in enumerate(specials)},
    )
    return enc


def llama():
    tok, base, specials = llama_tokenizer()
    results = []
    for name, tied in (("llama-tiny", False), ("llama-tiny-tied", True)):
        torch.manual_seed(SEED + (1 if tied else 0))
        config = llama_config(tok, tied, legacy_keys=tied)
        model = LlamaForCausalLM(config)
        if tied:
            model = model.to(torch.bfloat16)
        out = fresh_dir(name)
        if tied:
            model.save_pretrained(out, safe_serialization=True)
            to_legacy_config(out)
        else:
            model.save_pretrained(out, safe_serialization=True, max_shard_size="200KB")
        write_tokenizer_files(out, tok)
        write_json(
            os.path.join(out, "generation_config.json"),
            {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id},
        )
        # The reference is computed in f32 from the weights as saved (bf16 for the tied model).
        reloaded = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
        ids = [tok.encode(p).ids for p in PROMPTS]
        chat = tok.encode(
            "<|start_header_id|>user<|end_header_id|>\n\nTell me a story<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        ).ids
        ids.append(chat)
        note = ("Llama-3.2 style, tied head, bf16 weights, transformers-4 config keys" if tied else
                "Llama-3.1 style, GQA 4/2, llama3 rope scaling, untied head, sharded safetensors")
        tricky = ["a  1", "1234567", "  leading", "naïve café 🙂", "<|eot_id|>x", "x\n\n\ny", "I'm we'll", ""]
        extra = {"tokenizer_cases": [{"text": t, "ids": tok.encode(t).ids} for t in tricky]}
        results.append(reference(reloaded, ids, out, note, extra))
        if not tied:
            meta = fresh_dir("llama-tiny-meta")
            enc = write_meta(reloaded, config, tok, base, specials, meta)
            for f in ("reference.json", "logits.safetensors"):
                shutil.copy(os.path.join(out, f), meta)
            # Meta's tokenizer is tiktoken: its ids are the reference for tokenizer.model.
            cases = [{"text": t, "ids": enc.encode(t, allowed_special="all")} for t in PROMPTS + tricky]
            write_json(os.path.join(meta, "tiktoken_reference.json"), {"tiktoken": tiktoken.__version__, "cases": cases})
    return min(results)


def dcp():
    """llama-tiny-meta's consolidated.00.pth saved by torch.distributed.checkpoint as torchtitan
    saves a model (`{"model": state_dict}`, so keys read `model.layers.0...`), single process;
    and dcp-chunks, a hand-made multi-chunk checkpoint (one process cannot shard), checked by
    torch's own loader. Returns 1.0 (no greedy margins here: the references are llama-tiny-meta's)."""
    import io
    import pickle

    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    meta = os.path.join(ROOT, "llama-tiny-meta")
    out = fresh_dir("llama-tiny-dcp")
    state = torch.load(os.path.join(meta, "consolidated.00.pth"), weights_only=True)
    dist_cp.save({"model": state}, storage_writer=dist_cp.FileSystemWriter(out))
    for f in ("params.json", "tokenizer.model"):
        shutil.copy(os.path.join(meta, f), out)
    back = {"model": {k: torch.empty_like(v) for k, v in state.items()}}
    dist_cp.load(back, storage_reader=dist_cp.FileSystemReader(out))
    assert all(torch.equal(back["model"][k], v) for k, v in state.items())

    # dcp-chunks: value k of a tensor (row-major) is k / 4 - 1, exact in bf16 and f16.
    out = fresh_dir("dcp-chunks")
    tensors = {
        "model.rows": (torch.bfloat16, (6, 4), [((0, 0), (4, 4)), ((4, 0), (2, 4))]),
        "model.cols": (torch.float16, (3, 5), [((0, 0), (3, 2)), ((0, 2), (3, 3))]),
        "grid": (torch.float32, (4, 6), [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))]),
        "scalar": (torch.float32, (), [((), ())]),
    }
    full = {name: (torch.arange(math.prod(shape), dtype=torch.float32) / 4 - 1).reshape(shape).to(dtype)
            for name, (dtype, shape, _) in tensors.items()}
    files = {"__0_0.distcp": io.BytesIO(), "__1_0.distcp": io.BytesIO()}
    state_md, storage = {}, {}
    for name, (dtype, shape, chunks) in tensors.items():
        metas = []
        for i, (offsets, sizes) in enumerate(chunks):
            piece = full[name][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone()
            if name == "model.cols" and i == 1:
                piece = piece.t().contiguous().t()  # column-major: read through its strides
                assert not piece.is_contiguous()
            file = "__1_0.distcp" if name == "grid" and i >= 2 else "__0_0.distcp"
            stream = files[file]
            start = stream.tell()
            torch.save(piece, stream)
            storage[MetadataIndex(name, torch.Size(offsets))] = _StorageInfo(file, start, stream.tell() - start)
            metas.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        state_md[name] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), metas)
    stream = files["__0_0.distcp"]
    start = stream.tell()
    torch.save({"step": 3}, stream)
    state_md["train_state"] = BytesStorageMetadata()
    storage[MetadataIndex("train_state")] = _StorageInfo("__0_0.distcp", start, stream.tell() - start)
    for file, stream in files.items():
        with open(os.path.join(out, file), "wb") as f:
            f.write(stream.getvalue())

    def write_metadata(file, state_md, storage):
        with open(os.path.join(out, file), "wb") as f:
            pickle.dump(Metadata(state_dict_metadata=state_md, storage_data=storage), f)

    write_metadata(".metadata", state_md, storage)
    back = {name: torch.zeros(shape, dtype=dtype) for name, (dtype, shape, _) in tensors.items()}
    dist_cp.load(back, storage_reader=dist_cp.FileSystemReader(out))
    assert all(torch.equal(back[name], full[name]) for name in tensors), "torch reads dcp-chunks back"
    # Broken variants (the tests rename one to `.metadata`): the grid's last chunk left out of
    # its chunk list, and kept in the list without its storage entry.
    grid = state_md["grid"]
    gap = TensorStorageMetadata(grid.properties, grid.size, grid.chunks[:3])
    write_metadata("missing-chunk.metadata", {**state_md, "grid": gap}, storage)
    last = MetadataIndex("grid", torch.Size((2, 3)))
    write_metadata("missing-storage.metadata", state_md, {k: v for k, v in storage.items() if k != last})
    return 1.0


def mistral():
    """A sliding attention window shorter than the prompts, so every greedy step depends on it:
    kiln must apply the model's window with every cache kind."""
    torch.manual_seed(SEED + 7)
    config = MistralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        sliding_window=5,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    model = MistralForCausalLM(config)
    out = fresh_dir("mistral-tiny")
    model.save_pretrained(out, safe_serialization=True)
    reloaded = MistralForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    prompts = [[1, 17, 200, 5, 41, 98, 33, 7, 250, 12, 64, 3], [1, 9, 9, 9, 100], [1] + list(range(30, 60))]
    return reference(reloaded, prompts, out, "Mistral: Llama with sliding_window 5, GQA 4/2, f32, untied head")


QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHATML_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen_tokenizer():
    """Qwen2's tokenizer.json layout: NFC, its split regex (single digits), byte-level BPE without
    a BOS, and the ChatML specials after the base vocabulary."""
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok = train_bpe(384, pre, [])
    tok.normalizer = normalizers.NFC()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def randomize(model, names, scale):
    """transformers zero-initialises biases and sets norms to one; a fixture with those values
    would not test that they are read. Replaces each parameter whose name ends with one of
    `names` by random values (norms around 1)."""
    for name, param in model.named_parameters():
        if any(name.endswith(n) for n in names):
            noise = torch.randn_like(param) * scale
            param.copy_(noise + (1.0 if "norm" in name else 0.0))


def qwen():
    tok = qwen_tokenizer()
    eos = tok.token_to_id("<|im_end|>")
    endoftext = tok.token_to_id("<|endoftext|>")
    common = dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        initializer_range=0.15,
        bos_token_id=endoftext,
        eos_token_id=[eos, endoftext],
        attn_implementation="eager",
    )
    chat = tok.encode("<|im_start|>user\nTell me a story<|im_end|>\n<|im_start|>assistant\n").ids
    ids = [tok.encode(p).ids for p in PROMPTS] + [chat]
    tricky = ["a  1", "1234567", "  leading", "naïve café 🙂", "e\u0301t\u00e9", "<|im_end|>x", "x\n\n\ny", "I'm we'll", ""]
    extra = {"tokenizer_cases": [{"text": t, "ids": tok.encode(t).ids} for t in tricky]}
    results = []
    for name, cls, config, params, note in (
        (
            "qwen2-tiny",
            Qwen2ForCausalLM,
            Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=True, sliding_window=5, max_window_layers=1),
            ("q_proj.bias", "k_proj.bias", "v_proj.bias", "layernorm.weight"),
            "Qwen2.5 style: random Q/K/V biases, tied head, sliding window 5 on layer 1 only, f32",
        ),
        (
            "qwen3-tiny",
            Qwen3ForCausalLM,
            Qwen3Config(**common, head_dim=32, tie_word_embeddings=False),
            ("q_norm.weight", "k_norm.weight", "layernorm.weight"),
            "Qwen3 style: random per-head q/k norms, head_dim 32 (hidden 64, 4 heads), GQA 4/2, untied head, f32",
        ),
    ):
        torch.manual_seed(SEED + 11 + len(results))
        model = cls(config)
        randomize(model, params, 0.3)
        out = fresh_dir(name)
        model.save_pretrained(out, safe_serialization=True)
        tok.save(os.path.join(out, "tokenizer.json"))
        write_json(
            os.path.join(out, "tokenizer_config.json"),
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "add_bos_token": False,
                "chat_template": CHATML_TEMPLATE,
                "tokenizer_class": "Qwen2Tokenizer",
            },
        )
        write_json(
            os.path.join(out, "generation_config.json"),
            {"bos_token_id": endoftext, "eos_token_id": [eos, endoftext]},
        )
        reloaded = cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
        results.append(reference(reloaded, ids, out, note, extra))
        if name == "qwen3-tiny":
            yarn_reference(out, cls, ids)
    return min(results)


# Gemma 2's chat template (google/gemma-2-2b-it): no system role, `model` for the assistant.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)


def gemma_tokenizer():
    """A byte-level BPE standing in for Gemma's SentencePiece vocabulary (kiln's HF tokenizer
    reads byte-level BPE), with Gemma's special ids: <pad> 0, <eos> 1, <bos> 2, <unk> 3, the turn
    markers after the base vocabulary, and a BOS on every encoding."""
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok = train_bpe(384, pre, ["<pad>", "<eos>", "<bos>", "<unk>"])
    tok.add_special_tokens(["<start_of_turn>", "<end_of_turn>"])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)])
    return tok


def randomize_gemma_norms(model, scale):
    """Gemma's norms hold `w` for a scale of `1 + w`, initialised to 0: random values around 0
    so that the fixture tests the 1 is added."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(torch.randn_like(param) * scale)


def gemma():
    tok = gemma_tokenizer()
    end_of_turn = tok.token_to_id("<end_of_turn>")
    common = dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=24,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        sliding_window=5,
        initializer_range=0.15,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=[1, end_of_turn],
        attn_implementation="eager",
    )
    chat = tok.encode("<start_of_turn>user\nTell me a story<end_of_turn>\n<start_of_turn>model\n").ids
    ids = [tok.encode(p).ids for p in PROMPTS] + [chat]
    results = []
    for name, cls, config, note in (
        (
            "gemma2-tiny",
            Gemma2ForCausalLM,
            Gemma2Config(**common, attn_logit_softcapping=2.0, final_logit_softcapping=3.0, tie_word_embeddings=True),
            "Gemma 2: random (1 + w) norms, GeGLU, query_pre_attn_scalar 24 over head_dim 32, soft caps 2 and 3, "
            "window 5 on layers 0 and 2, tied head, f32",
        ),
        (
            "gemma3-tiny",
            Gemma3ForCausalLM,
            Gemma3TextConfig(
                **common,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                rope_parameters={
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                },
                tie_word_embeddings=False,
            ),
            "Gemma 3 (text): random (1 + w) norms and q/k norms, GeGLU, query_pre_attn_scalar 24, local RoPE base "
            "10,000 on the windowed layers 0 and 2, global 1e6 with linear scaling 2 on layer 1, untied head, f32",
        ),
    ):
        torch.manual_seed(SEED + 21 + len(results))
        model = cls(config)
        randomize_gemma_norms(model, 0.3)
        out = fresh_dir(name)
        model.save_pretrained(out, safe_serialization=True)
        tok.save(os.path.join(out, "tokenizer.json"))
        write_json(
            os.path.join(out, "tokenizer_config.json"),
            {
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "add_bos_token": True,
                "chat_template": GEMMA_TEMPLATE,
                # Not GemmaTokenizer: that class would impose SentencePiece's pre-tokenization
                # on this byte-level stand-in.
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
        )
        write_json(
            os.path.join(out, "generation_config.json"),
            {"bos_token_id": 2, "eos_token_id": [1, end_of_turn], "pad_token_id": 0},
        )
        reloaded = cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
        results.append(reference(reloaded, ids, out, note, {"chat_cases": gemma_chat_cases(out)}))
    return min(results)


def gemma_chat_cases(out):
    """Gemma's template as transformers renders it: one and two turns (`model` for the
    assistant, contents trimmed), and the system message it refuses (`error`)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    cases = []
    for messages in (
        [{"role": "user", "content": "Tell me a story"}],
        [
            {"role": "user", "content": "  Hi there \n"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "What is 2+2?"},
        ],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    ):
        try:
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            cases.append({"messages": messages, "rendered": rendered,
                          "ids": tokenizer(rendered, add_special_tokens=False)["input_ids"]})
        except Exception as e:  # transformers' raise_exception
            cases.append({"messages": messages, "error": str(e)})
    return cases


# Qwen3's documented long-context setting, scaled to the fixture: factor 4 over an original
# context of 32 (of its 128 positions).
YARN = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32}


@torch.no_grad()
def yarn_reference(out, cls, prompts):
    """The same weights with YaRN RoPE scaling: last-position logits and 20 greedy tokens
    (with the KV cache) per prompt, in yarn_reference.json (the test rewrites config.json)."""
    config = json.load(open(os.path.join(out, "config.json")))
    config["rope_parameters"] = YARN
    with open(os.path.join(out, "config.json")) as f:
        original = f.read()
    try:
        write_json(os.path.join(out, "config.json"), config)
        model = cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    finally:
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write(original)
    cases = []
    for ids in prompts:
        last, generated, _ = greedy_with_cache(model, ids)
        cases.append({"prompt_ids": ids, "last_logits": [round(float(x), 7) for x in last], "greedy": generated})
    write_json(
        os.path.join(out, "yarn_reference.json"),
        {"generator": "scripts/reference/make_model_fixtures.py", "transformers": transformers.__version__,
         "rope_parameters": YARN, "cases": cases},
    )


MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- else %}{{- message['content'] + eos_token }}"
    "{%- endif %}{%- endfor %}"
)
SPM_TRICKY = [
    "a  1", "  leading", "naïve café 🙂", "x\n\n\ny", "日本語", "1234567", "end  ", "\ttab", "", " ",
    "<s>x</s> y", "[INST] Hi [/INST] ok", "use <tool> now", "<unk>", "I'm we'll",
]


def train_sentencepiece():
    """A SentencePiece BPE model with Llama 2's settings (identity normalization, dummy prefix,
    no whitespace folding, digits split, byte fallback): the serialized `tokenizer.model`."""
    import io
    import sentencepiece

    text = open(os.path.join(ROOT, "text", "around-the-world-ch1-2.txt")).read()
    lines = [line for line in text.splitlines() if line.strip()] + CORPUS
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=640, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=True,
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, user_defined_symbols=["<tool>"],
        control_symbols=["[INST]", "[/INST]"], num_threads=1, minloglevel=2,
    )
    return model.getvalue()


def llama2():
    """Llama 2 / Mistral: a SentencePiece vocabulary. transformers converts tokenizer.model to
    the tokenizer.json kiln reads from the folder; the GGUF (make_family_ggufs.py) carries the
    pieces, scores and types themselves."""
    out = fresh_dir("llama2-tiny")
    with open(os.path.join(out, "tokenizer.model"), "wb") as f:
        f.write(train_sentencepiece())
    write_json(
        os.path.join(out, "tokenizer_config.json"),
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "add_bos_token": True, "add_eos_token": False, "chat_template": MISTRAL_CHAT_TEMPLATE},
    )
    tok = transformers.AutoTokenizer.from_pretrained(out)
    tok.save_pretrained(out)
    # transformers 4.x also wrote each added token's flags; llama.cpp's converter reads them to
    # type the GGUF's pieces (special: control; otherwise user-defined).
    config_path = os.path.join(out, "tokenizer_config.json")
    tokenizer_config = json.load(open(config_path))
    tokenizer_config["added_tokens_decoder"] = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                 "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.added_tokens_decoder.items())
    }
    write_json(config_path, tokenizer_config)
    torch.manual_seed(SEED + 11)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.15,
        bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    reloaded = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    chat = [{"role": "user", "content": "Tell me a story"}]
    ids.append(tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"])
    extra = {"tokenizer_cases": [{"text": t, "ids": tok(t)["input_ids"]} for t in PROMPTS + SPM_TRICKY]}
    note = "Llama 2 / Mistral style: SentencePiece tokenizer.model, GQA 4/2, untied head, f32"
    return reference(reloaded, ids, out, note, extra)


PHI3_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
PHI3_SPECIALS = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"]


@torch.no_grad()
def longrope_cases(model, prompts):
    """Per (context, prompt): the last-position logits and greedy tokens with the KV cache, as
    many as the context leaves room for (at most 20)."""
    cases = []
    for context, ids in prompts:
        steps = min(20, (context or model.config.max_position_embeddings) - len(ids))
        last, greedy, margins = greedy_with_cache(model, ids, steps)
        cases.append({"context": context, "prompt_ids": ids, "last_logits": [float(x) for x in last],
                      "greedy": greedy, "min_greedy_margin": min(margins)})
    return cases


def phi3():
    """Phi-3: fused qkv_proj and gate_up_proj, LongRoPE, a sliding window, Llama 2's SentencePiece
    vocabulary with Phi-3's chat tokens after it and the model's vocabulary padded past them (as
    Phi-3's 32064). The main fixture's LongRoPE has its original context equal to the model's (its
    short factors, attention factor 1); longrope_reference.json holds the same weights with an
    original context of 32, on both sides of it."""
    from transformers import AddedToken, Phi3Config, Phi3ForCausalLM

    out = fresh_dir("phi3-tiny")
    with open(os.path.join(out, "tokenizer.model"), "wb") as f:
        f.write(train_sentencepiece())
    write_json(
        os.path.join(out, "tokenizer_config.json"),
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "add_bos_token": False, "add_eos_token": False, "chat_template": PHI3_CHAT_TEMPLATE},
    )
    tok = transformers.AutoTokenizer.from_pretrained(out)
    # As Phi-3's tokenizer.json: the chat tokens take the whitespace after them along.
    tok.add_tokens([AddedToken(t, special=True, normalized=False, rstrip=t != "<|endoftext|>") for t in PHI3_SPECIALS],
                   special_tokens=True)
    tok.eos_token = "<|endoftext|>"
    tok.save_pretrained(out)
    config_path = os.path.join(out, "tokenizer_config.json")
    tokenizer_config = json.load(open(config_path))
    tokenizer_config["added_tokens_decoder"] = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                 "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.added_tokens_decoder.items())
    }
    write_json(config_path, tokenizer_config)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    endoftext, end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|end|>"])
    torch.manual_seed(SEED + 13)
    short = [round(1.0 + 0.35 * i + 0.1 * float(torch.rand(())), 4) for i in range(8)]
    long = [round(f * (1.0 + 0.9 * i), 4) for i, f in enumerate(short)]
    rope = {"rope_type": "longrope", "short_factor": short, "long_factor": long}
    shape = dict(
        vocab_size=-(-len(tok) // 16) * 16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
        sliding_window=7, tie_word_embeddings=False, initializer_range=0.15, bos_token_id=1,
        eos_token_id=endoftext, pad_token_id=endoftext,
    )
    config = Phi3Config(**shape, original_max_position_embeddings=128, rope_scaling=dict(rope))
    model = Phi3ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    generation = json.load(open(os.path.join(out, "generation_config.json")))
    generation["eos_token_id"] = [endoftext, end]
    write_json(os.path.join(out, "generation_config.json"), generation)
    reloaded = Phi3ForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    ids.append(tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])

    # The same weights with an original context of 32: short factors for a context of 32, long
    # ones past it (a prompt of more than 32 tokens, the model's whole context).
    long_config = Phi3Config(**shape, original_max_position_embeddings=32, rope_scaling=dict(rope))
    scaled = Phi3ForCausalLM(long_config)
    scaled.load_state_dict(reloaded.state_dict())
    scaled.eval()
    joined = [t for p in ids for t in p][:45]
    assert len(joined) == 45
    cases = longrope_cases(scaled, [(32, ids[0][:10]), (None, joined)])
    write_json(os.path.join(out, "longrope_reference.json"), {
        "generator": "scripts/reference/make_model_fixtures.py", "transformers": transformers.__version__,
        "note": "phi3-tiny's weights with original_max_position_embeddings 32: a context of 32 (short factors) "
                "and the full 128 with a 45-token prompt (long factors); last-position logits and greedy tokens",
        "original_max_position_embeddings": 32, "cases": cases,
    })
    note = "Phi-3: fused QKV and gate/up, LongRoPE (short factors), window 7, GQA 4/2, SentencePiece + chat tokens, f32"
    texts = PROMPTS + SPM_TRICKY + ["<|user|>\nHi<|end|>\n<|assistant|>\n", "a<|end|>b <|system|> \t c", "<|end|>", "x<|endoftext|> y"]
    extra = {"tokenizer_cases": [{"text": t, "ids": tok(t)["input_ids"]} for t in texts]}
    return min(reference(reloaded, ids, out, note, extra), min(c["min_greedy_margin"] for c in cases))


@torch.no_grad()
def gemma3_multimodal():
    """gemma3-mm-tiny: Gemma 3's multimodal checkpoint layout (`Gemma3ForConditionalGeneration`,
    model_type gemma3, a `text_config`, the language model under `language_model.`) around
    gemma3-tiny's weights, with a one-layer SigLIP vision tower. Its text-only logits are
    gemma3-tiny's (checked here), and its reference is transformers on this folder."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig, Gemma3ForConditionalGeneration

    source = os.path.join(ROOT, "gemma3-tiny")
    out = fresh_dir("gemma3-mm-tiny")
    text = Gemma3TextConfig.from_pretrained(source)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    # The top-level `tie_word_embeddings` is the one transformers 5 ties by: it must say what the
    # text model says (gemma3-tiny's head is untied).
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=5, boi_token_index=3, eoi_token_index=4,
                          tie_word_embeddings=text.tie_word_embeddings)
    torch.manual_seed(SEED + 31)
    model = Gemma3ForConditionalGeneration(config)
    text_model = Gemma3ForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="eager")
    model.model.language_model.load_state_dict(text_model.model.state_dict(), strict=True)
    model.lm_head.load_state_dict(text_model.lm_head.state_dict())
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(source, name), out)
    reloaded = Gemma3ForConditionalGeneration.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    reloaded.eval()
    cases = json.load(open(os.path.join(source, "reference.json")))["cases"]
    ids = [c["prompt_ids"] for c in cases]
    for i, prompt in enumerate(ids):
        ours = reloaded(torch.tensor([prompt])).logits[0]
        theirs = text_model(torch.tensor([prompt])).logits[0]
        assert (ours - theirs).abs().max() < 1e-5, f"prompt {i}: the multimodal wrapper changes the text logits"
    note = "gemma3-tiny's weights in Gemma3ForConditionalGeneration's layout (a one-layer SigLIP tower), text-only prompts"
    return reference(reloaded, ids, out, note)


# Qwen3's thinking switch, as the end of its chat template writes it (the hub's template also
# handles tools and earlier turns' reasoning; this is the part `enable_thinking` drives).
QWEN3_THINKING_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)


def qwen3_thinking():
    """qwen3-tiny/thinking_chat_cases.json: Qwen3's thinking switch rendered by transformers'
    apply_chat_template with `enable_thinking` absent, true and false (template variables)."""
    out = os.path.join(ROOT, "qwen3-tiny")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    cases = []
    for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
        rendered = tok.apply_chat_template(messages, chat_template=QWEN3_THINKING_TEMPLATE, tokenize=False,
                                           add_generation_prompt=True, **kwargs)
        cases.append({"messages": messages, "kwargs": kwargs, "rendered": rendered,
                      "ids": tok(rendered, add_special_tokens=False)["input_ids"]})
    write_json(os.path.join(out, "thinking_chat_cases.json"), {
        "generator": "scripts/reference/make_model_fixtures.py --only qwen3-thinking",
        "transformers": transformers.__version__, "template": QWEN3_THINKING_TEMPLATE, "cases": cases})
    return 1.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["gpt2", "gpt2-tiny-lenient", "gpt-bigcode", "llama", "mistral", "qwen", "gemma", "gemma3-mm", "llama2", "phi3", "qwen3-thinking", "dcp"], help="rewrite one family of fixtures")
    only = parser.parse_args().only
    torch.set_grad_enabled(False)
    for name, make in [("gpt2", gpt2), ("gpt2-tiny-lenient", gpt2_lenient), ("gpt-bigcode", bigcode), ("llama", llama), ("mistral", mistral), ("qwen", qwen), ("gemma", gemma), ("gemma3-mm", gemma3_multimodal), ("llama2", llama2), ("phi3", phi3), ("qwen3-thinking", qwen3_thinking), ("dcp", dcp)]:
        if only in (None, name):
            print(f"{name}: smallest top-1/top-2 logit margin on the greedy paths {make():.4f}", file=sys.stderr)
    for name in sorted(n for n in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, n))):
        size = sum(os.path.getsize(os.path.join(ROOT, name, f)) for f in os.listdir(os.path.join(ROOT, name)))
        print(f"{name}: {size / 1024:.0f} KiB", file=sys.stderr)


if __name__ == "__main__":
    main()
