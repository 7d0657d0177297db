"""GPU tick benchmark of Moshi (7B temporal transformer + depth transformer + Mimi) on Metronome, random bf16 weights.

    PYTHONPATH=$PWD python3 bench/models_gpu_moshi.py                          # on a CUDA machine (~3 min)
    PYTHONPATH=$PWD python3 bench/models_gpu_moshi.py --sessions 16,32 --ticks 5 --window 1008
    PYTHONPATH=$PWD python3 bench/models_gpu_moshi.py --smoke                  # tiny shapes on the CPU (tests)

The real shape is transformers' ``MoshiConfig()`` / ``MimiConfig()`` defaults, which are the published
Kyutai checkpoints' (kmhf/hf-moshiko, kyutai/mimi): temporal transformer 32 layers, hidden 4096, 32 heads ×
128, gated FFN 2 × 11264 (``ffn_dim`` 22528), text vocab 32000, context 3000 steps, RoPE θ 1e4, RMSNorm eps
1e-8; depth transformer 6 layers, hidden 1024, 16 heads, ``ffn_dim`` 5632, one set of weights per codebook,
8 codebooks of 2048; Mimi: SEANet ratios 8·6·5·4 (24 kHz → 25 Hz, then 12.5 Hz), 8-layer transformers
(hidden 512, 8 heads, sliding window 250) in the encoder and the decoder, split RVQ (8 of 32 codebooks used).
The paper's B for Moshi is 80 ms (one frame per tick), so the limit is 0.3·B = 24 ms.

One tick per session = one Moshi frame, exactly the worker's path through ``metronome/audio/omni/moshi.py``:
``prepare`` (Mimi-encode 1920 new samples of every session in one batch + the summed input embeddings:
"encoder"), ``engine.step`` (one position per session, KV under SinkWindow: "prefill"; no decode rounds:
Moshi's text comes from its own head), ``on_hidden`` (text head + the depth transformer's 8 codebook steps
for all sessions: "depth"; Mimi-decode of every session's new frame: "mimi decode"). The depth transformer
and Mimi replay CUDA graphs per batch-size bucket (captured in the warm-up ticks); the engine's one-position
prefill runs eagerly (the engine graphs decode rounds only, and Moshi has none). Sessions are pre-aged
until their window is full (default S = 16, W = 2048: with the rebase interval and chunk it fits Moshi's 3000 positions). Reported
per N: the tick and its split, and the largest N whose tick stays within 0.3·B. Results: a table on stdout
and ``$OUT/models_moshi.json`` (OUT defaults to ./out).

Runs with only torch + transformers + triton installed (soxr's import is stubbed: nothing here resamples).
"""

from __future__ import annotations

import argparse
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

if importlib.util.find_spec("soxr") is None:   # metronome.audio imports it for the worker's resampler
    sys.modules["soxr"] = types.ModuleType("soxr")

SHAPES = {
    "moshi-7b": {
        "moshi": dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, ffn_dim=22528, max_position_embeddings=3000, sliding_window=3000,
                      rms_norm_eps=1e-8, num_codebooks=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "depth": dict(hidden_size=1024, num_hidden_layers=6, num_attention_heads=16, ffn_dim=5632,
                      max_position_embeddings=9, sliding_window=8, rms_norm_eps=1e-8),
        "mimi": dict(hidden_size=512, num_filters=64, upsampling_ratios=[8, 6, 5, 4], num_hidden_layers=8,
                     intermediate_size=2048, num_attention_heads=8, num_key_value_heads=8, codebook_size=2048,
                     codebook_dim=256, num_quantizers=32, vector_quantization_hidden_dimension=256,
                     upsample_groups=512, sliding_window=250, max_position_embeddings=8000),
    },
    "smoke": {
        "moshi": dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      ffn_dim=64, num_codebooks=8),
        "depth": dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32),
        "mimi": dict(hidden_size=16, num_filters=4, upsampling_ratios=[8, 6, 5, 4], num_hidden_layers=1,
                     intermediate_size=32, num_attention_heads=2, num_key_value_heads=2, codebook_size=32,
                     codebook_dim=8, num_quantizers=8, vector_quantization_hidden_dimension=8, upsample_groups=4,
                     sliding_window=20, max_position_embeddings=200),
    },
}


def moshi_config(shape: str):
    from transformers import MoshiConfig

    s = SHAPES[shape]
    return MoshiConfig(**s["moshi"], audio_encoder_config=dict(s["mimi"]), depth_decoder_config=dict(s["depth"]))


class NoText:
    """Stands in for Moshi's SentencePiece tokenizer (none can be downloaded): text deltas come out empty."""

    all_special_ids: list[int] = []

    def decode(self, ids, **kwargs) -> str:
        return ""


