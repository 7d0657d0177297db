"""SwiGLU's ``silu(gate) * up`` in one Triton kernel (CUDA), reading the fused gate/up projection.

Eagerly, ``F.silu(gate).mul_(up)`` on the two halves of ``gate_up_proj``'s output runs two kernels
over *strided* views, which fall off PyTorch's vectorised path: in a profiled Qwen2.5-7B tick
(N = 256, H200) they took 45 ms of 471. One program here handles ``BLOCK`` columns of one token,
loading both halves contiguously and writing the product once, in float32 before the final rounding.
Where the down projection multiplies E4M3 rows, one program per token computes its row's amax, then recomputes
the product and writes its E4M3 codes, instead of a second launch (the row quantiser) reading the product back:
the same codes, the product rounded to the activations' dtype first as the two launches round it. Rows few
enough to stay in the L2 (decode rounds) are split over programs instead: one launch writes each chunk's amax,
a second recomputes the chunk and writes its codes.
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
# The split quantising form, for rows that stay in the L2 between its two launches (decode rounds): a program
# per SPLIT_BLOCK columns of a row, where one program a row waits on its chunks one after another.
SPLIT_BLOCK = 2048
L2_BYTES_UNKNOWN = 32 << 20   # a device that does not report its L2 (the interpreter): a Hopper-class one


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


@triton.jit
def _silu_mul_chunk_amax(X, AMAX, stride_x, n_cols, n_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = _silu_mul_row_chunk(X, row, stride_x, n_cols, cols, cols < n_cols)
    tl.store(AMAX + row * n_chunks + chunk, tl.max(tl.abs(x), 0))


@triton.jit
def _silu_mul_chunk_codes(X, AMAX, Q, S, stride_x, stride_q, n_cols, n_chunks, amax_floor, BLOCK: tl.constexpr,
                          CHUNKS: tl.constexpr):
    # The row's scale from its chunks' amaxes (the max of maxima is the row's amax exactly), then this
    # chunk's product again, from the L2, onto E4M3.
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    c = tl.arange(0, CHUNKS)
    scale = row_scale(tl.load(AMAX + row * n_chunks + c, mask=c < n_chunks, other=0.0), amax_floor)
    if chunk == 0:
        tl.store(S + row, scale)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    store_codes(_silu_mul_row_chunk(X, row, stride_x, n_cols, cols, mask), scale, Q + row * stride_q + cols, mask)


def splits_rows(gate_up: torch.Tensor) -> bool:
    """Whether the quantising form splits each row over programs: where the rows, read twice, fit half the L2."""
    l2 = L2_BYTES_UNKNOWN
    if gate_up.is_cuda:
        l2 = getattr(torch.cuda.get_device_properties(gate_up.device), "L2_cache_size", L2_BYTES_UNKNOWN)
    return gate_up.numel() * gate_up.element_size() <= l2 // 2


def silu_mul(gate_up: torch.Tensor, *, quantize: bool = False, split: bool | None = None
             ) -> torch.Tensor | QuantizedRows:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` for ``gate_up`` [T, 2I] (last dim contiguous) → [T, I]; with
    ``quantize``, as per-token E4M3 ``QuantizedRows`` for an FP8 layer, a row split over programs where ``split``
    (by default where ``splits_rows``: the same codes either way)."""
    t, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"gate_up must have an even width, got {two_i}")
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    n = two_i // 2
    if quantize:
        codes = torch.empty((t, n), dtype=E4M3, device=gate_up.device)
        scale = torch.empty((t, 1), dtype=torch.float32, device=gate_up.device)
        if t and (splits_rows(gate_up) if split is None else split):
            chunks = triton.cdiv(n, SPLIT_BLOCK)
            amax = torch.empty((t, chunks), dtype=torch.float32, device=gate_up.device)
            _silu_mul_chunk_amax[(t, chunks)](gate_up, amax, gate_up.stride(0), n, chunks, BLOCK=SPLIT_BLOCK)
            _silu_mul_chunk_codes[(t, chunks)](gate_up, amax, codes, scale, gate_up.stride(0), codes.stride(0), n,
                                               chunks, ACTIVATION_AMAX_FLOOR, BLOCK=SPLIT_BLOCK,
                                               CHUNKS=triton.next_power_of_2(chunks))
        elif t:
            launch = {} if triton_interpreted() else {"num_warps": QUANTIZE_WARPS}
            _silu_mul_quantize[(t,)](gate_up, codes, scale, gate_up.stride(0), codes.stride(0), n,
                                     ACTIVATION_AMAX_FLOOR, BLOCK=QUANTIZE_BLOCK, **launch)
        return QuantizedRows(codes, scale, gate_up.dtype)
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        _silu_mul[(t, triton.cdiv(n, BLOCK))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=BLOCK)
    return out
