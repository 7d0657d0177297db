"""Adapters with their own output heads: hidden states reach ``on_hidden``; audio they speak reaches the
client as ``response.output_audio.delta`` (the path Moshi uses), over real gRPC and WebSockets."""

from __future__ import annotations

import asyncio
import base64
import itertools
import threading

import aiohttp
import numpy as np
import torch

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from metronome.audio.adapter import InteractionAdapter, PreparedInput, TickAudio
from metronome.serving.worker import WorkerConfig, serve_worker
from tests.serving.test_gateway import BUDGET_MS, chunks, of_type, recv_until, running_gateway, tone

PROMPT = [5, 9, 17]


class HiddenToAudio(InteractionAdapter):
    """Feeds PROMPT every tick and 'speaks' the first hidden features as PCM16 (x1000, clipped)."""

    name, sample_rate, modes, default_mode = "hidden-to-audio", 16000, ("free_running",), "free_running"
    output_sample_rate = 24000

    def __init__(self) -> None:
        self.audio: dict[str, bytes] = {}
        self.seen: list[tuple[str, torch.Tensor]] = []

    def open_session(self, session_id, mode, instructions):
        self.resolve_mode(mode)

    def close_session(self, session_id):
        self.audio.pop(session_id, None)

    def prepare(self, batch: list[TickAudio]) -> list[PreparedInput]:
        return [PreparedInput(token_ids=list(PROMPT), return_hidden=True) for _ in batch]

    def on_hidden(self, batch):
        for sid, hidden in batch:
            self.seen.append((sid, hidden))
            self.audio[sid] = pcm16(hidden)

    def on_output(self, session_id, token_ids, finished):
        return ""

    def take_audio(self, session_id):
        return self.audio.pop(session_id, b"")

    def input_tokens_per_tick(self, budget_ms):
        return len(PROMPT)


def pcm16(hidden: torch.Tensor) -> bytes:
    return (hidden[:32].float().numpy() * 1000).clip(-32768, 32767).astype("<i2").tobytes()


def engine_config(checkpoint: str) -> EngineConfig:
    return EngineConfig(model=checkpoint, policy=KVPolicy(sinks=4, window=64, block_size=8), num_blocks=200,
                        max_chunk_tokens=64)


async def test_hidden_states_become_audio_deltas(chat_checkpoint):
    engine = Engine(engine_config(chat_checkpoint))
    adapter = HiddenToAudio()
    worker = await serve_worker(WorkerConfig(engine_config(chat_checkpoint), budget_ms=BUDGET_MS, port=0),
                                engine=engine, adapter=adapter)
    # The oracle: the same tokens through a separate engine, asking for the hidden state directly.
    reference = Engine(engine_config(chat_checkpoint))
    sid = reference.open_session()
    want = reference.step([StepInput(sid, token_ids=PROMPT, return_hidden=True)])[0].hidden
    try:
        async with running_gateway([worker]) as (_, addr), aiohttp.ClientSession() as http:
            async with http.ws_connect(f"ws://{addr}/v1/realtime") as ws:
                await recv_until(ws, of_type("session.created"))
                for chunk in list(chunks(tone(0.1)))[:2]:
                    await ws.send_json({"type": "input_audio_buffer.append", "audio": chunk})
                events = await recv_until(ws, of_type("response.output_audio.delta"))
        delta = events[-1]
        assert delta["sample_rate"] == 24000
        assert base64.b64decode(delta["delta"]) == pcm16(want)
        assert any(e["type"] == "response.created" for e in events)
        first_sid, first_hidden = adapter.seen[0]
        assert first_hidden.shape == (engine.spec.hidden_size,)
        torch.testing.assert_close(first_hidden, want)
        assert np.frombuffer(base64.b64decode(delta["delta"]), "<i2").any()
    finally:
        await worker.stop()


class FailingHeads(HiddenToAudio):
    """Heads that raise: the sessions that asked for them get an error; a plain session is unaffected."""

    def prepare(self, batch):
        return [PreparedInput(token_ids=list(PROMPT), return_hidden=t.session_id.startswith("heads"))
                for t in batch]

    def on_hidden(self, batch):
        raise RuntimeError("depth transformer out of memory")


async def test_failing_adapter_heads_are_reported_on_their_sessions_only(chat_checkpoint):
    import grpc

    from metronome.serving.proto import worker_pb2 as pb
    from metronome.serving.proto import worker_pb2_grpc

    engine = Engine(engine_config(chat_checkpoint))
    worker = await serve_worker(WorkerConfig(engine_config(chat_checkpoint), budget_ms=BUDGET_MS, port=0),
                                engine=engine, adapter=FailingHeads())
    try:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            for sid in ("heads-1", "plain-1"):
                assert (await stub.OpenSession(pb.OpenSessionRequest(sid=sid))).ok
            response = await stub.Step(pb.StepRequest(tick=1, tokens_per_tick=2, sessions=[
                pb.SessionInput(sid="heads-1", sample_rate=16000), pb.SessionInput(sid="plain-1", sample_rate=16000)]))
        out = {o.sid: o for o in response.outputs}
        assert "output heads failed" in out["heads-1"].error and "out of memory" in out["heads-1"].error
        assert not out["plain-1"].error
    finally:
        await worker.stop()


