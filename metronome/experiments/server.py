"""One data point's server: a FRESH worker (engine + energy adapter) and a gateway, as two processes.

Started by the sweep as ``python -m metronome.experiments.server '<json>'``: the gateway runs in that
process and the worker in a child (``--worker``), each with its own interpreter, as ``metronome serve``
runs them (in one process the gateway's event loop and the engine thread would share one GIL). Prints one JSON line ``{"gateway": host:port,
"worker": host:port}`` when ready and serves until stdin closes. New processes per data point keep
every point clean (the paper: a reused worker contaminated sweeps).

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
import os
import subprocess
import sys


from metronome.config import AimdConfig, EngineConfig, GatewayConfig, KVPolicy
from metronome.engine.engine import Engine
from metronome.serving.gateway import serve_gateway
from metronome.serving.gc_pauses import freeze_startup_heap
from metronome.serving.worker import WorkerConfig, serve_worker


async def start_worker(spec: dict):
    """The worker (engine + energy adapter) in this process; returns the started ``WorkerServer``."""
    policy = KVPolicy(sinks=spec["sinks"], window=spec["window"], block_size=spec["block_size"])
    engine_cfg = EngineConfig(model=spec["model"], policy=policy, device=spec["device"], dtype=spec["dtype"],
                              num_blocks=spec["num_blocks"], max_chunk_tokens=spec["max_chunk_tokens"],
                              seed=spec.get("seed", 0))
    config = WorkerConfig(engine_cfg, adapter="energy", budget_ms=spec["budget_ms"], port=0)
    loop = asyncio.get_running_loop()
    if spec.get("random_weights"):   # a shape directory (shapes.py): the decoder is drawn, not loaded
        from metronome.experiments.shapes import random_engine

        engine = await loop.run_in_executor(None, random_engine, engine_cfg, spec["model"])
    else:
        engine = await loop.run_in_executor(None, Engine, engine_cfg)
    if spec.get("recycle"):   # the recycling experiment: application-level recycling over the same engine
        from metronome.experiments.recycling_engine import RecyclingEngine

        engine = RecyclingEngine(engine, **spec["recycle"])
    return await serve_worker(config, engine=engine)


async def start_gateway(spec: dict, worker_address: str):
    """The production gateway (picows) over one worker; returns the started server."""
    n = spec["sessions"]
    aimd = AimdConfig(initial_cap=n + 2, min_cap=n + 2, target_fraction=1.0)
    controller = "aimd"
    if spec.get("admission"):   # the admission experiment: the controller runs free (see admission.py)
        adm = dict(spec["admission"])
        controller = adm.pop("controller", "aimd")
        aimd = AimdConfig(**adm)
    gw_cfg = GatewayConfig(workers=(worker_address,), port=0, budget_ms=spec["budget_ms"],
                           tokens_per_tick=spec["tokens_per_tick"], max_buffered_audio_s=60.0,
                           # The paper's arrangement: this gateway's own controller decides (the one under test).
                           aimd=aimd, controller=controller, admission="gateway")
    return await serve_gateway(gw_cfg)


async def start(spec: dict):
    """Worker and gateway in THIS process (tests); returns (worker, gateway server, gateway host:port).
    The experiments run them as two processes (``main``), as ``metronome serve`` does."""
    worker = await start_worker(spec)
    server = await start_gateway(spec, worker.address)
    return worker, server, server.address


async def _until_stdin_closes() -> None:
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def worker_main(spec: dict) -> None:
    worker = await start_worker(spec)
    freeze_startup_heap()   # as `metronome worker` does
    try:
        print(json.dumps({"worker": worker.address}), flush=True)
        # Nobody reads this pipe after the handshake: anything printed later goes to the log (stderr), not
        # into a pipe that would fill and block the worker.
        os.dup2(2, 1)
        await _until_stdin_closes()
    finally:
        await worker.stop(0)


async def main(spec: dict) -> None:
    """The gateway here, the worker in a child process (its own interpreter and GIL, as in production)."""
    child = subprocess.Popen([sys.executable, "-m", "metronome.experiments.server", "--worker", json.dumps(spec)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.get_running_loop().run_in_executor(None, child.stdout.readline)
        if not line:
            raise RuntimeError(f"the worker process exited with {child.wait()} before it was ready")
        worker = json.loads(line)["worker"]
        server = await start_gateway(spec, worker)
        freeze_startup_heap()   # as `metronome gateway` does
        try:
            print(json.dumps({"gateway": server.address, "worker": worker}), flush=True)
            await _until_stdin_closes()   # the sweep closes stdin to stop us
        finally:
            await server.stop()
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=20)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("metronome.engine").setLevel(logging.WARNING)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    if sys.argv[1] == "--worker":
        asyncio.run(worker_main(json.loads(sys.argv[2])))
    else:
        asyncio.run(main(json.loads(sys.argv[1])))
