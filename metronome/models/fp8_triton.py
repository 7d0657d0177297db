"""E4M3 in Triton: per-token quantisation of activations in one kernel, and the weight-streaming product (the
tiled product for more rows is ``fp8_tiled_triton.py``).

Codes are rounded onto the E4M3 grid by ``attention/e4m3_triton.e4m3_grid`` before any cast (exact rounding).

The FP8 linear layer scales every activation row by its own amax before the tensor-core product. In torch
that is half a dozen small kernels (abs, amax, cast, divide, clamp, cast) per layer input; inside a captured
decode round each costs a launch, so one program per row does the lot: the amax, then the E4M3 codes, from one
load of a row that fits ``QUANT_ROW_MAX_BLOCK`` (two passes over a longer one).

A decode round has a few hundred rows or fewer per layer input, where the product is bound by reading the weight,
not by the arithmetic: ``fp8_weight_linear`` streams the E4M3 codes (half the bytes of bf16) with the weight tile as
the wide operand and long reductions split across programs. Given E4M3 rows and their scales it multiplies on the
FP8 tensor cores (W8A8); given bf16 or float rows it widens the codes to their dtype in registers (W8A16), a
conversion that on an H200 held the stream to 2.3–2.7 TB/s. E4M3 in Triton needs compute capability 8.9. Interpreted (CPU tests), the
operands are upcast to float32, as in ``moe_triton.py``.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from metronome.attention.e4m3_triton import e4m3_grid
from metronome.attention.fp8 import E4M3, E4M3_MAX
from metronome.cpu import triton_interpreted

ROW_BLOCK = 1024   # elements of a row one program of the split sum takes at once
# The row quantiser takes a row of up to this many elements in one load, kept in registers from the amax to the
# codes (64 a thread at 16 warps), rather than two passes over the row, each of dependent loads: a 7B model's
# down-projection input (18,944) fits.
QUANT_ROW_MAX_BLOCK = 32768
_MAX = tl.constexpr(E4M3_MAX)


@triton.jit
def row_scale(amax, amax_floor):
    """A row's E4M3 scale from its elementwise running amax (float32): the row's amax maps to 448."""
    return tl.maximum(tl.max(amax, 0), amax_floor) / _MAX


@triton.jit
def store_codes(x, scale, codes_ptrs, mask):
    """``x`` (float32) divided by its row's ``scale``, rounded onto E4M3, stored at ``codes_ptrs``."""
    tl.store(codes_ptrs, e4m3_grid(x / scale).to(codes_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def store_row_codes(x, mask, codes_ptrs, scale_ptr, amax_floor):
    """One whole row ``x`` (float32, masked-off lanes 0) onto E4M3 with its own scale: the codes at
    ``codes_ptrs``, the scale at ``scale_ptr``. For kernels that hold the row they produce in registers."""
    scale = row_scale(tl.abs(x), amax_floor)
    tl.store(scale_ptr, scale)
    store_codes(x, scale, codes_ptrs, mask)


@triton.jit
def _quantize_rows(X, Q, S, K, stride_x, stride_q, amax_floor, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if ONE_BLOCK:   # the row stays in registers between the amax and the codes: one load, not two
        mask = offs < K
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        store_row_codes(x, mask, Q + row * stride_q + offs, S + row, amax_floor)
        return
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(X + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = row_scale(amax, amax_floor)
    tl.store(S + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(X + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        store_codes(x, scale, Q + row * stride_q + k0 + offs, mask)


def row_block(width: int) -> int | None:
    """The block of a one-program-a-row kernel that holds a whole row of ``width`` in registers; None past
    ``QUANT_ROW_MAX_BLOCK``."""
    block = triton.next_power_of_2(max(width, 1))
    return block if block <= QUANT_ROW_MAX_BLOCK else None


def row_launch(block: int) -> dict:
    """Warps for a program that holds ``block`` elements of a row: 1,024 a warp, 4 to 16 (none interpreted)."""
    return {} if triton_interpreted() else {"num_warps": max(4, min(16, block // 1024))}


def quantize_rows_triton(x: torch.Tensor, amax_floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes of ``x`` [M, K] (last dim contiguous) and float32 scales [M, 1]: each row's amax maps to 448."""
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    codes = torch.empty((m, k), dtype=E4M3, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(QUANT_ROW_MAX_BLOCK, triton.next_power_of_2(k))
        launch = row_launch(block)
        _quantize_rows[(m,)](x, codes, scale, k, x.stride(0), codes.stride(0), amax_floor, BLOCK=block,
                             ONE_BLOCK=k <= block, **launch)
    return codes, scale


@triton.jit
def _fp8_weight_product(X, XS, W, S, B, Y, P, M, N, K, k_per_split, stride_x, stride_w, stride_y,
                        HAS_BIAS: tl.constexpr, ROW_SCALE: tl.constexpr, DOT_F32: tl.constexpr,
                        SPLIT: tl.constexpr, EVEN: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Transposed product: the weight tile [BLOCK_N, BLOCK_K] is the wide operand and the few activation rows the
    # narrow one, so a 64-column tile fills the tensor cores whatever the row count. Row tiles vary fastest, so
    # the programs that share a weight tile run together and read it from memory once.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_lo = split * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(X + offs_m[None, :].to(tl.int64) * stride_x + offs_k[:, None],
                    mask=m_mask[None, :] & k_mask[:, None], other=0.0)
        w_ptr = W + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
        if EVEN:
            w = tl.load(w_ptr)
        else:
            w = tl.load(w_ptr, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_F32:
            acc = tl.dot(w.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
        else:   # E4M3 activations: E4M3 products; else the codes widened to the activations' dtype
            acc = tl.dot(w.to(a.dtype), a, acc)
    if SPLIT == 1:
        acc = acc * tl.load(S + offs_n, mask=n_mask, other=0.0)[:, None]
        if ROW_SCALE:
            acc = acc * tl.load(XS + offs_m, mask=m_mask, other=0.0)[None, :]
        if HAS_BIAS:
            acc = acc + tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(Y + offs_m[None, :].to(tl.int64) * stride_y + offs_n[:, None], acc.to(Y.dtype.element_ty),
                 mask=m_mask[None, :] & n_mask[:, None])
    else:   # this split's partial sum; _sum_splits adds them in split order (the same bits every run)
        tl.store(P + (split * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None], acc,
                 mask=m_mask[None, :] & n_mask[:, None])


@triton.jit
def _sum_splits(P, XS, S, B, Y, M, N, stride_y, HAS_BIAS: tl.constexpr, ROW_SCALE: tl.constexpr,
                SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT):
        acc += tl.load(P + (split * M + row).to(tl.int64) * N + offs, mask=mask, other=0.0)
    acc = acc * tl.load(S + offs, mask=mask, other=0.0)
    if ROW_SCALE:
        acc = acc * tl.load(XS + row)
    if HAS_BIAS:
        acc = acc + tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row.to(tl.int64) * stride_y + offs, acc.to(Y.dtype.element_ty), mask=mask)


def multiprocessor_count(device: torch.device) -> int:
    """The SMs of a CUDA device; 1 elsewhere (the interpreter runs one program at a time)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def sum_splits(partial: torch.Tensor, x_scale: torch.Tensor | None, scale: torch.Tensor, bias: torch.Tensor | None,
               y: torch.Tensor) -> None:
    """Into ``y`` [M, N]: the float32 partial sums [splits, M, N] of a split reduction added in split order (the
    same bits every run), times the weight's per-channel ``scale`` and the rows' ``x_scale`` if any, plus ``bias``."""
    splits, m, n = partial.shape
    _sum_splits[(triton.cdiv(n, ROW_BLOCK), m)](
        partial, scale if x_scale is None else x_scale, scale, scale if bias is None else bias, y, m, n, y.stride(0),
        HAS_BIAS=bias is not None, ROW_SCALE=x_scale is not None, SPLIT=splits, BLOCK=ROW_BLOCK)


def split_k_for(column_tiles: int, k_steps: int, device: torch.device) -> int:
    """Reduction splits (1, 2, 4 or 8) that give the GPU about four programs per SM: a decode round's product
    streams the weight, and a layer with few column tiles (7B q/k/v, o, down: 56-72) would leave most SMs
    without enough loads in flight. On the CPU (interpreted) one split."""
    if device.type != "cuda":
        return 1
    target = 4 * multiprocessor_count(device)
    split = 1
    while split < 8 and column_tiles * split < target and 2 * split <= k_steps:
        split *= 2
    return split


def fp8_weight_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                      *, x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                      split_k: int | None = None) -> torch.Tensor:
    """``x @ (codes * scale).T + bias`` for x [M, K] (a decode round's rows), E4M3 codes [N, K], per-channel
    scales [N, 1]; the result in ``out_dtype`` (default ``x``'s).

    ``x`` in a float dtype: weight-only (W8A16), the codes widened to it in registers. ``x`` E4M3 codes with one
    scale per row (``x_scale`` [M, 1], from ``quantize_rows_triton``): the products run on the FP8 tensor cores
    (W8A8), which spares the widening. ``split_k``: reduction splits (default ``split_k_for``); with more than
    one, each writes a float32 partial and a second launch sums them in order, scales and rounds.
    """
    m, k = x.shape
    n = codes.shape[0]
    if (x.dtype == E4M3) != (x_scale is not None) or (x.dtype == E4M3 and out_dtype is None):
        raise ValueError("E4M3 rows need their scales (x_scale) and an out_dtype; only E4M3 rows take scales")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    block_n, block_k = 64, 128
    column_tiles, k_steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    split = split_k or split_k_for(column_tiles, k_steps, x.device)
    k_per_split = triton.cdiv(k_steps, split) * block_k
    partial = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    has_bias = bias is not None
    unused = scale   # stands in for the pointers a launch does not read
    _fp8_weight_product[(triton.cdiv(m, block_m), column_tiles, split)](
        x, unused if x_scale is None else x_scale, codes, scale, bias if has_bias else unused, y, partial,
        m, n, k, k_per_split, x.stride(0), codes.stride(0), y.stride(0), HAS_BIAS=has_bias,
        ROW_SCALE=x_scale is not None, DOT_F32=triton_interpreted() or y.dtype == torch.float32, SPLIT=split,
        EVEN=k % block_k == 0 and n % block_n == 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4, num_stages=3)
    if split > 1:
        sum_splits(partial, x_scale, scale, bias, y)
    return y
