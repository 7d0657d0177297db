"""The Triton grouped-GEMM MoE against the torch sorted path (and a per-assignment float64 oracle).

Without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py
before triton is imported), so shapes stay tiny.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from metronome.models.moe import experts_sorted  # noqa: E402
from metronome.models.moe_triton import MoeLaunch, TileConfig, grouped_moe, sum_assignments  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(e, h, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5
    down = torch.randn(e, h, inter, generator=g) / inter ** 0.5
    return gate_up.to(DEVICE, dtype), down.to(DEVICE, dtype)


def _routing(t, e, k, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    if skew:  # most tokens pick the same few experts: several row tiles per expert, many experts idle
        logits[:, :3] += 4.0
    w, ids = torch.softmax(logits, -1).topk(k, -1)
    return ids.to(DEVICE), (w / w.sum(-1, keepdim=True)).to(DEVICE)


def _oracle(x, gate_up, down, ids, w):
    """Per-assignment float64 sum: the definition, with no sorting or grouping at all."""
    x, gate_up, down, w = x.double().cpu(), gate_up.double().cpu(), down.double().cpu(), w.double().cpu()
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            y[t] += w[t, j] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return y


@pytest.mark.parametrize("t,e,k,h,inter,block_m,skew", [
    (1, 4, 2, 32, 16, 16, False),     # one decode token
    (7, 8, 2, 48, 32, 16, False),     # ragged hidden / intermediate vs the 16/32 blocks below
    (40, 6, 3, 32, 16, 16, True),     # several tiles for the popular experts, idle experts
    (33, 5, 2, 32, 32, 32, True),
])
def test_grouped_gemm_matches_torch_path_and_oracle_fp32(t, e, k, h, inter, block_m, skew):
    gate_up, down = _weights(e, h, inter, torch.float32)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ids, w = _routing(t, e, k, skew=skew)
    small = TileConfig(block_n=16, block_k=16)
    got = grouped_moe(x, gate_up, down, ids, w, launch=MoeLaunch(block_m, small, TileConfig(block_n=32, block_k=16)))
    torch.testing.assert_close(got, experts_sorted(x, gate_up, down, ids, w), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.double().cpu(), _oracle(x, gate_up, down, ids, w), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("t,e,k", [(3, 8, 2), (24, 8, 2), (100, 4, 2), (300, 2, 1)])
def test_default_tiles_for_every_load_class(t, e, k):
    """choose_launch's four classes (decode-like to prefill-like rows per expert) give the same result."""
    from metronome.models.moe_triton import choose_launch

    gate_up, down = _weights(e, 32, 16, torch.float32)
    x = torch.randn(t, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    ids, w = _routing(t, e, k, seed=5)
    assert choose_launch(t * k, e).block_m == {3: 16, 24: 16, 100: 64, 300: 128}[t]
    torch.testing.assert_close(grouped_moe(x, gate_up, down, ids, w), experts_sorted(x, gate_up, down, ids, w),
                               atol=1e-5, rtol=1e-4)


def test_grouped_gemm_bf16_close_to_fp32_oracle_and_deterministic():
    t, e, k, h, inter = 12, 8, 4, 64, 32
    gate_up, down = _weights(e, h, inter, torch.bfloat16)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    ids, w = _routing(t, e, k)
    w = w.to(torch.bfloat16)
    tiles = TileConfig(block_n=32, block_k=32)
    got = grouped_moe(x, gate_up, down, ids, w, launch=MoeLaunch(16, tiles, tiles))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double().cpu(), _oracle(x, gate_up, down, ids, w), atol=3e-2, rtol=3e-2)
    again = grouped_moe(x, gate_up, down, ids, w, launch=MoeLaunch(16, tiles, tiles))
    assert torch.equal(got, again)


@pytest.mark.parametrize("t,k,h", [(1, 8, 2048), (5, 3, 1500), (9, 2, 40)])
def test_sum_assignments_adds_each_tokens_rows_into_its_dtype(t, k, h):
    rows = torch.randn(t * k, h, generator=torch.Generator().manual_seed(t)).to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        got = sum_assignments(rows, k, dtype)
        assert got.dtype == dtype and got.shape == (t, h)
        want = rows.double().view(t, k, h).sum(1)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(got.double(), want.to(dtype).double(), **tol)


def test_rejects_mismatched_expert_weights():
    gate_up, down = _weights(4, 32, 16, torch.float32)
    x = torch.zeros(2, 16, device=DEVICE)
    ids, w = _routing(2, 4, 2)
    with pytest.raises(ValueError, match="hidden"):
        grouped_moe(x, gate_up, down, ids, w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_grouped_gemm_replays_in_a_cuda_graph_with_new_routing():
    """Routing and both launches are free of host syncs: one capture serves every routing of that size."""
    t, e, k, h, inter = 24, 16, 4, 64, 32
    gate_up, down = _weights(e, h, inter, torch.bfloat16)
    x = torch.randn(t, h, device=DEVICE, dtype=torch.bfloat16)
    ids, w = _routing(t, e, k, seed=1)
    static_ids, static_w = ids.clone(), w.to(torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        grouped_moe(x, gate_up, down, static_ids, static_w)   # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_moe(x, gate_up, down, static_ids, static_w)
    for seed in (2, 3):
        ids, w = _routing(t, e, k, seed=seed, skew=seed == 3)
        static_ids.copy_(ids)
        static_w.copy_(w)
        graph.replay()
        torch.testing.assert_close(out, grouped_moe(x, gate_up, down, ids, w.to(torch.bfloat16)), atol=0, rtol=0)


@pytest.mark.parametrize("itemsize", [1, 2, 4])
def test_default_tiles_fit_hopper_shared_memory(itemsize):
    """Pipelined A and B tiles of every default launch fit in 227 KiB (gate/up loads two B tiles per step).

    Triton's software pipeline keeps ``num_stages - 1`` buffers (the H200 reported 417792 bytes = 3 × one
    fp32 stage of the 4-stage gate/up tile): float32 must narrow the bf16-tuned tiles. The tiles for E4M3 rows
    on Hopper's warpgroup MMA fit even with bf16 rows.
    """
    from metronome.models.moe_triton import choose_launch

    for mean, warpgroup_mma in itertools.product((1, 8, 64, 512), (False, True)):
        launch = choose_launch(mean * 128, 128, itemsize, warpgroup_mma=warpgroup_mma)
        for c, b_tiles in ((launch.gate_up, 2), (launch.down, 1)):
            a_bytes = max(itemsize, 2)   # E4M3 weights (1 byte) meet bf16 activations
            per_stage = launch.block_m * c.block_k * a_bytes + b_tiles * c.block_k * c.block_n * itemsize
            assert max(1, c.num_stages - 1) * per_stage <= 227 * 1024, (mean, c)
