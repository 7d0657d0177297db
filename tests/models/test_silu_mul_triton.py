"""The fused Triton SwiGLU activation (interpreted on the CPU) against the eager expression."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from metronome.models.silu_mul_triton import QUANTIZE_BLOCK  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tokens,width", [(1, 8), (3, 1030), (5, 2 * 1024 + 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_eager(tokens, width, dtype):
    from metronome.models.silu_mul_triton import silu_mul

    torch.manual_seed(0)
    gate_up = torch.randn(tokens, 2 * width, device=DEVICE, dtype=dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    want = (F.silu(gate.float()) * up.float()).to(dtype)
    got = silu_mul(gate_up)
    assert got.shape == (tokens, width) and got.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got, want, **tol)


def test_silu_mul_refuses_odd_widths():
    from metronome.models.silu_mul_triton import silu_mul

    with pytest.raises(ValueError, match="even"):
        silu_mul(torch.zeros(2, 7, device=DEVICE))


@pytest.mark.parametrize("width", [1030, QUANTIZE_BLOCK + 300], ids=["one-chunk", "two-chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantised_silu_mul_is_the_quantiser_of_the_product(dtype, width):
    """Quantised in the same launch, the rows are the codes and scales the row quantiser writes for the unfused
    product: fusing changes no code, whether a row takes one chunk of the kernel or several."""
    from metronome.models import fp8
    from metronome.models.silu_mul_triton import silu_mul

    torch.manual_seed(1)
    gate_up = torch.randn(4, 2 * width, device=DEVICE, dtype=dtype) * 4
    gate_up[1] = 0
    gate_up[2, width - 1] = 40   # the row's amax in its last column (the last chunk)
    rows = silu_mul(gate_up, quantize=True)
    assert isinstance(rows, fp8.QuantizedRows) and rows.dtype == dtype and rows.codes.shape == (4, width)
    want_codes, want_scale = fp8.quantize_rows(silu_mul(gate_up))
    assert torch.equal(rows.codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(rows.scale, want_scale)
    assert (rows.codes[1].float() == 0).all()
