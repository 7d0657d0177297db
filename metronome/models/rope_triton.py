"""RoPE for q and k in one Triton kernel (CUDA decode/prefill): rotate-half layout, in place.

The eager version costs ~7 small kernels per tensor per layer (casts, slices, cat, mul, add); inside a
captured decode round those dominate the elementwise time. One program handles one token: it computes
cos/sin of ``position * inv_freq`` in float32 and rotates every q and k head of that token.
Runs under ``TRITON_INTERPRET=1`` on the CPU (tests compare it with ``Rotary.apply``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_qk(Q, K, POS, INV_FREQ, stride_qt, stride_qh, stride_kt, stride_kh, scaling,
             QH: tl.constexpr, KH: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
             BLOCK_HALF: tl.constexpr):
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
            base, stride_t, stride_h, n = Q, stride_qt, stride_qh, QH
        else:
            base, stride_t, stride_h, n = K, stride_kt, stride_kh, KH
        hmask = (heads < n)[:, None] & fmask[None, :]
        ptr = base + t * stride_t + heads[:, None] * stride_h + offs[None, :]
        x1 = tl.load(ptr, mask=hmask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr + HALF, mask=hmask, other=0.0).to(tl.float32)
        tl.store(ptr, (x1 * cos[None, :] - x2 * sin[None, :]).to(base.dtype.element_ty), mask=hmask)
        tl.store(ptr + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(base.dtype.element_ty), mask=hmask)


def rope_qk_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
             scaling: float = 1.0) -> None:
    """Rotate ``q`` [T, QH, D] and ``k`` [T, KH, D] in place at ``positions`` [T] (last dim contiguous)."""
    t, qh, d = q.shape
    kh = k.shape[1]
    if t == 0:
        return
    half = d // 2
    _rope_qk[(t,)](q, k, positions, inv_freq, q.stride(0), q.stride(1), k.stride(0), k.stride(1), float(scaling),
                   QH=qh, KH=kh, HALF=half, BLOCK_H=triton.next_power_of_2(max(qh, kh)),
                   BLOCK_HALF=triton.next_power_of_2(half))
