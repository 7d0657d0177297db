#!/usr/bin/env bash
# Device call planned for session 5: verify session 4's CUDA-path changes, then the served capacity.
#   1. GPU tests: among them, no attention kernel compiles after start-up (Triton warm-up, num_splits no
#      longer specialised), and everything session 3 added (pipelined stops, unbounded graphs == eager).
#   2. bench/engine_stops_gpu.py at N = 288, 320, 352, W = 1024: the served path's capacity at 0.3·B, the
#      rebase ticks with the in-place re-rotation kernel (+130 ms at N = 320 in session 4), and the first
#      tick (2,088 ms in session 4) and one-off 0.7-1 s ticks, gone if they were kernel compiles.
# Then the experiments, one call each (each ~4-8 min):
#   LIMIT_S=560 bash bench/gpu_experiments.sh admission gpu-short --arms robust-sink_window --offered 1024 --duration-s 180
#       (arrivals for 128 s, so the cap meets latency before the offer runs out; session 4's ran out at 211)
#   LIMIT_S=560 bash bench/gpu_experiments.sh ablation gpu-short
#   LIMIT_S=560 bash bench/gpu_experiments.sh admission gpu-short --arms robust-unbounded
#   LIMIT_S=560 bash bench/gpu_experiments.sh admission gpu-short --profiles churn --offered 1200 --duration-s 150
#       (sessions leave after ~60 s; both SinkWindow arms, ~6 min)
#   LIMIT_S=580 bash bench/gpu_experiments.sh cliff gpu-short --runs 2 --duration-s 100
#       (session 4's 60-s runs ended 26 s after Unbounded's pool filled, too soon for the wall rule to judge)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
echo "== GPU tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine_cuda.py tests/attention/test_triton_paged.py \
  tests/models/test_rope_triton.py \
  2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
echo "== served path"
timeout 300 python3 bench/engine_stops_gpu.py --sessions 288,320,352 --window 1024 --ticks 8 \
  --out "$OUT/engine_stops_w1024.json" 2>&1 | grep -v -i warn | cut -c1-400
