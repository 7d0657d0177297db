"""The frame budget B: a gateway given none adopts its workers'; a worker whose B differs is not used."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import grpc
import pytest

from metronome.config import AimdConfig, GatewayConfig
from metronome.serving.gateway import serve_gateway
from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.proto import worker_pb2_grpc as pb_grpc


class FixedBudgetWorker(pb_grpc.WorkerServicer):
    """A model-free worker that reports ``budget_ms`` in Health and answers every tick with one token."""

    def __init__(self, budget_ms: float) -> None:
        self.budget_ms = budget_ms
        self.opened: list[str] = []

    async def OpenSession(self, request, context):
        self.opened.append(request.sid)
        return pb.OpenSessionResponse(ok=True)

    async def CloseSession(self, request, context):
        return pb.CloseSessionResponse(closed=True)

    async def Health(self, request, context):
        return pb.HealthResponse(ready=True, model="fixed", budget_ms=self.budget_ms, capacity_sessions=8,
                                 kv_blocks_total=8, input_sample_rate=16000)

    async def Step(self, request, context):
        return pb.StepResponse(outputs=[pb.SessionOutput(sid=s.sid, tokens=[1], text=".") for s in request.sessions])

    async def StreamStep(self, request_iterator, context):
        last = None
        async for message in request_iterator:
            last = message
        await context.write(await self.Step(last, context))


@pytest.fixture
async def workers():
    """Start fake workers at the given budgets; yields a starter that returns (servicer, address)."""
    servers = []

    async def start(budget_ms: float):
        servicer = FixedBudgetWorker(budget_ms)
        server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return servicer, f"127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(0)


def gateway_config(addresses, budget_ms=None) -> GatewayConfig:
    # Gateway admission: its own controllers must run at the adopted B too (the workers' always do).
    return GatewayConfig(workers=tuple(addresses), port=0, budget_ms=budget_ms, tokens_per_tick=1,
                         aimd=AimdConfig(initial_cap=4, min_cap=4, target_fraction=1.0), admission="gateway")


async def session_created(url: str) -> dict:
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        event = json.loads((await ws.receive(timeout=10)).data)
        assert event["type"] == "session.created", event
        await ws.send_json({"type": "session.update", "session": {"mode": "free_running"}})
        await ws.send_json({"type": "input_audio_buffer.append", "audio": ""})
        await ws.send_json({"type": "response.create"})
        while True:
            tick = json.loads((await ws.receive(timeout=10)).data)
            if tick["type"] == "metronome.tick":
                return {"created": event, "tick": tick}


async def test_a_gateway_given_no_budget_adopts_the_workers(workers):
    _, address = await workers(120.0)
    server = await serve_gateway(gateway_config([address]))
    try:
        pool = server.gateway.pool
        assert pool.budget_ms == 120.0
        (handle,) = pool.handles
        assert handle.healthy and not handle.refused and handle.controller.config.budget_ms == 120.0
        seen = await session_created(server.url)
        assert seen["created"]["session"]["budget_ms"] == 120.0 and seen["tick"]["budget_ms"] == 120.0
        assert b'metronome_tick_latency_seconds_bucket{le="0.12"' in server.gateway.metrics.render()
    finally:
        await server.stop()


async def test_a_worker_whose_budget_differs_from_the_gateways_is_refused_and_logged(workers, caplog):
    good, good_address = await workers(500.0)
    other, other_address = await workers(80.0)
    caplog.set_level(logging.ERROR, logger="metronome.serving.gateway.pool")
    server = await serve_gateway(gateway_config([other_address, good_address], budget_ms=500.0))
    try:
        pool = server.gateway.pool
        by_address = {h.address: h for h in pool.handles}
        refused, used = by_address[other_address], by_address[good_address]
        assert pool.budget_ms == 500.0 and used.healthy and not refused.healthy
        assert "B = 80 ms" in refused.refused and "B = 500 ms" in refused.refused
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any(other_address in m and "not used" in m and "80" in m for m in errors)
        for _ in range(3):   # every session goes to the worker at the gateway's B
            await session_created(server.url)
        assert len(set(good.opened)) == 3 and not other.opened   # (session.update re-opens a session)
        await asyncio.sleep(1.2)   # a health check later the refusal is not logged again
        assert sum("not used" in r.getMessage() for r in caplog.records) == 1
    finally:
        await server.stop()


async def test_an_adopted_budget_binds_the_other_workers_too(workers):
    _, first = await workers(300.0)
    _, second = await workers(2000.0)
    server = await serve_gateway(gateway_config([first, second]))
    try:
        pool = server.gateway.pool
        assert pool.budget_ms == 300.0
        assert [h.healthy for h in pool.handles] == [True, False]
        assert "B = 2000 ms" in pool.handles[1].refused
    finally:
        await server.stop()


async def test_a_worker_reporting_no_budget_cannot_set_one(workers):
    _, address = await workers(0.0)
    server = await serve_gateway(gateway_config([address]))
    try:
        pool = server.gateway.pool
        assert pool.budget_ms is None and not pool.handles[0].healthy
        assert "explicit budget" in pool.handles[0].refused
        async with aiohttp.ClientSession() as http, http.ws_connect(server.url) as ws:
            event = json.loads((await ws.receive(timeout=10)).data)
            assert event["error"]["type"] == "server_overloaded"
    finally:
        await server.stop()
