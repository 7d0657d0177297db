"""Hostile clients against a live gateway + worker, with victim sessions streaming beside them.

Each attack must cost only the attacker: the victims' ticks keep coming every B with their deadline met
(cadence), the admission slots the attackers took come back (slots), and so does their KV (memory).
Everything runs on loopback with the tiny random checkpoint; B = 200 ms and short runs keep it fast.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
import pytest

from metronome.config import AimdConfig, EngineConfig, GatewayConfig, KVPolicy
from metronome.serving.gateway import serve_gateway
from metronome.serving.worker import WorkerConfig, serve_worker
from tests.serving.test_gateway import chunks, of_type, recv_until, tone

BUDGET_MS = 200.0
# Admission control is tested on its own (the workers own it); here a slow CI box must not shrink the cap.
PERMISSIVE = AimdConfig(initial_cap=8, min_cap=8, target_fraction=1.0)
VICTIMS = 2
URL = "ws://{addr}/v1/realtime"


async def start_worker(checkpoint: str):
    engine = EngineConfig(model=checkpoint, policy=KVPolicy(sinks=4, window=64, block_size=8), num_blocks=400,
                          max_chunk_tokens=64)
    return await serve_worker(WorkerConfig(engine, budget_ms=BUDGET_MS, adapter="energy", port=0,
                                           max_input_tokens=256, aimd=PERMISSIVE))


@pytest.fixture
async def worker(chat_checkpoint):
    handle = await start_worker(chat_checkpoint)
    yield handle
    await handle.stop()


@asynccontextmanager
async def gateway(worker, **overrides):
    limits = dict(max_message_bytes=64 << 10, max_text_bytes_per_tick=16 << 10, max_instruction_bytes=8 << 10,
                  abuse_window_s=60.0)
    config = GatewayConfig(workers=(worker.address,), port=0, budget_ms=BUDGET_MS, tokens_per_tick=4,
                           **{**limits, **overrides})
    server = await serve_gateway(config)
    try:
        yield server.gateway, server.address
    finally:
        await server.stop()


@dataclass
class Victim:
    """A well-behaved client: streams 20 ms of audio every 20 ms and records its ticks."""

    ws: aiohttp.ClientWebSocketResponse
    ticks: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    tasks: list[asyncio.Task] = field(default_factory=list)

    async def _send(self) -> None:
        loud, quiet = next(chunks(tone(0.02))), next(chunks(tone(0.02, amplitude=0.001)))
        n = 0
        while True:   # speech-like: 200 ms loud, 200 ms quiet
            chunk = loud if n % 20 < 10 else quiet
            await self.ws.send_json({"type": "input_audio_buffer.append", "audio": chunk})
            n += 1
            await asyncio.sleep(0.02)

    async def _read(self) -> None:
        async for msg in self.ws:
            event = json.loads(msg.data)
            if event["type"] == "metronome.tick":
                self.ticks.append(event)
            elif event["type"] == "error":
                self.errors.append(event["error"])

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._send()), asyncio.create_task(self._read())]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.ws.close()


@asynccontextmanager
async def victims(http: aiohttp.ClientSession, addr: str, n: int = VICTIMS):
    crowd = []
    for _ in range(n):
        ws = await http.ws_connect(URL.format(addr=addr))
        await recv_until(ws, of_type("session.created"))
        crowd.append(Victim(ws))
    for victim in crowd:
        victim.start()
    try:
        yield crowd
    finally:
        for victim in crowd:
            await victim.stop()


@dataclass
class Cadence:
    """The victims' ticks from a point on: how many, how late, how many met their deadline."""

    crowd: list[Victim]
    since: list[int]
    started: float
    until: list[int] | None = None   # None: up to now

    @classmethod
    async def mark(cls, crowd: list[Victim], ticks: int = 0) -> Cadence:
        """From now on (after each victim has ``ticks`` more ticks, when given)."""
        at = [len(v.ticks) for v in crowd]
        await wait_until(lambda: all(len(v.ticks) >= n + ticks for v, n in zip(crowd, at)))
        return cls(crowd, [len(v.ticks) for v in crowd], asyncio.get_running_loop().time())

    def ticks(self) -> list[dict]:
        until = self.until or [None] * len(self.crowd)
        return [t for v, n, m in zip(self.crowd, self.since, until) for t in v.ticks[n:m]]

    def up_to(self, later: Cadence) -> Cadence:
        """This window, ended where ``later`` starts."""
        return Cadence(self.crowd, self.since, self.started, later.since)

    def met(self) -> float:
        ticks = self.ticks()
        return sum(t["deadline_met"] for t in ticks) / max(1, len(ticks))

    def median_ms(self) -> float:
        latencies = sorted(t["latency_ms"] for t in self.ticks())
        return latencies[len(latencies) // 2] if latencies else 0.0


async def assert_unharmed(before: Cadence, during: Cadence) -> None:
    """The victims' ticks kept coming every B during an attack, about as punctual as before it (a shared CI
    box sets how punctual that is), and no victim heard an error."""
    before = before.up_to(during)
    seconds = asyncio.get_running_loop().time() - during.started
    due = seconds * 1000.0 / BUDGET_MS
    for victim, n in zip(during.crowd, during.since):
        assert len(victim.ticks) - n >= 0.5 * due, (len(victim.ticks) - n, due)
        assert not victim.errors, victim.errors
    assert during.met() >= min(0.9, before.met()) - 0.25, (before.met(), [t["latency_ms"] for t in during.ticks()])
    assert during.median_ms() <= before.median_ms() + BUDGET_MS / 2, (before.median_ms(), during.median_ms())


async def wait_until(predicate, timeout: float = 10.0, what: str = "") -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.05)


