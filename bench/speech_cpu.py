"""Per-tick cost of the speech assistant on this CPU: VAD + ASR + LLM for N cascade sessions.

    python bench/speech_cpu.py --scenario worst 1 2 4 8        # the arguments are the session counts
    python bench/speech_cpu.py --scenario staggered 1 2 4 8

Figures: docs/benchmarks/cpu.md (speech assistant).

The cascade adapter and the engine are ticked directly (no sockets, no real-time pacing), B = 2 s: per
tick, every session's 2 s of audio goes through the streaming VAD, the utterances that ended in the tick
(of all sessions) through one Whisper call, then one engine step (SmolLM2-135M, S = 16, W = 1024)
prefills the user turns and decodes up to 8 answer tokens. Speech: espeak-ng (en-us, 135 words a minute)
asking "What is the capital of France / Germany / Japan?". Scenarios:

* worst: every session asks at the same moment, so all utterances end in the same tick and Whisper
  transcribes N of them in one batch, then the engine prefills N user turns; ~10 s of audio.
* staggered: every session asks every 10 s, sessions offset by whole ticks, so at most ⌈N/4⌉
  utterances end in one tick; 30 s of audio.

Per N: the busiest tick's utterances, VAD ms per tick (mean), ASR and LLM ms (worst tick), worst and
mean tick, ticks over B, compute per second of audio per session, and the answers that contain the
expected city. A table goes to stdout and every tick to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

B_S, TOKENS, RATE = 2.0, 8, 16000
QUESTIONS = (("What is the capital of France?", "Paris"), ("What is the capital of Germany?", "Berlin"),
             ("What is the capital of Japan?", "Tokyo"))
SCENARIOS = {"worst": 1200, "staggered": 2400}   # KV pool blocks
CYCLE_S, CYCLES = 10.0, 3   # staggered: a question every CYCLE_S seconds, CYCLES times


def trim(samples: np.ndarray, threshold: float = 1e-3) -> np.ndarray:
    """``samples`` without leading and trailing near-silence (espeak-ng pads its output a little)."""
    idx = np.flatnonzero(np.abs(samples) > threshold)
    return samples[idx[0]: idx[-1] + 1] if idx.size else samples[:0]


def questions() -> list[np.ndarray]:
    from metronome.experiments.speech import espeak

    return [trim(espeak(text, RATE, words_per_minute=135)) for text, _ in QUESTIONS]


def session_audio(scenario: str, i: int, speech: list[np.ndarray]) -> np.ndarray:
    """Session ``i``'s whole audio: its question (every CYCLE_S, offset by i % 4 ticks, when staggered)."""
    from metronome.experiments.speech import silence

    q = speech[i % len(speech)]
    if scenario == "worst":
        return np.concatenate([silence(0.3), q, silence(1.7 + 6.0)])
    cycle = np.zeros(int(CYCLE_S * RATE), np.float32)
    offset = int((i % 4) * B_S * RATE) + RATE // 4
    cycle[offset:offset + len(q)] = q
    return np.tile(cycle, CYCLES)


