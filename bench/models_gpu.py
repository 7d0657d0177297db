"""Tick benchmark of one interaction model at its real shape, random weights made on the device (no download).

    python bench/models_gpu.py --model qwen2_5_omni            # on one CUDA GPU (3-4 min a model)
    python bench/models_gpu.py --model qwen3_omni --sessions 16,32,48,64
    python bench/models_gpu.py --model moshi --smoke            # tiny shapes on the CPU: checks the code path

Figures: docs/benchmarks/models.md.

Per N sessions, one tick is what the model's adapter and the engine do for a free-running session: the
audio front end for B of audio of every session in one batched call ("encoder"), the engine's prefill of
the spliced rows, and the tick's decode (25 greedy tokens in shared rounds; Moshi: one frame, whose depth
transformer and Mimi decode run in the adapter). Sessions use SinkWindow (S = 16, W = 1024; Moshi
W = 2048) and are aged until the window is full. Reported per N: the median tick and its split, and the
largest N whose median tick stays within 0.3·B (the capacity). Shapes, from the published configs:

* qwen2_5_omni (B = 2 s): Qwen2.5-Omni-7B's thinker, Qwen2-7B decoder (28 layers, hidden 3584, 28/4
  heads x 128, TMRoPE) and a Whisper-large-v3-shaped audio tower; 52 input rows a tick.
* qwen3_omni (B = 2 s): Qwen3-Omni-30B-A3B's thinker, a 48-layer MoE decoder (128 experts, 8 active, the
  Triton grouped GEMM) and its 32-layer audio encoder; 28 input rows a tick. Also times one MoE layer per
  expert path and eager ticks with the per-expert loop against the grouped GEMM; ``--tune-moe`` only
  sweeps the grouped GEMM's tiles.
* minicpm_o (B = 1 s): MiniCPM-o 4.5, a Qwen3-8B decoder and Whisper-medium with its projection and
  5x pooling; 12 input rows a tick.
* moshi (B = 80 ms): Moshi 7B, temporal transformer (one position a frame), depth transformer (8
  codebooks) and Mimi, both CUDA-graphed per batch bucket in the adapter.

``--quantization fp8`` quantises the decoder and, as the worker does, the omni models' audio towers
(``metronome/audio/omni/tower_fp8.py``); ``--bf16-tower`` leaves the towers unquantised.

A table goes to stdout and the raw results (every tick, the config, the machine) to ``--out``
(default ``$OUT/models_<model>.json``, OUT defaulting to ./out).
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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

# ============================================================================================ shapes
QWEN2_5_OMNI = {
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
QWEN2_5_AUDIO_PAD, QWEN2_5_AUDIO_START, QWEN2_5_AUDIO_END = 151646, 151647, 151648

QWEN3_OMNI = {
    "qwen3-omni-30b-a3b": dict(
        text=dict(vocab_size=152064, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                  intermediate_size=6144,  # dense MLP size; unused (every layer is MoE: mlp_only_layers = [])
                  num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, rope_theta=1e6,
                  max_position_embeddings=65536),
        audio=dict(num_mel_bins=128, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
                   d_model=1280, output_dim=2048, downsample_hidden_size=480, n_window=50, n_window_infer=800,
                   conv_chunksize=500, max_source_positions=1500),
    ),
    "smoke": dict(
        text=dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=96, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  rope_theta=1e6, max_position_embeddings=4096),
        audio=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                   output_dim=64, downsample_hidden_size=8, n_window=50, n_window_infer=800, conv_chunksize=500,
                   max_source_positions=1500),
    ),
}

# MiniCPM-o 4.5: the LLM fields are top-level in its config.json (MiniCPMOConfig is a Qwen3Config).
MINICPM_O = {
    "minicpm-o-4.5": dict(
        llm=dict(model_type="minicpmo", vocab_size=151748, hidden_size=4096, intermediate_size=12288,
                 num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                 attention_bias=False, tie_word_embeddings=False, eos_token_id=151645),
        whisper=dict(d_model=1024, encoder_layers=24, encoder_attention_heads=16, encoder_ffn_dim=4096,
                     num_mel_bins=80, max_source_positions=1500),
        markers=[151697, 151699],   # <|audio_start|>, <|audio_end|>
    ),
    "smoke": dict(
        llm=dict(model_type="minicpmo", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
                 max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False,
                 tie_word_embeddings=False, eos_token_id=2),
        whisper=dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128, num_mel_bins=80,
                     max_source_positions=1500, decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64),
        markers=[1, 2],
    ),
}
MINICPM_POOL_STEP = 5

# transformers' MoshiConfig() / MimiConfig() defaults are the published Kyutai checkpoints'.
MOSHI = {
    "moshi-7b": {
        "moshi": dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, ffn_dim=22528, max_position_embeddings=3000, sliding_window=3000,
                      rms_norm_eps=1e-8, num_codebooks=8,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "depth": dict(hidden_size=1024, num_hidden_layers=6, num_attention_heads=16, ffn_dim=5632,
                      max_position_embeddings=9, sliding_window=8, rms_norm_eps=1e-8),
        "mimi": dict(hidden_size=512, num_filters=64, upsampling_ratios=[8, 6, 5, 4], num_hidden_layers=8,
                     intermediate_size=2048, num_attention_heads=8, num_key_value_heads=8, codebook_size=2048,
                     codebook_dim=256, num_quantizers=32, vector_quantization_hidden_dimension=256,
                     upsample_groups=512, sliding_window=250, max_position_embeddings=8000),
    },
    "smoke": {
        "moshi": dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, ffn_dim=64, num_codebooks=8),
        "depth": dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32),
        "mimi": dict(hidden_size=16, num_filters=4, upsampling_ratios=[8, 6, 5, 4], num_hidden_layers=1,
                     intermediate_size=32, num_attention_heads=2, num_key_value_heads=2, codebook_size=32,
                     codebook_dim=8, num_quantizers=8, vector_quantization_hidden_dimension=8, upsample_groups=4,
                     sliding_window=20, max_position_embeddings=200),
    },
}


# ============================================================================================ shared parts
def without_soxr() -> None:
    """``metronome.audio`` imports its resampler (soxr); nothing here resamples, so a stand-in does when
    soxr is not installed."""
    if importlib.util.find_spec("soxr") is None:
        stub = types.ModuleType("soxr")

        def unavailable(*args, **kwargs):
            raise RuntimeError("soxr is not installed (the benchmark does not resample)")

        stub.resample = stub.ResampleStream = unavailable
        sys.modules["soxr"] = stub


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def speech_like(samples: int, rng: np.random.Generator) -> np.ndarray:
    """Noise with a random loudness every 25 ms, in [-1, 1]."""
    envelope = np.repeat(10 ** rng.uniform(-3.0, 0.0, size=samples // 400 + 1), 400)[:samples]
    return (rng.standard_normal(samples) * envelope * 0.3).clip(-1, 1).astype(np.float32)


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy rate, bytes read + written per second (nan off CUDA)."""
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


