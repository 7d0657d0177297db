"""FP8 on one GPU, bf16 against FP8: quality (SmolLM2 perplexity), the layers (linear, MoE experts) and engine ticks.

    python bench/fp8_gpu.py --out results/fp8_gpu.json            # every part (about 10 minutes on an H200)
    python bench/fp8_gpu.py --parts perplexity,linear --out results/fp8_quick.json

Parts:

* ``perplexity``: SmolLM2-135M-Instruct (the packaged checkpoint, real weights) on ``--tokens`` tokens of English
  prose in chunks of 256 through a sink + window session (S = 16, W = 1024): bf16, FP8 weights, FP8 KV, both.
* ``linear``: ``Fp8Linear`` against bf16 ``F.linear`` at Qwen2.5-7B's four layer shapes (``--linear-shape``: or
  Qwen3-8B's), for decode-sized and prefill-sized row counts: µs per call replayed in a CUDA graph (as the engine's
  decode rounds run), cycling through enough copies of the weight that it comes from memory and not from L2; each
  FP8 product on its own (cuBLAS's ``_scaled_mm``; the streamed Triton product with bf16 or E4M3 activations; the
  tiled Triton product with E4M3 activations); the eager per-call time
  (launch cost inside); and the weight bytes streamed per µs (decode rounds are weight-bound: FP8 halves them).
* ``moe``: the grouped GEMM over Qwen3-Omni-30B-A3B's experts (E = 128, k = 8, H = 2048, I = 768), bf16 against
  E4M3 experts with bf16 activations (W8A16) and with E4M3 activations (W8A8, the default), at decode batches of
  N tokens: the two kernels' time and the whole layer's (routing and the weighted sum too) in a CUDA graph, the
  layer eager, and the floor of streaming the experts that round touches once, at the measured copy and
  read-only bandwidths.
* ``engine``: a Qwen2.5-7B-shaped decoder (random weights): one tick of N sessions (26 tokens prefilled, 25
  decoded, windows full) in bf16, with FP8 weights, with FP8 weights and FP8 KV; and each pool's capacity
  (sessions that fit at ``kv_memory_fraction`` 0.85 beside the weights).
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
import torch.nn.functional as F

# hidden, intermediate, query heads, KV heads, head_dim of the decoders whose layers ``linear`` times. Qwen3-Omni's
# thinker has no dense MLP: its attention's qkv and o are the layers that count; its gate_up and down rows time one
# expert's shape through Fp8Linear, which the experts themselves never run (they take the grouped GEMM).
LINEAR_SHAPES = {"qwen2.5-7b": (3584, 18944, 28, 4, 128), "qwen3-8b": (4096, 12288, 32, 8, 128),
                 "qwen3-omni": (2048, 768, 32, 4, 128)}
VARIANTS = {"bf16": (None, "auto"), "fp8-weights": ("fp8", "auto"), "fp8-kv": (None, "fp8"), "fp8-both": ("fp8", "fp8")}


def timed_us(fn, reps: int = 50) -> float:
    """Median of ``reps`` CUDA-event timings of one eager call of ``fn`` (after a warm-up), in µs: the host's
    launch cost is inside."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def graphed_us(fns, inner: int = 5, reps: int = 9) -> float:
    """µs per call of ``fns`` (a list of calls) captured ``inner`` times in one CUDA graph, median of ``reps``
    replays: the GPU's time with no launch cost, as in the engine's captured decode rounds."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):   # compile and allocate outside the capture
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            for fn in fns:
                fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (inner * len(fns)))
    del graph
    return statistics.median(times)


def copy_bandwidth() -> dict:
    """Device-to-device copy (bytes read + written per second) and read-only streaming (a sum over the same
    bytes), eager, 512 MiB."""
    a = torch.empty(1 << 28, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    copy_us = timed_us(lambda: b.copy_(a), reps=10)
    words = a.view(torch.float32)
    read_us = timed_us(lambda: words.sum(), reps=10)
    return {"copy_bytes_per_s": 2 * a.numel() * 2 / (copy_us * 1e-6),
            "read_bytes_per_s": a.numel() * 2 / (read_us * 1e-6)}


def l2_defeating_copies(weight_bytes: int) -> int:
    """How many copies of a weight make a cycle through them four times the GPU's L2 (a decode round reads each
    layer's weight once, from memory, not from the cache a benchmark loop would leave it in)."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    return max(2, math.ceil(4 * l2 / weight_bytes))