def run_n(engine, adapter, scenario: str, n: int, speech: list[np.ndarray]) -> dict:
    from metronome import SamplingParams, StepInput
    from metronome.audio.adapter import TickAudio

    names = [f"{scenario}{n}_{i}" for i in range(n)]
    ids = {s: engine.open_session() for s in names}
    for s in names:
        adapter.open_session(s, "turn", "")
    audio = {s: session_audio(scenario, i, speech) for i, s in enumerate(names)}
    said = {s: "" for s in names}
    step = int(B_S * RATE)
    ticks = []
    for k in range(0, len(audio[names[0]]), step):
        t0 = time.perf_counter()
        prepared = adapter.prepare([TickAudio(s, audio[s][k:k + step], max_tokens=TOKENS) for s in names])
        t1 = time.perf_counter()
        outs = engine.step([StepInput(ids[s], token_ids=p.token_ids, max_new_tokens=p.max_new_tokens,
                                      sampling=SamplingParams(stop_token_ids=p.stop_token_ids))
                            for s, p in zip(names, prepared)])
        for s, o in zip(names, outs):
            said[s] += adapter.on_output(s, list(o.token_ids), o.finished)
        t2 = time.perf_counter()
        timing = adapter.last_timing
        ticks.append({"utterances": timing.utterances, "vad_ms": timing.vad_ms, "asr_ms": timing.asr_ms,
                      "llm_ms": (t2 - t1) * 1e3, "tick_ms": (t2 - t0) * 1e3})
    for s in names:
        adapter.close_session(s)
        engine.close_session(ids[s])
    asked = CYCLES if scenario == "staggered" else 1
    expected = {s: QUESTIONS[i % len(QUESTIONS)][1] for i, s in enumerate(names)}
    answers = sum(min(asked, said[s].count(expected[s])) for s in names)
    tick_ms = [t["tick_ms"] for t in ticks]
    return {"N": n, "ticks": ticks, "busiest_tick_utterances": max(t["utterances"] for t in ticks),
            "vad_ms_mean": float(np.mean([t["vad_ms"] for t in ticks])),
            "asr_ms_max": max(t["asr_ms"] for t in ticks), "llm_ms_max": max(t["llm_ms"] for t in ticks),
            "tick_ms_max": max(tick_ms), "tick_ms_mean": float(np.mean(tick_ms)),
            "ticks_over_b": sum(t > B_S * 1e3 for t in tick_ms),
            "compute_per_audio": sum(tick_ms) / 1e3 / (len(audio[names[0]]) / RATE) / n,
            "answers": answers, "questions": asked * n, "replies": said}


def print_table(results: dict) -> None:
    print(f"\n{results['scenario']}: B = {B_S:g} s, {TOKENS} tokens a tick, SmolLM2-135M float32, "
          f"{results['torch_threads']} torch threads")
    print(f"{'N':>3} {'ticks':>6} {'utts':>5} {'VAD ms':>7} {'ASR ms':>7} {'LLM ms':>7} {'worst':>7} {'mean':>7} "
          f"{'over B':>7} {'compute/audio':>14} {'answers':>8}")
    for r in results["rows"]:
        print(f"{r['N']:>3} {len(r['ticks']):>6} {r['busiest_tick_utterances']:>5} {r['vad_ms_mean']:>7.1f} "
              f"{r['asr_ms_max']:>7.0f} {r['llm_ms_max']:>7.0f} {r['tick_ms_max']:>7.0f} {r['tick_ms_mean']:>7.0f} "
              f"{r['ticks_over_b']:>7} {r['compute_per_audio']:>14.3f} {r['answers']:>4}/{r['questions']:<3}")
    print("VAD: mean over ticks, all sessions; ASR, LLM: the worst tick's; worst / mean: tick ms.")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=type(
        "Formatter", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {}))
    p.add_argument("sessions", nargs="*", type=int, default=[1, 2, 4, 8], help="session counts N")
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="worst", help="when the sessions ask")
    p.add_argument("--out", default=argparse.SUPPRESS, help="raw JSON; default results/speech_cpu_<scenario>.json")
    args = p.parse_args(argv)
    from metronome import Engine, EngineConfig, KVPolicy
    from metronome.audio.cascade import CascadeAdapter

    out = Path(getattr(args, "out", f"results/speech_cpu_{args.scenario}.json"))
    speech = questions()
    results = {"benchmark": "speech_cpu", "scenario": args.scenario, "budget_ms": B_S * 1e3, "tokens": TOKENS,
               "torch_threads": torch.get_num_threads(), "cpus_usable": len(os.sched_getaffinity(0)),
               "platform": platform.platform(), "loadavg_start": list(os.getloadavg()),
               "date": time.strftime("%Y-%m-%d"), "rows": []}
    config = EngineConfig(model="smollm2-135m", policy=KVPolicy(sinks=16, window=1024),
                          num_blocks=SCENARIOS[args.scenario])
    with Engine(config) as engine:
        adapter = CascadeAdapter(engine.tokenizer)
        for n in args.sessions:
            row = run_n(engine, adapter, args.scenario, n, speech)
            results["rows"].append(row)
            print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                              if k not in ("ticks", "replies")}), flush=True)
    print_table(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"raw results: {out}")
    return results


if __name__ == "__main__":
    main()
