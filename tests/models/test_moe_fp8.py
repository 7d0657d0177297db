"""FP8 MoE experts: the grouped GEMM (Triton; interpreted on the CPU) and the torch paths with E4M3 weights and
per-channel or block scales, against a float64 per-assignment oracle over the weights dequantised here, and the
whole sparse block against transformers' Qwen3-Omni block."""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from metronome.models.fp8 import ExpertScales, Fp8Linear, quantize  # noqa: E402
from metronome.models.moe import ExpertMLP, FusedExperts, experts_loop, experts_sorted  # noqa: E402
from metronome.models.moe_triton import MoeLaunch, TileConfig, grouped_moe  # noqa: E402
from tests.models.test_moe import _pair  # noqa: E402
from tests.models.test_moe_triton import _oracle, _routing, _weights  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fp8_experts(e, h, inter, group, seed=0):
    """E4M3 experts with the test's own dequantised copies (codes times each column's scale)."""
    gate_up, down = _weights(e, h, inter, torch.float32, seed)
    (gu_codes, gu_scale), (d_codes, d_scale) = quantize(gate_up, group), quantize(down, group)

    def back(codes, scale, width):
        cols = scale.repeat_interleave(group or width, -1)[..., :width]
        return codes.float() * cols

    scales = ExpertScales(gu_scale, d_scale, group or h, group or inter)
    return gu_codes, d_codes, scales, back(gu_codes, gu_scale, h), back(d_codes, d_scale, inter)


@pytest.mark.parametrize("group", [None, 16, 32], ids=["per-channel", "groups-of-16", "groups-of-32"])
@pytest.mark.parametrize("t,e,k,h,inter,skew", [(1, 4, 2, 32, 32, False), (40, 6, 3, 64, 48, True)])
def test_grouped_gemm_with_fp8_experts_matches_float64_over_dequantised(group, t, e, k, h, inter, skew):
    gate_up, down, scales, gate_up_f, down_f = _fp8_experts(e, h, inter, group)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ids, w = _routing(t, e, k, skew=skew)
    want = _oracle(x, gate_up_f, down_f, ids, w)
    tiles = TileConfig(block_n=16, block_k=32)
    got = grouped_moe(x, gate_up, down, ids, w, launch=MoeLaunch(16, tiles, tiles), scales=scales)
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=1e-4)
    for path in (experts_sorted, experts_loop):
        torch.testing.assert_close(path(x, gate_up, down, ids, w, scales).double().cpu(), want, atol=1e-5, rtol=1e-4)


def test_group_scales_need_whole_reduction_steps():
    gate_up, down, scales, _, _ = _fp8_experts(4, 48, 24, 24)
    x = torch.randn(3, 48).to(DEVICE)
    ids, w = _routing(3, 4, 2)
    with pytest.raises(ValueError, match="groups of 24"):
        grouped_moe(x, gate_up, down, ids, w, scales=scales)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_quantised_block_close_to_transformers(backend):
    """The sparse block with its experts quantised in place: exact to transformers' block holding the dequantised
    experts, and within a stated bound of the float one: 10 % of the largest output (E4M3's 3-bit mantissa
    through two products and SiLU: 5.4 % seen here)."""
    ref, ours = _pair(norm_topk_prob=True)
    ours.experts.quantize_fp8_()
    assert ours.experts.gate_up_proj.dtype == torch.float8_e4m3fn and ours.experts.scales is not None
    ours.experts.backend = backend
    dequantised = copy.deepcopy(ref)
    s = ours.experts.scales
    with torch.no_grad():
        dequantised.experts.gate_up_proj.copy_(ours.experts.gate_up_proj.float() * s.gate_up)
        dequantised.experts.down_proj.copy_(ours.experts.down_proj.float() * s.down)
        x = torch.randn(1, 11, 32, generator=torch.Generator().manual_seed(3))
        got = ours.to(DEVICE)(x[0].to(DEVICE)).cpu()
        torch.testing.assert_close(got, dequantised(x)[0], atol=1e-5, rtol=1e-4)
        want = ref(x)[0]
    assert (got - want).abs().max() <= 0.1 * want.abs().max()


def test_per_expert_fp8_layers_stack_with_their_block_scales():
    """An FP8 checkpoint's experts, one Fp8Linear per projection with block scales, stack into one tensor each."""
    g = torch.Generator().manual_seed(5)
    experts = torch.nn.ModuleList(ExpertMLP(64, 48) for _ in range(3))
    for x in experts:
        for name in ("gate_proj", "up_proj", "down_proj"):
            linear = getattr(x, name)
            torch.nn.init.normal_(linear.weight, std=linear.in_features ** -0.5, generator=g)
            setattr(x, name, Fp8Linear.from_linear(linear, 32))
    fused = FusedExperts.stack(experts)
    s = fused.scales
    assert fused.gate_up_proj.shape == (3, 96, 64) and s.gate_up.shape == (3, 96, 2) and s.gate_up_group == 32
    assert s.down.shape == (3, 64, 2) and s.down_group == 32
    x = torch.randn(5, 64, generator=g)
    ids, w = (t.cpu() for t in _routing(5, 3, 2, seed=6))     # the stacked experts live on the CPU here
    want = sum(w[:, j, None] * torch.stack([
        experts[e].down_proj(torch.nn.functional.silu(experts[e].gate_proj(x[t])) * experts[e].up_proj(x[t]))
        for t, e in enumerate(ids[:, j].tolist())]) for j in range(2))
    torch.testing.assert_close(fused(x, ids, w), want, atol=1e-5, rtol=1e-4)
