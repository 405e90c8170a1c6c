#!/usr/bin/env python3
"""GGUF forms of the family fixtures, written by llama.cpp's own converter.

Converts crates/models/tests/fixtures/<name>/ (an HF folder made by make_model_fixtures.py) with the
convert_hf_to_gguf.py of the llama.cpp vendored in llama-cpp-python's sdist (the one `cargo xtask llama-cpp`
builds), and quantizes with that build's llama-quantize:

  gguf/<name>.f32.gguf            every tensor F32: kiln's logits and greedy tokens must equal transformers'
  gguf/<name>.q8_0.gguf           llama-quantize Q8_0 of the F32 file: kiln states its KL divergence against
                                  the F32 file
  gguf/<name>.f16.gguf,           llama-quantize F16 / BF16 of the F32 file (SIXTEEN_BIT: qwen2-tiny F16,
  gguf/<name>.bf16.gguf           phi3-tiny BF16): kept in 16 bits they must give the same file's exact path
  gguf/<name>.reference.json,     transformers on the model the GGUF holds: the HF fixture's prompts, greedy
  gguf/<name>.logits.safetensors  continuations and full logits. llama.cpp's converter drops Qwen2's sliding
                                  window (as it does Mistral's), so the model is the HF folder with
                                  `use_sliding_window` false; for a fixture without a window it is the same.

for qwen2-tiny and qwen3-tiny, and for llama2-tiny (a SentencePiece vocabulary: `tokenizer.ggml.model`
`llama`) the F32 file and its reference, whose `tokenizer_cases` are llama.cpp's tokenization of the HF
fixture's texts (below); phi3-tiny as llama2-tiny, with a Q8_0 file; qwen2-yarn-tiny: qwen2-tiny with YaRN
rope parameters (VARIANTS), converted and referenced as changed. gemma2-tiny and gemma3-tiny carry a
byte-level stand-in for Gemma's vocabulary, which the converter cannot read: each is converted from a copy
with a SentencePiece tokenizer.model trained here with Gemma's settings (gemma_vocabulary), and its
reference is the folder as llama.cpp reads the file (scores by head_dim^-0.5: the file has no
query_pre_attn_scalar; Gemma's default window patterns). The fixtures' tokenizers are trained here, so the converter's hash of their
pre-tokenizer output matches no released model; `get_vocab_base_pre` is told the name their split regex
is (`qwen2`), which is what the converter writes for every Qwen2/Qwen3 model. Nothing else is changed.

    python3 scripts/reference/make_family_ggufs.py [--llama-cpp DIR] [--quantize PATH] [--only NAME]

llama.cpp tokenizes a SentencePiece vocabulary as SentencePiece's BPE does, with two differences from
`SentencePieceProcessor.encode`: control, user-defined and unknown pieces written in the text are matched
as tokens, and a space goes before every run of text that starts the prompt or follows such a token
(llama-vocab.cpp, `is_prev_special`). The cases are computed that way, with the fixture's tokenizer.model
and its dummy prefix switched off; when `llama-tokenize` is built beside llama-quantize, each case is also
run through it and must agree.

DIR defaults to target/llama.cpp/sdist/llama_cpp_python-*/vendor/llama.cpp (extracted from the sdist
if needed), PATH to target/llama.cpp/build/bin/llama-quantize.
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

import torch
from transformers import AutoModelForCausalLM

from make_model_fixtures import CORPUS, PROMPTS, ROOT as TEXT_ROOT, SPM_TRICKY, reference

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURES = os.path.join(ROOT, "crates", "models", "tests", "fixtures")
# name: (the pre-tokenizer name the converter is told, or None for SentencePiece; quantize to Q8_0)
FAMILIES = {"qwen2-tiny": ("qwen2", True), "qwen3-tiny": ("qwen2", True), "llama2-tiny": (None, False),
            "phi3-tiny": (None, True), "gemma2-tiny": (None, True), "gemma3-tiny": (None, True),
            "gpt2-tiny": ("gpt-2", True), "gpt-bigcode-tiny": ("gpt-2", True),
            "qwen2-yarn-tiny": ("qwen2", False)}
# 16-bit files: (family, llama-quantize's type name).
SIXTEEN_BIT = {"qwen2-tiny": "F16", "phi3-tiny": "BF16"}
# GGUF-only variants: (the HF fixture they start from, what changes in its config.json). YaRN with
# an original context of 32 stretched 4x to the fixture's 128 positions: the converter writes
# llama.cpp's `rope.scaling.*` keys, and the reference is transformers on the changed folder.
VARIANTS = {"qwen2-yarn-tiny": ("qwen2-tiny", {"rope_parameters": {
    "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32}})}


def fixture_folder(name, out):
    """The HF folder `name` converts from: the fixture itself, or for a variant a copy of its base
    under `out` with the config changes."""
    if name not in VARIANTS:
        return os.path.join(FIXTURES, name)
    base, changes = VARIANTS[name]
    shutil.copytree(os.path.join(FIXTURES, base), out)
    config = json.load(open(os.path.join(out, "config.json")))
    config.update(changes)
    json.dump(config, open(os.path.join(out, "config.json"), "w"))
    return out
# Byte-level texts for the fixtures whose reference.json has no tokenizer_cases: the GGUF's
# vocabulary must split them as the folder's tokenizer does.
BYTE_LEVEL_TEXTS = PROMPTS + ["a  1", "  leading", "naïve café 🙂", "x\n\n\ny", "1234567", "end  ", "\ttab", "I'm we'll"]
# The Gemma fixtures carry a byte-level BPE stand-in; their GGUFs get a SentencePiece vocabulary
# trained here with Gemma's settings, as many pieces as the model's vocabulary (gemma_vocabulary).
GEMMA = {"gemma2-tiny", "gemma3-tiny"}
GEMMA_TEXTS = PROMPTS + SPM_TRICKY + ["<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
                                      "  two leading spaces", "<bos>x<eos> y"]


def gemma_vocabulary(source, out):
    """`source` (a Gemma fixture folder) in `out` with a SentencePiece tokenizer.model in place of its
    tokenizer.json: Gemma's settings (no dummy prefix, identity normalization, spaces kept, digits
    split, byte fallback), its ids (<pad> 0, <eos> 1, <bos> 2, <unk> 3), <start_of_turn> and
    <end_of_turn> user-defined, and exactly `vocab_size` pieces."""
    import io
    import sentencepiece

    shutil.copytree(source, out)
    os.remove(os.path.join(out, "tokenizer.json"))
    vocab_size = json.load(open(os.path.join(out, "config.json")))["vocab_size"]
    text = open(os.path.join(TEXT_ROOT, "text", "around-the-world-ch1-2.txt")).read()
    lines = [line for line in text.splitlines() if line.strip()] + CORPUS
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=False,
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], num_threads=1,
        minloglevel=2,
    )
    with open(os.path.join(out, "tokenizer.model"), "wb") as f:
        f.write(model.getvalue())
    config = json.load(open(os.path.join(out, "tokenizer_config.json")))
    config["tokenizer_class"] = "GemmaTokenizer"
    # As Gemma's tokenizer_config.json lists them: the converter types the pieces from it.
    config["added_tokens_decoder"] = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"])
    }
    json.dump(config, open(os.path.join(out, "tokenizer_config.json"), "w"))
    # The converter takes a single EOS id from config.json.
    model_config = json.load(open(os.path.join(out, "config.json")))
    model_config["eos_token_id"] = 1
    json.dump(model_config, open(os.path.join(out, "config.json"), "w"))
    return out


def llama_tokenize(binary, gguf_path, text):
    """`llama-tokenize`'s ids for `text` (special tokens parsed, BOS as the file says)."""
    out = subprocess.run([binary, "-m", gguf_path, "-p", text, "--ids", "--log-disable"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def llama_cpp_tokenization(model_dir, texts, tokenize_binary, gguf_path):
    """Each text's ids as llama.cpp's SPM tokenizer gives them (with BOS unless the GGUF says not), from tokenizer.model with
    the piece types the GGUF gives them (the converter types pieces from tokenizer_config.json)."""
    import gguf
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(open(os.path.join(model_dir, "tokenizer.model"), "rb").read())
    proto.normalizer_spec.add_dummy_prefix = False
    fields = gguf.GGUFReader(gguf_path).fields
    gguf_types = [int(fields["tokenizer.ggml.token_type"].parts[i][0]) for i in fields["tokenizer.ggml.token_type"].data]
    gguf_tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in fields["tokenizer.ggml.tokens"].data]
    add_bos = "tokenizer.ggml.add_bos_token" not in fields or bool(fields["tokenizer.ggml.add_bos_token"].parts[-1][0])
    space = " " if "tokenizer.ggml.add_space_prefix" not in fields or bool(fields["tokenizer.ggml.add_space_prefix"].parts[-1][0]) else ""
    # gguf.TokenType and SentencePiece's proto number the kinds alike (1 normal ... 6 byte);
    # SentencePiece needs its one unknown piece, which both kinds match whole in text anyway.
    for piece, kind in zip(proto.pieces, gguf_types):
        if piece.type != proto.SentencePiece.UNKNOWN:
            piece.type = kind
    processor = sentencepiece.SentencePieceProcessor(model_proto=proto.SerializeToString())
    kinds = (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED, gguf.TokenType.UNKNOWN)
    # The GGUF's vocabulary may go on past the model's pieces (Phi-3's chat tokens, padding).
    matched = {piece: i for i, (piece, kind) in enumerate(zip(gguf_tokens, gguf_types)) if kind in kinds}
    # llama-vocab.cpp: a Phi-3 (by name) drops the whitespace after its special tokens but these.
    name = bytes(fields["general.name"].parts[-1]).decode().lower() if "general.name" in fields else ""
    phi3 = "phi-3" in name or "phi3" in name
    rstrip = {i for t, i in matched.items() if phi3 and t not in ("<unk>", "<s>", "<|endoftext|>")}
    cases = []
    for text in texts:
        fragments = [text]
        for piece in sorted(matched, key=len, reverse=True):
            split = []
            for fragment in fragments:
                if isinstance(fragment, int):
                    split.append(fragment)
                    continue
                for n, part in enumerate(fragment.split(piece)):
                    if n:
                        split.append(matched[piece])
                    if part:
                        split.append(part)
            fragments = split
        stripped = []
        for fragment in fragments:
            if isinstance(fragment, str) and stripped and stripped[-1] in rstrip:
                fragment = fragment.lstrip(" \t\n\v\f\r")  # C's isspace
            if fragment != "":
                stripped.append(fragment)
        ids = [proto.trainer_spec.bos_id] if add_bos else []
        for fragment in stripped:
            ids += [fragment] if isinstance(fragment, int) else processor.encode(space + fragment)
        if tokenize_binary and text:  # llama-tokenize refuses an empty prompt
            assert llama_tokenize(tokenize_binary, gguf_path, text) == ids, (text, ids)
        cases.append({"text": text, "ids": ids})
    return cases


def vendored_llama_cpp():
    sdist = os.path.join(ROOT, "target", "llama.cpp", "sdist")
    found = glob.glob(os.path.join(sdist, "llama_cpp_python-*", "vendor", "llama.cpp"))
    if found:
        return found[0]
    tarballs = glob.glob(os.path.join(sdist, "llama_cpp_python-*.tar.gz"))
    if not tarballs:
        sys.exit("no llama-cpp-python sdist under target/llama.cpp/sdist: run `cargo xtask llama-cpp` first")
    with tarfile.open(tarballs[0]) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name and (
            m.name.endswith("convert_hf_to_gguf.py") or "/conversion/" in m.name or "/gguf-py/" in m.name)]
        tar.extractall(sdist, members=members, filter="data")
    return glob.glob(os.path.join(sdist, "llama_cpp_python-*", "vendor", "llama.cpp"))[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", default=None)
    parser.add_argument("--quantize", default=os.path.join(ROOT, "target", "llama.cpp", "build", "bin", "llama-quantize"))
    parser.add_argument("--only", choices=sorted(FAMILIES))
    args = parser.parse_args()
    llama_cpp = args.llama_cpp or vendored_llama_cpp()
    sys.path.insert(0, llama_cpp)
    sys.path.insert(1, os.path.join(llama_cpp, "gguf-py"))
    import convert_hf_to_gguf
    from conversion import base

    out_dir = os.path.join(FIXTURES, "gguf")
    for name, (pre, quantize) in FAMILIES.items():
        if args.only not in (None, name):
            continue
        if pre is not None:
            base.TextModel.get_vocab_base_pre = lambda self, tokenizer, pre=pre: pre
        f32 = os.path.join(out_dir, f"{name}.f32.gguf")
        vocabulary_dir = tempfile.TemporaryDirectory()
        source = fixture_folder(name, os.path.join(vocabulary_dir.name, "variant"))
        hf_folder = source
        if name in GEMMA:
            source = gemma_vocabulary(source, os.path.join(vocabulary_dir.name, name))
        if name == "gpt2-tiny":
            # The converter reads GPT-2's context as `n_ctx`, which transformers 5 no longer saves.
            source = shutil.copytree(source, os.path.join(vocabulary_dir.name, name))
            config = json.load(open(os.path.join(source, "config.json")))
            config["n_ctx"] = config["n_positions"]
            json.dump(config, open(os.path.join(source, "config.json"), "w"))
        sys.argv = ["convert_hf_to_gguf.py", source, "--outfile", f32, "--outtype", "f32"]
        convert_hf_to_gguf.main()
        written = [f32]
        if quantize:
            q8 = os.path.join(out_dir, f"{name}.q8_0.gguf")
            subprocess.run([args.quantize, f32, q8, "Q8_0"], check=True, capture_output=True)
            written.append(q8)
        if name in SIXTEEN_BIT:
            ty = SIXTEEN_BIT[name]
            half = os.path.join(out_dir, f"{name}.{ty.lower()}.gguf")
            subprocess.run([args.quantize, f32, half, ty], check=True, capture_output=True)
            written.append(half)
        extra = None
        hf_reference = json.load(open(os.path.join(hf_folder, "reference.json")))
        tokenize = os.path.join(os.path.dirname(args.quantize), "llama-tokenize")
        tokenize = tokenize if os.path.exists(tokenize) else None
        if pre is not None:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(hf_folder)
            cases = hf_reference.get("tokenizer_cases") or [
                {"text": t, "ids": tokenizer(t)["input_ids"]} for t in BYTE_LEVEL_TEXTS]
            checked = ""
            if tokenize:
                # llama.cpp applies no NFC; the HF file may (Qwen2's): decomposed text differs.
                for case in cases:
                    if case["text"] and "\u0301" not in case["text"]:
                        assert llama_tokenize(tokenize, f32, case["text"]) == case["ids"], case
                checked = ", equal to llama-tokenize's ids on the GGUF (but for decomposed text, which llama.cpp does not NFC)"
            extra = {"tokenizer_cases": cases, "tokenizer_note": "the HF folder's tokenizer (transformers)" + checked}
        if pre is None:
            texts = GEMMA_TEXTS if name in GEMMA else [
                c["text"] for c in json.load(open(os.path.join(hf_folder, "reference.json")))["tokenizer_cases"]]
            extra = {"tokenizer_cases": llama_cpp_tokenization(source, texts, tokenize, f32),
                     "tokenizer_note": "llama.cpp's SPM tokenization" + (", checked with llama-tokenize" if tokenize else
                                       " (sentencepiece without its dummy prefix, a space before each run of text)")}
        with tempfile.TemporaryDirectory() as tmp:
            windowless = os.path.join(tmp, "model")
            shutil.copytree(hf_folder, windowless)
            config_path = os.path.join(windowless, "config.json")
            config = json.load(open(config_path))
            # Phi-3 has no `use_sliding_window`: its window stays, in the GGUF and here.
            window = "its sliding window" if config.get("sliding_window") and "use_sliding_window" not in config else "no sliding window"
            config["use_sliding_window"] = False
            # Gemma: llama.cpp reads the window pattern as Gemma's defaults (every other layer; five
            # of six), which is what transformers makes without `layer_types`, and scales scores by
            # 1/sqrt(head_dim) (but for Gemma 2 27B's 46 layers): `query_pre_attn_scalar` is not in
            # the file.
            config.pop("layer_types", None)
            if name in GEMMA:
                config["query_pre_attn_scalar"] = config["head_dim"]
            # llama.cpp's GPT-2 and StarCoder scale scores by head_dim^-0.5: the file has no
            # `scale_attn_weights`.
            if "scale_attn_weights" in config:
                config["scale_attn_weights"] = True
            json.dump(config, open(config_path, "w"))
            model = AutoModelForCausalLM.from_pretrained(windowless, dtype=torch.float32, attn_implementation="eager")
            cases = json.load(open(os.path.join(hf_folder, "reference.json")))["cases"]
            out = os.path.join(tmp, "reference")
            os.makedirs(out)
            note = f"{name} as its GGUF holds it ({window}), by transformers"
            reference(model, [c["prompt_ids"] for c in cases], out, note, extra)
            shutil.copy(os.path.join(out, "reference.json"), os.path.join(out_dir, f"{name}.reference.json"))
            shutil.copy(os.path.join(out, "logits.safetensors"), os.path.join(out_dir, f"{name}.logits.safetensors"))
        for path in written:
            print(f"{os.path.relpath(path, ROOT)}: {os.path.getsize(path) / 1024:.0f} KiB", file=sys.stderr)


if __name__ == "__main__":
    main()
