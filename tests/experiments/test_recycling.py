"""Recycling vs SinkWindow: the application-level baseline over a real engine, the
age/recycle analysis on synthetic frames, and a few seconds through the real gateway."""

import asyncio
import json

import numpy as np
import pytest

from metronome.experiments.loadgen import LoadRun
from metronome.experiments.recycling import CPU, age_profile, analyse, analyse_point, recycle_frames, write_report
from metronome.experiments.recycling_engine import RecyclingEngine
from metronome.experiments.server import start
from metronome import Engine, EngineConfig, KVPolicy, StepInput


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_recycling_ends_the_context_and_reprefills_its_tail(chat_checkpoint):
    engine = Engine(EngineConfig(model=chat_checkpoint, policy=KVPolicy(window=None), num_blocks=64,
                                 max_chunk_tokens=16))
    clock = Clock()
    rec = RecyclingEngine(engine, period_s=1.0, tail_tokens=12, clock=clock)
    a, b = rec.open_session(), rec.open_session()
    first_engine_id = rec._contexts[a].engine_id
    for k in range(4):                                   # 4 ticks of 10 tokens + 3 decoded, before the period
        clock.t = 0.2 * k
        outs = rec.step([StepInput(a, token_ids=list(range(100 + k, 110 + k)), max_new_tokens=3),
                         StepInput(b, token_ids=[5, 6], max_new_tokens=1)])
        assert [o.session_id for o in outs] == [a, b] and all(o.ok for o in outs)
    assert rec.session_stats(a).num_tokens == 4 * 13 - 1    # the last decoded token is still pending
    assert rec.events == []
    tail = list(rec._contexts[a].tail)
    assert len(tail) == 12 and tail[-3:] == outs[0].token_ids

    clock.t = 1.05                                       # a passed its period (b too: both recycled, one batch)
    used_before = engine.stats().kv_blocks_used
    outs = rec.step([StepInput(a, token_ids=[7, 8], max_new_tokens=2)])
    assert outs[0].ok and outs[0].session_id == a and len(outs[0].token_ids) == 2
    assert rec._contexts[a].engine_id != first_engine_id
    assert len(rec.events) == 1 and rec.events[0]["session"] == a
    assert rec.events[0]["ended_tokens"] == 51 and rec.events[0]["tail_tokens"] == 12
    # The fresh context holds exactly the tail, then this tick's input and decode.
    assert rec.session_stats(a).num_tokens == 12 + 2 + 1
    assert engine.stats().kv_blocks_used < used_before
    assert rec.last_timing.prefill_ms >= rec.events[0]["ms"] > 0
    rec.close_session(a)
    rec.close_session(b)
    assert engine.stats().sessions == 0 and engine.stats().kv_blocks_used == 0


def test_age_profile_and_recycle_ticks():
    p = age_profile([0.1, 0.6, 1.2, 1.4, 3.1], [10.0, 30.0, 50.0, 70.0, 5.0], 1.0)
    assert p["start_s"] == [0.0, 1.0, 2.0, 3.0] and p["frames"] == [2, 2, 0, 1]
    assert p["p50_ms"][0] == 20.0 and np.isnan(p["p50_ms"][2]) and p["p99_ms"][3] == 5.0
    assert recycle_frames([0.9, 1.0, 1.2, 1.3], [1.0], 0.25).tolist() == [False, True, True, False]


def _synthetic_point(arm, t0=1000.0):
    """2 sessions, 4 ticks/s for 8 s; recycling: every 2 s a 100-ms tick (the re-prefill), else 20 ms."""
    sessions = []
    events = []
    for s in range(2):
        ticks = []
        for k in range(32):
            t = 0.25 * k + 0.1 + 0.05 * s
            slow = arm == "recycling" and k % 8 == 7
            ticks.append([t, k, 100.0 if slow else 20.0, True, 2, False, 3])
            if slow and s == 0:
                events.append({"t": t0 + t - 0.08, "session": 0, "ended_tokens": 80, "tail_tokens": 32,
                               "batch": 2, "ms": 70.0})
        sessions.append({"index": s, "arrival_s": 0.0, "connected_s": 0.05 * s, "refused": None, "errors": [],
                         "ticks": ticks, "chunks_sent": 400, "chunks_skipped": 0})
    kv = [{"t_s": 0.5 * i, "used": (4 + (i % 4) * 2 if arm == "recycling" else 6) * 2, "total": 100, "sessions": 2}
          for i in range(16)]
    return {"arm": arm, "run": 0, "sessions_n": 2, "spec": {"sessions": 2}, "load": {"duration_s": 8.0},
            "sessions": sessions, "kv": kv, "events": events if arm == "recycling" else [], "t0_monotonic": t0}


def test_analysis_separates_recycle_ticks_and_reports_memory(tmp_path):
    a = analyse_point(_synthetic_point("recycling"), budget_ms=250.0, bin_s=2.0)
    assert a["recycles"] == 4 and a["recycle_ms_mean"] == 70.0
    assert a["recycle_tick_p50_ms"] == 100.0 and a["other_tick_p50_ms"] == 20.0
    assert a["kv_blocks_per_session_max"] == 10.0
    s = analyse_point(_synthetic_point("sink_window"), 250.0, 2.0)
    assert s["recycles"] == 0 and s["recycle_tick_p50_ms"] is None and s["kv_blocks_per_session_steady"] == 6.0
    raw = {"preset": CPU.to_dict(), "machine": {}, "points": [_synthetic_point("recycling"),
                                                               _synthetic_point("sink_window")]}
    summary = write_report(raw, tmp_path)
    assert "| recycling | 2 | 1 |" in summary and "| sink_window | 2 | 1 |" in summary
    assert json.loads((tmp_path / "analysis.json").read_text())["table"][0]["recycles"] == 4
    assert analyse(raw)["table"][1]["arm"] == "sink_window"


async def test_recycling_smoke_through_the_gateway(chat_checkpoint, tmp_path):
    """~3 s: two sessions through a worker whose engine is wrapped; both contexts are recycled."""
    events = tmp_path / "events.jsonl"
    spec = dict(model=chat_checkpoint, device="cpu", dtype="float32", sinks=0, window=None, block_size=16,
                num_blocks=256, max_chunk_tokens=32, budget_ms=100.0, tokens_per_tick=2, sessions=2,
                recycle={"period_s": 1.0, "tail_tokens": 24, "events_path": str(events)})
    worker, server, gateway = await start(spec)
    try:
        assert isinstance(worker.service.engine, RecyclingEngine)
        load = LoadRun(gateway=gateway, worker=worker.address, sessions=2, rate=10.0, duration_s=2.6, sample_s=0.25)
        result = await asyncio.wait_for(load.run(), timeout=25)
    finally:
        await server.stop()
        await worker.stop(0)
    result["events"] = [json.loads(x) for x in events.read_text().splitlines()]
    point = {"arm": "recycling", "run": 0, "sessions_n": 2, "spec": spec, **result}
    a = analyse_point(point, budget_ms=100.0, bin_s=0.5)
    assert a["recycles"] >= 2 and len({e["session"] for e in result["events"]}) == 2   # both sessions
    assert all(e["tail_tokens"] == 24 for e in result["events"])
    assert a["frames"] > 20 and a["preempted_fraction"] == 0.0 and a["refused"] == 0
    assert a["recycle_tick_frames"] > 0
