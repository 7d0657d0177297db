"""Llama-family decoder (Llama, Qwen2, Qwen3) over the paged KV cache.

Tokens of all sequences in a forward are packed into one [T, hidden] batch (no padding); attention
goes through the backend with explicit metadata. Module names mirror transformers' so a Hugging
Face state dict loads as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from metronome.models.cpu_layer_ops import CpuLayerOps
from metronome.models.cpu_linear import skinny_linear
from metronome.models.fp8 import Fp8Linear, QuantizedRows, takes_e4m3_rows
from metronome.models.rope import Rotary
from metronome.models.spec import DecoderSpec
from metronome.native import NativeLibrary


class AttentionBackend(Protocol):
    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, plan: Any,
                 kv_scale: torch.Tensor | None = None) -> torch.Tensor: ...


def _fused_linear(parts: list[nn.Module]) -> nn.Module:
    """One Linear whose output is the concatenation of ``parts``' outputs (FP8 when any part is)."""
    if any(isinstance(p, Fp8Linear) for p in parts):
        return Fp8Linear.concat(parts)
    weight = torch.cat([p.weight for p in parts], 0)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=parts[0].bias is not None,
                      device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(weight)
        if parts[0].bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts], 0))
    return fused.requires_grad_(False)


@dataclass(frozen=True)
class RopeInputs:
    """What every layer needs to rotate q and k: the positions, and cos/sin tables on the eager path."""

    positions: torch.Tensor
    rotary: Rotary
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    @classmethod
    def at(cls, positions: torch.Tensor, rotary: Rotary) -> "RopeInputs":
        """On CUDA the fused Triton RoPE computes its angles in the kernel; elsewhere cos/sin tables."""
        if positions.is_cuda:
            return cls(positions, rotary)
        return cls(positions, rotary, *rotary.cos_sin(positions))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.cpu_ops: CpuLayerOps | None = None   # the C kernels, where the engine hands them out (CPU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one fused kernel instead of eight (they dominate a captured decode round's small ops)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if self.cpu_ops is not None and (out := self.cpu_ops.rms_norm(x, self.weight, self.eps)) is not None:
            return out
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                 into: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor | QuantizedRows]:
        """``(r, norm(r))`` for the residual ``r = x + delta`` (``x`` where ``delta`` is None), the norm as the
        layer ``into`` takes it: on CUDA one kernel adds, normalises and, where ``into`` multiplies E4M3 rows,
        quantises them (``rms_norm_triton``), instead of three launches."""
        if x.is_cuda and x.dim() == 2:
            from metronome.models.rms_norm_triton import add_rms_norm, fits

            if fits(x.shape[1]):
                quantize = takes_e4m3_rows(into, x.shape[0], x.dtype)
                return add_rms_norm(x, delta, self.weight, self.eps, quantize=quantize,
                                    values=quantize and into.reads_values)
        if delta is not None:
            x = x + delta
        return x, self(x)


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.q_proj = nn.Linear(spec.hidden_size, h * d, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(spec.hidden_size, kvh * d, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(spec.hidden_size, kvh * d, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(h * d, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.cpu_ops: CpuLayerOps | None = None

    def fuse(self) -> None:
        """Replace q/k/v by one projection after loading: one large matmul beats three small ones."""
        self.qkv_proj = _fused_linear([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor | QuantizedRows, rope: RopeInputs, kv: tuple[torch.Tensor, torch.Tensor],
                attention: AttentionBackend, plan: Any) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        t = qkv.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if rope.cos is None:   # CUDA: q/k norms (Qwen3) and RoPE in one pass over the projection's q and k
            from metronome.models.rope_triton import rope_qk_

            # Both norms take the spec's rms_norm_eps.
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
            rope_qk_(q, k, rope.positions, rope.rotary.inv_freq, rope.rotary.attention_scaling, norms)
            return self._attend(q, k, v, kv, attention, plan)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.cpu_ops is None or not self.cpu_ops.rope_qk_(q, k, rope.cos, rope.sin):
            q, k = Rotary.apply(q, rope.cos, rope.sin), Rotary.apply(k, rope.cos, rope.sin)
        return self._attend(q, k, v, kv, attention, plan)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: tuple[torch.Tensor, ...],
                attention: AttentionBackend, plan: Any) -> torch.Tensor:
        # An FP8 cache's layer carries its per-head scales as a third element (attention/fp8.py).
        o = attention(q, k, v, kv[0], kv[1], plan, kv[2] if len(kv) > 2 else None)
        return self.o_proj(o.reshape(q.shape[0], self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.cpu_ops: CpuLayerOps | None = None

    def fuse(self) -> None:
        self.gate_up_proj = _fused_linear([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda:  # one kernel instead of two over strided halves (~10% of a 7B tick)
            from metronome.models.silu_mul_triton import silu_mul

            quantize = takes_e4m3_rows(self.down_proj, gate_up.shape[0], gate_up.dtype)
            return self.down_proj(silu_mul(gate_up, quantize=quantize))
        if self.cpu_ops is not None and (act := self.cpu_ops.silu_mul(gate_up)) is not None:
            return self.down_proj(act)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.self_attn = Attention(spec)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, rope, kv, attention, plan):
        _, h = self.input_layernorm.add_norm(x, None, self.self_attn.qkv_proj)
        mlp_in = self.mlp.gate_up_proj if isinstance(self.mlp, MLP) else self.mlp
        x, h = self.post_attention_layernorm.add_norm(x, self.self_attn(h, rope, kv, attention, plan), mlp_in)
        return x + self.mlp(h)


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


def fuse_layer(layer: nn.Module) -> None:
    """One decoder layer's projections fused (q/k/v, gate/up; a MoE block's experts stacked), once."""
    layer.self_attn.fuse()
    layer.mlp.fuse()


class LlamaFamilyForCausalLM(nn.Module):
    """``forward`` returns final-normed hidden states [T, hidden]; ``compute_logits`` maps rows to vocab."""

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = DecoderModel(spec)
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.rotary: Rotary | None = None
        # Metronome's C kernels when the engine gives the logits' few-row products to them (``cpu_linear``).
        self.cpu_kernels: NativeLibrary | None = None
        # The head's weight packed for oneDNN, where the engine packs the decoder's bf16 weights (``cpu_linear``): a
        # copy made at load, as the packed layers are, so it does not follow later changes to the plain weight.
        self.packed_head: nn.Module | None = None
        # The head's weight with zero rows after the vocabulary (``align_head_``), on CUDA where it pays; the
        # head's weight (and a tied embedding) are then views of its first rows.
        self.aligned_head: torch.Tensor | None = None

    def align_head_(self) -> bool:
        """Give the logits' product a head padded to a multiple of ``HEAD_ROW_MULTIPLE`` rows where the vocabulary
        is not one, sharing its storage: cuBLAS's fast kernels need 16-byte aligned rows of logits, and a
        vocabulary like MiniCPM-o's 151,748 falls back to a slower one (docs/benchmarks/models.md, MiniCPM-o).
        Whether it padded (not again where the head already is a view of the padded one)."""
        weight = self.head_weight()
        vocab = weight.shape[0]
        if vocab % HEAD_ROW_MULTIPLE == 0 or (self.aligned_head is not None
                                              and self.aligned_head.data_ptr() == weight.data_ptr()):
            return False
        with torch.no_grad():
            padded = weight.new_zeros((-(-vocab // HEAD_ROW_MULTIPLE) * HEAD_ROW_MULTIPLE, weight.shape[1]))
            padded[:vocab].copy_(weight)
        head = nn.Parameter(padded[:vocab], requires_grad=False)
        if self.spec.tie_word_embeddings:
            self.model.embed_tokens.weight = head
        else:
            self.lm_head.weight = head
        self.aligned_head = padded
        return True

    def fuse_projections(self) -> None:
        """Call once after the checkpoint is loaded (names mirror transformers' until then)."""
        for layer in self.model.layers:
            fuse_layer(layer)

    def init_rotary(self, device: torch.device | str) -> None:
        self.rotary = Rotary(self.spec.inv_freq, self.spec.rope_attention_scaling, device)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attention: AttentionBackend,
                plan: Any) -> torch.Tensor:
        rope = RopeInputs.at(positions, self.rotary)
        x = inputs_embeds
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, rope, kv, attention, plan)
        return self.model.norm(x)

    def head_weight(self) -> torch.Tensor:
        """The logits' weight [vocab, hidden]: the embedding's where the checkpoint ties them."""
        return self.model.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.head_weight()
        logits = None
        if hidden.device.type == "cpu" and self.packed_head is not None:
            logits = self.packed_head(hidden)
        elif hidden.device.type == "cpu" and self.cpu_kernels is not None:
            logits = skinny_linear(hidden, weight, None, self.cpu_kernels)
        elif self.aligned_head is not None:
            logits = F.linear(hidden, self.aligned_head)[:, :weight.shape[0]]
        if logits is None and hidden.device.type == "cpu":
            # vocab-major product: ~1.5x faster than F.linear for few rows on the CPU BLAS here; its rows made
            # contiguous, since top-k and argmax over a strided row take several times as long.
            logits = (weight @ hidden.t()).t().contiguous()
        elif logits is None:
            logits = F.linear(hidden, weight)
        return exact_top(logits, hidden, weight) if logits.dtype in (torch.bfloat16, torch.float16) else logits


# Rows of the padded head (``align_head_``): 8 would align bf16 rows of logits to 16 bytes; 64, as vLLM pads its
# vocabulary, also aligns one-byte rows and keeps the head in whole 64-row tiles.
HEAD_ROW_MULTIPLE = 64

# A bfloat16 logit near 25 is a multiple of 0.125: two of the top logits often round to one value, and argmax then
# takes the lower token id, a different answer from the float32 head's (greedy decoding goes astray from there).
EXACT_TOP = 4


def exact_top(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, k: int = EXACT_TOP) -> torch.Tensor:
    """Half-precision ``logits`` [rows, vocab] as float32, the ``k`` largest of each row recomputed in float32 from
    ``hidden`` [rows, h] and ``weight`` [vocab, h]. Rounding keeps order, so the float32 argmax is among the row's
    rounded maxima, and after this it is the argmax. Static shapes: it runs inside CUDA graphs."""
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices
    exact = torch.einsum("rh,rkh->rk", hidden.float(), weight[top].float())
    return logits.float().scatter_(-1, top, exact)
