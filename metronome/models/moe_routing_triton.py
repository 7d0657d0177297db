"""A sparse MoE block's routing in two Triton launches: expert choice, then the assignments laid out by expert.

A decode round of Qwen3-Omni's thinker routes every token in each of 48 layers. In torch that is about fifteen
small kernels a layer (softmax, top-k and its sort, the renormalising sum and division, a stable radix sort of
the assignments, a scatter-add histogram, cumsums, a search), each a few microseconds, most of them latency:
together more device time a round than the attention's bytes take. Here:

1. ``select_experts``: softmax of the router's logits in fp32, the top ``k`` (ties to the lower expert id),
   optionally renormalised: one program per block of tokens.
2. ``route``: one program per expert. Each counts every expert's assignments (a histogram), so it knows its
   own first row and first row tile without a second launch, marks its row tiles, and writes its assignments'
   ids in their original order (a stable counting sort). No host synchronisation, static shapes: CUDA-graph
   safe. Every program reads all M ids twice: nothing in a decode round, and 128 × 72k ids for a prefill of
   9,000 tokens, still small beside that prefill's expert products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Assignments (or row tiles) one program handles per loop step.
ROUTE_BLOCK = 1024
# Tokens per program when choosing experts.
SELECT_BLOCK_T = 16


@dataclass(frozen=True)
class Routing:
    """The assignments of one forward sorted by expert, and how row tiles map to experts.

    ``order[j]``: the flat assignment index (token · k + slot) of the j-th row in expert order.
    ``start[e]`` / ``count[e]``: expert ``e``'s rows in that order. ``tile_expert[b]``: the expert of
    row tile ``b`` (``E`` past the last real tile); ``tile_start[e]``: the first tile of expert ``e``.
    """

    order: torch.Tensor        # [M] int32
    start: torch.Tensor        # [E] int32
    count: torch.Tensor        # [E] int32
    tile_expert: torch.Tensor  # [num_tiles] int32
    tile_start: torch.Tensor   # [E] int32
    block_m: int


def max_row_tiles(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the row tiles: each used expert wastes less than one tile to padding."""
    return triton.cdiv(num_assignments, block_m) + min(num_experts, num_assignments)


