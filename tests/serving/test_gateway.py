"""The gateway end to end over real sockets: WebSocket clients → gateway → gRPC worker → engine."""

from __future__ import annotations

import asyncio
import base64
import json
import math
from contextlib import asynccontextmanager

import aiohttp
import numpy as np
import pytest

from metronome.config import AimdConfig, EngineConfig, GatewayConfig, KVPolicy
from metronome.serving.gateway import serve_gateway
from metronome.serving.protocol import DEFAULT_SAMPLE_RATE
from metronome.serving.worker import WorkerConfig, serve_worker

BUDGET_MS = 150.0
# Admission control is tested on its own (the workers own it); here a slow CI box must not shrink the cap.
PERMISSIVE = AimdConfig(initial_cap=8, min_cap=8, target_fraction=1.0)


def tone(seconds: float, rate: int = DEFAULT_SAMPLE_RATE, amplitude: float = 0.2) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (np.sin(2 * math.pi * 440 * t) * amplitude * 32767).astype("<i2").tobytes()


def chunks(pcm: bytes, rate: int = DEFAULT_SAMPLE_RATE, ms: int = 20):
    step = rate * 2 * ms // 1000
    for i in range(0, len(pcm), step):
        yield base64.b64encode(pcm[i:i + step]).decode()


async def start_worker(checkpoint: str, port: int = 0):
    engine = EngineConfig(model=checkpoint, policy=KVPolicy(sinks=4, window=64, block_size=8), num_blocks=400,
                          max_chunk_tokens=64)
    return await serve_worker(WorkerConfig(engine, budget_ms=BUDGET_MS, adapter="energy", port=port,
                                           aimd=PERMISSIVE))


@asynccontextmanager
async def running_gateway(workers, **overrides):
    config = GatewayConfig(workers=tuple(w.address for w in workers), port=0, budget_ms=BUDGET_MS,
                           tokens_per_tick=4, **overrides)
    server = await serve_gateway(config)
    try:
        yield server.gateway, server.address
    finally:
        await server.stop()


@pytest.fixture
async def worker(chat_checkpoint):
    handle = await start_worker(chat_checkpoint)
    yield handle
    await handle.stop()


async def recv_until(ws, predicate, timeout=10.0):
    """Events up to and including the first that satisfies ``predicate``."""
    seen = []
    async with asyncio.timeout(timeout):
        while True:
            msg = await ws.receive()
            assert msg.type == aiohttp.WSMsgType.TEXT, f"socket ended: {msg.type} {msg.data} {msg.extra}"
            event = json.loads(msg.data)
            seen.append(event)
            if predicate(event):
                return seen


def of_type(kind):
    return lambda e: e["type"] == kind


async def test_a_session_streams_audio_and_gets_deltas_and_ticks(worker):
    async with running_gateway([worker]) as (gateway, addr), aiohttp.ClientSession() as http:
        async with http.ws_connect(f"ws://{addr}/v1/realtime") as ws:
            created = (await recv_until(ws, of_type("session.created")))[-1]
            session = created["session"]
            # The GA defaults for a client that sets nothing: PCM16 at 24 kHz, server VAD, audio out.
            assert session["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
            assert session["input_audio_sample_rate"] == 24000
            assert session["audio"]["input"]["turn_detection"]["type"] == "server_vad"
            assert session["output_modalities"] == ["audio"] and session["type"] == "realtime"
            await ws.send_json({"type": "session.update", "session": {"mode": "free_running"}})
            await recv_until(ws, of_type("session.updated"))
            for chunk in chunks(tone(0.4)):
                await ws.send_json({"type": "input_audio_buffer.append", "audio": chunk})
            events = await recv_until(ws, of_type("response.output_text.delta"))
            ticks = [e for e in events if e["type"] == "metronome.tick"]
            assert any(e["type"] == "response.created" for e in events)
            events = await recv_until(ws, of_type("metronome.tick"))
            tick = events[-1]
            assert tick["budget_ms"] == BUDGET_MS and tick["batch"] == 1
            assert isinstance(tick["deadline_met"], bool) and tick["latency_ms"] > 0
            # The worker's share: its whole Step covers its engine and front end and sits within the latency.
            assert tick["engine_ms"] + tick["frontend_ms"] <= tick["worker_ms"] <= tick["latency_ms"]
            assert len(ticks) + 1 >= 1


async def test_turn_mode_answers_a_committed_turn_and_finishes(worker):
    async with running_gateway([worker]) as (gateway, addr), aiohttp.ClientSession() as http:
        async with http.ws_connect(f"ws://{addr}/v1/realtime") as ws:
            await recv_until(ws, of_type("session.created"))
            for chunk in chunks(tone(0.2)):
                await ws.send_json({"type": "input_audio_buffer.append", "audio": chunk})
            await ws.send_json({"type": "input_audio_buffer.commit"})
            events = await recv_until(ws, of_type("response.output_text.delta"))
            assert any(e["type"] == "input_audio_buffer.committed" for e in events)
            await ws.send_json({"type": "response.cancel"})
            await recv_until(ws, lambda e: e["type"] == "response.done"
                             and e["response"]["status"] in ("cancelled", "completed"))


async def test_the_cap_refuses_overflow_with_server_overloaded(worker):
    async with running_gateway([worker], max_sessions=2) as (gateway, addr), aiohttp.ClientSession() as http:
        a = await http.ws_connect(f"ws://{addr}/v1/realtime")
        b = await http.ws_connect(f"ws://{addr}/v1/realtime")
        await recv_until(a, of_type("session.created"))
        await recv_until(b, of_type("session.created"))
        c = await http.ws_connect(f"ws://{addr}/v1/realtime")
        refusal = await c.receive()
        assert refusal.type == aiohttp.WSMsgType.TEXT
        event = json.loads(refusal.data)
        assert event["type"] == "error" and event["error"]["type"] == "server_overloaded"
        closing = await c.receive()
        assert closing.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED) and c.close_code == 1013
        # The admitted sessions are untouched.
        await a.send_json({"type": "input_audio_buffer.append", "audio": next(chunks(tone(0.02)))})
        await recv_until(a, of_type("metronome.tick"))
        for ws in (a, b, c):
            await ws.close()