def randomize(module: torch.nn.Module, seed: int) -> None:
    from metronome.experiments.random_weights import randomize_

    randomize_(module, seed)


def build(shape: str, device: torch.device, dtype: torch.dtype):
    """(temporal decoder, adapter) at ``shape`` with random weights made on ``device``."""
    from metronome.audio.omni.moshi import MoshiAdapter
    from metronome.audio.omni.moshi_heads import MoshiHeads
    from metronome.models.omni.moshi import build_decoder, decoder_spec, finish_decoder

    config = moshi_config(shape)
    net = build_decoder(decoder_spec(config), dtype, device)
    randomize(net, 0)
    net = finish_decoder(net, device)
    with torch.device(device):
        heads = MoshiHeads(config)   # Mimi keeps transformers' initialisation (float32, as the adapter runs it)
    randomize(heads.depth_decoder, 1)
    randomize(heads.embed_tokens, 2)
    randomize(heads.lm_head, 3)
    with torch.no_grad():
        for name, b in heads.audio_encoder.named_buffers():
            if name.endswith("embed_sum"):   # codebooks start at zero: every code would be 0
                b.normal_()
    for module in (heads.embed_tokens, heads.lm_head, heads.depth_decoder):
        module.to(dtype)
    heads.requires_grad_(False).eval()
    adapter = MoshiAdapter(heads, NoText(), net.embed, device, dtype)
    return net, adapter


def make_engine(model, args, device):
    from metronome import Engine, EngineConfig, KVPolicy

    policy = KVPolicy(sinks=args.sinks, window=args.window, block_size=16)
    cuda = device.type == "cuda"
    start = time.perf_counter()
    engine = Engine(EngineConfig(model="random", device=str(device), dtype="bfloat16" if cuda else "float32",
                                 policy=policy, attention="triton" if cuda else "torch", cuda_graphs=cuda,
                                 kv_memory_fraction=0.85, num_blocks=None if cuda else 64 * max(args.session_list),
                                 max_chunk_tokens=256, max_batch_tokens=16384), model=model)
    print(f"engine ready in {time.perf_counter() - start:.1f} s, KV capacity {engine.stats().capacity} sessions",
          flush=True)
    return engine


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timed:
    """Wraps a bound method: synchronises and adds its wall time (ms) to ``total``."""

    def __init__(self, fn, device) -> None:
        self.fn, self.device, self.total = fn, device, 0.0

    def __call__(self, *args, **kwargs):
        sync(self.device)
        t = time.perf_counter()
        out = self.fn(*args, **kwargs)
        sync(self.device)
        self.total += (time.perf_counter() - t) * 1e3
        return out


def age(engine, sids: list[int], hidden: int, device, dtype, gen: torch.Generator) -> None:
    """Fill the new sessions' windows with random embeddings, 256 rows at a time."""
    from metronome import StepInput

    policy = engine.config.policy
    for _ in range(math.ceil((policy.sinks + policy.window) / 256)):
        engine.step([StepInput(s, embeds=(torch.randn(256, hidden, generator=gen) * 0.02).to(device, dtype))
                     for s in sids])


