"""Decode rounds over a dense copy of each session's live keys, gathered once per step (the CPU path).

The reference gathers every decoding session's sink + window keys out of the paged cache in every
layer of every round; on a CPU that copy costs more than the attention it feeds. A ``DecodeWindow``
copies them once, in the step's first decode round, into per-layer dense buffers with room to grow.
Each later round appends its one new key/value per session and attends with one call per layer over all
sessions (the C kernel of ``cpu_kernel.py`` where it is built, else SDPA), with a token-granular mask (the
window slides one token a round; keys behind it stay in the buffer, masked). The paged cache stays the truth and is written every round too.

A session is gathered again when it joins, when its keys moved in the cache (a rebase re-rotated them)
or when its buffer row is full (the fresh gather drops the keys behind the window); sessions that
leave are dropped by compacting the rows. E4M3 pages stay E4M3 in the buffers (half the bytes a round reads),
their per-head scales applied by the kernel. The buffers stay allocated between steps (about one more
copy of the decoding sessions' live K/V, up to half again as many rows and twice the columns as slack for
growth), zero-initialised once, so padding is always finite and a freed block is never read.

``attend_qkv`` is the same call for a layer's fused projection rows (``models/cpu_decode_round.py``): in a round
that only appends to float32 or bfloat16 buffers, its writes and the attention are direct calls to the C kernels,
whose operands the round's plan checked once for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from metronome.attention.cpu_kernel import DTYPES, KV_KINDS, CpuDecodeKernel, check_attention
from metronome.attention.fp8 import E4M3
from metronome.attention.metadata import PagedAttentionMetadata, e4m3_codes, write_kv
from metronome.attention.reference import live_keys

# Spare columns per row beyond the longest gathered row: rounds append into them.
SPARE_COLUMNS = 32
# Columns grow by at least this fraction, in steps of COLUMN_STEP (a bounded session's up to the most it can
# hold): live keys grow every step until a window is full, and regrowing (fresh zeroed memory for every layer's
# buffers, then a copy) each step costs more than the slack.
COLUMN_GROWTH, COLUMN_STEP = 1.0, 64
# Rows grow by at least half, in steps of ROW_STEP: sessions join one at a time, and growing exactly to each new
# count would zero and copy every layer's buffers at every join.
ROW_GROWTH, ROW_STEP = 0.5, 4


@dataclass(frozen=True)
class DecodeRoundPlan:
    """One decode round: where each new key goes in the buffers, which rows are (re)gathered, the mask."""

    meta: PagedAttentionMetadata
    window: DecodeWindow
    append_q: torch.Tensor | None  # query rows appended (None: rows 0..n-1, all of them)
    append_at: torch.Tensor        # [appended * kv_heads] flat (row, head, column) index of each new key
    gather_rows: torch.Tensor | None   # rows gathered whole from the cache this round
    gather_slots: torch.Tensor | None  # [rows, columns] the cache slot of each column (0, the null block, padding)
    mask: torch.Tensor             # [rows, 1, 1, width] bool, True = attend
    width: int                     # columns attended
    # With the C kernel, the gather as row copies: cache rows [slot * kv_heads + head] to buffer rows
    # [(row * kv_heads + head) * columns + column], the padding from the null block as above (a masked column still
    # meets its value with weight 0, so a stale non-finite value left by a row's earlier session would show).
    gather_from: torch.Tensor | None = None
    gather_to: torch.Tensor | None = None
    direct: DirectRound | None = None   # ``attend_qkv``'s direct calls, where the round allows them


@dataclass(frozen=True)
class DirectRound:
    """What ``DecodeWindow.attend_qkv`` hands the C kernels in every layer of a round, checked once when the round
    is planned: the new rows' cache slots and buffer rows (int64), the mask's bytes, and the row counts that bound
    the scatters' indices (the C checks each index against them)."""

    slots: int           # address of meta.slot_mapping [n]
    append_at: int       # address of the plan's append_at [n * kv_heads]
    mask: int            # address of the mask [n, width], contiguous bools
    cache_rows: int      # rows of kv_heads * head_dim elements in a layer's cache
    buffer_rows: int     # rows of head_dim elements in a layer's buffer


