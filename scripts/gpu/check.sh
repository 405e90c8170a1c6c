#!/usr/bin/env bash
# kiln's GPU check, run on a machine with an NVIDIA GPU from the folder `cargo xtask gpu-check`
# packs (target/gpu-check): no Rust toolchain needed there, only the driver, NVRTC (a CUDA
# toolkit, or PyTorch's pip wheels: kiln finds those itself) and, for the baselines, python3
# with torch and transformers.
#
#   bash check.sh            # everything, within KILN_GPU_BUDGET seconds (default 540)
#
# Steps, most important first, each under its own time limit (a step that would start with
# too little budget left is skipped and says so):
#   1. the device, `kiln backends`
#   2. time to a first token: a tiny model, twice with a fresh kernel cache (first process
#      compiles, second reuses)
#   3. `kiln selftest --backend cuda`
#   4. golden logits and greedy tokens on cuda (f32 within 1e-4 of transformers), bf16's KL
#      divergence and top-1 agreement against f32, a GGUF's Q8_0 blocks multiplied on the device
#   5. `kiln bench --backend cuda --shape llama-3.2-1b --dtype bf16 --verbose`
#   6. transformers eager on the same matrix, then its torch.compile'd static-cache decode
#   7. kiln with Q4_K blocks on the device; `kiln bench`'s default cells
#   8. kiln's batch-1 decode again (drift check) and a per-kernel time profile
# Output: $OUT (default ./out): log.txt (everything), summary.json, kiln_bench.json,
# hf_eager.json, hf_compiled.json, kiln_q4k.json, profile.txt.
set -u
PACK="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$PACK/out}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
BUDGET="${KILN_GPU_BUDGET:-540}"
START=$SECONDS
BIN="$PACK/bin"
mkdir -p "$BIN"
: >"$LOG"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

say() { echo "$*" | tee -a "$LOG"; }
note() { echo "$*" | tee -a "$LOG" >>"$SUMMARY"; }

# step NAME LIMIT CMD...: runs CMD under `timeout LIMIT` (shortened to the budget left),
# appending its output to the log; skipped when less than a quarter of LIMIT is left.
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -lt $((limit / 4)) ] || [ "$left" -lt 10 ]; then
        note "SKIP $name (budget: ${left}s left)"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say ""
    say "== $name (at $((SECONDS - START))s, limit ${limit}s)"
    local t0=$SECONDS
    timeout --kill-after=5 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    note "$( [ $rc -eq 0 ] && echo PASS || echo "FAIL (exit $rc)") $name ($((SECONDS - t0))s)"
    return 0
}

for f in "$PACK"/*.xz; do
    xz -dc "$f" >"$BIN/$(basename "$f" .xz)" && chmod +x "$BIN/$(basename "$f" .xz)"
done
export KILN_FIXTURES="$PACK/fixtures"
# The kernel cache starts empty, outside $OUT (only a few files come back from a lent GPU).
export KILN_HOME=/tmp/kiln-gpu-check-home
rm -rf "$KILN_HOME"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
PY=python3

step "device" 30 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; $BIN/kiln backends"

# 2. Startup: a fresh kernel cache, then the same one again.
tiny() {
    local t0 t1
    t0=$(date +%s%N)
    "$BIN/kiln" generate --backend cuda --model "$PACK/fixtures/llama-tiny" --dtype f32 \
        --temperature 0 -n 8 "Hello world" || return 1
    t1=$(date +%s%N)
    echo "wall: $(((t1 - t0) / 1000000)) ms"
}
export -f tiny
export BIN PACK
step "tiny model, first process (fresh kernel cache)" 120 bash -c tiny
step "tiny model, second process" 60 bash -c tiny
grep "^wall:" "$LOG" | tee -a "$SUMMARY"

step "kiln selftest --backend cuda" 90 "$BIN/kiln" selftest --backend cuda

export KILN_REQUIRE_CUDA=1
step "golden logits and greedy tokens on cuda (f32)" 150 "$BIN/models-tests" golden::cuda:: --test-threads 1 --nocapture
step "bf16 on cuda against f32 (KL, top-1)" 90 "$BIN/models-tests" precision::bf16_on_cuda --test-threads 1 --nocapture
step "GGUF Q8_0 blocks on the device against transformers" 60 "$BIN/models-tests" gguf::tiny_llama_quantized_on_cuda --test-threads 1 --nocapture
unset KILN_REQUIRE_CUDA

MATRIX=(--prompt-lens 128,512 --batch-sizes 1,16,64 --new-tokens 64 --repeats 1)
step "kiln bench, llama-3.2-1b bf16" 150 "$BIN/kiln" bench --backend cuda --shape llama-3.2-1b \
    --dtype bf16 --verbose "${MATRIX[@]}" --json "$OUT/kiln_bench.json"
step "transformers eager, llama-3.2-1b bf16" 120 bash -c \
    "$PY $PACK/transformers_bench.py --shape llama-3.2-1b --dtype bf16 --device cuda ${MATRIX[*]} >$OUT/hf_eager.json"
step "transformers torch.compile, llama-3.2-1b bf16" 180 bash -c \
    "$PY $PACK/transformers_bench.py --shape llama-3.2-1b --dtype bf16 --device cuda --compile --prompt-lens 128 --batch-sizes 1,64 --new-tokens 64 --repeats 1 >$OUT/hf_compiled.json"
step "kiln bench, llama-3.2-1b Q4_K blocks on the device, bf16 activations" 90 "$BIN/kiln" bench \
    --backend cuda --shape llama-3.2-1b --weights q4_k --dtype bf16 --verbose \
    --prompt-lens 128,512 --batch-sizes 1,64 --new-tokens 64 --repeats 1 --json "$OUT/kiln_q4k.json"
step "kiln bench, default cells (llama-3.2-1b bf16)" 150 "$BIN/kiln" bench --backend cuda \
    --shape llama-3.2-1b --dtype bf16
step "kiln bench again (batch 1, drift)" 60 "$BIN/kiln" bench --backend cuda \
    --shape llama-3.2-1b --dtype bf16 --prompt-lens 128 --batch-sizes 1 --new-tokens 64 --repeats 1

# 7. Per-kernel times of a batch-1 decode: cubecl times every launch (blocking) and prints a
# table per sync, into profile.txt.
PROFILE=/tmp/kiln-gpu-check-profile
rm -rf "$PROFILE" && mkdir -p "$PROFILE"
printf '[profiling.logger]\nlevel = "basic"\nfile = "%s"\n' "$PROFILE/launches.txt" >"$PROFILE/cubecl.toml"
step "per-kernel profile (batch 1 decode)" 60 bash -c "cd $PROFILE && $BIN/kiln bench \
    --backend cuda --shape llama-3.2-1b --dtype bf16 --prompt-lens 128 --batch-sizes 1 \
    --new-tokens 16 --repeats 1"
# Each line is `| <duration> | <kernel>`: summed per kernel, largest first.
$PY "$PACK/profile_summary.py" "$PROFILE/launches.txt" >"$OUT/profile.txt" 2>&1

say ""
say "== done in $((SECONDS - START))s"
cat "$SUMMARY"