def made_layer(args):
    """What each decoder layer goes through as the random decoder is made: with ``--quantization fp8``, E4M3 at
    once (the engine leaves FP8 layers as they are), so only one layer is ever held in bf16."""
    from metronome.models.fp8 import quantize_layers_

    return quantize_layers_ if args.quantization == "fp8" else None


def tower_quantization(args) -> str | None:
    """The audio tower's weights: the engine's ``--quantization`` (as the worker serves it) unless ``--bf16-tower``."""
    return None if args.bf16_tower else args.quantization


def weight_count(net: torch.nn.Module) -> int:
    """Parameters, and the weights that FP8 layers hold as buffers (E4M3 codes)."""
    from metronome.models.fp8 import Fp8Linear

    return (sum(p.numel() for p in net.parameters())
            + sum(m.weight.numel() for m in net.modules() if isinstance(m, Fp8Linear)))


def make_engine(model, args, device: torch.device, *, cuda_graphs: bool | None = None, kv_fraction: float = 0.85):
    from metronome import Engine, EngineConfig, KVPolicy

    cuda = device.type == "cuda"
    policy = KVPolicy(sinks=args.sinks, window=args.window, block_size=16)
    start = time.perf_counter()
    engine = Engine(EngineConfig(model="random", device=str(device), dtype=args.dtype, policy=policy,
                                 attention="triton" if cuda else "torch",
                                 cuda_graphs=(cuda and not args.no_graphs) if cuda_graphs is None else cuda_graphs,
                                 kv_memory_fraction=kv_fraction, num_blocks=None if cuda else args.num_blocks,
                                 max_chunk_tokens=args.chunk, max_batch_tokens=args.batch_tokens,
                                 quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype), model=model)
    print(f"engine ready in {time.perf_counter() - start:.1f} s, KV capacity {engine.stats().capacity} sessions",
          flush=True)
    return engine


class Arm:
    """One model on one engine, with sessions that stay open (and full) as the sweep grows N."""

    warmup_ticks = 1
    columns: tuple[tuple[str, str], ...] = ()   # (table header, row key)
    medians: tuple[str, ...] = ()               # the per-tick times a row reports the median of

    def __init__(self, args, device: torch.device) -> None:
        self.args, self.device = args, device
        self.sids: list[int] = []
        self.rng = np.random.default_rng(0)
        self.gen = torch.Generator().manual_seed(0)

    def age_input(self, sid: int, rows: int):
        from metronome import StepInput

        return StepInput(sid, token_ids=torch.randint(0, self.vocab_size, (rows,), generator=self.gen).tolist())

    def grow(self, n: int) -> None:
        """Open sessions up to ``n`` and fill the new ones' windows, a chunk at a time."""
        new = [self.engine.open_session() for _ in range(n - len(self.sids))]
        policy, chunk = self.engine.config.policy, self.args.chunk
        per_step = max(1, self.args.batch_tokens // chunk)
        for _ in range(math.ceil((policy.sinks + policy.window) / chunk)):
            for i in range(0, len(new), per_step):
                self.engine.step([self.age_input(s, chunk) for s in new[i:i + per_step]])
        self.sids += new

    def tick(self, n: int) -> dict:
        raise NotImplementedError

    def row_extra(self, n: int, ticks: list[dict]) -> dict:
        return {}

    def before(self, results: dict) -> None:
        """Measurements made before the sweep (none by default)."""

    def after(self, results: dict) -> None:
        """Measurements made after the sweep (none by default)."""

    def close(self) -> None:
        self.engine.close()


def kernel_group(name: str) -> str:
    """A kernel's name for the profile's split, without its argument list: torch's elementwise kernels keep
    their template arguments, which name the operation (``CUDAFunctor_add<c10::BFloat16>``)."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "").split("(")[0]
    return name[:140] if name.startswith("at::native::") else name.split("<")[0][:100]


def idle_gaps(ticks: list[list[tuple[float, float, str]]], floor_us: float = 20.0, top: int = 10) -> dict:
    """Where the device waits within each tick, from each tick's kernels (start and end in µs, name): all the time
    between its first kernel and its last that no kernel or copy covers, and the stretches over ``floor_us``
    grouped by the kernels on either side; ms per tick."""
    groups: dict[str, list[float]] = {}
    uncovered = 0.0
    for spans in ticks:
        order = sorted(spans)
        busy_until, last = (order[0][1], order[0][2]) if order else (0.0, "")
        for start, end, name in order[1:]:
            if start > busy_until:
                uncovered += (start - busy_until) / 1e3 / len(ticks)
            if start - busy_until > floor_us:
                entry = groups.setdefault(f"{last} -> {name}", [0.0, 0])
                entry[0] += (start - busy_until) / 1e3 / len(ticks)
                entry[1] += 1
            if end > busy_until:
                busy_until, last = end, name
    rows = sorted(({"between": k, "ms_per_tick": round(v[0], 3), "per_tick": v[1] / len(ticks)}
                   for k, v in groups.items()), key=lambda r: -r["ms_per_tick"])
    return {"uncovered_ms_per_tick": round(uncovered, 3),
            "idle_ms_per_tick": round(sum(r["ms_per_tick"] for r in rows), 3), "gaps": rows[:top]}


def profile_ticks(arm: Arm, n: int, ticks: int, top: int = 25) -> dict:
    """``ticks`` ticks under the torch profiler, one profile a tick: device time per kernel family (graph replays
    included) against the ticks' wall time, and the stretches in which the device waits on the host."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if arm.device.type == "cuda" else [])
    families: dict[str, list[float]] = {}
    walls, per_tick = [], []
    for _ in range(ticks):
        with profile(activities=activities) as prof:
            walls.append(arm.tick(n)["tick_ms"])
        spans = [(e.time_range.start, e.time_range.end, kernel_group(e.name)) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA]
        for start, end, name in spans:
            entry = families.setdefault(name, [0.0, 0])
            entry[0] += (end - start) / 1e3 / ticks
            entry[1] += 1
        per_tick.append(spans)
    kernels = sorted(({"kernel": k, "ms_per_tick": round(v[0], 3), "launches_per_tick": v[1] // ticks}
                      for k, v in families.items()), key=lambda r: -r["ms_per_tick"])
    busy = sum(r["ms_per_tick"] for r in kernels)
    idle = idle_gaps(per_tick)
    print(f"profile at N = {n}: tick {statistics.median(walls):.1f} ms (under the profiler), kernels {busy:.1f} ms, "
          f"device waiting {idle['uncovered_ms_per_tick']:.1f} ms "
          f"({idle['idle_ms_per_tick']:.1f} in stretches over 20 µs)")
    for r in kernels[:top]:
        print(f"  {r['ms_per_tick']:9.3f} ms {r['launches_per_tick']:6d}x  {r['kernel']}")
    for r in idle["gaps"]:
        print(f"  idle {r['ms_per_tick']:8.3f} ms {r['per_tick']:6.0f}x  {r['between'][:150]}")
    return {"tick_ms": walls, "kernel_ms_per_tick": busy, "kernels": kernels[:top], "idle": idle}


def sweep(arm: Arm, spec: ModelBench, args, results: dict) -> None:
    """Grow the sessions through ``args.sessions``; per N, median tick and split after the warm-up."""
    limit, rows = results["limit_ms"], results[spec.rows_key]
    for n in args.session_list:
        capacity = arm.engine.stats().capacity
        if capacity < n:
            rows.append({"N": n, "skipped": f"KV pool holds {capacity} sessions"})
            break
        arm.grow(n)
        ticks = [arm.tick(n) for _ in range(arm.warmup_ticks + args.ticks)][arm.warmup_ticks:]
        medians = {f"{spec.prefix}{key}": statistics.median(t[key] for t in ticks)
                   for key in arm.medians or [key for _, key in arm.columns]}
        row = {"N": n, **medians, **arm.row_extra(n, ticks), "ticks": ticks}
        if n in args.profile_list:
            row["profile"] = profile_ticks(arm, n, args.ticks)
        rows.append(row)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()
                          if k not in ("ticks", "profile")}),
              flush=True)
        if row[f"{spec.prefix}tick_ms"] > args.stop_factor * limit:
            break
    fit = [r["N"] for r in rows if r.get(f"{spec.prefix}tick_ms", math.inf) <= limit]
    results["capacity_at_0.3B"] = max(fit) if fit else 0


