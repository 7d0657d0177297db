"""Gateway benchmark: how many sessions streaming 20 ms audio chunks one gateway process sustains.

Run on an otherwise idle machine::

    python bench/gateway.py                     # sweep N = 100,250,500,1000,1500, 20 s each (~3 min)
    python bench/gateway.py --quick             # smoke run: N = 50,100, 10 s each (~45 s)
    python bench/gateway.py --sessions 250,500,1000 --out results/gateway_bench.json

Figures: docs/benchmarks/gateway.md.

Each sweep point starts three kinds of process, fresh, so the gateway is measured alone:

* a **no-op worker** (``bench/noop_worker.py``): the real gRPC ``Worker`` service answering every
  ``Step`` at once with one ``"."`` delta per session (no model), and logging each Step's arrival
  time and audio bytes;
* the **gateway** (``metronome.serving.gateway.run_gateway``: picows on uvloop, the production entry
  point; ``--transport aiohttp`` runs ``Gateway.app`` on aiohttp instead) with budget B (``--budget-ms``,
  default 1000 ms), ``max_sessions=None`` and an AIMD controller pinned open (``initial_cap = min_cap = N + 10``, ``target_fraction = 1``), so admission never
  interferes;
* ``--generators`` **load generator** processes (default 1) on uvloop. They speak WebSocket over raw
  asyncio protocols: one pre-encoded, pre-masked ``input_audio_buffer.append`` frame (20 ms of
  16 kHz PCM16 = 640 bytes, base64 in JSON, ~900 bytes on the wire) is written per session every
  20 ms, so the generator's cost per message is one ``transport.write``. Sessions connect over a
  ramp (``--ramp-s``, default max(2 s, N / 250 per s)), each waits for ``session.created``, then
  streams. Sessions are phase-staggered over 10 slots 2 ms apart, paced by CLOCK_MONOTONIC; the
  generator records its own lateness against that schedule, so generator saturation is told apart
  from gateway saturation (a chunk more than 100 ms late is skipped and counted, never burst).

After the ramp and ``--warmup-s`` the measurement window (``--duration-s``, default 20 s) runs.
Reported per N (all times CLOCK_MONOTONIC, shared by all processes):

* **gateway drift**: the ``drift_ms`` field of ``metronome.tick`` (tick start minus its schedule,
  as the gateway's ticker measures it on uvloop's millisecond loop clock), one sample per tick;
* **client cadence error**: per session, the interval between consecutive ``metronome.tick``
  arrivals minus B; p50/p99 of its absolute value over all sessions and ticks. This is what a
  client sees: it includes the Step round trip to the worker and the fan-out of the tick to N
  sockets (reported as its own, stricter verdict: ``client_verdict``);
* **fan-out**: per tick, last minus first arrival of that tick's event over all sessions;
* **tick latency**: ``latency_ms`` of ``metronome.tick`` (the Step round trip), and the worker's
  Step inter-arrival error (request build + gRPC transfer jitter);
* **messages/s**: offered by the generators (appends written), *ingested* by the gateway (audio
  bytes that reached the worker in Steps / 640: below offered means the gateway fell behind
  reading its sockets), and out (events the clients received);
* **CPU**: gateway, generator(s) and worker processes (utime + stime from ``/proc/<pid>/stat``, in
  % of one core), and the whole box (``/proc/stat``, % of all cores; ``other`` = the box minus
  these processes: another job on a shared machine shows up there);
* generator lateness p99 and skipped chunks, sessions connected / refused / closed, error events.

A point **passes** (the target: the gateway sustains the load with its tick cadence held)
when all N sessions were admitted and streamed without errors, the gateway ingested >= 99 % of the
offered audio, and the p99 gateway drift is <= 2 % of B. When the generator itself ran late (lateness
p99 > 10 ms or skipped chunks) a failing point is marked inconclusive: the load, not the gateway, may
be what broke. ``client_verdict`` is "pass" when, in addition, the p99 client cadence error is <= 2 %
of B (the Step round trip's jitter then stays below it too).

A table goes to stdout, progress to stderr, everything raw (per tick drift/latency/fan-out, worker
Steps, quantiles, machine info, log tails of the child processes) to ``--out`` (default
``results/gateway_bench.json``), rewritten after every point. ``--profile-gateway DIR`` runs the
gateway under cProfile (slower; for finding hot spots, not for the numbers) and writes
``DIR/gateway_N.prof`` plus a top-30 text summary.

Only meaningful on an otherwise idle machine: on 2 cores the gateway, the generator and the
worker share the CPUs, and any other busy process shows up as ``other`` CPU and as lateness.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as dt
import json
import logging
import math
import multiprocessing as mp
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).resolve().parent   # bench/: the no-op worker sits beside this script

DEFAULT_SESSIONS = "100,250,500,1000,1500"
QUICK = dict(sessions="50,100", duration_s=10.0)
SAMPLE_RATE = 16000
CHUNK_MS = 20
CHUNK_BYTES = SAMPLE_RATE * 2 * CHUNK_MS // 1000   # 640 bytes of PCM16
SLOTS = 10                  # phase groups per chunk period (2 ms apart at 20 ms)
MAX_BEHIND_S = 0.1          # a generator slot later than this is skipped (counted), not burst
TARGET_FRACTION = 0.02      # the target: p99 drift <= 2 % of B
GEN_LATE_MS = 10.0          # generator lateness p99 above this: the load itself was late
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ============================================================================================ building blocks
def raise_nofile() -> int:
    """Soft RLIMIT_NOFILE := hard (N sockets on each end need it); returns the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def quantiles(values, qs=(50, 90, 99, 99.9, 100)) -> dict[str, float] | None:
    if values is None or len(values) == 0:
        return None
    import numpy as np

    arr = np.asarray(values, dtype=float)
    out = {f"p{q:g}": round(float(np.percentile(arr, q)), 3) for q in qs}
    out["mean"] = round(float(arr.mean()), 3)
    out["n"] = int(arr.size)
    return out


