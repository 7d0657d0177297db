"""GPU benchmark: the Triton paged sink + window attention vs PyTorch SDPA (flash) and FlexAttention.

Run on a CUDA machine (about 3-5 minutes on an H200)::

    python bench/attention_gpu.py                     # the full sweep, table on stdout
    python bench/attention_gpu.py --quick             # a smoke subset (under a minute)
    python bench/attention_gpu.py --cpu-smoke         # a tiny version through the Triton interpreter

Figures: docs/benchmarks/gpu.md (attention kernel).

What one run measures, in bf16, for every (model, mode, N):

* models (query heads / KV heads x head_dim): SmolLM2-135M 9/3x64, Qwen2.5-7B 28/4x128,
  Qwen3-30B-A3B 32/4x128 (and Qwen3-8B 32/8x128, MiniCPM-o's decoder, and Moshi-7B 32/32x128 with
  ``--models``); sinks S = 16, window W = 1024, block size 16;
* N in {1, 16, 64, 256, 512} sessions, each well past the window (4096 + 0..15 tokens old, so windows end
  mid-block), modes: decode (1 query token per session) and prefill chunks of 26 and 50 tokens;
* **triton**: ``paged_attention_triton`` over a paged pool (physical blocks shuffled; the slots after each
  session's last token are NaN, so any read outside the live set shows up as NaN), the plan built once
  outside the timed region, as the engine does per forward;
* **sdpa**: ``F.scaled_dot_product_attention`` (flash backend, ``enable_gqa=True``) over a contiguous
  per-session cache holding the same live keys (S sinks + window: S + W + q keys). Decode: exactly the
  same function. Prefill: flash cannot express the sink + band mask, so it runs lower-right causal over
  the same keys (a superset of the mask: same bytes, slightly more arithmetic) and is not compared;
* **flex**: ``flex_attention`` compiled, with a block mask for the exact sink + window mask, over the same
  contiguous cache (``--flex-budget-s`` caps the compile time spent on it; later shapes are skipped);
* **copy**: a large device-to-device copy, for the bandwidth ceiling (bytes read + written / time).

Correctness first, at every shape: the Triton output (poisoned with NaN beforehand) is compared with
an fp32 SDPA over the contiguous cache with the explicit mask (max |error|, ‖error‖/‖ref‖); Flex with
the same; SDPA flash too for decode. Timing: CUDA events around CUDA-graph replays (GPU time, launch
gaps removed; falls back to eager if capture fails) and around eager loops (host launch overhead
included), median of ``--repeats``; inputs rotate over enough independent session sets that the live
K/V of one timed pass exceeds the L2 several times. Achieved bandwidth = (live K/V bytes read + Q + O)
/ time, also as a fraction of the measured copy bandwidth.

Raw numbers (every shape, both timings, errors, plans, machine) go to ``--out``
(default ``results/attention_gpu.json``). Without CUDA the script says so and exits with status 2
(``--cpu-smoke`` runs a tiny version through the Triton interpreter to check the script itself).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MODELS = {  # name: (query heads, kv heads, head_dim)
    "smollm2-135m": (9, 3, 64),
    "qwen2.5-7b": (28, 4, 128),
    "qwen3-30b-a3b": (32, 4, 128),
    "qwen3-8b": (32, 8, 128),    # MiniCPM-o 4.5's decoder
    "moshi-7b": (32, 32, 128),   # no GQA: one query row per program in decode
}
DEFAULT_MODELS = "smollm2-135m,qwen2.5-7b,qwen3-30b-a3b"
MODES = {"decode": 1, "prefill26": 26, "prefill50": 50}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=type(
        "Formatter", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {}))
    p.add_argument("--out", default="results/attention_gpu.json", help="raw JSON results")
    p.add_argument("--models", default=DEFAULT_MODELS, help=f"comma list of {list(MODELS)}")
    p.add_argument("--sessions", default="1,16,64,256,512", help="comma list of N")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {list(MODES)}")
    p.add_argument("--sinks", type=int, default=16, help="sink tokens S")
    p.add_argument("--window", type=int, default=1024, help="window W")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--age", type=int, default=4096, help="tokens before this forward (plus 0..block-1)")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed repetitions first")
    p.add_argument("--rotate-mb", type=float, default=256.0,
                   help="rotate over session sets until one timed pass reads this many MB of live K/V")
    p.add_argument("--max-sets", type=int, default=128, help="at most this many session sets to rotate over")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    p.add_argument("--no-sdpa", action="store_true", help="skip SDPA")
    p.add_argument("--no-graphs", action="store_true", help="eager timing only")
    p.add_argument("--flex-budget-s", type=float, default=120.0, help="compile+run seconds allowed for flex")
    p.add_argument("--time-limit-s", type=float, default=290.0, help="skip the remaining shapes after this")
    p.add_argument("--force-splits", type=int, default=None, help="override the split-KV rule (None: the engine's)")
    p.add_argument("--target-programs", type=int, default=None, help="split-KV target (None: PROGRAMS_PER_SM x SMs)")
    p.add_argument("--block-n", type=int, default=64, help="keys per tile (a power of two, at least 16)")
    p.add_argument("--decode-block-n", type=int, default=None,
                   help="keys per tile of the decode launch (default: --block-n, as the engine)")
    p.add_argument("--prefill-block-m", type=int, default=64, help="rows (tokens x GQA heads) per prefill program")
    p.add_argument("--num-warps", type=int, default=None, help="override the launch's warps (None: 4)")
    p.add_argument("--num-stages", type=int, default=None, help="override the launch's stages (None: the engine's rule)")
    p.add_argument("--crowded-stages", type=int, default=None,
                   help="stages of a decode launch past 2 programs per SM, capped at 128 registers where ptxas "
                        "takes more (None: the engine's for the pages' element type)")
    p.add_argument("--widen-v-max-group", type=int, default=None,
                   help="E4M3 pages: widen the values where loaded up to this many query heads a KV head (None: "
                        "the engine's)")
    p.add_argument("--quick", action="store_true", help="qwen2.5-7b only, N in {1, 64, 512}")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="no GPU: tiny shapes through the Triton interpreter (checks this script only)")
    p.add_argument("--seed", type=int, default=0, help="random inputs' seed")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="the paged pool's element type: auto (the compute dtype) or fp8 (E4M3, a scale per head; "
                        "SDPA and flex read the dequantised keys in bf16)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------- data
@dataclass
class Shape:
    model: str
    heads: int
    kv_heads: int
    head_dim: int
    mode: str
    q: int
    n: int


@dataclass
class SessionSets:
    """``n_sets`` independent batches of ``n`` sessions over one shared paged pool."""

    metas: list           # PagedAttentionMetadata per set
    plans: list           # TritonPlan per set
    nosplit_plans: list   # same with split-KV forced off (None when the rule gives 1 anyway)
    queries: list         # [n*q, H, D] packed
    outs: list            # [n*q, H, D] output buffers
    k_cache: object
    v_cache: object
    q_c: list             # [n, H, q, D] contiguous (SDPA / flex)
    k_c: list             # [n, KVH, L, D]
    v_c: list
    o_c: list
    kv_scale: object      # [2, KVH] float32 scales of an E4M3 pool (None otherwise)
    live_keys: int        # keys per session (S + W + q)
    kv_bytes: int         # live K/V bytes of one set (what one call must read)
    qo_bytes: int         # Q read + O written of one set


def build_sets(shape: Shape, n_sets: int, args, device, dtype, plan_kw):
    import torch

    from metronome.attention.metadata import PagedAttentionMetadata, token_slots
    from metronome.attention.triton_paged import plan_triton

    bs, sinks, window, q = args.block_size, args.sinks, args.window, shape.q
    kvh, heads, d = shape.kv_heads, shape.heads, shape.head_dim
    gen = torch.Generator().manual_seed(args.seed * 7919 + shape.n * 31 + q)
    m = shape.n * n_sets
    ages = args.age + torch.randint(0, bs, (m,), generator=gen)
    ctx = ages + q
    sink_blocks = -(-sinks // bs)
    wf = torch.clamp((ages - window) // bs, min=sink_blocks)
    n_live = sink_blocks + (ctx - 1) // bs - wf + 1
    width = int(n_live.max())
    total = int(n_live.sum())
    perm = torch.randperm(total, generator=gen) + 1  # physical ids; block 0 = the null block
    table = torch.full((m, width), -1, dtype=torch.int32)
    col = torch.arange(width)[None, :]
    used = col < n_live[:, None]
    table[used] = perm.to(torch.int32)
    num_blocks = total + 1
    gdev = torch.Generator(device=device).manual_seed(args.seed * 7919 + shape.n * 31 + q)
    k_cache = torch.randn((num_blocks, bs, kvh, d), generator=gdev, device=device, dtype=dtype)
    v_cache = torch.randn((num_blocks, bs, kvh, d), generator=gdev, device=device, dtype=dtype)
    k_cache[0] = 0
    v_cache[0] = 0
    kv_scale = None
    if args.kv_cache_dtype == "fp8":
        from metronome.attention.fp8 import head_scales

        kv_scale = torch.stack([head_scales(c.view(-1, kvh, d)) for c in (k_cache, v_cache)]).contiguous()
    # NaN in every slot after a session's last token: reading outside the live set poisons the output.
    last_phys = table[torch.arange(m), n_live - 1].long()
    j = torch.arange(bs)[None, :]
    tail = (last_phys[:, None] * bs + j)[j >= ((ctx - 1) % bs + 1)[:, None]].to(device)
    k_cache.view(-1, kvh, d)[tail] = float("nan")
    v_cache.view(-1, kvh, d)[tail] = float("nan")
    if kv_scale is not None:   # the pool holds E4M3 codes; the contiguous copies below, their values
        from metronome.attention.fp8 import to_e4m3

        codes = [to_e4m3(c, sc[:, None]) for c, sc in ((k_cache, kv_scale[0]), (v_cache, kv_scale[1]))]
        k_cache, v_cache = ((c.float() * sc[:, None]).to(dtype) for c, sc in zip(codes, kv_scale))
    table_d, wf_d, ctx_d = table.to(device), wf.to(device), ctx.to(device)

    # Contiguous copies of the live keys, token order: sinks, then [first_query - W, ctx).
    live = sinks + window + q
    kpos = torch.arange(live)[None, :]
    tokens = torch.where(kpos < sinks, kpos, (ages - window)[:, None] + kpos - sinks)
    big = PagedAttentionMetadata(block_size=bs, sinks=sinks, window=window, sink_blocks=sink_blocks,
                                 query_lens=[q] * m, context_lens=ctx.tolist(),
                                 query_start=torch.arange(m + 1, device=device) * q, context_lens_t=ctx_d,
                                 block_tables=table_d, window_first=wf_d,
                                 slot_mapping=torch.zeros(m * q, dtype=torch.long, device=device))
    rows = torch.arange(m, device=device)
    slots = token_slots(big, rows, tokens.to(device))                      # [m, live]
    qtok = ages[:, None] + torch.arange(q)[None, :]
    new_slots = token_slots(big, rows, qtok.to(device)).flatten()          # where this forward's K/V went
    k_flat, v_flat = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)
    k_all = k_flat[slots.flatten()].view(m, live, kvh, d).transpose(1, 2).contiguous()
    v_all = v_flat[slots.flatten()].view(m, live, kvh, d).transpose(1, 2).contiguous()
    assert not torch.isnan(k_all).any(), "a live key is NaN: the bench's own layout is wrong"
    query = torch.randn((m * q, heads, d), generator=gdev, device=device, dtype=dtype)
    q_all = query.view(m, q, heads, d).transpose(1, 2).contiguous()

    if kv_scale is not None:
        k_cache, v_cache = codes
    sets = SessionSets([], [], [], [], [], k_cache, v_cache, [], [], [], [], kv_scale, live,
                       shape.n * live * kvh * d * 2 * k_cache.element_size(),
                       2 * shape.n * q * heads * d * query.element_size())
    n = shape.n
    for s in range(n_sets):
        lo, hi = s * n, (s + 1) * n
        meta = PagedAttentionMetadata(
            block_size=bs, sinks=sinks, window=window, sink_blocks=sink_blocks, query_lens=[q] * n,
            context_lens=ctx[lo:hi].tolist(), query_start=torch.arange(n + 1, device=device) * q,
            context_lens_t=ctx_d[lo:hi], block_tables=table_d[lo:hi], window_first=wf_d[lo:hi],
            slot_mapping=new_slots[lo * q:hi * q])
        plan = plan_triton(meta, heads, kvh, **plan_kw)
        nosplit = None
        if any(ln.num_splits > 1 for ln in plan.launches):
            nosplit = plan_triton(meta, heads, kvh, **{**plan_kw, "force_splits": 1})
        sets.metas.append(meta)
        sets.plans.append(plan)
        sets.nosplit_plans.append(nosplit)
        sets.queries.append(query[lo * q:hi * q])
        sets.outs.append(torch.empty_like(query[lo * q:hi * q]))
        sets.q_c.append(q_all[lo:hi])
        sets.k_c.append(k_all[lo:hi])
        sets.v_c.append(v_all[lo:hi])
        sets.o_c.append(torch.empty_like(q_all[lo:hi]))
    return sets


def band_mask(q: int, live: int, sinks: int, window: int, device):
    """[q, live] bool over the contiguous layout: sinks, then window keys from first_query - W."""
    import torch

    i = torch.arange(q, device=device)[:, None]
    c = torch.arange(live, device=device)[None, :]
    rel = c - sinks
    return (c < sinks) | ((rel >= i) & (rel <= i + window))


# --------------------------------------------------------------------------------------------- timing
class Timer:
    def __init__(self, device, graphs: bool, warmup: int, repeats: int):
        self.cuda = device.type == "cuda"
        self.graphs = graphs and self.cuda
        self.warmup, self.repeats = warmup, repeats

    def _sync(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def eager(self, calls) -> float:
        """Median seconds per call of running every call once (eager launches)."""
        import torch

        for _ in range(self.warmup):
            for c in calls:
                c()
        self._sync()
        samples = []
        for _ in range(self.repeats):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for c in calls:
                    c()
                b.record()
                b.synchronize()
                samples.append(a.elapsed_time(b) / 1e3 / len(calls))
            else:
                t = time.perf_counter()
                for c in calls:
                    c()
                samples.append((time.perf_counter() - t) / len(calls))
        return statistics.median(samples)

    def graph(self, calls) -> float | None:
        """Median seconds per call of CUDA-graph replays of all calls (None if capture fails)."""
        if not self.graphs:
            return None
        import torch

        try:
            for c in calls:  # warm: compile, allocate workspaces
                c()
            self._sync()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for c in calls:
                    c()
            torch.cuda.current_stream().wait_stream(stream)
            self._sync()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for c in calls:
                    c()
            for _ in range(self.warmup):
                g.replay()
            self._sync()
            samples = []
            for _ in range(self.repeats):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                b.synchronize()
                samples.append(a.elapsed_time(b) / 1e3 / len(calls))
            del g
            return statistics.median(samples)
        except Exception as exc:  # noqa: BLE001 - reported, eager numbers still stand
            print(f"  (graph capture failed: {type(exc).__name__}: {str(exc)[:120]})", file=sys.stderr)
            torch.cuda.synchronize()
            return None


def copy_bandwidth(device, timer: Timer, nbytes: int = 2 << 30) -> dict:
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    t = timer.eager([lambda: dst.copy_(src)])
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes_moved": 2 * nbytes, "seconds": t, "bytes_per_s": 2 * nbytes / t}


# ------------------------------------------------------------------------------------------------ run
def errors(out, ref) -> dict:
    o, r = out.float(), ref.float()
    if not bool(o.isfinite().all()):
        return {"max_abs": float("nan"), "rel": float("nan"), "finite": False}
    return {"max_abs": float((o - r).abs().max()), "rel": float((o - r).norm() / r.norm().clamp_min(1e-30)),
            "finite": True}


def engine_plan_kw(shape: Shape, plan_kw: dict, args, device, dtype) -> dict:
    """``plan_kw`` with the register cap the engine's start-up warm-up settles for this shape
    (``TritonPagedAttention.warm_up``) unless one was given; on the CPU, unchanged."""
    import torch

    from metronome.attention.triton_paged import TritonPagedAttention

    if device.type != "cuda" or plan_kw.get("max_registers") is not None:
        return plan_kw
    attention = TritonPagedAttention(shape.heads, num_kv_heads=shape.kv_heads, **plan_kw)
    fp8 = args.kv_cache_dtype == "fp8"   # the cap of the kernel that reads E4M3 pages, as the engine's would be
    scratch = [torch.zeros((2, args.block_size, shape.kv_heads, shape.head_dim), dtype=dtype, device=device)
               .to(torch.float8_e4m3fn if fp8 else dtype) for _ in range(2)]
    attention.warm_up(*scratch, block_size=args.block_size, sinks=args.sinks, window=args.window,
                      sink_blocks=-(-args.sinks // args.block_size), block=1, dtype=dtype,
                      kv_scale=torch.ones((2, shape.kv_heads), device=device) if fp8 else None)
    return {**plan_kw, "max_registers": attention.options["max_registers"]}


def run_shape(shape: Shape, args, device, dtype, timer: Timer, plan_kw, flex_state, sdpa_ok) -> dict:
    import torch
    import torch.nn.functional as F

    from metronome.attention.triton_paged import paged_attention_triton

    per_session_kv = (args.sinks + args.window + shape.q) * shape.kv_heads * shape.head_dim * 4
    n_sets = max(1, min(args.max_sets, math.ceil(args.rotate_mb * 2**20 / (per_session_kv * shape.n))))
    sets = build_sets(shape, n_sets, args, device, dtype, plan_kw)
    scale = 1.0 / math.sqrt(shape.head_dim)
    row = {"model": shape.model, "heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
           "mode": shape.mode, "q": shape.q, "n": shape.n, "n_sets": n_sets, "live_keys": sets.live_keys,
           "kv_bytes": sets.kv_bytes, "qo_bytes": sets.qo_bytes,
           "launches": [{"block_m": ln.block_m, "items": ln.num_items, "splits": ln.num_splits,
                         "max_tiles": ln.max_tiles, "stages": ln.num_stages, "block_n": ln.block_n}
                        for ln in sets.plans[0].launches],
           "max_registers": plan_kw.get("max_registers")}

    def triton_call(s, plans):
        return lambda: paged_attention_triton(sets.queries[s], sets.k_cache, sets.v_cache, sets.metas[s],
                                              scale, plans[s], out=sets.outs[s], kv_scale=sets.kv_scale)

    # ---- correctness on set 0 (first 64 sessions) against fp32 SDPA with the explicit mask
    check_n = min(shape.n, 64)
    mask = band_mask(shape.q, sets.live_keys, args.sinks, args.window, device)
    q0, k0, v0 = sets.q_c[0][:check_n], sets.k_c[0][:check_n], sets.v_c[0][:check_n]
    ref = F.scaled_dot_product_attention(q0.float(), k0.float(), v0.float(), attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    sets.outs[0].fill_(float("nan"))
    triton_call(0, sets.plans)()
    tri0 = sets.outs[0].view(shape.n, shape.q, shape.heads, shape.head_dim).transpose(1, 2)[:check_n]
    row["check_triton"] = errors(tri0, ref)
    if sets.nosplit_plans[0] is not None:
        sets.outs[0].fill_(float("nan"))
        triton_call(0, sets.nosplit_plans)()
        row["check_triton_nosplit"] = errors(tri0, ref)

    # ---- timing: triton
    row["triton_graph_s"] = timer.graph([triton_call(s, sets.plans) for s in range(n_sets)])
    row["triton_eager_s"] = timer.eager([triton_call(s, sets.plans) for s in range(n_sets)])
    if sets.nosplit_plans[0] is not None:
        row["triton_nosplit_graph_s"] = timer.graph([triton_call(s, sets.nosplit_plans) for s in range(n_sets)])

    # ---- SDPA flash on the contiguous cache
    if sdpa_ok:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        if shape.q == 1:
            row["sdpa_mask"] = "exact (all S + W + 1 live keys)"

            def sdpa(s):
                def call():
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                        sets.o_c[s].copy_(F.scaled_dot_product_attention(
                            sets.q_c[s], sets.k_c[s], sets.v_c[s], scale=scale, enable_gqa=True))
                return call
        else:
            row["sdpa_mask"] = "lower-right causal over the S + W + q live keys (superset of the exact mask)"
            bias = causal_lower_right(shape.q, sets.live_keys)

            def sdpa(s):
                def call():
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                        sets.o_c[s].copy_(F.scaled_dot_product_attention(
                            sets.q_c[s], sets.k_c[s], sets.v_c[s], attn_mask=bias, scale=scale,
                            enable_gqa=True))
                return call
        try:
            try:
                sdpa(0)()
            except Exception as exc:  # noqa: BLE001 - flash without a GQA path here: expand K/V heads
                if shape.q == 1:
                    raise
                row["sdpa_native_gqa_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                row["sdpa_mask"] += "; K/V expanded to every query head (reads G x the K/V bytes)"
                g = shape.heads // shape.kv_heads
                sets.k_c = [k.repeat_interleave(g, dim=1) for k in sets.k_c]
                sets.v_c = [v.repeat_interleave(g, dim=1) for v in sets.v_c]
                sdpa(0)()
            if shape.q == 1:
                row["check_sdpa"] = errors(sets.o_c[0][:check_n], ref)
            row["sdpa_graph_s"] = timer.graph([sdpa(s) for s in range(n_sets)])
            row["sdpa_eager_s"] = timer.eager([sdpa(s) for s in range(n_sets)])
        except Exception as exc:  # noqa: BLE001
            row["sdpa_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if row.get("sdpa_native_gqa_error"):  # flex below gets the compact K/V back
            g = shape.heads // shape.kv_heads
            sets.k_c = [k[:, ::g].contiguous() for k in sets.k_c]
            sets.v_c = [v[:, ::g].contiguous() for v in sets.v_c]

    # ---- FlexAttention (compiled) with the exact mask
    if flex_state is not None:
        if flex_state["spent"] >= args.flex_budget_s:
            row["flex_error"] = "skipped: --flex-budget-s spent"
        else:
            t_start = time.perf_counter()
            try:
                from torch.nn.attention.flex_attention import create_block_mask

                sinks, window = args.sinks, args.window

                def mask_mod(b, h, q_idx, kv_idx):
                    rel = kv_idx - sinks
                    return (kv_idx < sinks) | ((rel >= q_idx) & (rel <= q_idx + window))

                block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=shape.q, KV_LEN=sets.live_keys,
                                               device=device)
                flex = flex_state["fn"]

                def flex_call(s):
                    def call():
                        sets.o_c[s].copy_(flex(sets.q_c[s], sets.k_c[s], sets.v_c[s], block_mask=block_mask,
                                               scale=scale, enable_gqa=True))
                    return call
                flex_call(0)()
                row["check_flex"] = errors(sets.o_c[0][:check_n], ref)
                row["flex_graph_s"] = timer.graph([flex_call(s) for s in range(n_sets)])
                row["flex_eager_s"] = timer.eager([flex_call(s) for s in range(n_sets)])
            except Exception as exc:  # noqa: BLE001
                row["flex_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            flex_state["spent"] += time.perf_counter() - t_start

    moved = sets.kv_bytes + sets.qo_bytes
    for impl in ("triton", "triton_nosplit", "sdpa", "flex"):
        t = row.get(f"{impl}_graph_s") or row.get(f"{impl}_eager_s")
        if t:
            row[f"{impl}_bytes_per_s"] = moved / t
    del sets
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def fmt_us(x):
    return f"{x * 1e6:8.1f}" if x else "       -"


def print_table(rows, copy_bw):
    head = (f"{'model':<14} {'mode':<9} {'N':>4} {'keys':>5} {'splits':>6} {'triton':>8} {'nosplit':>8} "
            f"{'sdpa':>8} {'flex':>8} {'TB/s':>5} {'%copy':>5} {'err':>8} {'flexerr':>8}")
    print("\ntimes in µs per call (CUDA-graph replay; eager where capture failed); TB/s and %copy: Triton")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "skipped" in r:
            print(f"{r['model']:<14} {r['mode']:<9} {r['n']:>4}  skipped: {r['skipped']}")
            continue
        t = lambda k: r.get(f"{k}_graph_s") or r.get(f"{k}_eager_s")  # noqa: E731
        bw = r.get("triton_bytes_per_s", 0.0)
        splits = "/".join(str(ln["splits"]) for ln in r["launches"])
        err = r["check_triton"]["max_abs"]
        ferr = r.get("check_flex", {}).get("max_abs", float("nan"))
        print(f"{r['model']:<14} {r['mode']:<9} {r['n']:>4} {r['live_keys']:>5} {splits:>6} {fmt_us(t('triton'))} "
              f"{fmt_us(t('triton_nosplit'))} {fmt_us(t('sdpa'))} {fmt_us(t('flex'))} {bw / 1e12:5.2f} "
              f"{100 * bw / copy_bw if copy_bw else 0:5.1f} {err:8.1e} {ferr:8.1e}")
    print("sdpa: flash backend; decode exact, prefill lower-right causal over the same live keys (superset mask).")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("attention_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured.\n"
              "Run it on the GPU machine, or pass --cpu-smoke to check the script through the Triton "
              "interpreter.", file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError:
        print("attention_gpu.py needs triton (pip install triton).", file=sys.stderr)
        return 2

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    dtype = torch.bfloat16
    if args.cpu_smoke:
        models = {"tiny-gqa3": (6, 2, 16)}
        sessions, modes = [1, 3], {"decode": 1, "prefill5": 5}
        args.sinks, args.window, args.age, args.block_size = 4, 40, 100, 8
        args.repeats, args.warmup, args.max_sets, args.rotate_mb = 2, 1, 2, 0.01
        args.no_graphs, args.block_n = True, 16  # SDPA and flex run on the CPU too (slowly)
    else:
        names = ["qwen2.5-7b"] if args.quick else [m for m in args.models.split(",") if m]
        models = {m: MODELS[m] for m in names}
        sessions = [1, 64, 512] if args.quick else [int(x) for x in args.sessions.split(",") if x]
        modes = {m: MODES[m] for m in args.modes.split(",") if m}

    from metronome.attention.triton_paged import crowded_stages_for

    timer = Timer(device, graphs=not args.no_graphs, warmup=args.warmup, repeats=args.repeats)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    plan_kw = {"num_sms": num_sms, "block_n": args.block_n, "decode_block_n": args.decode_block_n,
               "force_splits": args.force_splits,
               "target_programs": args.target_programs, "prefill_block_m": args.prefill_block_m,
               "num_warps": args.num_warps, "num_stages": args.num_stages,
               "crowded_stages": args.crowded_stages or crowded_stages_for(
                   torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else dtype),
               **({"widen_v_max_group": args.widen_v_max_group} if args.widen_v_max_group is not None else {})}
    info = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
            "num_sms": num_sms, "args": vars(args), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    t0 = time.perf_counter()
    copy = copy_bandwidth(device, timer) if device.type == "cuda" else {"bytes_per_s": 0.0}
    if copy["bytes_per_s"]:
        print(f"copy bandwidth: {copy['bytes_per_s'] / 1e12:.2f} TB/s (read + write)", flush=True)

    flex_state = None
    if not args.no_flex:
        try:
            import torch._dynamo.config as dcfg
            from torch.nn.attention.flex_attention import flex_attention

            for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                         "accumulated_recompile_limit"):
                if hasattr(dcfg, knob):
                    setattr(dcfg, knob, max(getattr(dcfg, knob), 1024))
            flex_state = {"fn": torch.compile(flex_attention, dynamic=False), "spent": 0.0}
        except Exception as exc:  # noqa: BLE001
            print(f"flex attention unavailable: {exc}", file=sys.stderr)

    rows = []
    for model, (h, kvh, d) in models.items():
        # The cap depends on the heads and head size alone: settled once per model, as the engine does at start.
        model_kw = engine_plan_kw(Shape(model, h, kvh, d, "decode", 1, 1), plan_kw, args, device, dtype)
        for mode, q in modes.items():
            for n in sessions:
                shape = Shape(model, h, kvh, d, mode, q, n)
                if time.perf_counter() - t0 > args.time_limit_s:
                    rows.append({"model": model, "mode": mode, "n": n, "skipped": "--time-limit-s reached"})
                    continue
                t_shape = time.perf_counter()
                try:
                    row = run_shape(shape, args, device, dtype, timer, model_kw, flex_state, not args.no_sdpa)
                except torch.cuda.OutOfMemoryError as exc:
                    torch.cuda.empty_cache()
                    row = {"model": model, "mode": mode, "n": n, "skipped": f"out of memory: {str(exc)[:80]}"}
                row["shape_seconds"] = time.perf_counter() - t_shape
                rows.append(row)
                if "skipped" not in row:
                    c = row["check_triton"]
                    status = "ok" if c["finite"] and c["rel"] < 2e-2 else "MISMATCH"
                    t = row.get("triton_graph_s") or row.get("triton_eager_s")
                    print(f"{model:<14} {mode:<9} N={n:<4} triton {t * 1e6:8.1f} µs  err max {c['max_abs']:.1e} "
                          f"rel {c['rel']:.1e} {status}  ({row['shape_seconds']:.1f} s)", flush=True)

    print_table(rows, copy["bytes_per_s"])
    failures = [r for r in rows if "check_triton" in r and not (r["check_triton"]["finite"]
                                                                and r["check_triton"]["rel"] < 2e-2)]
    info["seconds"] = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"info": info, "copy": copy, "rows": rows}, indent=1, default=str))
    print(f"\nraw results: {out}  ({info['seconds']:.0f} s)")
    if failures:
        print(f"{len(failures)} shape(s) where the Triton output did not match the reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
