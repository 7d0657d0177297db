"""A fleet on loopback, worker processes for real: gateways sharing workers, workers joining and leaving
while sessions stream, a killed worker, drains. Workers listen on 127.0.0.1-5 at one port, found through a
DNS name (an injected resolver answers it, as a headless Service's DNS would)."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import signal
import socket
import subprocess
import sys
from contextlib import AsyncExitStack

import aiohttp
import grpc
import numpy as np
import pytest

from metronome.config import GatewayConfig
from metronome.serving.gateway import serve_gateway
from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.proto import worker_pb2_grpc as pb_grpc
from metronome.serving.supervisor import WorkerSupervisor, worker_env

BUDGET_MS = 200.0
PER_WORKER = 2          # each worker's static cap: the fleet's capacity is known exactly
NAME = "workers.fleet.test"
HOSTS = [f"127.0.0.{i}" for i in range(1, 6)]   # 1-3 shared; 4 is killed, 5 drained


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_command(checkpoint: str, host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "metronome", "worker", "--model", checkpoint, "--adapter", "energy",
            "--budget-ms", str(BUDGET_MS), "--sinks", "4", "--window", "64", "--block-size", "8",
            "--num-blocks", "400", "--threads", "1", "--host", host, "--port", str(port),
            "--max-sessions", str(PER_WORKER), "--target", "1.0", "--drain-grace-s", "2"]


@pytest.fixture(scope="module")
def fleet(chat_checkpoint):
    port = free_port()
    commands = {f"{h}:{port}": worker_command(chat_checkpoint, h, port) for h in HOSTS}
    supervisor = WorkerSupervisor(commands, worker_env(None), None)
    supervisor.start()
    try:
        asyncio.run(supervisor.wait_ready(timeout_s=180))
        yield supervisor
    finally:
        supervisor.stop(grace_s=5)


class Dns:
    """What NAME resolves to now: the test changes it, the gateways ask again every discovery interval."""

    def __init__(self, *hosts: str) -> None:
        self.hosts = list(hosts)

    async def resolve(self, name: str, port: int) -> list[str]:
        if name != NAME:
            raise socket.gaierror(f"unknown name {name}")
        return list(self.hosts)


def tone(seconds: float, rate: int = 16000) -> str:
    t = np.arange(int(seconds * rate)) / rate
    return base64.b64encode((np.sin(2 * math.pi * 440 * t) * 0.2 * 32767).astype("<i2").tobytes()).decode()


async def start_gateway(stack: AsyncExitStack, dns: Dns, port: int, stop: bool = True):
    config = GatewayConfig(workers=(f"dns:{NAME}:{port}",), port=0, budget_ms=BUDGET_MS, tokens_per_tick=2,
                           discovery_interval_s=0.2, drain_grace_s=1.0)
    server = await serve_gateway(config, resolve=dns.resolve)
    if stop:
        stack.push_async_callback(server.stop)
    return server


async def first_event(ws) -> dict:
    msg = await ws.receive(timeout=20)
    assert msg.type == aiohttp.WSMsgType.TEXT, msg
    return json.loads(msg.data)


async def until(predicate, timeout: float = 20.0, what: str = "") -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.05)


async def events_until(ws, done, timeout: float = 20.0) -> list[dict]:
    """Stream audio (a 20 ms chunk a tick) and read events until ``done(event)``, an error or the close
    (the last event then: ``error``, or ``closed`` with the code)."""
    events = []
    async with asyncio.timeout(timeout):
        await ws.send_json({"type": "input_audio_buffer.append", "audio": tone(0.02)})
        while True:
            msg = await ws.receive()
            if msg.type != aiohttp.WSMsgType.TEXT:
                return events + [{"type": "closed", "code": ws.close_code}]
            events.append(json.loads(msg.data))
            if done(events[-1]) or events[-1]["type"] == "error":
                return events
            if events[-1]["type"] == "metronome.tick":
                await ws.send_json({"type": "input_audio_buffer.append", "audio": tone(0.02)})


async def ticks(ws, n: int) -> list[dict]:
    """Events until ``n`` more ticks, or the error that ended the session (then last)."""
    seen = 0

    def nth_tick(event: dict) -> bool:
        nonlocal seen
        seen += event["type"] == "metronome.tick"
        return seen >= n

    return await events_until(ws, nth_tick)


def placed(server) -> dict[str, set[str]]:
    return {h.address: set(h.sessions) for h in server.gateway.pool.handles}


def worker_of(server, sid: str) -> str:
    return next(a for a, sids in placed(server).items() if sid in sids)


async def worker_sessions(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        return (await pb_grpc.WorkerStub(channel).Health(pb.HealthRequest(), timeout=5)).sessions


async def until_idle(*addresses: str) -> None:
    """Until the workers hold no session (closing is asynchronous): the next test starts from empty workers."""
    async with asyncio.timeout(20):
        while any(await asyncio.gather(*(worker_sessions(a) for a in addresses))):
            await asyncio.sleep(0.05)


async def test_two_gateways_share_three_workers_and_never_over_admit(fleet):
    port = int(fleet.workers[0].address.rsplit(":", 1)[1])
    dns = Dns(*HOSTS[:3])
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as http:
        gateways = [await start_gateway(stack, dns, port) for _ in range(2)]
        # Offered together through both gateways: half again the fleet's capacity.
        offered = 3 * PER_WORKER * 3 // 2
        socks = await asyncio.gather(*(http.ws_connect(gateways[i % 2].url) for i in range(offered)))
        firsts = await asyncio.gather(*(first_event(ws) for ws in socks))
        admitted = [ws for ws, e in zip(socks, firsts) if e["type"] == "session.created"]
        refused = [e for e in firsts if e["type"] == "error"]
        assert len(admitted) == 3 * PER_WORKER
        assert len(refused) == offered - len(admitted)
        assert all(e["error"]["type"] == "server_overloaded" for e in refused)
        counts = await asyncio.gather(*(worker_sessions(f"{h}:{port}") for h in HOSTS[:3]))
        assert counts == [PER_WORKER] * 3    # each worker took exactly what it allows, from both gateways
        # Every admitted session streams.
        for ws in admitted:
            assert (await ticks(ws, 1))[-1]["type"] == "metronome.tick"
        for ws in socks:
            await ws.close()
        await until_idle(*(f"{h}:{port}" for h in HOSTS[:3]))


async def test_workers_join_and_leave_while_sessions_stream(fleet):
    port = int(fleet.workers[0].address.rsplit(":", 1)[1])
    dns = Dns(*HOSTS[:2])
    first, second, third = (f"{h}:{port}" for h in HOSTS[:3])
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as http:
        server = await start_gateway(stack, dns, port)
        socks = [await http.ws_connect(server.url) for _ in range(2)]
        sids = [(await first_event(ws))["session"]["id"] for ws in socks]
        assert {worker_of(server, sid) for sid in sids} == {first, second}   # by headroom: one each

        dns.hosts.append(HOSTS[2])                                             # a worker appears
        await until(lambda: any(h.address == third and h.healthy for h in server.gateway.pool.handles))
        joined = await http.ws_connect(server.url)
        assert worker_of(server, (await first_event(joined))["session"]["id"]) == third   # most headroom

        dns.hosts.remove(HOSTS[0])                                             # a worker leaves discovery
        leaving = next(h for h in server.gateway.pool.handles if h.address == first)
        await until(lambda: leaving.retired)
        for ws in socks:   # its session keeps streaming, as do the others
            assert (await ticks(ws, 2))[-1]["type"] == "metronome.tick"
        late = await http.ws_connect(server.url)
        assert worker_of(server, (await first_event(late))["session"]["id"]) != first
        on_first = socks[[worker_of(server, s) for s in sids].index(first)]
        await on_first.close()                                                 # its last session ends...
        await until(lambda: leaving not in server.gateway.pool.handles)        # ...and it is dropped
        for ws in socks + [joined, late]:
            await ws.close()
        await until_idle(first, second, third)


async def test_a_killed_worker_costs_only_its_own_sessions(fleet):
    port = int(fleet.workers[0].address.rsplit(":", 1)[1])
    dns = Dns(HOSTS[0], HOSTS[3])
    doomed = next(w for w in fleet.workers if w.address == f"{HOSTS[3]}:{port}")
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as http:
        server = await start_gateway(stack, dns, port)
        socks = [await http.ws_connect(server.url) for _ in range(2)]
        sids = [(await first_event(ws))["session"]["id"] for ws in socks]
        victim = [worker_of(server, s) for s in sids].index(doomed.address)
        for ws in socks:
            assert (await ticks(ws, 1))[-1]["type"] == "metronome.tick"
        doomed.proc.send_signal(signal.SIGKILL)
        doomed.proc.wait(timeout=10)
        ended = await ticks(socks[victim], 50)
        assert ended[-1]["type"] == "error" and ended[-1]["error"]["code"] == "worker_unavailable"
        survivor = socks[1 - victim]
        assert (await ticks(survivor, 3))[-1]["type"] == "metronome.tick"
        replacement = await http.ws_connect(server.url)   # new sessions go to the worker still up
        assert worker_of(server, (await first_event(replacement))["session"]["id"]) == f"{HOSTS[0]}:{port}"
        for ws in socks + [replacement]:
            await ws.close()
        await until_idle(f"{HOSTS[0]}:{port}")


async def test_a_draining_worker_admits_nothing_and_ends_its_sessions_after_the_grace(fleet):
    port = int(fleet.workers[0].address.rsplit(":", 1)[1])
    dns = Dns(HOSTS[0], HOSTS[4])
    draining = next(w for w in fleet.workers if w.address == f"{HOSTS[4]}:{port}")
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as http:
        server = await start_gateway(stack, dns, port)
        socks = [await http.ws_connect(server.url) for _ in range(2)]
        sids = [(await first_event(ws))["session"]["id"] for ws in socks]
        on_draining = [worker_of(server, s) for s in sids].index(draining.address)
        handle = next(h for h in server.gateway.pool.handles if h.address == draining.address)
        draining.proc.send_signal(signal.SIGTERM)
        await until(lambda: handle.draining)
        assert not handle.placeable
        newcomer = await http.ws_connect(server.url)    # placed elsewhere while the drain runs
        assert worker_of(server, (await first_event(newcomer))["session"]["id"]) == f"{HOSTS[0]}:{port}"
        ended = await ticks(socks[on_draining], 200)      # it streams through the grace, then ends
        assert ended[-1]["type"] == "error" and ended[-1]["error"]["code"] == "worker_draining"
        assert sum(e["type"] == "metronome.tick" for e in ended) >= 1
        assert draining.proc.wait(timeout=20) == 0
        assert (await ticks(socks[1 - on_draining], 2))[-1]["type"] == "metronome.tick"
        for ws in socks + [newcomer]:
            await ws.close()
        await until_idle(f"{HOSTS[0]}:{port}")


async def test_a_draining_gateway_warns_its_sessions_refuses_new_ones_and_closes_with_1001(fleet):
    port = int(fleet.workers[0].address.rsplit(":", 1)[1])
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as http:
        server = await start_gateway(stack, Dns(HOSTS[0]), port, stop=False)   # the test stops it
        base = f"http://{server.address}"
        assert (await http.get(f"{base}/ready")).status == 200
        ws = await http.ws_connect(server.url)
        assert (await first_event(ws))["type"] == "session.created"
        drain = asyncio.create_task(server.drain(grace_s=1.0))
        events = await events_until(ws, lambda e: e["type"] == "session_ending")
        assert events[-1]["type"] == "session_ending" and events[-1]["ends_in_s"] == pytest.approx(1.0)
        assert (await http.get(f"{base}/ready")).status == 503
        assert (await http.get(f"{base}/live")).status == 200
        late = await http.ws_connect(server.url)
        refusal = await first_event(late)
        assert refusal["error"]["code"] == "server_draining"
        assert (await late.receive(timeout=10)).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        assert late.close_code == 1001
        await drain          # the grace is over with the session still open: stop closes it, going away
        await server.stop()
        ended = await events_until(ws, lambda e: False)
        assert ended[-1] == {"type": "closed", "code": 1001}
        await until_idle(f"{HOSTS[0]}:{port}")


async def test_sigterm_drains_a_gateway_process(fleet):
    """``metronome gateway`` as a process: SIGTERM warns its session, closes it with 1001 after the grace, exits 0."""
    worker = f"{HOSTS[0]}:{int(fleet.workers[0].address.rsplit(':', 1)[1])}"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "metronome", "gateway", "--workers", worker, "--port", str(port),
                             "--budget-ms", str(BUDGET_MS), "--drain-grace-s", "1"])
    try:
        async with aiohttp.ClientSession() as http:
            async def ready() -> bool:
                try:
                    return (await http.get(f"http://127.0.0.1:{port}/ready")).status == 200
                except aiohttp.ClientError:
                    return False

            async with asyncio.timeout(60):
                while not await ready():
                    assert proc.poll() is None, "the gateway exited"
                    await asyncio.sleep(0.1)
            ws = await http.ws_connect(f"ws://127.0.0.1:{port}/v1/realtime")
            assert (await first_event(ws))["type"] == "session.created"
            proc.send_signal(signal.SIGTERM)
            events = await events_until(ws, lambda e: False)
            assert [e["type"] for e in events].count("session_ending") == 1
            assert events[-1] == {"type": "closed", "code": 1001}
        assert await asyncio.to_thread(proc.wait, 20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    await until_idle(worker)
