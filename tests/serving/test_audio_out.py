"""Adapters with their own output heads: hidden states reach ``on_hidden``; audio they speak reaches the
client as ``response.output_audio.delta`` (the path Moshi uses), over real gRPC and WebSockets."""

from __future__ import annotations

import base64

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
