"""GPU tick benchmark of Qwen2.5-Omni-7B's thinker on Metronome (random bf16 weights made on the device).

    PYTHONPATH=$PWD python3 bench/models_gpu_qwen2_5_omni.py                  # on a CUDA machine (~3 min)
    PYTHONPATH=$PWD python3 bench/models_gpu_qwen2_5_omni.py --sessions 64,128 --ticks 2
    PYTHONPATH=$PWD python3 bench/models_gpu_qwen2_5_omni.py --smoke          # tiny shapes on the CPU (tests)

The real shape, from the published config (transformers' Qwen2.5-Omni config defaults are the 7B's):
thinker decoder = Qwen2-7B (28 layers, hidden 3584, 28 query / 4 KV heads × 128, intermediate 18944,
vocab 152064, TMRoPE θ = 1e6); audio encoder = Whisper-large-v3-shaped (32 layers, d_model 1280, 20 heads,
FFN 5120, 128 mel bins, 2-s windows, output projected to 3584). The paper's B for Qwen-Omni is 2 s.

One tick per session (free-running steady state): 2 s of audio → Whisper features → the audio tower (all
sessions' blocks in one call, packed window attention) → 50 embeddings spliced between ``<|audio_bos|>``
and ``<|audio_eos|>`` (52 input rows) → prefill → 25 greedy decode tokens in shared rounds. Sessions are
pre-aged until their SinkWindow (S=16, W=1024) is full. Reported per N: the tick split into encoder
(features + tower + splice), prefill and decode, and the largest N whose tick stays within 0.3·B.
Results: a table on stdout and ``$OUT/models_qwen2_5_omni.json`` (OUT defaults to ./out).

Runs with only torch + transformers + triton installed (no soxr: its import is stubbed, nothing here resamples).
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
    "qwen2.5-omni-7b": {
        "text": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
                     rope_theta=1e6, rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default",
                                                   "type": "default"},
                     use_sliding_window=False, sliding_window=32768, max_window_layers=28),
        "audio": dict(num_mel_bins=128, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
                      d_model=1280, output_dim=3584, n_window=100, max_source_positions=1500),
    },
    "smoke": {
        "text": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
                     rope_scaling={"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"}),
        "audio": dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                      output_dim=64, n_window=100, max_source_positions=1500),
    },
}
AUDIO_PAD, AUDIO_START, AUDIO_END = 151646, 151647, 151648


def omni_config(shape: str) -> dict:
    """A ``config.json`` of a Qwen2_5OmniForConditionalGeneration checkpoint of ``shape`` (thinker only)."""
    s = SHAPES[shape]
    vocab = s["text"]["vocab_size"]
    pad, start, end = (AUDIO_PAD, AUDIO_START, AUDIO_END) if vocab > AUDIO_END else (vocab - 3, vocab - 2, vocab - 1)
    return {"model_type": "qwen2_5_omni", "thinker_config": {
        "model_type": "qwen2_5_omni_thinker", "text_config": dict(s["text"]), "audio_config": dict(s["audio"]),
        "audio_token_index": pad, "audio_start_token_id": start, "audio_end_token_id": end,
        "tie_word_embeddings": False}}


def randomize(module: torch.nn.Module, seed: int) -> None:
    from metronome.experiments.random_weights import randomize_

    randomize_(module, seed)


def build(shape: str, device: torch.device, dtype: torch.dtype):
    """(decoder, audio front end, audio marker ids) at ``shape`` with random weights on ``device``."""
    from transformers import WhisperFeatureExtractor

    from metronome.audio.omni.qwen2_5_omni import AudioFrontEnd, AudioMarkers, audio_config, build_audio_encoder
    from metronome.models.llama import LlamaFamilyForCausalLM
    from metronome.models.omni.qwen2_5_omni import text_spec

    config = omni_config(shape)
    spec = text_spec(config)
    with torch.device("meta"):
        net = LlamaFamilyForCausalLM(spec)
    net = net.to_empty(device=device).to(dtype)
    randomize(net, 0)
    net.fuse_projections()
    net.init_rotary(device)
    net = net.eval().requires_grad_(False)
    encoder = build_audio_encoder(audio_config(config), device, dtype, packed=True)
    randomize(encoder, 1)
    features = WhisperFeatureExtractor(feature_size=encoder.config.num_mel_bins, sampling_rate=16000, hop_length=160,
                                       chunk_length=30, n_fft=400)
    return net, AudioFrontEnd(encoder, features, device, dtype), AudioMarkers.from_config(config)


def make_engine(model, args, device):
    from metronome import Engine, EngineConfig, KVPolicy

    policy = KVPolicy(sinks=args.sinks, window=args.window, block_size=16)
    cuda = device.type == "cuda"
    start = time.perf_counter()
    engine = Engine(EngineConfig(model="random", device=str(device), dtype="bfloat16" if cuda else "float32",
                                 policy=policy, attention="triton" if cuda else "torch", cuda_graphs=cuda,
                                 kv_memory_fraction=0.8, num_blocks=None if cuda else 64 * max(args.session_list),
                                 max_chunk_tokens=256, max_batch_tokens=16384), model=model)
    print(f"engine ready in {time.perf_counter() - start:.1f} s, KV capacity {engine.stats().capacity} sessions",
          flush=True)
    return engine


def speech_like(samples: int, rng: np.random.Generator) -> np.ndarray:
    envelope = np.repeat(10 ** rng.uniform(-3.0, 0.0, size=samples // 400 + 1), 400)[:samples]
    return (rng.standard_normal(samples) * envelope * 0.3).clip(-1, 1).astype(np.float32)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def age(engine, sids: list[int], spec, gen: torch.Generator) -> None:
    """Fill the new sessions' windows with random tokens, 256 at a time."""
    from metronome import StepInput

    policy = engine.config.policy
    for _ in range(math.ceil((policy.sinks + policy.window) / 256)):
        engine.step([StepInput(s, token_ids=torch.randint(0, spec.vocab_size, (256,), generator=gen).tolist())
                     for s in sids])