def print_table(arm: Arm, spec: ModelBench, results: dict) -> None:
    policy = results["policy"]
    print(f"\n{results['title']}, shape {results['shape']} ({results['device']}): B = {results['budget_ms']:g} ms, limit 0.3·B = "
          f"{results['limit_ms']:g} ms, SinkWindow S = {policy['sinks']}, W = {policy['window']}, "
          + spec.per_tick.format(decode=results["decode_tokens"]))
    digits = 2 if results["budget_ms"] < 200 else 1
    print(f"{'N':>5} " + " ".join(f"{header:>9}" for header, _ in arm.columns))
    for r in results[spec.rows_key]:
        if "skipped" in r:
            print(f"{r['N']:>5} {r['skipped']}")
        else:
            print(f"{r['N']:>5} " + " ".join(f"{r.get(spec.prefix + key, r.get(key, math.nan)):>9.{digits}f}"
                                             for _, key in arm.columns))
    print(f"capacity (tick <= {results['limit_ms']:g} ms): {results['capacity_at_0.3B']} sessions")


# ============================================================================================ Qwen2.5-Omni
def qwen2_5_omni_config(shape: str) -> dict:
    """A ``config.json`` of a Qwen2_5OmniForConditionalGeneration checkpoint of ``shape`` (thinker only)."""
    s = QWEN2_5_OMNI[shape]
    vocab = s["text"]["vocab_size"]
    markers = (QWEN2_5_AUDIO_PAD, QWEN2_5_AUDIO_START, QWEN2_5_AUDIO_END) if vocab > QWEN2_5_AUDIO_END \
        else (vocab - 3, vocab - 2, vocab - 1)
    return {"model_type": "qwen2_5_omni", "thinker_config": {
        "model_type": "qwen2_5_omni_thinker", "text_config": dict(s["text"]), "audio_config": dict(s["audio"]),
        "audio_token_index": markers[0], "audio_start_token_id": markers[1], "audio_end_token_id": markers[2],
        "tie_word_embeddings": False}}


