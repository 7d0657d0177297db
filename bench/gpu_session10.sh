#!/usr/bin/env bash
# Device call planned for session 6: are the served path's one-off slow ticks garbage collections?
#   1. GPU tests (the no-compile test passed in session 5 after the re-rotation kernel stopped specialising
#      on its row stride).
#   2. bench/engine_stops_gpu.py at N = 320, W = 1024, 24 ticks per case, first with the collector as Python
#      sets it, then with the start-up heap frozen (what the worker and gateway now do). Session 5 saw 1 tick
#      in 8 take 150-250 ms more in either position mode; each tick now records its collections.
# Then, if time is left, the experiments still planned (one call each):
#   LIMIT_S=560 bash bench/gpu_experiments.sh admission gpu-short --arms robust-sink_window --offered 1024 --duration-s 180
#       (session 5's run saw 5 such ticks in 89; the worker now freezes its heap; ticks now carry worker_ms, so
#       latency - worker_ms splits transport and gateway from the worker)
#   LIMIT_S=560 bash bench/gpu_experiments.sh admission gpu-short --arms robust-unbounded
#   LIMIT_S=560 bash bench/gpu_experiments.sh admission gpu-short --profiles churn --offered 1200 --duration-s 150
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl 2>/dev/null || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
echo "== GPU tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine_cuda.py tests/attention/test_triton_paged.py \
  tests/models/test_rope_triton.py 2>&1 | grep -v -i warn | tail -8 | tee "$OUT/gpu_tests.log"
for heap in default frozen; do
  echo "== served path, heap $heap"
  timeout 200 python3 bench/engine_stops_gpu.py --sessions 320 --window 1024 --ticks 24 --heap $heap \
    --out "$OUT/engine_stops_heap_$heap.json" 2>&1 | grep -v -i warn | cut -c1-300
done
