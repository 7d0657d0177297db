"""RoPE in Triton (CUDA): q and k of a forward in one kernel, and the re-rotation of stored keys when
windows rebase. Rotate-half layout, in place.

The eager version costs ~7 small kernels per tensor per layer (casts, slices, cat, mul, add); inside a
captured decode round those dominate the elementwise time. One program handles one token: it computes
cos/sin of ``position * inv_freq`` in float32 and rotates every q and k head of that token.
Runs under ``TRITON_INTERPRET=1`` on the CPU (tests compare it with ``Rotary.apply``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metronome.attention.e4m3_triton import e4m3_grid


@triton.jit
def _rotate_in_place(ptr, cos, sin, mask, HALF: tl.constexpr):
    """Rotate-half RoPE of the [heads, HALF] pairs at ``ptr`` and ``ptr + HALF`` by float32 ``cos``/``sin``."""
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    _store_rotated(ptr, x1, x2, cos, sin, mask, HALF)


@triton.jit
def _store_rotated(ptr, x1, x2, cos, sin, mask, HALF: tl.constexpr):
    y1 = x1 * cos[None, :] - x2 * sin[None, :]
    y2 = x2 * cos[None, :] + x1 * sin[None, :]
    if ptr.dtype.element_ty == tl.float8e4nv:  # E4M3 keys (per-head scales; rotation keeps them): round exactly
        y1 = e4m3_grid(y1)
        y2 = e4m3_grid(y2)
    tl.store(ptr, y1.to(ptr.dtype.element_ty), mask=mask)
    tl.store(ptr + HALF, y2.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_rotate_in_place(ptr, norm_ptr, eps, cos, sin, offs, mask, HALF: tl.constexpr):
    """Each head's RMSNorm (weight at ``norm_ptr``, in float32) and then its rotation, one read and one write."""
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    fmask = offs < HALF
    w1 = tl.load(norm_ptr + offs, mask=fmask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(norm_ptr + HALF + offs, mask=fmask, other=0.0).to(tl.float32)[None, :]
    _store_rotated(ptr, x1 * rstd * w1, x2 * rstd * w2, cos, sin, mask, HALF)


@triton.jit
def _rope_qk(Q, K, POS, INV_FREQ, Q_NORM, K_NORM, stride_qt, stride_qh, stride_kt, stride_kh, scaling, eps,
             QH: tl.constexpr, KH: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
             BLOCK_HALF: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_HALF)
    fmask = offs < HALF
    pos = tl.load(POS + t).to(tl.float32)
    freq = tl.load(INV_FREQ + offs, mask=fmask, other=0.0)
    angle = pos * freq
    cos = tl.cos(angle) * scaling
    sin = tl.sin(angle) * scaling
    heads = tl.arange(0, BLOCK_H)
    for which in tl.static_range(2):
        if which == 0:
            base, stride_t, stride_h, n, norm = Q, stride_qt, stride_qh, QH, Q_NORM
        else:
            base, stride_t, stride_h, n, norm = K, stride_kt, stride_kh, KH, K_NORM
        hmask = (heads < n)[:, None] & fmask[None, :]
        ptr = base + t * stride_t + heads[:, None] * stride_h + offs[None, :]
        if NORM:
            _norm_rotate_in_place(ptr, norm, eps, cos, sin, offs, hmask, HALF)
        else:
            _rotate_in_place(ptr, cos, sin, hmask, HALF)


def rope_qk_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
             scaling: float = 1.0, norms: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> None:
    """Rotate ``q`` [T, QH, D] and ``k`` [T, KH, D] in place at ``positions`` [T] (last dim contiguous).

    ``norms``: (q weight [D], k weight [D], eps) of a per-head RMSNorm (Qwen3's ``q_norm`` / ``k_norm``) applied
    first, in the same pass: a decode round's two norm launches a layer folded into this one.
    """
    t, qh, d = q.shape
    kh = k.shape[1]
    if t == 0:
        return
    half = d // 2
    q_norm, k_norm, eps = norms if norms is not None else (inv_freq, inv_freq, 0.0)   # placeholders: unread
    _rope_qk[(t,)](q, k, positions, inv_freq, q_norm, k_norm, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                   float(scaling), float(eps), QH=qh, KH=kh, HALF=half, BLOCK_H=triton.next_power_of_2(max(qh, kh)),
                   BLOCK_HALF=triton.next_power_of_2(half), NORM=norms is not None)


# The cos/sin row stride is D/2, but D when one session moves (a one-row slice is already contiguous). Where
# D/2 is not a multiple of 16 (head_dim 16 in the test checkpoints) Triton's divisibility specialisation made
# those two kernels, and the first single-session rebase compiled the second mid-tick.
@triton.jit(do_not_specialize=["stride_row"])
def _rerotate_keys(K, SLOTS, ROWS, COS, SIN, stride_ks, stride_kh, stride_row,
                   KH: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t)
    row = tl.load(ROWS + t)
    offs = tl.arange(0, BLOCK_HALF)
    fmask = offs < HALF
    cos = tl.load(COS + row * stride_row + offs, mask=fmask, other=0.0)
    sin = tl.load(SIN + row * stride_row + offs, mask=fmask, other=0.0)
    heads = tl.arange(0, BLOCK_H)
    hmask = (heads < KH)[:, None] & fmask[None, :]
    _rotate_in_place(K + slot * stride_ks + heads[:, None] * stride_kh + offs[None, :], cos, sin, hmask, HALF)


def rerotate_keys_(k_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> None:
    """Rotate the stored keys at flat cache ``slots`` [T] in place, key ``i`` by table row ``rows[i]``.

    ``k_cache`` is [blocks, block_size, KH, D] (or already flat [slots, KH, D]); ``cos``/``sin`` are
    [R, D/2] float32 (one row per moving session: ``Rotary.shift_tables`` halves). Rebasing a session's
    window is this rotation by ``-delta``. One read and one write of each key, where the eager gather,
    rotate and scatter make several passes over float32 copies (docs/benchmarks/gpu.md#served-tick-and-capacity).
    """
    kh, d = k_cache.shape[-2:]
    flat = k_cache.view(-1, kh, d)
    t = slots.numel()
    if t == 0:
        return
    if flat.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
        raise ValueError("the cache's last dimension and the cos/sin rows must be contiguous")
    half = d // 2
    _rerotate_keys[(t,)](flat, slots, rows, cos, sin, flat.stride(0), flat.stride(1), cos.stride(0),
                         KH=kh, HALF=half, BLOCK_H=triton.next_power_of_2(kh),
                         BLOCK_HALF=triton.next_power_of_2(half))
