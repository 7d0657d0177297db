#!/usr/bin/env bash
# Device call of session 6, after two changes:
#   1. CUDA graph capture holds Python's collector off (metronome/graph_capture.py). One GPU test run of
#      session 6 failed 15 tests: a collection during a capture freed an earlier engine's graphs, which
#      invalidated the capture and left the CUDA generator in capture mode. The GPU tests again, with the new
#      test that makes the collector run at almost every allocation during engine start-up.
#   2. The gateway streams each tick's input to the worker as it arrives (StreamStep). The admission ramp at
#      1,024 offered for 300 s (slow start reaches ~237 in ~56 s, then +1 a tick), to see where the served
#      capacity lands now (session 6's earlier run, unary Steps: 269 live at p50 601 ms).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl 2>/dev/null || exit 1
OUT=${OUT:-results}
mkdir -p "$OUT"
echo "== GPU tests"
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider -W ignore tests/engine/test_engine_cuda.py \
  tests/attention/test_triton_paged.py tests/models/test_rope_triton.py tests/test_graph_capture.py > "$OUT/gpu_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -20
echo "== admission ramp, streamed ticks"
LIMIT_S=${LIMIT_S:-400} bash bench/gpu_experiments.sh admission gpu-short --arms robust-sink_window --offered 1024 \
  --duration-s 300 2>&1 | grep -v "^ramp robust" | tail -30
