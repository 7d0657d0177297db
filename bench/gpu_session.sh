#!/usr/bin/env bash
# Everything this project runs on the H200 in one device call (see docs/benchmarks/gpu.md).
#   run from the repo root on the device machine: bash bench/gpu_session.sh  (results under $OUT)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' | tee -a "$OUT/gpu.txt"
echo "== correctness on the GPU"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/attention/test_triton_paged.py tests/engine/test_engine_cuda.py \
    2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
echo "== attention kernel"
timeout 230 python3 bench/attention_gpu.py --out "$OUT/attention_gpu.json" --time-limit-s 170 2>&1 | tee "$OUT/attention_gpu.log" | tail -60
echo "== engine tick"
timeout 190 python3 bench/engine_gpu.py --out "$OUT/engine_gpu.json" --ticks 2 --hf-sessions 16,64 2>&1 | tee "$OUT/engine_gpu.log" | tail -25
