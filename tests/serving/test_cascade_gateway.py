"""Talking to the default model end to end: espeak-ng speech in 20 ms chunks → gateway → worker (cascade
adapter: Silero VAD, Whisper tiny.en, SmolLM2-135M-Instruct) → transcription events and a streamed answer."""

from __future__ import annotations

import asyncio
import base64
import json
from contextlib import asynccontextmanager

import aiohttp
import numpy as np
import pytest
import pytest_asyncio

from metronome.config import EngineConfig, GatewayConfig, KVPolicy
from metronome.serving.gateway import serve_gateway
from metronome.serving.worker import WorkerConfig, serve_worker
from tests.audio.speech import silence, synth, trim

# One worker (one SmolLM2 + VAD + Whisper load) for the module, so the module shares one event loop.
pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

BUDGET_MS = 500.0
TOKENS_PER_TICK = 8


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cascade_worker():
    engine = EngineConfig(model="smollm2-135m", policy=KVPolicy(sinks=16, window=256, block_size=16), num_blocks=200)
    config = WorkerConfig(engine, adapter="cascade", budget_ms=BUDGET_MS, port=0)
    assert WorkerConfig().adapter == "cascade"          # the default worker serves the speech assistant
    handle = await serve_worker(config)
    yield handle
    await handle.stop()


@asynccontextmanager
async def gateway_for(worker):
    config = GatewayConfig(workers=(worker.address,), port=0, budget_ms=BUDGET_MS, tokens_per_tick=TOKENS_PER_TICK)
    server = await serve_gateway(config)
    try:
        async with aiohttp.ClientSession() as http, http.ws_connect(server.url) as ws:
            yield ws
    finally:
        await server.stop()


def pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes()


class Events:
    """Reads the socket in the background so that sending (paced in real time) never blocks on it."""

    def __init__(self, ws):
        self.ws, self.seen = ws, []
        self.task = asyncio.ensure_future(self._read())

    async def _read(self):
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            self.seen.append(json.loads(msg.data))

    async def wait(self, predicate, timeout=30.0):
        async with asyncio.timeout(timeout):
            while not any(predicate(e) for e in self.seen):
                await asyncio.sleep(0.02)

    def of(self, kind):
        return [e for e in self.seen if e["type"] == kind]

    def close(self):
        self.task.cancel()


async def stream(ws, samples: np.ndarray, rate: int, ms: int = 20):
    """``samples`` (float32 at ``rate``) as PCM16 in ``ms`` chunks, paced at real time."""
    data, step = pcm16(samples), rate * 2 * ms // 1000
    loop = asyncio.get_running_loop()
    start = loop.time()
    for k, i in enumerate(range(0, len(data), step)):
        await ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(data[i:i + step]).decode()})
        await asyncio.sleep(max(0.0, start + (k + 1) * ms / 1000 - loop.time()))


def spoken(text: str, rate: int) -> np.ndarray:
    return np.concatenate([silence(0.3, rate), trim(synth(text, rate)), silence(0.8, rate)])


async def ask(ws, events: Events, text: str, rate: int) -> tuple[str, str]:
    """Speak ``text``; return (what the server heard, the answer) once the response is done."""
    done_before = len(events.of("response.done"))
    heard_before = len(events.of("conversation.item.input_audio_transcription.completed"))
    await stream(ws, spoken(text, rate), rate)
    await events.wait(lambda e: len([x for x in events.seen if x["type"] == "response.done"]) > done_before)
    heard = events.of("conversation.item.input_audio_transcription.completed")[heard_before:]
    done = events.of("response.done")[-1]
    rid = done["response"]["id"]
    answer = "".join(e["delta"] for e in events.of("response.output_text.delta") if e["response_id"] == rid)
    assert done["response"]["status"] == "completed", done
    return " ".join(h["transcript"] for h in heard), answer


async def test_spoken_questions_get_spoken_answers(cascade_worker):
    async with gateway_for(cascade_worker) as ws:
        events = Events(ws)
        try:
            await events.wait(lambda e: e["type"] == "session.created")
            for question, expected in [("What is the capital of France?", "Paris"),
                                       ("What is the capital of Germany?", "Berlin")]:
                heard, answer = await ask(ws, events, question, 24000)   # the default rate: never named
                assert "capital" in heard.lower(), heard
                assert expected in answer, (heard, answer)
            deltas = events.of("conversation.item.input_audio_transcription.delta")
            completed = events.of("conversation.item.input_audio_transcription.completed")
            assert len(deltas) == len(completed) == 2
            assert [d["item_id"] for d in deltas] == [c["item_id"] for c in completed]
            assert all(d["delta"] == c["transcript"] for d, c in zip(deltas, completed))
            assert len(events.of("response.created")) == 2
        finally:
            events.close()


@pytest.mark.parametrize("rate", [8000, 48000])
async def test_other_client_sample_rates(cascade_worker, rate):
    async with gateway_for(cascade_worker) as ws:
        events = Events(ws)
        try:
            await ws.send_json({"type": "session.update", "session": {"input_audio_sample_rate": rate}})
            await events.wait(lambda e: e["type"] == "session.updated")
            assert events.of("session.updated")[0]["session"]["input_audio_sample_rate"] == rate
            heard, answer = await ask(ws, events, "What is the capital of Japan?", rate)
            assert "Japan" in heard and "Tokyo" in answer, (heard, answer)
        finally:
            events.close()


async def test_a_session_that_only_sends_silence_and_noise_gets_ticks_and_nothing_else(cascade_worker):
    async with gateway_for(cascade_worker) as ws:
        events = Events(ws)
        try:
            rng = np.random.default_rng(0)
            audio = np.concatenate([silence(1.0, 24000), (rng.standard_normal(24000) * 0.003).astype(np.float32)])
            await stream(ws, audio, 24000)
            await ws.send_json({"type": "input_audio_buffer.commit"})   # nothing was said: nothing to answer
            await events.wait(lambda e: e["type"] == "input_audio_buffer.committed")
            ticks = len(events.of("metronome.tick"))
            await events.wait(lambda e: len(events.of("metronome.tick")) >= ticks + 3, timeout=10)
            kinds = {e["type"] for e in events.seen}
            assert "error" not in kinds, events.of("error")
            assert not kinds & {"response.created", "response.output_text.delta",
                                "conversation.item.input_audio_transcription.delta"}, kinds
        finally:
            events.close()


async def test_five_questions_from_one_user_leave_room_for_a_second(cascade_worker):
    """One user asks five questions in a row, then a second user connects and is admitted. The ticks that
    prefill a question overrun the latency target even at one session; a cost that does not grow with the
    number of sessions is not load, so the worker's own admission (the default) keeps its cap above one."""
    config = GatewayConfig(workers=(cascade_worker.address,), port=0, budget_ms=BUDGET_MS,
                           tokens_per_tick=TOKENS_PER_TICK)
    server = await serve_gateway(config)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(server.url) as first:
                events = Events(first)
                try:
                    await events.wait(lambda e: e["type"] == "session.created")
                    for city in ("France", "Germany", "Japan", "France", "Germany"):
                        heard, _ = await ask(first, events, f"What is the capital of {city}?", 24000)
                        assert "capital" in heard.lower(), heard
                    async with http.ws_connect(server.url) as second:
                        hello = await second.receive_json(timeout=30)
                        assert hello["type"] == "session.created", hello
                finally:
                    events.close()
    finally:
        await server.stop()
