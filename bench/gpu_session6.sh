#!/usr/bin/env bash
# Device call 10 (session 2, 2026-11-30): Qwen2.5-Omni-7B thinker and MiniCPM-o 4.5 capacities.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
echo "== qwen2.5-omni"
timeout 270 python3 bench/models_gpu_qwen2_5_omni.py 2>&1 | grep -v Warn | tee "$OUT/models_qwen2_5_omni.log"
echo "== minicpm-o (needs soxr: carry .whl with its wheel, see .library/device/README.md)"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
timeout 250 python3 bench/models_gpu_minicpm_o.py 2>&1 | grep -v Warn | tee "$OUT/models_minicpm_o.log"