async def closed_with(ws: aiohttp.ClientWebSocketResponse, timeout: float = 10.0) -> tuple[list[dict], int]:
    """The events until the server closes the socket, and the close code."""
    errors = []
    async with asyncio.timeout(timeout):
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.TEXT and json.loads(msg.data)["type"] == "error":
                errors.append(json.loads(msg.data)["error"])
    return errors, ws.close_code


def slots_and_memory_back(gw, worker) -> bool:
    """Only the victims hold admission slots and KV (at most their reservation each) again."""
    stats = worker.service.engine.stats()
    return (gw.pool.handles[0].live == VICTIMS and stats.sessions == VICTIMS
            and stats.kv_blocks_used <= VICTIMS * stats.blocks_per_session)


def engine_thread_texts(worker, monkeypatch) -> list[int]:
    """Sizes of the texts the adapter sees on the engine thread."""
    sizes: list[int] = []
    prepare = worker.service.adapter.prepare

    def recording(batch):
        assert threading.current_thread().name.startswith("metronome-engine")
        sizes.extend(len(t.text) for t in batch if t.text)
        return prepare(batch)

    monkeypatch.setattr(worker.service.adapter, "prepare", recording)
    return sizes


# ------------------------------------------------------------------ work budgets
async def test_text_floods_cost_only_the_abusers(worker, monkeypatch):
    sizes = engine_thread_texts(worker, monkeypatch)
    async with gateway(worker) as (gw, addr), aiohttp.ClientSession() as http:
        async with victims(http, addr) as crowd:
            before = await Cadence.mark(crowd, ticks=2)
            await Cadence.mark(crowd, ticks=5)
            during = await Cadence.mark(crowd)
            words = "antidisestablishmentarianism " * 500   # 15 KB: under the byte cap, thousands of tokens
            big = "x" * 60_000
            attacks = [
                {"type": "conversation.item.create",   # over the gateway's bytes per tick
                 "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": big}]}},
                {"type": "conversation.item.create",   # within the bytes, over the worker's tokens
                 "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": words}]}},
                {"type": "input_audio_buffer.append",   # 1.25 s of 16-kHz audio every 200 ms: over 2x real time
                 "audio": base64.b64encode(b"\x00\x01" * 20_000).decode()},
                "[" * 60_000,   # nested far deeper than any parser should recurse
            ]
            for attack in attacks:
                abuser = await http.ws_connect(URL.format(addr=addr))
                await recv_until(abuser, of_type("session.created"))
                if isinstance(attack, dict) and attack["type"] == "input_audio_buffer.append":
                    await abuser.send_json({"type": "session.update", "session": {"input_audio_sample_rate": 16000}})
                    await recv_until(abuser, of_type("session.updated"))
                raw = attack if isinstance(attack, str) else json.dumps(attack)
                outcome = asyncio.create_task(closed_with(abuser))   # reading all along, as clients do
                for _ in range(20):
                    if outcome.done():
                        break
                    try:
                        await abuser.send_str(raw)
                    except aiohttp.ClientConnectionResetError:   # closed for abuse already
                        break
                    await asyncio.sleep(BUDGET_MS / 1000.0)
                errors, code = await outcome
                assert code == 1008 and errors[-1]["code"] == "abuse", (raw[:80], errors)
                assert not {"internal_error", "session_failed"} & {e["code"] for e in errors}
            await assert_unharmed(before, during)
            assert max(sizes, default=0) < 200   # the engine thread never tokenized an abuser's text
            await wait_until(lambda: slots_and_memory_back(gw, worker), what="slots and KV back")


