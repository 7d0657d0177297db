"""Smoke test: the load generator against a real gateway + worker (in this process) for a few seconds.

Unbounded arm with a tiny pool, so within ~4 s the pool runs dry and frames come back preempted:
the whole path the cliff experiment measures (ticks, deltas, KV samples, preemption) is exercised.
"""

import asyncio

from metronome.experiments.cliff import analyse_run
from metronome.monitor.fill import fit_fill
from metronome.experiments.loadgen import RATE, LoadRun
from metronome.experiments.server import start

N = 3


async def test_load_generator_streams_through_gateway_and_sees_the_pool_run_dry(chat_checkpoint):
    spec = dict(model=chat_checkpoint, device="cpu", dtype="float32", sinks=0, window=None, block_size=16,
                num_blocks=25, max_chunk_tokens=32, budget_ms=100.0, tokens_per_tick=4, sessions=N)
    worker, server, gateway = await start(spec)
    try:
        load = LoadRun(gateway=gateway, worker=worker.address, sessions=N, rate=10.0, duration_s=4.5, sample_s=0.25)
        result = await asyncio.wait_for(load.run(), timeout=25)
    finally:
        await server.stop()
        await worker.stop(0)

    sessions = result["sessions"]
    assert all(s["refused"] is None and s["connected_s"] is not None for s in sessions)
    assert all(s["input_rate"] == RATE for s in sessions)          # the server reads the audio at its real rate
    assert all(s["chunks_sent"] > 150 for s in sessions)          # ~50 chunks/s for ~4 s each
    assert all(len(s["ticks"]) > 15 and s["deltas"] > 5 for s in sessions)
    # the worker's engine and front-end times ride on every tick event, inside the tick's latency
    rows = [t for s in sessions for t in s["ticks"]]
    assert all(0 < t[7] <= t[2] and 0 <= t[8] <= t[2] for t in rows)
    # Phase-staggered, open-loop arrivals: session i connects at about i / rate.
    assert [round(s["arrival_s"], 2) for s in sessions] == [0.0, 0.1, 0.2]
    kv = result["kv"]
    assert len(kv) >= 12 and kv[0]["total"] == 24
    assert max(k["used"] for k in kv) >= 20                        # the unbounded pool filled up
    point = {"arm": "unbounded", "run": 0, "spec": spec, **result}
    a = analyse_run(point, bucket_s=0.5, wall_ms=50.0, quiet_fraction=0.5, t_end=4.5)
    assert a["frames"] == sum(len(s["ticks"]) for s in sessions)
    assert a["preempted_frames"] > 0 and a["first_preempted_s"] is not None
    assert 0 < a["engine_p50_ms"] <= a["latency_p50_ms"]
    fit = fit_fill([k["t_s"] for k in kv], [k["used"] / k["total"] for k in kv], sessions=N)
    assert fit is not None and fit["r_per_session"] > 0


def test_more_than_a_hundred_sessions_through_the_two_process_server(chat_checkpoint, tmp_path):
    """The sweep's server (gateway here, worker in its own process) carries 110 clients at once: every
    session connects on its schedule and gets ticks (aiohttp's default pool stopped the loadgen at 100)."""
    from metronome.experiments.sweep import Server

    n = 110
    spec = dict(model=chat_checkpoint, device="cpu", dtype="float32", sinks=4, window=32, block_size=16,
                num_blocks=1024, max_chunk_tokens=32, budget_ms=500.0, tokens_per_tick=1, sessions=n)
    server = Server(spec, tmp_path / "server.log")
    try:
        assert server.addresses["gateway"] != server.addresses["worker"]
        load = LoadRun(gateway=server.addresses["gateway"], worker=server.addresses["worker"], sessions=n,
                       rate=200.0, duration_s=3.0, sample_s=0.5)
        result = asyncio.run(asyncio.wait_for(load.run(), timeout=60))
    finally:
        server.stop()
    sessions = result["sessions"]
    assert all(s["refused"] is None and not s["errors"] for s in sessions)
    assert all(s["connected_s"] is not None and s["connected_s"] < s["arrival_s"] + 1.0 for s in sessions)
    assert all(len(s["ticks"]) >= 2 for s in sessions)
    assert max(t[4] for s in sessions for t in s["ticks"]) == n          # one tick carried every session