def release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- parts
def bench_perplexity(args) -> dict:
    from metronome import Engine, EngineConfig, KVPolicy, StepInput
    from metronome.experiments.quality import perplexity, text_tokens
    from metronome.models.loader import load_tokenizer, resolve_checkpoint

    checkpoint = resolve_checkpoint("smollm2-135m")
    tokens, chars = text_tokens(load_tokenizer(checkpoint), args.tokens)
    out = {"tokens": len(tokens), "chars": chars, "perplexity": {}}
    for name, (quantization, kv) in VARIANTS.items():
        engine = Engine(EngineConfig(model=str(checkpoint), device="cuda", dtype="bfloat16", num_blocks=400,
                                     quantization=quantization, kv_cache_dtype=kv,
                                     policy=KVPolicy(sinks=16, window=1024, block_size=16)))
        sid = engine.open_session()
        logprobs = []
        for k in range(0, len(tokens), 256):
            res, = engine.step([StepInput(sid, token_ids=tokens[k:k + 256], prompt_logprobs=True)])
            logprobs += res.prompt_logprobs
        engine.close()
        out["perplexity"][name] = perplexity(logprobs)
        release()
    base = out["perplexity"]["bf16"]
    out["vs_bf16"] = {k: v / base - 1 for k, v in out["perplexity"].items()}
    return out


def bench_linear(args) -> dict:
    from metronome.models.fp8 import STREAMED_MAX_ROWS, TILED_MAX_ROWS, Fp8Linear, fp8_matmul, quantize_rows
    from metronome.models.fp8_tiled_triton import fp8_tiled_linear
    from metronome.models.fp8_triton import fp8_weight_linear

    hidden, inter, heads, kv_heads, d = LINEAR_SHAPES[args.linear_shape]
    shapes = {"qkv": (hidden, (heads + 2 * kv_heads) * d), "o": (heads * d, hidden), "gate_up": (hidden, 2 * inter),
              "down": (inter, hidden)}
    rows = [int(x) for x in args.rows.split(",")]
    out = []
    for name, (k, n) in shapes.items():
        copies = l2_defeating_copies(2 * k * n)
        linears = [torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        fp8s = [Fp8Linear.from_linear(linear) for linear in linears]
        assert fp8s[0].tensor_cores, "needs FP8 tensor cores (compute capability >= 8.9)"
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"layer": name, "K": k, "N": n, "rows": m, "weight_copies": copies,
                   "bf16_us": graphed_us([lambda w=linear.weight: F.linear(x, w) for linear in linears]),
                   "fp8_us": graphed_us([lambda f=f: f(x) for f in fp8s])}
            # Each FP8 product on its own: cuBLAS's (activations quantised per token), and the streamed Triton
            # product in both forms, past the row count where the layer leaves it too (to show where that falls).
            row["scaled_mm_us"] = graphed_us([lambda f=f: fp8_matmul(x, f.weight, f.weight_scale) for f in fp8s])
            if m <= 4 * STREAMED_MAX_ROWS:
                row["streamed_w8a16_us"] = graphed_us([lambda f=f: fp8_weight_linear(x, f.weight, f.weight_scale)
                                                       for f in fp8s])

                def streamed_w8a8(f: Fp8Linear) -> torch.Tensor:   # the rows' quantising launch counts too
                    rows_e4m3, row_scale = quantize_rows(x)
                    return fp8_weight_linear(rows_e4m3, f.weight, f.weight_scale, x_scale=row_scale, out_dtype=x.dtype)

                row["streamed_w8a8_us"] = graphed_us([lambda f=f: streamed_w8a8(f) for f in fp8s])
            if STREAMED_MAX_ROWS < m <= 2 * TILED_MAX_ROWS:   # past its range too, to show where it should end
                def tiled(f: Fp8Linear) -> torch.Tensor:
                    rows_e4m3, row_scale = quantize_rows(x)
                    return fp8_tiled_linear(rows_e4m3, row_scale, f.weight, f.weight_scale, out_dtype=x.dtype)

                row["tiled_w8a8_us"] = graphed_us([lambda f=f: tiled(f) for f in fp8s])
            row.update({"speedup": row["bf16_us"] / row["fp8_us"],
                        "bf16_eager_us": timed_us(lambda: F.linear(x, linears[0].weight)),
                        "fp8_eager_us": timed_us(lambda: fp8s[0](x)),
                        "bf16_weight_GBps": 2 * k * n / row["bf16_us"] / 1e3,
                        "fp8_weight_GBps": k * n / row["fp8_us"] / 1e3})
            out.append(row)
            print(json.dumps(row), flush=True)
        del linears, fp8s
        release()
    return {"shape": args.linear_shape, "layers": out}


