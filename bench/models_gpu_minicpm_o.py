"""GPU tick benchmark: MiniCPM-o 4.5's speech path at its real shape, random bf16 weights made on the device.

    PYTHONPATH=$PWD python3 bench/models_gpu_minicpm_o.py                 # on one H200 (~3 min)
    PYTHONPATH=$PWD python3 bench/models_gpu_minicpm_o.py --sessions 64,128
    PYTHONPATH=$PWD python3 bench/models_gpu_minicpm_o.py --smoke         # tiny shape on the CPU (tests)

Shape (published MiniCPM-o 4.5 = Whisper-medium + Qwen3-8B; OpenBMB config, cross-checked with ports):
LLM Qwen3-8B, 36 layers, hidden 4096, 32/8 heads x 128, intermediate 12288, vocab 151748, RoPE 1e6;
audio ``apm`` Whisper-medium encoder, 24 layers, d_model 1024, 16 heads, ffn 4096, 80 mel bins;
``audio_projection_layer`` 1024 -> 4096 -> 4096, AvgPool1d(5).

One tick of the paper's free-running sessions (B = 1 s) for N sessions, as the minicpm_o adapter and
the worker run it: every session's new 1-s chunk -> log-mel -> Whisper -> projection -> pooling (one
batched call: ``encoder_ms``), spliced between <|audio_start|>/<|audio_end|> (12 positions per
session), then one engine step: prefill (``prefill_ms``) and 25 decoded tokens (``decode_ms``). The
sessions are aged first so their SinkWindow (S=16, W=1024) is full. The largest N whose median tick
stays within 0.3·B is reported. Output: a table, and JSON in ``$OUT/models_minicpm_o.json`` (OUT
defaults to ./out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

# Published MiniCPM-o 4.5 fields: the LLM ones are top-level in its config.json (MiniCPMOConfig is a Qwen3Config).
REAL = dict(
    llm=dict(model_type="minicpmo", vocab_size=151748, hidden_size=4096, intermediate_size=12288,
             num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
             max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False,
             tie_word_embeddings=False, eos_token_id=151645),
    whisper=dict(d_model=1024, encoder_layers=24, encoder_attention_heads=16, encoder_ffn_dim=4096,
                 num_mel_bins=80, max_source_positions=1500),
    markers=(151697, 151699),   # <|audio_start|>, <|audio_end|>
)
SMOKE = dict(
    llm=dict(model_type="minicpmo", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
             max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False,
             tie_word_embeddings=False, eos_token_id=2),
    whisper=dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128, num_mel_bins=80,
                 max_source_positions=1500, decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64),
    markers=(1, 2),
)
POOL_STEP = 5


def random_decoder(shape: dict, device, dtype):
    from metronome.models.llama import LlamaFamilyForCausalLM
    from metronome.models.omni.minicpm_o import decoder_spec

    spec = decoder_spec(shape["llm"])
    from metronome.experiments.random_weights import random_decoder as build

    return build(LlamaFamilyForCausalLM, spec, device, dtype)


def random_tower(shape: dict, device, dtype):
    from metronome.audio.omni.minicpm_o import AudioSpec, AudioTower

    spec = AudioSpec(whisper=dict(shape["whisper"]), pool_step=POOL_STEP, chunk_s=1.0,
                     hidden_size=shape["llm"]["hidden_size"])
    with torch.device(device):
        tower = AudioTower(spec)
    tower = tower.to(dtype)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if "embed_positions" in name:
                continue   # sinusoids, as Whisper's init
            if "layer_norm" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                p.normal_(0.0, 0.02)
    return tower.eval().requires_grad_(False)


def make_engine(model, args, device, dtype_name: str):
    from metronome import Engine, EngineConfig, KVPolicy

    policy = KVPolicy(sinks=args.sinks, window=args.window, block_size=16)
    start = time.perf_counter()
    cuda = torch.device(device).type == "cuda"
    engine = Engine(EngineConfig(model="random", device=str(device), dtype=dtype_name, policy=policy,
                                 attention="triton" if cuda else "torch", cuda_graphs=cuda and not args.no_graphs,
                                 kv_memory_fraction=0.85, num_blocks=None if cuda else 512,
                                 max_chunk_tokens=256, max_batch_tokens=16384), model=model)
    print(f"engine ready in {time.perf_counter() - start:.1f} s, capacity {engine.stats().capacity} sessions",
          flush=True)
    return engine


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def audio_chunks(n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """n seconds of speech-like noise (random loudness every 25 ms), one per session."""
    env = np.repeat(10 ** rng.uniform(-2.5, 0, size=(n, 40)), 400, axis=1)
    return list((rng.standard_normal((n, 16000)) * env * 0.3).clip(-1, 1).astype(np.float32))


def encode_tick(tower, mel_fn, embed, markers, chunks, device) -> list[torch.Tensor]:
    """The adapter's per-tick work for every session: one batched mel + tower call, then the splice."""
    with torch.inference_mode():
        rows = tower(mel_fn(chunks).to(device))
        start, end = embed(torch.tensor(list(markers), device=device)).to(rows.dtype).split(1)
        return [torch.cat([start, r, end]) for r in rows]


