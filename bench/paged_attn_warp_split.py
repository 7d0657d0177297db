"""An experimental decode kernel, kept as the record of an A/B that it lost: each warp owns its own keys.

The engine's kernel (:mod:`metronome.attention.triton_paged`) computes a decode tile as one ``[16, 64]`` score
block. Triton spreads it over the 4 warps along the keys (``warpsPerCTA = [1, 4]``), so every tile hands its row
maximum, row sum and probabilities between warps through shared memory, behind barriers (9 ``BAR`` in the loop).
The hypothesis was that this chain, not the memory, set the per-tile time at N = 64.

Here the tile is ``[WARPS, 16, 64 / WARPS]``: the key tile is cut into one group per warp, both products are
batched over the groups (3-D ``tl.dot``, whose batch dimension Triton gives to the warps: ``warpsPerCTA = [4, 1,
1]``, 2 ``BAR``), and each group keeps its own running max, sum and accumulator. The groups' partial results are
merged once, after the last tile. The live-key set, block-id prefetch, masks and output are the engine kernel's.
Decode launches only, without split-KV.

On the H200 it was slower at every size: 47.7 against 43.4 µs at N = 64, 88.1 against 74.6 at 128 (255 registers, 2
programs per SM). The launch timeline showed why: the engine kernel's tile loop already reads at the copy
bandwidth (docs/benchmarks/gpu.md §1e). Checked against the torch reference and the float64 oracle under the
interpreter and compiled on the GPU (``tests/bench/test_paged_attn_warp_split.py``); timed by
``bench/decode_timeline_gpu.py``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from metronome.attention.metadata import PagedAttentionMetadata
from metronome.attention.triton_paged import LOG2E, TritonPlan, _interpreting, _next_pow2, _tile_blocks, _tile_keys


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attn_decode_warp_split(
    Q, K, V, O, BT, WF, ITEMS,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    qk_scale, sinks, window, sink_blocks,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, GROUPS: tl.constexpr,
    KV_I64: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr,
):
    SUB: tl.constexpr = BLOCK_N // GROUPS
    item = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(ITEMS + item * 4)
    q_row0 = tl.load(ITEMS + item * 4 + 1)
    n_q = tl.load(ITEMS + item * 4 + 2)
    t0 = tl.load(ITEMS + item * 4 + 3)
    t_last = t0 + n_q - 1
    wf = tl.load(WF + seq).to(tl.int32)
    if HAS_WINDOW:
        n_sink = tl.minimum(sinks, t_last + 1)
        ws = tl.maximum(n_sink, t0 - window)
    else:
        n_sink = t_last * 0
        ws = t_last * 0
    sink_tiles = tl.cdiv(n_sink, BLOCK_N)
    win0 = tl.maximum(ws // BLOCK_N, sink_tiles)
    n_tiles = sink_tiles + tl.maximum(tl.cdiv(t_last + 1, BLOCK_N) - win0, 0)

    rows = tl.arange(0, BLOCK_M)
    tok = rows // G
    row_valid = tok < n_q
    qpos = t0 + tok
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_D
    head = kvh * G + rows % G
    q = tl.load(Q + (q_row0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    q3 = tl.broadcast_to(q[None, :, :], (GROUPS, BLOCK_M, BLOCK_D))

    m_i = tl.full([GROUPS, BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUPS, BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([GROUPS, BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = BT + seq * stride_bt
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    # Key j of group g sits at g * SUB + j in the tile: the live-key helpers work elementwise on this 2-D index.
    offs_n0 = tl.arange(0, GROUPS)[:, None] * SUB + tl.arange(0, SUB)[None, :]
    d3 = offs_d[None, None, :]
    dk3 = offs_d[None, :, None]

    phys_next = _tile_blocks(0, sink_tiles, win0, t_last, n_sink, ws, wf, sink_blocks, bt_row, offs_n0,
                             BLOCK_N, BLOCK_SIZE, HAS_WINDOW)
    for it in range(0, n_tiles):
        phys = phys_next
        n3, live3 = _tile_keys(it, sink_tiles, win0, t_last, n_sink, ws, offs_n0, BLOCK_N, HAS_WINDOW)
        if KV_I64:
            phys = phys.to(tl.int64)
        within = n3 % BLOCK_SIZE
        k_slot = phys * stride_kb + within * stride_ks
        v_slot = phys * stride_vb + within * stride_vs
        k = tl.load(k_base + k_slot[:, None, :] + dk3, mask=live3[:, None, :] & d_valid[None, :, None], other=0.0)
        v = tl.load(v_base + v_slot[:, :, None] + d3, mask=live3[:, :, None] & d_valid[None, None, :], other=0.0)
        phys_next = _tile_blocks(tl.minimum(it + 1, n_tiles - 1), sink_tiles, win0, t_last, n_sink, ws, wf,
                                 sink_blocks, bt_row, offs_n0, BLOCK_N, BLOCK_SIZE, HAS_WINDOW)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if IEEE:
            qk = tl.dot(q3, k, input_precision="ieee")
        else:
            qk = tl.dot(q3, k)                                       # [GROUPS, BLOCK_M, SUB]
        allowed = (n3[:, None, :] <= qpos[None, :, None]) & live3[:, None, :]
        if HAS_WINDOW:
            allowed = allowed & ((n3[:, None, :] < sinks) | (n3[:, None, :] >= qpos[None, :, None] - window))
        s = tl.where(allowed, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 2))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, :, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 2)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, :, None] + pv
        m_i = m_new

    # The groups' partial softmaxes, merged once.
    m = tl.max(m_i, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(m_i - m_use[None, :])
    l = tl.sum(l_i * w, 0)
    total = tl.sum(acc * w[:, :, None], 0)
    out = total / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(O + (q_row0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


def paged_attention_warp_split(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               meta: PagedAttentionMetadata, plan: TritonPlan, scale: float | None = None,
                               out: torch.Tensor | None = None, *, groups: int = 4, num_warps: int = 4,
                               num_stages: int = 3) -> torch.Tensor:
    """Decode attention with the engine kernel's plan (its single decode launch, unsplit); [T, H, D] out."""
    t, heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    if len(plan.launches) != 1 or plan.launches[0].num_splits != 1 or plan.launches[0].block_m > 16:
        raise ValueError("the warp-split kernel takes one unsplit decode launch")
    launch = plan.launches[0]
    if plan.block_n % groups or plan.block_n // groups < 16:
        raise ValueError(f"{plan.block_n}-key tiles do not cut into {groups} groups of at least 16 keys")
    if out is None:
        out = torch.empty((t, heads, head_dim), dtype=query.dtype, device=query.device)
    interp = _interpreting() or not query.is_cuda
    tables = meta.block_tables
    if tables.dtype != torch.int32 or tables.stride(-1) != 1:
        tables = tables.to(torch.int32).contiguous()
    cfg = {} if not query.is_cuda else {"num_warps": num_warps, "num_stages": num_stages}
    _paged_attn_decode_warp_split[(launch.num_items, kv_heads)](
        query, k_cache, v_cache, out, tables, meta.window_first, launch.items,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), tables.stride(0),
        (scale if scale is not None else 1.0 / math.sqrt(head_dim)) * LOG2E, meta.sinks,
        meta.window if meta.window is not None else 0, meta.sink_blocks,
        G=heads // kv_heads, BLOCK_M=launch.block_m, BLOCK_N=plan.block_n, BLOCK_D=max(16, _next_pow2(head_dim)),
        HEAD_D=head_dim, BLOCK_SIZE=meta.block_size, HAS_WINDOW=meta.window is not None, GROUPS=groups,
        KV_I64=max(k_cache.numel(), v_cache.numel()) >= 2**31 - 1, DOT_F32=interp,
        IEEE=query.dtype == torch.float32, **cfg)
    return out
