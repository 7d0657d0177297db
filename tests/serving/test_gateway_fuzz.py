"""Random event streams thrown at a live gateway (hypothesis): it stays up, and others keep ticking."""

from __future__ import annotations

import asyncio
import base64
import json
import threading

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from websockets.sync.client import connect

from metronome.config import EngineConfig, GatewayConfig, KVPolicy
from metronome.serving.gateway import serve_gateway
from metronome.serving.worker import WorkerConfig, serve_worker

BUDGET_MS = 100.0


class Stack:
    """Worker + gateway on their own event loop in a thread; tests talk to them over sockets only."""

    def __init__(self, checkpoint: str) -> None:
        self.checkpoint = checkpoint
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self.ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        engine = EngineConfig(model=self.checkpoint, num_blocks=600, max_chunk_tokens=64,
                              policy=KVPolicy(sinks=4, window=64, block_size=8))
        self.worker = await serve_worker(WorkerConfig(engine, budget_ms=BUDGET_MS, port=0))
        config = GatewayConfig(workers=(self.worker.address,), port=0, budget_ms=BUDGET_MS, tokens_per_tick=2,
                               max_message_bytes=8192)
        self.gateway = await serve_gateway(config)
        self.url = self.gateway.url

    async def _stop(self) -> None:
        await self.gateway.stop()
        await self.worker.stop()

    def __enter__(self) -> Stack:
        self.thread.start()
        assert self.ready.wait(120), "stack did not start"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def stack(chat_checkpoint):
    with Stack(chat_checkpoint) as s:
        yield s


def recv_until(ws, kind: str, timeout: float = 10.0) -> dict:
    while True:
        event = json.loads(ws.recv(timeout=timeout))
        if event["type"] == kind:
            return event


pcm = st.binary(max_size=400).map(lambda b: base64.b64encode(b).decode())
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                      max_size=3), max_leaves=8)
event_types = st.sampled_from(["session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                               "input_audio_buffer.clear", "conversation.item.create", "response.create",
                               "response.cancel", "nope", ""])
events = st.one_of(
    st.builds(lambda t, extra: json.dumps({"type": t, **extra}), event_types,
              st.dictionaries(st.sampled_from(["audio", "session", "item", "response", "event_id"]), json_values,
                              max_size=2)),
    st.builds(lambda a: json.dumps({"type": "input_audio_buffer.append", "audio": a}), pcm),
    st.builds(lambda r, m: json.dumps({"type": "session.update", "session": {"input_audio_sample_rate": r,
                                                                             "mode": m}}),
              st.sampled_from([0, 8000, 16000, 44100, 48000, 96000, -1]), st.sampled_from(["turn", "free_running", "x"])),
    st.text(max_size=50),
    st.binary(max_size=50),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stream=st.lists(events, min_size=1, max_size=25))
def test_random_event_streams_never_take_the_gateway_down(stack, stream):
    # max_queue=None: the test never reads the fuzzed socket's replies; with websockets' default bound of
    # 16 queued messages its reader would stop, the close handshake would wait out close_timeout (10 s).
    with connect(stack.url, max_queue=None) as control, connect(stack.url, max_queue=None) as fuzzed:
        recv_until(control, "session.created")
        recv_until(fuzzed, "session.created")
        for message in stream:
            fuzzed.send(message)
        # The control session is untouched: it still streams and ticks.
        control.send(json.dumps({"type": "input_audio_buffer.append",
                                 "audio": base64.b64encode(b"\x10\x00" * 320).decode()}))
        tick = recv_until(control, "metronome.tick")
        assert tick["budget_ms"] == BUDGET_MS