def proc_cpu_s(pid: int) -> tuple[float, float] | None:
    """(utime, stime) of a process (all its threads), seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def proc_rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def box_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine from /proc/stat."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    total = sum(parts[:8])
    return total - idle, total


def tail(path: Path, lines: int = 20) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


# ============================================================================================ frames
def masked_frame(payload: bytes, mask: bytes, opcode: int = 0x1) -> bytes:
    """One final client frame (RFC 6455 §5.2): clients must mask; the server unmasks with any key."""
    n = len(payload)
    if n < 126:
        header = bytes([0x80 | opcode, 0x80 | n])
    elif n < 1 << 16:
        header = bytes([0x80 | opcode, 0x80 | 126]) + n.to_bytes(2, "big")
    else:
        header = bytes([0x80 | opcode, 0x80 | 127]) + n.to_bytes(8, "big")
    key = (mask * (n // 4 + 1))[:n]
    body = (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(n, "big") if n else b""
    return header + mask + body


def append_frames(mask: bytes, seconds: float = 1.0) -> list[bytes]:
    """``seconds`` of a 440 Hz tone as pre-encoded, pre-masked 20 ms append frames (cycled)."""
    import numpy as np

    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    pcm = (np.sin(2 * math.pi * 440 * t) * 0.2 * 32767).astype("<i2").tobytes()
    frames = []
    for i in range(0, len(pcm) - CHUNK_BYTES + 1, CHUNK_BYTES):
        event = {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + CHUNK_BYTES]).decode()}
        frames.append(masked_frame(json.dumps(event, separators=(",", ":")).encode(), mask))
    return frames


class ServerEvent(msgspec.Struct):
    """The fields of a gateway event the generator looks at (the rest is skipped while decoding)."""

    type: str
    tick: int = 0
    drift_ms: float = 0.0
    latency_ms: float = 0.0
    batch: int = 0
    deadline_met: bool = True
    error: dict | None = None


_decode_event = msgspec.json.Decoder(ServerEvent).decode
# The gateway encodes events compactly with "type" first: text deltas (half of what arrives) are
# recognised by their first bytes and only counted, which keeps the generator's fan-out bursts short.
DELTA_PREFIX = b'{"type":"response.output_text.delta"'


# ============================================================================================ generator
class Client(asyncio.Protocol):
    """One session: WebSocket handshake and frame parsing on a raw asyncio protocol."""

    __slots__ = ("gen", "index", "transport", "buf", "handshaken", "created", "paused", "gone", "ticks",
                 "t_connect", "t_created", "close_code", "close_reason", "backpressured")

    def __init__(self, gen: Generator, index: int) -> None:
        self.gen = gen
        self.index = index
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.handshaken = False
        self.created = False
        self.paused = False
        self.gone = False
        self.ticks: list[tuple[int, float]] = []   # (tick, arrival) of every metronome.tick
        self.t_connect = time.monotonic()
        self.t_created: float | None = None
        self.close_code: int | None = None
        self.close_reason = ""
        self.backpressured = 0

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(self.gen.handshake)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False

    def connection_lost(self, exc) -> None:
        self.gone = True
        if not self.gen.stopping:
            self.gen.lost[type(exc).__name__ if exc else "eof"] += 1

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        buf = self.buf
        buf += data
        if not self.handshaken:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            status = bytes(buf[:buf.find(b"\r\n")])
            del buf[:end + 4]
            if b" 101 " not in status:
                self.gen.errors["handshake: " + status.decode(errors="replace")[:60]] += 1
                self.transport.close()
                return
            self.handshaken = True
        pos, n = 0, len(buf)
        while n - pos >= 2:
            b1 = buf[pos + 1]
            length, head = b1 & 0x7F, 2
            if length == 126:
                if n - pos < 4:
                    break
                length, head = int.from_bytes(buf[pos + 2:pos + 4], "big"), 4
            elif length == 127:
                if n - pos < 10:
                    break
                length, head = int.from_bytes(buf[pos + 2:pos + 10], "big"), 10
            if b1 & 0x80:  # a masked server frame: not expected, but skip its key correctly
                head += 4
            if n - pos < head + length:
                break
            opcode = buf[pos] & 0x0F
            payload = bytes(buf[pos + head:pos + head + length])
            pos += head + length
            self.gen.on_frame(self, opcode, payload, now)
        if pos:
            del buf[:pos]

    def send_close(self) -> None:
        if self.transport is not None and not self.gone:
            self.transport.write(masked_frame((1000).to_bytes(2, "big"), self.gen.mask, opcode=0x8))
            self.transport.close()


class Generator:
    """A share of the N sessions: connects them on the ramp, streams their chunks, records events."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.host, self.port = spec["host"], spec["port"]
        self.indices: list[int] = spec["indices"]
        self.n_total: int = spec["n_total"]
        self.mask = os.urandom(4)
        self.frames = append_frames(self.mask)
        key = base64.b64encode(os.urandom(16)).decode()
        self.handshake = (f"GET /v1/realtime HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nUpgrade: websocket\r\n"
                          f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                          ).encode()
        self.clients: list[Client] = []
        self.groups: list[list[Client]] = [[] for _ in range(SLOTS)]
        self.stopping = False
        self.errors: Counter[str] = Counter()        # error events by code, handshake failures
        self.lost: Counter[str] = Counter()          # connections lost before the end
        self.connect_errors: Counter[str] = Counter()
        self.closes: Counter[str] = Counter()        # close frames from the server, "code reason"
        self.types_in_window: Counter[str] = Counter()
        self.recv_total = 0
        self.tick_info: dict[int, tuple[float, float, int, bool]] = {}
        self.lateness_ms: list[float] = []
        self.sent_window = 0
        self.sent_total = 0
        self.skipped_late = 0
        self.skipped_backpressure = 0

    # ------------------------------------------------------------------ events
    def on_frame(self, client: Client, opcode: int, payload: bytes, now: float) -> None:
        if opcode == 0x1:
            self.recv_total += 1
            if payload.startswith(DELTA_PREFIX):  # one per session per tick: counted, not decoded
                if self.spec["measure_start"] <= now < self.spec["measure_end"]:
                    self.types_in_window["response.output_text.delta"] += 1
                return
            try:
                event = _decode_event(payload)
            except msgspec.DecodeError:
                self.errors["undecodable event"] += 1
                return
            kind = event.type
            if self.spec["measure_start"] <= now < self.spec["measure_end"]:
                self.types_in_window[kind] += 1
            if kind == "metronome.tick":
                client.ticks.append((event.tick, now))
                if event.tick not in self.tick_info:
                    self.tick_info[event.tick] = (event.drift_ms, event.latency_ms, event.batch, event.deadline_met)
            elif kind == "session.created":
                client.created = True
                client.t_created = now
                self.groups[client.index % SLOTS].append(client)
            elif kind == "error":
                code = (event.error or {}).get("code") or (event.error or {}).get("type") or "?"
                self.errors[str(code)] += 1
        elif opcode == 0x8:
            code = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else 1005
            client.close_code = code
            client.close_reason = payload[2:].decode(errors="replace")
            if not self.stopping:
                self.closes[f"{code} {client.close_reason}".strip()] += 1
            client.gone = True
            client.transport.close()
        elif opcode == 0x9:  # ping: answer with a pong carrying the same payload
            client.transport.write(masked_frame(payload, self.mask, opcode=0xA))

    # ------------------------------------------------------------------ tasks
    async def _connect(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        client = Client(self, index)
        try:
            await loop.create_connection(lambda: client, self.host, self.port)
        except OSError as exc:
            self.connect_errors[type(exc).__name__] += 1
            return
        self.clients.append(client)

    async def _ramp(self) -> None:
        s = self.spec
        tasks = []
        for index in self.indices:
            at = s["t_start"] + s["ramp_s"] * index / self.n_total
            delay = at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(self._connect(index)))
        await asyncio.gather(*tasks)

    async def _stream(self) -> None:
        s = self.spec
        slot_s = CHUNK_MS / 1000 / SLOTS
        t0, stop_at = s["t_start"], s["stop_at"]
        m0, m1 = s["measure_start"], s["measure_end"]
        frames, nframes = self.frames, len(self.frames)
        k = 0
        while True:
            target = t0 + k * slot_s
            now = time.monotonic()
            if target > now:
                await asyncio.sleep(target - now)
                now = time.monotonic()
            if now >= stop_at:
                return
            late = now - target
            if late > MAX_BEHIND_S:  # far behind: skip whole slots (counted), never burst to catch up
                behind = int(late / slot_s)
                for j in range(k, k + behind):
                    self.skipped_late += len(self.groups[j % SLOTS])
                k += behind
                continue
            group = self.groups[k % SLOTS]
            frame = frames[(k // SLOTS) % nframes]
            sent = 0
            for client in group:
                if client.gone:
                    continue
                if client.paused:  # the gateway is not reading this socket: do not pile up memory
                    client.backpressured += 1
                    self.skipped_backpressure += 1
                    continue
                client.transport.write(frame)
                sent += 1
            self.sent_total += sent
            if m0 <= target < m1:
                self.sent_window += sent
                self.lateness_ms.append(late * 1e3)
            k += 1

    async def run(self) -> dict[str, Any]:
        s = self.spec
        ramp = asyncio.ensure_future(self._ramp())
        stream = asyncio.ensure_future(self._stream())
        await stream
        self.stopping = True
        ramp.cancel()
        await asyncio.gather(ramp, return_exceptions=True)
        for client in self.clients:
            client.send_close()
        await asyncio.sleep(0.2)
        return self.result(s)

    # ------------------------------------------------------------------ summary
    def result(self, s: dict[str, Any]) -> dict[str, Any]:
        budget_s = s["budget_ms"] / 1000.0
        m0, m1 = s["measure_start"], s["measure_end"]
        interval_err_ms: list[float] = []
        tick_gaps = 0
        fanout: dict[int, list[float]] = {}   # tick -> [first, last, count]
        no_ticks = 0
        created_ms = []
        for c in self.clients:
            if c.t_created is not None:
                created_ms.append((c.t_created - c.t_connect) * 1e3)
            in_window = 0
            prev: tuple[int, float] | None = None
            for tick, t in c.ticks:
                f = fanout.get(tick)
                if f is None:
                    fanout[tick] = [t, t, 1]
                else:
                    f[0] = min(f[0], t)
                    f[1] = max(f[1], t)
                    f[2] += 1
                if m0 <= t < m1:
                    in_window += 1
                    if prev is not None:
                        if tick == prev[0] + 1:
                            interval_err_ms.append(((t - prev[1]) - budget_s) * 1e3)
                        else:
                            tick_gaps += 1
                prev = (tick, t)
            if c.created and in_window == 0:
                no_ticks += 1
        return {
            "sessions": len(self.indices),
            "connected": sum(c.handshaken for c in self.clients),
            "created": sum(c.created for c in self.clients),
            "connect_errors": dict(self.connect_errors),
            "lost": dict(self.lost),
            "server_closes": dict(self.closes),
            "errors": dict(self.errors),
            "sessions_without_ticks": no_ticks,
            "tick_gaps": tick_gaps,
            "interval_err_ms": interval_err_ms,
            "fanout": {k: v for k, v in fanout.items()},
            "tick_info": self.tick_info,
            "lateness_ms": self.lateness_ms,
            "created_ms": created_ms,
            "sent_window": self.sent_window,
            "sent_total": self.sent_total,
            "recv_total": self.recv_total,
            "types_in_window": dict(self.types_in_window),
            "skipped_late": self.skipped_late,
            "skipped_backpressure": self.skipped_backpressure,
            "backpressured_sessions": sum(c.backpressured > 0 for c in self.clients),
        }


def generator_main(conn, spec: dict[str, Any]) -> None:
    """Child process: say ready, receive the shared schedule, run, send the result back."""
    raise_nofile()
    if spec.get("cpus"):
        os.sched_setaffinity(0, spec["cpus"])
    import uvloop

    conn.send("ready")
    schedule = conn.recv()
    if schedule is None:
        return
    spec.update(schedule)
    try:
        result = uvloop.run(Generator(spec).run())
    except BaseException as exc:  # noqa: BLE001 - report, do not hang the parent
        result = {"fatal": f"{type(exc).__name__}: {exc}"}
    conn.send(result)


# ============================================================================================ gateway
def run_aiohttp_gateway(config) -> None:
    """The gateway on its aiohttp transport (``Gateway.app``), on uvloop: the baseline for ``--transport``."""
    import uvloop
    from aiohttp import web

    from metronome.serving.gateway import Gateway

    web.run_app(Gateway(config).app, host=config.host, port=config.port, print=None, access_log=None,
                loop=uvloop.new_event_loop())


def gateway_main(config, log_path: str, profile_path: str | None, cpus: set[int] | None = None,
                 transport: str = "picows") -> None:
    """Child process: the production entry point ``run_gateway`` (picows on uvloop), stderr to a log file."""
    raise_nofile()
    if cpus:
        os.sched_setaffinity(0, cpus)  # before grpc starts its threads: they inherit it
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from metronome.serving.gateway import run_gateway

    run = run_gateway if transport == "picows" else run_aiohttp_gateway
    if not profile_path:
        run(config)
        return
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    try:
        run(config)
    finally:
        profile.disable()
        profile.dump_stats(profile_path)
        with open(profile_path + ".txt", "w") as f:
            stats = pstats.Stats(profile, stream=f).strip_dirs()
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(30)


# ============================================================================================ one point
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def scrape_metrics(text: str) -> dict[str, float]:
    """The gateway's Prometheus counters that matter here, summed over labels."""
    wanted = ("metronome_sessions_admitted_total", "metronome_sessions_rejected_total", "metronome_ticks_total",
              "metronome_deadline_misses_total", "metronome_client_errors_total")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def run_point(n: int, args, logdir: Path, bar_position: int = 1) -> dict[str, Any]:
    from tqdm import tqdm

    from metronome.config import AimdConfig, GatewayConfig

    ctx = mp.get_context("spawn")
    budget_ms = args.budget_ms
    ramp_s = args.ramp_s if args.ramp_s is not None else max(2.0, n / 250.0)
    warmup_s = args.warmup_s if args.warmup_s is not None else max(3.0, 2 * budget_ms / 1000.0)
    paths = {k: logdir / f"n{n}.{k}" for k in ("worker.log", "gateway.log", "steps.jsonl")}
    for p in paths.values():
        p.unlink(missing_ok=True)
    point: dict[str, Any] = {"sessions": n, "budget_ms": budget_ms, "ramp_s": ramp_s, "warmup_s": warmup_s,
                             "duration_s": args.duration_s, "generators": args.generators,
                             "transport": args.transport}
    worker = gateway = None
    gateway_cpus = load_cpus = None
    usable = sorted(os.sched_getaffinity(0))
    if args.pin and len(usable) >= 2:
        gateway_cpus, load_cpus = {usable[0]}, set(usable[1:])
    point["pinned"] = {"gateway": sorted(gateway_cpus), "load": sorted(load_cpus)} if gateway_cpus else None
    gens: list[tuple[Any, Any]] = []
    completed = False  # False in the finally: interrupted or failed, so stop the children at once
    try:
        # ---- worker
        with open(paths["worker.log"], "w") as wlog:
            worker = subprocess.Popen([sys.executable, str(HERE / "noop_worker.py"), "--port", "0",
                                       "--budget-ms", str(budget_ms), "--stats", str(paths["steps.jsonl"])],
                                      stdout=subprocess.PIPE, stderr=wlog, text=True,
                                      preexec_fn=(lambda: os.sched_setaffinity(0, load_cpus)) if load_cpus else None)
        line = worker.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"the no-op worker did not start: {tail(paths['worker.log'])}")
        worker_addr = f"127.0.0.1:{int(line.split()[1])}"
        # ---- gateway
        port = free_port()
        cap = n + 10
        config = GatewayConfig(workers=(worker_addr,), host="127.0.0.1", port=port, budget_ms=budget_ms,
                               tokens_per_tick=args.tokens_per_tick, max_sessions=None,
                               stream_interval_ms=args.stream_interval_ms,
                               # The gateway's own controller, held open: every offered session is admitted.
                               aimd=AimdConfig(budget_ms=budget_ms, initial_cap=cap, min_cap=cap, target_fraction=1.0),
                               admission="gateway")
        point["gateway_config"] = {k: v for k, v in asdict(config).items() if k != "api_key"}
        profile = str(Path(args.profile_gateway) / f"gateway_{n}.prof") if args.profile_gateway else None
        gateway = ctx.Process(target=gateway_main, args=(config, str(paths["gateway.log"]), profile, gateway_cpus,
                                                         args.transport), name=f"gateway-{n}")
        gateway.start()
        # ---- generators (spawned while the gateway starts)
        k = max(1, min(args.generators, n))
        for g in range(k):
            parent, child = ctx.Pipe()
            spec = {"host": "127.0.0.1", "port": port, "indices": list(range(g, n, k)), "n_total": n,
                    "budget_ms": budget_ms, "cpus": load_cpus}
            proc = ctx.Process(target=generator_main, args=(child, spec), name=f"loadgen-{n}-{g}")
            proc.start()
            gens.append((proc, parent))
        deadline = time.monotonic() + 30
        while True:
            try:
                status, _ = http_get(f"http://127.0.0.1:{port}/health", timeout=1.0)
                if status == 200:
                    break
            except OSError:
                pass
            if not gateway.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not become healthy: {tail(paths['gateway.log'])}")
            time.sleep(0.1)
        for proc, conn in gens:
            if not conn.poll(30):
                raise RuntimeError(f"load generator {proc.name} did not start")
            conn.recv()
        # ---- the shared schedule
        t_start = time.monotonic() + 0.3
        m0 = t_start + ramp_s + warmup_s
        m1 = m0 + args.duration_s
        schedule = {"t_start": t_start, "ramp_s": ramp_s, "measure_start": m0, "measure_end": m1,
                    "stop_at": m1 + 0.25}
        for _, conn in gens:
            conn.send(schedule)
        pids = {"gateway": gateway.pid, "worker": worker.pid, **{f"gen{i}": p.pid for i, (p, _) in enumerate(gens)}}
        total = m1 - time.monotonic()
        with tqdm(total=round(total), desc=f"N={n}", unit="s", position=bar_position, leave=False,
                  bar_format="{desc}: {bar} {n_fmt}/{total_fmt} s {postfix}") as bar:
            def wait(until: float, phase: str) -> None:
                bar.set_postfix_str(phase)
                while time.monotonic() < until:
                    time.sleep(min(0.5, max(0.0, until - time.monotonic())))
                    done = min(bar.total, round(total - (m1 - time.monotonic())))
                    if done != bar.n:
                        bar.update(done - bar.n)
            wait(m0, "ramp + warm-up")
            sleep_until(m0)
            cpu0 = {k: proc_cpu_s(p) for k, p in pids.items()}
            box0, w0 = box_cpu(), time.monotonic()
            wait(m1, "measuring")
            sleep_until(m1)
            cpu1 = {k: proc_cpu_s(p) for k, p in pids.items()}
            box1, w1 = box_cpu(), time.monotonic()
        point["gateway_rss_mib"] = proc_rss_mib(gateway.pid)
        try:
            point["gateway_metrics"] = scrape_metrics(http_get(f"http://127.0.0.1:{port}/metrics")[1].decode())
        except OSError as exc:
            point["gateway_metrics"] = {"error": str(exc)}
        results = []
        for proc, conn in gens:
            results.append(conn.recv() if conn.poll(60) else {"fatal": "no result within 60 s"})
        wall = w1 - w0
        split = {k: (None if cpu0[k] is None or cpu1[k] is None else
                     [round(100 * (cpu1[k][i] - cpu0[k][i]) / wall, 1) for i in (0, 1)]) for k in pids}
        cpu = {k: None if v is None else round(v[0] + v[1], 1) for k, v in split.items()}
        point["cpu_user_sys_pct"] = split
        busy = (box1[0] - box0[0]) / max(1, box1[1] - box0[1])
        ncpu = len(os.sched_getaffinity(0))
        point["cpu_pct"] = {
            "gateway": cpu["gateway"], "worker": cpu["worker"],
            "generators": round(sum(v for k, v in cpu.items() if k.startswith("gen") and v is not None), 1),
            "box_busy_pct_of_all_cores": round(100 * busy, 1), "cores": ncpu,
        }
        known = sum(v for v in cpu.values() if v is not None)
        point["cpu_pct"]["other"] = round(100 * busy * ncpu - known, 1)
        point["measure_wall_s"] = round(wall, 3)
        completed = True
        point.update(summarize(n, budget_ms, results, paths["steps.jsonl"], m0, m1))
        m = point["msgs_per_s"]
        msgs = (m["in_ingested"] or m["in_offered"]) + m["out"]
        gen_msgs = m["in_offered"] + m["out"]
        point["cpu_us_per_msg"] = {
            "gateway": None if not cpu["gateway"] or not msgs else round(cpu["gateway"] * 1e4 / msgs, 1),
            "generators": None if not gen_msgs else round(point["cpu_pct"]["generators"] * 1e4 / gen_msgs, 1)}
    finally:
        for proc, conn in gens:
            if proc.is_alive():
                proc.join(5 if completed else 0)
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        if gateway is not None and gateway.is_alive():
            os.kill(gateway.pid, signal.SIGINT)
            gateway.join(20)
            if gateway.is_alive():
                gateway.kill()
                gateway.join(2)
        if worker is not None and worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait(2)
        point["gateway_log_tail"] = tail(paths["gateway.log"])
        point["worker_log_tail"] = tail(paths["worker.log"])
    return point


def summarize(n: int, budget_ms: float, results: list[dict], steps_path: Path, m0: float, m1: float) -> dict:
    fatal = [r["fatal"] for r in results if "fatal" in r]
    results = [r for r in results if "fatal" not in r]
    duration = m1 - m0
    out: dict[str, Any] = {"generator_fatal": fatal}
    agg = Counter()
    for key in ("connected", "created", "sessions_without_ticks", "tick_gaps", "sent_window", "sent_total",
                "recv_total", "skipped_late", "skipped_backpressure", "backpressured_sessions"):
        agg[key] = sum(r[key] for r in results)
    merged: dict[str, Counter] = {k: Counter() for k in ("connect_errors", "lost", "server_closes", "errors",
                                                          "types_in_window")}
    for r in results:
        for k in merged:
            merged[k].update(r[k])
    out.update(agg)
    out.update({k: dict(v) for k, v in merged.items()})
    # ---- ticks: the gateway's own view (one sample per tick), fan-out over sessions
    info: dict[int, tuple] = {}
    fan: dict[int, list[float]] = {}
    for r in results:
        info.update(r["tick_info"])
        for tick, (first, last, count) in r["fanout"].items():
            f = fan.setdefault(tick, [first, last, 0])
            f[0], f[1], f[2] = min(f[0], first), max(f[1], last), f[2] + count
    in_window = sorted(t for t, f in fan.items() if m0 <= f[0] < m1)
    out["ticks_in_window"] = len(in_window)
    out["ticks"] = [{"tick": t, "first_arrival_s": round(fan[t][0] - m0, 4),
                     "fanout_ms": round((fan[t][1] - fan[t][0]) * 1e3, 3), "sessions": fan[t][2],
                     "drift_ms": info[t][0], "latency_ms": info[t][1], "batch": info[t][2],
                     "deadline_met": info[t][3]} for t in in_window if t in info]
    ticks = out["ticks"]
    out["gateway_drift_ms"] = quantiles([t["drift_ms"] for t in ticks])
    out["tick_latency_ms"] = quantiles([t["latency_ms"] for t in ticks])
    out["fanout_ms"] = quantiles([t["fanout_ms"] for t in ticks])
    out["deadline_misses_in_window"] = sum(not t["deadline_met"] for t in ticks)
    firsts = [fan[t][0] for t in in_window]
    out["first_arrival_interval_err_ms"] = quantiles([((b - a) * 1e3 - budget_ms) for a, b in zip(firsts, firsts[1:])])
    errs = [e for r in results for e in r["interval_err_ms"]]
    out["client_interval_err_ms"] = quantiles(errs, qs=(0.1, 1, 50, 99, 99.9))
    out["client_cadence_abs_err_ms"] = quantiles([abs(e) for e in errs])
    out["generator_lateness_ms"] = quantiles([x for r in results for x in r["lateness_ms"]])
    out["session_created_ms"] = quantiles([x for r in results for x in r["created_ms"]])
    # ---- the worker's view: Step arrivals and how much audio the gateway really forwarded
    steps = []
    try:
        with open(steps_path) as f:
            steps = [json.loads(line) for line in f if line.strip()]
    except OSError:
        pass
    win = [s for s in steps if m0 <= s["t"] < m1]
    out["worker_steps_in_window"] = len(win)
    out["worker_steps"] = [{"t_s": round(s["t"] - m0, 4), "tick": s["tick"], "sessions": s["sessions"],
                            "audio_bytes": s["audio_bytes"]} for s in win]
    out["worker_step_interval_err_ms"] = quantiles(
        [((b["t"] - a["t"]) * 1e3 - budget_ms) for a, b in zip(win, win[1:])], qs=(1, 50, 99, 100))
    if len(win) >= 2:
        span = win[-1]["t"] - win[0]["t"]
        ingested = sum(s["audio_bytes"] for s in win[1:]) / CHUNK_BYTES / span
    else:
        ingested = None
    offered = agg["sent_window"] / duration
    out["msgs_per_s"] = {
        "in_offered": round(offered, 1),
        "in_ingested": None if ingested is None else round(ingested, 1),
        "ingest_ratio": None if not ingested or not offered else round(ingested / offered, 4),
        "out": round(sum(merged["types_in_window"].values()) / duration, 1),
        "nominal_in": round(n * 1000 / CHUNK_MS, 1),
    }
    # ---- verdict
    b = budget_ms
    drift99 = (out["gateway_drift_ms"] or {}).get("p99")
    cad99 = (out["client_cadence_abs_err_ms"] or {}).get("p99")
    lat99 = (out["generator_lateness_ms"] or {}).get("p99")
    problems = []
    if agg["created"] < n:
        problems.append(f"only {agg['created']}/{n} sessions admitted")
    if fatal:
        problems.append("a load generator failed")
    if out["errors"] or out["server_closes"] or out["lost"] or out["connect_errors"]:
        problems.append("errors/closes")
    if agg["sessions_without_ticks"]:
        problems.append(f"{agg['sessions_without_ticks']} sessions got no tick")
    ratio = out["msgs_per_s"]["ingest_ratio"]
    if ratio is None or ratio < 0.99:
        problems.append(f"ingested {ratio} of the offered audio")
    if drift99 is None or drift99 > TARGET_FRACTION * b:
        problems.append(f"gateway drift p99 {drift99} ms > {TARGET_FRACTION * b:g} ms")
    client_ok = cad99 is not None and cad99 <= TARGET_FRACTION * b
    out["client_verdict"] = "pass" if client_ok and not problems else "fail"
    generator_late = (lat99 is not None and lat99 > GEN_LATE_MS) or agg["skipped_late"] > 0
    out["generator_saturated"] = generator_late
    if not problems:
        out["verdict"] = "pass"
    elif generator_late:
        out["verdict"] = "inconclusive"
    else:
        out["verdict"] = "fail"
    out["problems"] = problems
    return out


# ============================================================================================ report
def fmt(q: dict | None, key: str, nd: int = 1) -> str:
    if not q or q.get(key) is None:
        return "–"
    return f"{q[key]:.{nd}f}"


def table(points: list[dict], budget_ms: float) -> str:
    head = ("| N | admitted | gw drift p50/p99 ms | client cadence p50/p99 ms | fan-out p99 ms | "
            "tick latency p50/p99 ms | msgs/s in offered/ingested | msgs/s out | gateway CPU | generator CPU | "
            "worker CPU | box busy (other) | gen lateness p99 ms | errors | verdict |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in points:
        if "error" in p:
            rows.append(f"| {p['sessions']} |" + " – |" * 12 + f" {p['error']} | error |")
            continue
        m, c = p["msgs_per_s"], p["cpu_pct"]
        ingested = "–" if m["in_ingested"] is None else f"{m['in_ingested']:.0f}"
        errs = sum(sum(p[k].values()) for k in ("errors", "server_closes", "lost", "connect_errors"))
        verdict = p["verdict"] + ("" if p["verdict"] == "pass" else f" ({'; '.join(p['problems'])})")
        drift, cadence, latency = p["gateway_drift_ms"], p["client_cadence_abs_err_ms"], p["tick_latency_ms"]
        rows.append(
            f"| {p['sessions']} | {p['created']} | {fmt(drift, 'p50')}/{fmt(drift, 'p99')} "
            f"| {fmt(cadence, 'p50')}/{fmt(cadence, 'p99')} "
            f"| {fmt(p['fanout_ms'], 'p99')} | {fmt(latency, 'p50')}/{fmt(latency, 'p99')} "
            f"| {m['in_offered']:.0f}/{ingested} "
            f"| {m['out']:.0f} | {c['gateway']}% ({p['cpu_us_per_msg']['gateway']} µs/msg) | {c['generators']}% "
            f"| {c['worker']}% "
            f"| {c['box_busy_pct_of_all_cores']}% ({c['other']}%) | {fmt(p['generator_lateness_ms'], 'p99')} "
            f"| {errs} | {verdict} |")
    return "\n".join(rows)


def machine_info() -> dict[str, Any]:
    import aiohttp
    import grpc

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=HERE).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, timeout=10, cwd=HERE).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    import picows
    import uvloop

    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(), "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
        "aiohttp": aiohttp.__version__, "picows": picows.__version__, "grpcio": grpc.__version__, "uvloop": uvloop.__version__,
        "msgspec": msgspec.__version__, "nofile_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[1],
        "git_commit": commit, "git_dirty": dirty, "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=type(
        "Formatter", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {}))
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: sessions {QUICK['sessions']}, {QUICK['duration_s']:g} s each (explicit flags win)")
    p.add_argument("--sessions", default=argparse.SUPPRESS,
                   help=f"comma-separated N to sweep; default {DEFAULT_SESSIONS}, quick {QUICK['sessions']}")
    p.add_argument("--duration-s", type=float, default=argparse.SUPPRESS,
                   help=f"measurement window per point, s; default 20, quick {QUICK['duration_s']:g}")
    p.add_argument("--budget-ms", type=float, default=1000.0, help="tick budget B")
    p.add_argument("--tokens-per-tick", type=int, default=1, help="sent in each Step")
    p.add_argument("--stream-interval-ms", type=float, default=100.0,
                   help="the gateway streams input to the worker this often; >= B: all at the tick")
    p.add_argument("--generators", type=int, default=1,
                   help="load generator processes (each a uvloop loop); more only helps with spare cores")
    p.add_argument("--ramp-s", type=float, default=argparse.SUPPRESS,
                   help="connect ramp, s; default max(2, N/250)")
    p.add_argument("--warmup-s", type=float, default=argparse.SUPPRESS,
                   help="after the ramp, before measuring, s; default max(3, 2B)")
    p.add_argument("--transport", choices=("picows", "aiohttp"), default="picows",
                   help="the gateway's WebSocket transport: picows (production, run_gateway) or aiohttp (Gateway.app, "
                        "for comparison)")
    p.add_argument("--pin", action="store_true",
                   help="pin the gateway to the first usable CPU and the generators + worker to the others, so the "
                        "gateway has a core of its own (a remote-client setup); off: all share all cores")
    p.add_argument("--out", default="results/gateway_bench.json", help="raw JSON results")
    p.add_argument("--profile-gateway", default=None, metavar="DIR",
                   help="run the gateway under cProfile, write DIR/gateway_N.prof(.txt) (distorts the numbers)")
    args = p.parse_args(argv)
    for key in ("sessions", "duration_s", "ramp_s", "warmup_s"):
        if not hasattr(args, key):
            setattr(args, key, None)
    if args.sessions is None:
        args.sessions = QUICK["sessions"] if args.quick else DEFAULT_SESSIONS
    if args.duration_s is None:
        args.duration_s = QUICK["duration_s"] if args.quick else 20.0
    args.session_list = [int(x) for x in args.sessions.split(",") if x.strip()]
    if not args.session_list or min(args.session_list) < 1:
        p.error("--sessions needs positive integers")
    if args.generators < 1 or args.duration_s <= 0 or args.budget_ms <= 0:
        p.error("--generators >= 1, --duration-s > 0, --budget-ms > 0")
    return args


