"""E4M3 in Triton: exact rounding onto the E4M3 grid, and per-token quantisation of activations in one kernel.

``e4m3_grid`` rounds float32 to the nearest E4M3 value (ties to even, saturating at ±448) before any kernel casts
to ``float8e4nv``, so the cast itself is exact. Left to the cast, compiled kernels may round through an fp16
intermediate (values just past a midpoint then round down, triton-lang/triton#11753) and the interpreter drops
the carry into the exponent (126.3 became 64, triton-lang/triton#11897).

The FP8 linear layer scales every activation row by its own amax before the tensor-core product. In torch
that is half a dozen small kernels (abs, amax, cast, divide, clamp, cast) per layer input; inside a captured
decode round each costs a launch, so one program per row does the lot: a pass for the amax, a pass to write
the E4M3 codes.

A decode round has a few rows per layer input, where the product is bound by reading the weight, not by the
arithmetic: ``w8a16_linear`` reads the E4M3 codes (half the bytes of bf16), converts each tile to the
activations' dtype in registers and multiplies on the bf16 tensor cores, so the activations are not
quantised at all. Interpreted (CPU tests), the operands are upcast to float32, as in ``moe_triton.py``.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from metronome.attention.fp8 import E4M3, E4M3_MAX
from metronome.cpu import triton_interpreted

BLOCK_K = 1024
_MAX = tl.constexpr(E4M3_MAX)


@triton.jit
def e4m3_grid(x):
    """``x`` (float32) rounded to the nearest E4M3 value, ties to even, saturated at ±448 (NaN stays NaN)."""
    nan = x != x
    x = tl.clamp(x, -_MAX, _MAX)
    bits = x.to(tl.int32, bitcast=True)
    ax = tl.abs(x)
    # E4M3 values are 2**(e - 3) apart in the binade [2**e, 2**(e + 1)), and 2**-9 apart below 2**-6.
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = ax / step  # exact: a power of two
    f = tl.floor(r)
    half = r - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    up = (half > 0.5) | ((half == 0.5) & (odd == 1.0))
    q = (f + up.to(tl.float32)) * step
    q = (q.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)  # x's sign, -0 too
    return tl.where(nan, float("nan"), q)  # the clamp does not keep NaN


@triton.jit
def _quantize_rows(X, Q, S, K, stride_x, stride_q, amax_floor, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(X + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0), amax_floor) / _MAX
    tl.store(S + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(X + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Q + row * stride_q + k0 + offs, e4m3_grid(x / scale).to(Q.dtype.element_ty), mask=mask)


def quantize_rows_triton(x: torch.Tensor, amax_floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes of ``x`` [M, K] (last dim contiguous) and float32 scales [M, 1]: each row's amax maps to 448."""
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    codes = torch.empty((m, k), dtype=E4M3, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows[(m,)](x, codes, scale, k, x.stride(0), codes.stride(0), amax_floor,
                             BLOCK=min(BLOCK_K, triton.next_power_of_2(k)))
    return codes, scale


@triton.jit
def _w8a16(X, W, S, B, Y, M, N, K, stride_x, stride_w, stride_y, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(X + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(W + offs_n[None, :].to(tl.int64) * stride_w + offs_k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_F32:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w.to(a.dtype), acc)
    acc = acc * tl.load(S + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def w8a16_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (codes * scale).T + bias`` for x [M, K] (few rows), E4M3 codes [N, K], per-channel scales [N, 1]."""
    m, k = x.shape
    n = codes.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    # Narrow column tiles: a decode round's few rows leave the weight stream as the work, and 32 columns
    # give the GPU's SMs several programs each at the hidden sizes of 7B models (N >= 3584).
    block_n = 32 if n >= 2048 else 16
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _w8a16[grid](x, codes, scale, bias if bias is not None else scale, y, m, n, k,
                 x.stride(0), codes.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                 DOT_F32=triton_interpreted() or x.dtype == torch.float32,
                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, num_warps=4, num_stages=4)
    return y
