"""Load generator: many WebSocket clients through the real gateway, plus a KV-usage sampler.

Each client connects at its open-loop arrival time (``i / rate`` after the start, whether or not
earlier clients got in), sends ``session.update {"mode": "free_running"}`` before any audio, then
streams PCM16 16 kHz in 20 ms ``input_audio_buffer.append`` chunks on an absolute schedule whose phase
is staggered across sessions (``(i · 20 ms / N) mod 20 ms``). A chunk more than 100 ms late is skipped
and counted, never sent in a burst. Every ``metronome.tick`` (latency_ms, deadline_met, batch,
preempted) and ``response.output_text.delta`` is recorded with its arrival time.

Audio (``audio=``, chosen by the preset): ``"speech"`` is real speech synthesised offline by espeak-ng
(``speech.speech_stream``: read-aloud paragraphs of a public-domain manual with spoken questions between
them, ~60 s looped; session i starts 0.74·i s into it); ``"noise"`` is seeded noise under a slowly
varying loudness envelope. The energy adapter (one token per 80 ms by loudness) makes the same number of
tokens from either. Times are ``time.monotonic()`` seconds since the first arrival (``t0_monotonic`` in
the result converts other processes' monotonic clocks).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np

RATE = 16000
CHUNK_MS = 20
LATE_SKIP_S = 0.1


def synth_audio(seconds: float, seed: int) -> bytes:
    """Noise with a loudness envelope changing every 80 ms (PCM16 little-endian, 16 kHz)."""
    rng = np.random.default_rng(seed)
    n = int(seconds * RATE)
    frames = -(-n // 1280)
    env = np.repeat(rng.uniform(0.01, 0.6, frames), 1280)[:n]
    pcm = rng.standard_normal(n) * env * 0.3
    return (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()


SPEECH_LOOP_S = 60.0
AUDIO_KINDS = ("speech", "noise")


def make_audio(kind: str, seed: int) -> bytes:
    """The PCM16 16 kHz stream the clients loop over: ``"speech"`` (espeak-ng) or ``"noise"``."""
    if kind == "noise":
        return synth_audio(8.0, seed)
    if kind == "speech":
        from metronome.audio.pcm import encode_pcm16

        from metronome.experiments.speech import cached_stream

        return encode_pcm16(cached_stream(SPEECH_LOOP_S, seed))
    raise ValueError(f"audio must be one of {AUDIO_KINDS}, got {kind!r}")


def append_messages(pcm: bytes) -> list[str]:
    """Pre-serialised ``input_audio_buffer.append`` events, one per 20 ms chunk."""
    step = RATE * 2 * CHUNK_MS // 1000
    return [json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + step]).decode()})
            for i in range(0, len(pcm) - step + 1, step)]


@dataclass
class SessionTrace:
    index: int
    arrival_s: float                     # scheduled (open loop)
    connected_s: float | None = None
    refused: str | None = None           # error type if the gateway refused or ended the session
    errors: list[str] = field(default_factory=list)
    chunks_sent: int = 0
    chunks_skipped: int = 0
    # one row per metronome.tick: [t_s, tick, latency_ms, deadline_met, batch, preempted, delta_chars,
    # engine_ms, frontend_ms, worker_ms] (the last three: the worker's share of latency_ms; absent in older raw
    # files, worker_ms in those before 2026-12-01 07:00 UTC)
    ticks: list[list] = field(default_factory=list)
    deltas: int = 0
    delta_chars: int = 0
    hold_s: float | None = None          # how long the client stays once connected (None: to the run's end)
    left_s: float | None = None          # when it closed its session itself (after hold_s)
    input_rate: int | None = None        # the input rate the server confirmed (session.updated)


@dataclass
class KVSample:
    t_s: float
    used: int
    total: int
    sessions: int


class LoadRun:
    def __init__(self, gateway: str, worker: str, sessions: int, rate: float, duration_s: float,
                 sample_s: float = 1.0, seed: int = 0, on_progress=None, audio: str = "noise") -> None:
        if audio not in AUDIO_KINDS:
            raise ValueError(f"audio must be one of {AUDIO_KINDS}, got {audio!r}")
        self.audio = audio
        self.gateway, self.worker = gateway, worker
        self.n, self.rate, self.duration_s, self.sample_s = sessions, rate, duration_s, sample_s
        self.seed = seed
        self.on_progress = on_progress
        self.traces = [SessionTrace(i, i / rate) for i in range(sessions)]
        self.kv: list[KVSample] = []
        self.t0 = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> dict:
        audio = append_messages(make_audio(self.audio, self.seed))
        self.t0 = time.monotonic() + 0.2
        self.end = self.duration_s
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        # limit=0: aiohttp's default pool holds 100 connections, and each client keeps its WebSocket open for
        # the whole run, so the 101st session would wait for a slot that never frees.
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            sampler = asyncio.create_task(self._sample())
            progress = asyncio.create_task(self._progress())
            await asyncio.gather(*(self._client(http, tr, audio) for tr in self.traces))
            sampler.cancel()
            progress.cancel()
            await asyncio.gather(sampler, progress, return_exceptions=True)
        return {"sessions": [asdict(t) for t in self.traces], "kv": [asdict(s) for s in self.kv],
                "audio": self.audio, "t0_monotonic": self.t0}

    async def _client(self, http: aiohttp.ClientSession, tr: SessionTrace, audio: list[str]) -> None:
        await asyncio.sleep(max(0.0, tr.arrival_s - self.now()))
        try:
            ws = await http.ws_connect(f"ws://{self.gateway}/v1/realtime", max_msg_size=0, heartbeat=None)
        except Exception as exc:                 # noqa: BLE001 - recorded, the run goes on
            tr.refused = f"connect: {exc!r}"
            return
        async with ws:
            msg = await ws.receive()
            if msg.type == aiohttp.WSMsgType.BINARY:   # the refusal (server_overloaded) comes as a binary frame
                try:
                    first = json.loads(msg.data)
                except ValueError:
                    tr.refused = "closed before session.created: BINARY"
                    return
            elif msg.type != aiohttp.WSMsgType.TEXT:
                tr.refused = f"closed before session.created: {msg.type.name}"
                return
            else:
                first = json.loads(msg.data)
            if first.get("type") != "session.created":
                tr.refused = first.get("error", {}).get("type", first.get("type"))
                return
            tr.connected_s = self.now()
            # The rate is stated: a session that names none is read at the Realtime API's 24 kHz.
            await ws.send_json({"type": "session.update", "session": {
                "mode": "free_running", "audio": {"input": {"format": {"type": "audio/pcm", "rate": RATE}}}}})
            reader = asyncio.create_task(self._read(ws, tr))
            phase = (tr.index * CHUNK_MS / max(1, self.n)) % CHUNK_MS / 1000.0
            start = self.now() + phase
            k = 0
            offset = tr.index * 37                # sessions start at different points of the audio
            end = self.end if tr.hold_s is None else min(self.end, tr.connected_s + tr.hold_s)
            try:
                while True:
                    due = start + k * CHUNK_MS / 1000.0
                    if due >= end or reader.done():
                        break
                    delay = due - self.now()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    elif -delay > LATE_SKIP_S:
                        tr.chunks_skipped += 1
                        k += 1
                        continue
                    await ws.send_str(audio[(offset + k) % len(audio)])
                    tr.chunks_sent += 1
                    k += 1
                await asyncio.sleep(max(0.0, end - self.now()))
                if end < self.end:
                    tr.left_s = self.now()        # the call is over: leaving frees its place (async with closes)
            except (ConnectionResetError, aiohttp.ClientError) as exc:
                tr.errors.append(repr(exc))
            finally:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, ws, tr: SessionTrace) -> None:
        pending_chars = 0
        async for msg in ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            event = json.loads(msg.data)
            kind = event.get("type")
            if kind == "metronome.tick":
                tr.ticks.append([round(self.now(), 4), event["tick"], event["latency_ms"], event["deadline_met"],
                                 event["batch"], bool(event.get("preempted")), pending_chars,
                                 event.get("engine_ms"), event.get("frontend_ms"), event.get("worker_ms")])
                pending_chars = 0
            elif kind == "session.updated":
                tr.input_rate = event["session"]["audio"]["input"]["format"]["rate"]
            elif kind == "response.output_text.delta":
                tr.deltas += 1
                tr.delta_chars += len(event.get("delta", ""))
                pending_chars += len(event.get("delta", "")) or 1   # a delta with tokens but no printable text
            elif kind == "error":
                tr.errors.append(event.get("error", {}).get("code", "error"))

    async def _sample(self) -> None:
        import grpc

        from metronome.serving.proto import worker_pb2 as pb
        from metronome.serving.proto import worker_pb2_grpc

        async with grpc.aio.insecure_channel(self.worker) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            k = 0
            while True:
                await asyncio.sleep(max(0.0, k * self.sample_s - self.now()))
                try:
                    h = await stub.Health(pb.HealthRequest(), timeout=5)
                    self.kv.append(KVSample(round(self.now(), 4), h.kv_blocks_used, h.kv_blocks_total, h.sessions))
                except grpc.aio.AioRpcError:
                    pass
                k += 1

    async def _progress(self) -> None:
        while self.on_progress is not None:
            await asyncio.sleep(1.0)
            recent = [row[2] for tr in self.traces for row in tr.ticks[-4:]]
            kv = self.kv[-1] if self.kv else None
            self.on_progress({"t": f"{self.now():.0f}/{self.duration_s:.0f}s",
                              "p50_ms": f"{np.median(recent):.0f}" if recent else "-",
                              "kv": f"{kv.used / max(1, kv.total):.0%}" if kv else "-",
                              "pre": sum(row[5] for tr in self.traces for row in tr.ticks[-4:])})


def run_load(**kwargs) -> dict:
    return asyncio.run(LoadRun(**kwargs).run())
