#!/usr/bin/env bash
# Device call 8 (session 2, 2026-11-30): fused SiLU*mul — GPU tests, then the engine tick again.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
echo "== correctness on the GPU"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/attention/test_triton_paged.py tests/engine/test_engine_cuda.py \
    tests/models/test_rope_triton.py tests/models/test_silu_mul_triton.py tests/engine/test_engine_hidden.py 2>&1 | tail -3 | tee "$OUT/gpu_tests8.log"
echo "== engine tick"
timeout 280 python3 bench/engine_gpu.py --out "$OUT/engine_gpu_silu.json" --ticks 2 --hf-sessions "" \
    --sessions 64,128,256,320,384,512 2>&1 | tail -10 | tee "$OUT/engine_gpu_silu.log"