class Qwen25OmniArm(Arm):
    """2 s of audio → Whisper features → the audio tower (all sessions' blocks in one packed call) → 50
    embeddings between ``<|audio_bos|>`` and ``<|audio_eos|>`` → prefill → decode."""

    columns = (("tick ms", "tick_ms"), ("encoder", "encoder_ms"), ("(feats)", "features_ms"),
               ("prefill", "prefill_ms"), ("decode", "decode_ms"))

    def __init__(self, args, device) -> None:
        super().__init__(args, device)
        from transformers import WhisperFeatureExtractor

        from metronome.audio.omni.qwen2_5_omni import AudioFrontEnd, AudioMarkers, audio_config, build_audio_encoder
        from metronome.experiments.random_weights import random_decoder, randomize_
        from metronome.models.llama import LlamaFamilyForCausalLM
        from metronome.models.omni.qwen2_5_omni import text_spec

        config = qwen2_5_omni_config(args.shape)
        model = random_decoder(LlamaFamilyForCausalLM, text_spec(config), device, args.torch_dtype,
                               each_layer=made_layer(args))
        encoder = randomize_(build_audio_encoder(audio_config(config), device, args.torch_dtype, packed=True), 1)
        features = WhisperFeatureExtractor(feature_size=encoder.config.num_mel_bins, sampling_rate=16000,
                                           hop_length=160, chunk_length=30, n_fft=400)
        self.frontend = AudioFrontEnd(encoder, features, device, args.torch_dtype, tower_quantization(args))
        self.markers = AudioMarkers.from_config(config)
        self.vocab_size = model.spec.vocab_size
        self.engine = make_engine(model, args, device, kv_fraction=0.8)

    def tick(self, n: int) -> dict:
        from metronome import StepInput
        from metronome.audio.omni.thinker import splice_all

        sids, m = self.sids[:n], self.markers
        block = int(round(self.args.budget_ms / 1000.0 * self.frontend.sample_rate))
        clips = [speech_like(block, self.rng) for _ in sids]
        sync(self.device)
        t0 = time.perf_counter()
        feats, lengths = self.frontend.extract(clips)
        sync(self.device)   # the features stay on the device: wait for them, so the column is their time
        t1 = time.perf_counter()
        with torch.inference_mode():
            rows = self.frontend.encode_features(feats, lengths)
            embeds = splice_all(self.engine.model.embed, [[m.start] + [m.pad] * r.shape[0] + [m.end] for r in rows],
                                m.pad, [[r] for r in rows], self.device)
        sync(self.device)
        t2 = time.perf_counter()
        outs = self.engine.step([StepInput(s, embeds=e, max_new_tokens=self.args.decode)
                                 for s, e in zip(sids, embeds)])
        sync(self.device)   # the step returns once its work is queued
        t3 = time.perf_counter()
        if any(o.error for o in outs) or any(len(o.token_ids) != self.args.decode for o in outs):
            raise RuntimeError(f"a session failed: {[o.error for o in outs if o.error][:3]}")
        timing = self.engine.last_timing
        return {"tick_ms": (t3 - t0) * 1e3, "features_ms": (t1 - t0) * 1e3, "encoder_ms": (t2 - t0) * 1e3,
                "prefill_ms": timing.prefill_ms, "decode_ms": timing.decode_ms, "step_ms": (t3 - t2) * 1e3,
                "input_rows": int(embeds[0].shape[0])}

    def row_extra(self, n, ticks) -> dict:
        return {"input_rows": ticks[0]["input_rows"]}


# ============================================================================================ Qwen3-Omni
def qwen3_omni_spec(text: dict):
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
    fastest (block_m, TileConfig) by its time in a CUDA graph; configs that do not fit are skipped."""
    import itertools

    from metronome.models.moe_routing_triton import route
    from metronome.models.moe_triton import (TileConfig, launch_down, launch_for, launch_gate_up,
                                             multiplies_transposed)

    text = QWEN3_OMNI["qwen3-omni-30b-a3b"]["text"]
    e, h, k = text["num_experts"], text["hidden_size"], text["num_experts_per_tok"]
    inter = text["moe_intermediate_size"]
    dev = torch.device("cuda")
    w_gate_up = torch.randn(e, 2 * inter, h, device=dev, dtype=torch.bfloat16) * 0.02
    w_down = torch.randn(e, h, inter, device=dev, dtype=torch.bfloat16) * 0.02
    gate_up_scale, down_scale = (None, 0), (None, 0)
    reductions = (64, 128, 256)
    if args.quantization == "fp8":   # E4M3 experts, one scale per output channel: half the bytes a step
        from metronome.models.fp8 import quantize

        (w_gate_up, s_gu), (w_down, s_dn) = quantize(w_gate_up), quantize(w_down)
        gate_up_scale, down_scale, reductions = (s_gu, h), (s_dn, inter), (128, 256, 512)

    def grid(mean: float) -> list[TileConfig]:
        widths = (64, 128, 256) if mean > 128 else (64, 128)   # wide columns only where tall row tiles reuse them
        return [TileConfig(n, kk, w, st) for n, kk, w, st in itertools.product(widths, reductions, (4, 8), (3, 4))]

    def timed(fn) -> float:
        """ms per call of ``fn`` replayed 5 times in a CUDA graph, median of 7 replays (no launch cost: the
        engine's decode rounds are captured)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(5):
                fn()
        times = []
        for _ in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 5)
        return statistics.median(times)

    rows = []
    for t in ints(args.tune_tokens):
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        ids = torch.softmax(torch.randn(t, e, device=dev), -1).topk(k, -1).indices
        weights = torch.full((t * k,), 1.0 / k, device=dev, dtype=torch.bfloat16)
        mean = t * k / e
        heights = (16,) if mean <= 8 else (16, 32, 64) if mean <= 64 else (64, 128)
        act = torch.randn(t * k, inter, device=dev, dtype=torch.bfloat16)
        out = torch.empty(t * k, h, device=dev, dtype=torch.float32)
        # E4M3 experts multiply E4M3 activations (as grouped_moe does on this GPU): the kernels read codes
        x_in, x_row_scale, act_in, act_row_scale = x, None, act, None
        if args.quantization == "fp8":
            from metronome.models.fp8 import quantize_rows

            (x_in, x_row_scale), (act_in, act_row_scale) = quantize_rows(x), quantize_rows(act)

        def kernels(routing, cfg: TileConfig, transposed: bool | None = None) -> dict:
            return {"gate_up": lambda: launch_gate_up(x_in, w_gate_up, act, routing, k, cfg, False, *gate_up_scale,
                                                      x_scale=x_row_scale, transposed=transposed),
                    "down": lambda: launch_down(act_in, w_down, out, weights, routing, cfg, False, *down_scale,
                                                act_scale=act_row_scale, transposed=transposed)}

        best: dict = {}
        for bm in heights:
            routing = route(ids, e, bm)
            for cfg in grid(mean):
                for kernel, fn in kernels(routing, cfg).items():
                    try:
                        ms = timed(fn)
                    except Exception as exc:   # e.g. out of shared memory for this tile shape
                        print(f"skip {kernel} T={t} bm={bm} {cfg}: {type(exc).__name__}", flush=True)
                        continue
                    if kernel not in best or ms < best[kernel]["ms"]:
                        best[kernel] = {"ms": ms, "block_m": bm, **vars(cfg)}
        # The tiles the engine chooses (launch_for, as grouped_moe), timed the same way, beside the sweep's best
        chosen = launch_for(x, w_gate_up, t * k, args.quantization == "fp8")
        routing = route(ids, e, chosen.block_m)
        best["chosen"] = {"block_m": chosen.block_m}
        for kernel, cfg in (("gate_up", chosen.gate_up), ("down", chosen.down)):
            best["chosen"][kernel] = {**vars(cfg), "ms": timed(kernels(routing, cfg)[kernel])}
            if multiplies_transposed(x_in.dtype, chosen.block_m, cfg, dev):   # and untransposed (fp16 operands)
                best["chosen"][kernel]["untransposed_ms"] = timed(kernels(routing, cfg, transposed=False)[kernel])
        weight_bytes = 3 * inter * h * w_down.element_size() * e * (1 - (1 - k / e) ** t)
        seconds = (best["gate_up"]["ms"] + best["down"]["ms"]) * 1e-3
        row = {"tokens": t, **best, "expert_bytes": weight_bytes, "tb_per_s": weight_bytes / seconds / 1e12,
               "tflop_per_s": 6 * inter * h * t * k / seconds / 1e12}
        rows.append(row)
        print(json.dumps({"tune": row}), flush=True)
    return {"tune": rows}


