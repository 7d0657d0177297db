#!/usr/bin/env bash
# Device calls 2-4 of 2026-11-30: decode CUDA graphs (3: pipelined greedy rounds; 4: fused RMSNorm/RoPE) — correctness on the GPU, then the engine tick.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
echo "== correctness on the GPU"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine_cuda.py tests/models/test_rope_triton.py 2>&1 | tail -15 | tee "$OUT/gpu_tests2.log"
echo "== engine tick with decode graphs"
timeout 330 python3 bench/engine_gpu.py --out "$OUT/engine_gpu_graphs.json" --ticks 2 --hf-sessions "" --sessions 64,128,256,320,384,512 \
    2>&1 | tee "$OUT/engine_gpu_graphs.log" | tail -25
