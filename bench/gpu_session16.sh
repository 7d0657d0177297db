#!/usr/bin/env bash
# Session 8, device call 2: how much of a decode call's time in bench/attention_gpu.py is the CUDA-graph replay's
# own overhead, spread over the few launches one replay holds at N = 64 (2 session sets at --rotate-mb 256)?
# The same decode shapes with 256 MB and 4096 MB of rotated K/V (2 and 30 launches per replay at N = 64).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
for MB in 256 4096; do
  echo "== --rotate-mb $MB"
  timeout 200 python3 bench/attention_gpu.py --models qwen2.5-7b,qwen3-30b-a3b --modes decode --sessions 16,64,128,256,512 \
    --no-flex --rotate-mb $MB --max-sets 64 --out "$OUT/attention_rotate${MB}.json" > "$OUT/attention_rotate${MB}.log" 2>&1
  echo "rc $?"
  grep -A20 "times in" "$OUT/attention_rotate${MB}.log" | head -16
done
