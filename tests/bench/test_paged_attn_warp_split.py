"""The experimental warp-split decode kernel against the engine kernel's reference and the float64 oracle
(interpreter on the CPU; compiled on a GPU). It is timed against the engine kernel in bench/decode_timeline_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from bench.paged_attn_warp_split import paged_attention_warp_split  # noqa: E402
from metronome.attention.triton_paged import plan_triton  # noqa: E402
from tests.attention.test_triton_paged import _case, _check  # noqa: E402

DECODE_CASES = {  # (context length, 1) per session; sinks, window, block size
    "t<S": ([(3, 1), (5, 1)], 8, 16, 4),
    "S<=t<S+W": ([(20, 1), (23, 1)], 4, 32, 4),
    "t>>W, window ends mid-block": ([(300, 1), (257, 1), (401, 1)], 3, 37, 8),
    "S=0 plain sliding window": ([(90, 1), (77, 1)], 0, 16, 4),
    "no window (causal)": ([(40, 1), (130, 1)], 4, None, 4),
    "sinks and window in one tile": ([(70, 1), (1, 1)], 16, 40, 16),
}


@pytest.mark.parametrize("name", DECODE_CASES)
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (7, 1)])
def test_matches_reference_and_oracle(name, heads, kv_heads):
    seqs, sinks, window, bs = DECODE_CASES[name]
    meta, query, k_cache, v_cache, dense = _case(seqs, sinks, window, bs, heads=heads, kv_heads=kv_heads, seed=5)
    plan = plan_triton(meta, heads, kv_heads, block_n=64, force_splits=1)
    out = torch.full_like(query, float("nan"))     # every element must be written
    paged_attention_warp_split(query, k_cache, v_cache, meta, plan, out=out)
    _check(out, meta, query, k_cache, v_cache, dense, seqs, sinks, window)


def test_refuses_what_it_does_not_implement():
    seqs = [(300, 1), (60, 20)]
    meta, query, k_cache, v_cache, _ = _case(seqs, 4, 32, 8)
    with pytest.raises(ValueError, match="one unsplit decode launch"):
        paged_attention_warp_split(query, k_cache, v_cache, meta, plan_triton(meta, 4, 2))
    decode = [(300, 1), (200, 1)]
    meta, query, k_cache, v_cache, _ = _case(decode, 4, 32, 8)
    with pytest.raises(ValueError, match="groups of at least 16 keys"):
        paged_attention_warp_split(query, k_cache, v_cache, meta, plan_triton(meta, 4, 2, block_n=32,
                                                                               force_splits=1))
