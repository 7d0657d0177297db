"""Where a decode launch's time goes, program by program: the paged kernel's launch-timeline probe on the GPU.

At N = 64 (Qwen2.5-7B decode, S = 16, W = 1024) one launch takes ~42 µs where reading its bytes takes ~34 µs
(docs/benchmarks/gpu.md §1d). The candidates for the difference are the launch's start (the gap before its
first program runs), each program's own start (four dependent loads before its first K/V byte), the ramp-down
while the last programs finish, and uneven SMs. The probe (``paged_attention_triton(..., timelines=...)``)
makes every program record its SM, start and end (``%globaltimer``) and cycles; this script runs it and says
how much of the launch each of those is.

    PYTHONPATH=$PWD python3 bench/decode_timeline_gpu.py --out results/decode_timeline.json

Per N (64, 128, 256, 512 by default) it measures, on ``bench/attention_gpu.py``'s inputs (session sets rotated
past the L2, NaN-poisoned pool; every configuration's output checked against fp32 SDPA first, and the run exits 1
if one is off):

* µs per call by CUDA-graph replay, median of ``--rounds`` interleaved rounds, for: the engine's launch (with the
  register cap its warm-up settles for the shape, ``TritonPagedAttention.warm_up``); the same uncapped, and with
  the single-buffered decode launch capped at ``--max-registers`` (128: ptxas otherwise gives the probed variant
  156 registers with Triton 3.6, 3 programs per SM instead of 4); capped with the probe (trust the timeline
  where these two agree). Session 8 also timed an experimental warp-split kernel here (commit 7740932; it lost,
  docs/benchmarks/gpu.md §1e);
* from one replay of the probed launches back to back (one per session set): each launch's span (first program
  start to last program end), the gap between one launch's last end and the next one's first start, when
  the programs start (the waves), programs per SM, program durations, and how long the launch runs with
  fewer than 90 % of its peak programs resident (ramp-up plus ramp-down);
* at N = 64 again with other windows (``--windows``): the median program duration against the tiles it reads,
  whose intercept is the fixed cost of one program at that concurrency.

Without CUDA it says so and exits with status 2. The summary's arithmetic is tested on the CPU
(``tests/bench/test_decode_timeline_gpu.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FULL = 0.9       # "running full": at least this fraction of the launch's peak programs resident
CHECK_REL = 2e-2  # bf16 output against fp32 SDPA: ‖error‖ / ‖ref‖ above this fails the run
LATE_US = 2.0    # a program that starts this long after the launch's first one waited for a free slot


def summarise_launch(rows: np.ndarray) -> dict:
    """One launch's timeline, ``rows`` = [programs, 6] of (SM, start ns, end ns, start clock, end clock, tiles),
    as the kernel's probe writes them.

    >>> r = np.array([[0, 0, 10_000, 0, 19_800, 4], [1, 0, 10_000, 5, 19_805, 4], [0, 10_000, 20_000, 0, 19_800, 4]])
    >>> s = summarise_launch(r)
    >>> s["span_us"], s["late_programs"], s["peak_resident"], s["programs_per_sm"]
    (20.0, 1, 2, {'1': 1, '2': 1})
    """
    sm, start, end = rows[:, 0], rows[:, 1].astype(np.int64), rows[:, 2].astype(np.int64)
    cycles = rows[:, 4] - rows[:, 3]
    t0 = int(start.min())
    span = int(end.max()) - t0
    # Resident programs over time: +1 at each start, -1 at each end (ends before starts at the same instant).
    times = np.concatenate([start, end]) - t0
    steps = np.concatenate([np.ones_like(start), -np.ones_like(end)])
    order = np.lexsort((steps, times))
    times, resident = times[order], np.cumsum(steps[order])
    peak = int(resident.max())
    widths = np.diff(np.append(times, span))
    below = float(widths[resident < FULL * peak].sum())
    duration = (end - start) / 1e3
    per_sm = np.bincount(np.unique(sm, return_counts=True)[1])
    ns = end - start
    return {
        "programs": int(len(rows)),
        "span_us": span / 1e3,
        "first_start_ns": t0,
        "last_end_ns": int(end.max()),
        "start_offsets_us": {q: float(np.percentile(start - t0, q) / 1e3) for q in (50, 90, 100)},
        "late_programs": int(((start - t0) > LATE_US * 1e3).sum()),
        "peak_resident": peak,
        "below_full_us": below / 1e3,
        "program_us": {q: float(np.percentile(duration, q)) for q in (10, 50, 90)},
        "programs_per_sm": {str(k): int(v) for k, v in enumerate(per_sm) if k and v},
        "sms_used": int(len(np.unique(sm))),
        "clock_ghz": float(np.median(cycles[ns > 0] / ns[ns > 0])) if (ns > 0).any() else None,
        "tiles": {q: float(np.percentile(rows[:, 5], q)) for q in (0, 50, 100)},
    }


def summarise_replay(launches: list[np.ndarray]) -> dict:
    """Back-to-back launches of one replay: the median of each launch's summary, and the gaps between them.

    >>> a = np.array([[0, 0, 10_000, 0, 1, 2]]); b = np.array([[0, 13_000, 20_000, 0, 1, 2]])
    >>> summarise_replay([a, b])["gap_us"]
    3.0
    """
    each = [summarise_launch(r) for r in launches]
    gaps = [(n["first_start_ns"] - p["last_end_ns"]) / 1e3 for p, n in zip(each, each[1:])]
    med = lambda key: float(np.median([e[key] for e in each]))  # noqa: E731
    return {"launches": len(each), "span_us": med("span_us"), "below_full_us": med("below_full_us"),
            "late_programs": med("late_programs"), "gap_us": float(np.median(gaps)) if gaps else None,
            "timer_step_ns": timer_step_ns(launches), "middle": each[len(each) // 2], "each": each}


def timer_step_ns(launches: list[np.ndarray]) -> int | None:
    """The smallest non-zero difference between recorded ``%globaltimer`` values: its resolution here."""
    stamps = np.unique(np.concatenate([r[:, 1:3].ravel() for r in launches]))
    steps = np.diff(stamps)
    return int(steps[steps > 0].min()) if (steps > 0).any() else None


def fixed_cost(points: list[tuple[float, float]]) -> dict:
    """Least-squares ``program µs = fixed + per_tile * tiles`` over (tiles, median program µs) points.

    >>> fixed_cost([(2, 5.0), (10, 13.0), (18, 21.0)])
    {'fixed_us': 3.0, 'per_tile_us': 1.0}
    """
    x, y = np.array(points, dtype=float).T
    per_tile, fixed = np.polyfit(x, y, 1)
    return {"fixed_us": round(float(fixed), 3), "per_tile_us": round(float(per_tile), 3)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "results" / "decode_timeline.json"))
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--sessions", default="64,128,256,512")
    p.add_argument("--max-registers", type=int, default=128, help="ptxas cap for the capped and probed runs")
    p.add_argument("--windows", default="128,384,640,1024", help="windows W for the fixed-cost fit at N = 64")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds of every configuration")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("decode_timeline_gpu.py needs a CUDA GPU; nothing was measured.", file=sys.stderr)
        return 2
    import triton

    from bench.attention_gpu import MODELS, Shape, Timer, band_mask, build_sets, engine_plan_kw, errors
    from metronome.attention.triton_paged import paged_attention_triton

    device = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    timer = Timer(device, graphs=True, warmup=3, repeats=args.repeats)
    heads, kv_heads, head_dim = MODELS[args.model]
    plan_kw = {"num_sms": num_sms, "block_n": 64, "force_splits": None, "target_programs": None,
               "prefill_block_m": 64, "num_warps": None, "num_stages": None}
    # The engine's register cap for this model (it depends on heads and head size, not on N or W).
    engine_kw = engine_plan_kw(Shape(args.model, heads, kv_heads, head_dim, "decode", 1, 1), plan_kw,
                               argparse.Namespace(block_size=16, sinks=16, window=1024), device, torch.bfloat16)
    scale = 1.0 / math.sqrt(head_dim)
    out = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name(device), "num_sms": num_sms, "args": vars(args),
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cases": []}

    def case(n: int, window: int) -> dict:
        sa = argparse.Namespace(block_size=16, sinks=16, window=window, age=4096, seed=args.seed, rotate_mb=256.0,
                                max_sets=128)
        shape = Shape(args.model, heads, kv_heads, head_dim, "decode", 1, n)
        per_session = (sa.sinks + window + 1) * kv_heads * head_dim * 4
        n_sets = max(2, min(sa.max_sets, math.ceil(sa.rotate_mb * 2**20 / (per_session * n))))   # >= 2: gaps
        sets = build_sets(shape, n_sets, sa, device, torch.bfloat16, engine_kw)
        timelines = [[torch.full((ln.num_splits, ln.num_items, kv_heads, 6), -1, dtype=torch.int64, device=device)
                      for ln in plan.launches] for plan in sets.plans]
        capped = [dataclasses.replace(p, max_registers=args.max_registers) for p in sets.plans]
        uncapped = [dataclasses.replace(p, max_registers=None) for p in sets.plans]

        def engine(plans, probe=False):
            return lambda s: lambda: paged_attention_triton(
                sets.queries[s], sets.k_cache, sets.v_cache, sets.metas[s], scale, plans[s], out=sets.outs[s],
                timelines=timelines[s] if probe else None)

        configs = {"engine": engine(sets.plans), "uncapped": engine(uncapped), "capped": engine(capped),
                   "probed": engine(capped, probe=True)}
        row = {"sessions": n, "window": window, "n_sets": n_sets, "kv_bytes": sets.kv_bytes,
               "engine_max_registers": engine_kw.get("max_registers"),
               "launches": [{"splits": ln.num_splits, "stages": ln.num_stages, "items": ln.num_items}
                            for ln in sets.plans[0].launches], "checks": {}, "us": {}}
        # Each configuration against fp32 SDPA with the explicit mask on the first 64 sessions of set 0.
        k = min(n, 64)
        ref = torch.nn.functional.scaled_dot_product_attention(
            sets.q_c[0][:k].float(), sets.k_c[0][:k].float(), sets.v_c[0][:k].float(),
            attn_mask=band_mask(1, sets.live_keys, sa.sinks, window, device), scale=scale, enable_gqa=True)
        for name, make in configs.items():
            sets.outs[0].fill_(float("nan"))
            make(0)()
            row["checks"][name] = errors(sets.outs[0].view(n, 1, heads, head_dim).transpose(1, 2)[:k], ref)
        # Interleaved rounds: no configuration always runs first (the first timed one read slowest).
        samples: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(args.rounds):
            for name, make in configs.items():
                t = timer.graph([make(s) for s in range(n_sets)])
                if t is None:
                    raise RuntimeError(f"CUDA graph capture failed for {name} (printed above)")
                samples[name].append(t * 1e6)
        row["us"] = {name: float(np.median(v)) for name, v in samples.items()}
        row["us_rounds"] = samples
        # The timeline: one replay of the probed launches back to back, into rows reset to -1 first.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for s in range(n_sets):
                configs["probed"](s)()
        for per_set in timelines:
            for t in per_set:
                t.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        launches = [t.view(-1, 6).cpu().numpy() for per_set in timelines for t in per_set]
        if any((r[:, 0] < 0).any() for r in launches):
            raise RuntimeError("a program left its timeline row unwritten")
        row["timeline"] = summarise_replay(launches)
        row["timeline"].pop("each")
        row["bytes_per_s"] = sets.kv_bytes / (row["us"]["engine"] * 1e-6)
        del sets, timelines, capped, uncapped, configs, graph
        torch.cuda.empty_cache()
        return row

    for n in [int(x) for x in args.sessions.split(",") if x]:
        out["cases"].append(case(n, 1024))
        print(json.dumps({k: v for k, v in out["cases"][-1].items() if k != "timeline"}), flush=True)
    fit_points = []
    for window in [int(x) for x in args.windows.split(",") if x]:
        row = next((c for c in out["cases"] if (c["sessions"], c["window"]) == (64, window)), None)
        if row is None:
            row = case(64, window)
            out["cases"].append(row)
        middle = row["timeline"]["middle"]
        fit_points.append((middle["tiles"][50], middle["program_us"][50]))
    if len(fit_points) >= 2:
        out["n64_fixed_cost"] = fixed_cost(fit_points) | {"points": fit_points}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))

    names = list(out["cases"][0]["us"])
    print(f"\n{out['device']}, {args.model} decode, S = 16; µs per call (median of {args.rounds} interleaved "
          f"rounds of CUDA-graph replays)")
    print(f"{'N':>4} {'W':>5} " + " ".join(f"{name:>20}" for name in names))
    for c in out["cases"]:
        print(f"{c['sessions']:>4} {c['window']:>5} " + " ".join(f"{c['us'][name]:20.1f}" for name in names))
    print(f"\ntimeline of the probed launches (µs); timer step {out['cases'][0]['timeline']['timer_step_ns']} ns")
    print(f"{'N':>4} {'W':>5} {'span':>6} {'gap':>5} {'<90%':>6} {'late':>5} {'start p90':>9} {'prog p10/50/90':>16} "
          f"{'per SM':>16} {'GHz':>5}")
    for c in out["cases"]:
        t, f = c["timeline"], c["timeline"]["middle"]
        prog = "/".join(f"{f['program_us'][q]:.1f}" for q in (10, 50, 90))
        per_sm = ",".join(f"{k}x{v}" for k, v in f["programs_per_sm"].items())
        gap = t["gap_us"] if t["gap_us"] is not None else float("nan")
        print(f"{c['sessions']:>4} {c['window']:>5} {t['span_us']:6.1f} {gap:5.1f} {t['below_full_us']:6.1f} "
              f"{t['late_programs']:5.0f} {f['start_offsets_us'][90]:9.2f} {prog:>16} {per_sm:>16} "
              f"{f['clock_ghz'] or 0:5.2f}")
    if "n64_fixed_cost" in out:
        fc = out["n64_fixed_cost"]
        print(f"N = 64: program µs = {fc['fixed_us']:.2f} + {fc['per_tile_us']:.3f} x tiles")
    failed = [(c["sessions"], c["window"], name) for c in out["cases"] for name, e in c["checks"].items()
              if not e["finite"] or e["rel"] > CHECK_REL]
    if failed:
        print(f"CHECK FAILED (output against fp32 SDPA): {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
