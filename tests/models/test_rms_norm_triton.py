"""The fused residual add + RMSNorm (+ E4M3 quantisation) kernel, interpreted on the CPU: against torch's add and
``F.rms_norm``, and against the launches it replaces (the norm, then the row quantiser) code for code."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from metronome.models import fp8  # noqa: E402
from metronome.models.fp8_triton import QUANT_ROW_MAX_BLOCK  # noqa: E402
from metronome.models.rms_norm_triton import add_rms_norm, fits  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def assert_torchs_add(got: torch.Tensor, want: torch.Tensor) -> None:
    """Compiled, the sum is rounded to nearest as torch rounds it: equal to the bit. The interpreter truncates
    float32 to bf16 instead, one bf16 step at most."""
    if DEVICE == "cuda" or got.dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0)


def _rows(tokens: int, width: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=g) * torch.logspace(-2, 2, tokens)[:, None]
    delta = torch.randn(tokens, width, generator=g)
    weight = 1 + 0.2 * torch.randn(width, generator=g)
    return tuple(t.to(DEVICE, dtype) for t in (x, delta, weight))


@pytest.mark.parametrize("tokens,width", [(1, 8), (3, 1030), (4, 4096 + 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("add", [False, True])
def test_add_and_norm_match_torch(tokens, width, dtype, add):
    """The residual is torch's add (``assert_torchs_add``); the norm is ``F.rms_norm``'s within the output's
    rounding."""
    x, delta, weight = _rows(tokens, width, dtype, tokens)
    residual, normed = add_rms_norm(x, delta if add else None, weight, EPS)
    assert_torchs_add(residual, x + delta if add else x)
    want = F.rms_norm(residual.float(), (width,), weight.float(), EPS)   # the norm of the kernel's own sum
    assert normed.dtype == dtype and normed.shape == (tokens, width)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2 ** -7)
    torch.testing.assert_close(normed.float(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("add", [False, True])
def test_quantised_norm_is_the_quantiser_of_the_norm(dtype, add):
    """Quantised in the same pass, the rows are the codes and scales the row quantiser writes for the kernel's
    own unquantised norm: fusing changes no code. A zero row keeps the amax floor and zero codes."""
    x, delta, weight = _rows(5, 1500, dtype, 3)
    x[2] = 0
    if add:
        delta[2] = 0
    residual, rows = add_rms_norm(x, delta if add else None, weight, EPS, quantize=True)
    assert isinstance(rows, fp8.QuantizedRows) and rows.dtype == dtype
    _, normed = add_rms_norm(x, delta if add else None, weight, EPS)
    want_codes, want_scale = fp8.quantize_rows(normed)
    assert torch.equal(rows.codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(rows.scale, want_scale)
    assert (rows.codes[2].float() == 0).all()
    assert_torchs_add(residual, x + delta if add else x)


def test_quantised_norm_keeps_its_values_where_asked():
    """For a layer that reads the rows unrounded too (a MoE router), the same pass stores the norm beside its codes:
    the rows the unquantised kernel writes, and the same codes."""
    x, delta, weight = _rows(4, 2048, torch.bfloat16, 5)
    _, rows = add_rms_norm(x, delta, weight, EPS, quantize=True, values=True)
    _, normed = add_rms_norm(x, delta, weight, EPS)
    _, codes_only = add_rms_norm(x, delta, weight, EPS, quantize=True)
    assert codes_only.values is None and torch.equal(rows.values, normed)
    assert torch.equal(rows.codes.view(torch.uint8), codes_only.codes.view(torch.uint8))
    assert torch.equal(rows.scale, codes_only.scale)


def test_rows_wider_than_a_program_are_refused():
    width = 2 * QUANT_ROW_MAX_BLOCK
    assert fits(QUANT_ROW_MAX_BLOCK) and not fits(width)
    with pytest.raises(ValueError, match="unfused"):
        add_rms_norm(torch.zeros(1, width, device=DEVICE), None, torch.ones(width, device=DEVICE), EPS)
