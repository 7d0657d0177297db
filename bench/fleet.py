"""A fleet past one gateway: 2 gateways × 3 workers on loopback, the fleet changing while sessions stream.

Run from the repository root::

    .venv/bin/python bench/fleet.py                       # B = 200 ms, 3 sessions a worker (~1.5 min)

Every part is its own process: workers (``metronome worker``, ``energy`` adapter, a random 2-layer Llama
with SmolLM2's tokenizer, a static cap of ``--per-worker`` sessions so the fleet's capacity is known) on
127.0.0.1-4 at one port, and two gateways (``serve_gateway`` in a child of this script) that find the
workers through a DNS name, answered from a file this script rewrites (what a headless Service's DNS
does as pods come and go). Clients stream 20 ms of PCM16 each tick and record every event. In order:

1. **admit**: 1.5× the fleet's capacity connects at once, alternately through either gateway;
2. **join**: a fourth worker enters the name; time until both gateways place sessions there, then new
   sessions fill it;
3. **leave**: the first worker leaves the name: its sessions must keep streaming, none new go there;
4. **drain**: SIGTERM on the second worker (grace ``--grace-s``): its sessions end ``worker_draining``;
5. **kill**: SIGKILL on the third: its sessions end ``worker_unavailable``; time from the kill to each
   session's error;
6. **gateway drain**: SIGTERM on one gateway: its sessions get ``session_ending``, then close 1001.

Reported: admitted and refused against capacity, each worker's own count (over-admitted: above its cap),
sessions lost per phase against those the phase should cost, and the timings. A table goes to stdout;
everything raw to ``--out`` (default ``results/fleet.json``).
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
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import numpy as np

NAME = "workers.fleet.bench"
HOSTS = [f"127.0.0.{i}" for i in range(1, 5)]


def tiny_checkpoint() -> str:
    """A random 2-layer Llama with SmolLM2's tokenizer (and chat template), in a temporary directory."""
    from metronome.experiments.sweep import make_tiny_checkpoint

    return make_tiny_checkpoint(tempfile.mkdtemp(prefix="fleet-tiny-"), max_position_embeddings=8192)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str]) -> subprocess.Popen:
    """A server process; its log goes to a file (a pipe nobody reads would fill and stall it)."""
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=log, text=True)
    proc.log = log
    return proc


async def gateway_child(spec: str) -> None:
    """A gateway process: ``dns:`` workers answered from the hosts file; SIGTERM drains it."""
    from metronome.config import GatewayConfig
    from metronome.serving.gateway import serve_gateway

    port, worker_port, hosts_file, budget_ms, grace_s = spec.split(",")

    async def resolve(name: str, _port: int) -> list[str]:
        if name != NAME:
            raise socket.gaierror(f"unknown name {name}")
        return json.loads(Path(hosts_file).read_text())

    config = GatewayConfig(workers=(f"dns:{NAME}:{worker_port}",), port=int(port), budget_ms=float(budget_ms),
                           tokens_per_tick=2, discovery_interval_s=0.5, drain_grace_s=float(grace_s))
    server = await serve_gateway(config, resolve=resolve)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.drain(config.drain_grace_s)
    await server.stop()


