"""Spoken replies on this CPU: end of speech → first audio byte, for N voice sessions over real sockets.

    python bench/voice_cpu.py                       # N = 1, 8, 16, the cascade's default B
    python bench/voice_cpu.py 1 --budget-ms 250     # one session at another B

Figures: docs/benchmarks/cpu.md ("Voice assistant: end of speech to first audio").

Per N, fresh processes as a user runs them: ``python -m metronome serve`` (one worker with the cascade on the
packaged SmolLM2-135M, Whisper tiny.en, speech out on with the packaged Piper voice; gateway on loopback,
admission held open for N sessions) and N WebSocket clients in this process. Each client asks a spoken
question (``metronome/audio/samples/*.wav``, resampled to 24 kHz PCM16) every ``--cycle-s`` seconds, streamed
in real time in 20-ms chunks with silence between; the clients are staggered evenly over one cycle, and each
question starts after a random lead of up to B (so its end falls anywhere within a tick). One
warm-up question is asked (and not counted) before the clients start.

After its last question's cycle each client sends ``--tail-s`` more seconds of silence, so late answers still
count. Measured per question: the end of speech (known from the audio sent: the moment its last speech sample is
"spoken", at real-time pacing) → the first ``response.output_audio.delta`` of the response that answers it
(the first ``response.created`` after its transcript). Also every tick's latency (the worker's Step round
trip, from ``metronome.tick``) against B. Targets: median ≤ 1.0 s at N = 1, p95 ≤ 1.5 s at N = 8 and 16,
no tick over B. A table goes to stdout, everything raw (per question, per tick, load average) to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import wave
from pathlib import Path

import numpy as np

from metronome.audio.pcm import decode_pcm16, encode_pcm16, resample
from metronome.audio.registry import default_budget_ms
from metronome.cpu import auto_dtype

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "metronome" / "audio" / "samples"
RATE, CHUNK_MS = 24_000, 20
INSTRUCTIONS = "You are a helpful voice assistant. Answer in one short sentence."


def speech_clips() -> list[tuple[str, np.ndarray]]:
    """(name, 24 kHz float32 speech without leading/trailing near-silence) per packaged sample."""
    clips = []
    for path in sorted(SAMPLES.glob("*.wav")):
        with wave.open(str(path), "rb") as w:
            pcm = decode_pcm16(w.readframes(w.getnframes()))
            rate = w.getframerate()
        idx = np.flatnonzero(np.abs(pcm) > 1e-2)
        clips.append((path.stem, resample(pcm[idx[0]: idx[-1] + 1], rate, RATE)))
    return clips


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quantile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


class Client:
    """One session: streams its questions in real time and times each answer's first audio."""

    def __init__(self, index: int, url: str, clips, start: float, cycle_s: float, questions: int,
                 tail_s: float = 0.0, phase_s: float = 0.0) -> None:
        self.index, self.url, self.clips = index, url, clips
        self.start, self.cycle_s, self.questions, self.tail_s = start, cycle_s, questions, tail_s
        # Each question starts after a random lead in [0, phase_s): with phase_s = B its end of speech falls at
        # any point of a tick, not at the one phase that a cycle of whole ticks would repeat for every question.
        self.leads = np.random.default_rng(index + 1).uniform(0.0, phase_s, questions)
        self.asked: list[dict] = []          # per question: eos (monotonic), transcript, response id, first audio
        self.ticks: dict[int, dict] = {}
        self.errors: list[dict] = []
        self.statuses: list[str] = []
        self._awaiting: dict | None = None   # the question whose transcript came, waiting for its response

    async def run(self, http) -> None:
        async with http.ws_connect(self.url, max_msg_size=0) as ws:
            await self._expect(ws, "session.created")
            await ws.send_json({"type": "session.update", "session": {
                "instructions": INSTRUCTIONS, "audio": {"input": {"format": {"type": "audio/pcm", "rate": RATE}}}}})
            await self._expect(ws, "session.updated")
            reader = asyncio.ensure_future(self._read(ws))
            try:
                await self._stream(ws)
                await self._stream_silence(ws, self.tail_s)   # late answers still count
            finally:
                reader.cancel()

    async def _expect(self, ws, kind: str) -> None:
        while True:
            msg = await ws.receive(timeout=60)
            event = json.loads(msg.data)
            if event["type"] == kind:
                return
            if event["type"] == "error":
                raise RuntimeError(f"client {self.index}: {event}")

    async def _stream(self, ws) -> None:
        chunk = RATE * CHUNK_MS // 1000
        silence = encode_pcm16(np.zeros(chunk, np.float32))
        for q in range(self.questions):
            name, clip = self.clips[(self.index + q) % len(self.clips)]
            t0 = self.start + q * self.cycle_s
            spoken = np.concatenate([np.zeros(round(self.leads[q] * RATE), np.float32), clip])
            pieces = [spoken[i:i + chunk] for i in range(0, spoken.size, chunk)]
            record = {"session": self.index, "question": q, "clip": name, "speech_s": clip.size / RATE,
                      "eos": t0 + spoken.size / RATE, "transcript": None, "transcript_at": None, "response": None,
                      "first_audio": None, "first_text": None, "text": "", "status": None}
            self.asked.append(record)
            sent = 0
            end = t0 + self.cycle_s
            while True:   # a chunk goes out when it is complete, as from a microphone
                due = t0 + (sent + 1) * CHUNK_MS / 1000
                if due >= end:
                    break
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                pcm = encode_pcm16(np.pad(pieces[sent], (0, chunk - pieces[sent].size))) \
                    if sent < len(pieces) else silence
                await ws.send_str(json.dumps({"type": "input_audio_buffer.append",
                                              "audio": base64.b64encode(pcm).decode("ascii")}))
                sent += 1

    async def _stream_silence(self, ws, seconds: float) -> None:
        chunk = RATE * CHUNK_MS // 1000
        frame = json.dumps({"type": "input_audio_buffer.append",
                            "audio": base64.b64encode(encode_pcm16(np.zeros(chunk, np.float32))).decode("ascii")})
        t0 = time.monotonic()
        for k in range(int(seconds * 1000 / CHUNK_MS)):
            await asyncio.sleep(max(0.0, t0 + (k + 1) * CHUNK_MS / 1000 - time.monotonic()))
            await ws.send_str(frame)

    async def _read(self, ws) -> None:
        responses: dict[str, dict] = {}
        async for msg in ws:
            now = time.monotonic()
            event = json.loads(msg.data)
            kind = event["type"]
            if kind == "metronome.tick":
                self.ticks[event["tick"]] = {**{k: event[k] for k in ("latency_ms", "budget_ms", "deadline_met",
                                                                      "batch", "frontend_ms", "engine_ms")},
                                             "at": now}
            elif kind == "conversation.item.input_audio_transcription.completed":
                # A session's transcripts come in the order it asked, however late: the oldest question waiting.
                pending = [r for r in self.asked if r["transcript"] is None and r["eos"] <= now]
                if pending:
                    pending[0]["transcript"] = event["transcript"]
                    pending[0]["transcript_at"] = now
                    self._awaiting = pending[0]
            elif kind == "response.created" and self._awaiting is not None:
                self._awaiting["response"] = event["response"]["id"]
                responses[event["response"]["id"]] = self._awaiting
                self._awaiting = None
            elif kind == "response.output_text.delta" and event["response_id"] in responses:
                r = responses[event["response_id"]]
                r["text"] += event["delta"]
                r["first_text"] = r["first_text"] or now
            elif kind == "response.output_audio.delta" and event["response_id"] in responses:
                r = responses[event["response_id"]]
                r["first_audio"] = r["first_audio"] or now
            elif kind == "response.done":
                r = responses.get(event["response"]["id"])
                if r is not None:
                    r["status"] = event["response"]["status"]
            elif kind == "error":
                self.errors.append(event)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"metronome serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                health = json.loads(reply.read())
                if health.get("status") == "ok":
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("metronome serve did not become ready")


