"""Decoder linear layers with their weights packed once for oneDNN, for matrix products on a CPU.

On a CPU, aten's ``F.linear`` hands oneDNN (bf16) or the BLAS (float32) a plain row-major weight, and a bf16
product reorders it into oneDNN's blocked layout on every call. A decode round is hundreds of products of a few
rows each, so that per-call work is paid per row. Packing each weight once at load (what inductor's weight
freezing does) leaves each call only the product.

oneDNN packs float32 everywhere and bfloat16 only where the CPU has the instructions for it (AVX512-BF16, AMX,
AVX-NE-CONVERT); ``packable`` asks oneDNN itself rather than reading flags.
"""

from __future__ import annotations

import torch
from torch import nn

# The rows a decode round's products usually have; oneDNN picks its blocking for it, any row count still runs.
ROWS_HINT = 8


def packable(dtype: torch.dtype) -> bool:
    """Whether oneDNN on this CPU packs weights of ``dtype`` (it refuses bf16 without bf16 instructions)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), ROWS_HINT)
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Module):
    """``nn.Linear``'s product with the weight in oneDNN's packed layout; the plain weight is dropped."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears_(layers: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``layers`` by a ``PackedLinear`` in place; returns how many."""
    targets = [(parent, name, child) for parent in layers.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
