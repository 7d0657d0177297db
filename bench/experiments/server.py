"""One data point's server: a FRESH worker (engine + energy adapter) and a gateway, in one process.

Started by the sweep as ``python -m bench.experiments.server '<json>'``; prints one JSON line
``{"gateway": host:port, "worker": host:port}`` when ready and serves until stdin closes. A new
process per data point keeps every point clean (the paper: a reused worker contaminated sweeps).

The Unbounded arm is admitted the way vLLM admits: the engine reports, for an unbounded policy, the
sessions whose first chunk fits as its memory cap, so the gateway admits all N and the pool is allowed
to run dry (that is the point).
With ``spec["random_weights"]`` the model directory holds only a config and a tokenizer (``shapes.py``)
and the decoder gets random weights on the device.
With ``spec["recycle"]`` the worker drives the engine through ``recycling.RecyclingEngine`` (experiment
4's application-level baseline: contexts ended every ``period_s`` and their tails re-prefilled).
The AIMD controller is pinned open (``initial_cap = min_cap = N``, ``target_fraction = 1``): the
cliff experiment measures a fixed N.
"""

from __future__ import annotations

import asyncio
import json
import sys


from metronome.config import AimdConfig, EngineConfig, GatewayConfig, KVPolicy
from metronome.engine.engine import Engine
from metronome.serving.gateway import serve_gateway
from metronome.serving.worker import WorkerConfig, serve_worker


async def start(spec: dict):
    """Start the worker and the gateway in this process; returns (worker, gateway server, gateway host:port)."""
    policy = KVPolicy(sinks=spec["sinks"], window=spec["window"], block_size=spec["block_size"])
    engine_cfg = EngineConfig(model=spec["model"], policy=policy, device=spec["device"], dtype=spec["dtype"],
                              num_blocks=spec["num_blocks"], max_chunk_tokens=spec["max_chunk_tokens"],
                              seed=spec.get("seed", 0))
    config = WorkerConfig(engine_cfg, adapter="energy", budget_ms=spec["budget_ms"], port=0)
    loop = asyncio.get_running_loop()
    if spec.get("random_weights"):   # a shape directory (shapes.py): the decoder is drawn, not loaded
        from bench.experiments.shapes import random_engine

        engine = await loop.run_in_executor(None, random_engine, engine_cfg, spec["model"])
    else:
        engine = await loop.run_in_executor(None, Engine, engine_cfg)
    if spec.get("recycle"):   # experiment 4: application-level recycling over the same engine
        from bench.experiments.recycling import RecyclingEngine

        engine = RecyclingEngine(engine, **spec["recycle"])
    worker = await serve_worker(config, engine=engine)
    n = spec["sessions"]
    aimd = AimdConfig(initial_cap=n + 2, min_cap=n + 2, target_fraction=1.0)
    controller = "aimd"
    if spec.get("admission"):   # the admission experiment: the controller runs free (see admission.py)
        adm = dict(spec["admission"])
        controller = adm.pop("controller", "aimd")
        aimd = AimdConfig(**adm)
    gw_cfg = GatewayConfig(workers=(worker.address,), port=0, budget_ms=spec["budget_ms"],
                           tokens_per_tick=spec["tokens_per_tick"], max_buffered_audio_s=60.0,
                           aimd=aimd, controller=controller)
    server = await serve_gateway(gw_cfg)   # the production transport (picows), as `metronome serve` runs it
    return worker, server, server.address


async def main(spec: dict) -> None:
    loop = asyncio.get_running_loop()
    worker, server, gateway = await start(spec)
    print(json.dumps({"gateway": gateway, "worker": worker.address}), flush=True)
    try:
        await loop.run_in_executor(None, sys.stdin.read)   # the sweep closes stdin to stop us
    finally:
        await server.stop()
        await worker.stop(0)


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("metronome.engine").setLevel(logging.WARNING)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(json.loads(sys.argv[1])))