class DecodeWindow:
    """Per-layer dense K/V rows for the sessions of one step's decode rounds, in the rounds' order. It is
    the attention backend of those rounds (same call as ``TorchPagedAttention``, with a ``DecodeRoundPlan``)."""

    name = "torch-decode-window"

    def __init__(self, kv_caches: list[tuple[torch.Tensor, ...]], num_heads: int,
                 scale: float | None = None, max_live_keys: int | None = None,
                 kernel: CpuDecodeKernel | None = None) -> None:
        """``max_live_keys``: the most keys a session can hold (a bounded policy's sinks + window, with the
        partial blocks at its ends), which caps the columns' growth slack; None: unbounded. ``kernel``: the
        C kernel that attends, for the caches' dtype and head dim (``cpu_kernel.kernel_for``; None: SDPA)."""
        self.max_columns = None if max_live_keys is None else max_live_keys + SPARE_COLUMNS
        self.kv_caches = kv_caches
        self.num_heads = num_heads
        self.scale = scale
        self.kernel = kernel
        self.layers = {k.data_ptr(): i for i, (k, *_) in enumerate(kv_caches)}
        self.device = kv_caches[0][0].device
        self.kv_heads, self.head_dim = kv_caches[0][0].shape[2:]
        # [rows_cap, kv_heads, cols_cap, head_dim]: head-major, the layout the CPU SDPA kernel reads fastest
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.rows_cap = self.cols_cap = 0
        self.begin()

    # ------------------------------------------------------------------ per step
    def begin(self) -> None:
        """A new step: no session has rows yet (the buffers' storage is kept)."""
        self.ids: list[int] = []
        self.fill = np.zeros(0, dtype=np.int64)     # columns used per row
        # [rows, cols_cap]: the logical token in each buffer column, -1 where empty
        self.tokens = torch.empty(0, self.cols_cap, dtype=torch.long, device=self.device)
        self.moved: set[int] = set()

    def mark_moved(self, session_ids) -> None:
        """These sessions' keys were re-rotated in the cache: gather them again next round."""
        self.moved.update(session_ids)

    def release(self) -> None:
        """Drop the buffers and the cache references (the engine is closing)."""
        self.buffers, self.rows_cap, self.cols_cap = [], 0, 0
        self.kv_caches, self.layers = [], {}
        self.begin()

    # ------------------------------------------------------------------ planning (host side, once a round)
    def plan_round(self, meta: PagedAttentionMetadata, session_ids: list[int]) -> DecodeRoundPlan:
        """Plan a round of one new token per session (``meta``'s sequences, in ``session_ids`` order)."""
        if any(q != 1 for q in meta.query_lens):
            raise ValueError("a decode round has one query token per session")
        n = len(session_ids)
        gather = self._arrange(session_ids)
        new_token = np.asarray(meta.context_lens, dtype=np.int64) - 1
        full = np.flatnonzero(self.fill >= self.cols_cap)
        gather = sorted(set(gather) | set(full.tolist()))
        fresh = live_keys(meta, gather) if gather else None
        need = max([self.cols_cap] + ([fresh.token.shape[1] + SPARE_COLUMNS] if fresh else []))
        if need > self.cols_cap:
            slack = -(-int(self.cols_cap * (1 + COLUMN_GROWTH)) // COLUMN_STEP) * COLUMN_STEP
            need = max(need, slack if self.max_columns is None else min(slack, self.max_columns))
        if n > self.rows_cap or need > self.cols_cap:
            self._grow(self._rows_for(n), need)
        cols, device = self.cols_cap, self.device

        gather_rows = gather_slots = gather_from = gather_to = None
        if fresh is not None:   # whole rows: the columns past the live keys read the null block (zeros)
            gather_rows = torch.tensor(gather, device=device)
            width = fresh.token.shape[1]
            self.tokens[gather_rows] = -1
            self.tokens[gather_rows, :width] = torch.where(fresh.valid, fresh.token, -1)
            self.fill[gather] = fresh.count
            gather_slots = torch.zeros(len(gather), cols, dtype=torch.long, device=device)
            gather_slots[:, :width] = fresh.slots
            if self.kernel is not None:
                heads = torch.arange(self.kv_heads, device=device)[None, :, None]
                gather_from = (gather_slots[:, None, :] * self.kv_heads + heads).flatten()
                gather_to = ((gather_rows[:, None, None] * self.kv_heads + heads) * cols
                             + torch.arange(cols, device=device)).flatten()
        append = np.setdiff1d(np.arange(n), gather, assume_unique=True)
        columns = self.fill[append]
        on = lambda a: torch.from_numpy(a).to(device)  # noqa: E731  (host plans, the device indexes)
        self.tokens[on(append), on(columns)] = on(new_token[append])
        self.fill[append] += 1
        heads = np.arange(self.kv_heads)
        append_at = on(((append[:, None] * self.kv_heads + heads) * cols + columns[:, None]).ravel())
        append_q = None if len(append) == n else on(append)

        width = int(self.fill.max())
        tokens = self.tokens[:n, :width]
        t = on(new_token)[:, None]
        mask = (tokens >= 0) & (tokens <= t)
        if meta.window is not None:
            mask &= (tokens < meta.sinks) | (tokens >= t - meta.window)
        direct, k_cache = None, self.kv_caches[0][0]
        if (self.kernel is not None and fresh is None and append_q is None and k_cache.dtype != E4M3
                and meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.is_contiguous()
                and meta.slot_mapping.shape == (n,) and mask.is_contiguous()):
            direct = DirectRound(meta.slot_mapping.data_ptr(), append_at.data_ptr(), mask.data_ptr(),
                                 k_cache.numel() // (self.kv_heads * self.head_dim),
                                 self.rows_cap * self.kv_heads * self.cols_cap)
        return DecodeRoundPlan(meta, self, append_q, append_at, gather_rows, gather_slots,
                               mask[:, None, None, :], width, gather_from, gather_to, direct)

    def _arrange(self, session_ids: list[int]) -> list[int]:
        """Put the rows in ``session_ids`` order (compacting away sessions that left); returns the new rows
        to gather (sessions that joined or whose keys moved)."""
        if session_ids == self.ids:
            moved = [i for i, sid in enumerate(session_ids) if sid in self.moved]
            self.moved.clear()
            return moved
        if len(session_ids) > self.rows_cap:
            self._grow(self._rows_for(len(session_ids)), self.cols_cap)
        where = {sid: i for i, sid in enumerate(self.ids)}
        source = [where.get(sid, -1) for sid in session_ids]
        kept = [i for i, s in enumerate(source) if s >= 0]
        origin = [source[i] for i in kept]
        if origin != kept:
            self._move_rows(origin, kept)
        fill = np.zeros(len(session_ids), dtype=np.int64)
        fill[kept] = self.fill[origin]
        tokens = torch.full((len(session_ids), self.cols_cap), -1, dtype=torch.long, device=self.device)
        if kept:
            tokens[kept] = self.tokens[origin]
        self.ids, self.fill, self.tokens = list(session_ids), fill, tokens
        gather = [i for i, (sid, s) in enumerate(zip(session_ids, source)) if s < 0 or sid in self.moved]
        self.moved.clear()
        return gather

    def _rows_for(self, n: int) -> int:
        """Row capacity for ``n`` sessions: the current one if it holds them, else grown with slack."""
        if n <= self.rows_cap:
            return self.rows_cap
        slack = -(-int(self.rows_cap * (1 + ROW_GROWTH)) // ROW_STEP) * ROW_STEP
        return max(n, slack, ROW_STEP)

    def _move_rows(self, source: list[int], dest: list[int]) -> None:
        """Copy buffer rows ``source`` to rows ``dest`` in every layer (through a copy: they may overlap)."""
        src, dst = torch.tensor(source, device=self.device), torch.tensor(dest, device=self.device)
        for pair in self.buffers:
            for buf in map(_bytes, pair):
                buf.index_copy_(0, dst, buf.index_select(0, src))

    def _grow(self, rows: int, cols: int) -> None:
        """Larger zeroed buffers holding what the current ones hold."""
        old_rows, old_cols = self.rows_cap, self.cols_cap
        grown = []
        for k_cache, *_ in self.kv_caches:
            shape = (rows, self.kv_heads, cols, self.head_dim)
            grown.append(tuple(torch.zeros(shape, dtype=k_cache.dtype, device=k_cache.device) for _ in range(2)))
        for (k_new, v_new), (k_old, v_old) in zip(grown, self.buffers):
            k_new[:old_rows, :, :old_cols] = k_old
            v_new[:old_rows, :, :old_cols] = v_old
        self.buffers, self.rows_cap, self.cols_cap = grown, rows, cols
        tokens = torch.full((len(self.ids), cols), -1, dtype=torch.long, device=self.device)
        if old_cols:
            tokens[:, :old_cols] = self.tokens
        self.tokens = tokens

    # ------------------------------------------------------------------ per layer
    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, plan: DecodeRoundPlan, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Write the round's K/V to the cache and the buffers, then attend: ``query`` [n, heads, head_dim].

        ``kv_scale`` [2, kv_heads]: the pages (and so the buffers) hold E4M3 codes of ``x / scale``."""
        if (kv_scale is not None) != (k_cache.dtype == E4M3):
            raise ValueError("E4M3 pages come with their scales [2, KV heads], and other pages without")
        kernel, kv_heads, head_dim = self.kernel, self.kv_heads, self.head_dim
        if kv_scale is not None:   # quantised once, for the cache and the buffers alike
            key, value = e4m3_codes(key, value, kv_scale, kernel)
        write_kv(key, value, k_cache, v_cache, plan.meta.slot_mapping, kernel=kernel)
        k_buf, v_buf = self.buffers[self.layers[k_cache.data_ptr()]]
        if plan.append_q is not None:
            key, value = key.index_select(0, plan.append_q), value.index_select(0, plan.append_q)
        for buf, x in ((k_buf, key), (v_buf, value)):     # the C row scatter where built, as write_kv
            rows = _bytes(buf).view(-1, head_dim)
            if kernel is None or not kernel.scatter_rows_(x, rows, plan.append_at):
                rows.index_copy_(0, plan.append_at, x.reshape(-1, head_dim).to(rows.dtype))
        if plan.gather_rows is not None:
            rows, slots = plan.gather_slots.shape
            for buf, cache in ((k_buf, k_cache), (v_buf, v_cache)):
                buf, cache = _bytes(buf), _bytes(cache)
                if plan.gather_from is not None and kernel.copy_rows_(
                        cache.view(-1, head_dim), plan.gather_from, buf.view(-1, head_dim), plan.gather_to):
                    continue
                gathered = cache.view(-1, kv_heads, head_dim).index_select(0, plan.gather_slots.flatten())
                buf.index_copy_(0, plan.gather_rows, gathered.view(rows, slots, kv_heads, head_dim).transpose(1, 2))
        n, heads = query.shape[:2]
        # The query heads that share a KV head (GQA's repeat_interleave order) stand as that head's query rows:
        # each KV head is read once, where SDPA's enable_gqa on the CPU expands K/V per query head first.
        grouped = query.view(n, kv_heads, heads // kv_heads, head_dim)
        if self.kernel is not None:
            scale = self.scale if self.scale is not None else head_dim ** -0.5
            o = self.kernel(grouped, k_buf, v_buf, plan.mask.view(n, plan.width), scale, kv_scale)
        else:
            k, v = k_buf[:n, :, :plan.width], v_buf[:n, :, :plan.width]
            if kv_scale is not None:   # dequantised as the reference does it
                k, v = (x.float() * s[:, None, None] for x, s in ((k, kv_scale[0]), (v, kv_scale[1])))
            o = F.scaled_dot_product_attention(grouped, k.to(query.dtype), v.to(query.dtype), attn_mask=plan.mask,
                                               scale=self.scale)
        return o.reshape(n, heads, head_dim)

    def attend_qkv(self, qkv: torch.Tensor, kv: tuple[torch.Tensor, ...], plan: DecodeRoundPlan) -> torch.Tensor:
        """``__call__`` for one layer's fused projection ``qkv`` [n, (heads + 2 * kv_heads) * head_dim] (each row
        q, k, v side by side, q and k rotated) over its cache ``kv``; returns [n, heads * head_dim]. Where the
        round only appends to float32 or bfloat16 buffers (``plan.direct``), the cache's and buffers' new rows and
        the attention are four direct calls to the C kernels, their operands checked when the round was
        planned; else ``__call__`` does the work."""
        n, d, kv_heads = qkv.shape[0], self.head_dim, self.kv_heads
        q_width, kv_width = self.num_heads * d, kv_heads * d
        direct = plan.direct
        if (direct is None or qkv.dtype not in DTYPES or qkv.dtype != self.kv_caches[0][0].dtype or qkv.dim() != 2
                or qkv.shape[1] != q_width + 2 * kv_width or qkv.stride(1) != 1 or n != len(self.ids)):
            q, k, v = qkv.split((q_width, kv_width, kv_width), dim=-1)
            o = self(q.view(n, self.num_heads, d), k.view(n, kv_heads, d), v.view(n, kv_heads, d), kv[0], kv[1],
                     plan, kv[2] if len(kv) > 2 else None)
            return o.reshape(n, q_width)
        cdll, size = self.kernel.library.cdll, qkv.element_size()
        row_bytes = qkv.stride(0) * size
        k_rows = qkv.data_ptr() + q_width * size
        v_rows = k_rows + kv_width * size
        k_buf, v_buf = self.buffers[self.layers[kv[0].data_ptr()]]
        for rows, cache, buf in ((k_rows, kv[0], k_buf), (v_rows, kv[1], v_buf)):
            if (cdll.metronome_scatter_rows(n, 1, kv_width * size, rows, row_bytes, 0, cache.data_ptr(),
                                            direct.cache_rows, direct.slots)
                    or cdll.metronome_scatter_rows(n, kv_heads, d * size, rows, row_bytes, d * size, buf.data_ptr(),
                                                   direct.buffer_rows, direct.append_at)):
                raise IndexError("a decode round's slot or buffer row is outside the cache or the buffers")
        query = qkv[:, :q_width].contiguous()
        out = torch.empty((n, q_width), dtype=qkv.dtype)
        scale = self.scale if self.scale is not None else d ** -0.5
        check_attention(cdll.metronome_decode_attention(
            n, kv_heads, self.num_heads // kv_heads, d, plan.width, DTYPES[qkv.dtype], KV_KINDS[qkv.dtype],
            query.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), k_buf.stride(0), k_buf.stride(1), direct.mask,
            plan.width, None, out.data_ptr(), scale, torch.get_num_threads()))
        return out


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """E4M3 tensors as their bytes: index_copy_ and index_select have no float8 kernels on the CPU."""
    return x.view(torch.uint8) if x.dtype == E4M3 else x
