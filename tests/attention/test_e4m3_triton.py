"""Rounding onto the E4M3 grid in Triton (interpreted on the CPU) against torch's cast."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from metronome.attention.e4m3_triton import e4m3_grid, e4m3_to_f16  # noqa: E402
from metronome.attention.fp8 import E4M3, E4M3_MAX  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _cast(X, Q, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N)
    tl.store(Q + offs, e4m3_grid(x).to(Q.dtype.element_ty), mask=offs < N)


def _triton_e4m3(x: torch.Tensor) -> torch.Tensor:
    q = torch.empty(x.shape, dtype=E4M3, device=x.device)
    _cast[(triton.cdiv(x.numel(), 1024),)](x, q, x.numel(), BLOCK=1024)
    return q


def test_rounding_onto_the_e4m3_grid_is_torchs():
    """Every E4M3 value, every midpoint between neighbours and one float32 step either side of it (ties go to
    even), subnormals, out of range (saturates), NaN: the same codes as torch's cast. (The interpreter's own cast
    turns NaN into a number, triton-lang/triton#11897, so NaN is checked compiled only.)"""
    grid = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    grid = grid[torch.isfinite(grid)].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    inf = torch.tensor(float("inf"))
    x = torch.cat([grid, mid, mid.nextafter(inf), mid.nextafter(-inf),
                   torch.tensor([464.0, 465.0, 1e9, -1e9, float("inf"), 2.0 ** -11, -(2.0 ** -10)])])
    got = _triton_e4m3(x.to(DEVICE)).cpu()
    # Saturating: ±inf become ±448 (torch's own cast of inf gives NaN, which no quantiser wants).
    assert torch.equal(got.view(torch.uint8), x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(torch.uint8))
    if DEVICE == "cuda":
        assert torch.isnan(_triton_e4m3(torch.tensor([float("nan")], device=DEVICE)).float()).all()


@triton.jit
def _widen(X, Y, ROWS: tl.constexpr, COLS: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(Y + offs, e4m3_to_f16(tl.load(X + offs)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="e4m3_to_f16 is PTX: it needs a compiled kernel on a GPU")
@pytest.mark.parametrize("rows,cols", [(16, 16), (64, 128)])
def test_widening_in_ptx_is_torchs_cast_for_every_code(rows, cols):
    """All 256 codes (NaN, both zeros, subnormals, ±448), in tiles whose elements each thread holds in fours: the
    fp16 bits torch's cast gives, element for element (NaN as NaN)."""
    codes = torch.arange(rows * cols, device="cuda").remainder(256).to(torch.uint8).view(E4M3).reshape(rows, cols)
    out = torch.empty((rows, cols), dtype=torch.float16, device="cuda")
    _widen[(1,)](codes, out, ROWS=rows, COLS=cols)
    want = codes.to(torch.float16)
    nan = want.isnan()
    assert nan.sum() == 2 * rows * cols // 256 and torch.equal(out.isnan(), nan)   # the payload may differ
    assert torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16))   # -0 and subnormals bit for bit
