"""Host cost of the worker's audio front end for one tick (what a Step reports as ``frontend_ms``).

Per session, the tick's PCM16 as the gateway sends it (2 s at 16 kHz) is read from the request, decoded,
level-checked and, at another rate, resampled; then the energy adapter turns the batch into tokens. Through
the gateway on an H200 this took 56 ms of a 626-ms tick at 272 sessions (docs/experiments/
admission-gpu-short). Host-only, with the packaged SmolLM2's tokenizer and a CPU engine behind the adapter:

    PYTHONPATH=. python bench/frontend_host.py --sessions 272 --out results/frontend_host.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.host_timing import mean_ms
from metronome import Engine, EngineConfig, KVPolicy
from metronome.audio.pcm import encode_pcm16
from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.worker import WorkerConfig, WorkerService, make_adapter


def speech_like(rng: np.random.Generator, samples: int) -> np.ndarray:
    """Noise under a loudness envelope that changes every 25 ms (what the energy adapter buckets)."""
    envelope = np.repeat(10 ** rng.uniform(-3.5, 0, samples // 400 + 1), 400)[:samples]
    return (rng.standard_normal(samples) * envelope * 0.3).clip(-1, 1).astype(np.float32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=272)
    p.add_argument("--seconds", type=float, default=2.0, help="audio per session per tick (B)")
    p.add_argument("--sample-rate", type=int, default=16000)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    config = WorkerConfig(EngineConfig(policy=KVPolicy(sinks=4, window=256), num_blocks=args.sessions * 40 + 64),
                          adapter="energy", budget_ms=args.seconds * 1e3, port=0)
    engine = Engine(config.engine)
    service = WorkerService(engine, make_adapter(config, engine), config, ThreadPoolExecutor(1))
    rng = np.random.default_rng(0)
    request = pb.StepRequest(tick=1, tokens_per_tick=25)
    for i in range(args.sessions):
        opened = service._open(pb.OpenSessionRequest(sid=f"s{i}", mode="free_running"))
        if not opened.ok:
            raise SystemExit(f"session {i} refused: {opened.error}")
        request.sessions.add(sid=f"s{i}", sample_rate=args.sample_rate,
                             audio_pcm16=encode_pcm16(speech_like(rng, int(args.seconds * args.sample_rate))))

    def front_end() -> None:   # WorkerService._step up to frontend_ms
        outputs = [pb.SessionOutput(sid=inp.sid) for inp in request.sessions]
        ticks = [service._tick_audio(inp, request.tokens_per_tick, out) for inp, out in zip(request.sessions, outputs)]
        service.adapter.prepare(ticks)

    ms = mean_ms(front_end, args.repeats)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    per_session_us = ms / args.sessions * 1e3
    print(f"| sessions | audio per session | front end per tick | per session |\n|---|---|---|---|\n"
          f"| {args.sessions} | {args.seconds:g} s at {args.sample_rate} Hz | {ms:.1f} ms | {per_session_us:.0f} µs |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "front_end_ms": ms, "commit": commit, "machine": platform.platform(),
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, f, indent=1)


if __name__ == "__main__":
    main()
