"""GPU engine tick benchmark: a Qwen2.5-7B-shaped decoder with random bf16 weights made on the device.

    python bench/engine_gpu.py --sessions 64,128,256,320,384,512 --ticks 2 --hf-sessions ""
    python bench/engine_gpu.py --served                 # the served tick: stop tokens, rebased/absolute

Figures: docs/benchmarks/gpu.md (engine tick vs roofline; served tick and capacity).

Per N sessions, one tick = every session prefills ``--prefill`` (26) new tokens, then ``--decode``
(25) tokens are decoded in shared rounds (SinkWindow S = 16, W = 1024, sessions pre-aged so the window
is full). Reported against the roofline floor of that tick, measured in the same run: max(bytes of
weights + live KV read per forward / copy bandwidth, FLOPs / bf16 matmul rate), and against transformers
driving the same batches with a growing batched ``DynamicCache`` (after the engine is closed, so the two
never share the GPU). The largest N whose tick stays within 0.3·B (B = 2 s) is the capacity.

``--served`` runs the tick as the worker does instead: with and without the adapters' stop tokens (the
host reads each decode round's tokens one round late), under rebased and absolute positions, sessions
aged past two rebase intervals, the start-up heap frozen as the worker freezes it; medians of
``--ticks`` ticks at N = 288, 320, 352 by default.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

SERVED_STOPS = (0, 2)   # SmolLM2's <|endoftext|> and <|im_end|>: what the energy adapter passes


def make_spec(name: str):
    """The decoder spec of a shape in ``metronome/experiments/shapes.py`` (the one table of benchmark shapes)."""
    from metronome.models.spec import spec_from_hf_config

    from metronome.experiments.shapes import shape_config

    return spec_from_hf_config(shape_config(name))


def random_model(spec, device):
    from metronome.experiments.random_weights import random_decoder
    from metronome.models.llama import LlamaFamilyForCausalLM

    return random_decoder(LlamaFamilyForCausalLM, spec, device, torch.bfloat16)


def measure_hardware(device) -> dict:
    n = 1 << 28  # 512 MiB of bf16
    a = torch.empty(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    reps = 20
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize()
    copy_bw = 2 * a.numel() * 2 * reps / (time.perf_counter() - t)  # read + write
    del a, b
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        m @ m
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        m @ m
    torch.cuda.synchronize()
    flops = 2 * 8192 ** 3 * 10 / (time.perf_counter() - t)
    return {"copy_bytes_per_s": copy_bw, "matmul_flops_per_s": flops}


def roofline_ms(spec, n: int, prefill: int, decode: int, live_keys: int, hw: dict) -> dict:
    params = sum(p for p in [spec.vocab_size * spec.hidden_size * 2,  # embedding + lm_head
                             spec.num_layers * (spec.hidden_size * (spec.num_heads + 2 * spec.num_kv_heads)
                                                * spec.head_dim + spec.num_heads * spec.head_dim * spec.hidden_size
                                                + 3 * spec.hidden_size * spec.intermediate_size)])
    weight_bytes = 2 * (params - spec.vocab_size * spec.hidden_size)  # the embedding is gathered, not streamed
    kv_token = spec.kv_bytes_per_token(torch.bfloat16)
    forwards = decode  # one prefill forward (yields the first token) + decode - 1 rounds
    bytes_total = forwards * (weight_bytes + n * live_keys * kv_token)
    tokens = n * (prefill + decode)
    flops = 2 * params * tokens + 4 * spec.num_layers * spec.num_heads * spec.head_dim * live_keys * tokens
    return {"bytes_ms": bytes_total / hw["copy_bytes_per_s"] * 1e3, "flops_ms": flops / hw["matmul_flops_per_s"] * 1e3,
            "floor_ms": max(bytes_total / hw["copy_bytes_per_s"], flops / hw["matmul_flops_per_s"]) * 1e3}


def make_engine(model, args, device):
    from metronome import Engine, EngineConfig, KVPolicy

    policy = KVPolicy(sinks=args.sinks, window=args.window, block_size=16)
    start = time.perf_counter()
    engine = Engine(EngineConfig(model="random", device=str(device), dtype="bfloat16", policy=policy,
                                 attention=args.attention, cuda_graphs=not args.no_graphs, kv_memory_fraction=0.85,
                                 max_chunk_tokens=256, max_batch_tokens=16384), model=model)
    print(f"engine ready in {time.perf_counter() - start:.1f} s (graphs: {engine.runner.graphs is not None})",
          flush=True)
    return engine


def bench_metronome(spec, engine, n, args) -> dict:
    from metronome import StepInput

    policy = engine.config.policy
    if engine.stats().capacity < n:
        return {"N": n, "skipped": f"KV pool holds {engine.stats().capacity} sessions"}
    gen = torch.Generator().manual_seed(n)
    sids = [engine.open_session() for _ in range(n)]
    # Age the sessions until the window is full, in chunks of 256.
    for _ in range(math.ceil((policy.window + policy.sinks) / 256)):
        engine.step([StepInput(s, token_ids=torch.randint(0, spec.vocab_size, (256,), generator=gen).tolist())
                     for s in sids])
    ticks = []
    for t in range(args.ticks + 1):
        inputs = [StepInput(s, token_ids=torch.randint(0, spec.vocab_size, (args.prefill,), generator=gen).tolist(),
                            max_new_tokens=args.decode) for s in sids]
        start = time.perf_counter()
        engine.step(inputs)
        torch.cuda.synchronize()   # the step returns once its work is queued
        elapsed = (time.perf_counter() - start) * 1e3
        if t:
            ticks.append({"tick_ms": elapsed, "prefill_ms": engine.last_timing.prefill_ms,
                          "decode_ms": engine.last_timing.decode_ms})
    live = engine.scheduler.sessions[sids[0]]
    live_keys = min(live.num_tokens, policy.sinks + policy.window)
    for s in sids:
        engine.close_session(s)
    return {"N": n, "ticks": ticks, "median_ms": statistics.median(x["tick_ms"] for x in ticks),
            "live_keys": live_keys}


def bench_transformers(spec, n, args, device) -> dict:
    from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
                         num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                         intermediate_size=spec.intermediate_size, vocab_size=spec.vocab_size,
                         max_position_embeddings=32768, tie_word_embeddings=False)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    cache = DynamicCache()
    gen = torch.Generator().manual_seed(n)
    ticks, last = [], None
    with torch.inference_mode():
        for t in range(args.ticks + 1):
            ids = torch.randint(0, spec.vocab_size, (n, args.prefill), generator=gen).to(device)
            if last is not None:
                ids = torch.cat([last, ids], 1)
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(args.decode - 1):
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            last = token
            if t:
                ticks.append({"tick_ms": (time.perf_counter() - start) * 1e3})
    del model, cache, out
    torch.cuda.empty_cache()
    return {"N": n, "ticks": ticks, "median_ms": statistics.median(x["tick_ms"] for x in ticks)}


def roofline_run(spec, args, device, results: dict) -> None:
    hw = results["hardware"] = measure_hardware(device)
    # The engine holds the only reference to the model: closing it frees the weights, the KV pool and the
    # graphs before the transformers arm allocates its own.
    with make_engine(random_model(spec, device), args, device) as engine:
        for n in ints(args.sessions):
            r = bench_metronome(spec, engine, n, args)
            if "median_ms" in r:
                r["roofline"] = roofline_ms(spec, n, args.prefill, args.decode, r["live_keys"], hw)
                r["x_floor"] = r["median_ms"] / r["roofline"]["floor_ms"]
            results["metronome"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "ticks"}), flush=True)
    gc.collect()
    torch.cuda.empty_cache()
    for n in ints(args.hf_sessions):
        r = bench_transformers(spec, n, args, device)
        results["transformers"].append(r)
        print(json.dumps({"transformers": {k: v for k, v in r.items() if k != "ticks"}}), flush=True)
    limit = 0.3 * args.budget_ms
    fit = [r["N"] for r in results["metronome"] if r.get("median_ms", math.inf) <= limit]
    results["capacity_at_0.3B"] = max(fit) if fit else 0
    print(f"\ncopy {hw['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {hw['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    print(f"{'N':>5} {'tick ms':>9} {'floor ms':>9} {'x floor':>8}")
    for r in results["metronome"]:
        if "median_ms" in r:
            print(f"{r['N']:>5} {r['median_ms']:>9.1f} {r['roofline']['floor_ms']:>9.1f} {r['x_floor']:>8.2f}")
        else:
            print(f"{r['N']:>5} {r['skipped']}")
    for r in results["transformers"]:
        print(f"transformers N={r['N']}: {r['median_ms']:.1f} ms per tick")
    print(f"capacity (tick <= {limit:.0f} ms): {results['capacity_at_0.3B']} sessions")


def served_ticks(engine, sids, ticks: int, prefill: int, decode: int, stops: tuple[int, ...], gen) -> dict:
    from metronome import SamplingParams, StepInput

    sampling = SamplingParams(stop_token_ids=stops)
    rows = []
    for _ in range(ticks):
        inputs = [StepInput(s, token_ids=torch.randint(3, 40000, (prefill,), generator=gen).tolist(),
                            max_new_tokens=decode, sampling=sampling) for s in sids]
        start = time.perf_counter()
        engine.step(inputs)
        torch.cuda.synchronize()   # the step returns once its work is queued
        rows.append({"tick_ms": (time.perf_counter() - start) * 1e3, "prefill_ms": engine.last_timing.prefill_ms,
                     "decode_ms": engine.last_timing.decode_ms, "rounds": engine.last_timing.decode_rounds})
    return {f"median_{k}": statistics.median(r[k] for r in rows) for k in ("tick_ms", "prefill_ms", "decode_ms")} \
        | {"ticks": rows}


def served_run(spec, args, device, results: dict) -> None:
    """The worker's tick: stop tokens or none, rebased or absolute positions, at each N."""
    from metronome import Engine, EngineConfig, KVPolicy
    from metronome.engine.blocks import blocks_per_session
    from metronome.serving.gc_pauses import freeze_startup_heap

    model = random_model(spec, device)
    sessions, chunk = ints(args.sessions), 64
    for positions in ("rebased", "absolute"):
        policy = KVPolicy(sinks=args.sinks, window=args.window, block_size=16, positions=positions)
        blocks = blocks_per_session(policy, chunk, spec.max_position_embeddings) * max(sessions) + 64
        config = EngineConfig(model="random", device=str(device), dtype="bfloat16", policy=policy,
                              attention=args.attention, cuda_graphs=not args.no_graphs, num_blocks=blocks,
                              max_chunk_tokens=chunk)
        with Engine(config, model=model) as engine:
            freeze_startup_heap()
            for n in sessions:
                gen = torch.Generator().manual_seed(n)
                sids = [engine.open_session() for _ in range(n)]
                # Past S + W + two rebase intervals, in prefill chunks: every window has slid and rebased.
                for _ in range(math.ceil((policy.sinks + policy.window + 2 * policy.rebase_interval) / chunk)):
                    served_ticks(engine, sids, 1, chunk, 0, (), gen)
                for label, stops in (("no stop tokens", ()), ("stop tokens", SERVED_STOPS)):
                    r = served_ticks(engine, sids, args.ticks, args.prefill, args.decode, stops, gen)
                    r.update(positions=positions, N=n, stops=label)
                    results["runs"].append(r)
                    print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()
                                      if k != "ticks"}), flush=True)
                for s in sids:
                    engine.close_session(s)
        gc.unfreeze()
        gc.collect()
    del model
    torch.cuda.empty_cache()
    labels = [(p, st) for p in ("rebased", "absolute") for st in ("no stop tokens", "stop tokens")]
    print(f"\nmedian tick ms, S = {args.sinks}, W = {args.window}, {args.prefill} prefill + {args.decode} decode tokens")
    print(f"{'N':>5} " + " ".join(f"{p + ', ' + st:>26}" for p, st in labels))
    for n in sessions:
        cells = {(r["positions"], r["stops"]): r["median_tick_ms"] for r in results["runs"] if r["N"] == n}
        print(f"{n:>5} " + " ".join(f"{cells[key]:>26.0f}" for key in labels))


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> dict:
    from metronome.experiments.shapes import SHAPES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=type(
        "Formatter", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {}))
    p.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES), help="decoder shape")
    p.add_argument("--served", action="store_true",
                   help="the served tick (stop tokens x rebased/absolute positions) instead of the roofline run")
    p.add_argument("--sessions", default=argparse.SUPPRESS, help="N; default 64,128,256,384,512, served 288,320,352")
    p.add_argument("--hf-sessions", default="16,64,128", help="N for the transformers arm ('' skips it)")
    p.add_argument("--ticks", type=int, default=argparse.SUPPRESS, help="measured ticks per N; default 3, served 8")
    p.add_argument("--prefill", type=int, default=26, help="new tokens per session per tick")
    p.add_argument("--decode", type=int, default=25, help="decode tokens per session per tick")
    p.add_argument("--budget-ms", type=float, default=2000.0, help="tick budget B")
    p.add_argument("--sinks", type=int, default=16, help="SinkWindow sinks S")
    p.add_argument("--window", type=int, default=1024, help="SinkWindow window W")
    p.add_argument("--attention", default="triton", choices=["triton", "torch"], help="attention backend")
    p.add_argument("--no-graphs", action="store_true", help="eager decode rounds (no CUDA graphs)")
    p.add_argument("--out", default=argparse.SUPPRESS,
                   help="raw JSON; default results/engine_gpu.json, served results/engine_served.json")
    args = p.parse_args(argv)
    for key, value in (dict(sessions="288,320,352", ticks=8, out="results/engine_served.json") if args.served
                       else dict(sessions="64,128,256,384,512", ticks=3, out="results/engine_gpu.json")).items():
        if not hasattr(args, key):
            setattr(args, key, value)
    if not torch.cuda.is_available():
        raise SystemExit("bench/engine_gpu.py needs a CUDA device")
    device = torch.device("cuda")
    spec = make_spec(args.shape)
    results = {"shape": args.shape, "args": vars(args), "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "platform": platform.platform(), "date": time.strftime("%Y-%m-%d")}
    if args.served:
        results["runs"] = []
        served_run(spec, args, device, results)
    else:
        results.update(metronome=[], transformers=[])
        roofline_run(spec, args, device, results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"raw results: {args.out}")
    return results


if __name__ == "__main__":
    main()
