"""Where a served tick's engine time goes: the worker's inputs (stop tokens) against the benchmark's (none).

The worker passes each adapter's stop tokens, which takes decode off the pipelined path (the host
reads every round's tokens before it prepares the next). This runs the served cliff's shape — a
Qwen2.5-7B-shaped random decoder, S = 16, W = 256, N sessions with full windows, 25 prefill + 25
decode tokens a tick — with and without stop tokens, rebased and absolute positions, and profiles
one tick of each path (host time against GPU kernel time). Each tick records the garbage collections
that ran inside it (generation, pause); ``--heap frozen`` freezes the start-up heap first, as the worker
does (``metronome.serving.gc_pauses``), ``--heap default`` leaves the collector as Python sets it (as every
run before 2026-12-01 session 5 did).

    python bench/engine_stops_gpu.py --sessions 64,128 --out results/engine_stops.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time

import torch

from bench.engine_gpu import make_spec, random_model
from metronome.serving.gc_pauses import CollectorPauses, freeze_startup_heap


def run_ticks(engine, sids, ticks: int, prefill: int, decode: int, stops: tuple[int, ...], gen) -> dict:
    from metronome import SamplingParams, StepInput

    sampling = SamplingParams(stop_token_ids=stops)
    rows = []
    with CollectorPauses() as pauses:
        for _ in range(ticks):
            inputs = [StepInput(s, token_ids=torch.randint(3, 40000, (prefill,), generator=gen).tolist(),
                                max_new_tokens=decode, sampling=sampling) for s in sids]
            pauses.take()
            start = time.perf_counter()
            engine.step(inputs)
            rows.append({"tick_ms": (time.perf_counter() - start) * 1e3,
                         "prefill_ms": engine.last_timing.prefill_ms, "decode_ms": engine.last_timing.decode_ms,
                         "rounds": engine.last_timing.decode_rounds,
                         "gc": [[generation, round(ms, 2)] for generation, ms in pauses.take()]})
    return {"median_tick_ms": statistics.median(r["tick_ms"] for r in rows),
            "median_prefill_ms": statistics.median(r["prefill_ms"] for r in rows),
            "median_decode_ms": statistics.median(r["decode_ms"] for r in rows),
            "full_collections": sum(generation == 2 for r in rows for generation, _ in r["gc"]),
            "max_gc_pause_ms": max((ms for r in rows for _, ms in r["gc"]), default=0.0), "ticks": rows}


def profile_tick(engine, sids, prefill, decode, stops, gen) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_ticks(engine, sids, 1, prefill, decode, stops, gen)
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    top_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    return {"gpu_kernel_ms": gpu_us / 1e3,
            "top_host_ops": [{"name": e.key, "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2)}
                             for e in top_cpu]}


def main() -> None:
    from metronome import Engine, EngineConfig, KVPolicy
    from metronome.engine.blocks import blocks_per_session

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", default="64,128")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--ticks", type=int, default=8)
    p.add_argument("--heap", choices=("frozen", "default"), default="frozen")
    p.add_argument("--out", default="results/engine_stops.json")
    args = p.parse_args()
    spec = make_spec("qwen2.5-7b")
    model = random_model(spec, torch.device("cuda"))
    stops = (0, 2)   # SmolLM2's <|endoftext|> and <|im_end|>: what the energy adapter passes
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args), "runs": []}
    for positions in ("rebased", "absolute"):
        policy = KVPolicy(sinks=16, window=args.window, block_size=16, positions=positions)
        t0 = time.perf_counter()
        sessions = [int(x) for x in args.sessions.split(",")]
        blocks = blocks_per_session(policy, 64, spec.max_position_embeddings) * max(sessions) + 64
        engine = Engine(EngineConfig(model="random", device="cuda", dtype="bfloat16", policy=policy,
                                     num_blocks=blocks, max_chunk_tokens=64), model=model)
        print(f"{positions}: engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
        if args.heap == "frozen":
            freeze_startup_heap()
        for n in [int(x) for x in args.sessions.split(",")]:
            gen = torch.Generator().manual_seed(n)
            sids = [engine.open_session() for _ in range(n)]
            # Age every session past S + W + 2 rebase intervals in 64-token prefill chunks: the window slides.
            for _ in range(math.ceil((policy.sinks + policy.window + 2 * policy.rebase_interval) / 64)):
                run_ticks(engine, sids, 1, 64, 0, (), gen)
            for label, st in (("no stop tokens", ()), ("stop tokens", stops)):
                r = run_ticks(engine, sids, args.ticks, 26, 25, st, gen)
                r.update(positions=positions, N=n, stops=label)
                if n == max(int(x) for x in args.sessions.split(",")) and positions == "rebased":
                    r["profile"] = profile_tick(engine, sids, 26, 25, st, gen)
                results["runs"].append(r)
                print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()
                                  if k not in ("ticks", "profile")}), flush=True)
                if "profile" in r:
                    print(json.dumps(r["profile"])[:1500], flush=True)
            for s in sids:
                engine.close_session(s)
        del engine
        gc.unfreeze()
        gc.collect()   # the engine sits in reference cycles: free its pool before the next one is made
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