def main(argv=None) -> int:
    from tqdm import tqdm

    args = parse_args(argv)

    def terminate(signum, frame):  # SIGTERM: unwind like Ctrl-C, so every point's finally stops its children
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    limit = raise_nofile()
    need = 2 * max(args.session_list) + 200
    if limit < need // max(1, args.generators):
        print(f"warning: open-file limit {limit} may be too low for {max(args.session_list)} sessions",
              file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.profile_gateway:
        Path(args.profile_gateway).mkdir(parents=True, exist_ok=True)
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        print("warning: --pin needs at least 2 usable CPUs; not pinning", file=sys.stderr)
    machine = machine_info()
    if machine["loadavg_start"][0] > 0.3 * machine["cpus_usable"]:
        print(f"warning: load average {machine['loadavg_start']} on {machine['cpus_usable']} CPUs: the machine is "
              "busy; cadence and CPU numbers will be pessimistic", file=sys.stderr)
    results: dict[str, Any] = {"benchmark": "gateway", "machine": machine,
                               "args": {k: v for k, v in vars(args).items() if k != "session_list"},
                               "target": {"drift_p99_ms_max": TARGET_FRACTION * args.budget_ms,
                                          "sessions": 1000}, "points": []}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gateway_bench_") as tmp:
        logdir = Path(tmp)
        for n in tqdm(args.session_list, desc="sweep", unit="point", position=0):
            try:
                point = run_point(n, args, logdir)
            except Exception as exc:  # noqa: BLE001 - one failed point must not lose the others
                point = {"sessions": n, "error": f"{type(exc).__name__}: {exc}"}
            results["points"].append(point)
            if "error" in point:
                tqdm.write(f"N={n}: error: {point['error']}")
            else:
                tqdm.write(f"N={n}: {point['verdict']}: admitted {point['created']}, gateway drift p99 "
                           f"{fmt(point['gateway_drift_ms'], 'p99')} ms, client cadence p99 "
                           f"{fmt(point['client_cadence_abs_err_ms'], 'p99')} ms, gateway CPU "
                           f"{point['cpu_pct']['gateway']}%, ingest {point['msgs_per_s']['ingest_ratio']}")
            results["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
            results["wall_s"] = round(time.monotonic() - started, 1)
            passing = [p["sessions"] for p in results["points"] if p.get("verdict") == "pass"]
            results["max_sessions_passing"] = max(passing) if passing else 0
            client = [p["sessions"] for p in results["points"] if p.get("client_verdict") == "pass"]
            results["max_sessions_client_cadence"] = max(client) if client else 0
            out.write_text(json.dumps(results, indent=1))
    b = args.budget_ms
    print(f"\nGateway benchmark: B = {b:g} ms, 20 ms chunks of 16 kHz PCM16, no-op worker, "
          f"{args.duration_s:g} s per point, {args.generators} generator process(es)"
          + (", gateway pinned to its own core" if args.pin else ", all processes share all cores")
          + f", {args.transport} transport")
    print(f"target: >= 1000 sessions with gateway tick drift p99 <= {TARGET_FRACTION * b:g} ms "
          f"({TARGET_FRACTION:.0%} of B), all audio ingested, no errors\n")
    print(table(results["points"], b))
    print("\nCPU in % of one core (µs/msg: gateway CPU time per message in + out); box busy in % of all cores "
          "(other: processes outside this benchmark).\nclient cadence = |tick inter-arrival - B| per session; "
          "msgs/s in: appends written by the generators / appends whose audio reached the worker.")
    best = results["max_sessions_passing"]
    verdict = "MET" if best >= 1000 else "NOT MET"
    print(f"\nlargest N passing: {best}  -> target {verdict} on this machine")
    print(f"largest N whose client-observed cadence p99 also stays <= {TARGET_FRACTION * b:g} ms "
          f"(includes the Step round trip): {results['max_sessions_client_cadence']}")
    m = results["machine"]
    print(f"machine: {m['platform']}, {m['cpus_usable']} CPUs, python {m['python']}, picows {m['picows']}, "
          f"aiohttp {m['aiohttp']}, "
          f"load avg {m['loadavg_start']} -> {m.get('loadavg_end')}; wall {results['wall_s']:.0f} s")
    print(f"raw results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