async def test_a_disconnected_client_frees_its_kv_within_a_tick(worker):
    async with running_gateway([worker]) as (gateway, addr), aiohttp.ClientSession() as http:
        ws = await http.ws_connect(f"ws://{addr}/v1/realtime")
        await recv_until(ws, of_type("session.created"))
        for chunk in chunks(tone(0.3)):
            await ws.send_json({"type": "input_audio_buffer.append", "audio": chunk})
        await recv_until(ws, of_type("metronome.tick"))
        engine = worker.service.engine
        assert engine.stats().sessions == 1 and engine.stats().kv_blocks_used > 0
        await ws.close()
        loop = asyncio.get_running_loop()
        closed_at = loop.time()
        async with asyncio.timeout(5):
            while engine.stats().sessions or engine.stats().kv_blocks_used:
                await asyncio.sleep(0.005)
        assert loop.time() - closed_at <= 2 * BUDGET_MS / 1000
        assert not gateway.pool.handles[0].sessions


BAD_INPUTS = [
    ("{not json", "invalid_json"),
    (json.dumps({"type": "nope.nope"}), "unknown_event"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "***"}), "invalid_audio"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()}), "invalid_audio"),
    (json.dumps({"type": "session.update", "session": {"input_audio_sample_rate": 11025}}), "unsupported_sample_rate"),
    (json.dumps({"type": "session.update", "session": {"input_audio_format": "g711_ulaw"}}), "unsupported_audio_format"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": 7}), "invalid_audio"),
    (json.dumps({"type": "response.create", "response": 7}), "invalid_event"),
    (json.dumps({"type": "conversation.item.create", "item": {"role": "assistant"}}), "unsupported_item"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 5000}), "message_too_large"),
]


async def test_bad_input_gets_a_clear_error_and_the_session_lives_on(worker):
    async with running_gateway([worker], max_message_bytes=4096) as (gateway, addr), aiohttp.ClientSession() as http:
        bystander = await http.ws_connect(f"ws://{addr}/v1/realtime")
        ws = await http.ws_connect(f"ws://{addr}/v1/realtime")
        await recv_until(ws, of_type("session.created"))
        await recv_until(bystander, of_type("session.created"))
        for raw, code in BAD_INPUTS:
            await ws.send_str(raw)
            event = (await recv_until(ws, of_type("error")))[-1]
            assert event["error"]["code"] == code, raw[:60]
        await ws.send_bytes(b"\x00\x01")
        assert (await recv_until(ws, of_type("error")))[-1]["error"]["code"] == "unsupported_frame"
        # Both sessions still tick.
        for sock in (ws, bystander):
            await sock.send_json({"type": "input_audio_buffer.append", "audio": next(chunks(tone(0.02)))})
            await recv_until(sock, of_type("metronome.tick"))
        await ws.close()
        await bystander.close()


