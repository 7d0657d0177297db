"""The torch reference over the paged cache against a float64 dense masked softmax."""

from __future__ import annotations

import math
import random

import pytest
import torch

from metronome.attention.metadata import PagedAttentionMetadata
from metronome.attention.reference import TorchPagedAttention, paged_attention_reference, plan_reference


def dense_oracle(q, keys, values, first_query, sinks, window):
    """float64 masked softmax: q [Q, H, D], keys/values [ctx, KVH, D] (token order)."""
    qn, heads, d = q.shape
    ctx, kv_heads, _ = keys.shape
    k = keys.double().repeat_interleave(heads // kv_heads, dim=1)
    v = values.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(d)
    t = torch.arange(first_query, first_query + qn)[:, None]
    j = torch.arange(ctx)[None, :]
    allowed = j <= t
    if window is not None:
        allowed &= (j < sinks) | (j >= t - window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def build_case(seqs, sinks, window, block_size, heads=4, kv_heads=2, head_dim=16, seed=0):
    """A paged cache holding each sequence's live blocks at shuffled physical ids; freed blocks are NaN.

    ``seqs`` is a list of (context length after this forward, query length).
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    sink_blocks = -(-sinks // block_size) if window is not None else 0
    total_logical = sum(-(-ctx // block_size) for ctx, _ in seqs)
    num_blocks = total_logical + 8
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    k_cache[0] = 0  # the null block
    v_cache[0] = 0
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    rows, window_first, dense, slots = [], [], [], []
    for ctx, qlen in seqs:
        keys = torch.randn(ctx, kv_heads, head_dim, generator=gen)
        values = torch.randn(ctx, kv_heads, head_dim, generator=gen)
        dense.append((keys, values))
        first_query = ctx - qlen
        n_logical = -(-ctx // block_size)
        wf = max(sink_blocks, (first_query - window) // block_size) if window is not None else 0
        live = [b for b in range(n_logical) if b < sink_blocks or b >= wf]
        physical = {b: free.pop() for b in live}
        for b in live:
            lo, hi = b * block_size, min(ctx, (b + 1) * block_size)
            k_cache[physical[b], : hi - lo] = keys[lo:hi]
            v_cache[physical[b], : hi - lo] = values[lo:hi]
        rows.append([physical[b] for b in live])
        window_first.append(wf)
        slots.extend(physical[j // block_size] * block_size + j % block_size for j in range(first_query, ctx))
    width = max(len(r) for r in rows)
    table = torch.full((len(seqs), width), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    qlens = [q for _, q in seqs]
    start = torch.zeros(len(seqs) + 1, dtype=torch.long)
    start[1:] = torch.cumsum(torch.tensor(qlens), 0)
    meta = PagedAttentionMetadata(
        block_size=block_size, sinks=sinks if window is not None else 0, window=window, sink_blocks=sink_blocks,
        query_lens=qlens, context_lens=[c for c, _ in seqs], query_start=start,
        context_lens_t=torch.tensor([c for c, _ in seqs]), block_tables=table,
        window_first=torch.tensor(window_first), slot_mapping=torch.tensor(slots))
    query = torch.randn(sum(qlens), heads, head_dim, generator=gen)
    return meta, query, k_cache, v_cache, dense


CASES = {
    "t<S": ([(3, 3), (5, 1)], 8, 16, 4),
    "S<=t<S+W": ([(20, 1), (23, 7)], 4, 32, 4),
    "t>>W": ([(300, 1), (257, 1), (400, 26)], 4, 32, 8),
    "window ends mid-block": ([(101, 1), (99, 13)], 3, 21, 8),
    "S=0 plain sliding window": ([(90, 1), (77, 20)], 0, 16, 4),
    "no window (causal)": ([(40, 1), (33, 9)], 4, None, 4),
    "mixed prefill and decode": ([(500, 1), (12, 12), (260, 50), (64, 1), (1, 1)], 16, 64, 16),
    "block size 1": ([(50, 1), (31, 5)], 2, 10, 1),
}


@pytest.mark.parametrize("name", CASES)
def test_reference_matches_float64_masked_softmax(name):
    seqs, sinks, window, bs = CASES[name]
    meta, query, k_cache, v_cache, dense = build_case(seqs, sinks, window, bs)
    out = paged_attention_reference(query, k_cache, v_cache, plan_reference(meta, num_heads=query.shape[1]))
    assert torch.isfinite(out).all(), "a freed (NaN) block reached the output"
    start = 0
    for (ctx, qlen), (keys, values) in zip(seqs, dense):
        expect = dense_oracle(query[start:start + qlen], keys, values, ctx - qlen, sinks, window)
        torch.testing.assert_close(out[start:start + qlen].double(), expect, atol=2e-5, rtol=1e-4)
        start += qlen


def test_backend_writes_new_keys_before_attending():
    seqs = [(10, 3)]
    meta, query, k_cache, v_cache, dense = build_case(seqs, 2, 4, 4)
    keys, values = dense[0]
    # Poison the slots of the new tokens: the backend must overwrite them with the given K/V.
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_k[meta.slot_mapping] = float("nan")
    backend = TorchPagedAttention(num_heads=query.shape[1])
    out = backend(query, keys[7:], values[7:], k_cache, v_cache, backend.prepare(meta))
    torch.testing.assert_close(out.double(), dense_oracle(query, keys, values, 7, 2, 4), atol=2e-5, rtol=1e-4)


def test_large_groups_are_split_without_changing_results(monkeypatch):
    import metronome.attention.reference as ref

    seqs = [(200, 1)] * 6 + [(150, 20)] * 3
    meta, query, k_cache, v_cache, _ = build_case(seqs, 4, 64, 8)
    whole = paged_attention_reference(query, k_cache, v_cache, plan_reference(meta, 4))
    monkeypatch.setattr(ref, "MAX_SCORE_ELEMENTS", 1000)
    split = paged_attention_reference(query, k_cache, v_cache, plan_reference(meta, 4))
    assert len(plan_reference(meta, 4).groups) > 2
    torch.testing.assert_close(split, whole)