def bench_n(engine, tower, mel_fn, shape, n: int, args, device) -> dict:
    from metronome import StepInput

    if engine.stats().capacity < n:
        return {"N": n, "skipped": f"KV pool holds {engine.stats().capacity} sessions"}
    rng = np.random.default_rng(n)
    gen = torch.Generator().manual_seed(n)
    vocab = shape["llm"]["vocab_size"]
    sids = [engine.open_session() for _ in range(n)]
    age = args.sinks + args.window
    for _ in range(math.ceil(age / 256)):   # fill the window (header + earlier audio and answers)
        engine.step([StepInput(s, token_ids=torch.randint(0, vocab, (256,), generator=gen).tolist()) for s in sids])
    ticks = []
    for t in range(args.ticks + 1):   # tick 0 warms up
        chunks = audio_chunks(n, rng)   # the clients' audio, decoded by the worker before the adapter runs
        sync(device)
        t0 = time.perf_counter()
        embeds = encode_tick(tower, mel_fn, engine.model.embed, shape["markers"], chunks, device)
        sync(device)
        t1 = time.perf_counter()
        engine.step([StepInput(s, embeds=e, max_new_tokens=args.decode) for s, e in zip(sids, embeds)])
        sync(device)
        t2 = time.perf_counter()
        if t:
            ticks.append({"tick_ms": (t2 - t0) * 1e3, "encoder_ms": (t1 - t0) * 1e3,
                          "prefill_ms": engine.last_timing.prefill_ms, "decode_ms": engine.last_timing.decode_ms})
    for s in sids:
        engine.close_session(s)
    med = {k: statistics.median(x[k] for x in ticks) for k in ("tick_ms", "encoder_ms", "prefill_ms", "decode_ms")}
    return {"N": n, **med, "prefill_tokens_per_session": int(embeds[0].shape[0]), "decode_tokens": args.decode,
            "ticks": ticks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", default="16,32,64,96,128,160,192,256,320")
    p.add_argument("--ticks", type=int, default=3)
    p.add_argument("--decode", type=int, default=25)
    p.add_argument("--budget-ms", type=float, default=1000.0)
    p.add_argument("--sinks", type=int, default=16)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--no-graphs", action="store_true", help="eager decode rounds (no CUDA graphs)")
    p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU: checks the code path only")
    args = p.parse_args()
    if args.smoke:
        shape, device, dtype, dtype_name = SMOKE, torch.device("cpu"), torch.float32, "float32"
        args.sessions, args.ticks, args.decode, args.window, args.sinks = "1,2", 1, 2, 32, 4
    else:
        if not torch.cuda.is_available():
            raise SystemExit("this benchmark needs a CUDA device (or --smoke)")
        shape, device, dtype, dtype_name = REAL, torch.device("cuda"), torch.bfloat16, "bfloat16"
    from metronome.audio.omni.minicpm_o import LogMel

    torch.manual_seed(0)
    start = time.perf_counter()
    model = random_decoder(shape, device, dtype)
    tower = random_tower(shape, device, dtype)
    mel_fn = LogMel(shape["whisper"]["num_mel_bins"], device)
    print(f"weights made in {time.perf_counter() - start:.1f} s", flush=True)
    engine = make_engine(model, args, device, dtype_name)

    limit = 0.3 * args.budget_ms
    results = {"model": "minicpm_o", "budget_ms": args.budget_ms, "limit_ms": limit, "smoke": args.smoke,
               "shape": {k: v for k, v in shape.items() if k != "markers"}, "args": vars(args),
               "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "sweep": []}
    for n in [int(x) for x in args.sessions.split(",") if x]:
        r = bench_n(engine, tower, mel_fn, shape, n, args, device)
        results["sweep"].append(r)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items() if k != "ticks"}),
              flush=True)
        if r.get("tick_ms", 0) > 2 * limit:
            break   # far past the limit: larger N only costs time
    fit = [r["N"] for r in results["sweep"] if r.get("tick_ms", math.inf) <= limit]
    results["capacity_at_0.3B"] = max(fit) if fit else 0

    what = "tiny smoke shape" if args.smoke else "Qwen3-8B + Whisper-medium"
    print(f"\nMiniCPM-o 4.5 ({what}), B = {args.budget_ms:g} ms, limit 0.3·B = {limit:g} ms")
    print(f"{'N':>5} {'tick ms':>9} {'encoder':>9} {'prefill':>9} {'decode':>9}")
    for r in results["sweep"]:
        if "tick_ms" in r:
            print(f"{r['N']:>5} {r['tick_ms']:>9.1f} {r['encoder_ms']:>9.1f} {r['prefill_ms']:>9.1f} "
                  f"{r['decode_ms']:>9.1f}")
        else:
            print(f"{r['N']:>5} {r['skipped']}")
    print(f"capacity (tick <= {limit:g} ms): {results['capacity_at_0.3B']} sessions")
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "models_minicpm_o.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