def bench_moe(args, bandwidth: dict) -> dict:
    from metronome.models.fp8 import ExpertScales, quantize, quantize_rows
    from metronome.models.moe_routing_triton import route
    from metronome.models.moe_triton import grouped_moe, launch_down, launch_for, launch_gate_up

    e, k, h, inter = 128, 8, 2048, 768  # Qwen3-Omni-30B-A3B's thinker layer
    gate_up = torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    (gu, gu_s), (dn, dn_s) = quantize(gate_up), quantize(down)
    scales = ExpertScales(gu_s, dn_s, h, inter)
    # name: expert weights, their scales, E4M3 activations (W8A8) or not
    variants = {"bf16": (gate_up, down, None, False), "fp8_w8a16": (gu, dn, scales, False),
                "fp8_w8a8": (gu, dn, scales, True)}
    out = []
    for n in [int(x) for x in args.moe_tokens.split(",")]:
        gen = torch.Generator(device="cuda").manual_seed(n)
        x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
        w, ids = torch.softmax(torch.randn(n, e, device="cuda", generator=gen), -1).topk(k, -1)
        w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
        touched = int(torch.unique(ids).numel())
        row = {"tokens": n, "experts_touched": touched}
        for name, (w_gu, w_dn, sc, fp8_act) in variants.items():
            launch = launch_for(x, w_gu, n * k, fp8_act)   # as grouped_moe launches
            routing = route(ids, e, launch.block_m)
            act = torch.empty(n * k, inter, device="cuda", dtype=torch.bfloat16)
            partial = torch.empty(n * k, h, device="cuda", dtype=torch.float32)
            flat_w = w.reshape(-1).contiguous()
            gu_scale, dn_scale = ((sc.gate_up, sc.gate_up_group), (sc.down, sc.down_group)) if sc else ((None, 0),) * 2
            floor = {b: touched * 3 * h * inter * w_gu.element_size() / bandwidth[f"{b}_bytes_per_s"] * 1e6
                     for b in ("copy", "read")}
            if fp8_act:   # the activations' two quantising launches count with the kernels
                xq, x_scale = quantize_rows(x)
                actq, act_scale = quantize_rows(act)
                calls = [lambda: quantize_rows(x),
                         lambda: launch_gate_up(xq, w_gu, act, routing, k, launch.gate_up, False, *gu_scale,
                                                x_scale=x_scale),
                         lambda: quantize_rows(act),
                         lambda: launch_down(actq, w_dn, partial, flat_w, routing, launch.down, False, *dn_scale,
                                             act_scale=act_scale)]
            else:
                calls = [lambda: launch_gate_up(x, w_gu, act, routing, k, launch.gate_up, False, *gu_scale),
                         lambda: launch_down(act, w_dn, partial, flat_w, routing, launch.down, False, *dn_scale)]
            kernels = graphed_us(calls) * len(calls)

            def layer():
                return grouped_moe(x, w_gu, w_dn, ids, w, scales=sc, fp8_activations=fp8_act if sc else None)

            row[name] = {"kernels_us": kernels, "layer_us": graphed_us([layer]), "layer_eager_us": timed_us(layer),
                         "floor_copy_us": floor["copy"], "floor_read_us": floor["read"],
                         "kernels_x_copy_floor": kernels / floor["copy"],
                         "kernels_x_read_floor": kernels / floor["read"],
                         "block_m": launch.block_m, "gate_up": vars(launch.gate_up), "down": vars(launch.down)}
        out.append(row)
        print(json.dumps(row), flush=True)
    del gate_up, down, gu, dn
    release()
    return {"shape": "qwen3-omni-30b-a3b layer", "rounds": out}