def tick(engine, frontend, markers, sids, clips, args) -> dict:
    """One tick for every session: features → tower → splice → prefill → decode; wall times in ms."""
    from metronome import StepInput
    from metronome.audio.omni.qwen2_5_omni import splice

    device = frontend.device
    sync(device)
    t0 = time.perf_counter()
    feats, lengths = frontend.extract(clips)
    t1 = time.perf_counter()
    with torch.inference_mode():
        rows = frontend.encode_features(feats, lengths)
        embeds = [splice(engine.model.embed, [markers.start] + [markers.pad] * r.shape[0] + [markers.end],
                         markers.pad, [r], device) for r in rows]
    sync(device)
    t2 = time.perf_counter()
    outs = engine.step([StepInput(s, embeds=e, max_new_tokens=args.decode) for s, e in zip(sids, embeds)])
    t3 = time.perf_counter()
    if any(o.error for o in outs) or any(len(o.token_ids) != args.decode for o in outs):
        raise RuntimeError(f"a session failed: {[o.error for o in outs if o.error][:3]}")
    timing = engine.last_timing
    return {"tick_ms": (t3 - t0) * 1e3, "features_ms": (t1 - t0) * 1e3, "encoder_ms": (t2 - t0) * 1e3,
            "prefill_ms": timing.prefill_ms, "decode_ms": timing.decode_ms, "step_ms": (t3 - t2) * 1e3,
            "input_rows": int(embeds[0].shape[0])}


def run(args) -> dict:
    device = torch.device("cuda" if not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start = time.perf_counter()
    model, frontend, markers = build(args.shape, device, dtype)
    print(f"{args.shape} built with random weights in {time.perf_counter() - start:.1f} s", flush=True)
    engine = make_engine(model, args, device)
    spec = model.spec
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    block = int(round(args.budget_ms / 1000.0 * frontend.sample_rate))   # B of audio per tick
    limit = 0.3 * args.budget_ms
    results = {"model": "Qwen2.5-Omni-7B thinker" if not args.smoke else "smoke", "shape": args.shape,
               "config": omni_config(args.shape), "budget_ms": args.budget_ms, "limit_ms": limit,
               "decode_tokens": args.decode, "policy": {"sinks": args.sinks, "window": args.window},
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "platform": platform.platform(), "date": time.strftime("%Y-%m-%d"),
               "rows": []}
    sids: list[int] = []
    for n in args.session_list:
        if engine.stats().capacity < n:
            results["rows"].append({"N": n, "skipped": f"KV pool holds {engine.stats().capacity} sessions"})
            break
        new = [engine.open_session() for _ in range(n - len(sids))]
        if new:
            age(engine, new, spec, gen)
            sids += new
        ticks = []
        for t in range(args.ticks + 1):   # the first tick warms up
            clips = [speech_like(block, rng) for _ in sids[:n]]
            r = tick(engine, frontend, markers, sids[:n], clips, args)
            if t:
                ticks.append(r)
        row = {"N": n, "ticks": ticks, "input_rows": ticks[0]["input_rows"]}
        for key in ("tick_ms", "features_ms", "encoder_ms", "prefill_ms", "decode_ms"):
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
          f"{results['decode_tokens']} decode tokens per tick")
    print(f"{'N':>5} {'tick ms':>9} {'encoder':>9} {'(feats)':>8} {'prefill':>9} {'decode':>9}")
    for r in results["rows"]:
        if "tick_ms" in r:
            print(f"{r['N']:>5} {r['tick_ms']:>9.1f} {r['encoder_ms']:>9.1f} {r['features_ms']:>8.1f} "
                  f"{r['prefill_ms']:>9.1f} {r['decode_ms']:>9.1f}")
        else:
            print(f"{r['N']:>5} {r['skipped']}")
    print(f"capacity (tick <= {results['limit_ms']:.0f} ms): {results['capacity_at_0.3B']} sessions")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-omni-7b", choices=sorted(SHAPES))
    p.add_argument("--sessions", default="8,16,32,64,96,128,160,192,256")
    p.add_argument("--ticks", type=int, default=3)
    p.add_argument("--decode", type=int, default=25)
    p.add_argument("--budget-ms", type=float, default=2000.0)
    p.add_argument("--sinks", type=int, default=16)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--stop-factor", type=float, default=1.5, help="stop the sweep once a tick exceeds this × 0.3·B")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (exercises the code path)")
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.sinks, args.window, args.decode = "smoke", 4, 64, 3
        if args.sessions == p.get_default("sessions"):
            args.sessions = "1,2"
        args.ticks = min(args.ticks, 1)
    args.session_list = [int(x) for x in args.sessions.split(",") if x]
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench/models_gpu_qwen2_5_omni.py needs a CUDA device (or --smoke)")
    results = run(args)
    report(results)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "models_qwen2_5_omni.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
