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

* ``"triton"`` (CUDA default): a grouped GEMM over assignments sorted by expert
  (``models/moe_triton.py``): two launches per layer, no host synchronisation (CUDA-graph safe).
* ``"torch"`` (CPU default): sort assignments by expert, one matmul pair per used expert, scatter-add.
* ``"loop"``: the naive per-expert loop with masks (as transformers' eager code); kept for benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

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
    """All experts' weights stacked: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj, requires_grad=False)
        self.down_proj = nn.Parameter(down_proj, requires_grad=False)
        self.backend = "auto"

    @classmethod
    def empty(cls, num_experts: int, hidden: int, inter: int) -> "FusedExperts":
        return cls(torch.empty(num_experts, 2 * inter, hidden), torch.empty(num_experts, hidden, inter))

    @classmethod
    def stack(cls, experts: nn.ModuleList) -> "FusedExperts":
        with torch.no_grad():
            gate_up = torch.stack([torch.cat([x.gate_proj.weight, x.up_proj.weight], 0) for x in experts])
            down = torch.stack([x.down_proj.weight for x in experts])
        return cls(gate_up, down)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        backend = self.backend
        if backend == "auto":
            backend = "triton" if x.is_cuda else "torch"
        if backend == "triton":
            from metronome.models.moe_triton import grouped_moe

            return grouped_moe(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights)
        if backend == "torch":
            return experts_sorted(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights)
        if backend == "loop":
            return experts_loop(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights)
        raise ValueError(f"unknown expert backend {backend!r}; use one of {EXPERT_BACKENDS}")


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def experts_sorted(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> torch.Tensor:
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
            out[begin:begin + n] = _swiglu(rows[begin:begin + n], w_gate_up[expert], w_down[expert])
            begin += n
    out *= topk_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, out)


def experts_loop(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
    """The naive path: for each used expert, find its tokens with a mask and run them (benchmark baseline)."""
    y = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == expert)
        out = _swiglu(x[token], w_gate_up[expert], w_down[expert]) * topk_weights[token, slot, None].to(x.dtype)
        y.index_add_(0, token, out)
    return y


class SparseMoeBlock(nn.Module):
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
        """Top-k expert ids [T, k] and their weights [T, k] in ``x``'s dtype (as transformers rounds them)."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
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