async def drive(url: str, n: int, args, clips) -> tuple[list[Client], Client]:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        warm = Client(-1, url, clips, time.monotonic() + 1.0, args.cycle_s, 1)
        await warm.run(http)
        start = time.monotonic() + 2.0
        clients = [Client(i, url, clips, start + i * args.cycle_s / n, args.cycle_s, args.questions, args.tail_s,
                          phase_s=args.budget_ms / 1000) for i in range(n)]
        await asyncio.gather(*(c.run(http) for c in clients))
    return clients, warm


def run_n(n: int, args, clips, logdir: Path) -> dict:
    port, worker_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "metronome", "--log-level", args.log_level, "serve", "--model", "smollm2-135m",
           "--voice", args.voice, "--port", str(port), "--worker-port", str(worker_port),
           "--budget-ms", str(args.budget_ms), "--dtype", args.dtype, "--tokens-per-tick", str(args.tokens_per_tick),
           "--initial-cap", str(n + 2), "--target", "1.0", "--idle-timeout-s", "0",
           "--cpu-attention", args.cpu_attention, "--cpu-linear", args.cpu_linear,
           "--cpu-elementwise", args.cpu_elementwise]
    log_path = logdir / f"voice_cpu_serve_{n}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            wait_ready(f"http://127.0.0.1:{port}/health", proc)
            load0 = os.getloadavg()
            clients, _ = asyncio.run(drive(f"ws://127.0.0.1:{port}/v1/realtime", n, args, clips))
            load1 = os.getloadavg()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    questions = [q for c in clients for q in c.asked]
    for q in questions:
        q["latency_s"] = q["first_audio"] - q["eos"] if q["first_audio"] else None
        q["text_latency_s"] = q["first_text"] - q["eos"] if q["first_text"] else None
    ticks: dict[int, dict] = {}
    for c in clients:
        ticks.update(c.ticks)
    lat = [q["latency_s"] for q in questions if q["latency_s"] is not None]
    tick_ms = [t["latency_ms"] for t in ticks.values()]
    return {"N": n, "questions": questions, "ticks": [{"tick": k, **v} for k, v in sorted(ticks.items())],
            "answered": len(lat), "asked": len(questions),
            "median_s": quantile(lat, 50), "p95_s": quantile(lat, 95), "max_s": max(lat, default=None),
            "text_median_s": quantile([q["text_latency_s"] for q in questions if q["text_latency_s"]], 50),
            "tick_ms_p50": quantile(tick_ms, 50), "tick_ms_max": max(tick_ms, default=None),
            "ticks_over_b": sum(t > args.budget_ms for t in tick_ms), "ticks_seen": len(tick_ms),
            "frontend_ms_max": max((t["frontend_ms"] for t in ticks.values()), default=None),
            "cancelled": sum(q["status"] == "cancelled" for q in questions),
            "errors": [e for c in clients for e in c.errors], "loadavg_start": load0, "loadavg_end": load1}


