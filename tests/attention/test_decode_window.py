"""Decode rounds over the step's gathered window against a float64 dense masked softmax, round by round.

A small paged cache is driven the way the engine drives it: every round each session appends one token
(a new block when it needs one), blocks behind the window are freed and filled with NaN (as if another
session had taken them), sessions leave and join between rounds and one session's keys are re-rotated
in the cache (a rebase). Every round's output must equal the oracle over that session's whole history.
"""

from __future__ import annotations

import random

import pytest
import torch

import metronome.attention.decode_window as dw
from metronome.attention.cpu_kernel import load_kernel
from metronome.native import find_compiler
from metronome.attention.decode_window import DecodeWindow
from metronome.attention.fp8 import E4M3, to_e4m3
from metronome.attention.metadata import PagedAttentionMetadata
from tests.attention.test_reference import dense_oracle

HEADS, KV_HEADS, DIM = 4, 2, 16


class PagedSim:
    """Sessions' keys/values in token order (the truth) and in a paged cache of ``layers`` layers. ``kv_scale``
    [2, KV_HEADS]: E4M3 pages holding ``x / scale``; the truth's values are drawn on that grid, so the pages hold
    the truth exactly (powers of two keep the products exact)."""

    def __init__(self, sinks, window, block_size, layers=2, num_blocks=400, seed=0, dtype=torch.float64,
                 kv_scale=None):
        self.sinks, self.window, self.bs, self.dtype = sinks, window, block_size, dtype
        self.kv_scale = kv_scale
        self.sink_blocks = -(-sinks // block_size) if window is not None else 0
        self.gen = torch.Generator().manual_seed(seed)
        self.caches = []
        for _ in range(layers):
            k = torch.full((num_blocks, block_size, KV_HEADS, DIM), float("nan"), dtype=dtype)
            v = torch.full_like(k, float("nan"))
            k[0], v[0] = 0, 0  # the null block
            if kv_scale is not None:   # NaN is E4M3's 0x7f
                k, v = k.to(E4M3), v.to(E4M3)
            self.caches.append((k, v))
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.truth: dict[int, list[list[torch.Tensor]]] = {}   # sid -> per layer [keys, values]
        self.blocks: dict[int, dict[int, int]] = {}            # sid -> logical -> physical

    def store(self, cache, slot, x, which):
        """Row ``slot`` of ``cache`` [.., KV_HEADS, DIM] := ``x`` (as its E4M3 codes on E4M3 pages)."""
        if self.kv_scale is None:
            cache.view(-1, KV_HEADS, DIM)[slot] = x
        else:
            cache.view(torch.uint8).view(-1, KV_HEADS, DIM)[slot] = to_e4m3(
                x, self.kv_scale[which][:, None]).view(torch.uint8)

    def draw(self, n, which):
        """``n`` tokens' random keys (``which`` 0) or values (1), on the pages' E4M3 grid where they have one."""
        x = torch.randn(n, KV_HEADS, DIM, generator=self.gen, dtype=self.dtype)
        if self.kv_scale is None:
            return x
        scale = self.kv_scale[which][:, None].to(self.dtype)
        return to_e4m3(x, scale).to(self.dtype) * scale

    def live(self, sid):
        return sorted(self.blocks[sid])

    def table_row(self, sid):
        return [self.blocks[sid][b] for b in self.live(sid)]

    def window_first(self, sid):
        window = [b for b in self.live(sid) if b >= self.sink_blocks]
        return window[0] if window else self.sink_blocks

    def length(self, sid):
        return self.truth[sid][0][0].shape[0] if sid in self.truth else 0

    def slot(self, sid, token):
        return self.blocks[sid][token // self.bs] * self.bs + token % self.bs

    def grow(self, sid, n):
        """Append ``n`` tokens: their blocks, their K/V in the truth; returns per layer (keys, values) [n, ...]."""
        self.blocks.setdefault(sid, {})
        start = self.length(sid)
        for t in range(start, start + n):
            if t // self.bs not in self.blocks[sid]:
                self.blocks[sid][t // self.bs] = self.free.pop()
        new = [(self.draw(n, 0), self.draw(n, 1)) for _ in self.caches]
        if sid not in self.truth:
            self.truth[sid] = [[k, v] for k, v in new]
        else:
            for pair, (k, v) in zip(self.truth[sid], new):
                pair[0], pair[1] = torch.cat([pair[0], k]), torch.cat([pair[1], v])
        return new

    def write(self, sid, start, new):
        for (k_cache, v_cache), (k, v) in zip(self.caches, new):
            for i in range(k.shape[0]):
                s = self.slot(sid, start + i)
                self.store(k_cache, s, k[i], 0)
                self.store(v_cache, s, v[i], 1)

    def release_behind_window(self, sid):
        if self.window is None:
            return
        below = max(0, (self.length(sid) - self.window) // self.bs)
        for b in [b for b in self.live(sid) if self.sink_blocks <= b < below]:
            physical = self.blocks[sid].pop(b)
            for k, v in self.caches:
                if self.kv_scale is None:
                    k[physical], v[physical] = float("nan"), float("nan")   # another session's garbage
                else:
                    k.view(torch.uint8)[physical], v.view(torch.uint8)[physical] = 0x7F, 0x7F   # E4M3's NaN
            self.free.append(physical)

    def prefill(self, sid, n):
        start = self.length(sid)
        self.write(sid, start, self.grow(sid, n))
        self.release_behind_window(sid)

    def rotate(self, sid):
        """A rebase stand-in: change the session's live window keys in the truth and the cache alike."""
        keys = [pair[0] for pair in self.truth[sid]]
        first = max(self.sinks, self.length(sid) - self.window) if self.window is not None else 0
        for layer, (k_cache, _) in enumerate(self.caches):
            keys[layer][first:] = -keys[layer][first:]
            for t in range(first, self.length(sid)):
                self.store(k_cache, self.slot(sid, t), keys[layer][t], 0)

    def round_meta(self, sids):
        """Allocate each session's next token and return this round's metadata (before its K/V is written)."""
        starts = [self.length(s) for s in sids]
        for sid, start in zip(sids, starts):
            if start // self.bs not in self.blocks[sid]:
                self.blocks[sid][start // self.bs] = self.free.pop()
        rows = [self.table_row(s) for s in sids]
        table = torch.full((len(sids), max(map(len, rows))), -1, dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
        ctx = [s + 1 for s in starts]
        return PagedAttentionMetadata(
            block_size=self.bs, sinks=self.sinks if self.window is not None else 0, window=self.window,
            sink_blocks=self.sink_blocks, query_lens=[1] * len(sids), context_lens=ctx,
            query_start=torch.arange(len(sids) + 1), context_lens_t=torch.tensor(ctx), block_tables=table,
            window_first=torch.tensor([self.window_first(s) for s in sids]),
            slot_mapping=torch.tensor([self.slot(s, t) for s, t in zip(sids, starts)]))


def attend_fused(window: DecodeWindow, query, key, value, k_cache, v_cache, plan, kv_scale=None) -> torch.Tensor:
    """``window``'s call through ``attend_qkv``: q, k and v side by side in one row a token, as a layer's fused
    projection gives them."""
    n = query.shape[0]
    qkv = torch.cat([x.reshape(n, -1) for x in (query, key, value)], dim=1)
    kv = (k_cache, v_cache) if kv_scale is None else (k_cache, v_cache, kv_scale)
    return window.attend_qkv(qkv, kv, plan).view(query.shape)


def run_rounds(sim: PagedSim, schedule, moves=(), window: DecodeWindow | None = None, fused: bool = False,
               directs: list | None = None) -> DecodeWindow:
    """One step's rounds. ``schedule``: the session ids of each round; ``moves``: (round, sid) rebases before
    that round; ``window``: the previous step's, to reuse its buffers; ``fused``: through ``attend_qkv``;
    ``directs``: collects whether each round's plan allowed direct calls."""
    window = window or DecodeWindow(sim.caches, HEADS)
    window.begin()
    tol = 1e-10 if sim.dtype == torch.float64 else 1e-5
    for r, sids in enumerate(schedule):
        for sid in [s for rr, s in moves if rr == r]:
            sim.rotate(sid)
            window.mark_moved([sid])
        meta = sim.round_meta(sids)
        starts = [sim.length(s) for s in sids]
        new = {sid: sim.grow(sid, 1) for sid in sids}
        for layer, (k_cache, v_cache) in enumerate(sim.caches):
            plan = window.plan_round(meta, list(sids)) if layer == 0 else plan
            query = torch.randn(len(sids), HEADS, DIM, generator=sim.gen, dtype=sim.dtype)
            key = torch.cat([new[s][layer][0] for s in sids])
            value = torch.cat([new[s][layer][1] for s in sids])
            attend = attend_fused if fused else DecodeWindow.__call__
            out = attend(window, query, key, value, k_cache, v_cache, plan, sim.kv_scale)
            if directs is not None and layer == 0:
                directs.append(plan.direct is not None)
            assert torch.isfinite(out).all(), f"round {r}: a freed (NaN) block reached the output"
            for i, (sid, start) in enumerate(zip(sids, starts)):
                keys, values = sim.truth[sid][layer]
                expect = dense_oracle(query[i:i + 1], keys, values, start, sim.sinks, sim.window)
                torch.testing.assert_close(out[i:i + 1].double(), expect, atol=tol, rtol=tol,
                                           msg=lambda m: f"round {r} session {sid} layer {layer}: {m}")
        for sid in sids:
            sim.release_behind_window(sid)
    return window


SCHEDULE = [[1, 2, 3]] * 4 + [[1, 3]] * 3 + [[3, 1]] * 2 + [[1, 3, 4]] * 4 + [[4]] * 3 + [[1, 2, 3, 4]] * 3
MOVES = [(2, 1), (5, 3), (11, 4), (17, 2)]


@pytest.mark.parametrize("sinks,window,block_size", [(4, 24, 4), (3, 21, 8), (0, 16, 4), (16, 32, 16), (4, None, 4)])
def test_rounds_match_the_oracle_as_sessions_leave_join_and_move(sinks, window, block_size):
    sim = PagedSim(sinks, window, block_size)
    for sid, n in ((1, 70), (2, 5), (3, 41), (4, 12)):
        sim.prefill(sid, n)
    run_rounds(sim, SCHEDULE, moves=MOVES)


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler to build the CPU attention kernel with")
@pytest.mark.parametrize("sinks,window,block_size", [(4, 24, 4), (0, 16, 4), (4, None, 4)])
def test_rounds_through_the_c_kernel_match_the_oracle(sinks, window, block_size, tmp_path):
    """The same rounds in float32 with the C kernel attending (the CPU engine's default where it builds)."""
    sim = PagedSim(sinks, window, block_size, dtype=torch.float32)
    for sid, n in ((1, 70), (2, 5), (3, 41), (4, 12)):
        sim.prefill(sid, n)
    kernel = load_kernel(tmp_path)
    if not kernel.supports(torch.float32, DIM):
        pytest.skip(f"head dim {DIM} is not a multiple of this CPU's vector width {kernel.vector_width}")
    run_rounds(sim, SCHEDULE, moves=MOVES, window=DecodeWindow(sim.caches, HEADS, kernel=kernel))


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler to build the CPU attention kernel with")
@pytest.mark.parametrize("sinks,window,block_size", [(4, 24, 4), (4, None, 4)])
@pytest.mark.parametrize("pages", ["float32", "e4m3"])
def test_fused_rows_match_the_oracle_in_direct_calls_and_through_the_call(sinks, window, block_size, pages):
    """``attend_qkv`` over rounds that only append (direct calls to the C kernels) and rounds that gather
    (sessions joining, keys moved) or read E4M3 pages (through ``__call__``)."""
    kv_scale = torch.tensor([[0.5, 2.0], [0.25, 1.0]]) if pages == "e4m3" else None
    sim = PagedSim(sinks, window, block_size, dtype=torch.float32, kv_scale=kv_scale)
    for sid, n in ((1, 70), (2, 5), (3, 41), (4, 12)):
        sim.prefill(sid, n)
    kernel = load_kernel()
    if not kernel.supports(torch.float32, DIM):
        pytest.skip(f"head dim {DIM} is not a multiple of this CPU's vector width {kernel.vector_width}")
    directs: list[bool] = []
    run_rounds(sim, SCHEDULE, moves=MOVES, window=DecodeWindow(sim.caches, HEADS, kernel=kernel), fused=True,
               directs=directs)
    if pages == "e4m3":
        assert not any(directs)
    else:   # the first round, joins and moves gather; the rest append
        assert directs[0] is False and sum(directs) >= len(SCHEDULE) // 2, directs


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler to build the CPU attention kernel with")
def test_a_slot_outside_the_cache_is_refused_in_direct_calls():
    sim = PagedSim(4, 24, 4, dtype=torch.float32)
    sim.prefill(1, 30)
    kernel = load_kernel()
    if not kernel.supports(torch.float32, DIM):
        pytest.skip(f"head dim {DIM} is not a multiple of this CPU's vector width {kernel.vector_width}")
    window = DecodeWindow(sim.caches, HEADS, kernel=kernel)
    run_rounds(sim, [[1]], window=window)      # the session's keys are in the buffers: the next round appends
    meta = sim.round_meta([1])
    plan = window.plan_round(meta, [1])
    assert plan.direct is not None
    meta.slot_mapping.fill_(sim.caches[0][0].numel())     # past the last row, read where the plan pointed
    k_cache, v_cache = sim.caches[0]
    before = k_cache.clone()
    q, k, v = (torch.randn(1, h, DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
    with pytest.raises(IndexError, match="outside the cache"):
        attend_fused(window, q, k, v, k_cache, v_cache, plan)
    assert torch.equal(k_cache.nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize("attend", ["kernel", "sdpa"])
@pytest.mark.parametrize("sinks,window,block_size", [(4, 24, 4), (4, None, 4)])
def test_rounds_over_e4m3_pages_match_the_oracle(attend, sinks, window, block_size, tmp_path):
    """E4M3 pages with a scale per (K or V, KV head): the buffers keep the codes and the C kernel (or SDPA over the
    dequantised buffers) applies the scales. The truth is on the E4M3 grid, so only float32 sums differ."""
    kernel = None
    if attend == "kernel":
        if find_compiler() is None:
            pytest.skip("no C compiler to build the CPU attention kernel with")
        kernel = load_kernel(tmp_path)
        if not kernel.supports(E4M3, DIM):
            pytest.skip(f"head dim {DIM} is not a multiple of this CPU's vector width {kernel.vector_width}")
    scales = torch.tensor([[2.0 ** -5, 2.0 ** -3], [2.0 ** -4, 2.0 ** -6]])
    sim = PagedSim(sinks, window, block_size, dtype=torch.float32, kv_scale=scales)
    for sid, n in ((1, 70), (2, 5), (3, 41), (4, 12)):
        sim.prefill(sid, n)
    window_ = run_rounds(sim, SCHEDULE, moves=MOVES, window=DecodeWindow(sim.caches, HEADS, kernel=kernel))
    assert window_.buffers[0][0].dtype == E4M3


def test_full_rows_are_gathered_again_and_the_buffers_grow(monkeypatch):
    """With little spare room rows fill up every few rounds: a windowed row is re-gathered without its
    dead keys, a young one (no dead keys) makes the buffers grow; outputs never change."""
    monkeypatch.setattr(dw, "SPARE_COLUMNS", 2)
    sim = PagedSim(sinks=2, window=12, block_size=4)
    sim.prefill(1, 30)
    sim.prefill(2, 1)
    window = run_rounds(sim, [[1, 2]] * 40)
    assert window.cols_cap > 14 + 2        # grew past the first gather's width + spare


def test_the_next_step_starts_from_the_cache_again():
    """Buffers are reused across steps, but a new step never reads a previous step's rows."""
    sim = PagedSim(sinks=4, window=16, block_size=4)
    for sid in (1, 2):
        sim.prefill(sid, 20)
    window = run_rounds(sim, [[1, 2]] * 5)
    sim.prefill(1, 9)                        # the session's next step: a prefill, then rounds again
    run_rounds(sim, [[2, 1]] * 5, window=window)


@pytest.fixture
def grows(monkeypatch) -> list[tuple[int, int]]:
    """The (rows, columns) of every buffer growth, as it happens."""
    sizes = []
    real_grow = DecodeWindow._grow

    def counted_grow(self, rows, cols):
        sizes.append((rows, cols))
        real_grow(self, rows, cols)

    monkeypatch.setattr(DecodeWindow, "_grow", counted_grow)
    return sizes


def test_growing_sessions_regrow_the_buffers_a_few_times_not_every_step(grows):
    """Young sessions' live keys grow every step until their windows fill. The columns double at a time, a
    bounded session's up to the most it can hold: most steps reuse the buffers as they are."""
    sinks, bs, steps = 4, 4, 24
    for window_len, max_live in ((200, 4 + 200 + 2 * 4), (None, None)):
        grows.clear()
        sim = PagedSim(sinks, window_len, bs, num_blocks=800)
        for sid in (1, 2):
            sim.prefill(sid, 3)
        window = DecodeWindow(sim.caches, HEADS, max_live_keys=max_live)
        for _ in range(steps):                 # each step: a prefill of 7, then 3 decode rounds
            for sid in (1, 2):
                sim.prefill(sid, 7)
            run_rounds(sim, [[1, 2]] * 3, window=window)
        assert 0 < len(grows) <= steps // 3    # without the slack: every step
        if max_live is not None:
            assert window.cols_cap <= window.max_columns


def test_sessions_joining_one_at_a_time_regrow_the_rows_a_few_times(grows):
    """A session joins every step: the rows grow by half at a time (each growth zeroes and copies every layer's
    buffers), not at every join; outputs still match the oracle."""
    sim = PagedSim(sinks=2, window=12, block_size=4, num_blocks=800)
    window = DecodeWindow(sim.caches, HEADS)
    joined = []
    for sid in range(1, 17):
        sim.prefill(sid, 5)
        joined.append(sid)
        run_rounds(sim, [joined] * 2, window=window)
    rows = sorted({r for r, _ in grows})
    assert rows[-1] >= 16 and len(rows) <= 5     # 4, 8, 12, 20 rather than 1, 2, ..., 16


@pytest.mark.parametrize("attend", ["sdpa", "kernel"])
def test_a_rows_earlier_values_never_reach_its_next_session(attend, tmp_path):
    """A masked column still meets its value (with weight 0), so a row's columns past its session's keys must hold
    finite values whatever the row held before: here every buffer is filled with NaN between two steps, and the
    next step's rows, gathered anew, must attend as the oracle does."""
    kernel = None
    if attend == "kernel":
        if find_compiler() is None:
            pytest.skip("no C compiler to build the CPU attention kernel with")
        kernel = load_kernel(tmp_path)
        if not kernel.supports(torch.float32, DIM):
            pytest.skip(f"head dim {DIM} is not a multiple of this CPU's vector width {kernel.vector_width}")
    sim = PagedSim(sinks=4, window=None, block_size=4, dtype=torch.float32)
    sim.prefill(1, 60)
    sim.prefill(2, 3)
    window = run_rounds(sim, [[1, 2]] * 3, window=DecodeWindow(sim.caches, HEADS, kernel=kernel))
    for k, v in window.buffers:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    run_rounds(sim, [[2, 1]] * 3, window=window)    # sid 2's row holds far fewer keys than the width
