#!/usr/bin/env bash
# Session 8, device call 4, as run at commit 24f36c7 (later commits removed the warp-split kernel, its test and
# --no-warp-split: docs/benchmarks/gpu.md §1e): the single-buffered decode launch's register cap, as the engine's warm-up now settles
# it per shape. GPU tests (attention, engine on CUDA with its decode graphs, graph capture), then the issue's
# kernel table (bench/attention_gpu.py, the standard --rotate-mb 256, SDPA and Flex side by side), then the decode
# A/B (engine / uncapped / capped) for both 128-dim shapes.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
echo "== GPU tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/attention tests/engine/test_engine_cuda.py tests/test_graph_capture.py \
  tests/bench/test_kernel_report_host.py tests/bench/test_paged_attn_warp_split.py > "$OUT/gpu_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -14
echo "== kernel table"
timeout 280 python3 bench/attention_gpu.py --time-limit-s 240 --out "$OUT/attention_gpu.json" > "$OUT/attention_gpu.log" 2>&1
echo "rc $?"
grep -A40 "times in" "$OUT/attention_gpu.log" | head -42
for M in qwen3-30b-a3b qwen2.5-7b; do
  echo "== decode A/B $M"
  timeout 50 python3 bench/decode_timeline_gpu.py --model $M --no-warp-split --windows 1024 --rounds 5 \
    --out "$OUT/decode_ab_$M.json" > "$OUT/decode_ab_$M.log" 2>&1
  echo "rc $?"
  grep -B1 -A5 "µs per call" "$OUT/decode_ab_$M.log"
done
