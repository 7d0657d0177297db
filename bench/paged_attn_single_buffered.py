"""The decode/prefill kernel as it was before session 7 (commit 6f59b35), kept for the A/B in
``bench/decode_pipeline_gpu.py``: it loads each tile's physical block ids inside the loop, right before the
K/V loads that need them, which leaves Triton 3.6's pipeliner one K/V buffer at num_stages 3 and 4.

Same signature as ``metronome.attention.triton_paged._paged_attn_fwd``; the bench swaps it in.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _paged_attn_fwd(
    Q, K, V, O, BT, WF, ITEMS, LSE_P, O_P,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    qk_scale, sinks, window, sink_blocks, num_splits,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
    KV_I64: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr,
):
    item = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # Work item: (sequence, first packed query row, query tokens in the tile, token index of the first).
    seq = tl.load(ITEMS + item * 4)
    q_row0 = tl.load(ITEMS + item * 4 + 1)
    n_q = tl.load(ITEMS + item * 4 + 2)
    t0 = tl.load(ITEMS + item * 4 + 3)
    t_last = t0 + n_q - 1
    wf = tl.load(WF + seq).to(tl.int32)

    # Live key set of this tile's queries: [0, n_sink) ∪ [ws, t_last].
    if HAS_WINDOW:
        n_sink = tl.minimum(sinks, t_last + 1)
        ws = tl.maximum(n_sink, t0 - window)
    else:
        n_sink = t_last * 0
        ws = t_last * 0
    sink_tiles = tl.cdiv(n_sink, BLOCK_N)
    win0 = tl.maximum(ws // BLOCK_N, sink_tiles)
    n_tiles = sink_tiles + tl.maximum(tl.cdiv(t_last + 1, BLOCK_N) - win0, 0)
    if SPLIT:
        per = tl.cdiv(n_tiles, num_splits)
        lo = split * per
        hi = tl.minimum(lo + per, n_tiles)
    else:
        lo = n_tiles * 0
        hi = n_tiles

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

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = BT + seq * stride_bt
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    offs_n0 = tl.arange(0, BLOCK_N)

    for it in range(lo, hi):
        tile = tl.where(it < sink_tiles, it, it - sink_tiles + win0)
        offs_n = tile * BLOCK_N + offs_n0
        if HAS_WINDOW:
            live = (offs_n <= t_last) & ((offs_n < n_sink) | (offs_n >= ws))
        else:
            live = offs_n <= t_last
        logical = offs_n // BLOCK_SIZE
        col = tl.where(logical < sink_blocks, logical, logical - wf + sink_blocks)
        phys = tl.load(bt_row + col, mask=live, other=0)
        if KV_I64:
            phys = phys.to(tl.int64)
        within = offs_n % BLOCK_SIZE
        k = tl.load(k_base + (phys * stride_kb + within * stride_ks)[None, :] + offs_d[:, None],
                    mask=live[None, :] & d_valid[:, None], other=0.0)
        v = tl.load(v_base + (phys * stride_vb + within * stride_vs)[:, None] + offs_d[None, :],
                    mask=live[:, None] & d_valid[None, :], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if IEEE:
            qk = tl.dot(q, k, input_precision="ieee")
        else:
            qk = tl.dot(q, k)
        allowed = (offs_n[None, :] <= qpos[:, None]) & live[None, :]
        if HAS_WINDOW:
            allowed = allowed & ((offs_n[None, :] < sinks) | (offs_n[None, :] >= qpos[:, None] - window))
        s = tl.where(allowed, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        base = ((split * tl.num_programs(0) + item) * tl.num_programs(1) + kvh) * BLOCK_M
        tl.store(LSE_P + base + rows, lse)
        tl.store(O_P + (base + rows)[:, None] * BLOCK_D + offs_d[None, :], out)
    else:
        tl.store(O + (q_row0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])
