"""Triton paged attention for the sink + window mask ``[0, S) ∪ [t - W, t]`` over the compact block tables.

Inputs are exactly those of :mod:`metronome.attention.reference` (see
:class:`~metronome.attention.metadata.PagedAttentionMetadata`): packed queries ``[T, H, D]``, the paged
caches ``[num_blocks, block_size, KVH, D]`` and compact tables (column ``c < sink_blocks`` = logical
block ``c``, column ``c >= sink_blocks`` = logical block ``window_first[b] + c - sink_blocks``).

Design
------
* **Work items.** The host plan (built once per forward in :meth:`TritonPagedAttention.prepare`, from the
  metadata's host lists only: no GPU→CPU sync) cuts every sequence's queries into *query tiles*. A
  program handles one (query tile, KV head, split): its ``BLOCK_M`` rows are ``tokens × G`` where
  ``G = H / KVH`` query heads share the KV head, so each K/V tile is loaded once for the whole GQA
  group (row ``r`` = token ``r // G``, head ``kvh * G + r % G``; padded rows are masked).
  Sequences whose ``query_len * G`` fits 16 rows (decode) go to a ``BLOCK_M = 16`` launch, the rest
  (prefill chunks) to a ``BLOCK_M = 64`` launch: two launches at most per layer.
* **Live tiles only.** Keys are visited in ``BLOCK_N``-token tiles of logical token index: first the
  sink tiles ``[0, ceil(n_sink / BLOCK_N))``, then the window tiles from ``window_start // BLOCK_N``
  to the tile of the tile's last query (causal: a query tile never touches keys after its last
  query). Tiles that would overlap are merged, so no key is seen twice. Inside a tile every key gets
  its physical block from the compact table (token → column → block id) and is loaded only when it
  is live (``j < n_sink`` or ``window_start <= j <= t_last``): dead/freed blocks and slots after
  ``context_len`` are never read (masked loads), then a token-granular per-row mask applies
  ``j <= t`` and ``j < S or j >= t - W``.
* **Online softmax** in base 2 (``exp2``, scores pre-scaled by ``scale * log2(e)``), fp32 accumulators,
  ``tl.dot`` on the input dtype (bf16/fp16 tensor cores; fp32 in IEEE precision), and in fp16 over E4M3
  pages (each tile widened by one conversion per pair; the key and value scales fold into the scores and
  the output; up to ``WIDEN_V_MAX_GROUP`` query heads a KV head the values are widened in the layout they were
  loaded in, not gathered bytewise into the dot's). New keys and values go in by one launch a layer
  (``write_kv_triton``).
* **Split-KV (flash-decoding).** When a launch has fewer than ``target_programs`` (default 1 × SMs)
  (item, KV head) programs, its tile list is cut into ``num_splits`` contiguous chunks (a pure
  function of the host lists: ``min(max_splits, ceil(target / programs), max_tiles // 2)``); each
  split writes a normalised partial output and its log-sum-exp, and a small combine kernel merges
  them. ``force_splits`` overrides the rule (tests use it to show both paths agree).

* **Pipelining.** Each tile's physical block ids are loaded one tile ahead, so the K/V loads of a tile do not
  wait on a load from the same iteration and ``num_stages=3`` keeps two K/V tiles in flight. Decode launches
  with more than ``DOUBLE_BUFFERED_PROGRAMS_PER_SM`` programs per SM ("crowded") use ``CROWDED_DECODE_STAGES``
  over 16-bit pages (2: one buffer, more programs resident), ``CROWDED_DECODE_STAGES_E4M3`` over E4M3 pages (3: half
  the bytes a buffer) and the warm-up's register cap: :func:`choose_stages`, :func:`crowded_stages_for`.

CPU: the same kernels run under ``TRITON_INTERPRET=1`` (set before triton is imported). The
interpreter multiplies bf16 bit patterns in ``tl.dot`` (triton-lang/triton#11584, unsupported
upstream), so when interpreting the dot operands are upcast to fp32 (loads and stores stay in the
input dtype).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer, smid

from metronome.attention.e4m3_triton import e4m3_grid, e4m3_to_f16
from metronome.attention.metadata import PagedAttentionMetadata
from metronome.cpu import triton_interpreted
from metronome.device_copy import to_device

LOG2E = 1.4426950408889634

# Defaults for the launch plan; every one can be overridden per backend.
DECODE_BLOCK_M = 16      # rows (tokens x GQA heads) of a decode program: the tl.dot minimum
PREFILL_BLOCK_M = 64     # rows of a prefill program
BLOCK_N = 64             # keys per tile (4 blocks of 16)
MAX_SPLITS = 16
MIN_TILES_PER_SPLIT = 2
DEFAULT_SMS = 132        # H200; used when no CUDA device can be asked
# Split-KV aims at this many programs per SM: more splits cost a reduction that one wave does not repay.
PROGRAMS_PER_SM = 1
# Double-buffered K/V (num_stages 3, ~72 KB of shared memory) hides each tile's load behind the previous tile's
# math while a decode launch has few programs per SM; past this many, single-buffered programs (num_stages 2,
# ~40 KB) fit more per SM and hide the latency by their number (the wave counts: docs/benchmarks/gpu.md#launch-rule).
DOUBLE_BUFFERED_PROGRAMS_PER_SM = 2
# Pipeline depth of a decode launch past that many programs per SM ("crowded"): over 16-bit pages 2 stages, one
# K/V buffer, so 4 programs fit an SM; over E4M3 pages a tile is half the bytes and 3 stages (one tile in flight
# during a tile's math) still fit 4: 3-7 % off the launch (docs/benchmarks/gpu.md#crowded-decode-launches-over-e4m3-pages).
CROWDED_DECODE_STAGES = 2
CROWDED_DECODE_STAGES_E4M3 = 3
# E4M3 values widened to fp16 where loaded (e4m3_triton.e4m3_to_f16) up to this many query heads a KV head: with the
# crowded launch's 3 stages every GQA group measured, 4 to 8, is shorter widened
# (docs/benchmarks/gpu.md#attention-over-e4m3-pages).
WIDEN_V_MAX_GROUP = 8
# Four single-buffered programs of 4 warps fit an SM's 64 K registers only at <= 128 registers a thread. Where
# ptxas takes more, the warm-up caps the launch here so one wave still holds them; where it takes fewer, a cap
# would only add spills, so none is set (bench/kernel_report.py; docs/benchmarks/gpu.md#register-cap).
SINGLE_BUFFERED_MAX_REGISTERS = 128


def widen_values_at_load(kv_fp8: bool, compiled_for_cuda: bool, query_dtype: torch.dtype, group: int,
                         max_group: int = WIDEN_V_MAX_GROUP) -> bool:
    """Whether a launch widens its E4M3 values with ``e4m3_to_f16`` (PTX: a kernel compiled for NVIDIA GPUs, not the
    interpreter or ROCm) rather than leaving the cast to Triton: 16-bit queries, at most ``max_group`` query heads
    a KV head.

    >>> widen_values_at_load(True, True, torch.bfloat16, 8), widen_values_at_load(True, True, torch.bfloat16, 16)
    (True, False)
    """
    return kv_fp8 and compiled_for_cuda and query_dtype != torch.float32 and group <= max_group


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------------- kernels
@triton.jit
def _tile_keys(it, sink_tiles, win0, t_last, n_sink, ws, offs_n0, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Token indices of the ``it``-th live tile (sink tiles first, then window tiles) and which of them are live."""
    tile = tl.where(it < sink_tiles, it, it - sink_tiles + win0)
    offs_n = tile * BLOCK_N + offs_n0
    if HAS_WINDOW:
        live = (offs_n <= t_last) & ((offs_n < n_sink) | (offs_n >= ws))
    else:
        live = offs_n <= t_last
    return offs_n, live


