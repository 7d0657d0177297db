"""``metronome demo``: several users talk to the model at once, one tick per frame period.

Each tick every session's new input is prefilled and a few tokens are decoded for all of them in
shared rounds; answers stream out tick by tick. After answering, the sessions keep decoding
free-running (full duplex: the model hears itself), and the KV they hold stays flat once the
window is full: that is the bounded state Metronome is about.

``metronome demo --speech`` talks instead: it starts a worker with the speech assistant (Silero VAD →
Whisper tiny.en → SmolLM2, the ``cascade`` adapter) and the WebSocket gateway in this process, streams
the bundled spoken questions (``metronome/audio/samples/*.wav``) through a real Realtime session in
20 ms chunks at real time (``--speed`` to go faster), and prints what was heard and what was said.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import time
import wave
from importlib import resources

from metronome import Engine, EngineConfig, KVPolicy, SamplingParams, StepInput
from metronome.cli.help import HelpFormatter
from metronome.cpu import ThreadPlan, startup_line, usable_cores

QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Germany?",
    "How many days are in a week?",
    "What is the capital of Japan?",
    "Name a primary color.",
    "What is the capital of the United Kingdom?",
]


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="concurrent sessions on the embedded default model (CPU)",
                       description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="packaged model name or HF checkpoint directory")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--quantization", default=None, choices=["fp8"], help="FP8 (E4M3) decoder and audio tower weights")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="fp8: E4M3 KV pages")
    p.add_argument("--sessions", type=int, default=4, help="concurrent sessions")
    p.add_argument("--tokens-per-tick", type=int, default=8, help="decode tokens per session per tick")
    p.add_argument("--sinks", type=int, default=16, help="pinned attention-sink tokens S")
    p.add_argument("--window", type=int, default=128, help="KV window in tokens (small, so the plateau shows)")
    p.add_argument("--free-run-ticks", type=int, default=30, help="ticks of free-running decode after the answers")
    p.add_argument("--speech", action="store_true",
                   help="talk to the speech assistant: stream the bundled spoken questions through a served session")
    p.add_argument("--budget-ms", type=float, default=None,
                   help="--speech: frame budget B per tick (None: the speech adapter's own)")
    p.add_argument("--voice", default="auto", choices=["auto", "piper", "espeak", "none"],
                   help="--speech: spoken answers (auto: the packaged Piper voice, else espeak-ng's; none: text only)")
    p.add_argument("--speed", type=float, default=1.0, help="--speech: audio pacing (1 = real time, 0 = no pacing)")
    p.set_defaults(run=run)


def _prompt(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def run(args: argparse.Namespace) -> int:
    if args.sessions < 1 or args.tokens_per_tick < 1:
        raise SystemExit("--sessions and --tokens-per-tick must be >= 1")
    plan = ThreadPlan.for_box(usable_cores(), speech=args.speech)
    plan.apply_to_torch()
    print(startup_line(args.device, "auto", plan), flush=True)
    if args.speech:
        return asyncio.run(run_speech(args))
    print(f"loading {args.model} on {args.device} (the first run converts the packaged model once)...", flush=True)
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=args.model, device=args.device,
                                 policy=KVPolicy(sinks=args.sinks, window=args.window, block_size=16),
                                 num_blocks=None, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype))
    tok = engine.tokenizer
    stats = engine.stats()
    print(f"ready in {time.perf_counter() - t0:.1f}s: {stats.kv_blocks_total} KV blocks, "
          f"{stats.blocks_per_session} reserved per session, capacity {stats.capacity} sessions\n")

    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.sessions)]
    sids = [engine.open_session() for _ in questions]
    pending = {sid: _prompt(tok, q) for sid, q in zip(sids, questions)}
    answers = {sid: [] for sid in sids}
    done: set[int] = set()
    stop = SamplingParams(stop_token_ids=(tok.eos_token_id,))
    tick = 0
    print("tick  latency  batch  KV blocks  streamed")
    while len(done) < len(sids):
        tick += 1
        live = [s for s in sids if s not in done]
        start = time.perf_counter()
        outs = engine.step([StepInput(s, token_ids=pending.pop(s, None), max_new_tokens=args.tokens_per_tick,
                                      sampling=stop) for s in live])
        latency = (time.perf_counter() - start) * 1e3
        for out in outs:
            if out.error:
                print(f"  session {out.session_id}: error: {out.error}")
                done.add(out.session_id)
                continue
            answers[out.session_id].extend(out.token_ids)
            if out.finished:
                done.add(out.session_id)
        first = outs[0]
        preview = tok.decode(first.token_ids, skip_special_tokens=True).replace("\n", " ")
        print(f"{tick:4d} {latency:7.0f}ms {len(live):5d} {engine.stats().kv_blocks_used:10d}  "
              f"[{first.session_id}] {preview!r}")
    print()
    for sid, q in zip(sids, questions):
        print(f"[{sid}] Q: {q}\n    A: {tok.decode(answers[sid], skip_special_tokens=True).strip()}")

    if args.free_run_ticks:
        print(f"\nfree-running {args.free_run_ticks} ticks (window {args.window} tokens): KV per session stays bounded")
        print("tick  latency  tokens/session  KV blocks used")
        for t in range(args.free_run_ticks):
            start = time.perf_counter()
            engine.step([StepInput(s, max_new_tokens=args.tokens_per_tick) for s in sids])
            latency = (time.perf_counter() - start) * 1e3
            if t % 5 == 4 or t == args.free_run_ticks - 1:
                length = engine.scheduler.sessions[sids[0]].num_tokens
                print(f"{t + 1:4d} {latency:7.0f}ms {length:15d} {engine.stats().kv_blocks_used:15d}")
    for sid in sids:
        engine.close_session(sid)
    return 0


# ---------------------------------------------------------------------------------------------- speech
def sample_conversation() -> list[tuple[str, bytes, int]]:
    """The bundled spoken questions: (name, PCM16 mono bytes, sample rate), in order."""
    out = []
    for entry in sorted(resources.files("metronome.audio").joinpath("samples").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".wav"):
            with resources.as_file(entry) as path, wave.open(str(path), "rb") as w:
                if w.getsampwidth() != 2 or w.getnchannels() != 1:
                    raise SystemExit(f"{entry.name}: the samples must be 16-bit mono WAV")
                out.append((entry.name, w.readframes(w.getnframes()), w.getframerate()))
    if not out:
        raise SystemExit("no bundled samples found under metronome/audio/samples/")
    return out


async def run_speech(args: argparse.Namespace) -> int:
    import aiohttp

    from metronome.config import AimdConfig, GatewayConfig
    from metronome.serving.gateway import serve_gateway
    from metronome.serving.auth import new_token
    from metronome.serving.worker import WorkerConfig, serve_worker

    samples = sample_conversation()
    print(f"loading {args.model} + Silero VAD + Whisper tiny.en (the first run converts the packaged model once)...",
          flush=True)
    t0 = time.perf_counter()
    engine = EngineConfig(model=args.model, device=args.device,
                          policy=KVPolicy(sinks=args.sinks, window=args.window, block_size=16), num_blocks=None,
                          quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    token = new_token()   # only this demo's gateway may open sessions on its worker
    worker = await serve_worker(WorkerConfig(engine, budget_ms=args.budget_ms, adapter="cascade", port=0,
                                             voice=args.voice, auth_token=token))
    gateway = await serve_gateway(GatewayConfig(workers=(worker.address,), port=0, budget_ms=args.budget_ms,
                                                tokens_per_tick=args.tokens_per_tick, worker_token=token,
                                                aimd=AimdConfig(initial_cap=4, min_cap=1)))
    url = gateway.url
    budget_ms = worker.service.core.config.budget_ms
    print(f"ready in {time.perf_counter() - t0:.1f}s; one session at {url}, B = {budget_ms:g} ms\n", flush=True)
    ticks: list[dict] = []
    try:
        async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
            answered = asyncio.Event()
            answer: list[str] = []
            spoken = [0.0]     # seconds of the current answer's speech received

            async def read() -> None:
                async for msg in ws:
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        break
                    event = json.loads(msg.data)
                    kind = event["type"]
                    if kind == "conversation.item.input_audio_transcription.completed":
                        print(f"  heard: {event['transcript']}", flush=True)
                    elif kind == "response.output_text.delta":
                        if not answer:
                            print("  said:  ", end="", flush=True)
                        answer.append(event["delta"])
                        print(event["delta"], end="", flush=True)
                    elif kind == "response.output_audio.delta":
                        spoken[0] += len(base64.b64decode(event["delta"])) / 2 / event.get("sample_rate", 24000)
                    elif kind == "response.done":
                        print(flush=True)
                        if spoken[0]:
                            print(f"  spoke: {spoken[0]:.1f} s of audio", flush=True)
                        answer.clear()
                        spoken[0] = 0.0
                        answered.set()
                    elif kind == "metronome.tick":
                        ticks.append(event)
                    elif kind == "error":
                        print(f"  error: {event['error']['message']}", flush=True)

            reader = asyncio.create_task(read())
            session_rate = 0
            for name, pcm, rate in samples:
                print(f"> {name} ({len(pcm) / 2 / rate:.1f} s of speech at {rate} Hz)", flush=True)
                if rate != session_rate:   # the session's rate is 24 kHz unless it names another
                    await ws.send_json({"type": "session.update", "session": {
                        "type": "realtime", "audio": {"input": {"format": {"type": "audio/pcm", "rate": rate}}}}})
                    session_rate = rate
                answered.clear()
                silence = bytes(2 * rate)   # 1 s of silence after the question: the VAD ends the utterance
                await _stream(ws, pcm + silence, rate, args.speed)
                try:
                    await asyncio.wait_for(answered.wait(), timeout=60)
                except asyncio.TimeoutError:
                    print("  (no answer within 60 s)", flush=True)
            reader.cancel()
    finally:
        await gateway.stop()
        await worker.stop()
    if ticks:
        lat = sorted(t["latency_ms"] for t in ticks)
        missed = sum(not t["deadline_met"] for t in ticks)
        print(f"\n{len(ticks)} ticks: median {lat[len(lat) // 2]:.0f} ms, max {lat[-1]:.0f} ms of B = "
              f"{budget_ms:g} ms ({missed} deadline misses)")
    return 0


async def _stream(ws, pcm: bytes, rate: int, speed: float, ms: int = 20) -> None:
    step = rate * 2 * ms // 1000
    loop = asyncio.get_running_loop()
    start = loop.time()
    for k, i in enumerate(range(0, len(pcm), step)):
        await ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + step]).decode()})
        if speed > 0:
            await asyncio.sleep(max(0.0, start + (k + 1) * ms / 1000 / speed - loop.time()))
