"""E4M3 in Triton (interpreted on the CPU): the per-token activation quantiser against the torch ops it replaces,
and the weight-only product against float64."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from metronome.models import fp8  # noqa: E402
from metronome.models.fp8_triton import QUANT_ROW_MAX_BLOCK, fp8_weight_linear, quantize_rows_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("width", [1500, 18944, QUANT_ROW_MAX_BLOCK + 300], ids=["one-load", "7b-down-proj", "looped"])
def test_row_quantisation_kernel_matches_torch(width):
    """The same scales as the torch ops, and codes that differ by at most one E4M3 step where the division
    rounds differently (float32 division is not correctly rounded on a GPU); rows that fit one load, and rows
    that take the loop."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, width, generator=g) * torch.logspace(-2, 3, 5)[:, None]
    x[2] = 0
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(DEVICE, dtype)
        codes, scale = quantize_rows_triton(xd, fp8.ACTIVATION_AMAX_FLOOR)
        want_codes, want_scale = fp8.quantize_rows(xd.cpu())
        torch.testing.assert_close(scale.cpu(), want_scale, rtol=1e-6, atol=0)
        back, want = codes.cpu().float() * scale.cpu(), want_codes.float() * want_scale
        assert ((back - want).abs() <= torch.maximum(want.abs() * 2 ** -3, want_scale * 2 ** -9)).all()
        # The codes themselves: the scales may differ in their last bit, which moves every product a little.
        assert (codes.cpu().view(torch.uint8) == want_codes.view(torch.uint8)).float().mean() > 0.999
        assert (back[2] == 0).all()


@pytest.mark.parametrize("rows", [1, 5, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("k,n", [(300, 80), (256, 128)])
def test_weight_only_product_against_float64(rows, dtype, with_bias, split_k, k, n):
    """Against float64 over the same dequantised weight: fp32 accumulation, then the output's own rounding
    (one bf16 step, 2**-7 of it: the interpreter truncates where the GPU rounds to nearest); column and
    reduction sizes that are whole tiles or not, in one reduction or in split partials summed by a second launch."""
    g = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(k, n, bias=with_bias)
    torch.nn.init.normal_(linear.weight, std=0.05, generator=g)
    codes, scale = fp8.quantize(linear.weight.detach())
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = linear.bias.detach().to(dtype) if with_bias else None
    got = fp8_weight_linear(x.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), None if bias is None else bias.to(DEVICE),
                            split_k=split_k)
    assert got.dtype == dtype and got.shape == (rows, n)
    want = x.double() @ (codes.double() * scale.double()).T
    if bias is not None:
        want += bias.double()
    eps = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -20
    bound = eps * want.abs() + 1e-5 * (x.double().abs() @ (codes.double() * scale.double()).abs().T) + 1e-6
    assert ((got.cpu().double() - want).abs() <= bound).all()


@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("k,n", [(1000, 80), (700, 80), (256, 80), (300, 128)])
def test_uneven_splits_and_tiles_whole_in_one_dimension_only(split_k, k, n):
    """Splits of several reduction steps each, the last one shorter (down's 148 steps in 8 splits are 19 and 15),
    and shapes whole in K but not N or the other way round (the kernels' unmasked fast path must not be taken)."""
    g = torch.Generator().manual_seed(k + n)
    weight = torch.randn(n, k, generator=g) * 0.05
    codes, scale = fp8.quantize(weight)
    x = torch.randn(5, k, generator=g)
    got = fp8_weight_linear(x.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), None, split_k=split_k).cpu().double()
    w = codes.double() * scale.double()
    want = x.double() @ w.T
    assert ((got - want).abs() <= 2 ** -20 * want.abs() + 1e-5 * (x.double().abs() @ w.abs().T) + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("split_k", [1, 3])
def test_fp8_activation_product_rounds_each_row_onto_e4m3(rows, split_k):
    """W8A8: within float32 rounding of float64 over the rows rounded as ``fp8.quantize_rows`` rounds them (a code
    that lands on the other side of a midpoint moves one element by an E4M3 step, rarely), and farther from the
    product of the exact rows, by about E4M3's precision; bias added after the scales."""
    g = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(300, 80)
    torch.nn.init.normal_(linear.weight, std=0.05, generator=g)
    codes, scale = fp8.quantize(linear.weight.detach())
    x = torch.randn(rows, 300, generator=g) * torch.logspace(-1, 1, 300)
    bias = linear.bias.detach()
    x_rows, x_scale = quantize_rows_triton(x.to(DEVICE), fp8.ACTIVATION_AMAX_FLOOR)
    got = fp8_weight_linear(x_rows, codes.to(DEVICE), scale.to(DEVICE), bias.to(DEVICE), x_scale=x_scale,
                            out_dtype=torch.float32, split_k=split_k).cpu().double()
    w = codes.double() * scale.double()
    x_codes, x_scale = fp8.quantize_rows(x)
    rounded = (x_codes.double() * x_scale.double()) @ w.T + bias.double()
    exact = x.double() @ w.T + bias.double()
    norm = (exact - bias.double()).norm()
    assert (got - rounded).norm() / norm < 2 ** -10
    assert 2 ** -10 < (got - exact).norm() / norm < 2 ** -4


def test_e4m3_rows_need_their_scales_and_an_output_dtype():
    codes, scale = fp8.quantize(torch.randn(32, 64))
    x_rows, x_scale = quantize_rows_triton(torch.randn(3, 64).to(DEVICE), fp8.ACTIVATION_AMAX_FLOOR)
    for kwargs in ({}, {"x_scale": x_scale}, {"out_dtype": torch.float32}):
        with pytest.raises(ValueError, match="x_scale"):
            fp8_weight_linear(x_rows, codes.to(DEVICE), scale.to(DEVICE), **kwargs)
    with pytest.raises(ValueError, match="x_scale"):
        fp8_weight_linear(torch.randn(3, 64).to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), x_scale=x_scale)