@triton.jit
def _tile_blocks(it, sink_tiles, win0, t_last, n_sink, ws, wf, sink_blocks, bt_row, offs_n0,
                 BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Physical block id of every key of the ``it``-th live tile (0 where the key is not live)."""
    offs_n, live = _tile_keys(it, sink_tiles, win0, t_last, n_sink, ws, offs_n0, BLOCK_N, HAS_WINDOW)
    logical = offs_n // BLOCK_SIZE
    col = tl.where(logical < sink_blocks, logical, logical - wf + sink_blocks)
    return tl.load(bt_row + col, mask=live, other=0)


# ``num_splits`` and ``stride_bt`` (the block table's width) change from forward to forward. Triton would
# compile a variant for each value class it specialises ints on (== 1, multiple of 16, other) at its first
# launch, ~1 s inside a tick; ``warm_up`` compiles what is left (the constexpr variants) before the first
# tick. The other ints (head and cache strides, sinks, window, sink blocks) are fixed for an engine.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _paged_attn_fwd(
    Q, K, V, O, BT, WF, ITEMS, LSE_P, O_P, TIMES, KV_SCALE,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    qk_scale, sinks, window, sink_blocks, num_splits,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
    KV_I64: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr, TIMELINE: tl.constexpr,
    KV_FP8: tl.constexpr, WIDEN_V_AT_LOAD: tl.constexpr,
):
    item = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if KV_FP8:
        # E4M3 pages with one scale per KV head ([2, KVH]: keys, values): the key scale folds into the scores
        # and the value scale into the output, so a tile dequantises by its dtype conversion alone.
        qk_scale = qk_scale * tl.load(KV_SCALE + kvh)
        v_scale = tl.load(KV_SCALE + tl.num_programs(1) + kvh)
    if TIMELINE:
        # Stored at once, so no timer value stays live in registers through the loop.
        timeline_row = TIMES + ((split * tl.num_programs(0) + item) * tl.num_programs(1) + kvh) * 6
        tl.store(timeline_row + 1, globaltimer())
        tl.store(timeline_row + 3, _clock64())
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
    elif KV_FP8 and not IEEE:
        # E4M3 widens to fp16 in one conversion per pair, to bf16 in more: 16-bit queries and tiles multiply
        # in fp16 (the scores accumulate in float32 either way). A query past fp16's range saturates, not inf.
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = BT + seq * stride_bt
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    offs_n0 = tl.arange(0, BLOCK_N)

    # The physical block ids of tile ``it + 1`` are loaded while tile ``it`` is read: the K/V addresses then
    # come from a register rather than from a load in the same iteration, so the software pipeliner keeps two
    # K/V tiles in flight instead of waiting for each one (with the ids loaded in-loop, Triton 3.6 at
    # num_stages=3 single-buffers K/V: every tile's load latency is exposed).
    phys_next = _tile_blocks(lo, sink_tiles, win0, t_last, n_sink, ws, wf, sink_blocks, bt_row, offs_n0,
                             BLOCK_N, BLOCK_SIZE, HAS_WINDOW)
    for it in range(lo, hi):
        phys = phys_next
        offs_n, live = _tile_keys(it, sink_tiles, win0, t_last, n_sink, ws, offs_n0, BLOCK_N, HAS_WINDOW)
        if KV_I64:
            phys = phys.to(tl.int64)
        within = offs_n % BLOCK_SIZE
        k = tl.load(k_base + (phys * stride_kb + within * stride_ks)[None, :] + offs_d[:, None],
                    mask=live[None, :] & d_valid[:, None], other=0.0)
        v = tl.load(v_base + (phys * stride_vb + within * stride_vs)[:, None] + offs_d[None, :],
                    mask=live[:, None] & d_valid[None, :], other=0.0)
        phys_next = _tile_blocks(tl.minimum(it + 1, hi - 1), sink_tiles, win0, t_last, n_sink, ws, wf, sink_blocks,
                                 bt_row, offs_n0, BLOCK_N, BLOCK_SIZE, HAS_WINDOW)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:
            k = k.to(q.dtype)
            if WIDEN_V_AT_LOAD:
                # Left to Triton, the values' cast follows their change to the dot's layout: a bytewise gather.
                tl.static_assert(KV_FP8 and not IEEE, "values are widened from E4M3 to fp16 only")
                v = e4m3_to_f16(v)
            else:
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
    if KV_FP8:
        out = out * v_scale
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        base = ((split * tl.num_programs(0) + item) * tl.num_programs(1) + kvh) * BLOCK_M
        tl.store(LSE_P + base + rows, lse)
        tl.store(O_P + (base + rows)[:, None] * BLOCK_D + offs_d[None, :], out)
    else:
        tl.store(O + (q_row0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])
    if TIMELINE:
        tl.debug_barrier()   # every warp's stores issued: the end stamp covers the whole program
        _record_end(timeline_row, tl.maximum(hi - lo, 0))


@triton.jit
def _write_kv(K, V, KC, VC, SLOTS, KV_SCALE, stride_kt, stride_vt, ROW: tl.constexpr, HEAD_D: tl.constexpr,
              KV_HEADS: tl.constexpr, BLOCK: tl.constexpr, KV_FP8: tl.constexpr):
    """One token's keys and values (``ROW = KV heads x head_dim`` each) into its cache slot; E4M3 caches get
    ``x / scale`` of each head rounded onto the grid, as ``attention/fp8.to_e4m3`` writes them."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(K + t * stride_kt + offs, mask=mask, other=0.0)
    v = tl.load(V + t * stride_vt + offs, mask=mask, other=0.0)
    if KV_FP8:
        head = offs // HEAD_D
        k = e4m3_grid(tl.math.div_rn(k.to(tl.float32), tl.load(KV_SCALE + head, mask=mask, other=1.0)))
        v = e4m3_grid(tl.math.div_rn(v.to(tl.float32), tl.load(KV_SCALE + KV_HEADS + head, mask=mask, other=1.0)))
    tl.store(KC + slot * ROW + offs, k.to(KC.dtype.element_ty), mask=mask)
    tl.store(VC + slot * ROW + offs, v.to(VC.dtype.element_ty), mask=mask)


def _is_e4m3(cache: torch.Tensor, kv_scale: torch.Tensor | None, kv_heads: int) -> bool:
    """Whether ``cache`` holds E4M3 codes; raises unless ``kv_scale`` is then their contiguous float32 [2, KV heads]
    scales, and otherwise None."""
    kv_fp8 = cache.dtype == torch.float8_e4m3fn
    if kv_fp8 != (kv_scale is not None) or (kv_fp8 and (kv_scale.shape != (2, kv_heads) or not kv_scale.is_contiguous()
                                                         or kv_scale.dtype != torch.float32)):
        raise ValueError("E4M3 caches need their contiguous float32 scales [2, KV heads]; other caches none")
    return kv_fp8


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """``metadata.write_kv`` in one launch (torch takes two scatters, and four more kernels a side for E4M3):
    the new tokens' keys/values [T, KV heads, head_dim] into their slots of the paged caches."""
    tokens, kv_heads, head_dim = key.shape
    if tokens == 0:
        return
    kv_fp8 = _is_e4m3(k_cache, kv_scale, kv_heads)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("write_kv_triton writes contiguous caches")
    key, value = (x if x.stride(2) == 1 and x.stride(1) == head_dim else x.contiguous() for x in (key, value))
    row = kv_heads * head_dim
    _write_kv[(tokens,)](key, value, k_cache, v_cache, slot_mapping, kv_scale if kv_fp8 else slot_mapping,
                         key.stride(0), value.stride(0), ROW=row, HEAD_D=head_dim, KV_HEADS=kv_heads,
                         BLOCK=_next_pow2(row), KV_FP8=kv_fp8,
                         **({"num_warps": max(1, min(8, _next_pow2(row) // 256))} if key.is_cuda else {}))


@triton.jit
def _clock64():
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _record_end(row, n_tiles):
    """The rest of one program's row of a launch timeline, ``(SM, start ns, end ns, start clock, end clock,
    tiles read)``: after the output's stores, so the end covers the whole program."""
    tl.store(row + 4, _clock64())
    tl.store(row + 2, globaltimer())
    tl.store(row, smid().to(tl.int64))
    tl.store(row + 5, n_tiles.to(tl.int64))


@triton.jit(do_not_specialize=["num_splits"])
def _paged_attn_combine(
    O, ITEMS, LSE_P, O_P, stride_ot, stride_oh, num_splits,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_D: tl.constexpr,
):
    item = tl.program_id(0)
    kvh = tl.program_id(1)
    num_items = tl.num_programs(0)
    kv_heads = tl.num_programs(1)
    q_row0 = tl.load(ITEMS + item * 4 + 1)
    n_q = tl.load(ITEMS + item * 4 + 2)
    rows = tl.arange(0, BLOCK_M)
    tok = rows // G
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s in range(0, num_splits):
        base = ((s * num_items + item) * kv_heads + kvh) * BLOCK_M
        lse = tl.load(LSE_P + base + rows)
        o = tl.load(O_P + (base + rows)[:, None] * BLOCK_D + offs_d[None, :])
        m_new = tl.maximum(m, lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        w = tl.exp2(lse - m_use)
        l = l * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    head = kvh * G + rows % G
    tl.store(O + (q_row0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=(tok < n_q)[:, None] & (offs_d < HEAD_D)[None, :])


# ------------------------------------------------------------------------------------------ host plan
@dataclass
class TritonLaunch:
    """One kernel launch: the work items that share a ``BLOCK_M``."""

    block_m: int
    items: torch.Tensor        # [I, 4] int32 on the device: seq, first packed row, n_q, first token index
    num_items: int
    num_splits: int
    max_tiles: int
    workspace: dict = field(default_factory=dict)   # (dtype-independent) split partials, per head_dim
    num_stages: int = 3                              # software-pipeline depth (choose_stages)
    decode: bool = False                             # the launch of query tiles that fit a decode program
    block_n: int = BLOCK_N                           # keys per tile
    crowded: bool = False                            # a decode launch past DOUBLE_BUFFERED_PROGRAMS_PER_SM


@dataclass
class TritonPlan:
    meta: PagedAttentionMetadata
    num_heads: int
    num_kv_heads: int
    launches: list[TritonLaunch]
    num_warps: int | None = None    # None: 4 (8 for BLOCK_M > 64)
    num_stages: int | None = None   # None: each launch's own (2 for head_dim > 128)
    # ptxas register cap per thread for a crowded decode launch (None: ptxas chooses); see
    # SINGLE_BUFFERED_MAX_REGISTERS, and TritonPagedAttention.warm_up, which sets it where it pays. Prefill and
    # uncrowded decode launches are never capped: shared memory sets their occupancy, and a cap only spills.
    max_registers: int | None = None
    widen_v_max_group: int = WIDEN_V_MAX_GROUP   # E4M3 values widened where loaded up to this GQA group


def live_tiles(t0: int, n_q: int, sinks: int, window: int | None, block_n: int) -> int:
    """Key tiles a query tile (queries ``t0 .. t0 + n_q - 1``) visits; mirrors the kernel exactly."""
    t_last = t0 + n_q - 1
    if window is None:
        return _cdiv(t_last + 1, block_n)
    n_sink = min(sinks, t_last + 1)
    ws = max(n_sink, t0 - window)
    sink_tiles = _cdiv(n_sink, block_n)
    win0 = max(ws // block_n, sink_tiles)
    return sink_tiles + max(_cdiv(t_last + 1, block_n) - win0, 0)


def choose_splits(num_programs: int, max_tiles: int, *, target_programs: int, max_splits: int = MAX_SPLITS,
                  min_tiles_per_split: int = MIN_TILES_PER_SPLIT) -> int:
    """Split-KV factor: 1 when the launch already has ``target_programs`` programs, else enough splits to
    reach it, at most ``max_splits`` and keeping ``min_tiles_per_split`` tiles per split (host-only)."""
    if num_programs <= 0 or num_programs >= target_programs:
        return 1
    return max(1, min(max_splits, _cdiv(target_programs, num_programs), max_tiles // max(1, min_tiles_per_split)))


def crowded_stages_for(kv_dtype: torch.dtype) -> int:
    """The crowded decode launch's pipeline depth over pages of ``kv_dtype``.

    >>> crowded_stages_for(torch.bfloat16), crowded_stages_for(torch.float8_e4m3fn)
    (2, 3)
    """
    return CROWDED_DECODE_STAGES_E4M3 if kv_dtype == torch.float8_e4m3fn else CROWDED_DECODE_STAGES


def crowded(programs: int, num_sms: int, *, decode: bool) -> bool:
    """Whether a launch is a decode launch of more than ``DOUBLE_BUFFERED_PROGRAMS_PER_SM`` programs per SM."""
    return decode and programs > DOUBLE_BUFFERED_PROGRAMS_PER_SM * num_sms


def choose_stages(programs: int, num_sms: int, *, decode: bool, crowded_stages: int = CROWDED_DECODE_STAGES) -> int:
    """Pipeline depth of a launch of ``programs`` programs (host-only): 3 (two K/V tiles in flight per program)
    unless it is a crowded decode launch, then ``crowded_stages``.

    >>> choose_stages(64 * 4, 132, decode=True), choose_stages(128 * 4, 132, decode=True)
    (3, 2)
    """
    return crowded_stages if crowded(programs, num_sms, decode=decode) else 3


def plan_triton(meta: PagedAttentionMetadata, num_heads: int, num_kv_heads: int, *, num_sms: int = DEFAULT_SMS,
                target_programs: int | None = None, max_splits: int = MAX_SPLITS,
                min_tiles_per_split: int = MIN_TILES_PER_SPLIT, force_splits: int | None = None,
                decode_block_m: int = DECODE_BLOCK_M, prefill_block_m: int = PREFILL_BLOCK_M,
                block_n: int = BLOCK_N, decode_block_n: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None, max_registers: int | None = None,
                crowded_stages: int = CROWDED_DECODE_STAGES, widen_v_max_group: int = WIDEN_V_MAX_GROUP) -> TritonPlan:
    """Launch plan of one forward, from the metadata's host lists (shared by every layer). ``decode_block_n``:
    the decode launch's keys per tile (None: ``block_n``, as the prefill launch); ``crowded_stages``: the
    pipeline depth of a crowded decode launch (``choose_stages``); ``widen_v_max_group``: see
    ``widen_values_at_load``."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    for width in (block_n, decode_block_n or block_n):
        if width < 16 or width & (width - 1):
            raise ValueError(f"keys per tile must be a power of two of at least 16, got {width}")
    g = num_heads // num_kv_heads
    target = target_programs if target_programs is not None else PROGRAMS_PER_SM * num_sms
    bm_small = max(decode_block_m, _next_pow2(g))
    bm_large = max(prefill_block_m, _next_pow2(g))
    groups: dict[int, list[list[int]]] = {bm_small: [], bm_large: []}
    tiles: dict[int, int] = {bm_small: 0, bm_large: 0}
    widths = {bm_large: block_n, bm_small: decode_block_n or block_n}   # bm_small wins where the two are equal
    start = 0
    for b, (qlen, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
        bm = bm_small if qlen * g <= bm_small else bm_large
        per_tile = bm // g
        first = ctx - qlen
        for off in range(0, qlen, per_tile):
            n_q = min(per_tile, qlen - off)
            groups[bm].append([b, start + off, n_q, first + off])
            tiles[bm] = max(tiles[bm], live_tiles(first + off, n_q, meta.sinks, meta.window, widths[bm]))
        start += qlen
    device = meta.query_start.device
    launches = []
    for bm, items in groups.items():
        if not items:
            continue
        if force_splits is not None:
            splits = max(1, int(force_splits))
        else:
            splits = choose_splits(len(items) * num_kv_heads, tiles[bm], target_programs=target,
                                   max_splits=max_splits, min_tiles_per_split=min_tiles_per_split)
        programs = len(items) * num_kv_heads * splits
        stages = choose_stages(programs, num_sms, decode=bm == bm_small, crowded_stages=crowded_stages)
        launches.append(TritonLaunch(bm, to_device(torch.tensor(items, dtype=torch.int32).reshape(-1, 4), device),
                                     len(items), splits, tiles[bm], num_stages=stages,
                                     decode=bm == bm_small, block_n=widths[bm],
                                     crowded=crowded(programs, num_sms, decode=bm == bm_small)))
    return TritonPlan(meta, num_heads, num_kv_heads, launches, num_warps, num_stages, max_registers, widen_v_max_group)


# ----------------------------------------------------------------------------------------------- launch
def launch_stages(plan: TritonPlan, launch: TritonLaunch, head_dim: int) -> int:
    """The ``num_stages`` a launch compiles with: the plan's override, else the launch's own (at most 2 past a
    head_dim of 128, where three buffers would not fit in shared memory)."""
    return plan.num_stages or (launch.num_stages if head_dim <= 128 else min(2, launch.num_stages))


def _launch_config(plan: TritonPlan, launch: TritonLaunch, head_dim: int, is_cuda: bool) -> dict:
    if not is_cuda:
        return {}
    return {"num_warps": plan.num_warps or (4 if launch.block_m <= 64 else 8),
            "num_stages": launch_stages(plan, launch, head_dim),
            **({"maxnreg": plan.max_registers} if plan.max_registers and launch.crowded else {})}


def paged_attention_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: PagedAttentionMetadata, scale: float | None = None,
                           plan: TritonPlan | None = None, out: torch.Tensor | None = None,
                           timelines: list[torch.Tensor] | None = None, kernels: list | None = None,
                           kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``query`` [T, H, D] over the paged cache; returns [T, H, D] in ``query.dtype``.

    ``kv_scale``: the per-KV-head scales [2, KVH] (float32) of E4M3 caches (``attention/fp8.py``); required
    with them, and only with them.

    ``timelines`` (CUDA only, for benchmarks): one int64 tensor per launch of the plan, ``[splits, items,
    KV heads, 6]``, that each program fills with its SM, start and end (``%globaltimer`` ns), start and end
    clock (its SM's cycles) and tiles read, to see a launch's waves and gaps. Without it the probe is compiled
    out. ``kernels``: each launch's compiled forward kernel is appended to it (its ``n_regs`` once launched on a
    GPU; ``None`` under the interpreter)."""
    t, heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    if plan is None:
        plan = plan_triton(meta, heads, kv_heads)
    if plan.num_heads != heads or plan.num_kv_heads != kv_heads:
        raise ValueError("plan was built for other head counts")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' last dimension must be contiguous")
    kv_fp8 = _is_e4m3(k_cache, kv_scale, kv_heads)
    if out is None:
        out = torch.empty((t, heads, head_dim), dtype=query.dtype, device=query.device)
    if t == 0:
        return out
    interp = triton_interpreted() or not query.is_cuda
    g = heads // kv_heads
    block_d = max(16, _next_pow2(head_dim))
    qk_scale = (scale if scale is not None else 1.0 / math.sqrt(head_dim)) * LOG2E
    kv_i64 = max(k_cache.numel(), v_cache.numel()) >= 2**31 - 1
    tables = meta.block_tables
    if tables.dtype != torch.int32 or tables.stride(-1) != 1:
        tables = tables.to(torch.int32).contiguous()
    window = meta.window if meta.window is not None else 0
    common = dict(G=g, BLOCK_D=block_d, HEAD_D=head_dim, BLOCK_SIZE=meta.block_size,
                  HAS_WINDOW=meta.window is not None, KV_I64=kv_i64, DOT_F32=interp,
                  IEEE=query.dtype == torch.float32, KV_FP8=kv_fp8,
                  WIDEN_V_AT_LOAD=widen_values_at_load(kv_fp8, not interp and torch.version.hip is None,
                                                       query.dtype, g, plan.widen_v_max_group))
    if timelines is not None:
        if interp:
            raise ValueError("launch timelines read GPU clocks: they need compiled kernels on a CUDA device")
        if len(timelines) != len(plan.launches) or any(
                t.dtype != torch.int64 or t.shape != (ln.num_splits, ln.num_items, kv_heads, 6)
                or not t.is_contiguous() for t, ln in zip(timelines, plan.launches)):
            raise ValueError("timelines: one int64 [splits, items, KV heads, 6] tensor per launch of the plan")
    for i, ln in enumerate(plan.launches):
        split = ln.num_splits > 1
        if split:
            key = (block_d, str(query.device))
            ws = ln.workspace.get(key)
            if ws is None:
                lse_p = torch.empty((ln.num_splits, ln.num_items, kv_heads, ln.block_m), dtype=torch.float32,
                                    device=query.device)
                o_p = torch.empty((ln.num_splits, ln.num_items, kv_heads, ln.block_m, block_d),
                                  dtype=torch.float32, device=query.device)
                ws = ln.workspace[key] = (lse_p, o_p)
            lse_p, o_p = ws
        else:
            lse_p = o_p = out  # unused
        cfg = _launch_config(plan, ln, head_dim, query.is_cuda)
        times = timelines[i] if timelines is not None else ln.items  # unused without a timeline
        kernel = _paged_attn_fwd[(ln.num_items, kv_heads, ln.num_splits)](
            query, k_cache, v_cache, out, tables, meta.window_first, ln.items, lse_p, o_p, times,
            kv_scale if kv_fp8 else ln.items,  # unused for float caches
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            tables.stride(0),
            qk_scale, meta.sinks, window, meta.sink_blocks, ln.num_splits,
            BLOCK_M=ln.block_m, BLOCK_N=ln.block_n, SPLIT=split, TIMELINE=timelines is not None, **common, **cfg)
        if kernels is not None:
            kernels.append(kernel)
        if split:
            _paged_attn_combine[(ln.num_items, kv_heads)](
                out, ln.items, lse_p, o_p, out.stride(0), out.stride(1), ln.num_splits,
                G=g, BLOCK_M=ln.block_m, BLOCK_D=block_d, HEAD_D=head_dim,
                **({"num_warps": 4} if query.is_cuda else {}))
    return out


class TritonPagedAttention:
    """The Triton attention backend (same interface as ``TorchPagedAttention``): writes K/V, then attends.

    ``num_kv_heads`` lets :meth:`prepare` build the full launch plan; without it the plan is completed at
    the first layer's call (the cache shape gives the KV heads) and reused by the remaining layers.
    """

    name = "triton"

    def __init__(self, num_heads: int, scale: float | None = None, num_kv_heads: int | None = None, *,
                 num_sms: int | None = None, target_programs: int | None = None, max_splits: int = MAX_SPLITS,
                 force_splits: int | None = None, decode_block_m: int = DECODE_BLOCK_M,
                 prefill_block_m: int = PREFILL_BLOCK_M, block_n: int = BLOCK_N, decode_block_n: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None,
                 max_registers: int | None = None, crowded_stages: int | None = None,
                 kv_dtype: torch.dtype = torch.bfloat16, widen_v_max_group: int = WIDEN_V_MAX_GROUP) -> None:
        """``crowded_stages``: a crowded decode launch's pipeline depth (None: ``crowded_stages_for(kv_dtype)``, the
        pages' element type)."""
        if crowded_stages is None:
            crowded_stages = crowded_stages_for(kv_dtype)
        self.num_heads = num_heads
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        if num_sms is None:
            num_sms = (torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
                       if torch.cuda.is_available() else DEFAULT_SMS)
        self.options = dict(num_sms=num_sms, target_programs=target_programs, max_splits=max_splits,
                            force_splits=force_splits, decode_block_m=decode_block_m,
                            prefill_block_m=prefill_block_m, block_n=block_n, decode_block_n=decode_block_n,
                            num_warps=num_warps,
                            num_stages=num_stages, max_registers=max_registers, crowded_stages=crowded_stages,
                            widen_v_max_group=widen_v_max_group)

    @property
    def decode_block_n(self) -> int:
        """Keys per tile of the decode launch."""
        return self.options["decode_block_n"] or self.options["block_n"]

    def _plan(self, meta: PagedAttentionMetadata, num_kv_heads: int) -> TritonPlan:
        return plan_triton(meta, self.num_heads, num_kv_heads, **self.options)

    def prepare(self, meta: PagedAttentionMetadata) -> TritonPlan | PagedAttentionMetadata:
        if self.num_kv_heads is None:
            return _LazyPlan(meta)
        return self._plan(meta, self.num_kv_heads)

    def warm_up(self, k_cache: torch.Tensor, v_cache: torch.Tensor, *, block_size: int, sinks: int,
                window: int | None, sink_blocks: int, block: int,
                dtype: torch.dtype, kv_scale: torch.Tensor | None = None) -> set[tuple[int, bool, int]]:
        """Launch every kernel variant a forward can use once, before the first step: decode and prefill
        tiles, each without and with split-KV, and an unsplit crowded decode tile (what a decode launch of many
        programs uses, see :func:`choose_stages`). A variant compiles at its first launch,
        about a second on an H200; inside a served tick that was a one-off tick of 1.4 s
        (docs/experiments/admission-gpu-short).

        Reads and writes cache block ``block`` only (the runner's scratch block; ``kv_scale``: an E4M3 cache's
        scales): the K/V write kernel is compiled by writing zeros to its first slot. Returns the
        ``(BLOCK_M, split, num_stages)`` triples launched, e.g. ``{(16, False, 3), (16, True, 3), (16, False, 2), (64, False, 3), (64, True, 3)}``.

        On a GPU it also settles the crowded decode launch's register cap, unless one was given: where
        ptxas compiled that kernel past ``SINGLE_BUFFERED_MAX_REGISTERS``, ``options["max_registers"]`` caps it
        there (and the capped kernel is compiled too), so plans made after this keep 4 programs per SM.
        """
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        g = self.num_heads // kv_heads
        bm_small = max(self.options["decode_block_m"], _next_pow2(g))
        dev = k_cache.device
        launched: set[tuple[int, bool, int]] = set()
        for n_q in (1, bm_small // g + 1):                # a decode tile, then a prefill tile
            # three key tiles: both halves of a split have work
            ctx = 2 * max(self.options["block_n"], self.decode_block_n) + n_q
            width = _cdiv(ctx, block_size)
            meta = PagedAttentionMetadata(
                block_size=block_size, sinks=sinks, window=window, sink_blocks=sink_blocks,
                query_lens=[n_q], context_lens=[ctx],
                query_start=torch.tensor([0, n_q], dtype=torch.long, device=dev),
                context_lens_t=torch.tensor([ctx], dtype=torch.long, device=dev),
                block_tables=torch.full((1, width), block, dtype=torch.int32, device=dev),
                # sink_blocks here makes every logical block its own table column (see token_slots)
                window_first=torch.tensor([sink_blocks], dtype=torch.long, device=dev),
                slot_mapping=torch.zeros(n_q, dtype=torch.long, device=dev))
            query = torch.zeros((n_q, self.num_heads, head_dim), dtype=dtype, device=dev)
            crowded_stages = self.options["crowded_stages"]
            for splits, stages in [(1, None), (2, None)] + ([(1, crowded_stages)] if n_q == 1 else []):
                plan = plan_triton(meta, self.num_heads, kv_heads, **{**self.options, "force_splits": splits})
                if stages is not None:
                    plan.launches = [dataclasses.replace(ln, num_stages=stages, crowded=True) for ln in plan.launches]
                kernels: list = []
                paged_attention_triton(query, k_cache, v_cache, meta, self.scale, plan, kernels=kernels,
                                       kv_scale=kv_scale)
                launched.update((ln.block_m, ln.num_splits > 1, launch_stages(plan, ln, head_dim))
                                for ln in plan.launches)
                registers = getattr(kernels[0], "n_regs", None) if kernels else None
                if (stages is not None and self.options["max_registers"] is None and registers is not None
                        and registers > SINGLE_BUFFERED_MAX_REGISTERS):
                    self.options["max_registers"] = SINGLE_BUFFERED_MAX_REGISTERS
                    plan.max_registers = SINGLE_BUFFERED_MAX_REGISTERS
                    paged_attention_triton(query, k_cache, v_cache, meta, self.scale, plan, kv_scale=kv_scale)
        zeros = torch.zeros((1, kv_heads, head_dim), dtype=dtype, device=dev)
        write_kv_triton(zeros, zeros, k_cache, v_cache,
                        torch.full((1,), block * block_size, dtype=torch.long, device=dev), kv_scale)
        return launched

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, plan,
                 kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(plan, _LazyPlan):
            if plan.plan is None:
                plan.plan = self._plan(plan.meta, k_cache.shape[2])
            plan = plan.plan
        write_kv_triton(key, value, k_cache, v_cache, plan.meta.slot_mapping, kv_scale)
        return paged_attention_triton(query, k_cache, v_cache, plan.meta, self.scale, plan, kv_scale=kv_scale)


@dataclass
class _LazyPlan:
    meta: PagedAttentionMetadata
    plan: TritonPlan | None = None