class Qwen3OmniArm(Arm):
    """Every session's 2-s clip → Whisper features (on the device) → the audio tower in one call →
    ``<|audio_start|> 26 x audio <|audio_end|>`` → prefill of those 28 rows → decode."""

    columns = (("tick ms", "tick_ms"), ("encoder", "encoder_ms"), ("prefill", "prefill_ms"),
               ("decode", "decode_ms"), ("floor", "decode_floor_ms"))
    medians = ("tick_ms", "encoder_ms", "prefill_ms", "decode_ms")

    def __init__(self, args, device) -> None:
        super().__init__(args, device)
        from transformers import Qwen3OmniMoeAudioEncoderConfig

        from metronome.audio.omni.qwen3_omni import AudioFrontEnd, build_audio_encoder, feature_extractor_for
        from metronome.experiments.random_weights import random_decoder, randomize_
        from metronome.models.moe import MoeForCausalLM

        shape = QWEN3_OMNI[args.shape]
        self.spec = qwen3_omni_spec(shape["text"])
        self.vocab_size = self.spec.vocab_size
        self.bandwidth = copy_bandwidth(device)
        self.moe_layer = time_expert_paths(self.spec, device, args.torch_dtype, ints(args.layer_tokens),
                                           reps=3 if args.smoke else 10)
        start = time.perf_counter()
        self.model = random_decoder(MoeForCausalLM, self.spec, device, args.torch_dtype, per_expert=False,
                                    each_layer=made_layer(args))
        encoder = build_audio_encoder(Qwen3OmniMoeAudioEncoderConfig(**shape["audio"]), device, args.torch_dtype)
        randomize_(encoder, seed=1)
        self.frontend = AudioFrontEnd(encoder, feature_extractor_for(None, shape["audio"]["num_mel_bins"]), device,
                                      args.torch_dtype, tower_quantization(args))
        sync(device)
        self.build_s = time.perf_counter() - start
        self.open_engine(cuda_graphs=None, kv_fraction=0.85)

    def open_engine(self, cuda_graphs: bool | None, kv_fraction: float) -> None:
        start = time.perf_counter()
        self.engine = make_engine(self.model, self.args, self.device, cuda_graphs=cuda_graphs,
                                  kv_fraction=kv_fraction)
        self.ready_s = time.perf_counter() - start
        self.sids = []
        markers = torch.tensor([1, 2], device=self.device)  # stand-ins for <|audio_start|>, <|audio_end|>
        self.start_row, self.end_row = self.model.embed(markers).split(1)

    def before(self, results: dict) -> None:
        results.update(copy_bytes_per_s=self.bandwidth, moe_layer=self.moe_layer, build_s=self.build_s,
                       decoder_params=weight_count(self.model), encoder_params=weight_count(self.frontend.encoder),
                       engine_ready_s=self.ready_s, capacity_by_memory=self.engine.stats().capacity)
        print(f"random weights: decoder {results['decoder_params'] / 1e9:.2f} B, encoder "
              f"{results['encoder_params'] / 1e9:.3f} B parameters in {self.build_s:.1f} s", flush=True)

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
        timing = self.engine.last_timing
        return {"tick_ms": (time.perf_counter() - start) * 1e3, "encoder_ms": encoder_ms,
                "prefill_ms": timing.prefill_ms, "decode_ms": timing.decode_ms,
                "prefill_rows": int(embeds[0].shape[0]) if embeds else 0}

    def row_extra(self, n, ticks) -> dict:
        extra = {"prefill_rows": ticks[0]["prefill_rows"]}
        if self.device.type == "cuda":
            extra["decode_floor_ms"] = decode_floor_ms(self.spec, n, self.args.decode, self.bandwidth)
        return extra

    def after(self, results: dict) -> None:
        """Whole ticks without CUDA graphs (the per-expert loop syncs with the host, so it cannot be
        captured): the grouped GEMM against the loop, on a fresh engine."""
        results["compare"] = []
        compare = ints(self.args.compare_sessions)
        if not compare:
            return
        self.engine.close()
        self.open_engine(cuda_graphs=False, kv_fraction=0.5)
        for n in compare:
            if n > self.engine.stats().capacity:
                continue
            self.grow(n)
            row = {"N": n}
            for path in ("triton" if self.device.type == "cuda" else "torch", "loop"):
                self.model.set_expert_backend(path)
                ticks = [self.tick(n) for _ in range(2)][1:]
                row[path] = {f"median_{k}": statistics.median(t[k] for t in ticks) for k in self.medians}
            self.model.set_expert_backend("auto")
            results["compare"].append(row)
            print(json.dumps({"compare": row}), flush=True)

    @staticmethod
    def report(results: dict) -> None:
        if results.get("moe_layer"):
            print("\none MoE layer, ms:  " + "  ".join(
                f"T={r['tokens']}: " + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in r.items() if k.endswith("_ms"))
                for r in results["moe_layer"]))
        for row in results.get("compare", []):
            print(f"eager tick at N={row['N']}: " + ", ".join(
                f"{path} {v['median_tick_ms']:.0f} ms (decode {v['median_decode_ms']:.0f})"
                for path, v in row.items() if path != "N"))


