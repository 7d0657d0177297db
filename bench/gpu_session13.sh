#!/usr/bin/env bash
# Device calls 4 and 5 of session 7, after the launch rule changed with the prefetched block ids: split-KV aims
# at 1 program per SM (was 2) and decode launches of more than 2 programs per SM run single-buffered
# (num_stages 2; bench/decode_pipeline_gpu.py --parts rule measured both).
#   bash bench/gpu_session13.sh kernel   GPU tests, then the full kernel table against SDPA-flash and FlexAttention
#   bash bench/gpu_session13.sh engine   the engine tick (roofline table) and the served path at W = 1024
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
case "${1:-kernel}" in
kernel)
  echo "== GPU tests"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/attention/test_triton_paged.py tests/engine/test_engine_cuda.py \
    tests/engine/test_engine_triton.py tests/models/test_rope_triton.py tests/test_graph_capture.py > "$OUT/gpu_tests.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -12
  echo "== kernel table"
  timeout 330 python3 bench/attention_gpu.py --out "$OUT/attention_gpu.json" --flex-budget-s 100 --time-limit-s 300 \
    > "$OUT/attention_gpu.log" 2>&1
  echo "rc $?"
  sed -n '/^times in/,$p' "$OUT/attention_gpu.log"
  ;;
engine)
  # First: the same decode launches timed by the two harnesses in fresh processes (call 4's attention_gpu table
  # read 158.5 µs at N = 256 where call 3's rule grid read 138.4 for the same launch).
  echo "== harness check"
  timeout 60 python3 bench/attention_gpu.py --models qwen2.5-7b --modes decode --sessions 64,256,512 --no-flex \
    --out "$OUT/attention_decode_only.json" 2>&1 | grep -E "^qwen" | head -3
  timeout 90 python3 bench/decode_pipeline_gpu.py --parts rule --out "$OUT/decode_rule.json" > "$OUT/decode_rule.log" 2>&1
  grep -E "best" "$OUT/decode_rule.log"
  echo "== engine tick"
  timeout 280 python3 bench/engine_gpu.py --out "$OUT/engine_gpu.json" --ticks 2 --hf-sessions "" \
    --sessions 64,128,256,320,384,512 > "$OUT/engine_gpu.log" 2>&1
  echo "rc $?"
  tail -12 "$OUT/engine_gpu.log"
  echo "== served path, W = 1024"
  timeout 150 python3 bench/engine_stops_gpu.py --sessions 320 --window 1024 --ticks 6 \
    --out "$OUT/engine_stops_w1024.json" 2>&1 | grep -v -i warn | cut -c1-300 | tail -12
  ;;
esac
