"""A Llama-family decoder's decode round on the CPU as direct calls to the C kernels.

A decode round runs a dozen steps in each layer on a few rows. Through the modules each step pays for
``nn.Module``'s call, its wrapper's checks and a fresh output: about half a millisecond a layer and a round on a
2-core AVX2 VM (docs/benchmarks/cpu.md, "The decode round in direct calls"). What those
checks guard is fixed when the engine loads the model (the layers' kinds and weights, the kernels handed out) or
when the round is planned (the rows, the window's buffers), so ``DirectDecodeRound.build`` checks it once and a
round's steps are plain calls: the C kernels' norms, rotary embedding and SiLU, the products each layer kind
offers without its module call, and the window's ``attend_qkv``. The steps are the modules' own, in their
order, so the hidden states are the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from metronome.attention.cpu_kernel import DTYPES
from metronome.attention.decode_window import DecodeRoundPlan, DecodeWindow
from metronome.models.cpu_linear import KERNEL_MAX_ROWS, KernelLinear, PackedLinear
from metronome.models.llama import MLP, DecoderLayer, LlamaFamilyForCausalLM, RMSNorm, RopeInputs
from metronome.native import NativeLibrary

Product = Callable[[torch.Tensor], torch.Tensor]


def direct_product(linear: nn.Module, library: NativeLibrary) -> Product:
    """``linear``'s product of contiguous 2-D rows without the module call: the C kernel's for float32 weights
    (up to ``KERNEL_MAX_ROWS`` rows, as ``KernelLinear``), oneDNN's packed product, else the layer's ``forward``."""
    if isinstance(linear, KernelLinear) and linear.in_features % library.vector_width == 0:
        weight, bias, cdll = linear.weight, linear.bias, library.cdll

        def kernel_rows(x: torch.Tensor) -> torch.Tensor:
            rows = x.shape[0]
            if rows > KERNEL_MAX_ROWS:
                return F.linear(x, weight, bias)
            out = torch.empty((rows, linear.out_features), dtype=torch.float32)
            if cdll.metronome_skinny_linear(rows, linear.out_features, linear.in_features, x.data_ptr(), x.stride(0),
                                            weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                            out.data_ptr(), linear.out_features, torch.get_num_threads()):
                raise ValueError(f"the C product refused input width {linear.in_features}")
            return out

        return kernel_rows
    if isinstance(linear, PackedLinear):
        packed_product = torch.ops.mkldnn._linear_pointwise.default
        return lambda x: packed_product(x, linear.packed, linear.bias, "none", [], "")
    return linear.forward


def _takes(layer: nn.Module, dtype: torch.dtype) -> bool:
    """A dense Llama-family layer whose every step has its direct call: fused projections, no q/k norms, the
    elementwise steps handed to the C kernels (``cpu_ops``), norms of the model's dtype (float32 or bfloat16)."""
    if type(layer) is not DecoderLayer or type(layer.mlp) is not MLP:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if attn.qk_norm or not hasattr(attn, "qkv_proj") or not hasattr(mlp, "gate_up_proj"):
        return False
    if any(type(n) is not RMSNorm or n.cpu_ops is None or n.weight.dtype != dtype or not n.weight.is_contiguous()
           for n in norms):
        return False
    return attn.cpu_ops is not None and mlp.cpu_ops is not None and attn.head_dim % 2 == 0


@dataclass(frozen=True)
class DirectLayer:
    """One layer's steps as direct calls (its modules, held for their weights)."""

    layer: DecoderLayer
    qkv: Product
    o: Product
    gate_up: Product
    down: Product


