#!/usr/bin/env bash
# Device call 8 of session 7: the GPU tests on the final tree, then warps per program at N = 64 and 128 decode.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
echo "== GPU tests"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/attention tests/engine tests/models tests/test_graph_capture.py \
  > "$OUT/gpu_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -12
echo "== warps"
timeout 200 python3 bench/decode_pipeline_gpu.py --parts warps --out "$OUT/decode_warps.json" > "$OUT/decode_warps.log" 2>&1
echo "rc $?"
grep -E "now|best" "$OUT/decode_warps.log" | sort -t: -k2 -n | head -12