async def wait_until(predicate, timeout_s: float, what: str) -> float:
    """Seconds until ``predicate()`` (an awaitable factory) is true; SystemExit after ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if await predicate():
            return time.monotonic() - t0
        await asyncio.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


async def worker_sessions(address: str) -> int | None:
    from metronome.serving.proto import worker_pb2 as pb
    from metronome.serving.proto import worker_pb2_grpc as pb_grpc

    try:
        async with grpc.aio.insecure_channel(address) as channel:
            return (await pb_grpc.WorkerStub(channel).Health(pb.HealthRequest(), timeout=2)).sessions
    except grpc.aio.AioRpcError:
        return None


async def gateway_health(http: aiohttp.ClientSession, port: int) -> dict:
    async with http.get(f"http://127.0.0.1:{port}/health") as reply:
        return await reply.json()


@dataclass
class Client:
    """One session: what it saw and when (``time.monotonic``)."""

    gateway: int
    first: dict | None = None
    ticks: int = 0
    ticks_at: list[float] = field(default_factory=list)
    ending: float | None = None        # session_ending received
    error: str = ""
    error_at: float | None = None
    close_code: int | None = None
    closed_at: float | None = None

    @property
    def admitted(self) -> bool:
        return self.first is not None and self.first["type"] == "session.created"

    def ticks_after(self, t: float) -> int:
        return sum(1 for at in self.ticks_at if at > t)


async def run_client(http: aiohttp.ClientSession, url: str, client: Client, stop: asyncio.Event,
                     admitted: asyncio.Event) -> None:
    chunk = base64.b64encode((np.random.default_rng(0).standard_normal(320) * 3000).astype("<i2").tobytes()).decode()
    async with http.ws_connect(url) as ws:
        async def close_on_stop() -> None:
            await stop.wait()
            await ws.close()

        closer = asyncio.create_task(close_on_stop())
        async for msg in ws:
            event = json.loads(msg.data)
            if client.first is None:
                client.first = event
                admitted.set()
            if event["type"] == "metronome.tick":
                client.ticks += 1
                client.ticks_at.append(time.monotonic())
            if event["type"] in ("session.created", "metronome.tick"):   # 20 ms of audio a tick, from the start
                await ws.send_json({"type": "input_audio_buffer.append", "audio": chunk})
            elif event["type"] == "session_ending":
                client.ending = time.monotonic()
            elif event["type"] == "error" and not client.error:
                client.error, client.error_at = event["error"]["code"], time.monotonic()
        client.close_code, client.closed_at = ws.close_code, time.monotonic()
        closer.cancel()
        admitted.set()


class Fleet:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.worker_port = free_port()
        self.hosts_file = Path(tempfile.mkdtemp(prefix="fleet-dns-")) / "hosts.json"
        self.workers: dict[str, subprocess.Popen] = {}
        self.gateway_ports = [free_port(), free_port()]
        self.gateways: list[subprocess.Popen] = []
        self.clients: list[Client] = []
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    def address(self, host: str) -> str:
        return f"{host}:{self.worker_port}"

    def publish(self, hosts: list[str]) -> None:
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(hosts))
        tmp.replace(self.hosts_file)   # atomic: a gateway never reads half a file

    def start_worker(self, host: str, checkpoint: str) -> None:
        a = self.args
        self.workers[host] = start(["-m", "metronome", "worker", "--model", checkpoint, "--adapter", "energy",
                                    "--budget-ms", str(a.budget_ms), "--sinks", "4", "--window", "64",
                                    "--block-size", "8", "--num-blocks", "800", "--threads", "1", "--host", host,
                                    "--port", str(self.worker_port), "--max-sessions", str(a.per_worker),
                                    "--target", "1.0", "--drain-grace-s", str(a.grace_s)])

    def start_gateways(self) -> None:
        for port in self.gateway_ports:
            spec = f"{port},{self.worker_port},{self.hosts_file},{self.args.budget_ms},{self.args.grace_s}"
            self.gateways.append(start([__file__, "--gateway-child", spec]))

    async def connect(self, http: aiohttp.ClientSession, gateway: int) -> Client:
        client = Client(gateway)
        self.clients.append(client)
        admitted = asyncio.Event()
        url = f"ws://127.0.0.1:{self.gateway_ports[gateway]}/v1/realtime"
        self.tasks.append(asyncio.create_task(run_client(http, url, client, self.stop, admitted)))
        await asyncio.wait_for(admitted.wait(), 30)
        return client

    async def counts(self, hosts: list[str]) -> dict[str, int | None]:
        found = await asyncio.gather(*(worker_sessions(self.address(h)) for h in hosts))
        return dict(zip(hosts, found))

    def shutdown(self) -> None:
        for proc in [*self.gateways, *self.workers.values()]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def run(args: argparse.Namespace, fleet: Fleet, checkpoint: str) -> dict:
    cap, B = args.per_worker, args.budget_ms / 1000.0
    out: dict = {}
    fleet.publish(HOSTS[:3])
    for host in HOSTS:
        fleet.start_worker(host, checkpoint)
    await wait_until(lambda: _all_up(fleet, HOSTS), 300, "the workers")
    fleet.start_gateways()
    async with aiohttp.ClientSession() as http:
        await wait_until(lambda: _gateways_see(http, fleet, 3), 120, "the gateways")

        # 1. admit: 1.5x capacity at once through both gateways
        offered = 3 * cap * 3 // 2
        t0 = time.monotonic()
        batch = await asyncio.gather(*(fleet.connect(http, i % 2) for i in range(offered)))
        admit_s = time.monotonic() - t0
        counts = await fleet.counts(HOSTS[:3])
        out["admit"] = {"offered": offered, "capacity": 3 * cap, "admitted": sum(c.admitted for c in batch),
                        "refused_overloaded": sum(c.first["type"] == "error" and
                                                  c.first["error"]["type"] == "server_overloaded" for c in batch),
                        "per_worker": counts, "over_admitted": sum(max(0, n - cap) for n in counts.values()),
                        "all_answered_s": admit_s}
        streaming = [c for c in batch if c.admitted]

        # 2. join: the fourth worker enters the name
        t_join = time.monotonic()
        fleet.publish(HOSTS)
        out["join"] = {"both_gateways_see_it_s": await wait_until(lambda: _gateways_see(http, fleet, 4), 60,
                                                                  "the joined worker")}
        joined = [await fleet.connect(http, i % 2) for i in range(cap)]
        out["join"].update(offered=cap, admitted=sum(c.admitted for c in joined),
                           on_new_worker=(await fleet.counts([HOSTS[3]]))[HOSTS[3]],
                           since_dns_change_s=time.monotonic() - t_join)
        streaming += [c for c in joined if c.admitted]

        # 3. leave: the first worker leaves the name; its sessions keep streaming
        before = (await fleet.counts([HOSTS[0]]))[HOSTS[0]]
        t_leave = time.monotonic()
        fleet.publish(HOSTS[1:])
        await asyncio.sleep(max(2.0, 10 * B))    # several discovery rounds and ticks with the worker gone from DNS
        after = await fleet.counts([HOSTS[0]])
        out["leave"] = {"sessions_on_it": before, "still_on_it": after[HOSTS[0]],
                        "lost": sum(1 for c in streaming if c.error_at and c.error_at > t_leave),
                        "ticks_after_leaving_min": min(c.ticks_after(t_leave) for c in streaming if not c.error)}

        # 4. drain the second worker
        on_drained = (await fleet.counts([HOSTS[1]]))[HOSTS[1]]
        t_drain = time.monotonic()
        fleet.workers[HOSTS[1]].send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(fleet.workers[HOSTS[1]].wait, 120)
        exit_s = time.monotonic() - t_drain
        await asyncio.sleep(2 * B)
        drained = [c for c in streaming if c.error == "worker_draining"]
        out["worker_drain"] = {"grace_s": args.grace_s, "sessions_on_it": on_drained, "ended_draining": len(drained),
                               "other_errors": sum(1 for c in streaming if c.error and c.error != "worker_draining"),
                               "end_after_sigterm_s": sorted(c.error_at - t_drain for c in drained),
                               "exit_s": exit_s, "exit_code": code}

        # 5. kill the third worker
        on_killed = (await fleet.counts([HOSTS[2]]))[HOSTS[2]]
        t_kill = time.monotonic()
        fleet.workers[HOSTS[2]].send_signal(signal.SIGKILL)
        await asyncio.to_thread(fleet.workers[HOSTS[2]].wait, 30)
        await asyncio.sleep(max(2.0, 5 * B))
        killed = [c for c in streaming if c.error == "worker_unavailable"]
        alive = [c for c in streaming if not c.error]
        out["kill"] = {"sessions_on_it": on_killed, "ended_unavailable": len(killed),
                       "error_after_kill_ms": sorted(1e3 * (c.error_at - t_kill) for c in killed),
                       "survivors": len(alive), "survivors_ticking": sum(1 for c in alive if c.ticks_after(t_kill + B))}

        # 6. drain gateway 0
        mine = [c for c in alive if c.gateway == 0]
        t_gw = time.monotonic()
        fleet.gateways[0].send_signal(signal.SIGTERM)
        gw_code = await asyncio.to_thread(fleet.gateways[0].wait, 120)
        await asyncio.sleep(2 * B)
        out["gateway_drain"] = {"grace_s": args.grace_s, "sessions": len(mine),
                                "got_session_ending": sum(1 for c in mine if c.ending),
                                "closed_1001": sum(1 for c in mine if c.close_code == 1001),
                                "closed_after_sigterm_s": sorted(c.closed_at - t_gw for c in mine if c.closed_at),
                                "exit_code": gw_code,
                                "other_gateway_sessions": sum(1 for c in alive if c.gateway == 1),
                                "other_gateway_ticking": sum(1 for c in alive if c.gateway == 1
                                                             and c.ticks_after(t_gw + B))}
        fleet.stop.set()
        await asyncio.gather(*fleet.tasks, return_exceptions=True)
    return out


async def _all_up(fleet: Fleet, hosts: list[str]) -> bool:
    for host in hosts:
        if fleet.workers[host].poll() is not None:
            fleet.workers[host].log.seek(0)
            raise SystemExit(f"worker {host} exited: {fleet.workers[host].log.read()[-2000:]}")
    return all(n is not None for n in (await fleet.counts(hosts)).values())


async def _gateways_see(http: aiohttp.ClientSession, fleet: Fleet, n: int) -> bool:
    try:
        healths = await asyncio.gather(*(gateway_health(http, p) for p in fleet.gateway_ports))
    except aiohttp.ClientError:
        return False
    return all(sum(w["healthy"] for w in h["workers"]) >= n for h in healths)


def table(r: dict) -> str:
    a, j, lv, d, k, g = r["admit"], r["join"], r["leave"], r["worker_drain"], r["kill"], r["gateway_drain"]
    ms = lambda xs: f"{xs[0]:.0f}–{xs[-1]:.0f} ms" if xs else "-"   # noqa: E731
    s = lambda xs: f"{xs[0]:.2f}–{xs[-1]:.2f} s" if xs else "-"     # noqa: E731
    rows = [
        ("admit", f"{a['offered']} offered through 2 gateways, capacity {a['capacity']}",
         f"{a['admitted']} admitted, {a['refused_overloaded']} refused (overloaded), over-admitted "
         f"{a['over_admitted']}; per worker {list(a['per_worker'].values())}; all answered in "
         f"{a['all_answered_s']:.2f} s"),
        ("join", "a 4th worker enters the DNS name",
         f"both gateways use it after {j['both_gateways_see_it_s']:.2f} s; {j['admitted']}/{j['offered']} new "
         f"sessions admitted, {j['on_new_worker']} on it"),
        ("leave", "the 1st worker leaves the name",
         f"{lv['sessions_on_it']} sessions on it, {lv['still_on_it']} still streaming there, {lv['lost']} lost; "
         f"every live session ticked >= {lv['ticks_after_leaving_min']} times since"),
        ("worker drain", f"SIGTERM on the 2nd worker, grace {d['grace_s']:g} s",
         f"{d['ended_draining']}/{d['sessions_on_it']} of its sessions ended worker_draining after "
         f"{s(d['end_after_sigterm_s'])}; {d['other_errors']} other errors; exit {d['exit_code']} after "
         f"{d['exit_s']:.2f} s"),
        ("kill", "SIGKILL on the 3rd worker",
         f"{k['ended_unavailable']}/{k['sessions_on_it']} of its sessions ended worker_unavailable "
         f"{ms(k['error_after_kill_ms'])} after the kill; {k['survivors_ticking']}/{k['survivors']} others ticking"),
        ("gateway drain", f"SIGTERM on gateway 1, grace {g['grace_s']:g} s",
         f"{g['got_session_ending']}/{g['sessions']} got session_ending, {g['closed_1001']} closed 1001 after "
         f"{s(g['closed_after_sigterm_s'])}; exit {g['exit_code']}; {g['other_gateway_ticking']}/"
         f"{g['other_gateway_sessions']} sessions on the other gateway ticking"),
    ]
    lines = ["| phase | what | result |", "|---|---|---|"]
    return "\n".join(lines + [f"| {p} | {w} | {r} |" for p, w, r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--budget-ms", type=float, default=200.0, help="frame budget B")
    parser.add_argument("--per-worker", type=int, default=3, help="each worker's static session cap")
    parser.add_argument("--grace-s", type=float, default=2.0, help="drain grace of workers and gateways")
    parser.add_argument("--model", default="tiny", help="'tiny' or a checkpoint directory")
    parser.add_argument("--out", default="results/fleet.json")
    parser.add_argument("--gateway-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gateway_child:
        asyncio.run(gateway_child(args.gateway_child))
        return
    checkpoint = tiny_checkpoint() if args.model == "tiny" else args.model
    fleet = Fleet(args)
    try:
        result = asyncio.run(run(args, fleet, checkpoint))
    finally:
        fleet.shutdown()
    print(table(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "processor": platform.processor(),
                    "load_avg_end": os.getloadavg()},
        "args": {k: v for k, v in vars(args).items() if k != "gateway_child"}, "result": result}, indent=1))


if __name__ == "__main__":
    main()
