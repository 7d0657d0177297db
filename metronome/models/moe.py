"""Sparse mixture-of-experts decoders (Qwen3-MoE style): router softmax → top-k experts per token.

``MoeSpec`` adds the MoE facts to ``DecoderSpec``; ``MoeForCausalLM`` is the Llama-family decoder
(``models/llama.py``, attention and norms unchanged) whose MLP is a ``SparseMoeBlock`` in every
sparse layer (``decoder_sparse_step`` / ``mlp_only_layers`` as transformers reads them).

The block routes each token to ``k`` of ``E`` experts (``softmax`` in fp32, top-k, optionally
renormalised: ``norm_topk_prob``) and sums the chosen SwiGLU experts' outputs weighted by those
probabilities. Expert weights live stacked, ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]
(transformers' fused layout). Checkpoints that store one module per expert
(``experts.{e}.gate_proj.weight`` ...; the published Qwen3 MoE checkpoints do) load into a
``ModuleList`` with those names and are stacked by ``fuse_projections`` after loading.

Three expert paths compute the same function:

* ``"triton"`` (CUDA default): a grouped GEMM over assignments sorted by expert (``models/moe_triton.py``): the
  layout (``models/moe_routing_triton.py``), the two products and the sum, one launch each, no host
  synchronisation (CUDA-graph safe); on CUDA the router's top-k is one launch too.
* ``"torch"`` (CPU default): sort assignments by expert, one matmul pair per used expert, scatter-add.
* ``"loop"``: the naive per-expert loop with masks (as transformers' eager code); kept for benchmarks.

FP8 experts (``quantize_fp8_``, or an FP8 checkpoint's per-expert layers) keep E4M3 codes in the same stacked
tensors with scales beside them (``models/fp8.py``): the grouped GEMM dequantises each weight tile in registers
(half the bytes streamed per decode round), the torch paths dequantise one used expert at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from metronome.models.fp8 import ExpertScales, Fp8Linear, QuantizedRows, TakesE4m3Rows, dequantize, quantize
from metronome.models.llama import LlamaFamilyForCausalLM
from metronome.models.spec import DecoderSpec

EXPERT_BACKENDS = ("auto", "triton", "torch", "loop")


@dataclass(frozen=True)
class MoeSpec(DecoderSpec):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        """transformers' rule: MoE unless listed in ``mlp_only_layers``, every ``decoder_sparse_step``-th layer."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


