#!/usr/bin/env bash
# Device call (session 2, 2026-11-30): one-row embeds on the decode graphs (GPU test), Moshi again,
# and the Qwen3-Omni-30B-A3B thinker. Needs soxr: carry .whl with its wheel.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
echo "== GPU engine tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine_cuda.py tests/models/omni/test_qwen3_omni.py 2>&1 | tail -3 | tee "$OUT/gpu_tests_embeds.log"
echo "== moshi"
timeout 100 python3 bench/models_gpu_moshi.py 2>&1 | grep -v Warn | tail -14 | tee "$OUT/models_moshi_graphs.log"
cp "$OUT/models_moshi.json" "$OUT/models_moshi_graphs.json" 2>/dev/null
echo "== qwen3-omni"
timeout 200 python3 bench/models_gpu_qwen3_omni.py --sessions 16,32,48,64 --compare-sessions "" --layer-tokens 16,256,4096 2>&1 | grep -v Warn | tail -30 | tee "$OUT/models_qwen3_omni.log"
ls "$OUT"
