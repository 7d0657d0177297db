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

from metronome.attention.e4m3_triton import e4m3_grid  # noqa: E402
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
