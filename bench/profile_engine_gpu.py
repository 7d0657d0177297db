"""Where one engine tick's GPU time goes: a kernel-level profile of the Qwen2.5-7B-shaped tick.

    python bench/profile_engine_gpu.py --sessions 64,256 --out results/profile_engine_gpu.json

Same setup as ``bench/engine_gpu.py`` (random bf16 weights, S=16, W=1024, sessions aged to a full
window, 26 prefill + 25 decode tokens per session). Per N: one warm tick, then one tick under
``torch.profiler``; CUDA kernel time is grouped into classes (GEMM, attention, norm/RoPE,
elementwise, sampling, copies, other) and split into the prefill forward and the decode rounds, and
compared with two floors: the issue's ``max(bytes, FLOPs)`` roofline and the tighter sequential one
(prefill FLOPs at the matmul rate + decode-round bytes at copy bandwidth), which no schedule of these
forwards can beat.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.engine_gpu import make_engine, make_spec, measure_hardware, random_model, roofline_ms

CLASSES = (
    ("attention", ("paged_attn",)),
    ("gemm", ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "ampere", "cublas", "splitk")),
    ("norm_rope", ("rms", "norm", "rope")),
    ("sampling", ("argmax", "max_", "sort", "topk", "softmax", "multinomial", "exponential")),
    ("copy_index", ("copy", "index", "gather", "scatter", "cat", "fill")),
    ("elementwise", ("elementwise", "vectorized", "silu", "mul", "add")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def tight_floor_ms(spec, n: int, prefill: int, decode: int, live_keys: int, hw: dict) -> float:
    """Prefill forward at the matmul rate, then decode - 1 rounds at copy bandwidth."""
    r = roofline_ms(spec, n, prefill, decode, live_keys, hw)
    per_forward_bytes_ms = r["bytes_ms"] / decode
    tokens = n * (prefill + 1)
    params = (spec.num_layers * (spec.hidden_size * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
                                 + spec.num_heads * spec.head_dim * spec.hidden_size
                                 + 3 * spec.hidden_size * spec.intermediate_size))
    prefill_ms = 2 * params * tokens / hw["matmul_flops_per_s"] * 1e3
    return prefill_ms + (decode - 1) * per_forward_bytes_ms


def profile_tick(spec, engine, n: int, args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from metronome import StepInput

    policy = engine.config.policy
    gen = torch.Generator().manual_seed(n)
    sids = [engine.open_session() for _ in range(n)]
    for _ in range(math.ceil((policy.window + policy.sinks) / 256)):
        engine.step([StepInput(s, token_ids=torch.randint(0, spec.vocab_size, (256,), generator=gen).tolist())
                     for s in sids])

    def tick():
        return engine.step([StepInput(s, token_ids=torch.randint(0, spec.vocab_size, (args.prefill,),
                                                                 generator=gen).tolist(),
                                      max_new_tokens=args.decode) for s in sids])

    tick()
    start = time.perf_counter()
    tick()
    wall_ms = (time.perf_counter() - start) * 1e3
    timing = engine.last_timing
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        tick()
    by_class: dict[str, float] = defaultdict(float)
    top = []
    for evt in prof.key_averages():
        cuda_us = getattr(evt, "device_time_total", 0.0) or getattr(evt, "cuda_time_total", 0.0)
        if evt.device_type == torch.autograd.DeviceType.CUDA and cuda_us > 0:
            by_class[kernel_class(evt.key)] += cuda_us / 1e3
            top.append((cuda_us / 1e3, evt.count, evt.key[:90]))
    top.sort(reverse=True)
    live = engine.scheduler.sessions[sids[0]]
    live_keys = min(live.num_tokens, policy.sinks + policy.window)
    for s in sids:
        engine.close_session(s)
    return {"N": n, "tick_ms": wall_ms, "prefill_ms": timing.prefill_ms, "decode_ms": timing.decode_ms,
            "kernel_ms_by_class": dict(by_class), "kernel_ms_total": sum(by_class.values()),
            "top_kernels": [{"ms": ms, "count": c, "name": k} for ms, c, k in top[:25]],
            "live_keys": live_keys}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--sessions", default="64,256")
    p.add_argument("--prefill", type=int, default=26)
    p.add_argument("--decode", type=int, default=25)
    p.add_argument("--attention", default="triton")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--out", default="results/profile_engine_gpu.json")
    args = p.parse_args()
    device = torch.device("cuda")
    hw = measure_hardware(device)
    spec = make_spec(args.shape)
    engine = make_engine(random_model(spec, device), args, device)
    results = {"hardware": hw, "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
               "torch": torch.__version__, "runs": []}
    for n in [int(x) for x in args.sessions.split(",") if x]:
        r = profile_tick(spec, engine, n, args)
        r["floor_ms"] = roofline_ms(spec, n, args.prefill, args.decode, r["live_keys"], hw)["floor_ms"]
        r["tight_floor_ms"] = tight_floor_ms(spec, n, args.prefill, args.decode, r["live_keys"], hw)
        results["runs"].append(r)
        print(f"\nN={n}: tick {r['tick_ms']:.1f} ms (prefill {r['prefill_ms']:.1f}, decode {r['decode_ms']:.1f}); "
              f"floor {r['floor_ms']:.1f} (x{r['tick_ms'] / r['floor_ms']:.2f}), sequential floor "
              f"{r['tight_floor_ms']:.1f} (x{r['tick_ms'] / r['tight_floor_ms']:.2f}); kernels {r['kernel_ms_total']:.1f} ms")
        for cls, ms in sorted(r["kernel_ms_by_class"].items(), key=lambda kv: -kv[1]):
            print(f"  {cls:<12} {ms:8.1f} ms")
        for k in r["top_kernels"][:12]:
            print(f"    {k['ms']:8.2f} ms x{k['count']:<5} {k['name']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
