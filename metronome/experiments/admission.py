"""The admission experiment, a ramp: offer far more sessions than fit, with the AIMD controller on.

Each arm is one fresh server (worker + gateway, ``server.py``) whose controller runs free: a small
``initial_cap``, ``min_cap = 1``, no static cap, target ``0.3·B`` and a KV pool whose memory capacity
(for SinkWindow) is well above the N* the latency allows, so the cap is set by latency alone. The load
generator offers ``offered`` sessions at an open-loop arrival rate (``loadgen.LoadRun``; a refused
client gets ``error{type: server_overloaded}`` and is recorded as refused) while a scraper polls the
gateway's ``/health`` (cap, live, memory capacity) and ``/metrics`` (admitted, rejected, deadline
misses) every ``scrape_s``.

Arms (``ARMS``): the robust controller on SinkWindow and on Unbounded, and the paper's single-sample
controller on SinkWindow, which starts with no cap as the paper's prototype did (``initial_cap``). Load
profiles (``arrival_times``): ``ramp`` (constant rate), ``step`` (a quarter of the rate for a third of the
run, then twice the rate), ``spike`` (a quarter of the rate, plus a burst of sessions arriving together at one
third of the run) and ``churn`` (the ramp's arrivals, but sessions leave after an exponential length of mean
``hold_s``: calls end, as the paper's never-ending sessions do not).

Analysis (pure, ``analyse_point``): N* is the median cap over the last quarter of the run; the
convergence time is the first scrape after which the cap stays within ``max(2, 15 %)`` of N*;
p50/p99 frame latency, deadline misses, preempted and empty frames of the admitted sessions are
measured from convergence on, or over the last quarter if that is longer (or the cap never settles).

    metronome bench admission --preset cpu      # ~5 min on 2 cores
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from metronome.experiments.cliff import frames, tick_breakdown


@dataclass(frozen=True)
class AdmissionPreset:
    name: str
    model: str
    device: str
    dtype: str
    budget_ms: float
    tokens_per_tick: int
    offered: int                 # sessions offered in the ramp
    arrival_rate: float          # open-loop arrivals per second
    duration_s: float            # from the first arrival
    num_blocks: int              # SinkWindow memory capacity ≈ num_blocks / blocks per session, far above N*
    block_size: int
    sinks: int
    window: int
    max_chunk_tokens: int
    max_position_embeddings: int
    target_fraction: float = 0.3
    initial_cap: int = 4
    scrape_s: float = 0.5
    sample_s: float = 0.5        # KV usage sampling (worker Health)
    tail_fraction: float = 0.25  # N* = median cap over this last part of the run
    audio: str = "speech"        # "speech" (espeak-ng) or "noise" (loadgen.make_audio)
    hold_s: float = 20.0         # churn profile: mean session length (exponential), so sessions leave

    def to_dict(self) -> dict:
        return asdict(self)


# B = 250 ms, target 75 ms. A tick of the tiny random model on this 2-core box costs ~40-60 ms at 8-16
# sessions and grows with N, so N* lands in the tens. 1024 blocks: SinkWindow (S=4, W=64: 8 blocks a
# session) holds ~128 sessions, far above N*; Unbounded (~7 tokens per session per tick) fills them in
# ~20-30 s at N ≈ 25, inside the run. 200 offered at 4/s: arrivals last 50 s of the 70-s run.
CPU = AdmissionPreset(name="cpu", model="tiny-random", device="cpu", dtype="float32", budget_ms=250.0,
                      tokens_per_tick=4, offered=200, arrival_rate=4.0, duration_s=70.0, num_blocks=1024,
                      block_size=16, sinks=4, window=64, max_chunk_tokens=32, max_position_embeddings=8192,
                      audio="noise")   # noise: as in the documented run (docs/experiments/admission-cpu)

# The paper's setting on one H200: 512 offered at 8/s, B = 2 s, target 0.3·B, S = 16, W = 1024, with a
# Qwen2.5-7B-shaped decoder of random weights (shapes.py). Its tick measured 447-568 ms at N = 256-320
# (docs/benchmarks/gpu.md, 26 + 25 tokens a session), so N* should land near 300. 40,000 blocks (37 GB)
# hold 571 SinkWindow sessions: latency, not memory, binds.
GPU = AdmissionPreset(name="gpu", model="random:qwen2.5-7b", device="cuda", dtype="bfloat16", budget_ms=2000.0,
                      tokens_per_tick=25, offered=512, arrival_rate=8.0, duration_s=180.0, num_blocks=40000,
                      block_size=16, sinks=16, window=1024, max_chunk_tokens=64, max_position_embeddings=32768,
                      scrape_s=0.5, sample_s=1.0, hold_s=60.0)   # churn: 8/s x 60 s = 480 offered concurrency
# About 15 minutes of an H200: 150-s runs (arrivals end at 64 s; a window fills 42 s after its session arrives).
GPU_SHORT = replace(GPU, name="gpu-short", duration_s=150.0)

PRESETS = {"cpu": CPU, "gpu": GPU, "gpu-short": GPU_SHORT}

# arm name -> (controller, KV policy)
ARMS = {"robust-sink_window": ("aimd", "sink_window"),
        "robust-unbounded": ("aimd", "unbounded"),
        "paper-sink_window": ("paper", "sink_window")}
PROFILES = ("ramp", "step", "spike", "churn")


def arrival_times(profile: str, offered: int, rate: float, duration_s: float | None = None) -> list[float]:
    """Open-loop arrival times (s), at most ``offered`` of them and (with ``duration_s``) all before its end.

    ramp: ``i / rate``, from the start. Sessions never leave, so any constant rate saturates; the two
    other profiles start *under* N* to show the controller meeting a change of load:
    step: ``rate / 4`` for the first third of the run, then ``2 · rate``.
    spike: ``rate / 4`` throughout, plus ``offered // 4`` sessions that all arrive at one third of the run.
    churn: ``i / rate`` like ramp, but the sessions also leave (``session_lengths``): the offered concurrency
    settles at ``rate * hold_s`` (Little's law), above N*, instead of growing without end.

    >>> arrival_times("ramp", 4, 2.0)
    [0.0, 0.5, 1.0, 1.5]
    >>> arrival_times("step", 8, 4.0, duration_s=6.0)
    [0.0, 1.0, 2.0, 2.125, 2.25, 2.375, 2.5, 2.625]
    >>> arrival_times("spike", 8, 4.0, duration_s=6.0)
    [0.0, 1.0, 2.0, 2.0, 2.0, 3.0, 4.0, 5.0]
    """
    end = float("inf") if duration_s is None else duration_s
    if profile in ("ramp", "churn"):
        times = [i / rate for i in range(offered)]
    elif profile == "step":
        t_step = (duration_s or 3.0 * offered / rate) / 3.0
        base = [i * 4.0 / rate for i in range(offered) if i * 4.0 / rate < t_step]
        times = base + [t_step + j / (2.0 * rate) for j in range(offered - len(base))]
    elif profile == "spike":
        t_spike = (duration_s or 3.0 * offered / rate) / 3.0
        burst = max(1, offered // 4)
        times = sorted([i * 4.0 / rate for i in range(offered - burst)] + [t_spike] * burst)
    else:
        raise ValueError(f"unknown profile {profile!r}; one of {PROFILES}")
    return [t for t in times if t < end][:offered]


def server_spec(preset: AdmissionPreset, model: str, arm: str, seed: int = 0) -> dict:
    controller, policy = ARMS[arm]
    sinks, window = (preset.sinks, preset.window) if policy == "sink_window" else (0, None)
    return dict(model=model, device=preset.device, dtype=preset.dtype, sinks=sinks, window=window,
                block_size=preset.block_size, num_blocks=preset.num_blocks, max_chunk_tokens=preset.max_chunk_tokens,
                budget_ms=preset.budget_ms, tokens_per_tick=preset.tokens_per_tick, sessions=preset.offered,
                seed=seed, admission=dict(controller=controller, initial_cap=initial_cap(preset, controller),
                                          min_cap=1, target_fraction=preset.target_fraction))


def initial_cap(preset: AdmissionPreset, controller: str) -> int | None:
    """The robust controller starts at ``preset.initial_cap`` and slow-starts from there; the paper's rule
    starts at the memory cap (None), as its prototype did: with ``+1`` a tick and no slow start, a small
    initial cap could not reach the paper's N* while its sessions arrive (64 s at 8/s, 32 ticks of 2 s)."""
    return None if controller == "paper" else preset.initial_cap


# ---------------------------------------------------------------------------------------- scraping
_METRIC = re.compile(r'^(metronome_[a-z_]+?)(?:_total)?(?:\{([^}]*)\})?\s+([-+0-9.eEinfa]+)$')


def parse_metrics(text: str) -> dict:
    """Sum of each counter/gauge we need from Prometheus text (labels summed over)."""
    want = {"metronome_sessions_admitted": "admitted", "metronome_sessions_rejected": "rejected",
            "metronome_deadline_misses": "deadline_misses", "metronome_ticks": "ticks"}
    out = {v: 0.0 for v in want.values()}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if m and m.group(1) in want and not line.startswith("#"):
            labels = m.group(2) or ""
            if m.group(1) == "metronome_sessions_rejected" and "server_overloaded" not in labels:
                continue
            out[want[m.group(1)]] += float(m.group(3))
    return out


class Scraper:
    """Polls the gateway every ``period`` s; ``samples`` holds one dict per poll (t on the load run's clock)."""

    def __init__(self, gateway: str, clock, period: float = 0.5) -> None:
        self.gateway, self.clock, self.period = gateway, clock, period
        self.samples: list[dict] = []

    async def run(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            k = 0
            while True:
                await asyncio.sleep(max(0.0, k * self.period - self.clock()))
                k += 1
                try:
                    async with http.get(f"http://{self.gateway}/health") as r:
                        health = await r.json()
                    async with http.get(f"http://{self.gateway}/metrics") as r:
                        counters = parse_metrics(await r.text())
                except Exception:                          # noqa: BLE001 - a missed scrape is a gap
                    continue
                w = health["workers"][0] if health.get("workers") else {}
                self.samples.append({"t_s": round(self.clock(), 3), "cap": w.get("cap"), "live": w.get("live"),
                                     "memory_capacity": w.get("memory_capacity"), **counters})


def session_lengths(profile: str, n: int, hold_s: float, seed: int = 0) -> list[float | None]:
    """How long each admitted session stays: exponential with mean ``hold_s`` for churn (seeded), else
    until the end of the run (None), as in the paper's ramp.

    >>> session_lengths("ramp", 2, 20.0)
    [None, None]
    >>> [round(x, 1) for x in session_lengths("churn", 3, 20.0, seed=1)]
    [2.9, 37.6, 28.9]
    """
    if profile != "churn":
        return [None] * n
    rng = random.Random(seed)
    return [rng.expovariate(1.0 / hold_s) for _ in range(n)]


async def run_point(gateway: str, worker: str, preset: AdmissionPreset, profile: str = "ramp",
                    duration_s: float | None = None, offered: int | None = None, seed: int = 0,
                    on_progress=None) -> dict:
    """One arm's load (open-loop arrivals + scraper) against a running server; returns sessions, kv, scrape."""
    from metronome.experiments.loadgen import LoadRun, SessionTrace

    offered = offered or preset.offered
    duration_s = duration_s or preset.duration_s
    load = LoadRun(gateway=gateway, worker=worker, sessions=offered, rate=preset.arrival_rate,
                   duration_s=duration_s, sample_s=preset.sample_s, seed=seed, audio=preset.audio)
    arrivals = arrival_times(profile, offered, preset.arrival_rate, duration_s)
    lengths = session_lengths(profile, len(arrivals), preset.hold_s, seed)
    load.traces = [SessionTrace(i, t, hold_s=h) for i, (t, h) in enumerate(zip(arrivals, lengths))]
    load.n = len(load.traces)
    scraper = Scraper(gateway, load.now, preset.scrape_s)
    if on_progress is not None:
        def progress(d):
            s = scraper.samples[-1] if scraper.samples else {}
            on_progress({**d, "cap": s.get("cap", "-"), "live": s.get("live", "-"),
                         "adm": int(s.get("admitted", 0)), "rej": int(s.get("rejected", 0))})
        load.on_progress = progress
    task = asyncio.ensure_future(scraper.run())
    try:
        result = await load.run()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return {**result, "scrape": scraper.samples, "profile": profile, "offered": len(load.traces),
            "arrivals": [tr.arrival_s for tr in load.traces]}


def run_admission(preset: AdmissionPreset, out_dir: Path, *, arms=None, profiles=("ramp",), duration_s=None,
                  offered=None, progress: bool = True) -> dict:
    """Every (profile, arm) on a fresh server; raw result written to ``out_dir/raw.json`` as it goes."""
    from tqdm import tqdm

    from metronome.experiments.sweep import Server, machine, prepare_model

    arms = tuple(arms or ARMS)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "logs").mkdir(exist_ok=True)
    raw = {"experiment": "admission", "preset": preset.to_dict(), "machine": machine(),
           "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
           "duration_s": duration_s or preset.duration_s, "points": []}
    plan = [(p, a) for p in profiles for a in arms]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="metronome-admission-") as tmp:
        model = prepare_model(preset.model, tmp, preset.max_position_embeddings)
        bar = tqdm(plan, desc=f"admission {preset.name}", unit="arm", disable=not progress, dynamic_ncols=True)
        for profile, arm in bar:
            bar.set_description(f"{profile} {arm}")
            spec = {**server_spec(preset, model["model"], arm), **model}
            t_point = time.monotonic()
            server = Server(spec, out_dir / "logs" / f"{profile}-{arm}.log")
            try:
                result = asyncio.run(run_point(
                    server.addresses["gateway"], server.addresses["worker"], preset, profile, duration_s, offered,
                    on_progress=(lambda d: bar.set_postfix(d, refresh=True)) if progress else None))
            finally:
                server.stop()
            raw["points"].append({"arm": arm, "controller": ARMS[arm][0], "policy": ARMS[arm][1], "spec": spec,
                                  "wall_clock_s": round(time.monotonic() - t_point, 2), **result})
            raw["elapsed_s"] = round(time.monotonic() - t0, 1)
            (out_dir / "raw.json").write_text(json.dumps(raw))
    raw["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    (out_dir / "raw.json").write_text(json.dumps(raw))
    return raw


# ---------------------------------------------------------------------------------------- analysis
def convergence(t, cap, tail_fraction: float = 0.25, t_end: float | None = None) -> dict:
    """N* (median cap over the last ``tail_fraction`` of the run) and when the cap settled near it.

    >>> t = list(range(20)); cap = [4, 6, 8, 10, 12, 14, 16, 18, 20, 19, 20, 20, 21, 20, 20, 19, 20, 20, 20, 20]
    >>> c = convergence(t, cap, 0.25, t_end=20)
    >>> c["n_star"], c["converged_s"]
    (20.0, 7.0)
    """
    t, cap = np.asarray(t, float), np.asarray(cap, float)
    if t.size == 0:
        return {"n_star": None, "converged_s": None, "band": None, "tail_start_s": None}
    t_end = float(t.max()) if t_end is None else float(t_end)
    tail_start = t_end * (1.0 - tail_fraction)
    tail = cap[t >= tail_start]
    if tail.size == 0:
        tail = cap[-1:]
    n_star = float(np.median(tail))
    band = max(2.0, 0.15 * n_star)
    inside = np.abs(cap - n_star) <= band
    conv = None
    for k in range(t.size):
        if inside[k:].all():
            conv = float(t[k])
            break
    return {"n_star": n_star, "converged_s": conv, "band": band, "tail_start_s": tail_start}


def analyse_point(point: dict, budget_ms: float, target_fraction: float, tail_fraction: float, t_end: float) -> dict:
    sc = [s for s in point["scrape"] if s.get("cap") is not None]
    t = [s["t_s"] for s in sc]
    cap = [s["cap"] for s in sc]
    conv = convergence(t, cap, tail_fraction, t_end)
    # Steady state: from convergence, and never less than the last quarter (a late blip of the cap
    # outside the band would otherwise leave a handful of frames).
    steady_from = conv["tail_start_s"]
    if conv["converged_s"] is not None and steady_from is not None:
        steady_from = min(conv["converged_s"], steady_from)
    sessions = point["sessions"]
    admitted = [s for s in sessions if s["connected_s"] is not None]
    overloaded = [s for s in sessions if s["refused"] == "server_overloaded"]
    f = frames({"sessions": admitted})
    sel = f["t"] >= (steady_from or 0.0)
    lat = f["latency_ms"][sel]
    n = max(1, int(sel.sum()))
    kv = point.get("kv") or []
    rho = [k["used"] / max(1, k["total"]) for k in kv]
    caps = np.asarray(cap, float)
    decreases = int((np.diff(caps) < 0).sum()) if caps.size > 1 else 0
    live = [s["live"] for s in sc]
    in_tail = np.asarray(t, float) >= (conv["tail_start_s"] or 0.0)
    tail_caps = caps[in_tail] if caps.size else caps
    # Sessions that never leave keep live above a cap that fell: then live, not N*, is the load the tail's
    # latency reflects.
    tail_live = np.asarray(live, float)[in_tail] if live else np.zeros(0)
    return {
        "arm": point["arm"], "controller": point.get("controller"), "policy": point.get("policy"),
        "profile": point.get("profile", "ramp"), "offered": len(sessions),
        "admitted": len(admitted), "rejected": len(overloaded),
        "other_failures": sum(1 for s in sessions if s["refused"] and s["refused"] != "server_overloaded"),
        "sessions_with_errors": sum(1 for s in admitted if s["errors"]),
        "n_star": conv["n_star"], "converged_s": conv["converged_s"], "steady_from_s": steady_from,
        "cap_max": int(caps.max()) if caps.size else None, "cap_final": int(caps[-1]) if caps.size else None,
        "cap_tail_std": float(tail_caps.std()) if tail_caps.size else None,
        "cap_decreases_seen": decreases, "live_max": max(live) if live else None,
        "live_final": live[-1] if live else None,
        "live_tail": float(np.median(tail_live)) if tail_live.size else None,
        "tick_breakdown": tick_breakdown(point, steady_from or 0.0),
        "memory_capacity": sc[-1]["memory_capacity"] if sc else None,
        "steady_frames": int(sel.sum()),
        "p50_ms": float(np.median(lat)) if lat.size else None,
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
        "target_ms": target_fraction * budget_ms, "budget_ms": budget_ms,
        "deadline_miss_fraction": float((~f["deadline_met"][sel]).sum() / n),
        "preempted_fraction": float(f["preempted"][sel].sum() / n),
        "empty_fraction": float(f["empty"][sel].sum() / n),
        "first_preempted_s": float(f["t"][f["preempted"]].min()) if f["preempted"].any() else None,
        "kv_max_fill": float(max(rho)) if rho else None,
        "deadline_misses_gateway": sc[-1]["deadline_misses"] if sc else None,
        "ticks_gateway": sc[-1]["ticks"] if sc else None,
    }


def analyse(raw: dict) -> dict:
    p = raw["preset"]
    rows = [analyse_point(pt, p["budget_ms"], p["target_fraction"], p["tail_fraction"], raw["duration_s"])
            for pt in raw["points"]]
    return {"experiment": "admission", "preset": p["name"], "points": rows}

