#!/usr/bin/env bash
# Compares the skinny tensor-core tilings of batched decode (crates/cube/src/matmul.rs,
# `SKINNY_TILES`) on a machine with an NVIDIA GPU, from the folder `cargo xtask gpu-check`
# packs (it needs kiln.xz, transformers_bench.py and profile_summary.py from there):
#
#   bash tiles.sh            # every tiling, then transformers eager on the same cells
#
# transformers eager at batches 32 and 64; then for each `KILN_GPU_SKINNY_TILES=i` (0: cubek's
# own tiles; the default first) the f16 product check of `kiln selftest` (40 rows) and `kiln
# bench` on the same cells; then a per-kernel profile of one batch-64 decode with the default.
# Output: $OUT (default ./out): tiles.txt (a line per tiling and cell), log.txt, tiles_<i>.json,
# hf_eager.json, profile_b64.txt.
set -u
PACK="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$PACK/out}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
: >"$LOG"
BIN=/tmp/kiln-tiles-bin
mkdir -p "$BIN"
xz -dc "$PACK/kiln.xz" >"$BIN/kiln" && chmod +x "$BIN/kiln"
export KILN_HOME=/tmp/kiln-tiles-home
rm -rf "$KILN_HOME"
TILINGS="${TILINGS:-1 0 2 3 4 5 6 7 8}"
MATRIX=(--prompt-lens 128,512 --batch-sizes 32,64 --new-tokens 64 --repeats 1)

echo "== transformers eager" | tee -a "$LOG"
timeout 90 python3 "$PACK/transformers_bench.py" --shape llama-3.2-1b --dtype bf16 --device cuda \
    "${MATRIX[@]}" >"$OUT/hf_eager.json" 2>>"$LOG"
grep -o '"[a-z_]*": [0-9.]*' "$OUT/hf_eager.json" | tr '\n' ' ' | tee -a "$OUT/tiles.txt"
echo | tee -a "$OUT/tiles.txt"

for i in $TILINGS; do
    echo "== tiling $i" | tee -a "$LOG"
    KILN_GPU_SKINNY_TILES=$i timeout 30 "$BIN/kiln" selftest --backend cuda 2>&1 \
        | grep -E "f16|passed" | sed "s/^/tiling $i: /" | tee -a "$LOG" "$OUT/tiles.txt"
    KILN_GPU_SKINNY_TILES=$i timeout 60 "$BIN/kiln" bench --backend cuda \
        --shape llama-3.2-1b --dtype bf16 --verbose "${MATRIX[@]}" --json "$OUT/tiles_$i.json" >>"$LOG" 2>&1 \
        || echo "tiling $i: bench failed (exit $?)" | tee -a "$OUT/tiles.txt"
    python3 - "$OUT/tiles_$i.json" "$i" <<'EOF' | tee -a "$OUT/tiles.txt"
import json, sys
try:
    report = json.load(open(sys.argv[1]))
except Exception as err:
    sys.exit(f"tiling {sys.argv[2]}: no report ({err})")
print(f"tiling {sys.argv[2]}: {report.get('kernel_fallbacks')} kernel fallbacks")
for cell in report.get("cells", []):
    print(f"tiling {sys.argv[2]}: prompt {cell.get('prompt_len')} batch {cell.get('batch')}: "
          f"decode {cell.get('decode_tokens_per_s')} tok/s (ITL p50 {cell.get('itl_p50_ms')} ms), prefill {cell.get('prefill_tokens_per_s')}")
EOF
done

# Where a batch-64 decode step's device time goes with the default tiling.
PROFILE=/tmp/kiln-tiles-profile
rm -rf "$PROFILE" && mkdir -p "$PROFILE"
printf '[profiling.logger]\nlevel = "basic"\nfile = "%s"\n' "$PROFILE/launches.txt" >"$PROFILE/cubecl.toml"
(cd "$PROFILE" && timeout 60 "$BIN/kiln" bench --backend cuda --shape llama-3.2-1b --dtype bf16 \
    --prompt-lens 128 --batch-sizes 64 --new-tokens 16 --repeats 1 >>"$LOG" 2>&1)
python3 "$PACK/profile_summary.py" "$PROFILE/launches.txt" >"$OUT/profile_b64.txt" 2>&1
cat "$OUT/tiles.txt"