def speech_like(samples: int, rng: np.random.Generator) -> np.ndarray:
    envelope = np.repeat(10 ** rng.uniform(-3.0, 0.0, size=samples // 400 + 1), 400)[:samples]
    return (rng.standard_normal(samples) * envelope * 0.3).clip(-1, 1).astype(np.float32)


def tick(engine, adapter, names: list[str], ids: dict[str, int], rng, timers: dict) -> dict:
    """One Moshi frame for every session, as the worker runs it; wall times in ms."""
    from metronome import StepInput
    from metronome.audio.adapter import TickAudio

    device = adapter.device
    for t in timers.values():
        t.total = 0.0
    sync(device)
    t0 = time.perf_counter()
    prepared = adapter.prepare([TickAudio(n, pcm=speech_like(adapter.frame_size, rng)) for n in names])
    sync(device)
    t1 = time.perf_counter()
    outs = engine.step([StepInput(ids[n], embeds=p.embeds, return_hidden=True) for n, p in zip(names, prepared)])
    t2 = time.perf_counter()
    if any(o.error or o.hidden is None for o in outs):
        raise RuntimeError(f"a session failed: {[o.error for o in outs if o.error][:3]}")
    adapter.on_hidden([(n, o.hidden) for n, o in zip(names, outs)])
    sync(device)
    t3 = time.perf_counter()
    spoken = [len(adapter.take_audio(n)) for n in names]
    for n in names:
        adapter.on_output(n, [], False)
    return {"tick_ms": (t3 - t0) * 1e3, "encoder_ms": (t1 - t0) * 1e3, "mimi_encode_ms": timers["encode"].total,
            "prefill_ms": engine.last_timing.prefill_ms, "step_ms": (t2 - t1) * 1e3,
            "depth_ms": timers["depth"].total, "mimi_decode_ms": timers["decode"].total,
            "heads_ms": (t3 - t2) * 1e3, "audio_bytes": spoken[0]}


def run(args) -> dict:
    device = torch.device("cuda" if not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start = time.perf_counter()
    model, adapter = build(args.shape, device, dtype)
    print(f"{args.shape} built with random weights in {time.perf_counter() - start:.1f} s", flush=True)
    timers = {"encode": Timed(adapter.codec.encode, device), "decode": Timed(adapter.codec.decode, device),
              "depth": Timed(adapter.depth.generate, device)}
    adapter.codec.encode, adapter.codec.decode, adapter.depth.generate = timers["encode"], timers["decode"], timers["depth"]
    engine = make_engine(model, args, device)
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    limit = 0.3 * args.budget_ms
    results = {"model": "Moshi 7B (temporal + depth + Mimi)" if not args.smoke else "smoke", "shape": args.shape,
               "config": SHAPES[args.shape], "budget_ms": args.budget_ms, "limit_ms": limit,
               "policy": {"sinks": args.sinks, "window": args.window},
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "platform": platform.platform(), "date": time.strftime("%Y-%m-%d"),
               "rows": []}
    ids: dict[str, int] = {}
    for n in args.session_list:
        if engine.stats().capacity < n:
            results["rows"].append({"N": n, "skipped": f"KV pool holds {engine.stats().capacity} sessions"})
            break
        new = [f"s{i}" for i in range(len(ids), n)]
        if new:
            eids = [engine.open_session() for _ in new]
            age(engine, eids, model.spec.hidden_size, device, dtype, gen)
            for name, eid in zip(new, eids):
                ids[name] = eid
                adapter.open_session(name, "free_running", "")
        names = list(ids)[:n]
        ticks = []
        for t in range(args.ticks + 2):   # the first two ticks warm up (a new session speaks from its second)
            r = tick(engine, adapter, names, ids, rng, timers)
            if t >= 2:
                ticks.append(r)
        row = {"N": n, "ticks": ticks}
        for key in ("tick_ms", "encoder_ms", "mimi_encode_ms", "prefill_ms", "depth_ms", "mimi_decode_ms", "heads_ms"):
            row[key] = statistics.median(x[key] for x in ticks)
        results["rows"].append(row)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if k != "ticks"}),
              flush=True)
        if row["tick_ms"] > args.stop_factor * limit:
            break
    fit = [r["N"] for r in results["rows"] if r.get("tick_ms", math.inf) <= limit]
    results["capacity_at_0.3B"] = max(fit) if fit else 0
    return results


def report(results: dict) -> None:
    print(f"\n{results['model']}: B = {results['budget_ms']:.0f} ms, limit 0.3·B = {results['limit_ms']:.0f} ms, "
          f"one frame per tick, SinkWindow S={results['policy']['sinks']} W={results['policy']['window']}")
    print(f"{'N':>5} {'tick ms':>9} {'encoder':>9} {'(mimi)':>8} {'prefill':>9} {'depth':>9} {'mimi dec':>9}")
    for r in results["rows"]:
        if "tick_ms" in r:
            print(f"{r['N']:>5} {r['tick_ms']:>9.2f} {r['encoder_ms']:>9.2f} {r['mimi_encode_ms']:>8.2f} "
                  f"{r['prefill_ms']:>9.2f} {r['depth_ms']:>9.2f} {r['mimi_decode_ms']:>9.2f}")
        else:
            print(f"{r['N']:>5} {r['skipped']}")
    print(f"capacity (tick <= {results['limit_ms']:.0f} ms): {results['capacity_at_0.3B']} sessions")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="moshi-7b", choices=sorted(SHAPES))
    p.add_argument("--sessions", default="1,4,8,16,24,32,40,48,56,64")
    p.add_argument("--ticks", type=int, default=5)
    p.add_argument("--budget-ms", type=float, default=80.0)
    p.add_argument("--sinks", type=int, default=16)
    p.add_argument("--window", type=int, default=2048,
                   help="S + W + W/4 (rebase interval) + chunk + 1 must fit Moshi's 3000 positions")
    p.add_argument("--stop-factor", type=float, default=1.5, help="stop the sweep once a tick exceeds this × 0.3·B")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (exercises the code path)")
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.sinks, args.window = "smoke", 4, 64
        args.stop_factor = math.inf   # CPU times say nothing: run every N
        if args.sessions == p.get_default("sessions"):
            args.sessions = "1,2"
        args.ticks = min(args.ticks, 1)
    args.session_list = [int(x) for x in args.sessions.split(",") if x]
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench/models_gpu_moshi.py needs a CUDA device (or --smoke)")
    results = run(args)
    report(results)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "models_moshi.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
