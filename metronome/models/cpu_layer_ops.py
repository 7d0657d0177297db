"""A decoder layer's elementwise steps through Metronome's C kernels on the CPU (``csrc/layer_ops.c``).

In a decode round RMSNorm, the rotary embedding and SiLU-times-up each work on a few rows, and torch runs them
as eight, nine (for q and for k each) and three operators, each dispatched for those few rows. Each is one call
here (docs/benchmarks/cpu.md has the ticks with and without). Results agree with torch's operators up to float32 rounding:
in bfloat16 the kernels round wherever torch would store a bfloat16 tensor between two operators.

Each method returns None (or False) where its kernel does not apply, and the caller keeps torch's path:
tensors off the CPU, a dtype other than float32 or bfloat16, mixed dtypes, layouts the kernel does not read,
or autograd. Everything the C reads is checked here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from metronome.attention.cpu_kernel import DTYPES
from metronome.native import NativeLibrary


def _plain(*tensors: torch.Tensor) -> bool:
    """CPU tensors of one dtype the kernels take, outside autograd. (Called for every norm of every layer of a
    decode round: plain loops, and the autograd check only when grad is on.)"""
    dtype = tensors[0].dtype
    if dtype not in DTYPES:
        return False
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu:
            return False
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


@dataclass(frozen=True)
class CpuLayerOps:
    library: NativeLibrary

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """``weight * (x / sqrt(mean(x²) + eps))`` over the last dim, as ``llama.RMSNorm`` computes it."""
        dim = x.shape[-1]
        if not _plain(x, weight) or weight.shape != (dim,) or not weight.is_contiguous() or x.numel() == 0:
            return None
        rows = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, dim)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape, dtype=x.dtype)
        self.library.cdll.metronome_rms_norm(rows.shape[0], dim, DTYPES[x.dtype], rows.data_ptr(), rows.stride(0),
                                             weight.data_ptr(), eps, out.data_ptr(), dim, torch.get_num_threads())
        return out if out.dim() == x.dim() else out.view(x.shape)

    def rope_qk_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Rotate ``q`` [T, heads, dim] and ``k`` [T, kv_heads, dim] in place by the float32 tables ``cos``/``sin``
        [T, dim], as ``Rotary.apply``; both or neither (False: neither was touched). ``q`` and ``k`` must not share
        elements (the fused projection's split gives disjoint views); each is rotated once."""
        tokens, dim = cos.shape
        if not (_plain(q, k) and q.dim() == k.dim() == 3 and q.shape[0] == k.shape[0] == tokens
                and q.shape[2] == k.shape[2] == dim and dim % 2 == 0
                and all(x.stride(2) == 1 and x.stride(1) >= dim and x.stride(0) >= x.shape[1] * x.stride(1)
                        for x in (q, k))   # rows apart: each is rotated once
                and cos.shape == sin.shape and cos.dtype == sin.dtype == torch.float32
                and cos.is_cpu and sin.is_cpu and cos.is_contiguous() and sin.is_contiguous()):
            return False
        for x in (q, k):
            self.library.cdll.metronome_rope(tokens, x.shape[1], dim, DTYPES[x.dtype], x.data_ptr(), x.stride(0),
                                             x.stride(1), cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())
        return True

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` for ``gate_up`` [..., 2 * dim] = (gate, up), as ``llama.MLP`` computes it."""
        dim = gate_up.shape[-1] // 2
        if not _plain(gate_up) or gate_up.shape[-1] % 2 or gate_up.numel() == 0:
            return None
        rows = gate_up if gate_up.dim() == 2 and gate_up.stride(-1) == 1 else gate_up.reshape(-1, 2 * dim)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], dim, dtype=gate_up.dtype)
        self.library.cdll.metronome_silu_mul(rows.shape[0], dim, DTYPES[gate_up.dtype], rows.data_ptr(),
                                             rows.stride(0), out.data_ptr(), dim, torch.get_num_threads())
        return out if gate_up.dim() == 2 else out.view(*gate_up.shape[:-1], dim)


def use_layer_ops_(model: nn.Module, ops: CpuLayerOps | None) -> int:
    """Hand ``ops`` to every module of ``model`` that takes them (a ``cpu_ops`` attribute); returns how many."""
    takers = [m for m in model.modules() if hasattr(m, "cpu_ops")]
    for module in takers:
        module.cpu_ops = ops
    return len(takers)
