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


def _oracle_fp8_activations(x, gate_up, down, ids, w):
    """The float64 oracle with the activations rounded as the W8A8 path rounds them: each token's input and each
    assignment's SiLU·up row to E4M3 with its own amax scale (``fp8.quantize_rows``), the SiLU·up row first to
    ``x``'s dtype, in which the kernel stores it."""
    from metronome.models.fp8 import quantize_rows

    dtype = x.dtype

    def rounded(rows):
        codes, scale = quantize_rows(rows.to(dtype).float())
        return codes.double() * scale.double()

    x, gate_up, down, w = rounded(x.cpu()), gate_up.double().cpu(), down.double().cpu(), w.double().cpu()
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            y[t] += w[t, j] * (down[e] @ rounded((torch.nn.functional.silu(gate) * up)[None])[0])
    return y


@pytest.mark.parametrize("block_m,block_n,h", [(16, 16, 96), (16, 64, 96), (32, 64, 80)],
                         ids=["narrow-columns", "transposed", "transposed-32-rows-partial-steps"])
@pytest.mark.parametrize("group", [None, 16], ids=["per-channel", "groups-of-16"])
def test_fp8_activations_round_each_row_onto_e4m3(group, block_m, block_n, h):
    """W8A8: within float32 rounding of the oracle that rounds the same rows onto E4M3 (a code that lands on the
    other side of a midpoint moves its element one E4M3 step, 2**-3 of it, rarely), and farther from the oracle
    that keeps the activations exact, by about E4M3's precision. Programs of a warpgroup MMA's rows of columns
    multiply transposed (the weight tile as the tall operand), narrower ones do not: both land within 2**-9 of the
    rounding oracle, with reduction steps that overrun the hidden size or not."""
    from metronome.attention.fp8 import E4M3
    from metronome.models.moe_triton import WARPGROUP_MMA_ROWS, multiplies_transposed

    t, e, k, inter = 24, 6, 3, 64
    gate_up, down, scales, gate_up_f, down_f = _fp8_experts(e, h, inter, group)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ids, w = _routing(t, e, k, skew=True)
    tiles = TileConfig(block_n=block_n, block_k=32)
    assert multiplies_transposed(E4M3, block_m, tiles) == (block_n >= WARPGROUP_MMA_ROWS)
    got = grouped_moe(x, gate_up, down, ids, w, launch=MoeLaunch(block_m, tiles, tiles), scales=scales,
                      fp8_activations=True).double().cpu()
    rounded = _oracle_fp8_activations(x, gate_up_f, down_f, ids, w)
    exact = _oracle(x, gate_up_f, down_f, ids, w)
    norm = exact.norm()
    assert (got - rounded).norm() / norm < 2 ** -9
    assert 2 ** -9 < (got - exact).norm() / norm < 2 ** -4
    with pytest.raises(ValueError, match="E4M3 experts"):
        grouped_moe(x, *_weights(e, h, inter, torch.float32), ids, w, fp8_activations=True)


def test_hopper_prefill_tiles_round_each_row_onto_e4m3():
    """The prefill tiles for E4M3 rows on Hopper's warpgroup MMA (twice the reduction step, 256 columns for the
    down product) give the product of the oracle that rounds the same rows, within the rounding of the rows' dtype,
    and stay about E4M3's precision from the exact one."""
    from metronome.models.moe_triton import choose_launch

    t, e, k, h, inter = 24, 6, 3, 160, 64
    # bf16 rows on the GPU, as the engine's: float32 rows multiply in IEEE float32, whose widened operands in these
    # tiles overflow Hopper's shared memory (grouped_moe never picks them for 4-byte rows).
    dtype, bound = (torch.bfloat16, 2 ** -7) if DEVICE == "cuda" else (torch.float32, 2 ** -9)
    gate_up, down, scales, gate_up_f, down_f = _fp8_experts(e, h, inter, None)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    ids, w = _routing(t, e, k, skew=True)
    launch = choose_launch(512 * e, e, itemsize=1, warpgroup_mma=True)
    assert launch == MoeLaunch(128, TileConfig(128, 128, 8, 4), TileConfig(256, 128, 8, 4))
    assert choose_launch(512 * e, e, itemsize=4, warpgroup_mma=True).gate_up.block_k <= 64   # 4-byte rows: narrowed
    got = grouped_moe(x, gate_up, down, ids, w.to(dtype), launch=launch, scales=scales,
                      fp8_activations=True).double().cpu()
    rounded = _oracle_fp8_activations(x.cpu(), gate_up_f, down_f, ids, w.to(dtype))
    exact = _oracle(x.cpu().double(), gate_up_f, down_f, ids, w.to(dtype))
    assert (got - rounded).norm() / rounded.norm() < bound < (got - exact).norm() / exact.norm()


