"""The tiled FP8 product: E4M3 rows times an E4M3 weight on the FP8 tensor cores, for a decode round of a hundred
rows or two (``fp8.TILED_MAX_ROWS``).

There cuBLAS's FP8 GEMM runs narrow layers (o, down) on few output tiles, most SMs idle through the long reduction,
and the weight-streaming product (``fp8_triton.fp8_weight_linear``) re-reads the rows once per 64 weight columns.
Here a program takes 64 rows x 128 weight columns; the row tiles that share a weight tile are launched together, so
the weight comes from memory once; and where the tiles are fewer than the SMs the reduction is split, its float32
partials summed in order by a second launch. Tiles and the split rule were chosen on an H200 (docs/benchmarks/
gpu.md, "The linear layers"). The E4M3 products accumulate in Triton's default for FP8 dots, as the streamed
product's and the experts' do; cuBLAS's path promotes its sums. Interpreted (CPU tests), the operands are upcast to
float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metronome.attention.fp8 import E4M3
from metronome.cpu import triton_interpreted
from metronome.models.fp8_triton import multiprocessor_count, sum_splits

# 64 rows (one warpgroup's MMA), 128 weight columns, 128-deep reduction steps.
TILED_BLOCK_M, TILED_BLOCK_N, TILED_BLOCK_K = 64, 128, 128
# Fewest reduction steps a split keeps.
MIN_STEPS_PER_SPLIT = 16


@triton.jit
def _fp8_tiled_product(X, XS, W, S, B, Y, P, M, N, K, k_per_split, stride_x, stride_w, stride_y,
                       HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr, DOT_F32: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # E4M3 rows times E4M3 weight columns in [BLOCK_M, BLOCK_N] tiles on the FP8 tensor cores. Row tiles vary
    # fastest, so the programs that share a weight tile run together and read it from memory once.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = split * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a_ptr = X + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]
        w_ptr = W + offs_n[None, :].to(tl.int64) * stride_w + offs_k[:, None]
        if EVEN:
            a = tl.load(a_ptr, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptr)
        else:
            k_mask = offs_k < K
            a = tl.load(a_ptr, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptr, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        if DOT_F32:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if SPLIT == 1:
        acc = acc * tl.load(XS + offs_m, mask=m_mask, other=0.0)[:, None]
        acc = acc * tl.load(S + offs_n, mask=n_mask, other=0.0)[None, :]
        if HAS_BIAS:
            acc = acc + tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])
    else:
        tl.store(P + (split * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :], acc,
                 mask=m_mask[:, None] & n_mask[None, :])


def tiled_split_k(row_tiles: int, column_tiles: int, k_steps: int, num_sms: int) -> int:
    """Reduction splits (1, 2 or 4) of the tiled product: enough for one program per SM where the tiles are fewer,
    keeping ``MIN_STEPS_PER_SPLIT`` reduction steps a split (fewer cost more in partial sums than they gain)."""
    split = 1
    while split < 4 and row_tiles * column_tiles * split < num_sms and k_steps // (2 * split) >= MIN_STEPS_PER_SPLIT:
        split *= 2
    return split


def fp8_tiled_linear(x: torch.Tensor, x_scale: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None, *, out_dtype: torch.dtype, block_m: int = TILED_BLOCK_M,
                     block_n: int = TILED_BLOCK_N, block_k: int = TILED_BLOCK_K, split_k: int | None = None,
                     num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """``(x * x_scale) @ (codes * scale).T + bias`` for E4M3 rows x [M, K] with scales [M, 1] (from
    ``quantize_rows_triton``), E4M3 codes [N, K] and per-channel scales [N, 1], on the FP8 tensor cores in
    [block_m, block_n] tiles: a decode round's product at a hundred rows or two, where cuBLAS's FP8 GEMM leaves
    SMs idle on narrow layers. ``split_k`` (default ``tiled_split_k``) > 1 sums float32 partials in order;
    ``num_stages`` defaults to 3 for wide layers (outputs >= 2x inputs), else 4."""
    m, k = x.shape
    n = codes.shape[0]
    if x.dtype != E4M3 or x_scale is None:
        raise ValueError("the tiled product takes E4M3 rows and their scales")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return y
    k_steps = triton.cdiv(k, block_k)
    if split_k is None:
        split_k = tiled_split_k(triton.cdiv(m, block_m), triton.cdiv(n, block_n), k_steps,
                                multiprocessor_count(x.device))
    if num_stages is None:
        num_stages = 3 if n >= 2 * k else 4
    k_per_split = triton.cdiv(k_steps, split_k) * block_k
    partial = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else y
    _fp8_tiled_product[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)](
        x, x_scale, codes, scale, scale if bias is None else bias, y, partial, m, n, k, k_per_split, x.stride(0),
        codes.stride(0), y.stride(0), HAS_BIAS=bias is not None, SPLIT=split_k, DOT_F32=triton_interpreted(),
        EVEN=k % block_k == 0 and n % block_n == 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        **({} if triton_interpreted() else {"num_warps": num_warps, "num_stages": num_stages}))
    if split_k > 1:
        sum_splits(partial, x_scale, scale, bias, y)
    return y
