"""FP8 (E4M3) weights: quantisation, the FP8 linear layer, and the FP8 checkpoint layout.

A weight [N, K] is held as E4M3 codes with float32 scales [N, G], ``w = codes * scale``: one scale per output
channel (G = 1), or one per row and group of ``group`` columns (G = ceil(K / group)). Every layout of the
vLLM / Hugging Face FP8 checkpoints maps onto it exactly: a per-tensor ``weight_scale`` repeats down the
rows, a per-channel one is a column, and a block-wise ``weight_scale_inv`` [ceil(N / bn), ceil(K / bk)] repeats
each block row bn times. Scales by row make fused projections (q/k/v, gate/up, stacked experts) a
concatenation, wherever their block edges fall.

Products: on CUDA (compute capability >= 8.9, which E4M3 in Triton needs) a per-channel weight times a few rows
(``STREAMED_MAX_ROWS``: decode rounds at small N) runs the weight-streaming Triton product
(``fp8_triton.fp8_weight_linear``): with bf16 activations the rows are quantised per token and multiplied on the
FP8 tensor cores where that pays (wide layers, or more than ``WIDENED_MAX_ROWS`` rows), else the codes are widened
in registers. More rows, with FP8 tensor cores and bf16 activations, have their activations quantised per token
on the fly and run the tiled Triton product up to ``TILED_MAX_ROWS`` (``fp8_tiled_triton.fp8_tiled_linear``, on
Hopper), cuBLAS (``torch._scaled_mm``) above; a block-wise weight is rescaled per channel once loaded
there (``per_channel_for_tensor_cores_``: one more E4M3 rounding). On the CPU a per-channel layer of float32 or
bf16 rows multiplies through Metronome's C kernel (``cpu_linear.E4m3Product``, given by ``use_cpu_kernel_``),
reading the codes and accumulating exact products in float32. Elsewhere the weight is dequantised to the
activations' dtype for each product; either way the layer computes with the dequantised weight.
Stacked MoE experts keep block scales everywhere (their grouped GEMM applies them).

>>> w = torch.tensor([[1.0, -0.5, 0.26], [100.0, 3.0, -7.0]])
>>> codes, scale = quantize(w)             # one scale per row: its largest magnitude maps to 448
>>> (scale * 448).flatten().tolist()
[1.0, 100.0]
>>> [[round(x, 3) for x in row] for row in dequantize(codes, scale, group=3).tolist()]
[[1.0, -0.5, 0.268], [100.0, 2.902, -7.143]]
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from metronome.attention.fp8 import E4M3, E4M3_MAX, to_e4m3
from metronome.errors import ConfigError, ModelLoadError
from metronome.models.cpu_linear import E4m3Product, from_pair_layout
from metronome.native import NativeLibrary

# Tensors an FP8 checkpoint stores beside its weights that are not weights: scales, and the static activation
# and KV scales of checkpoints calibrated for them (activations are scaled per token here, the KV per head).
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
UNUSED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")
# Smallest activation amax a row is scaled by (an all-zero row must not divide by zero).
ACTIVATION_AMAX_FLOOR = 1e-12
# Up to this many rows (a decode round's layer inputs at small N) a per-channel FP8 layer on CUDA runs the
# weight-streaming Triton product (``fp8_triton.fp8_weight_linear``); above, the tiled product or cuBLAS's FP8
# GEMM (``TILED_MAX_ROWS``). Within it, activations stay bf16 (the codes widened in registers) up to
# ``WIDENED_MAX_ROWS`` rows unless the layer is wide (outputs >= 2x inputs): for a narrow layer the E4M3 path's
# extra quantising launch costs more than the widening saves. Measured on an H200 (docs/benchmarks/gpu.md).
STREAMED_MAX_ROWS = 64
WIDENED_MAX_ROWS = 32
# Past the streamed range and up to this many rows, the tiled Triton product (``fp8_tiled_triton``) where the GPU
# is a Hopper or later (its tiles were sized for 228 KB of shared memory an SM; Ada has 100 KB): cuBLAS's FP8 GEMM
# there leaves SMs idle on narrow layers. Measured on an H200 (docs/benchmarks/gpu.md).
TILED_MAX_ROWS = 192


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize(w: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes of ``w`` [..., N, K] and float32 scales [..., N, G]: each row's (or row group's) largest
    magnitude maps to 448. ``group=None``: one scale per row."""
    k = w.shape[-1]
    group = group or k
    groups = _cdiv(k, group)
    wf = F.pad(w.float(), (0, groups * group - k)).unflatten(-1, (groups, group))
    amax = wf.abs().amax(-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return to_e4m3(wf, scale[..., None]).flatten(-2)[..., :k].contiguous(), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, group: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes * scale`` [..., N, K] in ``dtype`` (computed in float32): scales [..., N, G] of ``group`` columns."""
    if scale.shape[-1] > 1:
        scale = scale.repeat_interleave(group, dim=-1)[..., :codes.shape[-1]]
    return (codes.float() * scale).to(dtype)


def scaled_mm_available(device: torch.device) -> bool:
    """FP8 tensor cores: CUDA with compute capability >= 8.9 (Ada, Hopper and later)."""
    return device.type == "cuda" and _device_capability(device) >= (8, 9)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _device_capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability (the current device where ``device`` names no index)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def check_fp8_device(device: torch.device) -> None:
    """Refuse FP8 weights or KV on a GPU below compute capability 8.9: Triton has no E4M3 type there, so the
    first decode round's kernels would fail to compile. The CPU dequantises and takes them."""
    if device.type == "cuda" and not scaled_mm_available(device):
        major, minor = _device_capability(device)
        raise ConfigError(f"FP8 weights and KV need a GPU of compute capability 8.9 or later (Ada, Hopper); this "
                          f"one is {major}.{minor}: run without --quantization fp8 and --kv-cache-dtype fp8")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (row) dynamic quantisation of activations [M, K]: E4M3 codes and float32 scales [M, 1]
    (on CUDA one Triton kernel, ``models/fp8_triton.py``)."""
    if x.is_cuda:
        from metronome.models.fp8_triton import quantize_rows_triton

        return quantize_rows_triton(x, ACTIVATION_AMAX_FLOOR)
    scale = x.abs().amax(-1, keepdim=True).float().clamp_(min=ACTIVATION_AMAX_FLOOR) / E4M3_MAX
    return to_e4m3(x, scale), scale


@dataclass(frozen=True)
class QuantizedRows:
    """Activation rows already on the E4M3 grid, one scale a row, as ``quantize_rows`` makes them: written by a
    kernel that produces the rows and quantises them in the same pass (the fused RMSNorm, SwiGLU) for a layer
    that takes E4M3 rows (``takes_e4m3_rows``). ``dtype``: the activations' own dtype, the product's output dtype.
    ``values``: the rows themselves in ``dtype``, where the layer also reads them unrounded (a MoE block's
    router)."""

    codes: torch.Tensor   # [M, K] E4M3
    scale: torch.Tensor   # [M, 1] float32
    dtype: torch.dtype
    values: torch.Tensor | None = None   # [M, K] in dtype

    def dequantized(self) -> torch.Tensor:
        return (self.codes.float() * self.scale).to(self.dtype)

    def rows(self) -> torch.Tensor:
        """The rows in ``dtype``: ``values`` where the kernel kept them, else the codes dequantised."""
        return self.dequantized() if self.values is None else self.values


def fp8_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (codes * scale).T`` on the FP8 tensor cores: x [M, K] bf16, codes [N, K], per-channel scale [N, 1]."""
    return e4m3_matmul(*quantize_rows(x), codes, scale, x.dtype)


def e4m3_matmul(xq: torch.Tensor, x_scale: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS's FP8 GEMM of E4M3 rows [M, K] (scales [M, 1]) and E4M3 codes [N, K] (per-channel scales [N, 1])."""
    if xq.shape[0] == 0:
        return torch.empty((0, codes.shape[0]), dtype=out_dtype, device=xq.device)
    return torch._scaled_mm(xq, codes.t(), scale_a=x_scale, scale_b=scale.t(), out_dtype=out_dtype)


def warpgroup_mma_available(device: torch.device) -> bool:
    """Hopper's warpgroup MMA and its 227 KiB of shared memory a block, which the tiled FP8 product and the experts'
    E4M3 tiles are built for: CUDA with compute capability 9.x. Blackwell multiplies otherwise, and its consumer
    parts give a block 99 KiB, so those tiles stay on Hopper."""
    return device.type == "cuda" and _device_capability(device)[0] == 9


def tensor_core_dims(in_features: int, out_features: int) -> bool:
    """Whether a layer's products past the streamed range can run on the FP8 tensor cores (else dequantised)."""
    return in_features % 16 == 0 and out_features % 16 == 0


class Product(str, Enum):
    """How an FP8 layer multiplies (``choose_product``)."""

    STREAMED_W8A16 = "streamed-w8a16"   # the Triton product, the codes widened to the activations' dtype
    STREAMED_W8A8 = "streamed-w8a8"     # the Triton product, the rows rounded onto E4M3 (FP8 tensor cores)
    TILED_W8A8 = "tiled-w8a8"           # the tiled Triton product, the rows rounded onto E4M3
    SCALED_MM = "scaled-mm"             # cuBLAS's FP8 GEMM, the rows rounded onto E4M3
    CPU_KERNEL = "cpu-kernel"           # Metronome's C kernel on the CPU, the codes widened (cpu_linear.E4m3Product)
    DEQUANTIZED = "dequantized"         # the weight dequantised for an ordinary product


def choose_product(rows: int, in_features: int, out_features: int, dtype: torch.dtype, *, cuda: bool,
                   per_channel: bool, fp8_tensor_cores: bool, tiled: bool = False) -> Product:
    """How an FP8 layer multiplies ``rows`` rows; ``tiled``: the GPU runs the tiled product
    (``warpgroup_mma_available``)."""
    if cuda and per_channel and fp8_tensor_cores and rows <= STREAMED_MAX_ROWS:
        wide = out_features >= 2 * in_features
        if dtype == torch.bfloat16 and (rows > WIDENED_MAX_ROWS or wide):
            return Product.STREAMED_W8A8
        return Product.STREAMED_W8A16
    if (cuda and per_channel and fp8_tensor_cores and dtype == torch.bfloat16
            and tensor_core_dims(in_features, out_features)):
        return Product.TILED_W8A8 if tiled and rows <= TILED_MAX_ROWS else Product.SCALED_MM
    return Product.DEQUANTIZED


# The products that multiply E4M3 rows: a layer whose product is one of them takes ``QuantizedRows``.
E4M3_ROW_PRODUCTS = (Product.STREAMED_W8A8, Product.TILED_W8A8, Product.SCALED_MM)


class TakesE4m3Rows:
    """A layer that may be handed its input as ``QuantizedRows`` (``Fp8Linear``, a MoE block of E4M3 experts);
    ``reads_values``: it reads the rows unrounded as well, so they come in ``QuantizedRows.values``. A base class,
    not a runtime-checked protocol: the check runs for every layer of an eager forward."""

    reads_values = False

    def takes_e4m3_rows(self, rows: int, dtype: torch.dtype) -> bool:
        raise NotImplementedError


def takes_e4m3_rows(layer: nn.Module | None, rows: int, dtype: torch.dtype) -> bool:
    """Whether ``layer`` multiplies ``rows`` rows of ``dtype`` as E4M3 rows (so a kernel that writes its input
    may quantise them there, in one pass, ``QuantizedRows``)."""
    return isinstance(layer, TakesE4m3Rows) and layer.takes_e4m3_rows(rows, dtype)


class Fp8Linear(TakesE4m3Rows, nn.Module):
    """A linear layer of E4M3 codes [N, K] and float32 scales [N, G] (buffers) and an optional bias."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, group: int, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        if scale.shape != (self.out_features, _cdiv(self.in_features, group)):
            raise ValueError(f"scales {tuple(scale.shape)} do not fit {tuple(codes.shape)} in groups of {group}")
        self.group = group if scale.shape[1] > 1 else self.in_features
        self.register_buffer("weight", codes.contiguous())
        self.register_buffer("weight_scale", scale.float().contiguous())
        self.bias = bias
        self.cpu_product: E4m3Product | None = None   # the C kernel's product on the CPU (use_cpu_kernel_)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int | None = None) -> "Fp8Linear":
        """Quantise a float layer: one scale per output channel, or per ``group`` columns of each row."""
        codes, scale = quantize(linear.weight.detach(), group)
        return cls(codes, scale, group or linear.in_features, linear.bias)

    @classmethod
    def concat(cls, parts: list[nn.Module]) -> "Fp8Linear":
        """One layer whose output is the concatenation of ``parts``' outputs (float parts are quantised)."""
        groups = {p.group for p in parts if isinstance(p, Fp8Linear) and p.weight_scale.shape[1] > 1}
        if len(groups) > 1:
            raise ValueError(f"cannot fuse FP8 layers of different scale groups {sorted(groups)}")
        group = groups.pop() if groups else None
        parts = [p if isinstance(p, Fp8Linear) else cls.from_linear(p, group) for p in parts]
        width = max(p.weight_scale.shape[1] for p in parts)
        scale = torch.cat([p.weight_scale.expand(-1, width) for p in parts])  # a row's one scale fills its groups
        bias = None
        if parts[0].bias is not None:
            bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
        return cls(torch.cat([p.codes() for p in parts]), scale, group or parts[0].in_features, bias)

    @property
    def tensor_cores(self) -> bool:
        """Whether the products past the streamed range run on the FP8 tensor cores: one scale per output channel,
        dimensions that are multiples of 16, a device that has them."""
        return (self.weight.is_cuda and self.weight_scale.shape[1] == 1 and tensor_core_dims(self.in_features,
                self.out_features) and scaled_mm_available(self.weight.device))

    def codes(self) -> torch.Tensor:
        """The E4M3 codes [N, K], row-major (``weight`` holds them in the C kernel's layout where it reads another)."""
        if self.cpu_product is not None and self.cpu_product.pairs:
            return from_pair_layout(self.weight)
        return self.weight

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.codes(), self.weight_scale, self.group, dtype)

    def use_cpu_kernel_(self, product: E4m3Product | None) -> None:
        """Multiply through ``product`` (the C kernel on the CPU), the codes stored in the layout it reads; None:
        row-major codes again, and the products of the layer's device."""
        codes = self.codes()
        self.cpu_product = product
        self.weight = codes if product is None else product.stored(codes)

    def _apply(self, fn, recurse=True):
        # Moved or cast, the layer leaves the C kernel first: its codes go row-major, as every other product reads.
        self.use_cpu_kernel_(None)
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self.use_cpu_kernel_(None)     # a state dict holds row-major codes
        return super()._load_from_state_dict(*args, **kwargs)

    def product(self, rows: int, dtype: torch.dtype) -> Product:
        """How this layer multiplies ``rows`` rows of ``dtype``."""
        if self.cpu_product is not None and dtype == self.cpu_product.dtype:
            return Product.CPU_KERNEL
        cuda = self.weight.is_cuda
        return choose_product(rows, self.in_features, self.out_features, dtype, cuda=cuda,
                              per_channel=self.weight_scale.shape[1] == 1,
                              fp8_tensor_cores=cuda and scaled_mm_available(self.weight.device),
                              tiled=cuda and warpgroup_mma_available(self.weight.device))

    def takes_e4m3_rows(self, rows: int, dtype: torch.dtype) -> bool:
        """TakesE4m3Rows: whether ``rows`` rows of ``dtype`` multiply as E4M3 rows here."""
        return self.product(rows, dtype) in E4M3_ROW_PRODUCTS

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        cpu = self.cpu_product
        if (cpu is not None and type(x) is torch.Tensor and x.dtype == cpu.dtype
                and not (torch.is_grad_enabled() and (x.requires_grad or (self.bias is not None
                                                                          and self.bias.requires_grad)))):
            # Product.CPU_KERNEL, first: a decode round makes hundreds of these calls of a few rows each
            if x.dim() == 2:
                return cpu(x, self.weight, self.weight_scale, self.bias)
            out = cpu(x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.bias)
            return out.reshape(*x.shape[:-1], self.out_features)
        if isinstance(x, QuantizedRows):
            product = self.product(x.codes.shape[0], x.dtype)
            if product not in E4M3_ROW_PRODUCTS:   # lossy: the rows keep their E4M3 rounding
                return self.forward(x.dequantized())
            return self._e4m3_product(product, x.codes, x.scale, x.dtype)
        rows = x.reshape(-1, self.in_features)
        product = self.product(rows.shape[0], x.dtype)
        if product == Product.STREAMED_W8A16:
            from metronome.models.fp8_triton import fp8_weight_linear

            out = fp8_weight_linear(rows, self.weight, self.weight_scale, self.bias, out_dtype=x.dtype)
        elif product in E4M3_ROW_PRODUCTS:
            out = self._e4m3_product(product, *quantize_rows(rows), x.dtype)
        else:   # Product.DEQUANTIZED, and the CPU kernel's rows under autograd
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _e4m3_product(self, product: Product, codes: torch.Tensor, x_scale: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
        """E4M3 rows [M, K] with their scales [M, 1] times this layer's weight, plus its bias: [M, N] in ``dtype``."""
        if product == Product.STREAMED_W8A8:
            from metronome.models.fp8_triton import fp8_weight_linear

            return fp8_weight_linear(codes, self.weight, self.weight_scale, self.bias, x_scale=x_scale,
                                     out_dtype=dtype)
        if product == Product.TILED_W8A8:
            from metronome.models.fp8_tiled_triton import fp8_tiled_linear

            return fp8_tiled_linear(codes, x_scale, self.weight, self.weight_scale, self.bias, out_dtype=dtype)
        out = e4m3_matmul(codes, x_scale, self.weight, self.weight_scale, dtype)
        return out if self.bias is None else out.add_(self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}"


@dataclass(frozen=True)
class ExpertScales:
    """Scales of stacked E4M3 expert weights: ``gate_up`` [E, 2I, G1], ``down`` [E, H, G2], and the columns each
    scale covers (the row's whole width when G is 1)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_group: int
    down_group: int


# ------------------------------------------------------------------------------------------ checkpoints
def row_scales(stored: torch.Tensor, n: int, k: int, block: tuple[int, int] | None) -> tuple[torch.Tensor, int]:
    """A checkpoint's scale tensor for an [N, K] weight as float32 scales [N, G] and the columns G covers:
    per tensor (one value), per channel ([N] or [N, 1]) or per ``block`` = (bn, bk) ([ceil(N/bn), ceil(K/bk)])."""
    stored = stored.float()
    if stored.numel() == 1:
        return stored.reshape(1, 1).expand(n, 1).contiguous(), k
    if tuple(stored.shape) in ((n,), (n, 1)):
        return stored.reshape(n, 1).contiguous(), k
    if block is not None and tuple(stored.shape) == (_cdiv(n, block[0]), _cdiv(k, block[1])):
        return stored.repeat_interleave(block[0], dim=0)[:n].contiguous(), block[1]
    raise ModelLoadError(f"an FP8 scale of shape {tuple(stored.shape)} fits neither a tensor, a channel nor a "
                         f"block ({block}) of a [{n}, {k}] weight")


@dataclass(frozen=True)
class Fp8Checkpoint:
    """What an FP8 checkpoint (``quantization_config.quant_method == "fp8"``) stores beside its weights:
    each quantised weight's scale tensor (by the weight's stored name) and the block shape of block scales."""

    scales: dict[str, torch.Tensor]
    block: tuple[int, int] | None

    @classmethod
    def read(cls, config: dict, files: list[Path]) -> "Fp8Checkpoint | None":
        """The scales of an FP8 checkpoint; None for any other checkpoint."""
        quant = config.get("quantization_config") or {}
        if quant.get("quant_method") != "fp8":
            return None
        block = quant.get("weight_block_size")
        scales = {}
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for stored in f.keys():
                    if stored.endswith(SCALE_SUFFIXES):
                        scales[stored.rpartition(".")[0] + ".weight"] = f.get_tensor(stored)
        return cls(scales, tuple(block) if block else None)

    @staticmethod
    def is_extra(stored: str) -> bool:
        """A tensor that is not a weight: a scale (read with its weight) or an unused static scale."""
        return stored.endswith(SCALE_SUFFIXES + UNUSED_SUFFIXES)

    def install(self, net: nn.Module, name: str, stored: str, codes: torch.Tensor) -> None:
        """Put the E4M3 weight ``codes`` stored as ``stored`` into ``net``'s parameter ``name``: a linear layer of
        the decoder's layers becomes an ``Fp8Linear``; anything else (an LM head) takes the dequantised weight."""
        if stored not in self.scales:
            raise ModelLoadError(f"{stored} is stored as FP8 without a weight_scale or weight_scale_inv beside it")
        path = name.removesuffix(".weight")
        module = net.get_submodule(path)
        scale, group = row_scales(self.scales[stored], *codes.shape, self.block)
        if isinstance(module, nn.Linear) and ".layers." in f".{path}":
            device = module.weight.device
            _replace(net, path, Fp8Linear(codes.to(device), scale.to(device), group, module.bias))
            return
        param = net.get_parameter(name)
        with torch.no_grad():
            param.copy_(dequantize(codes, scale, group, param.dtype))


def _replace(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def per_channel_for_tensor_cores_(net: nn.Module) -> nn.Module:
    """On a device with FP8 tensor cores, rescale every block-scaled ``Fp8Linear`` of ``net`` per output channel
    (in place; the tensor-core product takes one scale per channel). Elsewhere nothing changes."""
    for path, module in list(net.named_modules()):
        if isinstance(module, Fp8Linear) and module.weight_scale.shape[1] > 1 and scaled_mm_available(
                module.weight.device):
            codes, scale = quantize(module.dequantized())
            _replace(net, path, Fp8Linear(codes, scale, module.in_features, module.bias))
    return net


def quantize_linears_(module: nn.Module, skip: Callable[[str, nn.Linear], bool] | None = None) -> list[Fp8Linear]:
    """Swap every ``nn.Linear`` of ``module`` for an ``Fp8Linear`` (per-channel scales), in place, except those
    ``skip(path, layer)`` holds for; returns the layers swapped in. Layers already in FP8 are left alone."""
    swapped = []
    for path, linear in list(module.named_modules()):
        if isinstance(linear, nn.Linear) and not (skip and skip(path, linear)):
            swapped.append(Fp8Linear.from_linear(linear))
            _replace(module, path, swapped[-1])
    return swapped


def use_cpu_kernel_(layers: nn.Module, library: NativeLibrary | None, dtype: torch.dtype) -> int:
    """Give every ``Fp8Linear`` under ``layers`` the C kernel's product for rows of ``dtype`` where the kernel takes
    the layer (``E4m3Product.for_layer``); ``library=None`` takes it from every one. Returns how many have it."""
    count = 0
    for layer in layers.modules():
        if isinstance(layer, Fp8Linear):
            layer.use_cpu_kernel_(None)
            product = None if library is None else E4m3Product.for_layer(layer.weight, layer.weight_scale, dtype,
                                                                         library)
            layer.use_cpu_kernel_(product)
            count += product is not None
    return count


def quantize_decoder_(net: nn.Module) -> nn.Module:
    """Swap every linear layer of ``net.model.layers`` for an ``Fp8Linear`` (per-channel scales) and quantise the
    stacked MoE experts (``quantize_fp8_``), in place. Embeddings, norms, the LM head and MoE routers stay as
    they are (small, and the router's choices are sensitive). Layers already in FP8 are left alone."""
    quantize_layers_(net.model.layers)
    return net


def quantize_layers_(layers: nn.Module) -> nn.Module:
    """``quantize_decoder_`` for decoder layers alone: a ``ModuleList`` of them, or one."""
    routers = {id(m.gate) for m in layers.modules()
               if hasattr(m, "experts") and isinstance(getattr(m, "gate", None), nn.Linear)}
    quantize_linears_(layers, skip=lambda _, linear: id(linear) in routers)
    for module in layers.modules():
        if hasattr(module, "quantize_fp8_"):
            module.quantize_fp8_()
    return layers