def test_only_e4m3_rows_on_hopper_take_the_hopper_tiles(monkeypatch):
    """``grouped_moe`` asks for the tiles of Hopper's warpgroup MMA where E4M3 rows meet such a GPU, and not for
    bf16 rows (W8A16) on it, nor for E4M3 rows elsewhere."""
    import metronome.models.moe_triton as mt

    t, e, k, h, inter = 8, 4, 2, 32, 32
    gate_up, down, scales, _, _ = _fp8_experts(e, h, inter, None)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    ids, w = _routing(t, e, k, skew=False)
    asked = []
    choose = mt.choose_launch
    monkeypatch.setattr(mt, "choose_launch", lambda *a, **kw: asked.append(kw["warpgroup_mma"]) or choose(*a, **kw))
    for hopper in (True, False):
        monkeypatch.setattr(mt, "warpgroup_mma_available", lambda device, hopper=hopper: hopper)
        for fp8_activations in (False, True):
            grouped_moe(x, gate_up, down, ids, w, scales=scales, fp8_activations=fp8_activations)
    assert asked == [False, True, False, False]


def test_transposed_tiles_only_where_the_warpgroup_mma_is(monkeypatch):
    """A GPU without the warpgroup MMA (Ada, Blackwell) multiplies short E4M3 row tiles as they are (transposed,
    they would only take more shared memory); Hopper and the interpreter multiply them transposed."""
    import metronome.models.fp8 as fp8
    from metronome.attention.fp8 import E4M3
    from metronome.models.moe_triton import multiplies_transposed

    tiles = TileConfig(block_n=64, block_k=128)
    for capability, transposed in (((8, 9), False), ((9, 0), True), ((10, 0), False)):
        monkeypatch.setattr(fp8, "_capability", lambda index, c=capability: c)
        assert multiplies_transposed(E4M3, 16, tiles, torch.device("cuda", 0)) is transposed
    assert multiplies_transposed(E4M3, 16, tiles, torch.device("cpu"))
    assert not multiplies_transposed(torch.bfloat16, 16, tiles, torch.device("cpu"))


def test_rows_quantised_before_the_block_give_the_same_product():
    """Codes handed in by the kernel that wrote the rows (the norm) are what the products read: given with rows of
    zeros beside them, the output is the one of the rows the codes were made from, to the bit. Without E4M3
    activations, or in another shape, they are refused."""
    from metronome.models.fp8 import quantize_rows

    t, e, k, h, inter = 20, 6, 3, 64, 64
    gate_up, down, scales, _, _ = _fp8_experts(e, h, inter, None)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ids, w = _routing(t, e, k, skew=False)
    tiles = TileConfig(block_n=16, block_k=32)
    launch = MoeLaunch(16, tiles, tiles)
    want = grouped_moe(x, gate_up, down, ids, w, launch=launch, scales=scales, fp8_activations=True)
    got = grouped_moe(torch.zeros_like(x), gate_up, down, ids, w, launch=launch, scales=scales, fp8_activations=True,
                      x_rows=quantize_rows(x))
    assert want.abs().max() > 0 and torch.equal(got, want)
    with pytest.raises(ValueError, match="x_rows"):
        grouped_moe(x, gate_up, down, ids, w, launch=launch, scales=scales, fp8_activations=False,
                    x_rows=quantize_rows(x))
    with pytest.raises(ValueError, match="x_rows"):
        grouped_moe(x, gate_up, down, ids, w, launch=launch, scales=scales, fp8_activations=True,
                    x_rows=quantize_rows(x[:-1]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_block_given_quantised_rows_routes_their_values(backend):
    """The block handed its input as ``QuantizedRows`` (as the norm before it writes them on a GPU with FP8 tensor
    cores): the router reads the values; the experts read the codes where they multiply E4M3 rows, else the values.
    The codes here come from other rows than the values, so each reading shows in the output."""
    from metronome.models.fp8 import QuantizedRows, quantize_rows, scaled_mm_available, takes_e4m3_rows

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32   # E4M3 activations are for bf16 rows
    _, block = _pair(norm_topk_prob=True)
    block = block.to(DEVICE, dtype)
    block.experts.quantize_fp8_()
    block.experts.backend = backend
    g = torch.Generator().manual_seed(8)
    x, other = (torch.randn(9, 32, generator=g).to(DEVICE, dtype) for _ in range(2))
    fp8_rows = DEVICE == "cuda" and backend == "triton" and scaled_mm_available(torch.device(DEVICE))
    assert takes_e4m3_rows(block, 9, dtype) == fp8_rows
    with torch.no_grad():
        got = block(QuantizedRows(*quantize_rows(other), dtype, values=x))
        ids, weights = block.route(x)
        want = block.experts(other if fp8_rows else x, ids, weights)
        assert torch.equal(got, want)
        assert not torch.equal(got, block.experts(x if fp8_rows else other, ids, weights))