async def test_a_refused_session_update_leaves_the_session_as_it_was(worker):
    async with gateway(worker) as (gw, addr), aiohttp.ClientSession() as http:
        async with http.ws_connect(URL.format(addr=addr)) as ws:
            await recv_until(ws, of_type("session.created"))
            await ws.send_json({"type": "session.update", "session": {"instructions": "Be brief."}})
            assert (await recv_until(ws, of_type("session.updated")))[-1]["session"]["instructions"] == "Be brief."
            for instructions in ("word " * 2000, "long " * 200):   # over the gateway's bytes; over the tokens
                await ws.send_json({"type": "session.update", "session": {"instructions": instructions,
                                                                          "mode": "free_running"}})
                error = (await recv_until(ws, of_type("error")))[-1]["error"]
                assert error["code"] in ("instructions_too_large", "session_update_refused")
                assert "unchanged" in error["message"]
            # Still admitted, still as it was: a valid update applies, and the session ticks.
            await ws.send_json({"type": "session.update", "session": {"mode": "free_running"}})
            updated = (await recv_until(ws, of_type("session.updated")))[-1]["session"]
            assert updated["instructions"] == "Be brief." and updated["mode"] == "free_running"
            await ws.send_json({"type": "input_audio_buffer.append", "audio": next(chunks(tone(0.1)))})
            await recv_until(ws, of_type("metronome.tick"))
            assert len(gw.pool.handles[0].sessions) == 1 and worker.service.engine.stats().sessions == 1


# ------------------------------------------------------------------ liveness
async def test_silent_clients_give_their_slots_back(worker):
    async with gateway(worker, max_sessions=VICTIMS + 2, idle_timeout_s=1.5) as (gw, addr), \
            aiohttp.ClientSession() as http:
        async with victims(http, addr) as crowd:
            before = await Cadence.mark(crowd, ticks=2)
            await Cadence.mark(crowd, ticks=5)
            during = await Cadence.mark(crowd)
            silent = [await http.ws_connect(URL.format(addr=addr)) for _ in range(2)]
            for ws in silent:
                await recv_until(ws, of_type("session.created"))
            refused = await http.ws_connect(URL.format(addr=addr))   # the cap is full
            errors, code = await closed_with(refused)
            assert code == 1013 and errors[-1]["code"] == "server_overloaded"
            for ws in silent:
                errors, code = await closed_with(ws)
                assert errors[-1]["code"] == "idle_timeout" and code == 1000
            await wait_until(lambda: gw.pool.handles[0].live == VICTIMS)
            late = await http.ws_connect(URL.format(addr=addr))   # a slot came back
            await recv_until(late, of_type("session.created"))
            await late.close()
            await assert_unharmed(before, during)


async def test_a_socket_that_never_reads_or_answers_pings_is_closed(worker):
    async with gateway(worker, idle_timeout_s=0, ping_interval_s=0.3, pong_timeout_s=0.3) as (gw, addr):
        host, port = addr.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write((f"GET /v1/realtime HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        await wait_until(lambda: len(gw.pool.handles[0].sessions) == 1)
        # From here on it never reads a byte nor answers a ping: the session must end and free its slot and KV.
        await wait_until(lambda: gw.pool.handles[0].live == 0 and worker.service.engine.stats().sessions == 0)
        writer.close()


async def test_an_http_head_that_never_ends_is_cut_off(worker):
    async with gateway(worker, handshake_timeout_s=0.3) as (gw, addr):
        host, port = addr.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")   # and then nothing
        async with asyncio.timeout(5):
            answer = await reader.read()
        assert answer.startswith(b"HTTP/1.1 408 ")
        writer.close()


# ------------------------------------------------------------------ HTTP that load balancers and operators expect
async def http_raw(addr: str, request: bytes) -> bytes:
    host, port = addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    async with asyncio.timeout(5):
        answer = await reader.read()
    writer.close()
    return answer


async def test_health_checks_methods_headers_and_key_guessing(worker):
    async with gateway(worker, api_key="sekret", auth_failures_per_min=3) as (gw, addr):
        head = await http_raw(addr, b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")   # no body
        get = await http_raw(addr, b"GET /health HTTP/1.0\r\n\r\n")
        status, body = get.split(b"\r\n", 1)[0], get.split(b"\r\n\r\n", 1)[1]
        assert status.startswith(b"HTTP/1.1 200 ") and json.loads(body)["status"] == "ok"
        # Public answers carry the model's name, never a path of the worker's machine.
        assert os.path.dirname(worker.service.engine.config.model) not in body.decode()
        post = await http_raw(addr, b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert post.startswith(b"HTTP/1.1 405 ") and b"\r\nAllow: GET, HEAD\r\n" in post
        big = await http_raw(addr, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n")
        assert big.startswith(b"HTTP/1.1 431 ")
        statuses = []
        for _ in range(5):   # guessing keys from one address: 401 three times, then 429 even for the right one
            answer = await http_raw(addr, b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer guess\r\n\r\n")
            statuses.append(int(answer.split(b" ", 2)[1]))
        assert statuses == [401, 401, 401, 429, 429]
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.WSServerHandshakeError) as throttled:
                await http.ws_connect(URL.format(addr=addr), headers={"Authorization": "Bearer sekret"})
            assert throttled.value.status == 429
