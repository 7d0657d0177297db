"""Window and sink ablation: steady-state analysis on synthetic points, and one short real point."""

import asyncio
from dataclasses import replace

import pytest

from metronome.experiments.ablation import CPU, analyse, kv_bytes_per_token, plan, reservation, steady_stats, write_report
from metronome.experiments.loadgen import LoadRun
from metronome.experiments.server import start


def _point(sinks, window, slow_ms, blocks, t_end=10.0):
    """4 sessions, 4 frames/s; latency 200 ms while warming (t < 5 s), then slow_ms; KV climbs to ``blocks``/session."""
    sessions = []
    for s in range(4):
        ticks = [[0.25 * k, k, 200.0 if 0.25 * k < 5 else slow_ms, True, 4, False, 3] for k in range(int(4 * t_end))]
        sessions.append({"ticks": ticks, "refused": None, "connected_s": 0.0})
    kv = [{"t_s": 0.5 * i, "used": min(4 * blocks, 4 * i), "total": 1000, "sessions": 4} for i in range(20)]
    return {"sinks": sinks, "window": window, "run": 0, "spec": {"sessions": 4}, "sessions": sessions, "kv": kv}


def test_steady_stats_ignore_the_warm_up():
    st = steady_stats(_point(4, 64, 30.0, 6), steady_from_s=5.0)
    assert st["p50_ms"] == 30.0 and st["p99_ms"] == 30.0 and st["frames"] == 4 * 20
    assert st["blocks_per_session"] == 6.0 and st["deadline_miss_fraction"] == 0.0
    assert steady_stats(_point(4, 64, 30.0, 6), steady_from_s=0.0)["p99_ms"] == 200.0


def test_grid_table_memory_and_report(tmp_path):
    p = replace(CPU, windows=(32, 256), sinks=(0, 16), steady_from_s=5.0)
    raw = {"preset": p.to_dict(), "machine": {}, "kv_bytes_per_token": 512,
           "points": [_point(0, 32, 20.0, 3), _point(16, 32, 22.0, 4), _point(0, 256, 25.0, 17), _point(16, 256, 27.0, 18)]}
    a = analyse(raw)
    rows = {(r["sinks"], r["window"]): r for r in a["table"]}
    assert [(r["window"], r["sinks"]) for r in a["table"]] == [(32, 0), (32, 16), (256, 0), (256, 16)]
    # The reservation is the engine's formula and grows with W and S; held memory stays under it.
    assert rows[(0, 32)]["reserved_blocks"] == reservation(0, 32, 16, 32, 8192)
    assert rows[(16, 256)]["reserved_blocks"] > rows[(0, 256)]["reserved_blocks"] > rows[(16, 32)]["reserved_blocks"]
    for r in a["table"]:
        assert r["blocks_per_session"] <= r["reserved_blocks"]
        assert r["steady_bytes"] == r["blocks_per_session"] * 16 * 512
    assert rows[(16, 256)]["p50_ms"] == 27.0
    summary = write_report(raw, tmp_path)
    assert "| 256 | 16 | 1 | 27.0 |" in summary and (tmp_path / "analysis.json").is_file()
    assert len(plan(p)) == 4 and {pt.meta["window"] for pt in plan(p)} == {32, 256}


def test_kv_bytes_per_token():
    assert kv_bytes_per_token("tiny-random", "float32") == 512
    assert kv_bytes_per_token("smollm2-135m", "bfloat16") == 2 * 30 * 3 * 64 * 2


async def test_ablation_smoke_point(chat_checkpoint):
    """~2.5 s of 3 sessions at S = 4, W = 32 through the real gateway: steady memory below the reservation."""
    spec = dict(model=chat_checkpoint, device="cpu", dtype="float32", sinks=4, window=32, block_size=16,
                num_blocks=128, max_chunk_tokens=32, budget_ms=100.0, tokens_per_tick=4, sessions=3)
    worker, server, gateway = await start(spec)
    try:
        load = LoadRun(gateway=gateway, worker=worker.address, sessions=3, rate=20.0, duration_s=2.5, sample_s=0.2)
        result = await asyncio.wait_for(load.run(), timeout=25)
    finally:
        await server.stop()
        await worker.stop(0)
    st = steady_stats({"spec": spec, **result}, steady_from_s=1.5)
    assert st["frames"] > 10 and st["p50_ms"] is not None and st["refused"] == 0
    res = reservation(4, 32, 16, 32, 2048)
    assert 0 < st["blocks_per_session_max"] <= res