def print_table(results: dict) -> None:
    print(f"\nB = {results['budget_ms']:g} ms, {results['tokens_per_tick']} tokens a tick, a question every "
          f"{results['cycle_s']:g} s per session, voice {results['voice']}")
    print(f"{'N':>3} {'answered':>9} {'median s':>9} {'p95 s':>7} {'max s':>7} {'text p50':>9} {'tick p50':>9} "
          f"{'tick max':>9} {'over B':>7} {'load 1m':>12}")
    for r in results["rows"]:
        def f(v, nd=2):
            return f"{v:.{nd}f}" if v is not None else "-"
        print(f"{r['N']:>3} {r['answered']:>4}/{r['asked']:<4} {f(r['median_s']):>9} {f(r['p95_s']):>7} "
              f"{f(r['max_s']):>7} {f(r['text_median_s']):>9} {f(r['tick_ms_p50'], 0):>9} {f(r['tick_ms_max'], 0):>9} "
              f"{r['ticks_over_b']:>3}/{r['ticks_seen']:<3} {r['loadavg_start'][0]:>5.1f}-{r['loadavg_end'][0]:<5.1f}")
    print("median/p95/max: end of speech -> first audio byte; text p50: -> first text delta; tick: Step round trip ms")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=type(
        "Formatter", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {}))
    p.add_argument("sessions", nargs="*", type=int, default=[1, 8, 16], help="session counts N")
    p.add_argument("--budget-ms", type=float, default=None,
                   help="frame budget B [default: the cascade's on this engine, as metronome serve picks it]")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the worker's engine dtype (metronome serve --dtype)")
    p.add_argument("--tokens-per-tick", type=int, default=25,
                   help="decode tokens per session per tick the gateway asks (serve's default; the cascade caps it)")
    p.add_argument("--cycle-s", type=float, default=10.0, help="seconds between one session's questions")
    p.add_argument("--questions", type=int, default=6, help="questions per session")
    p.add_argument("--tail-s", type=float, default=10.0,
                   help="silence each client keeps sending after its last question's cycle, for late answers")
    p.add_argument("--voice", default="piper", choices=["piper", "espeak"], help="speech out")
    p.add_argument("--cpu-attention", default="auto", choices=["auto", "kernel", "sdpa"],
                   help="the worker's decode-round attention (metronome serve --cpu-attention)")
    p.add_argument("--cpu-linear", default="auto", choices=["auto", "packed", "kernel", "aten"],
                   help="the worker's products (metronome serve --cpu-linear)")
    p.add_argument("--cpu-elementwise", default="auto", choices=["auto", "kernel", "torch"],
                   help="the worker's norms, rotary embedding and activation (metronome serve --cpu-elementwise)")
    p.add_argument("--log-level", default="info", help="the server's (its log goes beside --out)")
    p.add_argument("--out", default="results/voice_cpu.json", help="raw JSON")
    args = p.parse_args(argv)
    if args.budget_ms is None:
        args.budget_ms = default_budget_ms("cascade", device="cpu", dtype=args.dtype)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clips = speech_clips()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    results = {"benchmark": "voice_cpu", "budget_ms": args.budget_ms, "dtype": args.dtype,
               "engine_dtype": auto_dtype("cpu") if args.dtype == "auto" else args.dtype,
               "tokens_per_tick": args.tokens_per_tick,
               "cycle_s": args.cycle_s, "questions_per_session": args.questions, "voice": args.voice,
               "cpu": cpu, "cpus_usable": len(os.sched_getaffinity(0)), "platform": platform.platform(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": []}
    for n in args.sessions:
        row = run_n(n, args, clips, out.parent)
        results["rows"].append(row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                          if k not in ("questions", "ticks", "errors")}), flush=True)
        out.write_text(json.dumps(results, indent=1))
    print_table(results)
    print(f"raw results: {out}")
    return results


if __name__ == "__main__":
    main()