class DirectDecodeRound:
    """``model(embeds, positions, kv_caches, window, plan)`` for a decode round's ``DecodeRoundPlan``, in direct
    calls; ``build`` says whether the model's layers allow it."""

    def __init__(self, model: LlamaFamilyForCausalLM, library: NativeLibrary, layers: list[DirectLayer],
                 dtype: torch.dtype) -> None:
        self.model, self.layers, self.dtype = model, layers, dtype
        self.cdll = library.cdll
        self.dtype_code = DTYPES[dtype]

    @classmethod
    def build(cls, model: nn.Module, library: NativeLibrary | None) -> DirectDecodeRound | None:
        """The direct round for ``model`` on the CPU, or None where a layer or the final norm has a step with no
        direct call (other layer kinds, q/k norms, elementwise steps left to torch, other dtypes), or without
        the C kernels."""
        if library is None or type(model) is not LlamaFamilyForCausalLM or model.rotary is None:
            return None
        norm = model.model.norm
        dtype = norm.weight.dtype
        if (dtype not in DTYPES or norm.cpu_ops is None or not norm.weight.is_contiguous()
                or not all(_takes(layer, dtype) for layer in model.model.layers)):
            return None
        layers = [DirectLayer(layer, *(direct_product(p, library) for p in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)))
            for layer in model.model.layers]
        return cls(model, library, layers, dtype)

    def takes(self, embeds: torch.Tensor, window: object, plan: object) -> bool:
        """Whether this round's operands are the ones the direct calls were built for."""
        return (isinstance(plan, DecodeRoundPlan) and isinstance(window, DecodeWindow) and window.kernel is not None
                and embeds.dtype == self.dtype and embeds.is_cpu and embeds.dim() == 2 and embeds.is_contiguous())

    def __call__(self, embeds: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]],
                 window: DecodeWindow, plan: DecodeRoundPlan) -> torch.Tensor:
        if not self.takes(embeds, window, plan):
            return self.model(embeds, positions, kv_caches, window, plan)
        rope = RopeInputs.at(positions, self.model.rotary)
        cos, sin = rope.cos.contiguous(), rope.sin.contiguous()
        threads = torch.get_num_threads()
        x = embeds
        for direct, kv in zip(self.layers, kv_caches):
            x = self._layer(direct, x, cos, sin, kv, window, plan, threads)
        return self._norm(self.model.model.norm, x, threads)

    def _norm(self, norm: RMSNorm, x: torch.Tensor, threads: int) -> torch.Tensor:
        rows, dim = x.shape
        out = torch.empty((rows, dim), dtype=x.dtype)
        self.cdll.metronome_rms_norm(rows, dim, self.dtype_code, x.data_ptr(), dim, norm.weight.data_ptr(), norm.eps,
                                     out.data_ptr(), dim, threads)
        return out

    def _rows(self, y: torch.Tensor) -> torch.Tensor:
        """A product's output as the C kernels read it: rows of the model's dtype, each contiguous."""
        if y.dtype != self.dtype or y.dim() != 2:
            raise TypeError(f"a decode round's product gave {y.dtype} rows of {y.dim()} dims, not {self.dtype} 2-D")
        return y if y.stride(1) == 1 else y.contiguous()

    def _layer(self, direct: DirectLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kv: tuple[torch.Tensor, ...], window: DecodeWindow, plan: DecodeRoundPlan, threads: int) -> torch.Tensor:
        """``DecoderLayer.forward``'s steps, in its order."""
        layer, attn = direct.layer, direct.layer.self_attn
        rows, d = x.shape[0], attn.head_dim
        qkv = self._rows(direct.qkv(self._norm(layer.input_layernorm, x, threads)))
        row_stride, q_rows = qkv.stride(0), qkv.data_ptr()
        k_rows = q_rows + attn.num_heads * d * qkv.element_size()
        for heads, at in ((attn.num_heads, q_rows), (attn.num_kv_heads, k_rows)):
            self.cdll.metronome_rope(rows, heads, d, self.dtype_code, at, row_stride, d, cos.data_ptr(),
                                     sin.data_ptr(), threads)
        x = x + direct.o(window.attend_qkv(qkv, kv, plan))
        gate_up = self._rows(direct.gate_up(self._norm(layer.post_attention_layernorm, x, threads)))
        inter = gate_up.shape[1] // 2
        act = torch.empty((rows, inter), dtype=x.dtype)
        self.cdll.metronome_silu_mul(rows, inter, self.dtype_code, gate_up.data_ptr(), gate_up.stride(0),
                                     act.data_ptr(), inter, threads)
        return x + direct.down(act)
