set -u
OUT=${OUT:-results}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
echo "== rope tests alone"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/models/test_rope_triton.py --tb=long 2>&1 > $OUT/rope_alone.log; tail -5 $OUT/rope_alone.log
echo "== one failing test per process"
for k in "test_fused_rope_matches_eager and dtype1-7-1-64" "test_rerotated_keys_match and dtype0-2-16"; do
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/models/test_rope_triton.py -k "$k" --tb=short 2>&1 | grep -v -i warn | tail -30
done
