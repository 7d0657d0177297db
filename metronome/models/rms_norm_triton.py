"""RMSNorm in one Triton kernel (CUDA) with the residual add before it and, for an FP8 layer after it, the
quantisation of its output onto E4M3.

In a decoder layer ``x + attention(...)`` and ``post_attention_layernorm`` are two launches, and an FP8 layer's
per-token quantiser (``fp8_triton.quantize_rows_triton``) a third, each over a few hundred rows in a captured
decode round, where a launch costs more than its bytes. One program per row here adds, normalises in float32,
rounds to the activations' dtype as ``F.rms_norm`` does and, where asked, quantises the row from registers
(``fp8_triton.store_row_codes``): the same codes the three launches write, up to the norm's order of summation.
For a layer that reads the rows unrounded too (a MoE block: its router) it stores both.
Rows up to ``fp8_triton.QUANT_ROW_MAX_BLOCK`` wide; runs under ``TRITON_INTERPRET=1`` on the CPU (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metronome.attention.fp8 import E4M3
from metronome.models.fp8 import ACTIVATION_AMAX_FLOOR, QuantizedRows
from metronome.models.fp8_triton import row_block, row_launch, store_row_codes


@triton.jit
def _add_rms_norm(X, D, W, R, OUT, S, V, K, stride_x, stride_d, stride_r, stride_o, stride_v, eps, amax_floor,
                  ADD: tl.constexpr, QUANTIZE: tl.constexpr, VALUES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if ADD:   # the residual sum, rounded as torch's add rounds it, is the next residual
        d = tl.load(D + row * stride_d + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(R + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    h = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / K + eps) * w).to(X.dtype.element_ty)
    if QUANTIZE:
        store_row_codes(h.to(tl.float32), mask, OUT + row * stride_o + offs, S + row, amax_floor)
        if VALUES:
            tl.store(V + row * stride_v + offs, h, mask=mask)
    else:
        tl.store(OUT + row * stride_o + offs, h, mask=mask)


def fits(width: int) -> bool:
    """Whether a row of ``width`` fits one program of this kernel."""
    return row_block(width) is not None


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                 quantize: bool = False, values: bool = False) -> tuple[torch.Tensor, torch.Tensor | QuantizedRows]:
    """``(r, RMSNorm(r))`` with ``r = x + delta`` (``x`` itself where ``delta`` is None), rows [T, K] of one
    float dtype. The norm comes in ``x``'s dtype, or where ``quantize`` as ``QuantizedRows`` (per-token E4M3);
    ``values`` (with ``quantize``) keeps the rows in ``x``'s dtype beside the codes."""
    t, k = x.shape
    block = row_block(k)
    if block is None:
        raise ValueError(f"rows of {k} do not fit one program; use RMSNorm's unfused path")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if delta is not None and delta.stride(-1) != 1:
        delta = delta.contiguous()
    residual = torch.empty_like(x) if delta is not None else x
    out = torch.empty((t, k), dtype=E4M3 if quantize else x.dtype, device=x.device)
    scale = torch.empty((t, 1), dtype=torch.float32, device=x.device) if quantize else out
    rows = torch.empty_like(x) if quantize and values else None
    if t:
        _add_rms_norm[(t,)](x, x if delta is None else delta, weight, residual, out, scale,
                            out if rows is None else rows, k, x.stride(0), 0 if delta is None else delta.stride(0),
                            residual.stride(0), out.stride(0), 0 if rows is None else rows.stride(0), eps,
                            ACTIVATION_AMAX_FLOOR, ADD=delta is not None, QUANTIZE=quantize, VALUES=rows is not None,
                            BLOCK=block, **row_launch(block))
    return residual, QuantizedRows(out, scale, x.dtype, rows) if quantize else out
