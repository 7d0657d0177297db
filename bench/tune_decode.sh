#!/usr/bin/env bash
# Decode-kernel tuning sweep on the H200 (2026-11-30): Qwen2.5-7B shape, decode, N in {16, 64, 256}.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
run() {  # name, extra flags
  echo "== $1"
  timeout 100 python3 bench/attention_gpu.py --models qwen2.5-7b --modes decode --sessions 16,64,256 --no-flex \
      --no-sdpa --out "$OUT/tune_$1.json" "${@:2}" 2>&1 | grep -E "^qwen2.5-7b +decode" | tail -3
}
run default
run bn32 --block-n 32
run bn128 --block-n 128
run w8 --num-warps 8
run w2 --num-warps 2
run s2 --num-stages 2
run s4 --num-stages 4
run tp8 --target-programs 1056
run tp2 --target-programs 264
