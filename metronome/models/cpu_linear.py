"""Decoder linear layers for matrix products of a few rows on a CPU: bf16 weights packed once for oneDNN, and
float32 products through Metronome's C kernel.

On a CPU, aten's ``F.linear`` hands oneDNN (bf16) or the BLAS (float32) a plain row-major weight, and a bf16
product reorders it into oneDNN's blocked layout on every call. A decode round is hundreds of products of a few
rows each, so that per-call work is paid per row. Packing each weight once at load (what inductor's weight
freezing does) leaves each call only the product.

oneDNN packs float32 everywhere and bfloat16 only where the CPU has the instructions for it (AVX512-BF16, AMX,
AVX-NE-CONVERT); ``packable`` asks oneDNN itself rather than reading flags.

In float32 the BLAS (MKL) multiplies a few rows by a weight far below the core's rate (docs/benchmarks/cpu.md:
on an AVX2 machine the C kernel's ticks are a third to a half shorter). ``KernelLinear`` sends products of up to
``KERNEL_MAX_ROWS`` rows to ``csrc/skinny_linear.c`` (each weight read once, register-blocked), more rows
(a prefill) to ``F.linear``; ``skinny_linear`` is the same product for the logits.

FP8 (E4M3) weights, per output channel, multiply through ``csrc/e4m3_linear.c`` (``E4m3Product``), which reads
one byte a weight, half of bf16's. With bf16 rows on a CPU with AVX512-BF16 the codes are stored once in the
kernel's pair layout (16 output channels' codes for each 2 inputs side by side, what its pair products take);
elsewhere row-major, widened to float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from metronome.native import NativeLibrary

# The rows a decode round's products usually have; oneDNN picks its blocking for it, any row count still runs.
ROWS_HINT = 8
# The most rows the C kernel multiplies: a decode round's or a small prefill's; larger prefills go to the BLAS.
KERNEL_MAX_ROWS = 32


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
    """``F.linear(x, weight, bias)`` with ``weight`` [out, in] in oneDNN's packed layout (a copy: the caller drops
    the plain weight, or keeps it where something else reads it, as a tied embedding)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The decoder's packed tokens are 2-D already: no reshapes (four calls a layer a round).
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears_(layers: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``layers`` by a ``PackedLinear`` in place; returns how many."""
    targets = [(parent, name, child) for parent in layers.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child.weight, child.bias))
    return len(targets)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  library: NativeLibrary) -> torch.Tensor | None:
    """``x W^T (+ b)`` through the C kernel, or None where it does not apply (the caller takes another path):
    more than ``KERNEL_MAX_ROWS`` rows, anything but float32 CPU tensors with contiguous weight rows, an input
    width that is no multiple of the vector width, or autograd. Everything the C reads is checked here."""
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features)
    if (rows.shape[0] > KERNEL_MAX_ROWS or in_features % library.vector_width
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad)))
            or x.dtype != torch.float32 or weight.dtype != torch.float32 or not weight.is_contiguous()
            or x.device.type != "cpu" or weight.device.type != "cpu"
            or (bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"
                                      or not bias.is_contiguous() or bias.numel() != out_features))):
        return None
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32, device=rows.device)
    failed = library.cdll.metronome_skinny_linear(
        rows.shape[0], out_features, in_features, rows.data_ptr(), rows.stride(0), weight.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), torch.get_num_threads())
    if failed:
        raise ValueError(f"the C product refused input width {in_features} (vector width {library.vector_width})")
    return out.reshape(*x.shape[:-1], out_features)


class KernelLinear(nn.Module):
    """``nn.Linear`` whose products of few float32 rows go through the C kernel (``skinny_linear``), the rest
    through ``F.linear``. Keeps the layer's own parameters."""

    def __init__(self, linear: nn.Linear, library: NativeLibrary) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.library = library

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = skinny_linear(x, self.weight, self.bias, self.library)
        return F.linear(x, self.weight, self.bias) if out is None else out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def kernel_linears_(layers: nn.Module, library: NativeLibrary) -> int:
    """Replace every float32 ``nn.Linear`` under ``layers`` by a ``KernelLinear`` in place; returns how many."""
    targets = [(parent, name, child) for parent in layers.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.dtype == torch.float32]
    for parent, name, child in targets:
        setattr(parent, name, KernelLinear(child, library))
    return len(targets)


# Output channels of a group in the FP8 kernel's pair layout, and inputs of a pair.
PAIR_CHANNELS = 16
PAIR_INPUTS = 2


def to_pair_layout(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 codes [N, K] (N a multiple of 16, K of 2) in the pair layout: N / 16 groups of [K / 2][16][2]."""
    n, k = codes.shape
    return codes.view(n // PAIR_CHANNELS, PAIR_CHANNELS, k // PAIR_INPUTS, PAIR_INPUTS).permute(0, 2, 1, 3).contiguous()


def from_pair_layout(paired: torch.Tensor) -> torch.Tensor:
    """The codes [N, K] that ``to_pair_layout`` laid out as ``paired``."""
    groups, pairs, channels, inputs = paired.shape
    return paired.permute(0, 2, 1, 3).reshape(groups * channels, pairs * inputs)


@dataclass(frozen=True)
class E4m3Product:
    """How an FP8 layer multiplies rows of ``dtype`` (float32 or bfloat16) on the CPU through the C kernels:
    ``x (codes x scale)^T (+ bias)``, any number of rows, float32 sums rounded once to ``dtype``. The layer keeps
    its codes in the layout the kernel reads (``stored``): the pair layout where ``pairs``, else row-major.
    Build with ``for_layer``."""

    dtype: torch.dtype
    pairs: bool
    library: NativeLibrary

    @classmethod
    def for_layer(cls, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                  library: NativeLibrary) -> "E4m3Product | None":
        """The product for row-major E4M3 ``codes`` [N, K] with per-channel ``scale`` [N, 1], or None where the kernels
        do not take it (scales by group, a dtype other than float32 and bfloat16, an input width no multiple of the
        vector width, tensors off the CPU)."""
        n, k = codes.shape
        if (codes.device.type != "cpu" or scale.device.type != "cpu" or scale.shape != (n, 1)
                or dtype not in (torch.float32, torch.bfloat16) or k % library.vector_width):
            return None
        pairs = (dtype == torch.bfloat16 and bool(library.cdll.metronome_e4m3_pairs_available())
                 and n % PAIR_CHANNELS == 0 and k % PAIR_INPUTS == 0)
        return cls(dtype, pairs, library)

    def stored(self, codes: torch.Tensor) -> torch.Tensor:
        """Row-major codes [N, K] in the layout this product reads."""
        return to_pair_layout(codes) if self.pairs else codes.contiguous()

    def __call__(self, rows: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        """``rows`` [M, K] of ``dtype`` times the codes (``stored``), their per-channel ``scale`` [N, 1] (float32,
        contiguous) and ``bias`` [N]: [M, N] in ``dtype``."""
        if rows.dtype != self.dtype or not rows.is_cpu or not stored.is_cpu:
            raise ValueError(f"the C FP8 product takes {self.dtype} rows on the CPU, got {rows.dtype} on "
                             f"{rows.device} (codes on {stored.device})")
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        if bias is not None and bias.dtype != torch.float32:
            bias = bias.float()
        (count, in_features), out_features = rows.shape, scale.shape[0]
        out = torch.empty(count, out_features, dtype=self.dtype)
        bias_at = None if bias is None else bias.data_ptr()
        if self.pairs:
            failed = self.library.cdll.metronome_e4m3_linear_pairs(
                count, out_features, in_features, rows.data_ptr(), rows.stride(0), stored.data_ptr(),
                scale.data_ptr(), bias_at, out.data_ptr(), out_features, torch.get_num_threads())
        else:
            failed = self.library.cdll.metronome_e4m3_linear(
                count, out_features, in_features, int(self.dtype == torch.bfloat16), rows.data_ptr(),
                rows.stride(0), stored.data_ptr(), scale.data_ptr(), bias_at, out.data_ptr(), out_features,
                torch.get_num_threads())
        if failed:
            raise RuntimeError(f"the C FP8 product failed (code {failed}) for a [{out_features}, {in_features}] "
                               f"layer")
        return out
