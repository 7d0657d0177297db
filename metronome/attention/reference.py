"""Torch reference for sink + window attention over the paged cache (CPU default, any device).

Per forward, sequences are grouped (all decodes together; prefills bucketed by chunk length) and
each group is gathered into padded tensors: its live keys only, sinks then window, then one
``scaled_dot_product_attention`` call with a token-granular mask. Padding points at the null block
(always zero), so freed blocks are never read. Planning happens once per forward, on the host
lists the metadata carries, and is reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from metronome.attention.cpu_kernel import CpuDecodeKernel
from metronome.attention.metadata import PagedAttentionMetadata, first_window_token, token_slots, write_kv

# Upper bound on score elements (G * heads * Qmax * Kmax) one SDPA call may materialise.
MAX_SCORE_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class AttentionGroup:
    q_index: torch.Tensor  # [G, Qmax] flat query row (0 where padded)
    q_valid: torch.Tensor  # [G, Qmax] bool
    k_slots: torch.Tensor  # [G, Kmax] flat cache slot (0 = null block where padded)
    mask: torch.Tensor     # [G, 1, Qmax, Kmax] bool, True = attend
    all_valid: bool        # no padded query rows
    q_flat_valid: torch.Tensor  # positions in the flattened [G * Qmax] that are real queries
    q_rows: torch.Tensor        # their flat query rows


@dataclass(frozen=True)
class ReferencePlan:
    meta: PagedAttentionMetadata
    groups: list[AttentionGroup]


def _live_key_span(meta: PagedAttentionMetadata, b: int) -> tuple[int, int, int]:
    """(sink keys, first window token, number of keys) of sequence ``b`` for this forward."""
    ctx, first_query = meta.context_lens[b], meta.context_lens[b] - meta.query_lens[b]
    if meta.window is None:
        return 0, 0, ctx
    n_sink = min(meta.sinks, ctx)
    window_start = min(ctx, first_window_token(meta.sinks, meta.window, first_query))
    return n_sink, window_start, n_sink + ctx - window_start


def _group_rows(meta: PagedAttentionMetadata, num_heads: int) -> list[list[int]]:
    buckets: dict[int, list[int]] = {}
    for b, q in enumerate(meta.query_lens):
        buckets.setdefault(1 if q == 1 else 1 << (q - 1).bit_length(), []).append(b)
    groups = []
    for qmax, rows in sorted(buckets.items()):
        kmax = max(_live_key_span(meta, b)[2] for b in rows)
        per_seq = max(1, num_heads * qmax * kmax)
        step = max(1, MAX_SCORE_ELEMENTS // per_seq)
        groups.extend(rows[i:i + step] for i in range(0, len(rows), step))
    return groups


@dataclass(frozen=True)
class LiveKeys:
    """The keys sequences ``rows`` attend to in this forward, sinks then window, padded to ``[G, Kmax]``."""

    token: torch.Tensor  # logical token index of each key (0 where padded)
    slots: torch.Tensor  # its flat cache slot (0, the null block, where padded)
    valid: torch.Tensor  # bool
    count: list[int]     # keys per row


def live_keys(meta: PagedAttentionMetadata, rows: list[int]) -> LiveKeys:
    device = meta.query_start.device
    spans = [_live_key_span(meta, b) for b in rows]
    kmax = max(n for _, _, n in spans)
    row_t = torch.tensor(rows, device=device)
    n_sink = torch.tensor([s[0] for s in spans], device=device)
    w_start = torch.tensor([s[1] for s in spans], device=device)
    n_keys = torch.tensor([s[2] for s in spans], device=device)
    kpos = torch.arange(kmax, device=device)[None, :]
    k_valid = kpos < n_keys[:, None]
    k_token = torch.where(kpos < n_sink[:, None], kpos, w_start[:, None] + kpos - n_sink[:, None])
    k_token = torch.where(k_valid, k_token, 0)
    k_slots = torch.where(k_valid, token_slots(meta, row_t, k_token), 0)
    return LiveKeys(k_token, k_slots, k_valid, [s[2] for s in spans])


def _plan_group(meta: PagedAttentionMetadata, rows: list[int]) -> AttentionGroup:
    device = meta.query_start.device
    qmax = max(meta.query_lens[b] for b in rows)
    row_t = torch.tensor(rows, device=device)
    qlen = torch.tensor([meta.query_lens[b] for b in rows], device=device)
    first_query = meta.context_lens_t[row_t] - qlen

    qpos = torch.arange(qmax, device=device)
    q_valid = qpos[None, :] < qlen[:, None]
    q_index = torch.where(q_valid, meta.query_start[row_t][:, None] + qpos[None, :], 0)
    q_token = first_query[:, None] + qpos[None, :]

    keys = live_keys(meta, rows)
    k_valid, k_token, k_slots = keys.valid, keys.token, keys.slots

    kt, qt = k_token[:, None, :], q_token[:, :, None]
    mask = k_valid[:, None, :] & (kt <= qt)
    if meta.window is not None:
        mask &= (kt < meta.sinks) | (kt >= qt - meta.window)
    # Padded query rows attend to the (zero) first key so SDPA never sees an empty row.
    mask[:, :, 0] |= ~q_valid
    flat_valid = q_valid.flatten().nonzero().squeeze(1)
    all_valid = all(meta.query_lens[b] == qmax for b in rows)
    return AttentionGroup(q_index, q_valid, k_slots, mask.unsqueeze(1), all_valid, flat_valid,
                          q_index.flatten().index_select(0, flat_valid))


def plan_reference(meta: PagedAttentionMetadata, num_heads: int) -> ReferencePlan:
    return ReferencePlan(meta, [_plan_group(meta, rows) for rows in _group_rows(meta, num_heads)])


def paged_attention_reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              plan: ReferencePlan, scale: float | None = None,
                              kv_scale: torch.Tensor | None = None, dequantize=None) -> torch.Tensor:
    """Attention of ``query`` [T, heads, head_dim] over the paged cache; returns [T, heads, head_dim].

    ``kv_scale`` [2, kv_heads]: E4M3 caches, dequantised per KV head as they are gathered (by ``dequantize(codes,
    scale, dtype)`` where given and it applies: the CPU kernels' ``CpuDecodeKernel.dequantize``, the same values).
    """
    kv_heads, head_dim = k_cache.shape[-2:]
    k_flat, v_flat = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    out = torch.empty_like(query)
    heads = query.shape[1]
    for g in plan.groups:
        (n, qmax), kmax = g.q_index.shape, g.k_slots.shape[1]
        # index_select on flat indices: far faster on the CPU than multi-dimensional indexing.
        q = query.index_select(0, g.q_index.flatten()).view(n, qmax, heads, head_dim).transpose(1, 2)
        k, v = (flat.index_select(0, g.k_slots.flatten()) for flat in (k_flat, v_flat))
        if kv_scale is not None:
            k, v = (_dequantized(x, s, query.dtype, dequantize) for x, s in ((k, kv_scale[0]), (v, kv_scale[1])))
        k, v = (x.to(query.dtype).view(n, kmax, kv_heads, head_dim).transpose(1, 2) for x in (k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask,
                                           scale=scale, enable_gqa=kv_heads != heads)
        o = o.transpose(1, 2).reshape(n * qmax, heads, head_dim)
        if g.all_valid:
            out.index_copy_(0, g.q_index.flatten(), o)
        else:
            out.index_copy_(0, g.q_rows, o.index_select(0, g.q_flat_valid))
    return out


def _dequantized(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, dequantize) -> torch.Tensor:
    """Gathered E4M3 rows [rows, kv_heads, head_dim] times their head's scale, in ``dtype``."""
    out = dequantize(codes, scale, dtype) if dequantize is not None else None
    return out if out is not None else (codes.float() * scale[:, None]).to(dtype)


class TorchPagedAttention:
    """The attention backend the models call: writes the new K/V, then attends."""

    name = "torch"

    def __init__(self, num_heads: int, scale: float | None = None) -> None:
        self.num_heads = num_heads
        self.scale = scale
        self.kernel: CpuDecodeKernel | None = None   # the CPU's C kernels, for the K/V writes (``write_kv``)

    def prepare(self, meta: PagedAttentionMetadata) -> ReferencePlan:
        return plan_reference(meta, self.num_heads)

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, plan: ReferencePlan,
                 kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(key, value, k_cache, v_cache, plan.meta.slot_mapping, kv_scale, self.kernel)
        return paged_attention_reference(query, k_cache, v_cache, plan, self.scale, kv_scale,
                                         self.kernel.dequantize if self.kernel is not None else None)