# ============================================================================================ MiniCPM-o
class MiniCpmOArm(Arm):
    """Every session's new 1-s chunk → log-mel → Whisper → projection → pooling (one batched call), 10 rows
    between ``<|audio_start|>`` and ``<|audio_end|>`` → prefill → decode."""

    columns = (("tick ms", "tick_ms"), ("encoder", "encoder_ms"), ("prefill", "prefill_ms"), ("decode", "decode_ms"))

    def __init__(self, args, device) -> None:
        super().__init__(args, device)
        from metronome.audio.omni.minicpm_o import AudioSpec, AudioTower, LogMel
        from metronome.audio.omni.tower_fp8 import quantize_tower_
        from metronome.experiments.random_weights import random_decoder
        from metronome.models.llama import LlamaFamilyForCausalLM
        from metronome.models.omni.minicpm_o import decoder_spec

        torch.manual_seed(0)
        self.shape = MINICPM_O[args.shape]
        model = random_decoder(LlamaFamilyForCausalLM, decoder_spec(self.shape["llm"]), device, args.torch_dtype,
                               each_layer=made_layer(args))
        spec = AudioSpec(whisper=dict(self.shape["whisper"]), pool_step=MINICPM_POOL_STEP, chunk_s=1.0,
                         hidden_size=self.shape["llm"]["hidden_size"])
        with torch.device(device):
            tower = AudioTower(spec).to(args.torch_dtype)
        with torch.no_grad():
            for name, p in tower.named_parameters():
                if "embed_positions" in name:
                    continue   # sinusoids, as Whisper's init
                if "layer_norm" in name:
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    p.normal_(0.0, 0.02)
        self.tower = quantize_tower_(tower.eval().requires_grad_(False), tower_quantization(args))
        self.mel = LogMel(self.shape["whisper"]["num_mel_bins"], device)
        self.vocab_size = self.shape["llm"]["vocab_size"]
        self.engine = make_engine(model, args, device)

    def tick(self, n: int) -> dict:
        from metronome import StepInput

        sids = self.sids[:n]
        chunks = [speech_like(16000, self.rng) for _ in sids]   # as the worker hands them to the adapter
        sync(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            rows = self.tower(self.mel(chunks).to(self.device))
            markers = torch.tensor(self.shape["markers"], device=self.device)
            start, end = self.engine.model.embed(markers).to(rows.dtype).expand(len(rows), -1, -1).split(1, dim=1)
            embeds = torch.cat([start, rows, end], dim=1).unbind(0)
        sync(self.device)
        t1 = time.perf_counter()
        self.engine.step([StepInput(s, embeds=e, max_new_tokens=self.args.decode) for s, e in zip(sids, embeds)])
        sync(self.device)
        t2 = time.perf_counter()
        return {"tick_ms": (t2 - t0) * 1e3, "encoder_ms": (t1 - t0) * 1e3,
                "prefill_ms": self.engine.last_timing.prefill_ms, "decode_ms": self.engine.last_timing.decode_ms,
                "prefill_tokens": int(embeds[0].shape[0])}

    def row_extra(self, n, ticks) -> dict:
        return {"prefill_tokens_per_session": ticks[0]["prefill_tokens"], "decode_tokens": self.args.decode}


# ============================================================================================ Moshi
class NoText:
    """Stands in for Moshi's SentencePiece tokenizer (none is downloaded): text deltas come out empty."""

    all_special_ids: list[int] = []

    def decode(self, ids, **kwargs) -> str:
        return ""


def mark(device: torch.device):
    """A point in the device's stream (a recorded CUDA event), or the wall clock off CUDA."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def span_ms(start, end) -> float:
    """Milliseconds between two marks; on CUDA, once the end has run."""
    if isinstance(start, float):
        return (end - start) * 1e3
    end.synchronize()
    return start.elapsed_time(end)


class Timed:
    """Wraps a bound method and keeps the stream's span of each call, from the call to the end of its work: events
    rather than synchronisations, so timing a part adds no wait to the tick."""

    def __init__(self, fn, device) -> None:
        self.fn, self.device, self.spans = fn, device, []

    def __call__(self, *args, **kwargs):
        start = mark(self.device)
        out = self.fn(*args, **kwargs)
        self.spans.append((start, mark(self.device)))
        return out

    def take_ms(self) -> float:
        """The calls' total since the last take."""
        total = sum(span_ms(a, b) for a, b in self.spans)
        self.spans.clear()
        return total


class MoshiArm(Arm):
    """One Moshi frame per session, the worker's path through ``metronome/audio/omni/moshi.py``: ``prepare``
    (Mimi encode of 1,920 new samples of every session + the summed embeddings: "encoder"), ``engine.step``
    (one position a session, the engine's prefill: "step", ``prefill_ms`` in the JSON; no decode rounds),
    ``on_hidden`` (text head + depth transformer: "depth"; Mimi decode of the new frame: "mimi decode"). The tick
    is wall time from the audio in hand to the PCM on the host; the parts are spans of the stream (CUDA events),
    which add no wait to the tick (``engine_step_ms``: the engine's own timing of its step, CUDA events)."""

    warmup_ticks = 2   # a new session speaks from its second frame
    columns = (("tick ms", "tick_ms"), ("encoder", "encoder_ms"), ("(mimi)", "mimi_encode_ms"),
               ("step", "prefill_ms"), ("depth", "depth_ms"), ("mimi dec", "mimi_decode_ms"),
               ("heads", "heads_ms"))

    def __init__(self, args, device) -> None:
        super().__init__(args, device)
        from transformers import MoshiConfig

        from metronome.audio.omni.moshi import MoshiAdapter
        from metronome.audio.omni.moshi_heads import MoshiHeads
        from metronome.experiments.random_weights import randomize_
        from metronome.models.omni.moshi import build_decoder, decoder_spec, finish_decoder

        s, dtype = MOSHI[args.shape], args.torch_dtype
        config = MoshiConfig(**s["moshi"], audio_encoder_config=dict(s["mimi"]), depth_decoder_config=dict(s["depth"]))
        net = build_decoder(decoder_spec(config), dtype, device)
        randomize_(net, 0)
        net = finish_decoder(net, device)
        with torch.device(device):
            heads = MoshiHeads(config)   # Mimi keeps transformers' initialisation (float32, as the adapter runs it)
        for seed, module in enumerate((heads.depth_decoder, heads.embed_tokens, heads.lm_head), start=1):
            randomize_(module, seed)
        with torch.no_grad():
            for name, b in heads.audio_encoder.named_buffers():
                if name.endswith("embed_sum"):   # codebooks start at zero: every code would be 0
                    b.normal_()
        for module in (heads.embed_tokens, heads.lm_head, heads.depth_decoder):
            module.to(dtype)
        heads.requires_grad_(False).eval()
        self.adapter = a = MoshiAdapter(heads, NoText(), net.embed, device, dtype)
        self.timers = {"encode": Timed(a.codec.encode, device), "decode": Timed(a.codec.decode, device),
                       "depth": Timed(a.depth.generate, device)}
        a.codec.encode, a.codec.decode, a.depth.generate = (self.timers["encode"], self.timers["decode"],
                                                            self.timers["depth"])
        self.hidden, self.dtype = net.spec.hidden_size, dtype
        self.engine = make_engine(net, args, device)

    def age_input(self, sid: int, rows: int):
        from metronome import StepInput

        embeds = torch.randn(rows, self.hidden, generator=self.gen) * 0.02
        return StepInput(sid, embeds=embeds.to(self.device, self.dtype))

    def grow(self, n: int) -> None:
        old = len(self.sids)
        super().grow(n)
        for i in range(old, n):
            self.adapter.open_session(f"s{i}", "free_running", "")

    def tick(self, n: int) -> dict:
        from metronome import StepInput
        from metronome.audio.adapter import TickAudio

        a, names = self.adapter, [f"s{i}" for i in range(n)]
        audio = [TickAudio(name, pcm=speech_like(a.frame_size, self.rng)) for name in names]
        sync(self.device)
        t0 = time.perf_counter()
        start = mark(self.device)
        prepared = a.prepare(audio)
        prepared_at = mark(self.device)
        outs = self.engine.step([StepInput(s, embeds=p.embeds, return_hidden=True, embeds_finite=p.embeds_finite)
                                 for s, p in zip(self.sids[:n], prepared)])
        stepped_at = mark(self.device)
        if any(o.error or o.hidden is None for o in outs):
            raise RuntimeError(f"a session failed: {[o.error for o in outs if o.error][:3]}")
        a.on_hidden([(name, o.hidden) for name, o in zip(names, outs)])
        done_at = mark(self.device)
        sync(self.device)
        t3 = time.perf_counter()
        spoken = [len(a.take_audio(name)) for name in names]
        for name in names:
            a.on_output(name, [], False)
        return {"tick_ms": (t3 - t0) * 1e3, "encoder_ms": span_ms(start, prepared_at),
                "mimi_encode_ms": self.timers["encode"].take_ms(), "prefill_ms": span_ms(prepared_at, stepped_at),
                "engine_step_ms": self.engine.last_timing.prefill_ms, "depth_ms": self.timers["depth"].take_ms(),
                "mimi_decode_ms": self.timers["decode"].take_ms(), "heads_ms": span_ms(stepped_at, done_at),
                "audio_bytes": spoken[0]}


# ============================================================================================ the models
@dataclass(frozen=True)
class ModelBench:
    """One model's benchmark: its arm, its shapes, its defaults and how its raw results are laid out."""

    arm: type
    title: str
    shapes: dict
    per_tick: str                        # what one tick decodes, for the table's heading
    defaults: dict                       # option defaults at the real shape
    smoke: dict = field(default_factory=dict)   # what --smoke changes (explicit flags still win)
    rows_key: str = "rows"               # the JSON list of per-N rows
    prefix: str = ""                     # prefix of the per-N medians in the JSON ("median_")


COMMON = dict(ticks=3, decode=25, sinks=16, window=1024, stop_factor=1.5)
MODELS = {
    "qwen2_5_omni": ModelBench(
        Qwen25OmniArm, "Qwen2.5-Omni-7B thinker", QWEN2_5_OMNI, "{decode} decode tokens per tick",
        {**COMMON, "sessions": "8,16,32,64,96,128,160,192,256", "budget_ms": 2000.0},
        smoke=dict(sinks=4, window=64, decode=3, ticks=1)),
    "qwen3_omni": ModelBench(
        Qwen3OmniArm, "Qwen3-Omni-30B-A3B thinker + audio encoder", QWEN3_OMNI, "{decode} decode tokens per tick",
        {**COMMON, "sessions": "8,16,24,32,48,64,96,128,256", "ticks": 2, "budget_ms": 2000.0,
         "stop_factor": math.inf, "compare_sessions": "16,64", "layer_tokens": "16,64,256,1024,4096"},
        smoke=dict(window=64, decode=2, ticks=1, compare_sessions="2", layer_tokens="4,16"),
        rows_key="sweep", prefix="median_"),
    "minicpm_o": ModelBench(
        MiniCpmOArm, "MiniCPM-o 4.5 (Qwen3-8B + Whisper-medium)", MINICPM_O, "{decode} decode tokens per tick",
        {**COMMON, "sessions": "16,32,64,96,128,160,192,256,320", "budget_ms": 1000.0, "stop_factor": 2.0},
        smoke=dict(sinks=4, window=32, decode=2, ticks=1), rows_key="sweep"),
    "moshi": ModelBench(
        MoshiArm, "Moshi 7B (temporal + depth + Mimi)", MOSHI, "one frame per tick",
        {**COMMON, "sessions": "1,4,8,16,24,32,40,48,56,64", "ticks": 5, "budget_ms": 80.0, "window": 2048,
         "decode": None},
        smoke=dict(sinks=4, window=64, ticks=1)),
}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse(argv=None) -> argparse.Namespace:
    def per_model(key: str) -> str:
        return "; ".join(f"{name} {m.defaults[key]}" for name, m in MODELS.items() if key in m.defaults)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=type(
        "Formatter", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {}))
    p.add_argument("--model", required=True, choices=sorted(MODELS), help="the model to run (required)")
    p.add_argument("--shape", default=argparse.SUPPRESS,
                   help="the model's real shape or 'smoke'; default: the real one (" +
                        ", ".join(next(iter(m.shapes)) for m in MODELS.values()) + ")")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shape in float32, on the CPU unless --device says otherwise: checks the code path")
    p.add_argument("--device", default=argparse.SUPPRESS, help="cpu or cuda; default cuda, cpu with --smoke")
    p.add_argument("--sessions", default=argparse.SUPPRESS, help=f"the N sweep; default {per_model('sessions')}; smoke 1,2")
    p.add_argument("--ticks", type=int, default=argparse.SUPPRESS, help=f"measured ticks per N; default {per_model('ticks')}")
    p.add_argument("--decode", type=int, default=argparse.SUPPRESS, help="decode tokens per session per tick; default 25 (Moshi: none, one frame)")
    p.add_argument("--budget-ms", type=float, default=argparse.SUPPRESS, help=f"tick budget B; default {per_model('budget_ms')}")
    p.add_argument("--sinks", type=int, default=argparse.SUPPRESS, help="SinkWindow sinks S (default 16)")
    p.add_argument("--window", type=int, default=argparse.SUPPRESS,
                   help="SinkWindow window W; default 1024, Moshi 2048 (S + W + W/4 + chunk + 1 must fit its 3000 "
                        "positions)")
    p.add_argument("--stop-factor", type=float, default=argparse.SUPPRESS,
                   help=f"stop the sweep once a tick exceeds this x 0.3·B; default {per_model('stop_factor')}")
    p.add_argument("--no-graphs", action="store_true", help="eager decode rounds (no CUDA graphs)")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="the decoder's and the audio tower's weights: fp8 (E4M3, quantised at load; the tower's as "
                        "metronome/audio/omni/tower_fp8.py says) or bf16 when not given")
    p.add_argument("--bf16-tower", action="store_true",
                   help="with --quantization fp8: keep the audio tower's weights unquantised (to compare)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="the KV pool's element type")
    p.add_argument("--compare-sessions", default=argparse.SUPPRESS,
                   help="qwen3_omni: N for eager whole ticks, per-expert loop vs grouped GEMM ('' skips); "
                        "default 16,64, smoke 2")
    p.add_argument("--layer-tokens", default=argparse.SUPPRESS,
                   help="qwen3_omni: T for the one-layer expert-path timing ('' skips); "
                        "default 16,64,256,1024,4096, smoke 4,16")
    p.add_argument("--tune-moe", action="store_true", help="qwen3_omni: only sweep the grouped GEMM's tiles")
    p.add_argument("--tune-tokens", default="16,64,256,1024,4096,16384", help="qwen3_omni: T for --tune-moe")
    p.add_argument("--profile", default="",
                   help="N at which to profile --ticks more ticks (comma list): device time per kernel family")
    p.add_argument("--out", default=argparse.SUPPRESS, help="raw JSON; default $OUT/models_<model>.json (OUT=./out)")
    args = p.parse_args(argv)
    bench = MODELS[args.model]
    args.shape = "smoke" if args.smoke else getattr(args, "shape", next(iter(bench.shapes)))
    if args.shape not in bench.shapes:
        p.error(f"--shape for {args.model}: one of {sorted(bench.shapes)}")
    args.smoke = args.shape == "smoke"
    if args.tune_moe and args.model != "qwen3_omni":
        p.error("--tune-moe is for --model qwen3_omni")
    chosen = {"device": None, "out": None, "compare_sessions": "", "layer_tokens": "", **bench.defaults,
              **(dict(bench.smoke, sessions="1,2", stop_factor=math.inf) if args.smoke else {})}
    for key, value in chosen.items():
        if not hasattr(args, key):
            setattr(args, key, value)
    args.session_list = ints(args.sessions)
    args.profile_list = ints(args.profile) if args.profile else []
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.dtype = "float32" if args.smoke else "bfloat16"
    args.torch_dtype = getattr(torch, args.dtype)
    args.chunk, args.batch_tokens = (64, 512) if args.smoke else (256, 16384)
    args.num_blocks = 64 * max(args.session_list + [1])   # the KV pool off CUDA (on CUDA: from free memory)
    args.out = args.out or str(Path(os.environ.get("OUT", "out")) / f"models_{args.model}.json")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/models_gpu.py needs a CUDA device (or --smoke)")
    without_soxr()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.tune_moe:
        results = tune_moe(args)
        tiles = out.with_name("moe_tiles_qwen3_omni.json")
        tiles.write_text(json.dumps(results, indent=1))
        print(f"wrote {tiles}")
        return results
    bench, device = MODELS[args.model], torch.device(args.device)
    started = time.perf_counter()
    arm = bench.arm(args, device)
    print(f"{args.shape} built with random weights in {time.perf_counter() - started:.1f} s", flush=True)
    results = {"model": args.model, "title": bench.title, "shape": args.shape, "smoke": args.smoke,
               "config": bench.shapes[args.shape], "args": {k: v for k, v in vars(args).items() if k != "torch_dtype"},
               "budget_ms": args.budget_ms, "limit_ms": 0.3 * args.budget_ms, "decode_tokens": args.decode,
               "policy": {"sinks": args.sinks, "window": args.window},
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "platform": platform.platform(), "date": time.strftime("%Y-%m-%d"),
               bench.rows_key: []}
    arm.before(results)
    sweep(arm, bench, args, results)
    arm.after(results)
    arm.close()
    results["total_s"] = time.perf_counter() - started
    print_table(arm, bench, results)
    if hasattr(arm, "report"):
        arm.report(results)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"raw results: {out}")
    return results


if __name__ == "__main__":
    main()
