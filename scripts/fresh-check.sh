#!/usr/bin/env bash
# Clone the committed HEAD into a temporary folder and run the README's two commands there, as CI and a new
# user would: nothing from this checkout's .venv, caches or untracked files can hide a missing install step.
set -euo pipefail
src=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
dir=$(mktemp -d -t metronome-fresh-XXXXXX)
trap 'rm -rf "$dir"' EXIT
git clone -q "$src" "$dir/metronome"
cd "$dir/metronome"
echo "fresh clone of $(git rev-parse --short HEAD) in $dir/metronome"
export METRONOME_CACHE="$dir/cache"      # the packaged model is converted afresh too
export METRONOME_KERNEL_CACHE="$dir/kernels"   # and the C kernels built afresh
make test
make run
echo "fresh-check passed: make test and make run on a clean clone"
