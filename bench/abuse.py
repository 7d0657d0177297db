"""Abusive clients: the tick latency of well-behaved sessions with 0, 1 and 3 abusers on the same worker.

Run from the repository root::

    .venv/bin/python bench/abuse.py                        # B = 200 ms and 2 s, 0/1/3 abusers of each kind (~8 min)
    .venv/bin/python bench/abuse.py --budgets-ms 200 --duration-s 10        # a quick look

Per point a fresh worker (``metronome worker`` with the ``energy`` adapter, so a tick's cost is the
engine's and the tokenizer's, no ASR; 4 tokens a tick; ``--model tiny``, the default, is a random
2-layer Llama with SmolLM2's tokenizer: what abusers cost is tokenizing and front-end work, the same
for any model, and a tiny decoder keeps the victims' own ticks short on a shared 2-core box, so the
abusers' cost is what moves them; ``--model smollm2-135m`` runs the packaged model) and a fresh gateway (``run_gateway``, the
AIMD controller at its defaults but never below the victims plus 3, so every abuser is admitted) run as
processes, with a worker token between them. Two **victims**
stream 20 ms chunks of 16 kHz PCM16 in real time and record every ``metronome.tick``. **Abusers**
connect beside them and send, every tick, either

* ``1MB``: a ~1 MB typed user message (what once took the worker's engine thread about 0.4 s per
  message to tokenize, before its token limit refused it), or
* ``8KB``: 8 KB of dense text per tick (CJK characters, ~2 tokens each): within the gateway's bytes
  per tick, about 6,000 tokens, over the worker's 1,024-token limit: counted on the worker's token
  thread and refused there;

an abuser that is closed (1008, abuse) connects again at once. Reported per point: the victims' tick
latency p50 / p95 / max, deadline misses, the AIMD cap at the end, and how often abusers were closed.
**Target**: with abusers, the victims' p95 stays within 0.1·B of their p95 without, and no deadline is
missed. A table goes to stdout; everything raw to ``--out`` (default ``results/abuse.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np

VICTIMS = 2
KINDS = {
    "1MB": "The quick brown fox jumps over the lazy dog. " * 22_000,
    "8KB": "".join(chr(0x4E00 + i % 2000) for i in range(2_700)),   # 8.1 KB of UTF-8, ~2 tokens a character
}


def tiny_checkpoint() -> str:
    """A random 2-layer Llama with SmolLM2's tokenizer (and chat template), in a temporary directory."""
    import tempfile

    from metronome.experiments.sweep import make_tiny_checkpoint

    return make_tiny_checkpoint(tempfile.mkdtemp(prefix="abuse-tiny-"), max_position_embeddings=8192)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """A server process; its log goes to a file (a pipe nobody reads would fill and stall it)."""
    import tempfile

    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    proc.log = log
    return proc


def serve_gateway(worker: str, port: int, budget_ms: float) -> None:
    """The gateway child process: production ``run_gateway``, the cap floored so abusers get in."""
    from metronome.config import AimdConfig, GatewayConfig
    from metronome.serving.gateway import run_gateway

    run_gateway(GatewayConfig(workers=(worker,), port=port, budget_ms=budget_ms, tokens_per_tick=4,
                              worker_token=os.environ["METRONOME_WORKER_TOKEN"],
                              aimd=AimdConfig(initial_cap=16, min_cap=VICTIMS + 3), admission="gateway"))


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            proc.log.seek(0)
            raise SystemExit(f"a server exited: {proc.log.read()[-2000:]}")
        try:
            health = json.load(urllib.request.urlopen(url, timeout=2))
            if health["status"] == "ok":
                return health
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready after {timeout_s:.0f} s")