def bench_engine(args) -> dict:
    from metronome import Engine, EngineConfig, KVPolicy, StepInput
    from metronome.experiments.random_weights import random_decoder
    from metronome.experiments.shapes import shape_config
    from metronome.models.llama import LlamaFamilyForCausalLM
    from metronome.models.spec import spec_from_hf_config

    spec = spec_from_hf_config(shape_config("qwen2.5-7b"))
    policy = KVPolicy(sinks=16, window=1024, block_size=16)
    out = {}
    for name in ("bf16", "fp8-weights", "fp8-both"):
        quantization, kv = VARIANTS[name]
        net = random_decoder(LlamaFamilyForCausalLM, spec, "cuda", torch.bfloat16)
        engine = Engine(EngineConfig(model="random", device="cuda", dtype="bfloat16", policy=policy,
                                     quantization=quantization, kv_cache_dtype=kv, kv_memory_fraction=0.85,
                                     max_chunk_tokens=256, max_batch_tokens=16384), model=net)
        del net
        stats = engine.stats()
        rows = {"capacity": stats.capacity, "kv_blocks": stats.kv_blocks_total,
                "weights_GB": sum(t.numel() * t.element_size() for t in
                                  [*engine.model.parameters(), *engine.model.buffers()]) / 1e9, "ticks": []}
        gen = torch.Generator().manual_seed(0)
        for n in [int(x) for x in args.sessions.split(",")]:
            if n > stats.capacity:
                rows["ticks"].append({"N": n, "skipped": f"the pool holds {stats.capacity} sessions"})
                continue
            sids = [engine.open_session() for _ in range(n)]
            for _ in range(math.ceil((policy.window + policy.sinks) / 256)):  # fill the windows
                engine.step([StepInput(s, token_ids=torch.randint(0, spec.vocab_size, (256,), generator=gen).tolist())
                             for s in sids])
            ticks = []
            for t in range(args.ticks + 1):
                inputs = [StepInput(s, token_ids=torch.randint(0, spec.vocab_size, (26,), generator=gen).tolist(),
                                    max_new_tokens=25) for s in sids]
                torch.cuda.synchronize()
                start = time.perf_counter()
                engine.step(inputs)
                torch.cuda.synchronize()   # the step returns once its work is queued
                elapsed = (time.perf_counter() - start) * 1e3
                if t:
                    ticks.append({"tick_ms": elapsed, "prefill_ms": engine.last_timing.prefill_ms,
                                  "decode_ms": engine.last_timing.decode_ms})
            for s in sids:
                engine.close_session(s)
            rows["ticks"].append({"N": n, "median_ms": statistics.median(x["tick_ms"] for x in ticks),
                                  "median_decode_ms": statistics.median(x["decode_ms"] for x in ticks),
                                  "median_prefill_ms": statistics.median(x["prefill_ms"] for x in ticks),
                                  "ticks": ticks})
            print(json.dumps({name: {k: v for k, v in rows["ticks"][-1].items() if k != "ticks"}}), flush=True)
        engine.close()
        release()
        out[name] = rows
    return {"shape": "qwen2.5-7b", "variants": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="perplexity,linear,moe,engine")
    p.add_argument("--tokens", type=int, default=4096, help="perplexity: tokens of text")
    p.add_argument("--rows", default="1,16,64,256,1024,8192", help="linear: rows per call")
    p.add_argument("--linear-shape", default="qwen2.5-7b", choices=sorted(LINEAR_SHAPES),
                   help="linear: the decoder whose four layer shapes are timed (qwen3-8b: MiniCPM-o's; qwen3-omni: "
                        "the thinker's attention layers, one expert's MLP)")
    p.add_argument("--moe-tokens", default="64,128,256,320", help="moe: tokens per decode round")
    p.add_argument("--sessions", default="64,128,256,320,512", help="engine: sessions per tick")
    p.add_argument("--ticks", type=int, default=3)
    p.add_argument("--out", default="results/fp8_gpu.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/fp8_gpu.py needs a CUDA device")
    bandwidth = copy_bandwidth()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "platform": platform.platform(),
               "date": time.strftime("%Y-%m-%d"), "args": vars(args), **bandwidth}
    parts = [x for x in args.parts.split(",") if x]
    runners = {"perplexity": lambda: bench_perplexity(args), "linear": lambda: bench_linear(args),
               "moe": lambda: bench_moe(args, bandwidth), "engine": lambda: bench_engine(args)}
    for part in parts:
        start = time.perf_counter()
        results[part] = runners[part]()
        results[part]["elapsed_s"] = round(time.perf_counter() - start, 1)
        print(f"{part}: done in {results[part]['elapsed_s']} s", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    if "perplexity" in results:
        print("perplexity:", {k: round(v, 4) for k, v in results["perplexity"]["perplexity"].items()},
              "vs bf16:", {k: f"{v:+.2%}" for k, v in results["perplexity"]["vs_bf16"].items()})


if __name__ == "__main__":
    main()
