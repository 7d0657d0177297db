#!/usr/bin/env bash
# Prepared in session 8 (2026-12-01), when no GPU was lent; not yet run. One device call:
# 1. the attention GPU tests (the launch-timeline probe's among them);
# 2. the kernel report for sm_90 with the device's own Triton (registers and waves behind the launch rule);
# 3. the decode timeline at N = 64 / 256 / 512 and the N = 64 fixed-cost fit over windows 128 ... 1024:
#    where the ~8 µs between the N = 64 decode (~42 µs) and its read floor (~34 µs) go (gpu.md §1d).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
echo "== GPU tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/attention tests/bench/test_kernel_report_host.py \
  > "$OUT/gpu_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -12
echo "== kernel report (sm_90, this machine's Triton)"
timeout 120 python3 bench/kernel_report_host.py --out "$OUT/kernel_report.json" 2>&1 | grep -v "^compiling"
echo "== decode timeline"
timeout 300 python3 bench/decode_timeline_gpu.py --out "$OUT/decode_timeline.json" > "$OUT/decode_timeline.log" 2>&1
echo "rc $?"
tail -12 "$OUT/decode_timeline.log"