class ExpertMLP(nn.Module):
    """One expert as a checkpoint stores it (names only; its weights are stacked before use)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)


class FusedExperts(nn.Module):
    """All experts' weights stacked: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]; in FP8, E4M3 codes
    with ``scales`` beside them."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, scales: ExpertScales | None = None) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj, requires_grad=False)
        self.down_proj = nn.Parameter(down_proj, requires_grad=False)
        self._set_scales(scales)
        self.backend = "auto"

    def _set_scales(self, scales: ExpertScales | None) -> None:
        self.register_buffer("gate_up_scale", None if scales is None else scales.gate_up)
        self.register_buffer("down_scale", None if scales is None else scales.down)
        self.groups = (0, 0) if scales is None else (scales.gate_up_group, scales.down_group)

    @property
    def scales(self) -> ExpertScales | None:
        """The FP8 scales, or None for float experts."""
        if self.gate_up_scale is None:
            return None
        return ExpertScales(self.gate_up_scale, self.down_scale, *self.groups)

    @classmethod
    def empty(cls, num_experts: int, hidden: int, inter: int) -> "FusedExperts":
        return cls(torch.empty(num_experts, 2 * inter, hidden), torch.empty(num_experts, hidden, inter))

    @classmethod
    def stack(cls, experts: nn.ModuleList) -> "FusedExperts":
        if any(isinstance(m, Fp8Linear) for x in experts for m in (x.gate_proj, x.up_proj, x.down_proj)):
            return cls._stack_fp8(experts)
        with torch.no_grad():
            gate_up = torch.stack([torch.cat([x.gate_proj.weight, x.up_proj.weight], 0) for x in experts])
            down = torch.stack([x.down_proj.weight for x in experts])
        return cls(gate_up, down)

    @classmethod
    def _stack_fp8(cls, experts: nn.ModuleList) -> "FusedExperts":
        """FP8 experts (from a checkpoint) stacked: codes and scales alike (every expert in the same layout)."""
        gate_up = [Fp8Linear.concat([x.gate_proj, x.up_proj]) for x in experts]
        down = [d if isinstance(d, Fp8Linear) else Fp8Linear.from_linear(d) for d in (x.down_proj for x in experts)]
        for layers in (gate_up, down):
            if len({(m.group, m.weight_scale.shape[1]) for m in layers}) > 1:
                raise ValueError("the experts' FP8 weights do not share one scale layout")
        scales = ExpertScales(torch.stack([m.weight_scale for m in gate_up]),
                              torch.stack([m.weight_scale for m in down]), gate_up[0].group, down[0].group)
        return cls(torch.stack([m.weight for m in gate_up]), torch.stack([m.weight for m in down]), scales)

    def quantize_fp8_(self) -> None:
        """Hold the experts as E4M3 codes with one scale per output channel (in place; once)."""
        if self.scales is not None:
            return
        (gate_up, gate_up_scale), (down, down_scale) = quantize(self.gate_up_proj), quantize(self.down_proj)
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(down, requires_grad=False)
        self._set_scales(ExpertScales(gate_up_scale, down_scale, gate_up.shape[-1], down.shape[-1]))

    def _backend(self, device: torch.device) -> str:
        return ("triton" if device.type == "cuda" else "torch") if self.backend == "auto" else self.backend

    def multiplies_e4m3_rows(self, dtype: torch.dtype) -> bool:
        """Whether the grouped GEMM would round input rows of ``dtype`` onto E4M3 itself (so the norm before the
        block may write them so, ``QuantizedRows``)."""
        device = self.gate_up_proj.device
        if self._backend(device) != "triton":
            return False
        from metronome.models.moe_triton import multiplies_e4m3_rows

        return multiplies_e4m3_rows(dtype, device, self.scales)

    def forward(self, x: torch.Tensor | QuantizedRows, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """``x``: the tokens' rows, or as ``QuantizedRows`` with ``values`` (the codes go to the grouped GEMM)."""
        rows = None
        if isinstance(x, QuantizedRows):
            quantized, x = x, x.rows()
            if self.multiplies_e4m3_rows(x.dtype):
                rows = (quantized.codes, quantized.scale)
        backend = self._backend(x.device)
        if backend == "triton":
            from metronome.models.moe_triton import grouped_moe

            return grouped_moe(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights, scales=self.scales,
                               x_rows=rows)
        if backend == "torch":
            return experts_sorted(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights, self.scales)
        if backend == "loop":
            return experts_loop(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights, self.scales)
        raise ValueError(f"unknown expert backend {backend!r}; use one of {EXPERT_BACKENDS}")


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def _expert(w_gate_up: torch.Tensor, w_down: torch.Tensor, scales: ExpertScales | None, expert: int,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``expert``'s two weights as the product uses them (dequantised to ``dtype`` when FP8)."""
    if scales is None:
        return w_gate_up[expert], w_down[expert]
    return (dequantize(w_gate_up[expert], scales.gate_up[expert], scales.gate_up_group, dtype),
            dequantize(w_down[expert], scales.down[expert], scales.down_group, dtype))


def experts_sorted(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor, scales: ExpertScales | None = None) -> torch.Tensor:
    """The torch path: assignments sorted by expert, one matmul pair per used expert (no per-token loop)."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()  # one host sync per layer
    tokens = order // k
    rows = x[tokens]
    out = torch.empty_like(rows)
    begin = 0
    for expert, n in enumerate(counts):
        if n:
            out[begin:begin + n] = _swiglu(rows[begin:begin + n], *_expert(w_gate_up, w_down, scales, expert, x.dtype))
            begin += n
    out *= topk_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, out)


def experts_loop(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, scales: ExpertScales | None = None) -> torch.Tensor:
    """The naive path: for each used expert, find its tokens with a mask and run them (benchmark baseline)."""
    y = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == expert)
        weights = _expert(w_gate_up, w_down, scales, expert, x.dtype)
        out = _swiglu(x[token], *weights) * topk_weights[token, slot, None].to(x.dtype)
        y.index_add_(0, token, out)
    return y


class SparseMoeBlock(TakesE4m3Rows, nn.Module):
    """Router (``gate``) + experts; names mirror transformers' (``mlp.gate.weight``, ``mlp.experts...``)."""

    def __init__(self, spec: MoeSpec, per_expert: bool = True) -> None:
        super().__init__()
        self.top_k = spec.num_experts_per_tok
        self.norm_topk_prob = spec.norm_topk_prob
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        if per_expert:
            self.experts: nn.Module = nn.ModuleList(
                ExpertMLP(spec.hidden_size, spec.moe_intermediate_size) for _ in range(spec.num_experts))
        else:
            self.experts = FusedExperts.empty(spec.num_experts, spec.hidden_size, spec.moe_intermediate_size)

    def fuse(self) -> None:
        """Stack per-expert weights (after loading) so every path reads one tensor per projection."""
        if isinstance(self.experts, nn.ModuleList):
            self.experts = FusedExperts.stack(self.experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids [T, k] and their weights [T, k] in ``x``'s dtype (as transformers rounds them; ties on
        CUDA go to the lower expert id)."""
        logits = self.gate(x)
        if logits.is_cuda:   # one launch where torch takes five (models/moe_routing_triton.py)
            from metronome.models.moe_routing_triton import select_experts

            return select_experts(logits, self.top_k, self.norm_topk_prob)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(logits.dtype)

    reads_values = True   # TakesE4m3Rows: the router reads the rows unrounded, the experts their codes

    def takes_e4m3_rows(self, rows: int, dtype: torch.dtype) -> bool:
        """TakesE4m3Rows: whether the experts multiply E4M3 rows (``FusedExperts.multiplies_e4m3_rows``)."""
        return isinstance(self.experts, FusedExperts) and self.experts.multiplies_e4m3_rows(dtype)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        ids, weights = self.route(x.rows() if isinstance(x, QuantizedRows) else x)
        return self.experts(x, ids, weights)


class MoeForCausalLM(LlamaFamilyForCausalLM):
    """A Llama-family decoder whose sparse layers' MLPs are ``SparseMoeBlock`` s.

    ``per_expert``: build expert weights as one module per expert (checkpoints that store them so;
    ``fuse_projections`` stacks them) or stacked from the start (fused checkpoints, random weights).
    """

    def __init__(self, spec: MoeSpec, per_expert: bool = True) -> None:
        super().__init__(spec)
        for i, layer in enumerate(self.model.layers):
            if spec.is_sparse(i):
                layer.mlp = SparseMoeBlock(spec, per_expert)

    def set_expert_backend(self, backend: str) -> None:
        """Choose the expert path of every sparse layer (``EXPERT_BACKENDS``; benchmarks compare them)."""
        if backend not in EXPERT_BACKENDS:
            raise ValueError(f"unknown expert backend {backend!r}; use one of {EXPERT_BACKENDS}")
        for layer in self.model.layers:
            if isinstance(layer.mlp, SparseMoeBlock) and isinstance(layer.mlp.experts, FusedExperts):
                layer.mlp.experts.backend = backend
