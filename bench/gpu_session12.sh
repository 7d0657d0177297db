#!/usr/bin/env bash
# Device call 1 of session 7: the kernel now loads each tile's block ids one tile ahead (two K/V buffers at
# num_stages 3 under Triton 3.6, was one). GPU correctness of the kernel, then the A/B against the previous
# kernel over a configuration grid, the head-major layout, and the read floor (bench/decode_pipeline_gpu.py).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
echo "== kernel correctness on the GPU"
[ -n "${SKIP_TESTS:-}" ] || timeout 90 python3 -m pytest -q -p no:cacheprovider tests/attention/test_triton_paged.py > "$OUT/gpu_tests_attention.log" 2>&1
tail -2 "$OUT/gpu_tests_attention.log"
echo "== A/B"
timeout 480 python3 bench/decode_pipeline_gpu.py --out "$OUT/decode_pipeline.json" --time-limit-s 380 ${PARTS:+--parts $PARTS} \
  > "$OUT/decode_pipeline.log" 2>&1
echo "rc $?"
sed -n '/^copy bandwidth .* µs per call/,$p' "$OUT/decode_pipeline.log"
grep -c MISMATCH "$OUT/decode_pipeline.log"
