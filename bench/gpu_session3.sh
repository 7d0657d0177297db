#!/usr/bin/env bash
# Device call 6 of 2026-11-30: after the split-KV retune — GPU tests, decode kernel, engine tick.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
echo "== correctness on the GPU"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/attention/test_triton_paged.py tests/engine/test_engine_cuda.py \
    tests/models/test_rope_triton.py 2>&1 | tail -3 | tee "$OUT/gpu_tests6.log"
echo "== decode kernel"
timeout 150 python3 bench/attention_gpu.py --models qwen2.5-7b,qwen3-30b-a3b --modes decode --sessions 1,16,64,256,512 \
    --out "$OUT/attention_decode_retuned.json" --flex-budget-s 60 2>&1 | grep -E "^(qwen|model|---|copy)" | tail -14
echo "== engine tick"
timeout 200 python3 bench/engine_gpu.py --out "$OUT/engine_gpu_retuned.json" --ticks 2 --hf-sessions "" \
    --sessions 64,128,256,320,384,512 2>&1 | tail -9
