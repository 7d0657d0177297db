#!/usr/bin/env bash
# Session 8 (2026-12-01), device call 1, as run at commit 7740932 (the warp-split kernel and its test were removed
# after this call, having lost the A/B: docs/benchmarks/gpu.md §1e):
# 1. the GPU tests of the attention kernels (the launch-timeline probe, the warp-split kernel compiled) and the
#    sm_90 kernel report;
# 2. the kernel report with the device's own Triton;
# 3. the decode timeline at N = 64 / 128 / 256 / 512 with the A/B of the engine kernel, its register cap and the
#    experimental warp-split kernel, and the N = 64 fixed-cost fit over windows 128 ... 1024 (gpu.md §1e).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== GPU tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/attention tests/bench/test_kernel_report_host.py \
  tests/bench/test_paged_attn_warp_split.py > "$OUT/gpu_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -12
echo "== kernel report (sm_90, this machine's Triton)"
timeout 120 python3 bench/kernel_report_host.py --out "$OUT/kernel_report.json" 2>&1 | grep -v "^compiling"
echo "== decode timeline"
timeout 300 python3 bench/decode_timeline_gpu.py --out "$OUT/decode_timeline.json" > "$OUT/decode_timeline.log" 2>&1
echo "rc $?"
tail -22 "$OUT/decode_timeline.log"