@triton.jit
def _select_experts(logits_ptr, ids_ptr, weights_ptr, T, E, stride_l, K: tl.constexpr, K_POW2: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < T
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_l + cols[None, :],
                mask=row_mask[:, None] & (cols[None, :] < E), other=float("-inf")).to(tl.float32)
    x = tl.where(row_mask[:, None], x, 0.0)   # rows past T: finite, never stored
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    slots = tl.arange(0, K_POW2)
    chosen_p = tl.zeros((BLOCK_T, K_POW2), dtype=tl.float32)
    chosen_id = tl.zeros((BLOCK_T, K_POW2), dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(p, 1)
        # A row of NaN or inf logits (a captured round's padding rows) matches nothing: keep its id in range.
        best_id = tl.minimum(tl.min(tl.where(p == best[:, None], cols[None, :], BLOCK_E), 1), E - 1)
        chosen_p = tl.where(slots[None, :] == j, best[:, None], chosen_p)
        chosen_id = tl.where(slots[None, :] == j, best_id[:, None], chosen_id)
        p = tl.where(cols[None, :] == best_id[:, None], -1.0, p)   # below every probability
    if RENORMALIZE:
        chosen_p = chosen_p / tl.sum(chosen_p, 1)[:, None]
    out = rows[:, None] * K + slots[None, :]
    mask = row_mask[:, None] & (slots[None, :] < K)
    tl.store(ids_ptr + out, chosen_id, mask=mask)
    tl.store(weights_ptr + out, chosen_p.to(weights_ptr.dtype.element_ty), mask=mask)


def select_experts(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` experts of each row of router ``logits`` [T, E]: ids [T, k] int32 (by probability, highest
    first) and their softmax probabilities [T, k] in ``logits``' dtype, renormalised to sum to one if asked."""
    t, e = logits.shape
    if not 0 < k <= e:
        raise ValueError(f"cannot choose {k} of {e} experts")
    logits = logits.contiguous()
    ids = torch.empty((t, k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((t, k), dtype=logits.dtype, device=logits.device)
    if t:
        _select_experts[(triton.cdiv(t, SELECT_BLOCK_T),)](
            logits, ids, weights, t, e, logits.stride(0), K=k, K_POW2=triton.next_power_of_2(k),
            BLOCK_T=SELECT_BLOCK_T, BLOCK_E=triton.next_power_of_2(e), RENORMALIZE=renormalize)
    return ids, weights


@triton.jit
def _route(ids_ptr, order_ptr, start_ptr, count_ptr, tile_expert_ptr, tile_start_ptr, M, NUM_TILES,
           NUM_EXPERTS: tl.constexpr, BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    hist = tl.zeros((BINS,), dtype=tl.int32)
    for m0 in range(0, M, BLOCK):   # every expert's count; padding (and any id out of range) in bin NUM_EXPERTS
        ids = tl.load(ids_ptr + m0 + offs, mask=m0 + offs < M, other=NUM_EXPERTS).to(tl.int32)
        hist += tl.histogram(tl.where((ids >= 0) & (ids < NUM_EXPERTS), ids, NUM_EXPERTS), BINS)
    bins = tl.arange(0, BINS)
    count = tl.where(bins < NUM_EXPERTS, hist, 0)
    tiles = (count + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    mine = bins == e
    my_start = tl.sum(tl.where(mine, tl.cumsum(count, 0) - count, 0))
    my_tiles = tl.sum(tl.where(mine, tiles, 0))
    my_tile_start = tl.sum(tl.where(mine, tile_end - tiles, 0))
    tl.store(start_ptr + e, my_start)
    tl.store(count_ptr + e, tl.sum(tl.where(mine, count, 0)))
    tl.store(tile_start_ptr + e, my_tile_start)
    for b0 in range(0, my_tiles, BLOCK):
        tl.store(tile_expert_ptr + my_tile_start + b0 + offs, tl.full((BLOCK,), 0, tl.int32) + e,
                 mask=b0 + offs < my_tiles)
    if e == NUM_EXPERTS - 1:   # the spare tiles past the last real one find the sentinel expert
        for b0 in range(tl.sum(tiles), NUM_TILES, BLOCK):
            tl.store(tile_expert_ptr + b0 + offs, tl.full((BLOCK,), NUM_EXPERTS, tl.int32), mask=b0 + offs < NUM_TILES)
    seen = 0
    for m0 in range(0, M, BLOCK):   # this expert's assignments in their original order
        ids = tl.load(ids_ptr + m0 + offs, mask=m0 + offs < M, other=NUM_EXPERTS)
        hit = (ids == e).to(tl.int32)
        rank = seen + tl.cumsum(hit, 0) - 1
        tl.store(order_ptr + my_start + rank, m0 + offs, mask=hit != 0)
        seen += tl.sum(hit)


def route(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """Sort the [T, k] expert choices by expert (stable) and lay out the row tiles."""
    flat = topk_ids.reshape(-1).contiguous()
    m = flat.numel()
    device = flat.device
    num_tiles = max_row_tiles(m, num_experts, block_m)
    order = torch.empty(m, dtype=torch.int32, device=device)
    start, count, tile_start = (torch.empty(num_experts, dtype=torch.int32, device=device) for _ in range(3))
    tile_expert = torch.empty(num_tiles, dtype=torch.int32, device=device)
    _route[(num_experts,)](flat, order, start, count, tile_expert, tile_start, m, num_tiles,
                           NUM_EXPERTS=num_experts, BINS=triton.next_power_of_2(num_experts + 1), BLOCK_M=block_m,
                           BLOCK=ROUTE_BLOCK)
    return Routing(order, start, count, tile_expert, tile_start, block_m)
