"""A/B on the H200: the paged attention kernel with its block ids prefetched one tile ahead ("now") against
the kernel before session 7 ("before", ``bench/paged_attn_single_buffered.py``), and the read floor.

    PYTHONPATH=$PWD python3 bench/decode_pipeline_gpu.py --out results/decode_pipeline.json

Why: compiled for sm_90 with Triton 3.6, "before" keeps one K/V buffer at ``num_stages`` 3 and 4 (the
physical block ids are loaded in the same iteration as the K/V they address, which costs the pipeliner a
stage), so each program waits out every tile's load latency; at N = 64 decode only 2 programs share an SM
and cannot hide it. "now" loads the ids a tile ahead and gets two (three) K/V buffers at the same stages.

What one run measures (bf16, S = 16, W = 1024, block size 16, every session a full window; inputs and the
timing are ``bench/attention_gpu.py``'s: CUDA-graph replay, median, session sets rotated past the L2):

* Qwen2.5-7B decode at N = 64: both kernels over key tiles x warps x stages x split-KV; the three fastest
  "now" configurations again over a head-major (HND) cache layout (same kernel, other strides);
* decode at N = 16, 256, 512 and the Qwen3-30B-A3B 32/4 shape, prefill chunks of 26 (N = 256) and 50
  (N = 512): both kernels over a smaller grid;
* the read floor: the same number of bytes as one decode call, contiguous, read once by a Triton
  streaming-sum kernel (best of a small grid), by ``torch.sum`` and copied by ``Tensor.copy_``: what one
  launch of any kernel that must read those bytes can reach on this GPU.

Every timed configuration is first checked against fp32 SDPA with the explicit mask (NaN-poisoned pool).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.attention_gpu import MODELS, Shape, Timer, band_mask, build_sets, copy_bandwidth, errors  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "results" / "decode_pipeline.json"))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--time-limit-s", type=float, default=480.0, help="skip the remaining cases after this")
    p.add_argument("--quick", action="store_true", help="N = 64 decode, a handful of configurations")
    p.add_argument("--parts", default="n64,sizes,prefill,floor",
                   help="comma list: n64 (the wide N = 64 grid), sizes (other N and the 30B shape), prefill, "
                        "floor (the read floor at N = 64, 256, 512), rule (stages x split-KV at N = 16 ... 512, "
                        "for the launch rule), warps (warps per program at N = 64, 128)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def bench_args(seed: int):
    """The knobs ``build_sets`` reads (``bench/attention_gpu.py``'s defaults)."""
    return argparse.Namespace(block_size=16, sinks=16, window=1024, age=4096, seed=seed, rotate_mb=256.0,
                              max_sets=128)


@contextlib.contextmanager
def kernel_swapped(kernel):
    from metronome.attention import triton_paged

    saved = triton_paged._paged_attn_fwd
    triton_paged._paged_attn_fwd = kernel
    try:
        yield
    finally:
        triton_paged._paged_attn_fwd = saved


def head_major(cache):
    """The same values in a [blocks, kv_heads, block_size, D] allocation, viewed as [blocks, block_size,
    kv_heads, D]: a head's 16 tokens of a block are one 4 KB run (D = 128) instead of 16 runs of 256 B."""
    return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def run_case(shape: Shape, configs, kernels, device, timer, num_sms, seed, hnd_top: int = 0) -> list[dict]:
    import torch

    from metronome.attention.triton_paged import paged_attention_triton, plan_triton

    args = bench_args(seed)
    per_session_kv = (args.sinks + args.window + shape.q) * shape.kv_heads * shape.head_dim * 4
    n_sets = max(1, min(args.max_sets, math.ceil(args.rotate_mb * 2**20 / (per_session_kv * shape.n))))
    sets = build_sets(shape, n_sets, args, device, torch.bfloat16, {"num_sms": num_sms})
    scale = 1.0 / math.sqrt(shape.head_dim)
    check_n = min(shape.n, 64)
    mask = band_mask(shape.q, sets.live_keys, args.sinks, args.window, device)
    ref = torch.nn.functional.scaled_dot_product_attention(
        sets.q_c[0][:check_n].float(), sets.k_c[0][:check_n].float(), sets.v_c[0][:check_n].float(),
        attn_mask=mask, scale=scale, enable_gqa=True)
    moved = sets.kv_bytes + sets.qo_bytes
    caches = {"NHD": (sets.k_cache, sets.v_cache)}

    def measure(kernel_name, layout, cfg):
        bn, warps, stages, splits = cfg
        k_cache, v_cache = caches[layout]
        plans = [plan_triton(m, shape.heads, shape.kv_heads, num_sms=num_sms, block_n=bn, num_warps=warps,
                             num_stages=stages, force_splits=splits) for m in sets.metas]
        row = {"model": shape.model, "mode": shape.mode, "n": shape.n, "kernel": kernel_name, "layout": layout,
               "block_n": bn, "warps": warps, "stages": stages,
               "splits": [ln.num_splits for ln in plans[0].launches]}
        calls = [lambda s=s: paged_attention_triton(sets.queries[s], k_cache, v_cache, sets.metas[s], scale,
                                                    plans[s], out=sets.outs[s]) for s in range(n_sets)]
        try:
            with kernel_swapped(kernels[kernel_name]):
                sets.outs[0].fill_(float("nan"))
                calls[0]()
                got = sets.outs[0].view(shape.n, shape.q, shape.heads, shape.head_dim).transpose(1, 2)[:check_n]
                row["check"] = errors(got, ref)
                row["seconds"] = timer.graph(calls) or timer.eager(calls)
        except Exception as exc:  # noqa: BLE001 - a configuration the compiler rejects (shared memory) is recorded
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            torch.cuda.synchronize()
            return row
        row["bytes_per_s"] = moved / row["seconds"]
        ok = row["check"]["finite"] and row["check"]["rel"] < 2e-2
        row["ok"] = ok
        print(f"  {kernel_name:<6} {layout} bn={bn:<3} w={warps} st={stages} splits={row['splits']}: "
              f"{row['seconds'] * 1e6:7.1f} µs {'' if ok else 'MISMATCH'}", flush=True)
        return row

    rows = [measure(kn, "NHD", cfg) for kn in kernels for cfg in configs]
    if hnd_top:
        caches["HND"] = (head_major(sets.k_cache), head_major(sets.v_cache))
        best = sorted((r for r in rows if r.get("ok") and r["kernel"] == "now"), key=lambda r: r["seconds"])
        for r in best[:hnd_top]:
            forced = r["splits"][0] if len(r["splits"]) == 1 else None
            rows.append(measure("now", "HND", (r["block_n"], r["warps"], r["stages"], forced)))
    for r in rows:
        r.update(kv_bytes=sets.kv_bytes, qo_bytes=sets.qo_bytes, live_keys=sets.live_keys, n_sets=n_sets)
    del sets, caches
    torch.cuda.empty_cache()
    return rows


def read_floor(nbytes: int, device, timer) -> list[dict]:
    """Fastest single launch that reads ``nbytes`` of bf16 (rotating over copies past the L2)."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _read_sum(X, OUT, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * (BLOCK * ITERS)
        acc = tl.zeros([BLOCK], tl.float32)
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(OUT + pid, tl.sum(acc))

    n = nbytes // 2
    copies = max(2, math.ceil(256 * 2**20 / nbytes))
    xs = [torch.randn(n, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    rows = []
    for block, iters, warps in itertools.product((2048, 8192), (1, 4, 16), (4, 8)):
        grid = triton.cdiv(n, block * iters)
        out = torch.empty(grid, device=device, dtype=torch.float32)
        calls = [lambda x=x: _read_sum[(grid,)](x, out, n, BLOCK=block, ITERS=iters, num_warps=warps) for x in xs]
        t = timer.graph(calls)
        rows.append({"reader": "triton_sum", "block": block, "iters": iters, "warps": warps, "programs": grid,
                     "seconds": t, "bytes_per_s": nbytes / t})
    t = timer.graph([lambda x=x: x.sum(dtype=torch.float32) for x in xs])
    rows.append({"reader": "torch_sum", "seconds": t, "bytes_per_s": nbytes / t})
    dst = torch.empty_like(xs[0])
    t = timer.graph([lambda x=x: dst.copy_(x) for x in xs])
    rows.append({"reader": "copy (read + write)", "seconds": t, "bytes_per_s": 2 * nbytes / t})
    for r in rows:
        r["bytes"] = nbytes
    del xs, dst
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import triton

    if not torch.cuda.is_available():
        print("decode_pipeline_gpu.py needs a CUDA GPU; nothing was measured.", file=sys.stderr)
        return 2
    from bench.paged_attn_single_buffered import _paged_attn_fwd as before
    from metronome.attention.triton_paged import _paged_attn_fwd as now

    kernels = {"before": before, "now": now}
    device = torch.device("cuda")
    timer = Timer(device, graphs=True, warmup=3, repeats=args.repeats)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    t0 = time.perf_counter()
    copy = copy_bandwidth(device, timer)
    print(f"copy bandwidth: {copy['bytes_per_s'] / 1e12:.2f} TB/s", flush=True)

    tiles = [(64, 4), (128, 4)] if args.quick else [(32, 4), (64, 4), (128, 4), (128, 8)]
    stages = (3, 4) if args.quick else (2, 3, 4, 5)
    main_grid = [(bn, w, st, sp) for (bn, w), st, sp in itertools.product(tiles, stages, (1, 2, 4))]
    small_grid = [(bn, 4, st, sp) for bn, st, sp in itertools.product((64, 128), (3, 4, 5), (None, 1, 2, 4))]
    prefill_grid = [(bn, 4, st, None) for bn, st in itertools.product((64, 128), (2, 3, 4, 5))]
    q7, q30 = MODELS["qwen2.5-7b"], MODELS["qwen3-30b-a3b"]
    parts = set(args.parts.split(","))
    cases = [(Shape("qwen2.5-7b", *q7, "decode", 1, 64), main_grid, 3)] if "n64" in parts else []
    if not args.quick and "sizes" in parts:
        cases += [(Shape("qwen2.5-7b", *q7, "decode", 1, n), small_grid, 0) for n in (16, 256, 512)]
        cases += [(Shape("qwen3-30b-a3b", *q30, "decode", 1, n), small_grid, 0) for n in (64, 512)]
    if not args.quick and "prefill" in parts:
        cases += [(Shape("qwen2.5-7b", *q7, "prefill26", 26, 256), prefill_grid, 0),
                  (Shape("qwen2.5-7b", *q7, "prefill50", 50, 512), prefill_grid, 0)]
    if "rule" in parts:
        rule_grid = [(64, 4, st, sp) for st, sp in itertools.product((2, 3, 4), (1, 2, 3, 4))]
        cases += [(Shape("qwen2.5-7b", *q7, "decode", 1, n), rule_grid, 0) for n in (16, 64, 128, 256, 512)]
        cases += [(Shape("qwen3-30b-a3b", *q30, "decode", 1, 64), rule_grid, 0)]
    if "warps" in parts:   # warps per program at the sizes where a launch has few programs per SM
        warps_grid = [(bn, w, st, 1) for bn, w, st in itertools.product((32, 64), (2, 4, 8), (3, 4))]
        cases += [(Shape("qwen2.5-7b", *q7, "decode", 1, n), warps_grid, 0) for n in (64, 128)]
    rows, floors = [], []
    for shape, grid, hnd_top in cases:
        if time.perf_counter() - t0 > args.time_limit_s:
            rows.append({"model": shape.model, "mode": shape.mode, "n": shape.n, "skipped": "--time-limit-s"})
            continue
        print(f"{shape.model} {shape.mode} N={shape.n}", flush=True)
        rows += run_case(shape, grid, kernels, device, timer, num_sms, args.seed, hnd_top)
    if "floor" in parts:
        h, kvh, d = q7
        for n in (64, 256, 512):
            nbytes = n * (16 + 1024 + 1) * kvh * d * 2 * 2     # one decode call's live K/V (bf16)
            floors += [dict(r, n=n) for r in read_floor(nbytes, device, timer)]

    print(f"\ncopy bandwidth {copy['bytes_per_s'] / 1e12:.2f} TB/s; µs per call; %copy = (K/V + Q + O bytes) / time")
    for shape, _, _ in cases:
        mine = [r for r in rows if r.get("ok") and (r["model"], r["mode"], r["n"]) == (shape.model, shape.mode,
                                                                                      shape.n)]
        for kn in ("before", "now"):
            for layout in ("NHD", "HND"):
                best = sorted((r for r in mine if r["kernel"] == kn and r["layout"] == layout),
                              key=lambda r: r["seconds"])
                if best:
                    b = best[0]
                    print(f"{shape.model:<14} {shape.mode:<9} N={shape.n:<4} {kn:<6} {layout} best {b['seconds'] * 1e6:7.1f}"
                          f" ({100 * b['bytes_per_s'] / copy['bytes_per_s']:5.1f} %)  bn={b['block_n']} "
                          f"w={b['warps']} st={b['stages']} splits={b['splits']}")
    for n in sorted({f["n"] for f in floors}):
        best = min((f for f in floors if f["n"] == n and f["reader"] != "copy (read + write)"),
                   key=lambda f: f["seconds"])
        cp = next(f for f in floors if f["n"] == n and f["reader"] == "copy (read + write)")
        print(f"read floor N={n}: {best['bytes'] / 2**20:.0f} MiB in {best['seconds'] * 1e6:.1f} µs "
              f"({100 * best['bytes_per_s'] / copy['bytes_per_s']:.1f} % of copy bw, {best['reader']}); "
              f"copying them {cp['seconds'] * 1e6:.1f} µs")
    bad = [r for r in rows if "check" in r and not r.get("ok")]
    info = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(device),
            "num_sms": num_sms, "args": vars(args), "seconds": time.perf_counter() - t0}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"info": info, "copy": copy, "rows": rows, "read_floor": floors}, indent=1))
    print(f"raw results: {out} ({info['seconds']:.0f} s); {len(bad)} mismatching configuration(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
