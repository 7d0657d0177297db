"""The tiled FP8 product (interpreted on the CPU, where the operands are upcast to float32) against float64 over
the same E4M3 rows and weight."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from metronome.models import fp8  # noqa: E402
from metronome.models.fp8_tiled_triton import MIN_STEPS_PER_SPLIT, fp8_tiled_linear, tiled_split_k  # noqa: E402
from metronome.models.fp8_triton import quantize_rows_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rounded_product(rows: int, k: int, n: int, seed: int, with_bias: bool):
    """E4M3 rows and scales, E4M3 weight and scales, bias, and float64 over them: the sum, and the sum of
    magnitudes (what a float32 accumulation's error scales with)."""
    g = torch.Generator().manual_seed(seed)
    codes, scale = fp8.quantize(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-1, 1, k)
    bias = torch.randn(n, generator=g) if with_bias else None
    x_rows, x_scale = quantize_rows_triton(x.to(DEVICE), fp8.ACTIVATION_AMAX_FLOOR)
    xs, ws = x_rows.cpu().double() * x_scale.cpu().double(), codes.double() * scale.double()
    want = xs @ ws.T + (0 if bias is None else bias.double())
    return x_rows, x_scale, codes.to(DEVICE), scale.to(DEVICE), bias, want, xs.abs() @ ws.abs().T


@pytest.mark.parametrize("rows", [1, 37, 70])
@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("k,n,with_bias", [(300, 80, True), (512, 128, False)])
def test_small_tiles_against_float64(rows, split_k, k, n, with_bias):
    """Small tiles: within float32 rounding of float64, the scales applied after the sum, bias after the scales;
    row, column and reduction sizes that are whole tiles or not, in one reduction or in split partials summed in
    order by a second launch."""
    x_rows, x_scale, codes, scale, bias, want, magnitude = rounded_product(rows, k, n, rows, with_bias)
    got = fp8_tiled_linear(x_rows, x_scale, codes, scale, None if bias is None else bias.to(DEVICE),
                           out_dtype=torch.float32, block_m=16, block_n=32, block_k=64, split_k=split_k)
    assert got.shape == (rows, n)
    assert ((got.cpu().double() - want).abs() <= 2 ** -20 * magnitude + 1e-6).all()


def test_the_engines_tiles_and_bf16_output():
    """The default tiles, split rule and stages over a 4,096-deep reduction into bf16, as a decode round runs
    them: within bf16's rounding of the output (and, on a GPU, the FP8 dot's own accumulation) of float64."""
    x_rows, x_scale, codes, scale, bias, want, _ = rounded_product(70, 4096, 384, 0, True)
    got = fp8_tiled_linear(x_rows, x_scale, codes, scale, bias.to(DEVICE, torch.bfloat16), out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (70, 384)
    assert (got.cpu().double() - want).norm() / want.norm() < 2 ** -8


def test_the_split_gives_one_program_per_sm_where_the_reduction_is_long_enough():
    assert tiled_split_k(2, 32, 96, 132) == 4       # a narrow layer's long reduction: 64 tiles -> 256 programs
    assert tiled_split_k(2, 32, 4 * MIN_STEPS_PER_SPLIT - 1, 132) == 2   # each split keeps its fewest steps
    assert tiled_split_k(3, 192, 32, 132) == 1      # enough tiles already
    assert tiled_split_k(1, 1, 4096, 132) == 4      # at most 4


def test_only_e4m3_rows_with_scales_are_taken():
    codes, scale = fp8.quantize(torch.randn(32, 64))
    x_rows, x_scale = quantize_rows_triton(torch.randn(3, 64).to(DEVICE), fp8.ACTIVATION_AMAX_FLOOR)
    with pytest.raises(ValueError, match="E4M3 rows"):
        fp8_tiled_linear(torch.randn(3, 64).to(DEVICE), x_scale, codes.to(DEVICE), scale.to(DEVICE),
                         out_dtype=torch.float32)
    with pytest.raises(ValueError, match="E4M3 rows"):
        fp8_tiled_linear(x_rows, None, codes.to(DEVICE), scale.to(DEVICE), out_dtype=torch.float32)
