#!/usr/bin/env bash
# kiln's short GPU check (about two minutes of an H200), from the folder `cargo xtask
# gpu-check` packs: the selftest, golden logits and greedy tokens on cuda, bf16 against f32,
# then `kiln bench` and transformers eager on one matrix (prompts 128/512 × batches 1/16/64)
# with kiln's ratio per cell. check.sh is the full check; this one fits a retry in the same
# lent quarter of an hour.
#
#   bash quick.sh            # results in $OUT (default ./out): log.txt, summary.txt, kiln.json, hf_eager.json
set -u
PACK="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$PACK/out}"
mkdir -p "$OUT"
BIN=/tmp/kiln-quick-bin
mkdir -p "$BIN"
for f in kiln models-tests; do
    xz -dc "$PACK/$f.xz" >"$BIN/$f" && chmod +x "$BIN/$f"
done
export KILN_HOME=/tmp/kiln-quick-home
rm -rf "$KILN_HOME"
export KILN_FIXTURES="$PACK/fixtures"
LOG="$OUT/log.txt"
: >"$LOG"
say() { echo "== $* (${SECONDS}s)" | tee -a "$LOG"; }

say selftest
timeout 40 "$BIN/kiln" selftest --backend cuda 2>&1 | tee -a "$LOG" | tail -12
export KILN_REQUIRE_CUDA=1
say golden
timeout 90 "$BIN/models-tests" golden::cuda:: --test-threads 1 2>&1 | tail -5 | tee -a "$LOG"
say precision
timeout 60 "$BIN/models-tests" precision::bf16_on_cuda --test-threads 1 --nocapture 2>&1 \
    | grep -E "KL|test result|panicked" | tee -a "$LOG"
unset KILN_REQUIRE_CUDA
MATRIX=(--prompt-lens 128,512 --batch-sizes 1,16,64 --new-tokens 64 --repeats 1)
say kiln bench
timeout 90 "$BIN/kiln" bench --backend cuda --shape llama-3.2-1b --dtype bf16 --verbose \
    "${MATRIX[@]}" --json "$OUT/kiln.json" 2>&1 | tee -a "$LOG" | tail -16
say transformers eager
timeout 100 python3 "$PACK/transformers_bench.py" --shape llama-3.2-1b --dtype bf16 \
    --device cuda "${MATRIX[@]}" >"$OUT/hf_eager.json" 2>>"$LOG"
python3 - "$OUT/kiln.json" "$OUT/hf_eager.json" <<'PY' | tee -a "$LOG" "$OUT/summary.txt"
import json, sys
kiln = json.load(open(sys.argv[1]))
eager = {(c["prompt_len"], c["batch"]): c for c in json.load(open(sys.argv[2]))["cells"]}
print("kernel fallbacks:", kiln.get("kernel_fallbacks"))
for c in kiln["cells"]:
    e = eager.get((c["prompt_len"], c["batch"]), {})
    kd, ed = c["decode_tokens_per_s"], e.get("decode_tokens_per_s") or 0
    kp, ep = c["prefill_tokens_per_s"], e.get("prefill_tokens_per_s") or 0
    ratio = kd / ed if ed else 0
    print(f"p{c['prompt_len']} b{c['batch']}: decode kiln {kd:.1f} eager {ed:.1f} ({ratio:.2f}x), "
          f"ITL p50 {c['itl_p50_ms']:.2f} ms; prefill kiln {kp:.0f} eager {ep:.0f}")
PY
say done