async def victim(url: str, stop: asyncio.Event, ticks: list[dict]) -> None:
    rng = np.random.default_rng(len(ticks))
    chunk = base64.b64encode((rng.standard_normal(320) * 3000).astype("<i2").tobytes()).decode()
    async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
        async def read() -> None:
            async for msg in ws:
                event = json.loads(msg.data)
                if event["type"] == "metronome.tick":
                    ticks.append(event)

        await ws.send_json({"type": "session.update",    # 320 samples are 20 ms at 16 kHz (the default is 24)
                            "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}})
        reader = asyncio.create_task(read())
        next_at = time.monotonic()
        while not stop.is_set():
            await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            next_at += 0.02
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        reader.cancel()


async def abuser(url: str, message: str, budget_s: float, stop: asyncio.Event, closes: list[int]) -> None:
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            async with http.ws_connect(url, max_msg_size=0) as ws:
                async def read() -> None:
                    async for _ in ws:
                        pass

                reader = asyncio.create_task(read())
                while not stop.is_set() and not reader.done():
                    try:
                        await ws.send_str(message)
                    except aiohttp.ClientConnectionResetError:
                        break
                    await asyncio.sleep(budget_s)
                await asyncio.wait([reader], timeout=3)
                closes.append(ws.close_code or 0)
                reader.cancel()


async def measure(url: str, budget_ms: float, abusers: int, kind: str, warmup_s: float, duration_s: float) -> dict:
    stop = asyncio.Event()
    victims: list[list[dict]] = [[] for _ in range(VICTIMS)]
    closes: list[int] = []
    tasks = [asyncio.create_task(victim(url, stop, ticks)) for ticks in victims]
    await asyncio.sleep(warmup_s)
    start_counts = [len(t) for t in victims]
    message = json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": KINDS[kind]}]}})
    tasks += [asyncio.create_task(abuser(url, message, budget_ms / 1000.0, stop, closes)) for _ in range(abusers)]
    await asyncio.sleep(duration_s)
    stop.set()
    await asyncio.wait(tasks, timeout=10)
    ticks = [t for v, n in zip(victims, start_counts) for t in v[n:]]
    latencies = np.array([t["latency_ms"] for t in ticks]) if ticks else np.zeros(1)
    return {"budget_ms": budget_ms, "abusers": abusers, "kind": kind if abusers else "-", "ticks": len(ticks),
            "p50_ms": float(np.percentile(latencies, 50)), "p95_ms": float(np.percentile(latencies, 95)),
            "max_ms": float(latencies.max()), "misses": sum(not t["deadline_met"] for t in ticks),
            "abuser_closes": len(closes), "abuse_closes_1008": closes.count(1008),
            "latency_ms": latencies.round(2).tolist()}


def run_point(budget_ms: float, abusers: int, kind: str, args: argparse.Namespace) -> dict:
    token = secrets.token_urlsafe(32)
    root = str(Path(__file__).resolve().parent.parent)   # this checkout's metronome, also for the gateway child
    env = {**os.environ, "METRONOME_WORKER_TOKEN": token,
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    worker_port, port = free_port(), free_port()
    worker = start(["-m", "metronome", "worker", "--model", args.model, "--adapter", "energy", "--budget-ms",
                    str(budget_ms), "--port", str(worker_port), "--threads", str(args.threads)], env)
    gateway = None
    try:
        gateway = start([__file__, "--gateway-child", f"127.0.0.1:{worker_port},{port},{budget_ms}"], env)
        wait_http(f"http://127.0.0.1:{port}/health", gateway)
        point = asyncio.run(measure(f"ws://127.0.0.1:{port}/v1/realtime", budget_ms, abusers, kind,
                                    args.warmup_s, args.duration_s))
        health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5))
        point["cap_at_end"] = health["workers"][0]["cap"]
        point["load_avg_1min"] = os.getloadavg()[0]   # a shared box: what else ran meanwhile
        return point
    finally:
        for proc in (gateway, worker):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets-ms", default="200,2000")
    parser.add_argument("--abusers", default="0,1,3")
    parser.add_argument("--kinds", default="1MB,8KB")
    parser.add_argument("--model", default="tiny", help="'tiny' (default), 'smollm2-135m' or a checkpoint directory")
    parser.add_argument("--threads", type=int, default=1, help="the worker's torch threads")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--duration-s", type=float, default=None, help="default: 150 ticks at 200 ms, 20 at 2 s")
    parser.add_argument("--out", default="results/abuse.json")
    parser.add_argument("--gateway-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gateway_child:
        worker, port, budget_ms = args.gateway_child.split(",")
        serve_gateway(worker, int(port), float(budget_ms))
        return
    duration = args.duration_s
    if args.model == "tiny":
        args.model = tiny_checkpoint()
    points = []
    print("| B | abusers | kind | victim ticks | p50 | p95 | max | deadline misses | AIMD cap at end | "
          "abusers closed (1008) | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for budget_ms in (float(b) for b in args.budgets_ms.split(",")):
        args.duration_s = duration or max(30.0, 20 * budget_ms / 1000.0)
        for abusers in (int(a) for a in args.abusers.split(",")):
            for kind in (args.kinds.split(",") if abusers else ["-"]):
                print(f"B = {budget_ms:g} ms, {abusers} abusers ({kind})...", file=sys.stderr, flush=True)
                p = run_point(budget_ms, abusers, kind if abusers else "1MB", args)
                p["kind"] = kind
                points.append(p)
                print(f"| {budget_ms:g} ms | {abusers} | {kind} | {p['ticks']} | {p['p50_ms']:.1f} ms | "
                      f"{p['p95_ms']:.1f} ms | {p['max_ms']:.1f} ms | {p['misses']} | {p['cap_at_end']} | "
                      f"{p['abuser_closes']} ({p['abuse_closes_1008']}) | {p['load_avg_1min']:.1f} |", flush=True)
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps({
                    "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                "processor": platform.processor(), "load_avg_start": os.getloadavg()},
                    "args": {k: v for k, v in vars(args).items()}, "points": points}, indent=1))


if __name__ == "__main__":
    main()