async def test_a_flood_of_tiny_messages_is_limited_then_closed(worker):
    async with running_gateway([worker], max_messages_per_s=20.0) as (gateway, addr), aiohttp.ClientSession() as http:
        calm = await http.ws_connect(f"ws://{addr}/v1/realtime")
        ws = await http.ws_connect(f"ws://{addr}/v1/realtime")
        await recv_until(ws, of_type("session.created"))
        await recv_until(calm, of_type("session.created"))
        for _ in range(400):
            await ws.send_json({"type": "input_audio_buffer.clear"})
        codes = set()
        async with asyncio.timeout(10):
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.TEXT and json.loads(msg.data)["type"] == "error":
                    codes.add(json.loads(msg.data)["error"]["code"])
        assert {"rate_limited", "flood"} <= codes and ws.close_code == 1008
        await calm.send_json({"type": "input_audio_buffer.append", "audio": next(chunks(tone(0.02)))})
        await recv_until(calm, of_type("metronome.tick"))
        await calm.close()


async def test_api_key_is_required_when_set(worker):
    async with running_gateway([worker], api_key="sekret") as (gateway, addr), aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(f"ws://{addr}/v1/realtime")
        assert refused.value.status == 401
        with pytest.raises(aiohttp.WSServerHandshakeError):
            await http.ws_connect(f"ws://{addr}/v1/realtime", headers={"Authorization": "Bearer wrong"})
        async with http.ws_connect(f"ws://{addr}/v1/realtime", headers={"Authorization": "Bearer sekret"}) as ws:
            await recv_until(ws, of_type("session.created"))


async def test_http_endpoints(worker):
    async with running_gateway([worker]) as (gateway, addr), aiohttp.ClientSession() as http:
        async with http.ws_connect(f"ws://{addr}/v1/realtime") as ws:
            await recv_until(ws, of_type("session.created"))
            await ws.send_json({"type": "input_audio_buffer.append", "audio": next(chunks(tone(0.02)))})
            await recv_until(ws, of_type("metronome.tick"))
            health = await (await http.get(f"http://{addr}/health")).json()
            assert health["status"] == "ok" and health["workers"][0]["live"] == 1
            models = await (await http.get(f"http://{addr}/v1/models")).json()
            assert models["data"][0]["id"] == "metronome"
            metrics = await (await http.get(f"http://{addr}/metrics")).text()
            for name in ("metronome_sessions_live", "metronome_admission_cap", "metronome_tick_latency_seconds_bucket",
                         "metronome_deadline_misses_total", "metronome_kv_blocks_used",
                         "metronome_worker_time_seconds_total", "metronome_sessions_rejected_total",
                         "metronome_kv_time_to_wall_seconds"):
                assert name in metrics, name
            assert f'le="{BUDGET_MS / 1000}"' in metrics  # histogram buckets reach B


async def test_a_dead_worker_ends_its_sessions_and_others_carry_on(chat_checkpoint):
    first, second = await start_worker(chat_checkpoint), await start_worker(chat_checkpoint)
    try:
        async with running_gateway([first, second]) as (gateway, addr), aiohttp.ClientSession() as http:
            socks = [await http.ws_connect(f"ws://{addr}/v1/realtime") for _ in range(4)]
            for ws in socks:
                await recv_until(ws, of_type("session.created"))
            by_worker = {h.address: set(h.sessions) for h in gateway.pool.handles}
            assert all(len(s) == 2 for s in by_worker.values())  # placed by headroom
            dead_port = first.port
            await first.stop(grace=0)
            for ws in socks:
                await ws.send_json({"type": "input_audio_buffer.append", "audio": next(chunks(tone(0.02)))})
            outcomes = []
            for ws in socks:
                events = await recv_until(ws, lambda e: e["type"] in ("metronome.tick", "error"))
                outcomes.append(events[-1]["type"] if events[-1]["type"] == "metronome.tick"
                                else events[-1]["error"]["code"])
            assert sorted(outcomes) == ["metronome.tick", "metronome.tick", "worker_unavailable", "worker_unavailable"]
            # The worker comes back on the same port: the gateway admits there again.
            first = await start_worker(chat_checkpoint, port=dead_port)
            dead = next(h for h in gateway.pool.handles if h.address.endswith(f":{dead_port}"))
            async with asyncio.timeout(10):
                while not dead.healthy:
                    await asyncio.sleep(0.05)
            again = [await http.ws_connect(f"ws://{addr}/v1/realtime") for _ in range(2)]
            for ws in again:
                await recv_until(ws, of_type("session.created"))
            assert len(dead.sessions) >= 1
            for ws in socks + again:
                await ws.close()
    finally:
        await first.stop()
        await second.stop()


