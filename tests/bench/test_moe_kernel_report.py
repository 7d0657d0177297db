"""The grouped MoE GEMM's kernels as the compiler builds them for an H200 (sm_90), on a machine without a GPU.

Which tensor-core instruction a tile compiles to is a property of the compiled code, not of its results: every
numerical test passes whether an E4M3 product runs on the FP8 warpgroup MMA or has its operands widened to fp16
first, as short row tiles do untransposed (docs/benchmarks/gpu.md, "As compiled for sm_90"). It reads the compiler
of this repository's lock: a Triton that chose otherwise fails it, and the docs' reading of the kernels with it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from metronome.models.moe_triton import WARPGROUP_MMA_ROWS

ROOT = Path(__file__).resolve().parents[2]


def test_decode_and_prefill_tiles_both_multiply_e4m3_on_the_warpgroup_mma(tmp_path):
    """At a decode round's 224 tokens (32-row tiles) both kernels multiply transposed, the weight tile as the tall
    operand, and so reach Hopper's E4M3 warpgroup MMA with no widening in the loop, as the prefill's 6,272 tokens
    (128-row tiles) do untransposed."""
    out = tmp_path / "moe.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "moe_kernel_report.py"), "--tokens", "224,6272",
                          "--out", str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    kernels = {(k["tokens"], k["kernel"]): k for k in json.loads(out.read_text())["kernels"]}
    for kernel in ("gate_up", "down"):
        decode, prefill = kernels[224, kernel], kernels[6272, kernel]
        assert decode["block_m"] < WARPGROUP_MMA_ROWS <= prefill["block_m"]
        assert decode["transposed"] and not prefill["transposed"]
        for tile in (decode, prefill):
            assert set(tile["loop_mma"]) == {"QGMMA"} and tile["loop_widenings"] == 0, tile
