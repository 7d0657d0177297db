"""SwiGLU's ``silu(gate) * up`` in one Triton kernel (CUDA), reading the fused gate/up projection.

Eagerly, ``F.silu(gate).mul_(up)`` on the two halves of ``gate_up_proj``'s output runs two kernels
over *strided* views, which fall off PyTorch's vectorised path: in a profiled Qwen2.5-7B tick
(N = 256, H200) they took 45 ms of 471. One program here handles ``BLOCK`` columns of one token,
loading both halves contiguously and writing the product once, in float32 before the final rounding.
Where the down projection multiplies E4M3 rows, one program per token computes its row's amax, then recomputes
the product and writes its E4M3 codes, instead of a second launch (the row quantiser) reading the product back:
the same codes, the product rounded to the activations' dtype first as the two launches round it.
Runs under ``TRITON_INTERPRET=1`` on the CPU (tests compare it with the eager expression).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metronome.attention.fp8 import E4M3
from metronome.cpu import triton_interpreted
from metronome.models.fp8 import ACTIVATION_AMAX_FLOOR, QuantizedRows
from metronome.models.fp8_triton import row_scale, store_codes

BLOCK = 1024
# The quantising form: one program a token (16 warps) takes its row in chunks of QUANTIZE_BLOCK columns.
QUANTIZE_BLOCK = 4096
QUANTIZE_WARPS = 16


@triton.jit
def _silu_times_up(X, row, stride_x, n_cols, cols, mask):
    """``silu(gate) * up`` in float32 for columns ``cols`` of token ``row`` (both forms compute it here, so the
    quantising one writes the codes of the plain one's output)."""
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _silu_mul(X, OUT, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)   # row * stride passes 2**31 for long prefills of wide MLPs
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    out = _silu_times_up(X, row, stride_x, n_cols, cols, mask)
    tl.store(OUT + row * stride_o + cols, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_row_chunk(X, row, stride_x, n_cols, cols, mask):
    """The product rounded to the activations' dtype, as the plain form stores it, back in float32."""
    return _silu_times_up(X, row, stride_x, n_cols, cols, mask).to(X.dtype.element_ty).to(tl.float32)


@triton.jit
def _silu_mul_quantize(X, Q, S, stride_x, stride_q, n_cols, amax_floor, BLOCK: tl.constexpr):
    # Two passes over the row in chunks, the second recomputing the product from cache: a whole row of a wide
    # MLP held in registers through the rounding spills them.
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(_silu_mul_row_chunk(X, row, stride_x, n_cols, cols, cols < n_cols)))
    scale = row_scale(amax, amax_floor)
    tl.store(S + row, scale)
    for c0 in range(0, n_cols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < n_cols
        store_codes(_silu_mul_row_chunk(X, row, stride_x, n_cols, cols, mask), scale, Q + row * stride_q + cols,
                    mask)


def silu_mul(gate_up: torch.Tensor, *, quantize: bool = False) -> torch.Tensor | QuantizedRows:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` for ``gate_up`` [T, 2I] (last dim contiguous) → [T, I]; with
    ``quantize``, as per-token E4M3 ``QuantizedRows`` for an FP8 layer."""
    t, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"gate_up must have an even width, got {two_i}")
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    n = two_i // 2
    if quantize:
        codes = torch.empty((t, n), dtype=E4M3, device=gate_up.device)
        scale = torch.empty((t, 1), dtype=torch.float32, device=gate_up.device)
        if t:
            launch = {} if triton_interpreted() else {"num_warps": QUANTIZE_WARPS}
            _silu_mul_quantize[(t,)](gate_up, codes, scale, gate_up.stride(0), codes.stride(0), n,
                                     ACTIVATION_AMAX_FLOOR, BLOCK=QUANTIZE_BLOCK, **launch)
        return QuantizedRows(codes, scale, gate_up.dtype)
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        _silu_mul[(t, triton.cdiv(n, BLOCK))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=BLOCK)
    return out