async def test_the_openai_sdk_realtime_client_drives_a_session(worker):
    from openai import AsyncOpenAI

    async with running_gateway([worker], api_key="sk-test") as (gateway, addr):
        client = AsyncOpenAI(base_url=f"http://{addr}/v1", api_key="sk-test")
        async with client.realtime.connect(model="metronome") as conn:
            first = await conn.recv()
            assert first.type == "session.created"
            await conn.send({"type": "session.update", "session": {"type": "realtime", "mode": "free_running"}})
            for chunk in chunks(tone(0.3)):
                await conn.input_audio_buffer.append(audio=chunk)
            text = []
            async with asyncio.timeout(10):
                async for event in conn:
                    if event.type == "response.output_text.delta":
                        text.append(event.delta)
                        break
            assert text


async def test_tick_events_carry_input_level_checks(worker):
    async with running_gateway([worker]) as (gateway, addr), aiohttp.ClientSession() as http:
        async with http.ws_connect(f"ws://{addr}/v1/realtime") as ws:
            await recv_until(ws, of_type("session.created"))
            clipped = (np.sign(np.sin(np.arange(1600) / 5.0)) * 32767).astype("<i2").tobytes()  # full-scale square
            await ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(clipped).decode()})
            tick = (await recv_until(ws, lambda e: e["type"] == "metronome.tick" and e["input_dbfs"] > -120))[-1]
            assert tick["input_clipping"] > 0.9 and tick["input_dbfs"] > -1.0
            await ws.send_json({"type": "input_audio_buffer.append", "audio": next(chunks(tone(0.1, amplitude=0.2)))})
            tick = (await recv_until(ws, lambda e: e["type"] == "metronome.tick" and e["input_dbfs"] > -120))[-1]
            assert tick["input_clipping"] == 0.0 and -18.5 < tick["input_dbfs"] < -15.5  # 0.2 sine: -17 dBFS


async def test_session_update_takes_the_ga_and_the_beta_shapes_and_refuses_what_it_cannot_do(worker):
    async with running_gateway([worker]) as (gateway, addr), aiohttp.ClientSession() as http:
        async with http.ws_connect(f"ws://{addr}/v1/realtime") as ws:
            await recv_until(ws, of_type("session.created"))
            await ws.send_json({"type": "session.update", "session": {
                "type": "realtime", "output_modalities": ["text"], "max_output_tokens": 40,
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}, "turn_detection": None}}}})
            ga = (await recv_until(ws, of_type("session.updated")))[-1]["session"]
            assert ga["audio"]["input"] == {"format": {"type": "audio/pcm", "rate": 16000}, "turn_detection": None}
            assert ga["output_modalities"] == ["text"] and ga["max_output_tokens"] == 40
            await ws.send_json({"type": "session.update", "session": {
                "input_audio_format": "pcm16", "max_response_output_tokens": "inf",
                "turn_detection": {"type": "server_vad", "threshold": 0.7, "silence_duration_ms": 300}}})
            beta = (await recv_until(ws, of_type("session.updated")))[-1]["session"]
            turn = beta["audio"]["input"]["turn_detection"]
            assert turn["threshold"] == pytest.approx(0.7) and turn["silence_duration_ms"] == 300
            assert turn["prefix_padding_ms"] is None           # left to the worker's VAD
            assert beta["max_output_tokens"] == beta["max_response_output_tokens"] == "inf"
            assert beta["audio"]["input"]["format"]["rate"] == 16000   # not named: kept
            for bad, code in [({"turn_detection": {"type": "server_vad", "threshold": 2}}, "invalid_turn_detection"),
                              ({"audio": {"input": {"format": {"type": "audio/pcmu"}}}}, "unsupported_audio_format"),
                              ({"type": "transcription"}, "unsupported_session_type"),
                              ({"max_output_tokens": -3}, "invalid_max_output_tokens"),
                              ({"output_modalities": ["video"]}, "invalid_modalities")]:
                await ws.send_json({"type": "session.update", "session": bad})
                error = (await recv_until(ws, of_type("error")))[-1]
                assert error["error"]["code"] == code, (bad, error)
            await ws.send_json({"type": "response.create", "response": {"max_output_tokens": 0}})
            assert (await recv_until(ws, of_type("error")))[-1]["error"]["code"] == "invalid_max_output_tokens"
            await ws.send_json({"type": "session.update", "session": {}})
            after = (await recv_until(ws, of_type("session.updated")))[-1]["session"]
            assert after["audio"] == beta["audio"] and after["max_output_tokens"] == "inf"   # the refusals changed nothing