class VouchedEmbeds(HiddenToAudio):
    """Embeddings of PROMPT; the "vouched" sessions say they are finite by construction."""

    def __init__(self, embed) -> None:
        super().__init__()
        self.embed = embed

    def prepare(self, batch):
        with torch.no_grad():
            embeds = self.embed(torch.tensor(PROMPT))
        return [PreparedInput(embeds=embeds, embeds_finite=t.session_id.startswith("vouched"), return_hidden=True)
                for t in batch]


async def test_the_worker_passes_on_an_adapters_word_that_its_embeds_are_finite(chat_checkpoint):
    import grpc

    from metronome.serving.proto import worker_pb2 as pb
    from metronome.serving.proto import worker_pb2_grpc

    engine = Engine(engine_config(chat_checkpoint))
    seen: list[StepInput] = []
    step = engine.step

    def spy(inputs):
        seen.extend(inputs)
        return step(inputs)

    engine.step = spy
    worker = await serve_worker(WorkerConfig(engine_config(chat_checkpoint), budget_ms=BUDGET_MS, port=0),
                                engine=engine, adapter=VouchedEmbeds(engine.model.embed))
    try:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            for sid in ("vouched-1", "plain-1"):
                assert (await stub.OpenSession(pb.OpenSessionRequest(sid=sid))).ok
            sessions = [pb.SessionInput(sid=sid, sample_rate=16000) for sid in ("vouched-1", "plain-1")]
            response = await stub.Step(pb.StepRequest(tick=1, tokens_per_tick=2, sessions=sessions))
        assert not any(o.error for o in response.outputs)
        assert sorted(inp.embeds_finite for inp in seen) == [False, True]
    finally:
        await worker.stop()


class SpeaksBetweenTicks(HiddenToAudio):
    """One answer token, then speech finished between ticks, as the cascade's synthesis thread finishes it: the
    audio is made ready on another thread once the answer's tick has handed out what it had. The tick after
    waits until the client has that audio (at most 30 s, then it notes that it waited out)."""

    name = "speaks-between-ticks"
    speaks_between_ticks = True

    def __init__(self) -> None:
        super().__init__()
        self.notify = None
        self.ticks = 0
        self.tick_took = threading.Event()
        self.client_has_audio = threading.Event()
        self.waited_out = False
        self.lock = threading.Lock()
        self.ready: dict[str, bytes] = {}
        self.speaking_sids: set[str] = set()

    def on_speech_ready(self, notify):
        self.notify = notify

    def prepare(self, batch):
        self.ticks += 1
        if self.ticks == 1:
            return [PreparedInput(token_ids=list(PROMPT), max_new_tokens=1, ends_response=True) for _ in batch]
        if self.ticks == 2:
            self.waited_out = not self.client_has_audio.wait(30)
        return [PreparedInput() for _ in batch]

    def on_output(self, session_id, token_ids, finished):
        if token_ids:   # the answer: its speech is made on another thread
            self.speaking_sids.add(session_id)
            threading.Thread(target=self._speak, args=(session_id,)).start()
        return "Hi." if token_ids else ""

    def _speak(self, session_id):
        self.tick_took.wait(30)
        with self.lock:
            self.ready[session_id] = b"\x01\x02" * 240
        self.notify()

    def take_spoken(self, session_id):
        with self.lock:
            audio = self.ready.pop(session_id, b"")
        self.tick_took.set()
        if audio:
            self.speaking_sids.discard(session_id)
        return audio, "Hi." if audio else ""

    def speaking(self, session_id):
        return session_id in self.speaking_sids


async def test_speech_finished_between_ticks_reaches_the_client_before_the_next_tick(chat_checkpoint):
    """The answer's audio, finished after its tick, reaches the client while the next tick waits for it (it
    does not wait for that tick); the answer then ends in one response, its audio before response.done."""
    engine = Engine(engine_config(chat_checkpoint))
    adapter = SpeaksBetweenTicks()
    worker = await serve_worker(WorkerConfig(engine_config(chat_checkpoint), budget_ms=BUDGET_MS, port=0),
                                engine=engine, adapter=adapter)
    try:
        async with running_gateway([worker]) as (_, addr), aiohttp.ClientSession() as http:
            async with http.ws_connect(f"ws://{addr}/v1/realtime") as ws:
                await recv_until(ws, of_type("session.created"))

                async def talk():   # audio keeps streaming, as a microphone's does
                    for chunk in itertools.cycle(chunks(tone(0.2))):
                        await ws.send_json({"type": "input_audio_buffer.append", "audio": chunk})
                        await asyncio.sleep(0.02)

                talking = asyncio.ensure_future(talk())
                try:
                    events = await recv_until(ws, of_type("response.output_audio.delta"), timeout=20)
                    adapter.client_has_audio.set()
                    events += await recv_until(ws, of_type("response.done"), timeout=20)
                finally:
                    talking.cancel()
        assert not adapter.waited_out
        kinds = [e["type"] for e in events if e["type"].startswith("response.")]
        assert kinds.count("response.created") == 1 and kinds.count("response.output_audio.delta") == 1
        assert kinds.index("response.output_text.delta") < kinds.index("response.output_audio.delta") \
            < kinds.index("response.done")
        delta = next(e for e in events if e["type"] == "response.output_audio.delta")
        assert base64.b64decode(delta["delta"]) == b"\x01\x02" * 240 and delta["sample_rate"] == 24000
        assert events[-1]["response"]["status"] == "completed"
    finally:
        await worker.stop()
