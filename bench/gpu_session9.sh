#!/usr/bin/env bash
# Device call planned for session 5: verify session 4's CUDA-path changes, then the served capacity.
#   1. GPU tests: among them, no attention kernel compiles after start-up (Triton warm-up, num_splits no
#      longer specialised), and everything session 3 added (pipelined stops, unbounded graphs == eager).
#   2. bench/engine_stops_gpu.py at N = 320, W = 1024: the first tick (2,088 ms in session 4) and the
#      one-off 0.7-1 s ticks should be gone if they were kernel compiles.
# Then the experiments, one call each: bash bench/gpu_experiments.sh admission gpu-short --arrival-rate 4 ...
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
echo "== GPU tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine_cuda.py tests/attention/test_triton_paged.py \
  2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
echo "== served path"
timeout 240 python3 bench/engine_stops_gpu.py --sessions 320 --window 1024 --ticks 8 \
  --out "$OUT/engine_stops_w1024.json" 2>&1 | grep -v -i warn | cut -c1-400
