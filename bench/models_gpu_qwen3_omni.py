"""GPU benchmark: Qwen3-Omni-30B-A3B's thinker (MoE decoder) and audio encoder at their real shapes.

    PYTHONPATH=$PWD python3 bench/models_gpu_qwen3_omni.py              # H200, ~4 min: $OUT/models_qwen3_omni.json
    PYTHONPATH=$PWD python3 bench/models_gpu_qwen3_omni.py --smoke      # a tiny shape on the CPU (the test runs it)
    PYTHONPATH=$PWD python3 bench/models_gpu_qwen3_omni.py --smoke --device cuda   # the same tiny shape on a GPU

Nothing is downloaded: the configs are written here from the published ``config.json`` values
(thinker text model: 48 layers, hidden 2048, 32 query / 4 KV heads × 128, 128 experts, 8 active,
moe_intermediate 768, vocab 152064, rope θ 1e6; audio encoder: 32 layers, d_model 1280, 20 heads,
ffn 5120, 128 mel bins, conv 480, output 2048) and the weights are random bf16 made on the device
(~61 GB for the decoder's 30.5 B parameters, ~1.3 GB for the encoder).

Per N sessions, one tick at B = 2 s is what the adapter and the engine do for a free-running session:

* **encoder**: every session's 2-s clip → Whisper features (on the GPU) → the audio tower, one call for
  all N (``AudioFrontEnd`` of ``metronome/audio/omni/qwen3_omni.py``), then the prompt rows
  ``<|audio_start|> 26 × audio <|audio_end|>`` are assembled;
* **prefill**: those 28 rows per session;
* **decode**: 25 tokens per session in shared rounds (CUDA graphs).

Sessions use SinkWindow (S = 16, W = 1024) and are aged until the window is full, so attention is at
its steady-state cost. The MoE experts run as the Triton grouped GEMM (``models/moe_triton.py``). The
largest N whose median tick is within 0.3·B is the capacity. Two comparisons of the expert path:

* one MoE layer alone for T tokens: grouped GEMM vs the torch sorted path vs the naive per-expert loop;
* whole ticks at a few N without CUDA graphs (the loop path syncs with the host, so it cannot be
  captured): grouped GEMM vs the naive loop.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

REAL = dict(
    text=dict(vocab_size=152064, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
              intermediate_size=6144,  # dense MLP size; unused (every layer is MoE: mlp_only_layers = [])
              num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, rope_theta=1e6,
              max_position_embeddings=65536),
    audio=dict(num_mel_bins=128, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120, d_model=1280,
               output_dim=2048, downsample_hidden_size=480, n_window=50, n_window_infer=800, conv_chunksize=500,
               max_source_positions=1500),
)
SMOKE = dict(
    text=dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
              intermediate_size=96, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, rope_theta=1e6,
              max_position_embeddings=4096),
    audio=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
               output_dim=64, downsample_hidden_size=8, n_window=50, n_window_infer=800, conv_chunksize=500,
               max_source_positions=1500),
)


def _without_soxr() -> None:
    """``metronome.audio`` imports its PCM resampler (soxr) on import; the benchmark machine may lack soxr
    and the benchmark never resamples, so a placeholder module stands in for it (only when missing)."""
    if importlib.util.find_spec("soxr") is None:
        stub = types.ModuleType("soxr")

        def unavailable(*args, **kwargs):
            raise RuntimeError("soxr is not installed (the benchmark does not resample)")

        stub.resample = stub.ResampleStream = unavailable
        sys.modules["soxr"] = stub


def make_spec(text: dict):
    from metronome.models.moe import MoeSpec

    hd = text["head_dim"]
    inv_freq = tuple((1.0 / (text["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))).tolist())
    return MoeSpec(model_type="qwen3_omni_moe", vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
                   intermediate_size=text["intermediate_size"], num_layers=text["num_layers"],
                   num_heads=text["num_heads"], num_kv_heads=text["num_kv_heads"], head_dim=hd, rms_norm_eps=1e-6,
                   max_position_embeddings=text["max_position_embeddings"], qkv_bias=False, o_bias=False,
                   mlp_bias=False, qk_norm=True, tie_word_embeddings=False, inv_freq=inv_freq,
                   rope_attention_scaling=1.0, eos_token_ids=(), num_experts=text["num_experts"],
                   num_experts_per_tok=text["num_experts_per_tok"],
                   moe_intermediate_size=text["moe_intermediate_size"], norm_topk_prob=True, decoder_sparse_step=1,
                   mlp_only_layers=())


def random_decoder(spec, device, dtype):
    from metronome.models.moe import MoeForCausalLM

    from metronome.experiments.random_weights import random_decoder as build

    return build(MoeForCausalLM, spec, device, dtype, per_expert=False)


def random_frontend(audio: dict, device, dtype):
    from transformers import Qwen3OmniMoeAudioEncoderConfig

    from metronome.experiments.random_weights import randomize_
    from metronome.audio.omni.qwen3_omni import AudioFrontEnd, build_audio_encoder, feature_extractor_for

    encoder = build_audio_encoder(Qwen3OmniMoeAudioEncoderConfig(**audio), device, dtype)
    randomize_(encoder, seed=1)
    return AudioFrontEnd(encoder, feature_extractor_for(None, audio["num_mel_bins"]), device, dtype)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_copy_bandwidth(device) -> float:
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(1 << 28, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(device)
    start = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    sync(device)
    return 2 * a.numel() * 2 * 20 / (time.perf_counter() - start)


def decode_floor_ms(spec, n: int, decode: int, bandwidth: float) -> float:
    """Weight bytes the decode rounds must stream at least (experts a round's N tokens hit, in expectation;
    attention, norms, router and lm_head) over the copy bandwidth. KV reads are left out."""
    h, e, i = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size
    attn = h * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim + spec.num_heads * spec.head_dim * h
    hit = e * (1.0 - (1.0 - spec.num_experts_per_tok / e) ** n)
    per_round = spec.num_layers * (attn + h * e + hit * 3 * h * i) + spec.vocab_size * h
    return decode * per_round * 2 / bandwidth * 1e3


def time_expert_paths(spec, device, dtype, token_counts, reps: int) -> list[dict]:
    """One MoE layer (router + experts) for T tokens, per expert path; median ms over ``reps``."""
    from metronome.models.moe import SparseMoeBlock

    block = SparseMoeBlock(spec, per_expert=False).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    paths = ["triton", "torch", "loop"] if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" \
        else ["torch", "loop"]
    rows = []
    for t in token_counts:
        x = torch.randn(t, spec.hidden_size, device=device, dtype=dtype)
        row: dict = {"tokens": t}
        for path in paths:
            block.experts.backend = path
            with torch.inference_mode():
                block(x)
                times = []
                for _ in range(reps):
                    sync(device)
                    start = time.perf_counter()
                    block(x)
                    sync(device)
                    times.append((time.perf_counter() - start) * 1e3)
            row[f"{path}_ms"] = statistics.median(times)
        if "triton_ms" in row:
            row["loop_over_triton"] = row["loop_ms"] / row["triton_ms"]
        rows.append(row)
        print(json.dumps({"moe_layer": row}), flush=True)
    return rows


def tune_moe(args) -> dict:
    """Tile sweep of the two grouped-GEMM kernels at the real layer shape: per T tokens and kernel, the
    fastest (block_m, TileConfig) by median CUDA-event time; configs that do not fit are skipped."""
    import itertools

    from metronome.models.moe_triton import TileConfig, launch_down, launch_gate_up, route

    text = REAL["text"]
    e, h, k = text["num_experts"], text["hidden_size"], text["num_experts_per_tok"]
    inter = text["moe_intermediate_size"]
    dev = torch.device("cuda")
    w_gate_up = torch.randn(e, 2 * inter, h, device=dev, dtype=torch.bfloat16) * 0.02
    w_down = torch.randn(e, h, inter, device=dev, dtype=torch.bfloat16) * 0.02
    grid = [TileConfig(n, kk, w, st) for n, kk, w, st in itertools.product((64, 128), (64, 128, 256), (4, 8), (3, 4))]

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    rows = []
    for t in _ints(args.tune_tokens):
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        ids = torch.softmax(torch.randn(t, e, device=dev), -1).topk(k, -1).indices
        weights = torch.full((t * k,), 1.0 / k, device=dev, dtype=torch.bfloat16)
        mean = t * k / e
        heights = (16,) if mean <= 16 else (16, 32, 64) if mean <= 64 else (64, 128)
        best: dict = {}
        for bm in heights:
            routing = route(ids, e, bm)
            act = torch.empty(t * k, inter, device=dev, dtype=torch.bfloat16)
            out = torch.empty(t * k, h, device=dev, dtype=torch.float32)
            for cfg in grid:
                for kernel, fn in (("gate_up", lambda: launch_gate_up(x, w_gate_up, act, routing, k, cfg, False)),
                                   ("down", lambda: launch_down(act, w_down, out, weights, routing, cfg, False))):
                    try:
                        ms = timed(fn)
                    except Exception as exc:   # e.g. out of shared memory for this tile shape
                        print(f"skip {kernel} T={t} bm={bm} {cfg}: {type(exc).__name__}", flush=True)
                        continue
                    if kernel not in best or ms < best[kernel]["ms"]:
                        best[kernel] = {"ms": ms, "block_m": bm, **vars(cfg)}
        weight_bytes = 3 * inter * h * 2 * e * (1 - (1 - k / e) ** t)
        row = {"tokens": t, **best, "expert_bytes": weight_bytes,
               "tb_per_s": weight_bytes / ((best["gate_up"]["ms"] + best["down"]["ms"]) * 1e-3) / 1e12}
        rows.append(row)
        print(json.dumps({"tune": row}), flush=True)
    return {"tune": rows}


class Bench:
    """One engine over the random decoder, the audio front end, and sessions that stay open across N."""

    def __init__(self, spec, model, frontend, args, device, cuda_graphs: bool, kv_fraction: float) -> None:
        from metronome import Engine, EngineConfig, KVPolicy

        self.spec, self.model, self.frontend, self.args, self.device = spec, model, frontend, args, device
        policy = KVPolicy(sinks=args.sinks, window=args.window, block_size=16)
        start = time.perf_counter()
        self.engine = Engine(EngineConfig(model="random", device=str(device), dtype=args.dtype, policy=policy,
                                          attention="triton" if device.type == "cuda" else "torch",
                                          cuda_graphs=cuda_graphs, kv_memory_fraction=kv_fraction,
                                          num_blocks=args.num_blocks, max_chunk_tokens=args.chunk,
                                          max_batch_tokens=args.batch_tokens), model=model)
        self.ready_s = time.perf_counter() - start
        self.sids: list[int] = []
        self.rng = np.random.default_rng(0)
        markers = torch.tensor([1, 2], device=device)  # stand-ins for <|audio_start|>, <|audio_end|>
        self.start_row, self.end_row = model.embed(markers).split(1)

    @property
    def capacity(self) -> int:
        return self.engine.stats().capacity

    def grow(self, n: int) -> None:
        """Open sessions up to ``n`` and age the new ones until their window is full (random tokens)."""
        from metronome import StepInput

        new = [self.engine.open_session() for _ in range(n - len(self.sids))]
        fill = self.args.sinks + self.args.window
        gen = torch.Generator().manual_seed(len(self.sids))
        per_step = max(1, self.args.batch_tokens // self.args.chunk)
        for _ in range(math.ceil(fill / self.args.chunk)):
            for i in range(0, len(new), per_step):
                self.engine.step([StepInput(s, token_ids=torch.randint(
                    0, self.spec.vocab_size, (self.args.chunk,), generator=gen).tolist()) for s in new[i:i + per_step]])
        self.sids += new

    def tick(self, n: int) -> dict:
        from metronome import StepInput

        sids = self.sids[:n]
        clips = [(self.rng.standard_normal(int(self.args.budget_ms * 16)) * 0.1).astype(np.float32) for _ in sids]
        sync(self.device)
        start = time.perf_counter()
        audio = self.frontend.encode(clips)
        embeds = [torch.cat([self.start_row, a.to(self.start_row.dtype), self.end_row]) for a in audio]
        sync(self.device)
        encoder_ms = (time.perf_counter() - start) * 1e3
        self.engine.step([StepInput(s, embeds=e, max_new_tokens=self.args.decode) for s, e in zip(sids, embeds)])
        sync(self.device)
        tick_ms = (time.perf_counter() - start) * 1e3
        timing = self.engine.last_timing
        return {"tick_ms": tick_ms, "encoder_ms": encoder_ms, "prefill_ms": timing.prefill_ms,
                "decode_ms": timing.decode_ms, "prefill_rows": int(embeds[0].shape[0]) if embeds else 0}

    def run(self, n: int, ticks: int) -> dict:
        self.grow(n)
        rows = [self.tick(n) for _ in range(ticks + 1)][1:]   # the first tick warms up
        summary = {k: statistics.median(r[k] for r in rows) for k in ("tick_ms", "encoder_ms", "prefill_ms",
                                                                       "decode_ms")}
        return {"N": n, **{f"median_{k}": v for k, v in summary.items()}, "prefill_rows": rows[0]["prefill_rows"],
                "ticks": rows}

    def close(self) -> None:
        for s in self.sids:
            self.engine.close_session(s)
        self.sids = []


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shape in float32: checks the code path")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda; cpu with --smoke)")
    p.add_argument("--sessions", default=None, help="N sweep (default 8,16,24,32,48,64,96,128,256; smoke 1,2)")
    p.add_argument("--compare-sessions", default=None,
                   help="N for whole ticks with the naive expert loop vs the grouped GEMM, eager ('' skips)")
    p.add_argument("--layer-tokens", default=None, help="T for the one-layer expert-path timing ('' skips)")
    p.add_argument("--ticks", type=int, default=None)
    p.add_argument("--decode", type=int, default=None)
    p.add_argument("--budget-ms", type=float, default=2000.0)
    p.add_argument("--sinks", type=int, default=16)
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--tune-moe", action="store_true", help="only sweep the grouped-GEMM tiles at the real shape")
    p.add_argument("--tune-tokens", default="16,64,256,1024,4096,16384")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/models_qwen3_omni.json, OUT=./out)")
    args = p.parse_args(argv)
    smoke = args.smoke
    defaults = dict(sessions="1,2" if smoke else "8,16,24,32,48,64,96,128,256",
                    compare_sessions="2" if smoke else "16,64", layer_tokens="4,16" if smoke else "16,64,256,1024,4096",
                    ticks=1 if smoke else 2, decode=2 if smoke else 25, window=64 if smoke else 1024)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = "float32" if smoke else "bfloat16"
    args.chunk = 64 if smoke else 256
    args.batch_tokens = 512 if smoke else 16384
    args.num_blocks = 64 if smoke else None
    args.device = args.device or ("cpu" if smoke else "cuda")
    args.out = args.out or str(Path(os.environ.get("OUT", "out")) / "models_qwen3_omni.json")
    return args


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/models_gpu_qwen3_omni.py needs a CUDA device (or --smoke)")
    _without_soxr()
    if args.tune_moe:
        results = tune_moe(args)
        out = Path(args.out).with_name("moe_tiles_qwen3_omni.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
        return results
    device = torch.device(args.device)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shape = SMOKE if args.smoke else REAL
    spec = make_spec(shape["text"])
    started = time.perf_counter()
    results: dict = {"model": "qwen3-omni-30b-a3b" if not args.smoke else "smoke", "shape": shape,
                     "args": {k: v for k, v in vars(args).items()}, "torch": torch.__version__,
                     "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                     "platform": platform.platform(), "date": time.strftime("%Y-%m-%d"),
                     "budget_ms": args.budget_ms, "limit_ms": 0.3 * args.budget_ms}
    bandwidth = measure_copy_bandwidth(device)
    results["copy_bytes_per_s"] = bandwidth
    reps = 3 if args.smoke else 10
    results["moe_layer"] = time_expert_paths(spec, device, dtype, _ints(args.layer_tokens), reps=reps)

    build = time.perf_counter()
    model = random_decoder(spec, device, dtype)
    frontend = random_frontend(shape["audio"], device, dtype)
    sync(device)
    results["build_s"] = time.perf_counter() - build
    results["decoder_params"] = sum(p.numel() for p in model.parameters())
    results["encoder_params"] = sum(p.numel() for p in frontend.encoder.parameters())
    print(f"random weights: decoder {results['decoder_params'] / 1e9:.2f} B, encoder "
          f"{results['encoder_params'] / 1e9:.3f} B parameters in {results['build_s']:.1f} s", flush=True)

    bench = Bench(spec, model, frontend, args, device, cuda_graphs=device.type == "cuda", kv_fraction=0.85)
    results["engine_ready_s"], results["capacity_by_memory"] = bench.ready_s, bench.capacity
    results["sweep"] = []
    for n in _ints(args.sessions):
        if n > bench.capacity:
            results["sweep"].append({"N": n, "skipped": f"the KV pool holds {bench.capacity} sessions"})
            continue
        r = bench.run(n, args.ticks)
        if device.type == "cuda":
            r["decode_floor_ms"] = decode_floor_ms(spec, n, args.decode, bandwidth)
        results["sweep"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "ticks"}), flush=True)
    bench.close()
    del bench
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # Whole ticks, eager, grouped GEMM vs the naive loop (sessions aged once, with the grouped GEMM).
    results["compare"] = []
    compare = _ints(args.compare_sessions)
    if compare:
        eager = Bench(spec, model, frontend, args, device, cuda_graphs=False, kv_fraction=0.5)
        for n in compare:
            if n > eager.capacity:
                continue
            row = {"N": n}
            for path in ("triton" if device.type == "cuda" else "torch", "loop"):
                model.set_expert_backend(path)
                r = eager.run(n, 1)
                row[path] = {k: v for k, v in r.items() if k.startswith("median_")}
            model.set_expert_backend("auto")
            results["compare"].append(row)
            print(json.dumps({"compare": row}), flush=True)
        eager.close()

    fit = [r["N"] for r in results["sweep"] if r.get("median_tick_ms", math.inf) <= results["limit_ms"]]
    results["capacity_at_0.3B"] = max(fit) if fit else 0
    results["total_s"] = time.perf_counter() - started
    report(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return results


def report(results: dict) -> None:
    print(f"\nQwen3-Omni-30B-A3B thinker + audio encoder ({results['device']}), B = {results['budget_ms']:.0f} ms, "
          f"limit 0.3·B = {results['limit_ms']:.0f} ms")
    print(f"{'N':>5} {'tick ms':>9} {'encoder':>9} {'prefill':>9} {'decode':>9} {'floor':>8}")
    for r in results["sweep"]:
        if "skipped" in r:
            print(f"{r['N']:>5} {r['skipped']}")
            continue
        floor = r.get("decode_floor_ms", float("nan"))
        print(f"{r['N']:>5} {r['median_tick_ms']:>9.1f} {r['median_encoder_ms']:>9.1f} {r['median_prefill_ms']:>9.1f} "
              f"{r['median_decode_ms']:>9.1f} {floor:>8.1f}")
    print(f"capacity (tick <= {results['limit_ms']:.0f} ms): {results['capacity_at_0.3B']} sessions")
    if results["moe_layer"]:
        print("\none MoE layer, ms:  " + "  ".join(
            f"T={r['tokens']}: " + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in r.items() if k.endswith("_ms"))
            for r in results["moe_layer"]))
    for row in results["compare"]:
        print(f"eager tick at N={row['N']}: " + ", ".join(
            f"{path} {v['median_tick_ms']:.0f} ms (decode {v['median_decode_ms']:.0f})"
            for path, v in row.items() if path != "N"))


if __name__ == "__main__":
    main()
