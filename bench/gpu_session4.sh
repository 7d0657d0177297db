#!/usr/bin/env bash
# Device call 7 (session 2, 2026-11-30): where the tick's GPU time goes.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 420 python3 bench/profile_engine_gpu.py --sessions 64,256 --out "$OUT/profile_engine_gpu.json" 2>&1 | tee "$OUT/profile_engine_gpu.log" | grep -v Warning
