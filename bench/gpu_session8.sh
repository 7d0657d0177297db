#!/usr/bin/env bash
# Device call planned for session 4: verify this session's CUDA-path changes, then the served capacity.
#   1. GPU tests: decode graphs == eager (bounded and unbounded: the staged block tables are cut to the
#      live blocks now), stop tokens, one-row embeds; the Triton kernel tests.
#   2. bench/engine_stops_gpu.py at N = 128 and 320, W = 1024: the served path (stop tokens, rebased
#      windows) against the benchmark's, i.e. the capacity a gateway would find.
# Then the experiments, one call each: bash bench/gpu_experiments.sh admission gpu-short ...
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
echo "== GPU tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine_cuda.py tests/attention/test_triton_paged.py \
  2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
echo "== served path"
timeout 240 python3 bench/engine_stops_gpu.py --sessions 128,320 --window 1024 --ticks 6 \
  --out "$OUT/engine_stops_w1024.json" 2>&1 | grep -v -i warn | cut -c1-400
